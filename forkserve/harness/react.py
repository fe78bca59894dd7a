"""ReAct (Yao et al.): Thought -> Action -> Observation, lowered onto the verbs.

The framework's own format (``ReActFormat``) is used as is. Each turn the model
generates until the stop string that precedes an observation; the harness parses the
action, and the tool call becomes a ``ToolPause``: the observation wrapper is the known
p = 1 suffix, prefilled while the tool runs, then committed with the observation.
A resumed trajectory (model output given with the prompt) is committed as is and its
action runs first.
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
class ReActFormat:
    action: str = r"Action:\s*(\w+)\[([^\]]*)\]"
    final_answer: str = r"Final Answer:\s*(.*)"
    observation_prefix: str = "\nObservation: "
    observation_suffix: str = "\nThought:"
    stop: tuple[str, ...] = ("\nObservation:",)
    unknown_tool: str = "unknown tool {tool}; available: {tools}"


@dataclass(frozen=True)
class ReActResult:
    answer: str | None
    transcript: str                     # everything after the prompt, as the session holds it
    steps: list[ToolPauseResult] = field(default_factory=list)
    session_id: str = ""


class ReActAgent:
    def __init__(self, client: BranchClient, model: str, tools: Mapping[str, Callable[[str], str]], *,
                 fmt: ReActFormat = ReActFormat(), max_tokens: int = 128, expected_tool_ms: float | None = None,
                 guesses: Callable[[str, str], Sequence[Guess]] | None = None) -> None:
        """``guesses(tool, arg)``: optional guessed observations, e.g. a likely error."""
        self.client, self.model, self.tools, self.fmt = client, model, dict(tools), fmt
        self.max_tokens = max_tokens
        self.pause = ToolPause(client, expected_tool_ms=expected_tool_ms)
        self.guesses = guesses

    def run(self, prompt: str, *, resume: str | None = None, max_steps: int = 5) -> ReActResult:
        """``resume``: model output already produced for this prompt (a replayed trajectory
        that ends with an action); it is committed as is and its action runs first."""
        s = self.client.open(self.model, text=prompt)
        sid, tip = s.session_id, s.tip
        steps: list[ToolPauseResult] = []
        try:
            pending, tip = first_turn(self.client, sid, tip, resume=resume,
                                      max_tokens=self.max_tokens, stop=self.fmt.stop)
            transcript = pending
            while len(steps) < max_steps:
                action = _last_action(self.fmt.action, pending)
                if re.search(self.fmt.final_answer, pending) or action is None:
                    break
                step = self._act(sid, tip, pending, *action)
                steps.append(step)
                out = self.client.generate(sid, self.max_tokens, stop=self.fmt.stop)
                pending, tip = out.text, step.commit.tip
                transcript += step.committed_text + pending
        finally:
            self.client.close(sid)
        final = re.search(self.fmt.final_answer, pending)
        return ReActResult(final.group(1).strip() if final else None, transcript, steps, sid)

    def _act(self, sid: int, tip: int, generated: str, tool: str, arg: str) -> ToolPauseResult:
        fn = self.tools.get(tool)
        call = (lambda: fn(arg)) if fn is not None else \
            (lambda: self.fmt.unknown_tool.format(tool=tool, tools=", ".join(sorted(self.tools))))
        prefix = wrapper_remainder(generated, self.fmt.observation_prefix)
        guesses = tuple(self.guesses(tool, arg)) if self.guesses else ()
        return self.pause.run(sid, tip, call, prefix=prefix, suffix=self.fmt.observation_suffix,
                              guesses=tuple(Guess(prefix + g.text, g.priority) for g in guesses))


def _last_action(pattern: str, text: str) -> tuple[str, str] | None:
    matches = list(re.finditer(pattern, text))
    return (matches[-1].group(1), matches[-1].group(2).strip()) if matches else None
