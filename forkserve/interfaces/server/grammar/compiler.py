"""GrammarCompiler: the served tokenizer's xgrammar compiler, and the grammars the API asks for.

Built lazily (the tokenizer table takes a moment for a 49k vocabulary, and a server that is
never asked for structure never pays it); compiled grammars are cached by xgrammar, keyed
by their source, so an agent that sends the same tool list every turn compiles it once.
JSON is compact (no free whitespace): a small model given room for whitespace can spend its
whole budget on it.
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING, Any, Sequence

from forkserve.interfaces.server.errors import APIError

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarError(APIError):
    """A schema or grammar the engine cannot compile: the request's fault (400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(400, message, param=param)


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer, self._vocab, self._stops = hf_tokenizer, vocab_size, list(stop_token_ids)
        self._compiler: "xgr.GrammarCompiler | None" = None
        self._lock = threading.Lock()  # handlers compile on the event loop's thread pool

    def _get(self) -> "xgr.GrammarCompiler":
        import xgrammar as xgr  # heavy (it loads torch): only when a grammar is asked for

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab, stop_token_ids=self._stops
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def json_schema(self, schema: dict[str, Any], param: str) -> "xgr.CompiledGrammar":
        try:
            return self._get().compile_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True
            )
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{param}: the JSON schema cannot be enforced: {e}", param) from None

    def ebnf(self, grammar: str, param: str) -> "xgr.CompiledGrammar":
        try:
            return self._get().compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"{param}: the grammar cannot be compiled: {e}", param) from None


def schema_ebnf(
    schema: dict[str, Any], rule: str, param: str, any_whitespace: bool = False
) -> str:
    """The EBNF of a JSON schema (compact JSON unless ``any_whitespace``) with its root renamed
    ``rule`` and its other rules prefixed, so several schemas compose into one grammar."""
    import xgrammar as xgr

    try:
        text = str(
            xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=any_whitespace, strict_mode=True
            )
        )
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"{param}: the JSON schema cannot be enforced: {e}", param) from None
    names = set(re.findall(r"^(\w+) ::=", text, flags=re.M))
    # Scan as tokens: string literals and character classes pass unchanged, whole rule names
    # are renamed (a property called "root" stays a literal).
    pattern = re.compile(
        r'("(?:[^"\\]|\\.)*")|(\[(?:[^\]\\]|\\.)*\])|\b('
        + "|".join(sorted(names, key=len, reverse=True))
        + r")\b"
    )

    def rename(m: re.Match) -> str:
        if m.group(3) is None:
            return m.group(0)
        return rule if m.group(3) == "root" else f"{rule}_{m.group(3)}"

    return pattern.sub(rename, text)
