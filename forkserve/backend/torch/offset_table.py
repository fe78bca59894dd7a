"""Offset tables (docs/QUALITY.md, mode d): per (writer, reader) adapter pair and layer, an
estimate of how far the reader's own base K/V is from the base K/V the writer's forward left
in the shared pages, fitted once on anchor prompts both computed.

Per layer n and side s (K or V), with z the writer's base value of a token before RoPE
(z_k = h_W W_k + b_k, z_v = h_W W_v) and d = (h_X - h_W) W_s the reader X's offset:

    d^ = c + (z U) V^T           c [kv], U [kv, r], V^T [r, kv]

fitted by least squares over the anchor tokens: rank 0 is the mean offset (c = mean d); rank
r > 0 is a ridge regression of d on z (centred) cut to rank r (reduced-rank regression: the
fit's top-r output directions), so a token's correction follows its own base value, as
KVCOMM's offsets follow the anchors' (it predicts from what the reader has on read: the
stored base, nothing of its own). The map runs over all KV heads of the layer at once, since
every head reads the same h. A pair whose offsets are all zero (the writer is the reader)
fits c = 0, U = 0 exactly. Applied on read (``base_correction.py``): K after de-rotating the
stored K to z_k and re-rotating d^_k at the token's position; V as is.

The writer ``BASE_MODEL`` (a neutral writer, mode a) is one more writer of the same form.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

BASE_MODEL = ""  # the writer (or reader) that runs no adapter


@dataclass(frozen=True)
class PairOffset:
    """One (writer, reader) pair's fitted offsets, every layer, K and V (side 0 K, 1 V)."""

    writer: str   # adapter name, BASE_MODEL for the base model
    reader: str
    c: torch.Tensor    # [layers, 2, kv]
    u: torch.Tensor    # [layers, 2, kv, rank]
    vt: torch.Tensor   # [layers, 2, rank, kv]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.c, self.u, self.vt))


@dataclass(frozen=True)
class OffsetTable:
    rank: int
    ridge: float              # relative: lambda = ridge * mean eigenvalue of z's covariance
    anchor_tokens: int        # tokens every pair was fitted over
    pairs: tuple[PairOffset, ...]

    @property
    def nbytes(self) -> int:
        """What holding the tables costs (every pair, every layer)."""
        return sum(p.nbytes for p in self.pairs)

    def flops_per_read(self, kv_size: int) -> int:
        """Extra FLOPs per corrected token per layer on read: K de-rotated and the estimate
        rotated (3 kv each), c added on both sides (kv each), and at rank r the map on both
        sides (z U and then V^T: 4 kv r per side)."""
        return 6 * kv_size + 2 * kv_size + 2 * 4 * kv_size * self.rank

    def save(self, path: Path) -> None:
        torch.save({"rank": self.rank, "ridge": self.ridge, "anchor_tokens": self.anchor_tokens,
                    "pairs": [(p.writer, p.reader, p.c, p.u, p.vt) for p in self.pairs]}, path)

    @classmethod
    def load(cls, path: Path) -> "OffsetTable":
        d = torch.load(path)
        return cls(d["rank"], d["ridge"], d["anchor_tokens"],
                   tuple(PairOffset(*p) for p in d["pairs"]))


def fit_side(z: torch.Tensor, d: torch.Tensor, rank: int,
             ridge: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer and side: z, d [N, kv] -> (c [kv], U [kv, rank], V^T [rank, kv]), in float64."""
    z, d = z.double(), d.double()
    kv = z.shape[1]
    z_mean, d_mean = z.mean(0), d.mean(0)
    if rank == 0:
        return d_mean, z.new_zeros(kv, 0), z.new_zeros(0, kv)
    zc, dc = z - z_mean, d - d_mean
    gram = zc.T @ zc
    lam = ridge * gram.diagonal().mean().clamp(min=1e-12)
    m = torch.linalg.solve(gram + lam * torch.eye(kv, dtype=z.dtype, device=z.device), zc.T @ dc)
    # Reduced rank: keep the directions of the fitted offsets that carry the most of them.
    _, _, vh = torch.linalg.svd(zc @ m, full_matrices=False)
    vt = vh[:rank]
    u = m @ vt.T
    return d_mean - z_mean @ u @ vt, u, vt


def fit_pair(writer: str, reader: str, z_k: Sequence[torch.Tensor], z_v: Sequence[torch.Tensor],
             own_k: Sequence[torch.Tensor], own_v: Sequence[torch.Tensor], rank: int,
             ridge: float) -> PairOffset:
    """Per layer: the writer's base K (before RoPE) and V over the anchors, z_k[n] / z_v[n]
    [N, kv], and the reader's own over the same tokens."""
    sides = [[fit_side(z, own - z, rank, ridge) for z, own in ((zk, ok), (zv, ov))]
             for zk, zv, ok, ov in zip(z_k, z_v, own_k, own_v, strict=True)]
    dtype = z_k[0].dtype
    stack = [torch.stack([torch.stack([s[i] for s in layer]) for layer in sides]).to(dtype)
             for i in range(3)]
    return PairOffset(writer, reader, *stack)
