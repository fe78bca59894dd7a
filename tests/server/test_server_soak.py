"""A short soak (the CI version of benchmarks/soak_bench.py): concurrent clients mixing chat,
fork/commit and random disconnects -> zero 5xx, zero leaked pages by the engine's accounting."""
from __future__ import annotations

from server_testlib import start

from tests.benchmark_script import load_script


def test_short_soak_has_no_5xx_and_no_leaked_pages(tiny_model_dir):
    soak = load_script("soak_bench")
    # A small pool (page 4 tokens): eviction of published pages happens during the run too.
    cfg = soak.SoakConfig(clients=24, duration_s=8.0, max_tokens=8, seed=1, session_ttl_s=5.0)
    with start(tiny_model_dir, num_pages=1024, session_ttl_s=cfg.session_ttl_s) as server:
        report = soak.run_soak(server, cfg)
    print("\n" + report.table())
    assert report.requests > 100 and report.disconnects > 0
    assert report.five_xx == 0 and not report.unexpected
    assert report.sessions_left == 0 and report.pages_used_after == report.pages_published_after
    assert report.pages_used_after_evict == 0 and report.integrity_ok
