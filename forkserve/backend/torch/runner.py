"""ModelRunner: one forward for a validated list of work items, eager or through a CUDA graph."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from forkserve.backend.protocol import SeqWork
from forkserve.backend.torch.batch import BatchLimits, build
from forkserve.backend.torch.cuda_graph import DecodeGraph, batch_bucket, pages_bucket
from forkserve.backend.torch.kv_pool import KVPool
from forkserve.backend.torch.model import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, limits: BatchLimits, device: torch.device,
                 use_cuda_graphs: bool) -> None:
        self.model, self.pool, self.limits, self.device = model, pool, limits, device
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int, bool], DecodeGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None

    @property
    def captured_graphs(self) -> tuple[tuple[int, int, bool], ...]:
        return tuple(self._graphs)

    def forward(self, work: Sequence[SeqWork], adapter_slots: Mapping[int, int],
                all_logits: bool) -> torch.Tensor:
        """Logits (float32) for every token (all_logits) or for the last token of each sampling item."""
        decode = all(len(s.tokens) == 1 for s in work)
        graphable = self.use_cuda_graphs and decode and not all_logits and batch_bucket(len(work)) is not None
        batch = build(work, self.limits, adapter_slots, all_logits,
                      torch.device("cpu") if graphable else self.device,
                      self.pool.scratch_page, self.pool.scratch_residual_page)
        if not graphable:
            return self.model.forward(batch.input_ids, batch.positions, batch.token_slot, batch.meta,
                                      self.pool, batch.logits_indices, batch.use_lora)
        key = (batch_bucket(len(work)), pages_bucket(batch.meta.block_tables.shape[1]), batch.use_lora)
        graph = self._graphs.get(key)
        if graph is None:
            graph = DecodeGraph(self.model, self.pool, key[0], key[1], key[2], self.limits.disaggregated,
                                self.device, self._mempool)
            self._graphs[key] = graph
        logits = graph.run(batch)
        if batch.logits_indices.shape[0] == logits.shape[0]:
            return logits  # every item samples: the rows are already in order
        return logits[batch.logits_indices.to(self.device)]
