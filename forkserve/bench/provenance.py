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


def measured_on(doc: dict) -> str:
    """A result file's card and commit as one caption line for its plot ("NVIDIA H100 80GB
    HBM3, 241e214"): a PNG read apart from its JSON still says where it was measured. The
    file's ``gpu`` (else its ``device``) and ``commit`` fields; empty where it has neither."""
    where = doc.get("gpu") or doc.get("device") or ""
    commit = str(doc.get("commit") or "")[:7]
    return ", ".join(x for x in (where, commit) if x)
