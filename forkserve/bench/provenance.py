"""Which source a benchmark row was measured on: every committed result names its commit."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def source_commit() -> str:
    """``FORKSERVE_COMMIT`` (set by whoever copies the tree to a machine without ``.git``),
    else ``git rev-parse HEAD`` of the package's checkout (``+dirty`` with local changes),
    else ``"unknown"``."""
    if os.environ.get("FORKSERVE_COMMIT"):
        return os.environ["FORKSERVE_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
