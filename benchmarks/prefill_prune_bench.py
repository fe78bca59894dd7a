"""Seed 000's fan-out table: apc / alias / disagg / cascade side by side (MockBackend).

    python benchmarks/prefill_prune_bench.py [--sessions 10 --trunk 256 ... --out DIR]

Same as ``forkserve bench fanout``; writes fanout.json and fanout.png to --out
(default ./forkserve-bench-results).
"""
from forkserve.bench.fanout import main

if __name__ == "__main__":
    raise SystemExit(main())
