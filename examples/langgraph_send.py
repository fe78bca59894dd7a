"""LangGraph Send fan-out over ForkServe: reviewers run in parallel on one shared context.

    python examples/langgraph_send.py              # starts the demo model on CPU
    python examples/langgraph_send.py --url http://127.0.0.1:8000

``plan`` opens the shared context once; LangGraph sends one ``work`` task per reviewer
(each asks the server's chat endpoint, then records its note as a branch of the shared
session); ``reduce`` joins the notes in order and decodes a summary on the spine.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openai
from _common import parser, server

from forkserve.harness import SendFanout, build_send_graph
from forkserve.interfaces.client import BranchClient

CONTEXT = ("Patch under review:\n"
           "-    return a - b\n"
           "+    return a + b\n"
           "Reviewer notes:\n")
REVIEWERS = ["Correctness", "Tests", "Style"]


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--note-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    with server(args) as (url, model), BranchClient(url, api_key=args.api_key) as client:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=args.api_key or "unused")

        def review(context: str, aspect: str) -> str:
            r = oai.chat.completions.create(
                model=model, max_tokens=args.note_tokens, temperature=0,
                messages=[{"role": "system", "content": context},
                          {"role": "user", "content": f"One sentence on {aspect.lower()}:"}])
            return f"{aspect}: {r.choices[0].message.content.strip()}"

        graph = build_send_graph(SendFanout(client, model), review, separator="\n",
                                 summary_tokens=24, summary_stop=("\n\n",))
        final = graph.invoke({"context": CONTEXT, "subtasks": REVIEWERS})
    for index, node, text in sorted(final["results"]):
        print(f"send {index} -> branch {node}: {text!r}")
    j = final["join"]
    print(f"join: bound node {j['bound_node']} (matched {j['matched_tokens']}, prefilled "
          f"{j['prefilled_tokens']})")
    print(f"summary: {final['summary']!r}")
    return final


if __name__ == "__main__":
    main()
