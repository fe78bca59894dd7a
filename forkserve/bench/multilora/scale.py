"""The two scales of the multi-LoRA workloads: their defaults, and how a tiny run uses the CPU."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scale:
    """The defaults of one scale: the workload as docs/WORKLOADS.md fixes it on the 8B shape,
    or a 2-layer model small enough that every system at every W runs in under 3 minutes on
    2 CPU cores, with room for every system (no run fails at these defaults)."""

    workflows: tuple[int, ...]
    context: int
    turns: int
    gen: int
    kv_budget_gib: float
    residual_share: float   # a quarter of the tiny model's 64-dim K/V is its rank-16 residual


FULL = Scale(workflows=(1, 8, 32), context=8192, turns=3, gen=64, kv_budget_gib=24.0,
             residual_share=0.1)
TINY = Scale(workflows=(1, 4, 8), context=1024, turns=3, gen=32, kv_budget_gib=0.02,
             residual_share=0.5)


@contextlib.contextmanager
def tiny_threads(device: torch.device, tiny: bool):
    """The tiny model's matmuls are too small to split: a thread pool only adds wake-ups
    (10x slower on a busy 2-core machine), so tiny CPU runs use one thread while they run."""
    before = torch.get_num_threads()
    if tiny and device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
