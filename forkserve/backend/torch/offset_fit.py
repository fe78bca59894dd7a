"""Fit the offset tables of mode d (``offset_table.py``) on anchor prompts: every writer (each
adapter and the base model) and every reader adapter run each anchor in their own forward, and
per (writer, reader) pair and layer the reader's base K/V is regressed on the writer's.

The anchors are a small fixed calibration set, run once per set of adapters (KVCOMM fits its
offsets on anchors both sides computed; here both sides are run on purpose, offline). They
should be prompts like the ones served but never the ones evaluated: the quality benchmark
takes catalogs of training items.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from forkserve.backend.torch.base_kv import attention_inputs, context_hidden, kv_base
from forkserve.backend.torch.offset_table import BASE_MODEL, OffsetTable, fit_pair

if TYPE_CHECKING:
    from forkserve.backend.torch.backend import TorchBackend


def base_kv_over(backend: "TorchBackend", anchors: Sequence[Sequence[int]],
                 source: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, ``source``'s base K (before RoPE) and V over every anchor token: [N, kv] each."""
    aid = None if source == BASE_MODEL else backend.adapter_id(source)
    ks: list[list[torch.Tensor]] = [[] for _ in range(backend.model_config.num_layers)]
    vs: list[list[torch.Tensor]] = [[] for _ in range(backend.model_config.num_layers)]
    for tokens in anchors:
        h = attention_inputs(backend, tokens, context_hidden(backend, tokens, aid))
        for n in range(len(ks)):
            k, v = kv_base(backend, h[n], n)
            ks[n].append(k)
            vs[n].append(v)
    return [torch.cat(k) for k in ks], [torch.cat(v) for v in vs]


def fit_offsets(backend: "TorchBackend", anchors: Sequence[Sequence[int]], readers: Sequence[str],
                rank: int, ridge: float = 1e-2, base_writer: bool = True) -> OffsetTable:
    """Tables for every ordered pair of ``readers`` (adapter names resident in ``backend``, a
    unified-layout backend) and, with ``base_writer``, the base model writing for each."""
    kv = backend.model_config.kv_size
    if not 0 <= rank <= kv:
        raise ValueError(f"offset rank must be in [0, {kv}] (the layer's K/V width), got {rank}")
    writers = ([BASE_MODEL] if base_writer else []) + list(readers)
    base = {s: base_kv_over(backend, anchors, s) for s in writers}
    pairs = tuple(fit_pair(w, r, base[w][0], base[w][1], base[r][0], base[r][1], rank, ridge)
                  for w in writers for r in readers if w != r)
    return OffsetTable(rank, ridge, sum(len(a) for a in anchors), pairs)
