"""benchmarks/kernel_bench.py --cascade-prefill at its smoke shapes (CPU, Triton interpreter):
the grouped layer call takes the CASCADE route and gives the ungrouped one's output. On CUDA
the bench itself checks this (``grouped_rel_err_vs_ungrouped``)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.kernelbench.cascade_prefill import cascade_prefill_step
from benchmarks.kernelbench.setup import Setup, rel_err

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU smoke shapes; on CUDA run kernel_bench.py "
                                       "--cascade-prefill")


def test_grouped_equals_ungrouped() -> None:
    s = Setup(smoke=True)
    calls, routes = cascade_prefill_step(s, prefix=64, members=3, new=5)
    assert routes == {"ungrouped": "paged", "ungrouped_paged": "paged", "grouped": "cascade",
                      "prefix_splits": 1}
    grouped, ungrouped = calls["grouped"](), calls["ungrouped"]()
    assert grouped.shape == (3 * 5, s.n_heads * s.head_dim)
    assert rel_err(grouped, ungrouped) < 1e-5
