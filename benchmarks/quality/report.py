"""Per-layout summary of an evaluation, written as JSON, a markdown table and a PNG."""
from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Sequence

from benchmarks.quality.evaluate import EvalParams, LayoutResult


@dataclass(frozen=True)
class LayoutSummary:
    layout: str
    available: bool
    note: str
    items: int
    accuracy: float          # AST-valid answers / items
    token_f1: float
    agreement: float         # greedy tokens equal to unified's
    identical: float         # answers token-for-token equal to unified's
    readers: int             # agents whose context KV another agent (or the base pass) wrote
    reader_accuracy: float | None
    layer_cos: tuple[float, ...]  # readers' mean cosine to unified per layer; () if none
    prefill_tokens: int
    seconds: float


def summarize(result: LayoutResult, reference: LayoutResult) -> LayoutSummary:
    if not result.available:
        return LayoutSummary(result.layout, False, result.note, 0, 0.0, 0.0, 0.0, 0.0, 0, None, (), 0, 0.0)
    agents = result.agents
    ref = {(a.round, a.task): a.tokens for a in reference.agents}
    readers = [a for a in agents if a.reused_tokens > 0]
    compared = [a.layer_cos for a in readers if a.layer_cos]
    layer_cos = tuple(mean(c[i] for c in compared) for i in range(len(compared[0]))) if compared else ()
    return LayoutSummary(
        result.layout, True, result.note, len(agents), mean(a.valid for a in agents), mean(a.f1 for a in agents),
        mean(a.agreement for a in agents), mean(a.tokens == ref[(a.round, a.task)] for a in agents),
        len(readers), mean(a.valid for a in readers) if readers else None, layer_cos,
        result.prefill_tokens, result.seconds)


def markdown(summaries: Sequence[LayoutSummary], header: str) -> str:
    lines = [header, "",
             "| layout | accuracy (AST) | token F1 | readers | reader accuracy | greedy agreement "
             "| identical answers | hidden cos mean | hidden cos min layer | last layer | prefill tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if not s.available:
            lines.append(f"| {s.layout} | not available: {s.note} |" + " |" * 10)
            continue
        cos = (f"{mean(s.layer_cos):.4f} | {min(s.layer_cos):.4f} | {s.layer_cos[-1]:.4f}" if s.layer_cos
               else "— | — | —")
        reader_acc = f"{s.reader_accuracy:.1%}" if s.reader_accuracy is not None else "—"
        lines.append(f"| {s.layout} | {s.accuracy:.1%} | {s.token_f1:.3f} | {s.readers}/{s.items} | {reader_acc} "
                     f"| {s.agreement:.1%} | {s.identical:.1%} | {cos} | {s.prefill_tokens} |")
    return "\n".join(lines)


def plot(summaries: Sequence[LayoutSummary], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in summaries if s.available]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for s in shown:
        if s.layer_cos:
            ax1.plot(range(len(s.layer_cos)), s.layer_cos, marker=".", label=s.layout)
    ax1.set_xlabel("layer")
    ax1.set_ylabel("cosine to unified (readers' own tokens)")
    ax1.set_title("hidden state after each layer")
    ax1.grid(alpha=0.3)
    ax1.legend()
    x = range(len(shown))
    ax2.bar([i - 0.2 for i in x], [s.accuracy for s in shown], 0.4, label="accuracy (AST)")
    ax2.bar([i + 0.2 for i in x], [s.token_f1 for s in shown], 0.4, label="token F1")
    ax2.set_xticks(list(x), [s.layout for s in shown], rotation=15)
    ax2.set_ylim(0, 1)
    ax2.set_title("answer quality per layout")
    ax2.legend()
    fig.suptitle(textwrap.fill(title, 170), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: Sequence[LayoutResult], params: EvalParams, model: str, adapters: Path,
                  label: str, prefix: Path) -> str:
    """quality_<tag>.json (+ .md, .png); returns the markdown table."""
    summaries = [summarize(r, results[0]) for r in results]
    k = len(params.categories)
    header = (f"model {model}; adapters {adapters} {label}; K = {k} tasks ({', '.join(params.categories)}); "
              f"{params.rounds} rounds x {k} agents; {params.distractors} distractor items in each catalog; "
              f"greedy, max {params.max_new} new tokens; {params.device} {params.dtype} {params.attention}")
    table = markdown(summaries, header)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".md").write_text(table + "\n")
    agents = [dict(asdict(a), layout=r.layout) for r in results for a in r.agents]
    prefix.with_suffix(".json").write_text(json.dumps(
        {"model": model, "adapters": str(adapters), "label": label, "params": asdict(params),
         "summaries": [asdict(s) for s in summaries], "agents": agents}, indent=1))
    plot(summaries, header, prefix.with_suffix(".png"))
    return table
