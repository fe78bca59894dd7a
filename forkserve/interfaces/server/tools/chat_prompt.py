"""A chat with tools, as the model's own template renders it.

Templates differ in what they can show: Hermes / Qwen2.5 / Llama 3.x templates render the
``tools`` list and assistant ``tool_calls`` themselves; others (SmolLM2-135M's ChatML) drop
both silently. ``TemplateCaps.probe`` renders a sentinel once per model to find out, and
``ChatPrompt`` fills in what the template cannot show in the format's own words (the tools in
the system turn, the calls as the assistant wrote them), so no history is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from forkserve.interfaces.server.errors import APIError
from forkserve.interfaces.server.tools.formats import ToolFormat

_PROBE = "fs_probe_tool_7f3a"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


@dataclass(frozen=True)
class TemplateCaps:
    renders_tools: bool
    renders_tool_calls: bool

    @classmethod
    def probe(
        cls, render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]
    ) -> "TemplateCaps":
        user = {"role": "user", "content": "hi"}
        call = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}
            ],
        }
        return cls(
            renders_tools=_renders(render, [user], [_PROBE_TOOL]),
            renders_tool_calls=_renders(render, [user, call], None),
        )


def _renders(
    render: Callable[..., str], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> bool:
    try:
        return _PROBE in render(messages, tools)
    except Exception:  # noqa: BLE001 - a template that raises on the probe cannot render it
        return False


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # handed to the template (None when it cannot render them)


def build_prompt(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    fmt: ToolFormat,
    caps: TemplateCaps,
) -> ChatPrompt:
    """``messages``: OpenAI chat messages as dicts (content already flattened to text);
    ``tools``: the tools the model may call now (None: none)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        m = {k: v for k, v in m.items() if v is not None}
        calls = m.pop("tool_calls", None)
        if calls:
            parsed = [
                (c["function"]["name"], _arguments(c["function"]["arguments"], i, j))
                for j, c in enumerate(calls)
            ]
            if caps.renders_tool_calls:
                m["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }
                    for c, (name, args) in zip(calls, parsed, strict=True)
                ]
                m.setdefault("content", "")
            else:
                text = m.get("content") or ""
                m["content"] = (text + "\n" if text else "") + fmt.render_calls(parsed)
        m.setdefault("content", "")
        out.append(m)
    if tools and not caps.renders_tools:
        prompt = fmt.system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return ChatPrompt(out, list(tools) if tools and caps.renders_tools else None)


def _arguments(text: str, i: int, j: int) -> dict[str, Any]:
    try:
        args = json.loads(text) if text else {}
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise APIError(
            400,
            f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object",
            param=f"messages.{i}.tool_calls.{j}.function.arguments",
        )
    return args
