"""Skinny GEMM: ``x [M, K] @ W[N, K].T`` for the decode step's few rows (M <= 64).

A decode step at batch 1 is ~4 ms of weight reads: every projection is a GEMV that streams
its weight once. cuBLAS's kernels for these shapes (H200, Llama-3-8B, ``decode_profile.json``)
read 3.1-3.4 TB/s on qkv and o and ~4.0 on gate_up and down, against ~4.4 on the 1 GiB
lm_head: its tiles for the small projections fill a wave and a fraction of a wave (qkv at
128-row tiles is 48 programs over 132 SMs; gate_up 224 programs, 1.7 waves), and it splits K
for o and down, a second kernel reducing the parts. Here a program takes ``block_n`` whole
weight rows and the step's rows of x, computes ``W_tile @ x.T`` on the tensor cores (rows of
W as the dot's M, so 16 output rows still fill it; the M rows of x, padded to 16, 32 or 64,
as its N) and writes them, ``block_n`` chosen so the programs spread evenly over the SMs. x
(a few KiB) stays in L2; the weight tiles are loaded ``stages`` deep by Triton's pipeliner.

At 64 rows a program reads x's ``[64, block_k]`` slice beside each ``[block_n, block_k]``
weight tile, so narrow tiles read more x than W (from L2, but still bytes): wide tiles
(``block_n`` 64-128) keep it small, and where they leave SMs idle the tile is split in K
(``split_k``): each split leaves its float32 tile in a buffer of the call, and the split that
finishes last (a per-tile counter, acquire-release) sums them in split order and writes the
output, so a result does not depend on which split finished when, and sets the counter
back to 0: the counters live in one zeroed buffer per device (``_arrivals``), so a call
launches no fill kernel (in a CUDA graph one per split projection and layer: 32 more nodes of
the batch-64 step). That buffer serves one call at a time: calls are ordered on one stream
(the model's projections are). One kernel either way.

``gate_up_silu``: the MLP's gate and up rows (``[2I, K]``, gate first) in one program each,
``silu(gate) * up`` in the epilogue: the ``silu_mul`` kernel and the ``[M, 2I]`` round trip go.
Both halves are rounded to the input dtype first, so it computes what ``F.linear`` then
``silu_mul_triton`` computes.

Which shapes take the kernel, and at which tile, is data: ``SkinnyTuning``, measured per
device by ``benchmarks/linear_bench.py`` against cuBLAS and kept in ``skinny_tuning.json``
(vLLM keeps its fused-MoE tiles the same way). A shape the tuning does not list (another
device, model or batch class) runs ``F.linear``; so does anything not 2-D, contiguous in K,
16-bit, or on a device Triton does not drive.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Mapping, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 64  # beyond a decode batch the GEMM is compute-shaped: cuBLAS
TUNING_FILE = Path(__file__).with_name("skinny_tuning.json")


class SkinnyTile(NamedTuple):
    block_n: int   # weight rows (output columns) per program
    block_k: int
    warps: int
    stages: int
    split_k: int = 1  # programs per output tile, each over K / split_k


FOLDS = ("", "norm", "add")


class ShapeKey(NamedTuple):
    """What a tile is chosen for: the weight's shape, the padded row count, the epilogue,
    and what the call folds in: "" nothing, "norm" the RMSNorm of its input (measured
    against the norm kernel then cuBLAS), "add" the residual add after it (against cuBLAS
    then the add)."""
    n: int         # output columns (for gate_up_silu: I, half the weight's rows)
    k: int
    block_m: int   # 16, 32 or 64
    silu: bool
    fold: str = ""

    def text(self) -> str:
        return (f"{self.n}x{self.k}/m{self.block_m}" + ("/silu" if self.silu else "")
                + (f"/{self.fold}" if self.fold else ""))

    @classmethod
    def parse(cls, text: str) -> ShapeKey:
        shape, block, *tags = text.split("/")
        n, k = shape.split("x")
        folds = [t for t in tags if t in FOLDS[1:]]
        if any(t not in ("silu", *FOLDS[1:]) for t in tags) or len(folds) > 1:
            raise ValueError(f"skinny tuning key {text!r}: tags are silu, norm or add")
        return cls(int(n), int(k), int(block[1:]), "silu" in tags, folds[0] if folds else "")


def block_m(rows: int) -> int:
    """The dot's N for ``rows`` rows of x: at least 16 (the tensor cores' minimum)."""
    return max(16, triton.next_power_of_2(rows))


def tile_fits(key: ShapeKey, tile: SkinnyTile) -> bool:
    """The kernel has no N or K masks: the tile (each split's share of K) must divide the
    shape."""
    return key.n % tile.block_n == 0 and key.k % (tile.block_k * tile.split_k) == 0


class SkinnyTuning:
    """Per device name: the tile of each measured shape, or None where cuBLAS won there.

    Immutable once built; ``packaged`` reads ``skinny_tuning.json`` once per process."""

    def __init__(self, tiles: Mapping[str, Mapping[ShapeKey, SkinnyTile | None]]) -> None:
        self._tiles = {dev: dict(by_shape) for dev, by_shape in tiles.items()}

    def tile(self, device_name: str, key: ShapeKey) -> SkinnyTile | None:
        tile = self._tiles.get(device_name, {}).get(key)
        return tile if tile is not None and tile_fits(key, tile) else None

    def names(self, device_name: str, key: ShapeKey) -> bool:
        """Whether ``key`` was measured on the device (a tile, or None where cuBLAS won)."""
        return key in self._tiles.get(device_name, {})

    def devices(self) -> tuple[str, ...]:
        return tuple(self._tiles)

    @classmethod
    def from_json(cls, data: Mapping) -> SkinnyTuning:
        """``{device: {"NxK/mB[/silu]": [block_n, block_k, warps, stages(, split_k)] |
        null}}``."""
        return cls({dev: {ShapeKey.parse(k): (SkinnyTile(*v) if v is not None else None)
                          for k, v in shapes.items()}
                    for dev, shapes in data.items()})

    def to_json(self) -> dict:
        return {dev: {k.text(): (list(t) if t is not None else None) for k, t in shapes.items()}
                for dev, shapes in self._tiles.items()}

    @classmethod
    @functools.cache
    def packaged(cls) -> SkinnyTuning:
        if not TUNING_FILE.exists():
            return cls({})
        return cls.from_json(json.loads(TUNING_FILE.read_text()))


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


class SkinnyLinear:
    """``F.linear`` with the skinny kernel where ``tuning`` names the shape: the one place that
    decides. ``device_name``: fixed (the CPU tests, under the interpreter) or None to ask CUDA
    for the tensor's device. Each decision is a dictionary lookup on shapes alone, so a call
    is safe inside CUDA graph capture once its kernel is compiled (a graph's warm-up does)."""

    def __init__(self, tuning: SkinnyTuning, device_name: str | None = None) -> None:
        self.tuning, self.device_name = tuning, device_name

    def plan(self, x: torch.Tensor, w: torch.Tensor, silu: bool = False,
             fold: str = "") -> SkinnyTile | None:
        """The tile for ``x @ w.T`` (None: cuBLAS). ``fold``: a call that also folds in its
        input's norm ("norm": one split only, a split sees part of each row) or the residual
        add ("add") takes the tile measured so where the tuning names its key, else the
        plain shape's (which beat cuBLAS without the glue kernel the fold saves)."""
        if (x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]
                or x.shape[0] == 0 or x.shape[0] > MAX_ROWS
                or x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype
                or x.stride(1) != 1 or w.stride(1) != 1 or x.device != w.device):
            return None
        if self.device_name is None and not x.is_cuda:
            return None
        name = self.device_name or _device_name(x.device)
        n = w.shape[0] // 2 if silu else w.shape[0]
        key = ShapeKey(n, w.shape[1], block_m(x.shape[0]), silu)
        folded = key._replace(fold=fold)
        tile = self.tuning.tile(name, folded if self.tuning.names(name, folded) else key)
        return None if tile is None or (fold == "norm" and tile.split_k > 1) else tile

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        tile = self.plan(x, w)
        return F.linear(x, w, bias) if tile is None else skinny_mm(x, w, tile, bias)

    def gate_up_silu(self, x: torch.Tensor, w: torch.Tensor, silu_mul) -> torch.Tensor:
        """``silu_mul(F.linear(x, w))`` for the MLP's ``[2I, K]`` gate/up weight; ``silu_mul``:
        the caller's, for the shapes the kernel does not take."""
        tile = self.plan(x, w, silu=True)
        return silu_mul(F.linear(x, w)) if tile is None else skinny_mm(x, w, tile, silu=True)


@triton.jit
def _finish_tile(Y, Bias, Res, rn, rm, m_ok, stride_ym, stride_rm, acc, acc_up, keep,
                 HAS_BIAS: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr):
    """Bias, the SiLU epilogue, the residual add and the store of y's rows ``rm`` x columns
    ``rn`` from the float32 tile ``acc`` ([len(rn), BLOCK_M], transposed); ``keep``: whether
    this program writes it (a split that did not finish last does not)."""
    if HAS_BIAS:
        acc += tl.load(Bias + rn).to(tl.float32)[:, None]
    out = acc
    if SILU:
        # Both halves rounded as F.linear would store them, then silu_mul's float32 math.
        gate = acc.to(Y.dtype.element_ty).to(tl.float32)
        up = acc_up.to(Y.dtype.element_ty).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
    if RESIDUAL:  # the residual stream plus this product, rounded once
        out += tl.load(Res + rm[None, :] * stride_rm + rn[:, None], mask=m_ok[None, :] & keep,
                       other=0.0).to(tl.float32)
    y_ptrs = Y + rm[None, :] * stride_ym + rn[:, None]
    tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=m_ok[None, :] & keep)


