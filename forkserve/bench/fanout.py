"""The ``fanout`` workload (seed 000's cost-model table) on the MockBackend.

Ten sessions share one trunk text (256 tokens); each fans out four 32-token thoughts:
index 0 the winner (a legal tool call), one repeated loop, one illegal tool call, one
ordinary thought. Four systems run the same workload side by side:

* ``apc``     prefix caching, first expand: every child is its own request carrying
              trunk + residual, all arriving together (so none hits the cache).
* ``alias``   ForkServe without the cascade: fork aliases the trunk, every residual
              is prefilled.
* ``disagg``  ``apc`` on prefill/decode disaggregation: every prefilled page moves.
* ``cascade`` ``plus_config()``: hash probe, loop skip, early abort, the connector
              moving only kept residual miss tails.

Sessions run one after another, each committing its winner before the next fans out,
so the winner published by session 1 is a hash hit for sessions 2-10. Peak KV is the sum
over sessions of each session's peak *non-reclaimable* KV (the memory one must
provision to run them concurrently); with the cascade's two-class scheduler, unpinned
speculative pages are preemptible cache and do not count. See docs/COST_MODEL.md.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from forkserve.backend.byte_tokenizer import ByteTokenizer
from forkserve.backend.mock import MockBackend
from forkserve.bench.output import add_out_argument, new_figure, save_figure, write_json
from forkserve.config import ForkServeConfig, PrefixDedup, plus_config
from forkserve.engine import Engine

SYSTEMS = ("apc", "alias", "disagg", "cascade")
SEED_ROWS = {  # seed 000's table, for the side-by-side print
    "apc": (11520, 139.0, 0, 11520, 0),
    "alias": (3840, 47.1, 0, 3840, 0),
    "disagg": (11520, 162.1, 11520, 11520, 0),
    "cascade": (3232, 40.3, 672, 2880, 10),
}


@dataclass(frozen=True)
class FanoutParams:
    sessions: int = 10
    trunk: int = 256
    residual: int = 32
    fanout: int = 4
    page_size: int = 16
    # The seed's sessions share one trunk text; distinct trunks (a session marker up front)
    # is how plain vLLM was measured in docs/ANCHORS.md: no prefix hit across sessions.
    distinct_trunks: bool = False
    # In flight (the default): sessions opened together compute a shared prefix once. The
    # seed's arithmetic assumes every open computes its own copy: ``PrefixDedup.OFF``.
    prefix_dedup: PrefixDedup = PrefixDedup.IN_FLIGHT


@dataclass(frozen=True)
class FanoutRow:
    system: str
    prefill_tokens: int
    fanout_ms: float
    transfer_tokens: int
    peak_kv_tokens: int
    pruned: int
    prefill_calls: int
    decode_tokens: int
    resident_peak_tokens: int
    probe_aborts: int
    actions: dict


def _fit(text: str, n: int, tok: ByteTokenizer) -> list[int]:
    ids = tok.encode(text)
    if len(ids) < n:
        ids += tok.encode(" ") * (n - len(ids))
    return ids[:n]


def build_workload(params: FanoutParams) -> tuple[list[list[int]], list[list[int]]]:
    """Each session's trunk and the thoughts (winner, loop, illegal, ordinary, ...); a
    session's thoughts are the same text, the loop repeats the session's own trunk end."""
    tok = ByteTokenizer()
    prose = ("System: you are a coding agent with tools search(q) and run(cmd). "
             "User: find why the nightly build fails and propose a fix. ")
    trunk = _fit(prose * (params.trunk // len(prose) + 1), params.trunk, tok)
    # A marker at the front changes every block's hash and leaves the trunk's end (the loop
    # thought repeats it) the same.
    trunks = [_fit(f"Session {k}. ", 12, tok) + trunk[12:] if params.distinct_trunks else trunk
              for k in range(params.sessions)]
    thoughts = [
        _fit('Action: search({"q": "nightly build log"})', params.residual, tok),
        trunk[-params.residual:],                                  # a repeated loop
        _fit('Action: run({"cmd": "make test", "cwd": ', params.residual, tok),  # no close
        _fit("Thought: the failure may come from the cache.", params.residual, tok),
    ]
    while len(thoughts) < params.fanout:
        thoughts.append(_fit(f"Thought: alternative plan {len(thoughts)}.", params.residual, tok))
    return trunks, thoughts[:params.fanout]


def engine_config(system: str, params: FanoutParams, **overrides) -> ForkServeConfig:
    """``alias`` / ``cascade`` (and the cost model's ``apc`` / ``disagg``); ``overrides``
    fit a real engine (``disaggregated_prefill=False`` on one GPU, the model's vocab)."""
    # One tick takes every request of the wave, so no prefill is split into two calls.
    base = dict(page_size=params.page_size, num_pages=8192, hbm_tokens=8192 * params.page_size,
                max_batch_tokens=65536, branch_cap=max(6, params.fanout),
                disaggregated_prefill=system in ("disagg", "cascade"),
                prefix_dedup=params.prefix_dedup)
    base.update(overrides)
    if system == "cascade":
        return plus_config(**base)
    return ForkServeConfig(**base)


def drive(engine: Engine, system: str, params: FanoutParams) -> int:
    """The workload on ``engine``: sessions one after another (``apc``/``disagg``: every
    child its own request, all at once). Returns the summed per-session peak KV tokens."""
    trunks, thoughts = build_workload(params)
    if system in ("apc", "disagg"):
        handles = [engine.open(trunk + t) for trunk in trunks for t in thoughts]
        engine.drain_slack()
    else:
        handles = [engine.open(trunk) for trunk in trunks]
        for h in handles:
            kids = [engine.fork(h.id, h.tip, f"thought{i}", t) for i, t in enumerate(thoughts)]
            for i, kid in enumerate(kids):
                engine.speculate(h.id, kid, priority=0.9 if i == 0 else 0.5)
            engine.drain_slack()
            engine.commit(h.id, h.tip, thoughts[0])
    engine.check_integrity()
    return sum(engine.session_summary(h.id).peak_tokens for h in handles)


def run_system(system: str, params: FanoutParams, **overrides) -> FanoutRow:
    """One system on the MockBackend (its cost model's ms)."""
    engine = Engine(MockBackend(engine_config(system, params, **overrides)))
    peaks = drive(engine, system, params)
    m = engine.metrics
    return FanoutRow(system, m.prefill_tokens, round(m.prefill_ms, 3), m.transfer_tokens, peaks,
                     m.pruned, m.prefill_calls, m.decode_tokens, m.peak_pages * params.page_size,
                     m.probe_aborts, dict(m.actions))


def format_table(rows: list[FanoutRow]) -> str:
    head = (f"{'system':<8} {'prefill tok':>11} {'fan-out ms':>10} {'transfer tok':>12} "
            f"{'peak KV':>8} {'pruned':>6} | seed: prefill / ms / transfer / peak / pruned")
    lines = [head, "-" * len(head)]
    for r in rows:
        seed = SEED_ROWS.get(r.system)
        seed_s = " / ".join(str(x) for x in seed) if seed else "-"
        lines.append(f"{r.system:<8} {r.prefill_tokens:>11} {r.fanout_ms:>10.1f} "
                     f"{r.transfer_tokens:>12} {r.peak_kv_tokens:>8} {r.pruned:>6} | {seed_s}")
    apc = next((r for r in rows if r.system == "apc"), None)
    if apc:
        for r in rows:
            if r.system != "apc":
                lines.append(f"{r.system} vs apc: "
                             f"prefill {r.prefill_tokens / apc.prefill_tokens - 1:+.1%}, "
                             f"fan-out {r.fanout_ms / apc.fanout_ms - 1:+.1%}, "
                             f"peak KV {r.peak_kv_tokens / apc.peak_kv_tokens - 1:+.1%}")
    return "\n".join(lines)


def plot(rows: list[FanoutRow], path: Path) -> None:
    """Each figure of the table as bars, systems side by side (all four relative to apc)."""
    fig, axes = new_figure(3, width=12, height=3.8)
    figures = (("prefill tokens", lambda r: r.prefill_tokens),
               ("fan-out ms (modeled)", lambda r: r.fanout_ms),
               ("peak KV tokens", lambda r: r.peak_kv_tokens))
    names = [r.system for r in rows]
    for ax, (label, value) in zip(axes, figures, strict=True):
        bars = ax.bar(names, [value(r) for r in rows], color=[f"C{i}" for i in range(len(rows))])
        ax.bar_label(bars, fmt="%g", fontsize=8)
        ax.set(title=label)
        ax.margins(y=0.15)  # room for the bar labels
    fig.suptitle("fanout: prefix caching vs ForkServe (MockBackend cost model)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="forkserve bench fanout",
        description="seed 000's fan-out table (docs/WORKLOADS.md): prefix caching, alias, "
                    "disaggregation and the cascade side by side on the MockBackend cost model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10, help="sessions, one after another")
    ap.add_argument("--trunk", type=int, default=256, help="trunk tokens shared by a fan-out")
    ap.add_argument("--residual", type=int, default=32, help="tokens of each thought")
    ap.add_argument("--fanout", type=int, default=4, help="thoughts per session")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--prefix-dedup", choices=[m.value for m in PrefixDedup], default="in_flight",
                    help="in_flight: sessions opened together compute a shared prefix once; "
                         "off: each computes its own copy (the seed's arithmetic)")
    ap.add_argument("--system", choices=SYSTEMS + ("forkserve_plus", "all"), default="all",
                    help="one system (forkserve_plus = cascade) or all side by side")
    ap.add_argument("--tiny", action="store_true",
                    help="accepted for symmetry with react/mapreduce: fanout always runs on the "
                         "MockBackend in seconds")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    params = FanoutParams(args.sessions, args.trunk, args.residual, args.fanout, args.page_size,
                          prefix_dedup=PrefixDedup(args.prefix_dedup))
    systems = SYSTEMS if args.system == "all" else (
        ("cascade",) if args.system == "forkserve_plus" else (args.system,))
    rows = [run_system(s, params) for s in systems]
    print(f"fanout workload: {asdict(params)}; backend: MockBackend cost model (modeled ms)")
    print(format_table(rows))
    write_json(args.out / "fanout.json", {"workload": "fanout", "params": asdict(params),
                                          "backend": "mock-cost-model",
                                          "rows": [asdict(r) for r in rows]})
    plot(rows, args.out / "fanout.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
