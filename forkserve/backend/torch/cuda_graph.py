"""CUDA graphs for decode steps: one captured forward per (batch bucket, pages bucket, LoRA
on/off, split or merged form, cascade tiles bucket, mixed or not).

A split graph serves every batch with a split row. In a layout whose adapters may also run
merged (adaptive), a batch with merged rows of an adapter among split ones replays the
mixed split graph: each row's form is one more input (``kv_merge``), so its merged rows get
their k/v LoRA delta in their base pages and no residual (``seq_slot`` -1), which is what
the eager path computes from the same rows (``DecodeRows.to_batch``). A batch of split rows
alone replays the plain split graph, which computes no k/v delta at all, as the
disaggregated layout's: with one split graph for both, the adaptive layout's split batches
ran the k and v LoRA expansions of every layer, masked to zero on every row (react W = 32
on the H200, round 34: adaptive's decode steps 16.2 ms against disaggregated's 15.4 at the
same form).

A decode step of an 8B model is hundreds of small kernels; launching them from Python costs
more than running them (about 3.5x at batch 1 on the H200). A graph replays them with one
launch. Inputs live in one packed int64 device buffer, filled from the step's ``DecodeRows``
(``decode_rows.py``) into a pinned host buffer and sent by one asynchronous copy per step; a smaller
batch is padded up to its bucket with rows that read and write only the pool's scratch page. The
greedy argmax is captured too. Every tensor the graph reads is owned by the DecodeGraph: a temporary
freed after capture would be reused and read as garbage.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import numpy as np
import torch

from forkserve.backend.torch import cascade as cascade_tiles
from forkserve.backend.torch.attention import AttentionMetadata
from forkserve.backend.torch.batch import BatchLimits
from forkserve.backend.torch.cascade import CascadePlan, CascadeTiles
from forkserve.backend.torch.decode_rows import ROW_FIELDS, TABLE_FIELDS, DecodeRows
from forkserve.backend.torch.kv_pool import KVPool
from forkserve.backend.torch.model import CausalLM


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector runs inside whatever allocation crosses its threshold. If it
    frees a dead backend's CUDA objects (a graph, a pinned buffer, an event) while a capture is
    open, that CUDA call is illegal in capture and the process aborts: a failed test's
    traceback cycle took the CUDA suite down this way. The garbage waits for the capture."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_bucket(n: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def pages_bucket(n: int) -> int:
    """Multiples of 8 pages up to 64, powers of two beyond: a graph gathers (eager) or plans
    splits (Triton) for its bucket's width, so buckets stay close to the real width while
    bounding how many graphs get captured."""
    if n <= 4:
        return 4
    if n <= 64:
        return -(-n // 8) * 8
    return 1 << (n - 1).bit_length()


class DecodeGraph:
    def __init__(self, model: CausalLM, pool: KVPool, batch: int, pages: int, use_lora: bool,
                 split: bool, limits: BatchLimits, device: torch.device, mempool: tuple,
                 tiles: int = 0, agents: int = 1, mixed: bool = False) -> None:
        self.batch, self.pages, self.pool, self.limits = batch, pages, pool, limits
        self.padding = {  # what a padded row holds: a 1-token sequence on the scratch page
            "input_ids": 0, "positions": 0, "token_slot": -1,
            "slot_mapping": pool.scratch_page * pool.page_size,
            "res_slot_mapping": pool.scratch_residual_page * pool.page_size, "seq_lens": 1,
            "seq_slot": -1, "kv_merge": 0, "block_tables": pool.scratch_page,
            "res_block_tables": pool.scratch_residual_page,
            # cascade: suffix from key 0, tiles of no row
            "kv_starts": 0, "tile_seqs": -1, "tile_lens": 0}
        shapes = ({name: (batch,) for name in ROW_FIELDS}
                  | {name: (batch, pages) for name in TABLE_FIELDS})
        if tiles:
            shapes |= {"kv_starts": (batch,), "tile_seqs": (tiles, agents), "tile_lens": (tiles,)}
        offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
        total = 0
        for name, shape in shapes.items():
            offsets[name] = (total, shape)
            total += int(np.prod(shape))
        self.packed = torch.empty(total, dtype=torch.int64, device=device)
        self.host = torch.empty(total, dtype=torch.int64, pin_memory=True)
        host_np = self.host.numpy()
        self.host_views = {n: host_np[o:o + int(np.prod(s))].reshape(s)
                           for n, (o, s) in offsets.items()}
        self.copied = torch.cuda.Event()
        self._send(None)
        view = {n: self.packed[o:o + int(np.prod(s))].view(s) for n, (o, s) in offsets.items()}
        self.input_ids = view["input_ids"]  # a fed step's tokens land here, device to device
        self.rows = torch.arange(batch, device=device)
        self.query_starts = torch.arange(batch + 1, dtype=torch.int32, device=device)

        def forward() -> torch.Tensor:
            # The int32 casts (and the form mask) run inside the graph, so they see every step's
            # new inputs.
            merge = (view["kv_merge"] != 0)[:, None] if mixed else None
            cascade = CascadeTiles(view["tile_seqs"].to(torch.int32),
                                   view["tile_lens"].to(torch.int32),
                                   view["kv_starts"].to(torch.int32)) if tiles else None
            meta = AttentionMetadata(
                slot_mapping=view["slot_mapping"],
                res_slot_mapping=view["res_slot_mapping"] if split else None,
                block_tables=view["block_tables"].to(torch.int32),
                res_block_tables=view["res_block_tables"].to(torch.int32) if split else None,
                seq_lens=view["seq_lens"].to(torch.int32), query_starts=self.query_starts,
                seq_slot=view["seq_slot"], query_lens_host=(), seq_lens_host=(), seq_slot_host=(),
                decode_only=True, cascade=cascade, kv_merge_mask=merge)
            return model.forward(view["input_ids"], view["positions"], view["token_slot"], meta,
                                 pool, self.rows, use_lora)

        # Warm up on a side stream (allocator, library handles and kernel compiles settle),
        # then capture.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(self.graph, pool=mempool):
            self.logits = forward()
            self.greedy = self.logits.argmax(dim=-1)

    def _send(self, rows: DecodeRows | None, cascade: CascadePlan | None = None,
              stream: torch.cuda.Stream | None = None) -> None:
        self.copied.synchronize()  # the previous step's copy has finished reading the pinned buffer
        views = self.host_views
        n, width = rows.block_tables.shape if rows is not None else (0, 0)
        # Only what the rows leave is padding: a full-table reset is B x pages words a step.
        # A full bucket leaves none (an empty slice's store is still a numpy call).
        short, narrow = n < self.batch, width < self.pages
        for name in ROW_FIELDS:
            if short:
                views[name][n:] = self.padding[name]
            if n:
                views[name][:n] = getattr(rows, name)
        for name in TABLE_FIELDS:
            if short:
                views[name][n:] = self.padding[name]
            if narrow:
                views[name][:n, width:] = self.padding[name]
            if n:
                views[name][:n, :width] = getattr(rows, name)
        for name in ("kv_starts", "tile_seqs", "tile_lens"):
            if name in views:
                views[name][...] = self.padding[name]
        cascade_tiles.fill(cascade, views)
        self.packed.copy_(self.host, non_blocking=True)
        self.copied.record(stream)

    def run(self, rows: DecodeRows, cascade: CascadePlan | None = None,
            fed: torch.Tensor | None = None,
            stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for validated decode rows: (logits [n, vocab], greedy tokens [n]), copied
        out of the graph's output buffers, which the next replay overwrites (a caller of
        TorchBackend.forward may keep a step's logits). ``cascade``: at most the graph's tiles.
        ``fed``: the rows' input tokens as a device tensor [n] (an earlier step's sampled
        tokens, not read back): copied over ``rows.input_ids`` on the stream, after the
        host buffer's copy and before the replay. ``stream``: the current one where the caller
        holds it (a lookup builds a Stream object; three a step were ~0.07 ms of the H200
        host's profiled step)."""
        self._send(rows, cascade, stream)
        if fed is not None:
            self.input_ids[:len(rows)].copy_(fed, non_blocking=True)
        self.graph.replay()
        n = len(rows)
        return self.logits[:n].clone(), self.greedy[:n].clone()
