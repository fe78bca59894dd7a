"""KeptTables: the page tables and cascade tiles a TorchBackend keeps across launches of
steady rows equal the ones built afresh from the same batch, through joins, leaves and page
boundaries crossed at different ticks (so some launches reuse every row, some rewrite a few,
some rebuild all), in the layouts with and without a residual side, with overlap and without.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from torch_testlib import DEVICE, DTYPE, PAGE, make_config, prompt

from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch import backend as backend_module
from forkserve.backend.torch import cascade as cascade_tiles
from forkserve.backend.torch.decode_rows import ROW_FIELDS, TABLE_FIELDS
from forkserve.backend.torch.kept_tables import KeptTables
from forkserve.config import KVLayout
from forkserve.engine import Engine


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
def test_kept_tables_equal_fresh_ones(models, adapters, monkeypatch, layout, overlap):
    cfg = make_config(layout, num_pages=512).replace(
        overlap=overlap, steady_decode=True, node_ttl_s=None, shared_prefix_min_tokens=2 * PAGE)
    backend = TorchBackend(cfg, models["llama"], adapters={"qkvo": adapters["qkvo"]},
                           device=DEVICE, dtype=DTYPE)
    real = backend_module.of_batch
    seen = {"rebuilt": 0, "reused": 0, "partial": 0, "tiled": 0}

    def checked(batch, limits, slots, scratch, scratch_res, kept):
        got = real(batch, limits, slots, scratch, scratch_res, kept)
        fresh = KeptTables(limits.page_size, kept.groups.agents)
        want = real(batch, limits, slots, scratch, scratch_res, fresh)
        assert (got is None) == (want is None)
        if got is None:
            return got
        for name in (*ROW_FIELDS, *TABLE_FIELDS):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
        plan = kept.groups.plan(batch.shared_prefix)
        assert plan == fresh.groups.plan(batch.shared_prefix) == cascade_tiles.plan(
            batch.shared_prefix, limits.page_size, kept.groups.agents)
        changed = kept.pages.changed
        seen["rebuilt" if changed is None else "partial" if len(changed[1]) else "reused"] += 1
        seen["tiled"] += plan is not None
        return got

    monkeypatch.setattr(backend_module, "of_batch", checked)
    engine = Engine(backend)
    rng = random.Random(0)
    context = prompt(1, 3 * PAGE)
    live: list[int] = []
    for tick in range(60):
        # Joins with suffixes of different lengths (boundaries crossed at different ticks)...
        if tick % 7 == 0 or len(live) < 3:
            adapter = "qkvo" if rng.random() < 0.5 else None
            h = engine.open(context + prompt(100 + tick, rng.randrange(1, PAGE + 1)),
                            adapter=adapter)
            engine.start_generate(h.id, rng.randrange(6, 24))
            live.append(h.id)
        # ...and leaves, by cancelling a generation or reaching its end.
        if tick % 5 == 4 and len(live) > 3:
            engine.cancel_generate(live.pop(rng.randrange(len(live))))
        engine.tick()
        engine.sync()
        live = [i for i in live if engine.sessions[i].decode_left > 0]
    engine.check_integrity()
    assert seen["rebuilt"] and seen["reused"] and seen["partial"] and seen["tiled"], seen
