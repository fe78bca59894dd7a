"""ModelRunner: one forward for a validated list of work items, eager or through a CUDA graph."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from forkserve import kernels
from forkserve.backend.protocol import SeqWork, SharedPrefix
from forkserve.backend.torch import cascade as cascade_tiles
from forkserve.backend.torch.batch import Batch, BatchLimits, build
from forkserve.backend.torch.cuda_graph import (
    BATCH_BUCKETS,
    DecodeGraph,
    batch_bucket,
    pages_bucket,
)
from forkserve.backend.torch.decode_rows import DecodeRows
from forkserve.backend.torch.kv_pool import KVPool
from forkserve.backend.torch.mixed_batch import join
from forkserve.backend.torch.model import CausalLM


@dataclass(frozen=True)
class RunOutput:
    logits: torch.Tensor          # float32 [rows, vocab]
    greedy: torch.Tensor | None   # argmax of each row, when the graph computed it already
    hidden: torch.Tensor | None = None  # [tokens, layers, hidden] when asked for


# batch bucket, pages bucket, LoRA, split form, tiles bucket, merged rows of an adapter
# beside split ones (the mixed graph: each row's form one more input)
GraphKey = tuple[int, int, bool, bool, int, bool]


def graph_key(rows: DecodeRows, cascade: cascade_tiles.CascadePlan | None) -> GraphKey | None:
    """The decode graph ``rows`` replay; None past the largest batch bucket (they run
    eagerly). Rows with a split one replay a split graph whatever the other rows' form: the
    mixed one where a merged row of an adapter is among them (its k/v LoRA delta goes into
    its base pages: cuda_graph.py), so the adaptive layout's mixed batches replay too, and
    the plain one otherwise, which computes no k/v delta at all."""
    return key_of(len(rows), rows.block_tables.shape[1], rows.has_adapter, rows.split,
                  len(cascade.tile_rows) if cascade is not None else 0, rows.mixed)


def key_of(rows: int, pages: int, lora: bool, split: bool, tiles: int,
           mixed: bool = False) -> GraphKey | None:
    """``graph_key`` of ``rows`` rows whose widest reads ``pages`` pages, in ``tiles`` tiles
    (``mixed``: merged rows of an adapter among split ones)."""
    bucket = batch_bucket(rows)
    if bucket is None:
        return None
    return bucket, pages_bucket(pages), lora, split, cascade_tiles.tiles_bucket(tiles), mixed


def ahead_keys(max_batch: int, context_pages: int, use_lora: bool, splits: Sequence[bool],
               agents: int | None, mixed: bool = False) -> tuple[GraphKey, ...]:
    """The graphs ``ModelRunner.capture_decode_graphs`` captures: every batch bucket up to
    ``max_batch``'s, at the pages bucket of ``context_pages``, in each form (``mixed``: the
    split one also with merged rows among its own, for a layout that serves both), and with
    cascade (``agents`` rows per tile; None: cascade off) every tiles bucket the agents of
    one shared context take (``cascade.tiles_buckets``); other tilings are captured on use."""
    top = batch_bucket(max_batch) or BATCH_BUCKETS[-1]
    return tuple((bucket, pages_bucket(context_pages), use_lora, split, tiles, merged)
                 for bucket in BATCH_BUCKETS if bucket <= top for split in splits
                 for merged in ((False, True) if split and mixed else (False,))
                 for tiles in (cascade_tiles.tiles_buckets(bucket, agents) if agents else (0,)))


def decode_shaped(work: Sequence[SeqWork]) -> bool:
    """Every item is one token with nothing beyond it: the step may plan cascade tiles and
    replay a decode graph; any other step runs eagerly over ``build``'s batch."""
    return all(len(s.tokens) == 1 and not s.extra_residuals and s.prompt_logprobs is None
               for s in work)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, limits: BatchLimits, device: torch.device,
                 use_cuda_graphs: bool, cascade: bool = True) -> None:
        self.model, self.pool, self.limits, self.device = model, pool, limits, device
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        # Cascade attention for items that share a page prefix: decode batches (both forms),
        # a prefill step's chunks (unified form; its attention's policy decides per group).
        self.cascade = cascade
        self.cascade_agents = kernels.cascade_tile_agents(model.cfg.num_heads
                                                          // model.cfg.num_kv_heads)
        self._graphs: dict[GraphKey, DecodeGraph] = {}
        # Graphs a step had to capture itself (its key was not captured ahead): each costs
        # that step two eager forwards and a capture (benchmarks report it).
        self.captured_on_use = 0
        self._mempool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None

    @property
    def captured_graphs(self) -> tuple[GraphKey, ...]:
        return tuple(self._graphs)

    def replays(self, work: Sequence[SeqWork], all_logits: bool, hidden_states: bool) -> bool:
        """Whether a step over ``work`` may replay a decode graph, from the items' rows
        (``forward``'s ``rows``): graphs on, decode-shaped items, no logits beyond the sampled
        rows', no hidden states (a replayed graph keeps no per-layer tensors)."""
        return (self.use_cuda_graphs and not all_logits and not hidden_states
                and decode_shaped(work))

    def forward(self, work: Sequence[SeqWork], adapter_slots: Mapping[int, int], all_logits: bool,
                hidden_states: bool = False, rows: DecodeRows | None = None,
                stream: torch.cuda.Stream | None = None) -> RunOutput:
        """Logits for every token (all_logits) or, per item, for every token (prompt
        log-probabilities) or the last (it samples) or none; hidden_states: also every token's
        residual stream after each layer (runs eagerly). ``rows``: the items as decode rows
        (``decode_rows.of_items``) where they may replay a graph (``replays``); ``stream``:
        the step's (a replay's input copy is ordered on it)."""
        # Mixed merged/split batches too: a merged row has no residual (seq_slot -1), so the
        # split-form kernels read its base pages as unified K/V, in a tile or alone. A step
        # that prefills plans tiles for its one-token items (its attention's decode rows).
        plan = self._tiles(cascade_tiles.decode_marks(work))
        key = graph_key(rows, plan) if rows is not None else None
        if key is not None:
            out = self._replay(rows, key, plan, stream=stream)
            sampled = [i for i, s in enumerate(work) if s.sampling is not None]
            if len(sampled) == len(work):
                return out  # every item samples: the rows are already in order
            index = torch.tensor(sampled, device=self.device)
            return RunOutput(out.logits[index], out.greedy[index])
        batch = build(work, self.limits, adapter_slots, all_logits, self.device,
                      self.pool.scratch_page, self.pool.scratch_residual_page, plan,
                      marks=self.cascade)
        if hidden_states:
            logits, hidden = self.model.forward_hidden(*self._args(batch))
            return RunOutput(logits, None, hidden)
        return RunOutput(self.model.forward(*self._args(batch)), None)

    def forward_rows(self, rows: DecodeRows, plan: cascade_tiles.CascadePlan | None,
                     fed: torch.Tensor | None = None,
                     stream: torch.cuda.Stream | None = None) -> RunOutput:
        """The logits of decode rows (of either form or both), every row sampling, in order;
        ``plan``: their cascade tiles, None with ``cascade`` off (the caller keeps them
        across steps: ``kept_tables.py``). ``fed``: the rows' input tokens as a device tensor
        [n] (an earlier step's sampled tokens), in place of ``rows.input_ids``; ``stream``: as
        ``forward``'s."""
        key = graph_key(rows, plan) if self.use_cuda_graphs else None
        if key is not None:
            return self._replay(rows, key, plan, fed, stream)
        batch = rows.to_batch(self.device, plan)
        if fed is not None:  # a copy: the earlier step's tensor is its handle's
            batch = dataclasses.replace(batch, input_ids=fed.to(torch.int64, copy=True))
        return RunOutput(self.model.forward(*self._args(batch)), None)

    def forward_mixed(self, work: Sequence[SeqWork], rows: DecodeRows,
                      adapter_slots: Mapping[int, int],
                      row_marks: Sequence[SharedPrefix | None]) -> RunOutput:
        """The logits of validated items that are not all decode-shaped (``decode_shaped``:
        a prefill, a committed tail), as ``forward`` gives them, then of decode rows, every
        row sampling: one eager forward, as ``forward`` runs such a step over items (no
        graph; the tiles ``forward`` would plan for ``[*work, *rows]``, ``row_marks`` being
        the rows' marks), the rows' part built from their columns (``mixed_batch.py``)."""
        scratch, scratch_res = self.pool.scratch_page, self.pool.scratch_residual_page
        items = build(work, self.limits, adapter_slots, False, self.device, scratch, scratch_res,
                      marks=self.cascade)
        plan = self._tiles([*cascade_tiles.decode_marks(work), *row_marks])
        batch = join(items, rows.to_batch(self.device, None), scratch, scratch_res,
                     self.limits.page_size,
                     cascade_tiles.to_device(plan, self.device) if plan is not None else None)
        return RunOutput(self.model.forward(*self._args(batch)), None)

    def _tiles(self, marks: Sequence[SharedPrefix | None]) -> cascade_tiles.CascadePlan | None:
        """The cascade tiles of a step's one-token sequences (None with cascade off)."""
        if not self.cascade:
            return None
        return cascade_tiles.plan(marks, self.limits.page_size, self.cascade_agents)

    def _args(self, batch: Batch) -> tuple:
        """The eager forward's arguments for ``batch``."""
        return (batch.input_ids, batch.positions, batch.token_slot, batch.meta, self.pool,
                batch.logits_indices, batch.use_lora)

    def capture_decode_graphs(self, max_batch: int, context_tokens: int, use_lora: bool,
                              splits: Sequence[bool]) -> int:
        """Capture every decode graph a run of up to ``max_batch`` sequences of up to
        ``context_tokens`` tokens will replay (as vLLM does at start-up), so no step of a
        measured run pays for a capture. Returns how many were new."""
        if not self.use_cuda_graphs:
            return 0
        keys = ahead_keys(max_batch, -(-context_tokens // self.limits.page_size), use_lora, splits,
                          self.cascade_agents if self.cascade else None,
                          mixed=self.limits.merged_form and self.limits.disaggregated)
        return sum(self._ensure_graph(key) for key in keys)

    def _ensure_graph(self, key: GraphKey) -> bool:
        """Capture the graph for ``key`` unless it exists; whether it was new."""
        if key in self._graphs:
            return False
        self._graphs[key] = DecodeGraph(self.model, self.pool, key[0], key[1], key[2], key[3],
                                        self.limits, self.device, self._mempool, key[4],
                                        self.cascade_agents, mixed=key[5])
        return True

    def _replay(self, rows: DecodeRows, key: GraphKey, cascade: cascade_tiles.CascadePlan | None,
                fed: torch.Tensor | None = None,
                stream: torch.cuda.Stream | None = None) -> RunOutput:
        self.captured_on_use += self._ensure_graph(key)
        logits, greedy = self._graphs[key].run(rows, cascade, fed, stream)
        return RunOutput(logits, greedy)
