"""ChatPlan: what a chat request asks of tools and structure, decided before anything runs.

* the tools the prompt shows (all of them, whatever ``tool_choice`` says),
* whether the reply is parsed for calls (not for ``tool_choice: none``),
* the grammar every token must keep to: a call to one of the tools (``required``), to the
  named tool, the ``response_format`` schema, or either a call or the schema (``auto`` with
  a schema: an agent that may still call tools before its structured answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forkserve.interfaces.server.grammar import GrammarCompiler
from forkserve.interfaces.server.grammar.compiler import schema_ebnf
from forkserve.interfaces.server.schemas import ChatCompletionRequest, NamedToolChoice
from forkserve.interfaces.server.tools.chat_prompt import ChatPrompt, TemplateCaps, build_prompt
from forkserve.interfaces.server.tools.formats import ToolFormat
from forkserve.interfaces.server.tools.grammar import calls_rule

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass(frozen=True)
class GrammarSource:
    """A JSON schema (compiled directly, cached by xgrammar) or a composed EBNF grammar."""

    schema: dict[str, Any] | None = None
    ebnf: str | None = None

    def compile(self, compiler: GrammarCompiler) -> "xgr.CompiledGrammar":
        if self.schema is not None:
            return compiler.json_schema(self.schema, "response_format")
        return compiler.ebnf(self.ebnf, "tools")


@dataclass(frozen=True)
class ChatPlan:
    prompt: ChatPrompt
    fmt: ToolFormat | None  # the reply is parsed for calls in this format
    grammar: GrammarSource | None


def plan_chat(body: ChatCompletionRequest, fmt: ToolFormat, caps: TemplateCaps) -> ChatPlan:
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice or ("auto" if tools else "none")
    offered = tools if choice != "none" else []
    answer = body.response_format.answer_schema() if body.response_format else None
    # ``none`` still shows the tools (as vLLM does): the prompt stays the prefix of the
    # conversation's other turns, so their KV is shared; the reply is just not parsed.
    prompt = build_prompt(body.template_messages(), tools or None, fmt, caps)
    if not offered:
        return ChatPlan(prompt, None, GrammarSource(schema=answer) if answer is not None else None)
    if isinstance(choice, NamedToolChoice):
        forced = [t for t in offered if t["function"]["name"] == choice.function.name]
    else:
        forced = offered if choice == "required" else []
    if forced:
        # A turn that must call a tool has no text answer for response_format to shape (as in
        # the OpenAI API: the format applies to the text reply of a later turn).
        ebnf = "root ::= calls\n" + calls_rule(fmt, forced, body.parallel_tool_calls)
        return ChatPlan(prompt, fmt, GrammarSource(ebnf=ebnf))
    if answer is None:
        return ChatPlan(prompt, fmt, None)  # auto: the model may call a tool or answer freely
    ebnf = (
        "root ::= calls | answer\n"
        + calls_rule(fmt, offered, body.parallel_tool_calls)
        + schema_ebnf(answer, "answer", "response_format")
    )
    return ChatPlan(prompt, fmt, GrammarSource(ebnf=ebnf))
