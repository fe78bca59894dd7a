"""An OpenHands-style SWE loop: tool call -> pause -> observation, lowered onto the verbs.

The agent (a chat model) answers with a tool call in the framework's markup, e.g.
``<execute_bash>ls</execute_bash>``; the harness runs it in its sandbox. During that
pause the session holds a ``ToolPause`` (``ToolLoop``): the observation wrapper the
framework always writes (p = 1, pinned for the expected tool time) and guesses of the
outcome (a clean exit, a failure) that the cascade keeps or prunes. The observation is
committed as the framework formats it, then the agent continues from the committed spine.
A resumed trajectory (the agent's turn given with the messages) is committed as is; its
tool runs first.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from forkserve.harness.tool_loop import ToolCall, ToolLoop, Tools
from forkserve.harness.tool_pause import Guess, ToolPauseResult
from forkserve.interfaces.client import BranchClient


@dataclass(frozen=True)
class SweFormat:
    tool_call: str = r"<(execute_bash|read_file|finish)>(.*?)</\1>"
    observation_prefix: str = "\n<observation>\n"
    observation_suffix: str = "\n</observation>\n"
    stop: tuple[str, ...] = ("</execute_bash>", "</read_file>", "</finish>")
    finish_tool: str = "finish"
    unknown_tool: str = "error: no tool named {tool!r}"

    def last_call(self, turn: str) -> ToolCall | None:
        matches = list(re.finditer(self.tool_call, turn, flags=re.DOTALL))
        return ToolCall(matches[-1].group(1), matches[-1].group(2)) if matches else None

    def next_call(self, turn: str) -> ToolCall | None:
        """The turn's last tool call, unless it is the finish call."""
        call = self.last_call(turn)
        return None if call is None or call.tool == self.finish_tool else call


@dataclass(frozen=True)
class SweResult:
    finished: bool
    final_message: str | None
    transcript: str
    steps: tuple[ToolPauseResult, ...] = ()
    session_id: str = ""


# A shell command's two usual outcomes.
DEFAULT_GUESSES = (Guess("exit code 0", 0.4), Guess("Traceback (most recent call last):", 0.2))


class SweAgent:
    def __init__(self, client: BranchClient, model: str, tools: Tools, *,
                 fmt: SweFormat = SweFormat(), max_tokens: int = 128,
                 expected_tool_ms: float = 1000.0,
                 guesses: Sequence[Guess] = DEFAULT_GUESSES) -> None:
        """``guesses``: outcomes guessed for every tool call."""
        self.client, self.model, self.fmt = client, model, fmt
        fixed = tuple(guesses)
        self.loop = ToolLoop(client, fmt, tools, max_tokens=max_tokens,
                             expected_tool_ms=expected_tool_ms, guesses=lambda tool, arg: fixed)

    def run(self, messages: Sequence[Mapping[str, str]], *, resume: str | None = None,
            max_steps: int = 8) -> SweResult:
        """``resume``: the agent's turn already produced (a replayed trajectory ending with a
        tool call); it is committed as is and its tool runs first."""
        session = self.client.open(self.model, messages=messages)
        run = self.loop.run(session, resume=resume, max_steps=max_steps)
        call = self.fmt.last_call(run.last_turn)
        finished = call is not None and call.tool == self.fmt.finish_tool
        message = call.arg.strip() if finished else None
        return SweResult(finished, message, run.transcript, run.steps, run.session_id)
