"""A short soak (the CI version of benchmarks/soak_bench.py): concurrent clients mixing chat,
fork/commit and random disconnects -> zero 5xx, zero leaked pages by the engine's accounting."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from server_testlib import start

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_bench.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak_bench", _BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_short_soak_has_no_5xx_and_no_leaked_pages(tiny_model_dir):
    soak = _soak_module()
    # A small pool (page 4 tokens): eviction of published pages happens during the run too.
    cfg = soak.SoakConfig(clients=24, duration_s=8.0, max_tokens=8, seed=1, session_ttl_s=5.0)
    with start(tiny_model_dir, num_pages=1024, session_ttl_s=cfg.session_ttl_s) as server:
        report = soak.run_soak(server, cfg)
    print("\n" + report.table())
    assert report.requests > 100 and report.disconnects > 0
    assert report.five_xx == 0 and not report.unexpected
    assert report.sessions_left == 0 and report.pages_used_after == report.pages_published_after
    assert report.pages_used_after_evict == 0 and report.integrity_ok
