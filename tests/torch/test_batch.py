"""The CUDA-graph input fill (`fill_decode`) writes exactly what `build` computes."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from forkserve.backend.protocol import GREEDY, KVSlots, SeqWork
from forkserve.backend.torch.batch import BatchLimits, build, fill_decode
from forkserve.backend.torch.cuda_graph import pages_bucket
from forkserve.config import KVForm


@pytest.mark.parametrize("disaggregated", [False, True])
def test_fill_decode_equals_build(disaggregated):
    rng = random.Random(0)
    page, pages, scratch = 16, 64, 500
    limits = BatchLimits(vocab_size=1000, max_context=pages * page, page_size=page, num_pages=scratch,
                         num_residual_pages=scratch, disaggregated=disaggregated)
    slots = {7: 0, 9: 3}
    work = []
    for i in range(5):
        at = rng.randrange(0, 40 * page)
        adapter = rng.choice([None, 7, 9])
        table = tuple(rng.sample(range(scratch), pages))
        split = disaggregated and adapter is not None and rng.random() < 0.7
        res = tuple(rng.sample(range(scratch), pages)) if split else None
        work.append(SeqWork(i, (rng.randrange(1000),), at, KVSlots(table, res), adapter, GREEDY, decode=True,
                            write_base=rng.random() < 0.7, write_residual=rng.random() < 0.7,
                            form=KVForm.SPLIT if split else KVForm.MERGED))
    ref = build(work, limits, slots, False, torch.device("cpu"), scratch, scratch)
    width = pages_bucket(ref.meta.block_tables.shape[1])
    rows = {n: np.full((8,), -99, dtype=np.int64) for n in ("input_ids", "positions", "token_slot", "slot_mapping",
                                                             "res_slot_mapping", "seq_lens", "seq_slot")}
    rows |= {n: np.full((8, width), scratch, dtype=np.int64) for n in ("block_tables", "res_block_tables")}
    fill_decode(work, limits, slots, rows, scratch, scratch)
    n, w = len(work), ref.meta.block_tables.shape[1]
    expect = {"input_ids": ref.input_ids, "positions": ref.positions, "token_slot": ref.token_slot,
              "slot_mapping": ref.meta.slot_mapping, "seq_lens": ref.meta.seq_lens, "seq_slot": ref.meta.seq_slot,
              "block_tables": ref.meta.block_tables}
    if disaggregated:
        expect |= {"res_slot_mapping": ref.meta.res_slot_mapping, "res_block_tables": ref.meta.res_block_tables}
    for name, value in expect.items():
        got = rows[name][:n, :w] if value.dim() == 2 else rows[name][:n]
        assert np.array_equal(got, value.numpy()), name
