"""The eager path (``use_triton=False``: the engine's CPU path, and the kernels' reference)
against the plain formulas, through the public dispatch, so neither the references nor
their routing are checked against themselves."""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import make_adapters, make_cache, rel_err

from forkserve.kernels import (
    apply_rope,
    lora_expand,
    lora_shrink,
    paged_decode,
    paged_prefill,
    residual_decode,
    residual_prefill,
)
from forkserve.kernels.rope import default_inv_freq

TOL = 1e-5  # float32 math against float64


@pytest.mark.parametrize("seq_lens,q_lens,n_heads,n_kv", [
    ([37, 100, 16, 70], [37, 30, 1, 21], 4, 2),   # cold, cached prefix, one token; GQA 2
    ([50, 4096 + 27], [0, 24], 6, 2),             # an empty chunk; keys past 4K; GQA 3
])
def test_eager_attention_matches_plain_formulas(seq_lens, q_lens, n_heads, n_kv) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens))
    head_dim, r_max = 32, 12
    c = make_cache(gen, seq_lens, n_kv, head_dim, rank=r_max, dtype=torch.float32)
    c = type(c)(*(t.cpu() for t in vars(c).values()))
    b_k, b_v = (t.cpu().float() for t in make_adapters(gen, 2, r_max, n_kv, head_dim))
    adapters = torch.tensor([(1, 0, -1)[i % 3] for i in range(len(seq_lens))], dtype=torch.int32)
    inv_freq = default_inv_freq(head_dim, base=500000.0)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), n_heads, head_dim, generator=gen)
    residual = (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq)
    base = (c.k, c.v, c.block_tables, c.seq_lens)

    out = paged_prefill(q, *base, cu, use_triton=False)
    assert rel_err(out, plain.prefill(q, *base, cu)) < TOL
    res_args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens, cu,
                b_k, b_v, adapters, inv_freq)
    ref = plain.prefill(q, *base, cu, residual)
    assert rel_err(residual_prefill(*res_args, use_triton=False), ref) < TOL
    assert rel_err(ref, plain.prefill(q, *base, cu)) > 0.1  # the residual matters here

    q1 = torch.randn(len(seq_lens), n_heads, head_dim, generator=gen)
    assert rel_err(paged_decode(q1, *base, use_triton=False), plain.decode(q1, *base)) < TOL
    out = residual_decode(q1, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables,
                          c.seq_lens, b_k, b_v, adapters, inv_freq, use_triton=False)
    assert rel_err(out, plain.decode(q1, *base, residual)) < TOL


def test_eager_rope_matches_the_complex_rotation() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 2, 64, generator=gen)
    pos = torch.tensor([0, 1, 2, 17, 4095, 4097, 32768, 131072 + 5, 7])
    inv_freq = default_inv_freq(64, base=500000.0)
    want = plain.rope(x.double(), pos, inv_freq)
    torch.testing.assert_close(apply_rope(x, pos, inv_freq).double(), want, atol=1e-4, rtol=1e-4)


def test_eager_lora_matches_plain_products() -> None:
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor([0, 0, 2, -1, 1, 2], dtype=torch.int32)
    x = torch.randn(6, 40, generator=gen)
    a_all, b_all = torch.randn(3, 40, 8, generator=gen), torch.randn(3, 8, 24, generator=gen)
    out0 = torch.randn(6, 24, generator=gen)
    y = lora_shrink(x, a_all, idx, use_triton=False)
    out = lora_expand(y, b_all, idx, out0.clone(), use_triton=False)
    for t, a in enumerate(idx.tolist()):
        want_y = torch.zeros(8, dtype=torch.float64) if a < 0 else x[t].double() @ a_all[a].double()
        want = out0[t].double() + (0 if a < 0 else y[t].double() @ b_all[a].double())
        torch.testing.assert_close(y[t].double(), want_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[t].double(), want, atol=1e-5, rtol=1e-5)
