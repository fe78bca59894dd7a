"""Tool-call formats: how a model writes calls, how they parse, and the grammar that forces one.

One small strategy per family, chosen from the model's chat template (``choose_format``):

* ``HermesFormat`` (Hermes, Qwen2.5):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  per call; the template renders the tools itself.
* ``Llama3JsonFormat`` (Llama 3.1-3.3): the reply is ``{"name": ..., "parameters": {...}}``,
  several separated by ``; ``.
* ``SmolLM2Format`` (SmolLM2, and any template that cannot render tools): the function-calling
  prompt of SmolLM2-Instruct's model card, answered with ``<tool_call>[{...}, ...]</tool_call>``.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, ClassVar, Sequence


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(new_call_id(), obj["name"], args if isinstance(args, str) else json.dumps(args))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolFormat(ABC):
    """A family's tool-call syntax. ``prefix`` / ``separator`` / ``suffix`` frame the calls of
    one reply (the grammar of a required call); ``start`` is where calls begin in free text."""

    name: ClassVar[str]
    arguments_key: ClassVar[str] = "arguments"
    start: ClassVar[str]
    prefix: ClassVar[str]
    separator: ClassVar[str]
    suffix: ClassVar[str]

    def call_object(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, self.arguments_key: arguments}

    def render_calls(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
        """An assistant turn's calls as the model writes them (for templates that cannot)."""
        body = self.separator.join(json.dumps(self.call_object(n, a)) for n, a in calls)
        return self.prefix + body + self.suffix

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The tools, for a template that cannot render them (SmolLM2-Instruct's wording)."""
        listing = json.dumps([t["function"] for t in tools])
        example = self.render_calls(
            [("func_name1", {"argument1": "value1", "argument2": "value2"})]
        )
        return (
            "You are an expert in composing functions. You are given a question and a set of "
            "possible functions. Based on the question, you will need to make one or more "
            "function/tool calls to achieve the purpose. If none of the functions can be used, "
            "answer in plain text.\n\n"
            f"You have access to the following tools:\n<tools>{listing}</tools>\n\n"
            f"To call tools, answer in this format and nothing else:\n{example}"
        )

    def find_start(self, text: str) -> int:
        """Where the calls begin in ``text`` (-1: no call so far)."""
        return text.find(self.start)

    def hold(self, text: str) -> int:
        """How many trailing characters of ``text`` may still turn into the start of a call
        (a streamed reply holds them back until it knows)."""
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if text.endswith(self.start[:k]):
                return k
        return 0

    def parse(self, text: str) -> ParsedReply:
        at = self.find_start(text)
        if at < 0:
            return ParsedReply(text, ())
        calls = self._parse_calls(text[at:])
        if not calls:  # not a well-formed call: the text stays the answer
            return ParsedReply(text, ())
        content = text[:at].strip()
        return ParsedReply(content or None, tuple(calls))

    def calls_in(self, text: str) -> list[ToolCall]:
        """Every well-formed call anywhere in ``text`` (a history of several turns, the system
        prompt's example included); a malformed call is skipped, not fatal to the others."""
        bounds = [m.start() for m in re.finditer(re.escape(self.start), text)] + [len(text)]
        calls: list[ToolCall] = []
        for at, end in pairwise(bounds):  # each call's text ends where the next one starts
            calls += self._parse_calls(text[at:end])
        return calls

    @abstractmethod
    def _parse_calls(self, text: str) -> list[ToolCall]:
        """The calls of ``text`` (which starts where the calls start); [] if malformed."""


# One call between <tool_call> tags (the last one may be cut off by max_tokens).
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


class HermesFormat(ToolFormat):
    name = "hermes"
    start = "<tool_call>"
    prefix = "<tool_call>\n"
    separator = "\n</tool_call>\n<tool_call>\n"
    suffix = "\n</tool_call>"

    def _parse_calls(self, text: str) -> list[ToolCall]:
        calls = [_call(_loads(body), self.arguments_key) for body in _TOOL_CALL_BLOCK.findall(text)]
        return [] if not calls or None in calls else calls


class SmolLM2Format(ToolFormat):
    name = "smollm2"
    start = "<tool_call>"
    prefix = "<tool_call>["
    separator = ", "
    suffix = "]</tool_call>"

    def _parse_calls(self, text: str) -> list[ToolCall]:
        calls: list[ToolCall | None] = []
        for body in _TOOL_CALL_BLOCK.findall(text):
            items = _loads(body)
            items = items if isinstance(items, list) else [items]
            calls += [_call(item, self.arguments_key) for item in items]
        return [] if not calls or None in calls else calls


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    start = "{"
    prefix = ""
    separator = "; "
    suffix = ""

    def find_start(self, text: str) -> int:
        # Only a reply that *is* JSON calls a tool; a brace inside prose does not.
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1

    def hold(self, text: str) -> int:
        return len(text) if not text.strip() else 0

    def calls_in(self, text: str) -> list[ToolCall]:
        # Its start is any brace: read whole JSON objects, so a nested one is never a call.
        decoder, calls, i = json.JSONDecoder(), [], text.find("{")
        while i >= 0:
            try:
                obj, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                i = text.find("{", i + 1)
                continue
            call = _call(obj, self.arguments_key)
            calls += [call] if call is not None else []
            i = text.find("{", end)
        return calls

    def _parse_calls(self, text: str) -> list[ToolCall]:
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(text):
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return []
            calls.append(_call(obj, self.arguments_key))
            rest = text[i:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return []
            i = len(text) - len(rest) + 1
            while i < len(text) and text[i].isspace():
                i += 1
        return [] if not calls or None in calls else calls


def choose_format(chat_template: str) -> ToolFormat:
    """The model's family by its template's own markup."""
    if "<tool_call>" in chat_template:
        return HermesFormat()
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return Llama3JsonFormat()
    return SmolLM2Format()