@triton.jit
def _skinny_kernel(
    X, W, Bias, Y, Partial, Arrived, Gamma, Res,
    M, k_split, up_rows, n_out, eps,
    stride_xm, stride_wn, stride_ym, stride_rm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SPLIT_K: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr,
):
    # Program (N tile, K split): BLOCK_N weight rows over K / SPLIT_K. The weight tile is the
    # dot's A operand (its rows contiguous in K, as the tensor cores read A), x's rows its N,
    # so the product is y's tile transposed ([BLOCK_N, BLOCK_M]), stored by address.
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rn = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    # A split starts at a multiple of BLOCK_K (the launcher's tile divides k_split): told so,
    # the compiler keeps the weight loads aligned and loaded ahead (cp.async).
    rk = tl.multiple_of(split * k_split, BLOCK_K) + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    x_ok = m_ok[:, None]
    w_ptrs = W + rn[:, None] * stride_wn + rk[None, :]
    x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    squares = tl.full((BLOCK_M,), 0.0, tl.float32)
    g_ptrs = Gamma + rk
    for _ in range(0, k_split, BLOCK_K):
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if NORM:
            # RMSNorm folded in: the rows' sums of squares from the tiles the loop loads
            # anyway, gamma applied to each tile; 1/rms, a factor per row, after the loop.
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = (xf * tl.load(g_ptrs).to(tl.float32)[None, :]).to(X.dtype.element_ty)
            g_ptrs += BLOCK_K
        acc = tl.dot(tl.load(w_ptrs), tl.trans(x), acc)
        if SILU:
            acc_up = tl.dot(tl.load(w_ptrs + up_rows * stride_wn), tl.trans(x), acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if NORM:  # one split (the launcher's): its loop saw every column
        inv_rms = tl.rsqrt(squares / k_split + eps)[None, :]
        acc = acc * inv_rms
        if SILU:
            acc_up = acc_up * inv_rms
    if SPLIT_K == 1:
        _finish_tile(Y, Bias, Res, rn, rm, m_ok, stride_ym, stride_rm, acc, acc_up, True,
                     HAS_BIAS, SILU, RESIDUAL)
    else:
        # Each split leaves its float32 tile in Partial[split]; the split that arrives last
        # sums them in split order (the same sums every run) and writes the tile; the
        # others' loads and stores are masked off. The barrier puts every thread's stores
        # before the counter's release (one thread increments it); the acquire and the
        # broadcast of its value order the last split's reads after the others' stores.
        plane = BLOCK_M * n_out.to(tl.int64)
        part = rm[None, :] * n_out + rn[:, None]
        tl.store(Partial + split * (2 * plane) + part, acc)
        if SILU:
            tl.store(Partial + split * (2 * plane) + plane + part, acc_up)
        tl.debug_barrier()
        last = tl.atomic_add(Arrived + tile, 1, sem="acq_rel") == SPLIT_K - 1
        # Summed 64 rows at a time: a whole 256 x 64 tile and its sum spilled (sm_90a).
        SLICE: tl.constexpr = 64 if BLOCK_N > 64 else BLOCK_N
        for j in tl.static_range(BLOCK_N // SLICE):
            rn_j = (tile * BLOCK_N + j * SLICE + tl.arange(0, SLICE)).to(tl.int64)
            part_j = rm[None, :] * n_out + rn_j[:, None]
            total = tl.full((SLICE, BLOCK_M), 0.0, tl.float32)
            total_up = tl.full((SLICE, BLOCK_M), 0.0, tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(Partial + s * (2 * plane) + part_j, mask=last, other=0.0,
                                 cache_modifier=".cg")
                if SILU:
                    total_up += tl.load(Partial + s * (2 * plane) + plane + part_j, mask=last,
                                        other=0.0, cache_modifier=".cg")
            _finish_tile(Y, Bias, Res, rn_j, rm, m_ok, stride_ym, stride_rm, total, total_up,
                         last, HAS_BIAS, SILU, RESIDUAL)
        # Every split has counted in: the last leaves the counter as it found it.
        tl.store(Arrived + tile, 0, mask=last)


# Split counters per device, made once and never freed or replaced: a captured graph keeps
# the address it was captured with. 64K (256 KiB) covers any tiling of N <= 1M rows.
ARRIVAL_SLOTS = 1 << 16
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """``tiles`` split counters, all 0: the front of ``device``'s buffer, which each split-K
    call leaves as it found it. Made by the device's first split-K call, which must not be
    inside a CUDA graph capture (a buffer made there would be the graph's): the model's
    first calls are a graph's eager warm-up."""
    assert tiles <= ARRIVAL_SLOTS, tiles
    buf = _ARRIVALS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_mm: the device's first split-K call inside a CUDA "
                               "graph capture (run one eagerly first)")
        buf = _ARRIVALS[device] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return buf[:tiles]


def skinny_mm(x: torch.Tensor, w: torch.Tensor, tile: SkinnyTile,
              bias: torch.Tensor | None = None, silu: bool = False,
              norm: tuple[torch.Tensor, float] | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` ([M, N], x's dtype) at ``tile``, or with ``silu``
    ``silu(gate) * up`` of the ``[M, 2I]`` product ([M, I]). ``norm`` (gamma [K], eps): of
    ``rms_norm(x) * gamma`` instead of x (one split only). ``residual`` ([M, N]): plus it,
    rounded once (no SiLU). The caller checked the shapes (``SkinnyLinear.plan``,
    ``tile_fits``); this asserts them."""
    rows, k = x.shape
    n = w.shape[0] // 2 if silu else w.shape[0]
    assert 0 < rows <= MAX_ROWS and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    assert n % tile.block_n == 0 and k % (tile.block_k * tile.split_k) == 0, (n, k, tile)
    assert bias is None or not silu
    assert norm is None or (tile.split_k == 1 and norm[0].shape == (k,)
                            and norm[0].is_contiguous())
    assert residual is None or (not silu and residual.shape == (rows, n)
                                and residual.stride(1) == 1)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    bm, tiles = block_m(rows), n // tile.block_n
    if tile.split_k > 1:
        # The partials per call, from the caching allocator (a graph's pool under capture);
        # the counters from the device's buffer, which every call leaves zeroed.
        partial = torch.empty(tile.split_k * 2 * bm * n, dtype=torch.float32, device=x.device)
        arrived = _arrivals(x.device, tiles)
    else:
        partial = arrived = y
    gamma, eps = norm if norm is not None else (x, 0.0)
    res = residual if residual is not None else y
    _skinny_kernel[(tiles, tile.split_k)](
        x, w, bias if bias is not None else x, y, partial, arrived, gamma, res,
        rows, k // tile.split_k, n, n, eps,
        x.stride(0), w.stride(0), y.stride(0), res.stride(0),
        BLOCK_M=bm, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        HAS_BIAS=bias is not None, SILU=silu, SPLIT_K=tile.split_k,
        NORM=norm is not None, RESIDUAL=residual is not None, num_warps=tile.warps,
        num_stages=tile.stages)
    return y


def even_tiles(key: ShapeKey, sms: int, block_ns=(16, 32, 64, 128, 256), block_ks=(128, 256),
               stages=(3, 4, 5), splits=(1, 2, 4, 8)) -> list[SkinnyTile]:
    """Candidate tiles for ``key`` on ``sms`` SMs (what ``linear_bench`` sweeps): those that
    divide the shape, give each split at least 4 K tiles, and whose programs fill the SMs to
    within 30% of whole waves; a split of K only where the unsplit tile leaves a wave
    under-filled or gives fewer programs than SMs. 8 warps where the float32 accumulator
    holds 128 x 64 values or more (64 registers a thread at 4 warps, and the split's sum
    beside it spilled), else 4. Wide tiles matter at 64 rows, where a program reads x's
    slice beside each weight tile: 256 weight rows read a quarter as much x as W."""
    out = []
    for bn in block_ns:
        if key.n % bn:
            continue
        warps = (8,) if bn * key.block_m >= 128 * 64 else (4,)
        for split in splits:
            programs = key.n // bn * split
            waves = -(-programs // sms)
            if programs / (waves * sms) < 0.7 or (split > 1 and key.n // bn >= sms):
                continue
            out += [SkinnyTile(bn, bk, w, s, split) for bk in block_ks
                    if key.k % (bk * split) == 0 and key.k // (bk * split) >= 4
                    for w in warps for s in stages]
    return out
