"""Kernel tests run natively on CUDA (bf16) and under the Triton interpreter elsewhere (fp32).

TRITON_INTERPRET must be set before triton is first imported, hence at conftest import.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

# Importable without an editable install: put the repository root first on the path.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
