"""ToolPause: one tool call lowered onto the verbs (seed 000's agent step).

While the tool runs, the engine has nothing to decode for this session. Before calling
the tool the harness announces what comes next:

* the known wrapper the framework will write around any observation (p = 1): forked
  and speculated with ``t_idle_ms`` = the expected tool time, so it is prefilled (and
  pinned) during the pause;
* optional guesses of the observation (an error message, a cached result) at lower
  priority: the cascade keeps or prunes them.

When the tool returns, ``commit`` binds the branch with the longest common prefix and
prefills only the unmatched tail; the other branches are aborted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from forkserve.interfaces.client import BranchClient, Commit, Decision


@dataclass(frozen=True)
class Guess:
    text: str        # a guessed continuation after the tip (usually wrapper + observation)
    priority: float  # the harness's prior that this is what happens, in [0, 1)


@dataclass(frozen=True)
class ToolPauseResult:
    observation: str
    committed_text: str
    commit: Commit
    decisions: dict[str, Decision]  # branch label -> the cascade's verdict
    tool_ms: float


def wrapper_remainder(generated: str, wrapper: str) -> str:
    """The part of ``wrapper`` the model has not written itself: when generation stopped on
    (a prefix of) the wrapper, those characters are already in the session's context."""
    for k in range(min(len(generated), len(wrapper)), 0, -1):
        if generated.endswith(wrapper[:k]):
            return wrapper[k:]
    return wrapper


class ToolPause:
    def __init__(self, client: BranchClient, *, expected_tool_ms: float | None = None) -> None:
        self.client = client
        self.expected_tool_ms = expected_tool_ms

    def run(self, session_id: str, tip: int, tool: Callable[[], str], *, prefix: str, suffix: str,
            guesses: tuple[Guess, ...] = ()) -> ToolPauseResult:
        """Announce ``prefix`` (p = 1) and ``guesses``, run ``tool``, commit
        ``prefix + observation + suffix``."""
        decisions: dict[str, Decision] = {}
        if prefix:
            known = self.client.fork(session_id, tip, text=prefix, label="wrapper")
            decisions["wrapper"] = self.client.speculate(session_id, known, priority=1.0,
                                                         t_idle_ms=self.expected_tool_ms)
        for i, guess in enumerate(guesses):
            node = self.client.fork(session_id, tip, text=guess.text, label=f"guess{i}")
            decisions[f"guess{i}"] = self.client.speculate(
                session_id, node, priority=guess.priority, t_idle_ms=self.expected_tool_ms)
        started = time.perf_counter()
        observation = tool()
        tool_ms = (time.perf_counter() - started) * 1e3
        text = prefix + observation + suffix
        commit = self.client.commit(session_id, tip, text=text)
        return ToolPauseResult(observation, text, commit, decisions, tool_ms)


def first_turn(client: BranchClient, sid: str, tip: int, *, resume: str | None,
               max_tokens: int, stop) -> tuple[str, int]:
    """The agent's first turn: a replayed one (``resume``) is committed as is, otherwise the
    model generates it. Returns the turn's text and the new tip."""
    if resume is not None:
        return resume, client.commit(sid, tip, text=resume).tip
    out = client.generate(sid, max_tokens, stop=stop)
    return out.text, out.tip
