"""Grammar mask cost per decode step: xgrammar (row by row, batched) vs llguidance vs
ForkServe's sampler, batch 1 and 64.

One decode step of a constrained batch costs: compute each sequence's allowed-token bitmask
(the grammar engine, on the CPU), apply it to the logits [B, vocab], and advance each
sequence's grammar state by its sampled token. This script replays a valid JSON answer
token by token through each (a json_schema of an agent's tool call and free ``json_object``)
on the demo model's tokenizer (SmolLM2, 49 152 tokens) and reports the median milliseconds
per step for batch 1 and 64: ``xgrammar`` fills row after row, ``xgrammar-batch`` in one
``BatchGrammarMatcher`` call, ``llguidance`` with its parallel fill (each with its own apply);
``forkserve`` is what the server pays, its ``GrammarConstraint``s through the torch backend's
``Sampler`` (one fill call per step, the mask unpacked and applied where the logits live, greedy,
advance). Compile time is reported apart (paid once per schema, at request start, cached).

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
    """xgrammar, one matcher fill after another (what the sampler did before it batched)."""

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

    def start(self, compiled, batch: int):
        matchers = [self.xgr.GrammarMatcher(compiled) for _ in range(batch)]
        return matchers, self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)

    def step(self, state, logits: torch.Tensor, token: int) -> None:
        matchers, bitmask = state
        self.fill(matchers, bitmask)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
        sync(logits.device)
        for m in matchers:
            assert m.accept_token(token)


class XGrammarBatch(XGrammar):
    """xgrammar's batch fill: every row in one call, on its own threads."""

    name = "xgrammar-batch"

    def __init__(self, tok, vocab: int) -> None:
        super().__init__(tok, vocab)
        self.batch = self.xgr.BatchGrammarMatcher(max_threads="auto")

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


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
        return self.ll.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}
        )

    def start(self, compiled, batch: int):
        matchers = [self.ll.LLMatcher(self.tokenizer, compiled) for _ in range(batch)]
        return matchers, self.llt.allocate_token_bitmask(batch, self.vocab)

    def step(self, state, logits: torch.Tensor, token: int) -> None:
        matchers, bitmask = state
        self.llt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )
        self.llt.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
        sync(logits.device)
        for m in matchers:
            assert m.consume_token(token), m.get_error()


class ForkServe:
    """What the server pays: its GrammarConstraints through the torch backend's Sampler (one
    fill call per step, the mask unpacked and applied where the logits live, greedy, advance)."""

    name = "forkserve"

    def __init__(self, tok, vocab: int) -> None:
        from forkserve.backend.torch.sampler import Sampler
        from forkserve.interfaces.server.grammar import GrammarCompiler

        self.grammars = GrammarCompiler(tok, vocab, [tok.eos_token_id])
        self.sampler = None
        self.make_sampler = Sampler
        self.vocab = vocab

    def compile(self, schema: dict | None):
        return self.grammars.json_schema(schema or {"type": "object"}, "response_format")

    def start(self, compiled, batch: int):
        from forkserve.backend.protocol import SamplingParams
        from forkserve.interfaces.server.grammar import GrammarConstraint

        params = [SamplingParams(constraint=GrammarConstraint(compiled, 0)) for _ in range(batch)]
        return params, [0]

    def step(self, state, logits: torch.Tensor, token: int) -> None:
        params, position = state
        if self.sampler is None:
            self.sampler = self.make_sampler(logits.device)
        # The answer's token is made the most likely one: greedy samples (and advances) it.
        tokens = self.sampler.sample(logits, params, [position[0]] * len(params))
        assert tokens == [token] * len(params), tokens
        position[0] += 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_case(
    engine, tok, schema: dict | None, answer: str, batch: int, device: str, repeats: int
) -> dict:
    t0 = time.perf_counter()
    compiled = engine.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    steps: list[float] = []
    for _ in range(repeats):
        state = engine.start(compiled, batch)
        noise = torch.randn(batch, engine.vocab, device=device)
        for token in ids:
            logits = noise.clone()
            logits[:, token] = 1e4
            sync(logits.device)
            t = time.perf_counter()
            engine.step(state, logits, token)
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

    from forkserve.bench.output import save_figure

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
    save_figure(fig, path, quiet=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="an HF tokenizer folder (default: the demo model's GGUF)")
    ap.add_argument("--device", default="cpu", help="where the logits live (cpu | cuda)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--repeats", type=int, default=3)
    # One torch thread by default: on a shared 2-core box a two-thread op waits ~20 ms for a
    # descheduled OpenMP thread, which would be measured as mask cost.
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/grammar_bench_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
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
    rows, skipped = [], {}
    engines = []
    for system in (XGrammar, XGrammarBatch, LLGuidance, ForkServe):
        try:
            engines.append(system(tok, vocab))
        except ImportError as e:  # a GPU image without the server's packages: say so, go on
            skipped[system.name] = str(e)
            print(f"skipped {system.name}: {e}")
    meta["skipped"] = skipped
    for engine in engines:
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
