"""ReAct (Yao et al.): Thought -> Action -> Observation, lowered onto the verbs.

The framework's own format (``ReActFormat``) is used as is. Each turn the model
generates until the stop string that precedes an observation; the harness parses the
action, and the tool call becomes a ``ToolPause`` (``ToolLoop``): the observation wrapper
is the known p = 1 suffix, prefilled while the tool runs, then committed with the
observation. A resumed trajectory (model output given with the prompt) is committed as is
and its action runs first.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from forkserve.harness.tool_loop import Guesser, ToolCall, ToolLoop, Tools
from forkserve.harness.tool_pause import ToolPauseResult
from forkserve.interfaces.client import BranchClient


@dataclass(frozen=True)
class ReActFormat:
    action: str = r"Action:\s*(\w+)\[([^\]]*)\]"
    final_answer: str = r"Final Answer:\s*(.*)"
    observation_prefix: str = "\nObservation: "
    observation_suffix: str = "\nThought:"
    stop: tuple[str, ...] = ("\nObservation:",)
    unknown_tool: str = "unknown tool {tool}; available: {tools}"

    def next_call(self, turn: str) -> ToolCall | None:
        """The turn's last action, unless the turn gives the final answer."""
        if re.search(self.final_answer, turn):
            return None
        matches = list(re.finditer(self.action, turn))
        return ToolCall(matches[-1].group(1), matches[-1].group(2).strip()) if matches else None

    def answer(self, turn: str) -> str | None:
        final = re.search(self.final_answer, turn)
        return final.group(1).strip() if final else None


@dataclass(frozen=True)
class ReActResult:
    answer: str | None
    transcript: str                     # everything after the prompt, as the session holds it
    steps: tuple[ToolPauseResult, ...] = ()
    session_id: str = ""


class ReActAgent:
    def __init__(self, client: BranchClient, model: str, tools: Tools, *,
                 fmt: ReActFormat = ReActFormat(), max_tokens: int = 128,
                 expected_tool_ms: float | None = None, guesses: Guesser | None = None) -> None:
        """``guesses(tool, arg)``: optional guessed observations, e.g. a likely error."""
        self.client, self.model, self.fmt = client, model, fmt
        self.loop = ToolLoop(client, fmt, tools, max_tokens=max_tokens,
                             expected_tool_ms=expected_tool_ms, guesses=guesses)

    def run(self, prompt: str, *, resume: str | None = None, max_steps: int = 5) -> ReActResult:
        """``resume``: model output already produced for this prompt (a replayed trajectory
        that ends with an action); it is committed as is and its action runs first."""
        session = self.client.open(self.model, text=prompt)
        run = self.loop.run(session, resume=resume, max_steps=max_steps)
        return ReActResult(self.fmt.answer(run.last_turn), run.transcript, run.steps,
                           run.session_id)
