"""Mode d (offset correction) in the quality benchmark: its anchors, its fit, its costs.

The anchors are whole prompts of training items (``data.training_examples``: a catalog of
training schemas and the item's question), ``ANCHORS_PER_TASK`` per task, so the tables never
see a catalog the evaluation asks about. Every adapter and the base model run each anchor in
a unified-layout backend over the evaluation's weights (``offset_fit.fit_offsets``); the
tables are fitted once per unit, before its first step (a CUDA graph holds them).

Costs, beside the F1: the tables' bytes (every pair, every layer: held once for all contexts)
and the extra FLOPs of correcting on read, counted as a reader's cross-written tokens x its
steps (its prefill and each decode step re-read and re-correct the catalog: nothing corrected
is stored) x layers x ``OffsetTable.flops_per_read``. The eager path computes the correction
densely over each item's whole table (its own positions get zero), so it spends more than that.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from benchmarks.quality.data import Task, training_examples
from forkserve.backend.torch.offset_table import OffsetTable

ANCHORS_PER_TASK = 2
RIDGE = 1e-2
ATTENTION = "eager"  # the only attention that applies the correction (base_correction.py)
# What a correcting unit's tables were fitted from and how it ran (``units.OPTIONAL``: only
# these units carry it); the anchors follow from it and the unit's seed and distractors.
SETTING = {"anchors_per_task": ANCHORS_PER_TASK, "ridge": RIDGE, "attention": ATTENTION}


def anchor_prompts(tasks: Sequence[Task], tokenizer: Any, distractors: int,
                   seed: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(tokenizer.apply_chat_template(e.messages(False)))
                 for i in range(len(tasks))
                 for e in training_examples(tasks, i, distractors, seed)[:ANCHORS_PER_TASK])


def fit(model_config: Any, weights: Any, adapters: Mapping[str, Any],
        anchors: Sequence[Sequence[int]], rank: int, device: str, dtype: torch.dtype,
        page_size: int) -> OffsetTable:
    from forkserve.backend.torch import TorchBackend
    from forkserve.backend.torch.offset_fit import fit_offsets
    from forkserve.config import ForkServeConfig, KVLayout

    pages = -(-max(len(a) for a in anchors) // page_size) + 1
    config = ForkServeConfig(page_size=page_size, num_pages=pages, num_residual_pages=pages,
                             kv_layout=KVLayout.UNIFIED, max_batch_tokens=4096, node_ttl_s=None)
    backend = TorchBackend.from_weights(config, model_config, weights, adapters, device=device,
                                        dtype=dtype, attention=ATTENTION, use_cuda_graphs=False,
                                        compile_fusions=False)
    return fit_offsets(backend, anchors, list(adapters), rank, RIDGE)


def extra_flops(table: OffsetTable, kv_size: int, layers: int, corrected_tokens: int,
                steps: int) -> int:
    return corrected_tokens * steps * layers * table.flops_per_read(kv_size)
