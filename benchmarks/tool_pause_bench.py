"""The tool pause through the plain OpenAI API: follow-up hit rate and TTFT, pinned vs not.

N agents each send a first turn whose reply is a (required) tool call; while their tools
"run", unrelated chats put the KV pool under pressure (the prefix index must evict); then
each agent sends its follow-up (history + call + tool result) and we measure the share of
its prompt served from cached pages and its time to first token. With pinning (the server's
default) a reply that ends in tool calls keeps its conversation's base pages through the
pause; without it, LRU eviction takes them. Demo model (SmolLM2-135M) on CPU by default.

    python benchmarks/tool_pause_bench.py --agents 8 --pressure 16 --num-pages 320

LangGraph's ReAct loop sends exactly these requests (the openai client underneath); the
loop is driven directly here so that the pause and the pressure are placed deterministically.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import statistics
import time
from pathlib import Path

import openai

from forkserve.backend.torch import find_smollm2_gguf
from forkserve.config import app_config
from forkserve.interfaces.server.launcher import serve_in_thread
from forkserve.interfaces.server.served_model import ServedModel, load_served_model

NAME = "smollm2"
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a record up by id.",
        "parameters": {
            "type": "object",
            "properties": {"id": {"type": "integer"}},
            "required": ["id"],
        },
    },
}


def agent_messages(k: int) -> list[dict]:
    return [
        {"role": "system", "content": f"You are records agent number {k}. " * 6},
        {"role": "user", "content": f"Find record {100 + k} and summarise it."},
    ]


def run(model: ServedModel, args: argparse.Namespace) -> dict:
    model.engine.evict_all()
    start = dataclasses.asdict(model.engine.metrics)  # the engine is shared by both runs
    with serve_in_thread(model) as server:
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600
        )
        pool = concurrent.futures.ThreadPoolExecutor(max(args.agents, args.concurrency))
        first = list(
            pool.map(
                lambda k: client.chat.completions.create(
                    model=NAME,
                    messages=agent_messages(k),
                    tools=[TOOL],
                    tool_choice="required",
                    parallel_tool_calls=False,
                    max_tokens=32,
                    temperature=0,
                ),
                range(args.agents),
            )
        )
        pins = server.on_engine(lambda e: e.cache_stats().pins)

        def pressure(j: int) -> None:  # unrelated chats while the tools run
            text = f"Unrelated request {j}: " + "lorem ipsum dolor sit amet " * 40
            client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": text}],
                max_tokens=1,
                temperature=0,
            )

        list(
            concurrent.futures.ThreadPoolExecutor(args.concurrency).map(
                pressure, range(args.pressure)
            )
        )

        rows = []
        for k, r in enumerate(first):
            msg = r.choices[0].message
            follow = agent_messages(k) + [
                msg.model_dump(exclude_none=True),
                {
                    "role": "tool",
                    "tool_call_id": msg.tool_calls[0].id,
                    "content": json.dumps({"id": 100 + k, "status": "active"}),
                },
            ]
            hits = server.on_engine(lambda e: e.metrics.base_hit_tokens)
            t0 = time.perf_counter()
            ttft, usage = None, None
            for chunk in client.chat.completions.create(
                model=NAME,
                messages=follow,
                tools=[TOOL],
                tool_choice="none",
                max_tokens=2,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - t0
                usage = chunk.usage or usage
            hit = server.on_engine(lambda e: e.metrics.base_hit_tokens) - hits
            rows.append(
                {
                    "agent": k,
                    "prompt_tokens": usage.prompt_tokens,
                    "hit_tokens": hit,
                    "ttft_ms": round((ttft or time.perf_counter() - t0) * 1e3, 1),
                }
            )
        metrics = server.on_engine(lambda e: dataclasses.asdict(e.metrics))
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {
        "pin_tool_pauses": model.pin_tool_pauses,
        "pins_after_first_turn": pins,
        "hit_rate": round(sum(r["hit_tokens"] for r in rows) / prompt, 4),
        "ttft_ms_median": statistics.median(r["ttft_ms"] for r in rows),
        "ttft_ms_mean": round(statistics.fmean(r["ttft_ms"] for r in rows), 1),
        "pins_resumed": metrics["pins_resumed"] - start["pins_resumed"],
        "pins_expired": metrics["pins_expired"] - start["pins_expired"],
        "pins_broken": metrics["pins_broken"] - start["pins_broken"],
        "follow_ups": rows,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["pinned" if r["pin_tool_pauses"] else "not pinned" for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.5))
    a.bar(labels, [r["hit_rate"] for r in results], color=["tab:green", "tab:gray"])
    a.set_ylabel("follow-up prompt served from cache")
    a.set_ylim(0, 1)
    b.bar(labels, [r["ttft_ms_median"] for r in results], color=["tab:green", "tab:gray"])
    b.set_ylabel("follow-up TTFT, median ms")
    fig.suptitle("Tool pause through the OpenAI API under KV pressure (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--pressure", type=int, default=16, help="unrelated chats during the pause")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-pages", type=int, default=320)
    ap.add_argument("--out", default="benchmarks/results/tool_pause_bench_cpu.json")
    args = ap.parse_args()
    model = load_served_model(
        find_smollm2_gguf(),
        config=app_config(num_pages=args.num_pages),
        device="cpu",
        dtype="float32",
        attention="eager",
        name=NAME,
    )
    results = [run(model, args), run(dataclasses.replace(model, pin_tool_pauses=False), args)]
    for r in results:
        print({k: v for k, v in r.items() if k != "follow_ups"})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"args": vars(args), "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1
        )
        + "\n"
    )
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
