"""ReAct over ForkServe: the observation wrapper is prefilled while the tool runs.

    python examples/react_agent.py                  # starts the demo model on CPU
    python examples/react_agent.py --url http://127.0.0.1:8000

The first turn is replayed (a resumed trajectory) so the tool pause is shown whatever a
135M-parameter model would write; the model continues from the committed spine.
"""
from __future__ import annotations

import ast
import operator
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, server

from forkserve.harness import Guess, ReActAgent
from forkserve.interfaces.client import BranchClient

PROMPT = """Answer the question. Use this format:
Thought: what to do next
Action: calculator[expression] or lookup[term]
Observation: the tool's result
... (repeat as needed)
Final Answer: the answer

Question: A crate holds 17 boxes of 23 apples. How many apples is that?
"""
REPLAY = "Thought: I should multiply the boxes by the apples per box.\nAction: calculator[17*23]"

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Arithmetic only (no eval): + - * / on numbers."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported expression")
    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


def lookup(term: str) -> str:
    return {"apple": "a fruit", "crate": "a box for transport"}.get(term.lower(), "no entry")


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__.split("\n")[0]).parse_args(argv)
    with server(args) as (url, model), BranchClient(url, api_key=args.api_key) as client:
        agent = ReActAgent(client, model, {"calculator": calculator, "lookup": lookup},
                           max_tokens=48, expected_tool_ms=200,
                           guesses=lambda tool, arg: [Guess("error: ", 0.2)])
        result = agent.run(PROMPT, resume=REPLAY, max_steps=3)
    for i, step in enumerate(result.steps):
        c = step.commit
        print(f"step {i}: observation {step.observation!r} after {step.tool_ms:.1f} ms; "
              f"decisions {({k: d.action for k, d in step.decisions.items()})}; commit bound node "
              f"{c.bound_node} (matched {c.matched_tokens} tokens, prefilled {c.prefilled_tokens})")
    print(f"answer: {result.answer!r}\n--- transcript ---\n{result.transcript}")
    return {"steps": len(result.steps), "answer": result.answer, "transcript": result.transcript}


if __name__ == "__main__":
    main()
