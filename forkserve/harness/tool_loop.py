"""The tool loop every tool-calling harness shares: generate a turn, parse its tool call,
run the call as a ``ToolPause``, commit the observation, repeat.

Frameworks differ only in their markup (how a call is written, what wraps an observation,
where generation stops, which call ends the loop); that is a ``ToolFormat``. The loop owns
the session: it closes it however the run ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from forkserve.harness.tool_pause import (
    Guess,
    ToolPause,
    ToolPauseResult,
    first_turn,
    wrapper_remainder,
)
from forkserve.interfaces.client import BranchClient, Session


@dataclass(frozen=True)
class ToolCall:
    tool: str
    arg: str


class ToolFormat(Protocol):
    """A framework's markup, as the loop needs it."""

    observation_prefix: str
    observation_suffix: str
    stop: tuple[str, ...]
    unknown_tool: str   # str.format template with {tool} and {tools} (the known names)

    def next_call(self, turn: str) -> ToolCall | None:
        """The call to run after ``turn``, or None when the turn ends the loop."""
        ...


@dataclass(frozen=True)
class ToolLoopRun:
    session_id: str
    transcript: str                     # everything after the prompt, as the session holds it
    last_turn: str                      # the model's last turn (the format reads the outcome here)
    steps: tuple[ToolPauseResult, ...]


# guesses(tool, arg): guessed observations of one call, e.g. a likely error
Guesser = Callable[[str, str], Sequence[Guess]]
# tool name -> the tool: its argument text in, its observation text out
Tools = Mapping[str, Callable[[str], str]]


class ToolLoop:
    def __init__(self, client: BranchClient, fmt: ToolFormat, tools: Tools, *, max_tokens: int,
                 expected_tool_ms: float | None, guesses: Guesser | None) -> None:
        self.client, self.fmt, self.tools = client, fmt, dict(tools)
        self.max_tokens, self.guesses = max_tokens, guesses
        self.pause = ToolPause(client, expected_tool_ms=expected_tool_ms)

    def run(self, session: Session, *, resume: str | None, max_steps: int) -> ToolLoopRun:
        """Run up to ``max_steps`` tool calls on ``session`` (open, closed on return).
        ``resume``: a turn already produced (a replayed trajectory ending with a call); it is
        committed as is and its call runs first."""
        sid = session.session_id
        steps: list[ToolPauseResult] = []
        try:
            turn, tip = first_turn(self.client, sid, session.tip, resume=resume,
                                   max_tokens=self.max_tokens, stop=self.fmt.stop)
            transcript = turn
            while len(steps) < max_steps and (call := self.fmt.next_call(turn)) is not None:
                step = self._act(sid, tip, turn, call)
                steps.append(step)
                out = self.client.generate(sid, self.max_tokens, stop=self.fmt.stop)
                turn, tip = out.text, step.commit.tip
                transcript += step.committed_text + turn
        finally:
            self.client.close(sid)
        return ToolLoopRun(sid, transcript, turn, tuple(steps))

    def _act(self, sid: str, tip: int, turn: str, call: ToolCall) -> ToolPauseResult:
        fn = self.tools.get(call.tool)
        if fn is not None:
            def run_tool() -> str:
                return fn(call.arg)
        else:  # the model sees the mistake as the observation and may correct itself
            known = ", ".join(sorted(self.tools))

            def run_tool() -> str:
                return self.fmt.unknown_tool.format(tool=call.tool, tools=known)
        # The model may have written the start of the wrapper itself before it stopped.
        prefix = wrapper_remainder(turn, self.fmt.observation_prefix)
        guesses = tuple(self.guesses(call.tool, call.arg)) if self.guesses else ()
        return self.pause.run(sid, tip, run_tool, prefix=prefix, suffix=self.fmt.observation_suffix,
                              guesses=tuple(Guess(prefix + g.text, g.priority) for g in guesses))
