"""ModelRunner: one forward for a validated list of work items, eager or through a CUDA graph."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from forkserve.backend.protocol import SeqWork
from forkserve.backend.torch.batch import BatchLimits, build
from forkserve.backend.torch.cuda_graph import DecodeGraph, batch_bucket, pages_bucket
from forkserve.backend.torch.kv_pool import KVPool
from forkserve.backend.torch.model import CausalLM


@dataclass(frozen=True)
class RunOutput:
    logits: torch.Tensor          # float32 [rows, vocab]
    greedy: torch.Tensor | None   # argmax of each row, when the graph computed it already


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, limits: BatchLimits, device: torch.device,
                 use_cuda_graphs: bool) -> None:
        self.model, self.pool, self.limits, self.device = model, pool, limits, device
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int, bool, bool], DecodeGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None

    @property
    def captured_graphs(self) -> tuple[tuple[int, int, bool, bool], ...]:
        return tuple(self._graphs)

    def forward(self, work: Sequence[SeqWork], adapter_slots: Mapping[int, int], all_logits: bool) -> RunOutput:
        """Logits for every token (all_logits) or for the last token of each sampling item."""
        bucket = batch_bucket(len(work))
        # Adaptive layout: a batch of split and merged items runs eagerly (no graph has both).
        forms = {s.slots.residual_pages is not None for s in work
                 if self.limits.disaggregated and s.adapter_id is not None}
        if (self.use_cuda_graphs and not all_logits and bucket is not None and len(forms) <= 1
                and all(len(s.tokens) == 1 and not s.extra_residuals for s in work)):
            return self._replay(work, adapter_slots, bucket, split=forms == {True})
        batch = build(work, self.limits, adapter_slots, all_logits, self.device,
                      self.pool.scratch_page, self.pool.scratch_residual_page)
        logits = self.model.forward(batch.input_ids, batch.positions, batch.token_slot, batch.meta,
                                    self.pool, batch.logits_indices, batch.use_lora)
        return RunOutput(logits, None)

    def _replay(self, work: Sequence[SeqWork], adapter_slots: Mapping[int, int], bucket: int,
                split: bool) -> RunOutput:
        width = max(s.start_pos // self.limits.page_size + 1 for s in work)
        use_lora = any(s.adapter_id is not None for s in work)
        key = (bucket, pages_bucket(width), use_lora, split)
        graph = self._graphs.get(key)
        if graph is None:
            graph = DecodeGraph(self.model, self.pool, key[0], key[1], use_lora, split, self.limits,
                                self.device, self._mempool)
            self._graphs[key] = graph
        logits, greedy = graph.run(work, adapter_slots)
        rows = [i for i, s in enumerate(work) if s.sampling is not None]
        if len(rows) == len(work):
            return RunOutput(logits, greedy)  # every item samples: the rows are already in order
        index = torch.tensor(rows, device=self.device)
        return RunOutput(logits[index], greedy[index])
