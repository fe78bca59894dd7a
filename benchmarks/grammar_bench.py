"""Grammar mask cost per decode step: xgrammar vs llguidance, batch 1 and 64.

One decode step of a constrained batch costs: compute each sequence's allowed-token bitmask
(the grammar engine, on the CPU), apply it to the logits [B, vocab], and advance each
sequence's grammar state by its sampled token. This script replays a valid JSON answer
token by token through both engines (a json_schema of an agent's tool call and free
``json_object``) on the demo model's tokenizer (SmolLM2, 49 152 tokens) and reports the
median milliseconds per step (mask + apply + advance) for batch 1 and 64 — the figure that
picks the engine ForkServe's sampler uses. Compile time is reported apart (it is paid once
per schema, at request start, and cached).

    python benchmarks/grammar_bench.py                  # CPU; JSON + PNG under benchmarks/results/
    python benchmarks/grammar_bench.py --device cuda    # the H200 figure (masks still on CPU)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forkserve.bench.provenance import source_commit  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "calculator"},
        "arguments": {
            "type": "object",
            "properties": {
                "a": {"type": "number"},
                "b": {"type": "number"},
                "op": {"enum": ["add", "sub", "mul", "div"]},
            },
            "required": ["a", "b", "op"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
ANSWER = '{"name": "calculator", "arguments": {"a": 12.5, "b": 30, "op": "mul"}}'
FREE_ANSWER = '{"city": "Paris", "days": [1, 2, 3], "note": "bring an umbrella, it rains a lot"}'


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    from forkserve.backend.torch import find_smollm2_gguf

    if path:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    gguf = find_smollm2_gguf()
    return AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id]
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema: dict | None):
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matchers(self, compiled, batch: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(batch)]

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))

    def accept(self, matchers, token: int) -> None:
        for m in matchers:
            assert m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()
        self.vocab = vocab

    def compile(self, schema: dict | None):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}
        )
        return grammar

    def matchers(self, compiled, batch: int):
        return [self.ll.LLMatcher(self.tokenizer, compiled) for _ in range(batch)]

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        self.llt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def apply(self, logits, bitmask) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))

    def accept(self, matchers, token: int) -> None:
        for m in matchers:
            assert m.consume_token(token), m.get_error()


def run_case(
    engine, tok, schema: dict | None, answer: str, batch: int, device: str, repeats: int
) -> dict:
    t0 = time.perf_counter()
    compiled = engine.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    steps: list[float] = []
    for _ in range(repeats):
        matchers = engine.matchers(compiled, batch)
        bitmask = engine.bitmask(batch)
        logits = torch.randn(batch, engine.vocab, device=device)
        for token in ids:
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            engine.fill(matchers, bitmask)
            engine.apply(logits, bitmask)
            if device == "cuda":
                torch.cuda.synchronize()
            engine.accept(matchers, token)
            steps.append((time.perf_counter() - t) * 1e3)
    return {
        "engine": engine.name,
        "grammar": "json_schema" if schema else "json_object",
        "batch": batch,
        "tokens_per_answer": len(ids),
        "compile_ms": round(compile_ms, 2),
        "step_ms_median": round(statistics.median(steps), 4),
        "step_ms_p90": round(sorted(steps)[int(0.9 * len(steps))], 4),
        "per_sequence_us": round(statistics.median(steps) / batch * 1e3, 2),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r["grammar"], r["batch"]) for r in rows})
    engines = sorted({r["engine"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(engines)
    for k, eng in enumerate(engines):
        vals = [
            next(
                r["step_ms_median"]
                for r in rows
                if r["engine"] == eng and (r["grammar"], r["batch"]) == lab
            )
            for lab in labels
        ]
        ax.bar([i + k * width for i in range(len(labels))], vals, width, label=eng)
    ax.set_xticks(
        [i + width * (len(engines) - 1) / 2 for i in range(len(labels))],
        [f"{g}\nbatch {b}" for g, b in labels],
    )
    ax.set_ylabel("ms per decode step (mask + apply + advance)")
    ax.set_yscale("log")
    ax.set_title("Grammar mask cost per decode step (SmolLM2 vocab, CPU masks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="an HF tokenizer folder (default: the demo model's GGUF)")
    ap.add_argument("--device", default="cpu", help="where the logits live (cpu | cuda)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/grammar_bench_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = load_tokenizer(args.tokenizer)
    vocab = len(tok)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "vocab": vocab,
        "commit": source_commit(),
        "date": time.strftime("%Y-%m-%d"),
    }
    rows = []
    for engine in (XGrammar(tok, vocab), LLGuidance(tok, vocab)):
        for schema, answer in ((SCHEMA, ANSWER), (None, FREE_ANSWER)):
            for batch in (int(b) for b in args.batches.split(",")):
                row = run_case(engine, tok, schema, answer, batch, args.device, args.repeats)
                print(json.dumps(row))
                rows.append(row)
                # Written after every case: a run cut short keeps what it measured.
                out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
