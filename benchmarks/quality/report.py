"""The quality table from the saved units of one evaluation: JSON, markdown and PNG.

    python -m benchmarks.quality.report RESULTS/quality_<tag> [--label "..."]

Every layout is compared with its reference mode on the same agents (paired): its *readers*,
the agents whose context K/V another agent (or the base pass) wrote, each against the
reference's answer to the same question in the same round. The reference is unified (plain
LoRA, nothing shared across adapters) for every mode but the activated-LoRA ones, whose
readers are paired with ``alora_unified`` (the same aLoRA adapters, nothing reused): that
pair measures what sharing costs them. What aLoRA itself costs against plain LoRA is a second
table: every answer of an aLoRA mode against unified's. Differences of token F1 and AST
validity, greedy agreement (the share of positions where the same token was generated) and
identical answers come with bootstrap 95% intervals over rounds (stats.py) and their sample
sizes. Only the rounds that both the layout and its reference finished count. Beside them,
what the mode costs: the KV bytes the shared contexts occupy with every agent on them (and
that against unified), the layers a recompute mode keeps exact per reader, and the prefill
tokens.
"""
from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Any, Sequence

from benchmarks.quality import modes, units
from benchmarks.quality.modes import REFERENCE
from benchmarks.quality.stats import Estimate, bootstrap
from benchmarks.quality.units import AgentResult, Unit

# The plot's quality-against-memory panel shows ΔF1 down to this many points (see plot).
OFF_SCALE_POINTS = -25.0
PLOT_TOP = 5.0


@dataclass(frozen=True)
class Paired:
    """A layout's answers (its readers, or all of them) against a reference's on the same
    (round, task)."""

    f1: float                   # the answers' mean F1 in this layout ...
    f1_reference: float         # ... and the reference's on the same questions
    delta_f1: Estimate
    valid: int                  # AST-valid answers among them
    valid_reference: int
    delta_valid: Estimate
    agreement: Estimate
    identical: Estimate


@dataclass(frozen=True)
class LayoutSummary:
    layout: str
    available: bool
    note: str
    rounds: int
    answers: int
    accuracy: float          # AST-valid answers / answers, all agents
    token_f1: float
    readers: int
    paired: Paired | None    # readers vs the reference; None for a reference, or no readers
    layer_cos: tuple[float, ...]  # readers' mean cosine to the reference per layer; () if none
    prefill_tokens: int
    seconds: float
    context_kv_bytes: int = 0   # the shared contexts' K/V, every agent on them, summed over rounds
    recompute_layers: tuple[int, ...] = ()  # layers a reader keeps exact (selective recompute)
    reference: str = REFERENCE  # the mode ``paired`` compares with
    vs_lora: Paired | None = None  # every answer vs unified's, for a mode paired with another
    offset_table_bytes: int = 0  # offset correction: its tables, held once for every context
    extra_flops: int = 0         # offset correction: FLOPs spent correcting on read
    # context_kv_bytes against unified's over the same rounds (catalogs differ per round, so a
    # mode with fewer rounds than unified is compared with those rounds only); None if unknown
    kv_vs_unified: float | None = None


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    if not a and not b:
        return 1.0
    return sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b))


def pair(answers: Sequence[AgentResult], ref: dict[units.AgentKey, AgentResult]) -> Paired:
    rounds = [a.round for a in answers]
    refs = [ref[a.key] for a in answers]
    return Paired(
        mean(a.f1 for a in answers), mean(r.f1 for r in refs),
        bootstrap([a.f1 - r.f1 for a, r in zip(answers, refs, strict=True)], rounds),
        sum(a.valid for a in answers), sum(r.valid for r in refs),
        bootstrap([float(a.valid) - float(r.valid) for a, r in zip(answers, refs, strict=True)],
                  rounds),
        bootstrap([agreement(a.tokens, r.tokens) for a, r in zip(answers, refs, strict=True)],
                  rounds),
        bootstrap([float(a.tokens == r.tokens) for a, r in zip(answers, refs, strict=True)],
                  rounds))


