"""Benchmark workloads of ../shared/workloads.md, runnable from the CLI and benchmarks/."""
