"""ToolCallReader: the branch cascade's call reader (``control.call_loop.CallReader``).

The call-aware loop scorer of the control plane asks it which tool calls a token sequence
holds (a residual, or the path's recent history); it answers with the model's own tool
format (``formats.py``), each call's arguments as canonical JSON so that key order and
whitespace never make two equal calls differ. Made with the served model; stateless.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from forkserve.control.call_loop import Call
from forkserve.interfaces.server.tools.formats import ToolFormat


def canonical_arguments(arguments: str) -> str:
    """Sorted keys, no whitespace; text that is not JSON stays as written."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except json.JSONDecodeError:
        return arguments


class ToolCallReader:
    def __init__(self, fmt: ToolFormat, decode: Callable[[Sequence[int]], str]) -> None:
        self._fmt, self._decode = fmt, decode

    def __call__(self, tokens: Sequence[int]) -> tuple[Call, ...]:
        calls = self._fmt.calls_in(self._decode(tokens))
        return tuple(Call(c.name, canonical_arguments(c.arguments)) for c in calls)
