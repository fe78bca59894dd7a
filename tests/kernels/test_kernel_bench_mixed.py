"""benchmarks/kernel_bench.py --mixed at its smoke shapes (CPU, Triton interpreter): a mixed
step split as KernelAttention runs it (the chunk on its prefill route, the one-token rows
through the decode kernel) gives the whole batch's prefill-route output, and both match the
eager float32 reference. On CUDA the bench itself checks this (``split_rel_err_vs_whole``)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.kernelbench.mixed import mixed_step
from benchmarks.kernelbench.setup import Setup, rel_err
from forkserve import kernels

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU smoke shapes; on CUDA run kernel_bench.py --mixed")


@pytest.mark.parametrize("residual", [False, True])
def test_mixed_split_equals_whole(residual: bool) -> None:
    s = Setup(smoke=True)
    calls, routes = mixed_step(s, ctx=64, new=16, rows=3, residual=residual,
                               found=kernels.PrefillKernels())
    assert routes == ({"whole": "fused", "chunk": "fused"} if residual
                      else {"whole": "paged", "chunk": "paged"})
    whole, split, ref = calls["whole"](), calls["split"](), calls["reference"]()
    assert split.shape == whole.shape == (16 + 3, s.n_heads, s.head_dim)
    assert rel_err(split, whole) < 1e-5
    assert rel_err(split, ref) < 1e-5
    # The parts are the split output's rows.
    torch.testing.assert_close(calls["rows"](), split[16:], rtol=0, atol=0)
    torch.testing.assert_close(calls["chunk"](), split[:16], rtol=0, atol=0)
