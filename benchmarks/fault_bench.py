"""Failure isolation at scale: thousands of injected faults, zero cross-session effects.

    python benchmarks/fault_bench.py [--faults 5000] [--torch-faults 300] [--out DIR]

Runs the fault-injection state machine of the tests (``tests/control/fault_machine.py``) in
every layout, cascade on and off, until each has absorbed its share of ``--faults``
injected faults (over-long and never-fitting prompts, backend errors mid-step named or
not, adapters removed behind the engine, client aborts, bad tokens). Every step checks the
machine's invariants: integrity with the written-positions check, every table and every
published page holding exactly the KV of its key, and every unfaulted session's output
equal to a fresh engine's. Any violation is a cross-session effect and is reported with
its falsifying example. Then the same on the TorchBackend (tiny random Llama, CPU) for
``--torch-faults``. Writes ``fault_bench.json`` (after each machine) and ``fault_bench.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "control"), str(ROOT / "tests" / "integration")]

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402
from tqdm import tqdm  # noqa: E402

from forkserve import KVLayout  # noqa: E402
from forkserve.bench.output import add_out_argument  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402


def _machines():
    import test_fault_isolation as t

    return {m.__name__: m for m in t.MACHINES}


def run_mock(faults: int, results: dict, save) -> None:
    machines = _machines()
    share = -(-faults // len(machines))
    for name, machine in machines.items():
        machine.faults = 0
        t0, runs, failure = time.perf_counter(), 0, None
        with tqdm(total=share, desc=f"mock {name}", unit="fault") as bar:
            while machine.faults < share and failure is None:
                seen = machine.faults
                try:
                    run_state_machine_as_test(machine, settings=settings(
                        max_examples=10, stateful_step_count=40, deadline=None, database=None,
                        suppress_health_check=list(HealthCheck)))
                except Exception as exc:  # noqa: BLE001 - a violation: recorded, not hidden
                    failure = f"{type(exc).__name__}: {exc}"[:4000]
                runs += 1
                bar.update(min(machine.faults, share) - min(seen, share))
        results["mock"][name] = {"faults": machine.faults, "runs": runs,
                                 "cross_session_effects": 0 if failure is None else 1,
                                 "failure": failure, "seconds": round(time.perf_counter() - t0, 1)}
        save()


def run_torch(faults: int, results: dict, save) -> None:
    import torch_faults
    from tiny_llama import save_tiny_llama

    layouts = (KVLayout.UNIFIED, KVLayout.DISAGGREGATED, KVLayout.ADAPTIVE)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_llama(Path(tmp))
        for layout in tqdm(layouts, desc="torch layouts"):
            t0 = time.perf_counter()
            report = torch_faults.run(model_dir, layout, -(-faults // len(layouts)), seed=1)
            results["torch"][layout.value] = {**report.__dict__,
                                              "seconds": round(time.perf_counter() - t0, 1)}
            save()


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from forkserve.bench.output import save_figure

    rows = [(f"mock {k}", v) for k, v in results["mock"].items()] + \
           [(f"torch {k}", v) for k, v in results["torch"].items()]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    names = [r[0] for r in rows]
    ax.barh(names, [r[1]["faults"] for r in rows], color="tab:blue", label="injected faults")
    for i, (_, r) in enumerate(rows):
        ax.text(r["faults"], i, f"  {r['cross_session_effects']} cross-session effects",
                va="center", color="tab:red" if r["cross_session_effects"] else "tab:green")
    ax.set_xlabel("injected faults")
    total = sum(r[1]["faults"] for r in rows)
    ax.set_title(f"Failure isolation: {total} injected faults (CPU)")
    ax.set_xlim(0, max(r[1]["faults"] for r in rows) * 1.6)
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--faults", type=int, default=5000, help="faults injected on the MockBackend")
    ap.add_argument("--torch-faults", type=int, default=300, help="faults on the TorchBackend")
    add_out_argument(ap)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "fault_bench.json"
    results: dict = {"commit": source_commit(), "mock": {}, "torch": {}}

    def save() -> None:
        out.write_text(json.dumps(results, indent=2) + "\n")

    run_mock(args.faults, results, save)
    if args.torch_faults:
        run_torch(args.torch_faults, results, save)
    rows = {**{f"mock {k}": v for k, v in results["mock"].items()},
            **{f"torch {k}": v for k, v in results["torch"].items()}}
    print(f"\n{'machine':<28}{'faults':>8}{'cross-session effects':>24}{'s':>8}")
    for name, r in rows.items():
        print(f"{name:<28}{r['faults']:>8}{r['cross_session_effects']:>24}{r['seconds']:>8}")
        if r.get("failure"):
            print(f"  {r['failure'][:600]}")
    total = sum(r["faults"] for r in rows.values())
    effects = sum(r["cross_session_effects"] for r in rows.values())
    results["total_faults"], results["cross_session_effects"] = total, effects
    save()
    plot(results, args.out / "fault_bench.png")
    print(f"\n{total} injected faults, {effects} cross-session effects\n"
          f"wrote {out} and {args.out / 'fault_bench.png'}")
    return 1 if effects else 0


if __name__ == "__main__":
    sys.exit(main())