def summarize(layout: str, us: Sequence[Unit],
              refs: dict[str, dict[units.AgentKey, AgentResult]],
              unified_kv: dict[tuple[int, int], int] | None = None) -> LayoutSummary:
    """``refs``: each reference mode's answers by (round, task); ``unified_kv``: unified's
    context KV bytes by unit (first, end) round range."""
    mode = modes.mode(layout)
    if not all(u.available for u in us):
        note = next(u.note for u in us if not u.available)
        return LayoutSummary(layout, False, note, 0, 0, 0.0, 0.0, 0, None, (), 0, 0.0)
    layers = us[0].recompute_layers
    if any(u.recompute_layers != layers for u in us):
        raise ValueError(f"{layout}: units recomputed different layers "
                         f"{sorted({u.recompute_layers for u in us})}; rerun them with one profile")
    ref = refs.get(mode.reference, {})
    agents = [a for a in units.agents_of(us) if a.key in ref]
    if not agents:
        return LayoutSummary(layout, False, f"no rounds in common with {mode.reference}", 0, 0,
                             0.0, 0.0, 0, None, (), 0, 0.0)
    readers = [a for a in agents if a.reused_tokens > 0]
    cos = [a.layer_cos for a in readers if a.layer_cos]
    layer_cos = tuple(mean(c[i] for c in cos) for i in range(len(cos[0]))) if cos else ()
    paired = pair(readers, ref) if readers and not mode.is_reference else None
    lora = [a for a in agents if a.key in refs[REFERENCE]]
    vs_lora = pair(lora, refs[REFERENCE]) if lora and mode.reference != REFERENCE else None
    return LayoutSummary(layout, True, "; ".join(sorted({u.note for u in us if u.note})),
                         len({a.round for a in agents}), len(agents), mean(a.valid for a in agents),
                         mean(a.f1 for a in agents), len(readers), paired, layer_cos,
                         sum(u.prefill_tokens for u in us), sum(u.seconds for u in us),
                         sum(u.context_kv_bytes for u in us), layers, mode.reference, vs_lora,
                         max(u.offset_table_bytes for u in us), sum(u.extra_flops for u in us),
                         _kv_ratio(us, unified_kv or {}))


def _kv_ratio(us: Sequence[Unit], unified_kv: dict[tuple[int, int], int]) -> float | None:
    base = [unified_kv.get((u.first, u.end), 0) for u in us]
    if not all(base) or not any(u.context_kv_bytes for u in us):
        return None
    return sum(u.context_kv_bytes for u in us) / sum(base)


def summaries(by: dict[str, list[Unit]]) -> list[LayoutSummary]:
    if REFERENCE not in by:
        raise ValueError(f"no {REFERENCE} units: every layout is compared with it")
    refs = {name: {a.key: a for a in units.agents_of(us)} for name, us in by.items()
            if modes.mode(name).is_reference}
    unified_kv = {(u.first, u.end): u.context_kv_bytes for u in by[REFERENCE]}
    return [summarize(layout, by[layout], refs, unified_kv)
            for layout in sorted(by, key=modes.order_key)]


