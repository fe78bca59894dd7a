"""The tool pause through the plain OpenAI API: follow-up hit rate and TTFT, pinned vs not,
on LangGraph ReAct agents under memory pressure.

N LangGraph ``create_react_agent`` agents run concurrently against ``forkserve serve`` (in
process, the demo model SmolLM2-135M on CPU by default). Each agent's first model call ends
in a tool call (forced with ``tool_choice``: a 135M model picks tools poorly); its tool then
runs for a while, and meanwhile other tenants' unrelated chats arrive (sent from the tool's
pause, so the pressure lands inside every pause) and push the KV pool into eviction. Then
LangGraph sends the follow-up (history + call + tool result) and we read, through LangChain,
the share of its prompt served from cache (``usage_metadata.input_token_details.cache_read``,
the server's ``cached_tokens``) and its time to first token (a callback on the streamed
reply). With pinning (the server's default) a reply that ends in tool calls keeps its
conversation's base pages through the pause; without it, LRU eviction takes them. Both runs
share one loaded model, side by side.

    python benchmarks/tool_pause_bench.py --agents 8 --pressure 2 --num-pages 160
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import openai
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from forkserve.backend.torch import find_smollm2_gguf
from forkserve.bench.provenance import source_commit
from forkserve.config import app_config
from forkserve.interfaces.server.launcher import RunningServer, serve_in_thread
from forkserve.interfaces.server.served_model import ServedModel, load_served_model

NAME = "smollm2"


class ModelCallTimer(BaseCallbackHandler):
    """One agent's model calls, in order: when each started and when its first token came."""

    def __init__(self) -> None:
        self.started: dict[Any, float] = {}
        self.calls: list[dict] = []

    def on_chat_model_start(self, serialized, messages, *, run_id, **kwargs) -> None:
        self.started[run_id] = time.perf_counter()
        self.calls.append({"run_id": run_id, "ttft_s": None})

    def on_llm_new_token(self, token, *, run_id, **kwargs) -> None:
        call = next(c for c in self.calls if c["run_id"] == run_id)
        if call["ttft_s"] is None and token:
            call["ttft_s"] = time.perf_counter() - self.started[run_id]


def agent_task(server: RunningServer, args: argparse.Namespace, k: int) -> dict:
    """One ReAct agent: look record k up (a tool pause with pressure in it), then answer."""
    chat = ChatOpenAI(model=NAME, base_url=server.url + "/v1", api_key="unused", temperature=0,
                      max_tokens=32, max_retries=0, timeout=600, streaming=True, stream_usage=True)
    others = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=600)

    @tool
    def lookup(id: int) -> str:
        """Look a record up by id."""
        t0 = time.perf_counter()
        for j in range(args.pressure):  # other tenants' chats while the tool runs
            text = f"Unrelated request {k}.{j}: " + "lorem ipsum dolor sit amet " * 24
            others.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                           max_tokens=1, temperature=0)
        time.sleep(max(0.0, args.tool_s - (time.perf_counter() - t0)))
        return json.dumps({"id": id, "status": "active"})

    def model(state, runtime):
        if not any(isinstance(m, ToolMessage) for m in state["messages"]):
            return chat.bind_tools([lookup], tool_choice="lookup", parallel_tool_calls=False)
        return chat.bind(max_tokens=2).bind_tools([lookup], tool_choice="none")

    timer = ModelCallTimer()
    agent = create_react_agent(model, [lookup])
    out = agent.invoke(
        {"messages": [("system", f"You are records agent number {k}. " * 6),
                      ("user", f"Find record {100 + k} and summarise it.")]},
        {"recursion_limit": 6, "callbacks": [timer]},
    )
    replies = [m for m in out["messages"] if isinstance(m, AIMessage)]
    assert len(replies) == 2 and replies[0].tool_calls, "the agent did not call its tool"
    usage = replies[1].usage_metadata
    return {"agent": k, "prompt_tokens": usage["input_tokens"],
            "cached_tokens": usage.get("input_token_details", {}).get("cache_read", 0),
            "ttft_ms": round(timer.calls[1]["ttft_s"] * 1e3, 1)}


def run(model: ServedModel, args: argparse.Namespace) -> dict:
    model.engine.evict_all()
    start = dataclasses.asdict(model.engine.metrics)  # the engine is shared by both runs
    with serve_in_thread(model) as server:
        with concurrent.futures.ThreadPoolExecutor(args.agents) as pool:
            rows = list(pool.map(lambda k: agent_task(server, args, k), range(args.agents)))
        metrics = server.on_engine(lambda e: dataclasses.asdict(e.metrics))
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {
        "pin_tool_pauses": model.pin_tool_pauses,
        "hit_rate": round(sum(r["cached_tokens"] for r in rows) / prompt, 4),
        "ttft_ms_median": statistics.median(r["ttft_ms"] for r in rows),
        "ttft_ms_mean": round(statistics.fmean(r["ttft_ms"] for r in rows), 1),
        **{key: metrics[key] - start[key]
           for key in ("pins_resumed", "pins_expired", "pins_broken")},
        "follow_ups": rows,
    }


def plot(results: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from forkserve.bench.output import save_figure

    labels = ["pinned" if r["pin_tool_pauses"] else "not pinned" for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.5))
    a.bar(labels, [r["hit_rate"] for r in results], color=["tab:green", "tab:gray"])
    a.set_ylabel("follow-up prompt served from cache")
    a.set_ylim(0, 1)
    b.bar(labels, [r["ttft_ms_median"] for r in results], color=["tab:green", "tab:gray"])
    b.set_ylabel("follow-up TTFT, median ms")
    fig.suptitle(f"Tool pause, {args.agents} LangGraph ReAct agents under KV pressure "
                 "(SmolLM2-135M, CPU)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=8, help="concurrent LangGraph agents")
    ap.add_argument("--pressure", type=int, default=2, help="unrelated chats in each tool pause")
    ap.add_argument("--tool-s", type=float, default=0.5, help="how long each tool runs")
    # 16-token pages: the agents' conversations and the pressure do not fit together.
    ap.add_argument("--num-pages", type=int, default=160)
    ap.add_argument("--out", default="benchmarks/results/tool_pause_bench_cpu.json")
    args = ap.parse_args()
    model = load_served_model(find_smollm2_gguf(), config=app_config(num_pages=args.num_pages),
                              device="cpu", dtype="float32", attention="eager", name=NAME)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for pinned in (True, False):
        results.append(run(dataclasses.replace(model, pin_tool_pauses=pinned), args))
        print({k: v for k, v in results[-1].items() if k != "follow_ups"})
        record = {"args": vars(args), "commit": source_commit(),
                  "date": time.strftime("%Y-%m-%d"), "results": results}
        out.write_text(json.dumps(record, indent=1) + "\n")  # after each run: a cut one keeps it
    plot(results, out.with_suffix(".png"), args)
    pinned, unpinned = results
    print(f"pinned vs not: hit rate {pinned['hit_rate']:.2f} vs {unpinned['hit_rate']:.2f}, "
          f"follow-up TTFT x{pinned['ttft_ms_median'] / unpinned['ttft_ms_median']:.2f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
