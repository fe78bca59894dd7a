"""benchmarks/ws_probe.py's loop (a paged decode over page-granular TMA boxes, the shape
Triton's Hopper warp specialization would need) in the interpreter against a float32
softmax over the gathered pages: the probe's kernel computes what it claims to, so its
sm_90 builds (run on demand: ~25 s) probe the right loop."""
from __future__ import annotations

import os

import pytest
import torch

from tests.benchmark_script import load_script

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                or torch.cuda.is_available(),
                                reason="the interpreter's run (CPU)")


def test_probe_loop_matches_float32() -> None:
    assert load_script("ws_probe").check_interpreted() < 1e-3
