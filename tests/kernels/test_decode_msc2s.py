"""msc2s ResidualAttention decode (residual_msc2s.py): against the eager reference over
(ctx, batch) shapes, its pass 1's two buffers against msc's whole logits, and on CUDA
under graph capture with the side stream."""
from __future__ import annotations

import math

import pytest
import torch
from kernel_testlib import DEVICE, DTYPE, ON_CUDA, REL_TOL, make_adapters, make_cache, rel_err

from forkserve.kernels import reference, residual_decode
from forkserve.kernels.residual_msc import residual_logits
from forkserve.kernels.residual_msc2s import split_logits
from forkserve.kernels.rope import cached_rope_table, default_inv_freq
from forkserve.kernels.split_kv import LOG2E

N_HEADS, N_KV, HEAD_DIM, RANK = 8, 2, 32, 8  # GQA group 4
# 16-key tiles everywhere, so short contexts still give several tiles and chunks.
TUNING = {"block_n": 16, "residual": {"block_n": 16}}


def _inputs(ctx: int, batch: int, seed: int = 0):
    """Ragged lengths up to ``ctx`` (none a multiple of the 16-key tile unless ``ctx`` is),
    adapters cycling through 1, none, 0, 2."""
    gen = torch.Generator().manual_seed(seed + ctx * 31 + batch)
    seq_lens = [max(1, ctx - 13 * i) for i in range(batch)]
    c = make_cache(gen, seq_lens, N_KV, HEAD_DIM, rank=RANK)
    b_k, b_v = make_adapters(gen, 3, RANK, N_KV, HEAD_DIM)
    adapters = torch.tensor([(1, -1, 0, 2)[i % 4] for i in range(batch)], dtype=torch.int32,
                            device=DEVICE)
    q = torch.randn(batch, N_HEADS, HEAD_DIM, generator=gen).to(DEVICE, DTYPE)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens,
            b_k, b_v, adapters, default_inv_freq(HEAD_DIM, device=DEVICE))
    return args, c, adapters


@pytest.mark.parametrize("ctx,batch", [(70, 3), (129, 2), (33, 5), (16, 1)])
def test_msc2s_equals_eager_reference(ctx: int, batch: int) -> None:
    args, _, adapters = _inputs(ctx, batch)
    out = residual_decode(*args, use_triton=True, variant="msc2s", block_n=16,
                          score_tuning=TUNING)
    ref = reference.residual_decode_ref(*args)
    assert rel_err(out, ref) < REL_TOL
    # Rows without an adapter: base logits only, the unified decode's math.
    plain = ~(adapters >= 0)
    if plain.any():
        q, k, v, *_ = args
        base = reference.paged_decode_ref(q, k, v, args[5], args[7])
        assert rel_err(out[plain], base[plain]) < REL_TOL


def test_split_logits_sum_to_msc_logits() -> None:
    """Base logits plus the scaled bias are msc's whole logits at every key of every row;
    rows without an adapter are complete in the base logits."""
    (q, k, _, k_res, _, bt, rbt, lens, b_k, _, adapters, inv_freq), _, _ = _inputs(70, 5)
    scale, n = 1.0 / math.sqrt(HEAD_DIM), int(lens.max())
    table = cached_rope_table(inv_freq, n)
    common = (q, k, bt, k_res, rbt, lens, b_k, adapters, table, scale, n)
    # Table rows as msc's pass 1 (angle_add=False, also MSC2S_TUNING's): the same bf16
    # roundings of the folded queries and cos/sin in both, so they differ only by the stored
    # bias's rounding (qfold's default angle addition rounds other operands to bf16 on CUDA).
    logits, bias = split_logits(*common, block_n=16, waves=8,
                                residual={"block_n": 16, "chunk": 48, "angle_add": False})
    assert logits.shape == bias.shape and logits.stride() == bias.stride()
    whole = residual_logits(*common, block_n=16)
    half_ulp = torch.finfo(bias.dtype).eps / 2  # float16 on CUDA, float32 on the CPU
    for b, length in enumerate(lens.tolist()):
        got = logits[b, :, :length].double()
        want = whole[b, :, :length].double()
        # Bound: the bias's own rounding (half an ulp of it, times scale * log2(e)) plus
        # float32 summation-order slack of the logits (1e-5 of their largest).
        slack = 1e-5 * want.abs().max()
        if adapters[b] >= 0:
            scaled = bias[b, :, :length].double() * scale * LOG2E
            got = got + scaled
            slack = slack + half_ulp * scaled.abs()
        assert bool(((got - want).abs() <= slack).all()), (got - want).abs().max()


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs and streams need a GPU")
def test_msc2s_under_cuda_graph() -> None:
    """The fork/join onto the side stream captures: replays equal eager calls, also after
    the query changes in place."""
    args, _, _ = _inputs(300, 6)
    q = args[0]

    def run() -> torch.Tensor:
        return residual_decode(*args, use_triton=True, variant="msc2s", max_seq_len=300)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())
        q.copy_(torch.randn_like(q))
