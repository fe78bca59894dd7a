"""CallLegality: the branch cascade's exact tool-call check (``control.scorers.CallChecker``).

The legality scorer of the control plane asks it about a residual's tokens; it answers with
the server's own grammar machinery: from where the model's tool format starts a call, the
text must be calls the format's grammar accepts (its frame; each call a JSON object with a
string ``name`` and an object of arguments; JSON whitespace free). Text after the calls
ended (a guessed observation) is not its business, and a residual with no call is legal.
Made with the served model; the grammar is compiled on first use and kept.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Sequence

from forkserve.interfaces.server.grammar import GrammarCompiler
from forkserve.interfaces.server.tools.formats import ToolFormat
from forkserve.interfaces.server.tools.grammar import any_call_schema, frame_rule

if TYPE_CHECKING:
    import xgrammar as xgr


class CallLegality:
    def __init__(
        self, fmt: ToolFormat, grammars: GrammarCompiler, decode: Callable[[Sequence[int]], str]
    ) -> None:
        self._fmt, self._grammars, self._decode = fmt, grammars, decode
        self._compiled: "xgr.CompiledGrammar | None" = None
        self._lock = threading.Lock()

    def _grammar(self) -> "xgr.CompiledGrammar":
        with self._lock:
            if self._compiled is None:
                rule = frame_rule(self._fmt, any_call_schema(self._fmt), True, any_whitespace=True)
                self._compiled = self._grammars.ebnf("root ::= calls\n" + rule, "tools")
            return self._compiled

    def __call__(self, tokens: Sequence[int]) -> str | None:
        import xgrammar as xgr

        text = self._decode(tokens)
        at = self._fmt.find_start(text)
        if at < 0:
            return None
        matcher = xgr.GrammarMatcher(self._grammar())
        ended = False  # the calls were complete at some point: what follows is other text
        for i, ch in enumerate(text[at:]):
            if not matcher.accept_string(ch):
                if ended:
                    return None
                return f"not a {self._fmt.name} tool call at {text[at + i:at + i + 16]!r}"
            ended = ended or matcher.is_completed()
        return None if ended else f"unterminated {self._fmt.name} tool call"
