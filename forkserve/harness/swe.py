"""An OpenHands-style SWE loop: tool call -> pause -> observation, lowered onto the verbs.

The agent (a chat model) answers with a tool call in the framework's markup, e.g.
``<execute_bash>ls</execute_bash>``; the harness runs it in its sandbox. During that
pause the session holds a ``ToolPause``: the observation wrapper the framework always
writes (p = 1, pinned for the expected tool time) and guesses of the outcome (a clean
exit, a failure) that the cascade keeps or prunes. The observation is committed as the
framework formats it, then the agent continues from the committed spine. A resumed
trajectory (the agent's turn given with the messages) is committed as is; its tool runs first.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from forkserve.harness.tool_pause import (
    Guess,
    ToolPause,
    ToolPauseResult,
    first_turn,
    wrapper_remainder,
)
from forkserve.interfaces.client import BranchClient


@dataclass(frozen=True)
class SweFormat:
    tool_call: str = r"<(execute_bash|read_file|finish)>(.*?)</\1>"
    observation_prefix: str = "\n<observation>\n"
    observation_suffix: str = "\n</observation>\n"
    stop: tuple[str, ...] = ("</execute_bash>", "</read_file>", "</finish>")
    finish_tool: str = "finish"


@dataclass(frozen=True)
class SweResult:
    finished: bool
    final_message: str | None
    transcript: str
    steps: list[ToolPauseResult] = field(default_factory=list)
    session_id: str = ""


class SweAgent:
    def __init__(self, client: BranchClient, model: str, tools: Mapping[str, Callable[[str], str]], *,
                 fmt: SweFormat = SweFormat(), max_tokens: int = 128, expected_tool_ms: float = 1000.0,
                 guesses: Sequence[Guess] = (Guess("exit code 0", 0.4),
                                             Guess("Traceback (most recent call last):", 0.2))) -> None:
        self.client, self.model, self.tools, self.fmt = client, model, dict(tools), fmt
        self.max_tokens, self.guesses = max_tokens, tuple(guesses)
        self.pause = ToolPause(client, expected_tool_ms=expected_tool_ms)

    def run(self, messages: Sequence[Mapping[str, str]], *, resume: str | None = None,
            max_steps: int = 8) -> SweResult:
        """``resume``: the agent's turn already produced (a replayed trajectory ending with a
        tool call); it is committed as is and its tool runs first."""
        s = self.client.open(self.model, messages=messages)
        sid, tip = s.session_id, s.tip
        steps: list[ToolPauseResult] = []
        try:
            pending, tip = first_turn(self.client, sid, tip, resume=resume,
                                      max_tokens=self.max_tokens, stop=self.fmt.stop)
            transcript = pending
            while len(steps) < max_steps:
                call = _last_call(self.fmt.tool_call, pending)
                if call is None or call[0] == self.fmt.finish_tool:
                    break
                step = self._act(sid, tip, pending, *call)
                steps.append(step)
                out = self.client.generate(sid, self.max_tokens, stop=self.fmt.stop)
                pending, tip = out.text, step.commit.tip
                transcript += step.committed_text + pending
        finally:
            self.client.close(sid)
        call = _last_call(self.fmt.tool_call, pending)
        finished = call is not None and call[0] == self.fmt.finish_tool
        return SweResult(finished, call[1].strip() if finished else None, transcript, steps, sid)

    def _act(self, sid: int, tip: int, generated: str, tool: str, arg: str) -> ToolPauseResult:
        fn = self.tools.get(tool)
        call = (lambda: fn(arg)) if fn is not None else (lambda: f"error: no tool named {tool!r}")
        prefix = wrapper_remainder(generated, self.fmt.observation_prefix)
        guesses = tuple(Guess(prefix + g.text, g.priority) for g in self.guesses)
        return self.pause.run(sid, tip, call, prefix=prefix, suffix=self.fmt.observation_suffix, guesses=guesses)


def _last_call(pattern: str, text: str) -> tuple[str, str] | None:
    matches = list(re.finditer(pattern, text, flags=re.DOTALL))
    return (matches[-1].group(1), matches[-1].group(2)) if matches else None
