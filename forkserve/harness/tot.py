"""Tree-of-Thoughts (Yao et al., BFS with beam 1) lowered onto the verbs.

Each level: the framework's proposer gives k thoughts for the current state; each is
forked from the committed tip (aliasing its pages) and speculated, so the thoughts are
prefilled while the framework's evaluator scores them; the best-scored thought is
committed (binding its branch: no second prefill) and the others are aborted. After the
last level the answer is decoded from the committed spine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from forkserve.interfaces.client import BranchClient, Commit

Proposer = Callable[[str, int], Sequence[str]]   # (state text, k) -> k thoughts
Evaluator = Callable[[str, str], float]          # (state text, thought) -> value


@dataclass(frozen=True)
class TotLevel:
    thoughts: list[str]
    scores: list[float]
    chosen: int
    commit: Commit


@dataclass(frozen=True)
class TotResult:
    state: str                  # prompt + the chosen thoughts
    answer: str
    levels: list[TotLevel] = field(default_factory=list)


class TreeOfThoughts:
    def __init__(self, client: BranchClient, model: str, propose: Proposer, evaluate: Evaluator, *,
                 k: int = 3, depth: int = 2, answer_tokens: int = 64,
                 answer_stop: Sequence[str] = ()) -> None:
        self.client, self.model = client, model
        self.propose, self.evaluate = propose, evaluate
        self.k, self.depth = k, depth
        self.answer_tokens, self.answer_stop = answer_tokens, tuple(answer_stop)

    def run(self, prompt: str) -> TotResult:
        s = self.client.open(self.model, text=prompt)
        sid, tip, state = s.session_id, s.tip, prompt
        levels: list[TotLevel] = []
        try:
            for _ in range(self.depth):
                thoughts = [t for t in self.propose(state, self.k) if t][:self.k]
                if not thoughts:
                    break
                nodes = [self.client.fork(sid, tip, text=t, label=f"thought{i}")
                         for i, t in enumerate(thoughts)]
                for node in nodes:  # a uniform prior: the evaluator has not spoken yet
                    self.client.speculate(sid, node, priority=1.0 / len(nodes))
                scores = [self.evaluate(state, t) for t in thoughts]
                best = max(range(len(thoughts)), key=scores.__getitem__)
                commit = self.client.commit(sid, tip, text=thoughts[best])
                levels.append(TotLevel(thoughts, scores, best, commit))
                tip, state = commit.tip, state + thoughts[best]
            answer = self.client.generate(sid, self.answer_tokens, stop=self.answer_stop).text
        finally:
            self.client.close(sid)
        return TotResult(state, answer, levels)


def sampling_proposer(openai_client, model: str, *, max_tokens: int = 24, temperature: float = 0.9,
                      stop: Sequence[str] = ("\n",)) -> Proposer:
    """ToT's "sample" strategy: k i.i.d. continuations of the state (one request, n = k)."""
    def propose(state: str, k: int) -> list[str]:
        r = openai_client.completions.create(model=model, prompt=state, n=k, max_tokens=max_tokens,
                                             temperature=temperature, stop=list(stop) or None)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    return propose
