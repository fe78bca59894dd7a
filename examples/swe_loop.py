"""An OpenHands-style SWE loop over ForkServe: tool call -> pause -> observation.

    python examples/swe_loop.py                    # starts the demo model on CPU
    python examples/swe_loop.py --url http://127.0.0.1:8000

The agent works in a throw-away sandbox folder with a small buggy module. Its tools are
an allow-listed shell (ls, cat, head, wc, grep, python) and a file reader; the first turn
is replayed so the pause is shown whatever the model writes next.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, server

from forkserve.harness import SweAgent
from forkserve.interfaces.client import BranchClient

ALLOWED = {"ls", "cat", "head", "wc", "grep", "python"}
SYSTEM = ("You are a software engineer. Run one tool per turn: "
          "<execute_bash>command</execute_bash> "
          "or <read_file>path</read_file>; when done, <finish>summary</finish>.")
TASK = "The test in test_mathx.py fails. Find the bug in mathx.py."
REPLAY = "Let me look at the repository first.\n<execute_bash>ls</execute_bash>"


def make_sandbox() -> Path:
    root = Path(tempfile.mkdtemp(prefix="forkserve-swe-"))
    (root / "mathx.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "test_mathx.py").write_text("from mathx import add\n\nassert add(2, 3) == 5\n")
    return root


def tools_for(root: Path) -> dict:
    def execute_bash(command: str) -> str:
        argv = shlex.split(command)
        if not argv or argv[0] not in ALLOWED:
            return f"error: only {sorted(ALLOWED)} are allowed in this sandbox"
        try:
            p = subprocess.run(argv, check=False, cwd=root, capture_output=True, text=True,
                               timeout=10)
        except subprocess.TimeoutExpired:
            return "error: timed out after 10 s"
        return (p.stdout + p.stderr).strip()[:2000] + f"\n[exit code {p.returncode}]"

    def read_file(path: str) -> str:
        target = (root / path.strip()).resolve()
        if root not in target.parents or not target.is_file():
            return f"error: no file {path!r} in the sandbox"
        return target.read_text()[:2000]
    return {"execute_bash": execute_bash, "read_file": read_file}


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__.split("\n")[0]).parse_args(argv)
    root = make_sandbox()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    with server(args) as (url, model), BranchClient(url, api_key=args.api_key) as client:
        agent = SweAgent(client, model, tools_for(root), max_tokens=48, expected_tool_ms=100)
        result = agent.run(messages, resume=REPLAY, max_steps=4)
    for i, step in enumerate(result.steps):
        c = step.commit
        print(f"step {i}: tool ran {step.tool_ms:.1f} ms; decisions "
              f"{({k: d.action for k, d in step.decisions.items()})}; commit bound node "
              f"{c.bound_node} (matched {c.matched_tokens}, prefilled {c.prefilled_tokens}, "
              f"aborted {len(c.aborted)})")
    print(f"finished: {result.finished} {result.final_message!r}\n"
          f"--- transcript ---\n{result.transcript}")
    return {"steps": len(result.steps), "finished": result.finished,
            "transcript": result.transcript}


if __name__ == "__main__":
    main()
