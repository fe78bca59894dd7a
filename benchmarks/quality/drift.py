"""Per-layer drift of a reader's base K/V when it reads a writer's instead of computing its own.

    python -m benchmarks.quality.drift --adapters /root/adapters/qkvo --rounds 8 --out $OUT

In the disaggregated layout a reader X takes the base-side K/V of the shared context from the
writer W's forward pass, h_W W_k, where its own pass would have given h_X W_k (h: the
attention input of the layer, shaped by the adapter's earlier layers; likewise V). Per layer,
over the shared catalog of the evaluation's rounds, this measures

    drift_k[n] = sqrt( sum ||(h_X - h_W) W_k||^2 / sum ||h_X W_k + b_k||^2 )

(RoPE rotates both sides alike, so it does not change the norm). W ranges over the other
adapters and the base model (a neutral writer: issue 16's mode a). The layers that drift
most are the ones selective recompute (mode b) would recompute. Layer 0 reads the
embeddings, so its drift is 0 by construction. Outputs <out>/quality_<tag>_drift.{json,png}.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks.quality.evaluate import EvalParams, common_prefix, load_inputs
from forkserve.backend.torch.base_kv import attention_inputs, context_hidden, kv_base
from forkserve.bench.output import DEFAULT_OUT

BASE = "base"  # the writer that runs no adapter


@dataclass(frozen=True)
class PairDrift:
    writer: str
    reader: str
    k: tuple[float, ...]   # per layer
    v: tuple[float, ...]


@dataclass(frozen=True)
class DriftResult:
    model: str
    adapters: str
    rounds: int
    context_tokens: int    # summed over rounds: the tokens every ratio runs over
    pairs: tuple[PairDrift, ...]
    adapter_writer: PairDrift  # mean over the pairs of two adapters ("*", reader "*")
    base_writer: PairDrift     # mean over readers with the base model as writer


def measure(backend: Any, contexts: Sequence[Sequence[int]], names: Sequence[str],
            model: str, adapters: str) -> DriftResult:
    sources = [BASE, *names]
    layers = backend.model_config.num_layers
    # (writer, reader) -> per layer [sum ||dk||^2, sum ||k||^2, sum ||dv||^2, sum ||v||^2]
    sums = {(w, x): torch.zeros(layers, 4, dtype=torch.float64) for w in sources for x in names
            if w != x}
    for tokens in contexts:
        h = {s: attention_inputs(backend, tokens, context_hidden(
            backend, tokens, None if s == BASE else backend.adapter_id(s))) for s in sources}
        for n in range(layers):
            kv = {s: kv_base(backend, h[s][n], n) for s in sources}
            for (w, x), acc in sums.items():
                (kx, vx), (kw, vw) = kv[x], kv[w]
                acc[n] += torch.tensor([(kx - kw).square().sum().item(), kx.square().sum().item(),
                                        (vx - vw).square().sum().item(), vx.square().sum().item()],
                                       dtype=torch.float64)

    def drift(keys: Sequence[tuple[str, str]], writer: str, reader: str) -> PairDrift:
        total = sum(sums[key] for key in keys)
        return PairDrift(writer, reader, tuple((total[:, 0] / total[:, 1]).sqrt().tolist()),
                         tuple((total[:, 2] / total[:, 3]).sqrt().tolist()))

    pairs = tuple(drift([key], *key) for key in sums)
    return DriftResult(model, adapters, len(contexts), sum(len(c) for c in contexts), pairs,
                       drift([key for key in sums if key[0] != BASE], "*", "*"),
                       drift([key for key in sums if key[0] == BASE], BASE, "*"))


def plot(result: DriftResult, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from forkserve.bench.output import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, side in zip(axes, ("k", "v"), strict=True):
        for p in result.pairs:
            if p.writer != BASE:
                ax.plot(getattr(p, side), color="grey", alpha=0.3, lw=0.8)
        ax.plot(getattr(result.adapter_writer, side), marker=".", label="another adapter writes")
        ax.plot(getattr(result.base_writer, side), marker=".", label="the base model writes")
        ax.set_xlabel("layer")
        ax.set_title(f"base {side.upper()} the reader gets vs its own")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("relative drift ||(h_X - h_W) W|| / ||h_X W||")
    fig.suptitle(f"{result.model}, adapters {result.adapters}: {result.rounds} shared catalogs, "
                 f"{result.context_tokens} tokens; grey: each adapter pair", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


def run(model: Path, adapter_dir: Path, params: EvalParams, out: Path, tag: str,
        rounds: int) -> DriftResult:
    """The first ``rounds`` shared catalogs of the evaluation ``params`` describes."""
    from forkserve.backend.torch import TorchBackend
    from forkserve.config import ForkServeConfig, KVLayout

    inputs = load_inputs(model, adapter_dir, params)
    contexts = [ps[0][:common_prefix(ps)] for ps in inputs.prompts[:rounds]]
    pages = -(-max(len(c) for c in contexts) // params.page_size) + 1
    config = ForkServeConfig(page_size=params.page_size, num_pages=pages, num_residual_pages=pages,
                             kv_layout=KVLayout.UNIFIED, max_batch_tokens=4096, node_ttl_s=None)
    backend = TorchBackend.from_weights(
        config, inputs.model_config, inputs.weights, inputs.adapters, device=params.device,
        dtype=getattr(torch, params.dtype), attention=params.attention, use_cuda_graphs=False,
        compile_fusions=False)
    result = measure(backend, contexts, [e.task for e in inputs.rounds[0].examples], model.name,
                     adapter_dir.name)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"quality_{tag}_drift.json").write_text(json.dumps(
        dict(asdict(result), params=asdict(params)), indent=1))
    plot(result, out / f"quality_{tag}_drift.png")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None,
                    help=".gguf or HF folder (default: SmolLM2 GGUF)")
    ap.add_argument("--adapters", type=Path, required=True,
                    help="folder with one PEFT folder per task")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--rounds", type=int, default=8, help="shared catalogs measured (<= 40)")
    ap.add_argument("--eval-rounds", type=int, default=EvalParams.rounds,
                    help="the evaluation's round count (it decides the catalogs' distractors)")
    ap.add_argument("--distractors", type=int, default=EvalParams.distractors)
    ap.add_argument("--heldout", type=int, default=EvalParams.heldout)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.model is None:
        from forkserve.backend.torch import find_smollm2_gguf
        args.model = find_smollm2_gguf()
    params = EvalParams(rounds=args.eval_rounds, distractors=args.distractors,
                        heldout=args.heldout, device=args.device)
    result = run(args.model, args.adapters, params, args.out, args.tag, args.rounds)
    for p in (result.adapter_writer, result.base_writer):
        print(f"writer {p.writer:>4}: k " + " ".join(f"{d:.3f}" for d in p.k))
        print("            v " + " ".join(f"{d:.3f}" for d in p.v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
