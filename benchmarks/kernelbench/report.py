"""A bench mode's result file: its header, saving after every case, the PNG and the
printed table."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from benchmarks.kernelbench.setup import Setup
from forkserve.bench.output import save_figure
from forkserve.bench.provenance import source_commit


def result_header(s: Setup, **fields) -> dict:
    """The head of a result file (prefill, mixed, decode variants): machine, versions and
    shape, then ``fields`` (its timing note, its empty row lists)."""
    import triton
    return {
        "device": "cpu (interpreter)" if s.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(s.dtype),
        "commit": source_commit(),
        "shape": {"n_heads": s.n_heads, "n_kv": s.n_kv, "head_dim": s.head_dim, "rank": s.rank,
                  "page_size": s.page},
        **fields,
    }


def save_titled(fig, res: dict, path: Path, what: str = "") -> None:
    """A mode's figure titled with ``what`` and the run (device, dtype, shape, commit),
    laid out and saved at ``path``."""
    sh = res["shape"]
    fig.suptitle(f"{what}{res['device']} {res['dtype']} H={sh['n_heads']} Hkv={sh['n_kv']} "
                 f"D={sh['head_dim']} r={sh['rank']} page={sh['page_size']}, "
                 f"commit {res['commit'][:10]}")
    fig.tight_layout()
    save_figure(fig, path, dpi=110, quiet=True)


def publish(res: dict, path: Path, plot_fn: Callable[[dict, Path], None],
            print_fn: Callable[[dict], None]) -> None:
    """The JSON at ``path``, its PNG beside it (a plot that fails is said, not fatal), the
    printed table and the errors."""
    path.write_text(json.dumps(res, indent=1))
    try:
        plot_fn(res, path.with_suffix(".png"))
    except Exception as exc:
        print(f"plot failed: {exc!r}", flush=True)
    print_fn(res)
    for e in res.get("errors", []):
        print("ERROR", e)


def run_mode(res: dict, path: Path, what: str, run: Callable[[Callable[[], None]], None],
             plot_fn: Callable[[dict, Path], None], print_fn: Callable[[dict], None],
             plot_each: bool = False) -> dict:
    """One bench mode: ``run(save)`` measures into ``res`` and calls ``save()`` after every
    case (the JSON, and with ``plot_each`` the PNG too, so a call cut at its time limit keeps
    what it measured); a failure is recorded, not fatal; then ``publish``."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(res, indent=1))
        if plot_each:
            try:
                plot_fn(res, path.with_suffix(".png"))
            except Exception as exc:
                print(f"plot failed: {exc!r}", flush=True)

    try:
        run(save)
    except Exception as exc:  # keep what was measured; report the failure
        res.setdefault("errors", []).append(f"{what}: {exc!r}"[:1000])
        print(f"{what} FAILED: {exc!r}", flush=True)
    publish(res, path, plot_fn, print_fn)
    return res
