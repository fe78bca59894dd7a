"""Worker processes of ``--jobs`` (train.py, evaluate.py): a small model leaves the GPU idle
while one process's host work runs, so several processes share it.

A worker is this repository's module run again with its own narrowed command line; it writes
its results to files its parent names, and it ends when its parent does.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the workers import benchmarks.quality from here
PARENT_ENV = "FORKSERVE_TRAIN_PARENT"  # set in a worker's environment: its parent's pid


def worker_env(jobs: int) -> dict[str, str]:
    """The environment of one of ``jobs`` workers: this module importable by name however the
    parent was started (pytest, -m), and a share of the cores each, since workers that each
    spin up a thread per core slow one another down (3 steps of the tiny model: 10 s, not 1)."""
    threads = max(1, len(os.sched_getaffinity(0)) // jobs)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads),
                **{PARENT_ENV: str(os.getpid())})


def die_with_parent() -> None:
    """A worker ends when its parent does (Linux): a parent killed on its own, not through
    the call's ``timeout``, would otherwise leave workers running that no log lists."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the call above took effect
        raise SystemExit(f"the parent process {parent} is gone")
