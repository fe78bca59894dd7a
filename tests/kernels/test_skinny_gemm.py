"""The skinny GEMM (kernels/skinny_gemm.py) equals ``F.linear`` (and ``silu_mul`` after it) at
every row count of a decode batch, with bias and strided operands, and runs only where its
tuning names the shape.

Operands are 16-bit (the kernel's contract): bf16 on CUDA, fp16 in the interpreter (which
holds bf16 as raw integers). Both sides see the same rounded inputs and accumulate in
float32, so they differ by the order of the sums and one rounding of the output.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testlib import DEVICE, ON_CUDA

from forkserve.kernels import skinny_gemm
from forkserve.kernels.glue import silu_mul_triton
from forkserve.kernels.skinny_gemm import (
    ShapeKey,
    SkinnyLinear,
    SkinnyTile,
    SkinnyTuning,
    even_tiles,
    skinny_mm,
)

DTYPE = torch.bfloat16 if ON_CUDA else torch.float16
TOL = 2e-2 if ON_CUDA else 2e-3  # relative to the output's largest magnitude
TILE = SkinnyTile(block_n=16, block_k=32, warps=4, stages=2)


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    scale = ref.float().abs().max().clamp_min(1e-6)
    return bool(((out.float() - ref.float()).abs().max() / scale) < TOL)


def _operands(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as a column slice of a NaN-padded buffer (row stride above K) and W as a row slice
    of one (rows outside it NaN): a read past either shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    xb = torch.full((rows, k + 24), float("nan"))
    xb[:, 8:8 + k] = torch.randn(rows, k, generator=gen)
    wb = torch.full((n + 32, k), float("nan"))
    wb[16:16 + n] = torch.randn(n, k, generator=gen) / k ** 0.5
    xb, wb = xb.to(DEVICE, DTYPE), wb.to(DEVICE, DTYPE)
    return xb[:, 8:8 + k], wb[16:16 + n]


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_skinny_mm_equals_linear(rows, bias, split_k):
    x, w = _operands(rows, 64, 96, seed=rows)
    b = torch.randn(64, generator=torch.Generator().manual_seed(5)).to(DEVICE, DTYPE) \
        if bias else None
    out = skinny_mm(x, w, TILE._replace(split_k=split_k), b)
    assert out.shape == (rows, 64) and out.dtype == DTYPE and out.is_contiguous()
    assert torch.isfinite(out).all()
    assert _close(out, F.linear(x, w, b))


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gate_up_silu_equals_linear_then_silu_mul(rows, split_k):
    x, w = _operands(rows, 2 * 48, 64, seed=10 + rows)  # gate rows 0-47, up rows 48-95
    out = skinny_mm(x, w, TILE._replace(split_k=split_k), silu=True)
    assert out.shape == (rows, 48)
    assert _close(out, silu_mul_triton(F.linear(x, w)))


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("silu", [False, True])
def test_norm_folded_equals_rms_norm_then_linear(rows, silu):
    """``norm``: the product of ``rms_norm(x) * gamma`` from x itself (the sums of squares
    from the K loop's tiles, gamma on each tile, 1/rms per row after the loop): what the
    norm kernel then ``F.linear`` (and ``silu_mul``) compute, up to rounding. x at the scale
    of a residual stream (not normed), gamma away from 1."""
    n = 2 * 48 if silu else 64
    x, w = _operands(rows, n, 96, seed=20 + rows)
    x = (x.float() * 8).to(DTYPE)
    gamma = (0.5 + torch.rand(96, generator=torch.Generator().manual_seed(3))).to(DEVICE, DTYPE)
    out = skinny_mm(x, w, TILE, silu=silu, norm=(gamma, 1e-5))
    ref = F.linear(F.rms_norm(x, (96,), gamma, 1e-5), w)
    assert _close(out, silu_mul_triton(ref) if silu else ref)


@pytest.mark.parametrize("split_k", [1, 3])
def test_residual_added_in_the_epilogue(split_k):
    """``residual``: ``r + F.linear(x, w)`` in the store (the residual stream's add), split
    in K too (the last split adds it)."""
    x, w = _operands(7, 64, 96, seed=31)
    r = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE, DTYPE)
    out = skinny_mm(x, w, TILE._replace(split_k=split_k), residual=r)
    assert _close(out, r + F.linear(x, w))


def test_split_k_sums_in_a_fixed_order():
    """Split in K, the last split to finish sums the float32 partials in split order,
    whichever split that is: repeated calls agree bit for bit (on the GPU the splits finish
    in a different order each time; an atomic sum would not)."""
    x, w = _operands(8, 64, 96, seed=7)
    tile = TILE._replace(split_k=3)
    first = skinny_mm(x, w, tile)
    assert all(torch.equal(first, skinny_mm(x, w, tile)) for _ in range(5))
    assert _close(first, F.linear(x, w))


@pytest.mark.parametrize("silu", [False, True])
def test_split_k_wide_tiles_sum_in_slices(silu):
    """Tiles over 64 rows split in K sum their partials 64 rows at a time; every slice
    lands in its own rows (256-row tiles: four slices)."""
    x, w = _operands(5, 2 * 256 if silu else 512, 128, seed=11)
    tile = SkinnyTile(block_n=256, block_k=32, warps=4, stages=2, split_k=2)
    ref = silu_mul_triton(F.linear(x, w)) if silu else F.linear(x, w)
    assert _close(skinny_mm(x, w, tile, silu=silu), ref)


def test_split_k_leaves_its_counters_zeroed():
    """Split-K calls share one counter buffer per device, which each leaves as it found it:
    all zero after calls of several shapes and split counts, so the next call's last split
    is the one that counts ``split_k`` arrivals (a stale count would make it an earlier one,
    which would write a partial sum)."""
    for n, k, split_k, silu in ((64, 96, 3, False), (2 * 48, 64, 2, True), (512, 128, 2, False)):
        x, w = _operands(4, n, k, seed=n + k)
        tile = TILE._replace(split_k=split_k)
        out = skinny_mm(x, w, tile, silu=silu)
        assert _close(out, silu_mul_triton(F.linear(x, w)) if silu else F.linear(x, w))
        assert not skinny_gemm._ARRIVALS[x.device].any()


def _tuning(*keys: ShapeKey, tile: SkinnyTile = TILE) -> SkinnyLinear:
    return SkinnyLinear(SkinnyTuning({"dev": {k: tile for k in keys}}), device_name="dev")


def test_plan_takes_only_tuned_shapes():
    mm = _tuning(ShapeKey(64, 96, 16, False), ShapeKey(48, 64, 64, True))
    x, w = _operands(4, 64, 96, seed=1)
    assert mm.plan(x, w) == TILE
    assert mm.plan(x.float(), w.float()) is None              # not 16-bit
    assert mm.plan(torch.cat([x] * 9), w) is None             # 36 rows: class 64, not tuned
    assert mm.plan(torch.cat([x] * 17), w) is None            # 68 rows: past a decode batch
    assert mm.plan(x[:, :64], w) is None                      # K differs: F.linear's error
    assert mm.plan(x.t().contiguous().t(), w) is None         # x not contiguous in K
    assert mm.plan(x, w, silu=True) is None                   # silu of [32, 96]: not tuned
    x2, w2 = _operands(40, 96, 64, seed=2)
    assert mm.plan(x2, w2, silu=True) == TILE                 # [2 x 48, 64] at 40 rows
    # A tile that does not divide the shape is never used (K = 96: 64-deep tiles, or 32-deep
    # ones in 2 splits of 48).
    for tile in (TILE._replace(block_k=64), TILE._replace(split_k=2)):
        assert _tuning(ShapeKey(64, 96, 16, False), tile=tile).plan(x, w) is None
    assert _tuning(ShapeKey(64, 96, 16, False), tile=TILE._replace(split_k=3)).plan(x, w)


def test_plan_of_a_folding_call():
    """A call that folds in its input's norm or the residual add takes the tile measured so
    where the tuning names that key (None there: cuBLAS and the glue kernel won), else the
    plain shape's; a folded norm never takes a split tile."""
    plain, x_w = ShapeKey(64, 96, 16, False), _operands(4, 64, 96, seed=1)
    split = TILE._replace(split_k=3)
    assert _tuning(plain, tile=split).plan(*x_w, fold="norm") is None
    assert _tuning(plain, tile=split).plan(*x_w, fold="add") == split
    measured = SkinnyLinear(SkinnyTuning({"dev": {plain: TILE, plain._replace(fold="norm"): None,
                                                  plain._replace(fold="add"): split}}), "dev")
    assert measured.plan(*x_w, fold="norm") is None
    assert measured.plan(*x_w, fold="add") == split
    assert measured.plan(*x_w) == TILE


def test_untuned_call_is_f_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(skinny_gemm, "skinny_mm", lambda *a, **k: calls.append(a) or a[0])
    x, w = _operands(4, 64, 96, seed=3)
    out = _tuning(ShapeKey(32, 96, 16, False))(x, w)
    assert not calls and torch.equal(out, F.linear(x, w))
    _tuning(ShapeKey(64, 96, 16, False))(x, w)
    assert len(calls) == 1


def test_tuning_json_round_trip():
    tiles = {ShapeKey(6144, 4096, 16, False): SkinnyTile(16, 256, 4, 4),
             ShapeKey(4096, 4096, 64, False): SkinnyTile(128, 128, 4, 4, 4),
             ShapeKey(14336, 4096, 64, True): None}
    tuning = SkinnyTuning({"NVIDIA H200": tiles})
    again = SkinnyTuning.from_json(tuning.to_json())
    assert again.to_json() == tuning.to_json()
    assert again.tile("NVIDIA H200", ShapeKey(6144, 4096, 16, False)) == SkinnyTile(16, 256, 4, 4)
    assert again.tile("NVIDIA H200", ShapeKey(14336, 4096, 64, True)) is None
    assert again.tile("other", ShapeKey(6144, 4096, 16, False)) is None
    assert ShapeKey.parse("14336x4096/m64/silu") == ShapeKey(14336, 4096, 64, True)
    for key in (ShapeKey(14336, 4096, 16, True, "norm"), ShapeKey(4096, 4096, 64, False, "add")):
        assert ShapeKey.parse(key.text()) == key
    with pytest.raises(ValueError, match="tags are silu, norm or add"):
        ShapeKey.parse("4096x4096/m64/gelu")


def test_packaged_tuning_tiles_divide_their_shapes():
    for device in SkinnyTuning.packaged().devices():
        for text, tile in SkinnyTuning.packaged().to_json()[device].items():
            key = ShapeKey.parse(text)
            assert tile is None or SkinnyTuning.packaged().tile(device, key) is not None, text


def test_even_tiles_fill_the_sms():
    # Llama-3-8B's qkv (6144 rows) over 132 SMs: unsplit, 128-row tiles leave 84 of 132 SMs
    # idle (48 programs) and 16-64 rows come within 30% of whole waves; split in K, 128 rows
    # do too (48 x 8 = 384 programs).
    qkv = even_tiles(ShapeKey(6144, 4096, 16, False), 132)
    assert {t.block_n for t in qkv if t.split_k == 1} == {16, 32, 64}
    assert SkinnyTile(128, 128, 4, 4, 8) in qkv
    for key in (ShapeKey(4096, 14336, 64, False), ShapeKey(14336, 4096, 16, True)):
        for t in even_tiles(key, 132):
            programs = key.n // t.block_n * t.split_k
            assert key.n % t.block_n == 0 and key.k % (t.block_k * t.split_k) == 0
            assert programs / (-(-programs // 132) * 132) >= 0.7
            assert t.split_k == 1 or key.n // t.block_n < 132
            assert t.warps == (8 if t.block_n * key.block_m >= 8192 else 4)
    # o at 64 rows: 256-row tiles split 8 ways (16 x 8 programs), over 8 warps.
    assert SkinnyTile(256, 128, 8, 4, 8) in even_tiles(ShapeKey(4096, 4096, 64, False), 132)