def markdown(rows: Sequence[LayoutSummary], header: str) -> str:
    lines = [header, "",
             "Readers only, paired with their reference (unified, or alora_unified for the "
             "activated-LoRA rows) on the same questions; [95% CI], bootstrap over rounds. ΔF1 "
             "in F1 points (x100), ΔAST-valid in percentage points.", "",
             "| layout | rounds | answers | AST-valid (all) | F1 (all) | readers | paired with "
             "| reader F1 (reference) | ΔF1 | reader AST-valid (reference) | ΔAST-valid "
             "| greedy agreement | identical answers | hidden cos mean / last layer "
             "| context KV MiB (x unified) | recomputed layers | offset tables MiB / extra GFLOP "
             "| prefill tokens | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        if not s.available:
            lines.append(f"| {s.layout} | not available: {s.note} |" + " |" * 17)
            continue
        cos = f"{mean(s.layer_cos):.4f} / {s.layer_cos[-1]:.4f}" if s.layer_cos else "—"
        paired = "— | — | — | — | — | —" if s.paired is None else _paired_cells(s.paired)
        kv = f"{s.context_kv_bytes / 2**20:.1f}" if s.context_kv_bytes else "—"
        if s.kv_vs_unified is not None:
            kv += f" ({s.kv_vs_unified:.2f})"
        layers = ",".join(map(str, s.recompute_layers)) or "—"
        correction = (f"{s.offset_table_bytes / 2**20:.2f} / {s.extra_flops / 1e9:.1f}"
                      if s.offset_table_bytes else "—")
        lines.append(f"| {s.layout} | {s.rounds} | {s.answers} | {s.accuracy:.1%} "
                     f"| {s.token_f1:.3f} | {s.readers} | {s.reference} | {paired} | {cos} | {kv} "
                     f"| {layers} | {correction} | {s.prefill_tokens} | {s.seconds:.0f} |")
    variants = [s for s in rows if s.vs_lora is not None]
    if variants:
        lines += ["", "Against plain LoRA: every answer of the mode, paired with unified's to the "
                  "same questions (what the adapters' training variant costs, sharing aside).", "",
                  "| layout | answers | F1 (unified) | ΔF1 | AST-valid (unified) | ΔAST-valid "
                  "| greedy agreement | identical answers |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {s.layout} | {s.vs_lora.delta_f1.n} | {_paired_cells(s.vs_lora)} |"
                  for s in variants]
    return "\n".join(lines)


def _paired_cells(p: Paired) -> str:
    n = p.delta_f1.n
    return (f"{p.f1:.3f} ({p.f1_reference:.3f}) | {p.delta_f1.fmt(100)} | "
            f"{p.valid}/{n} ({p.valid_reference}/{n}) | {p.delta_valid.fmt(100)} | "
            f"{p.agreement.fmt_share()} | {p.identical.fmt_share()}")


def plot(rows: Sequence[LayoutSummary], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from forkserve.bench.output import save_figure

    # The hidden-state panel only where a unit recorded hidden states (diag, not eval).
    hidden = [s for s in rows if s.layer_cos]
    fig, axes = plt.subplots(1, 3 if hidden else 2, figsize=(18 if hidden else 13, 4.6))
    ax2, ax3 = axes[-2:]
    if hidden:
        ax1 = axes[0]
        for s in hidden:
            ax1.plot(range(len(s.layer_cos)), s.layer_cos, marker=".", label=s.layout)
        ax1.set_xlabel("layer")
        ax1.set_ylabel("cosine to unified (readers' own tokens)")
        ax1.set_title("hidden state after each layer")
        ax1.grid(alpha=0.3)
        ax1.legend()
    shown = [s for s in rows if s.paired is not None]
    for i, s in enumerate(shown):
        for offset, est, label in ((-0.15, s.paired.delta_f1, "ΔF1"),
                                   (0.15, s.paired.delta_valid, "ΔAST-valid")):
            ax2.errorbar(i + offset, est.mean * 100, yerr=[[(est.mean - est.low) * 100],
                                                           [(est.high - est.mean) * 100]],
                         fmt="o" if label == "ΔF1" else "s", capsize=4,
                         color="C0" if label == "ΔF1" else "C1", label=label if i == 0 else None)
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xticks(range(len(shown)), [f"{s.layout} (n={s.readers})" for s in shown],
                   rotation=35, ha="right", fontsize=8)
    ax2.set_ylabel("readers vs their reference (points), 95% CI")
    ax2.set_title("paired loss of the readers")
    if shown:
        ax2.legend()
    placed = [s for s in shown if s.kv_vs_unified is not None]  # kept against lost
    # The scale is the band where sharing modes differ; a mode far below it (no_lora) is
    # marked at the bottom edge with its figure instead of squashing the others into a line.
    floor = OFF_SCALE_POINTS
    labels: dict[float, list[tuple[float, float, str, Any]]] = {}

    def point(x: float, est: Estimate, label: str, color: Any, fmt: str) -> Any:
        y = est.mean * 100
        if y < floor:
            label, y = f"{label}: {y:+.1f} (off scale)", floor
            mark = ax3.plot([x], [y], marker="v", color=color)[0]
        else:
            mark = ax3.errorbar(x, y, yerr=[[y - est.low * 100], [est.high * 100 - y]], fmt=fmt,
                                mfc="none" if fmt == "D" else None, capsize=4, color=color)[0]
        labels.setdefault(round(x, 3), []).append((x, y, label, mark.get_color()))
        return mark

    for i, s in enumerate(placed):
        mark = point(s.kv_vs_unified, s.paired.delta_f1, s.layout, f"C{i % 10}", "o")
        if s.vs_lora is not None:  # a variant of the adapters: its own price, sharing aside
            point(s.kv_vs_unified, s.vs_lora.delta_f1, f"{s.layout}: every answer vs plain LoRA",
                  mark.get_color(), "D")
    # Modes at one KV ratio share an x: their labels go down a column beside it, in the order
    # of their points, each at least a line below the one above, tied to its point.
    step = (PLOT_TOP - floor) / 22
    for column in labels.values():
        last = float("inf")
        for x, y, label, color in sorted(column, key=lambda c: -c[1]):
            last = min(y, last - step)
            ax3.annotate(label, (x, y), xytext=(x + 0.012, last), fontsize=7, color=color,
                         va="center", arrowprops=dict(arrowstyle="-", lw=0.4, color=color))
    ax3.set_ylim(floor - 3, PLOT_TOP)
    ax3.axhline(0, color="grey", lw=0.8)
    ax3.set_xlabel("shared context's KV bytes, x unified")
    ax3.set_ylabel("readers' ΔF1 vs their reference (points), 95% CI")
    ax3.set_title("quality against memory")
    fig.suptitle(textwrap.fill(title, 170), fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


def write_outputs(folder: Path, label: str = "") -> str:
    """quality_<tag>.{json,md,png} beside the units' folder quality_<tag>/; returns the table."""
    by = units.load(folder)
    rows = summaries(by)
    setting = dict(by[REFERENCE][0].setting)
    setting.update({k: u.setting[k] for us in by.values() for u in us for k in units.OPTIONAL
                    if k in u.setting})
    cats = setting["categories"]
    alora = f" (aLoRA: {setting['alora_adapters']})" if "alora_adapters" in setting else ""
    header = (f"model {setting['model']}; adapters {setting.get('adapters', 'none')}{alora} "
              f"{label}; K = {len(cats)} "
              f"tasks ({', '.join(cats)}); {setting['distractors']} distractor items in each "
              f"catalog; greedy, max {setting['max_new']} new tokens; {setting['device']} "
              f"{setting['dtype']} {setting['attention']}"
              f"{' cuda-graphs' if setting['cuda_graphs'] else ''}")
    if "offset_fit" in setting:
        fit = setting["offset_fit"]
        header += (f"; offset rows: tables fitted on {fit['anchors_per_task']} training "
                   f"prompts per task (ridge {fit['ridge']}), {fit['attention']} attention")
    commits = sorted({u.commit or "unrecorded" for us in by.values() for u in us})
    header += f"; measured at {', '.join(commits)}"
    table = markdown(rows, header)
    prefix = folder.parent / folder.name
    prefix.with_suffix(".md").write_text(table + "\n")
    prefix.with_suffix(".json").write_text(json.dumps(
        {"setting": setting, "label": label, "commits": commits,
         "units": sorted(u.name for us in by.values() for u in us),
         "summaries": [asdict(s) for s in rows]}, indent=1))
    plot(rows, header, prefix.with_suffix(".png"))
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="the units' folder, RESULTS/quality_<tag>")
    ap.add_argument("--label", default="", help="what the adapters are (printed with the table)")
    args = ap.parse_args(argv)
    print(write_outputs(args.folder, args.label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
