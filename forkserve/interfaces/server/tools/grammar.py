"""The grammar of tool calls (``tool_choice`` required or named, or ``auto`` beside a schema).

The calls are the format's frame around one call, or several when ``parallel_tool_calls``;
each call is a JSON object naming one allowed tool with arguments valid for its schema.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from forkserve.interfaces.server.grammar.compiler import schema_ebnf
from forkserve.interfaces.server.tools.formats import ToolFormat

_EMPTY = {"type": "object", "properties": {}}


def call_schema(fmt: ToolFormat, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One call to any of ``tools`` (OpenAI ``{"type": "function", "function": {...}}``)."""
    options = []
    for tool in tools:
        fn = tool["function"]
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    fmt.arguments_key: fn.get("parameters") or _EMPTY,
                },
                "required": ["name", fmt.arguments_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def any_call_schema(fmt: ToolFormat) -> dict[str, Any]:
    """One call to some tool: a name and an object of arguments (the legality check's call,
    when the tools offered are not known)."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            fmt.arguments_key: {"type": "object", "additionalProperties": True},
        },
        "required": ["name", fmt.arguments_key],
        "additionalProperties": False,
    }


def calls_rule(fmt: ToolFormat, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
    """EBNF rules defining ``calls`` (and its ``call`` sub-rules)."""
    return frame_rule(fmt, call_schema(fmt, tools), parallel)


def frame_rule(
    fmt: ToolFormat, call: dict[str, Any], parallel: bool, any_whitespace: bool = False
) -> str:
    """EBNF rules defining ``calls``: the format's frame around calls matching ``call``."""
    more = f" ({json.dumps(fmt.separator)} call)*" if parallel else ""
    parts = [
        json.dumps(fmt.prefix) if fmt.prefix else "",
        "call" + more,
        json.dumps(fmt.suffix) if fmt.suffix else "",
    ]
    return (
        "calls ::= "
        + " ".join(p for p in parts if p)
        + "\n"
        + schema_ebnf(call, "call", "tools", any_whitespace)
    )
