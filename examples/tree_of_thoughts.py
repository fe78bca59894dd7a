"""Tree-of-Thoughts over ForkServe: k thoughts forked from one trunk, the best committed.

    python examples/tree_of_thoughts.py            # starts the demo model on CPU
    python examples/tree_of_thoughts.py --url http://127.0.0.1:8000

Thoughts come from ToT's "sample" proposer (one completions request with n = k); the
evaluator here is a stand-in for ToT's value prompt: it prefers thoughts that bring new
words to the state (a small model's self-rating is noise).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openai
from _common import parser, server

from forkserve.harness import TreeOfThoughts
from forkserve.harness.tot import sampling_proposer
from forkserve.interfaces.client import BranchClient

PROMPT = "Plan a three-step way to speed up a slow web page.\nStep 1:"


def novelty(state: str, thought: str) -> float:
    seen = set(state.lower().split())
    words = thought.lower().split()
    return len({w for w in words if w not in seen}) / (1 + abs(len(words) - 12))


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2)
    args = ap.parse_args(argv)
    with server(args) as (url, model), BranchClient(url, api_key=args.api_key) as client:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=args.api_key or "unused")
        tot = TreeOfThoughts(client, model,
                             sampling_proposer(oai, model, max_tokens=24, stop=("\n\n",)), novelty,
                             k=args.k, depth=args.depth, answer_tokens=32, answer_stop=("\n\n",))
        result = tot.run(PROMPT)
    for i, level in enumerate(result.levels):
        c = level.commit
        print(f"level {i}: scores {[round(s, 2) for s in level.scores]} -> thought {level.chosen} "
              f"(bound node {c.bound_node}, matched {c.matched_tokens}, prefilled "
              f"{c.prefilled_tokens}, aborted {len(c.aborted)})")
    print(f"--- state ---\n{result.state}\n--- answer ---\n{result.answer}")
    return {"levels": len(result.levels), "state": result.state, "answer": result.answer}


if __name__ == "__main__":
    main()
