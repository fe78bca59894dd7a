"""CUDA graphs for decode steps: one captured forward per (batch bucket, pages bucket, LoRA on/off).

A decode step of an 8B model is hundreds of small kernels; launching them from Python costs
more than running them (about 3.5x at batch 1 on the H200). A graph replays them with one
launch. Inputs live in static buffers; a smaller batch is padded up to its bucket with rows
that read and write only the pool's scratch page.
"""
from __future__ import annotations

import torch

from forkserve.backend.torch.attention import AttentionMetadata
from forkserve.backend.torch.batch import Batch
from forkserve.backend.torch.kv_pool import KVPool
from forkserve.backend.torch.model import CausalLM

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_bucket(n: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def pages_bucket(n: int) -> int:
    """Next power of two (at least 4): gathering more pages than needed costs bandwidth, so the
    buckets stay within 2x of the real width while bounding how many graphs are captured."""
    return max(4, 1 << (n - 1).bit_length())


class DecodeGraph:
    def __init__(self, model: CausalLM, pool: KVPool, batch: int, pages: int, use_lora: bool,
                 disaggregated: bool, device: torch.device, mempool: tuple) -> None:
        self.batch, self.pages, self.pool = batch, pages, pool
        scratch_slot = pool.scratch_page * pool.page_size
        scratch_res_slot = pool.scratch_residual_page * pool.page_size

        def full(shape: tuple[int, ...], value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        self.input_ids = full((batch,), 0, torch.int64)
        self.positions = full((batch,), 0, torch.int64)
        self.token_slot = full((batch,), -1, torch.int64)
        self.slot_mapping = full((batch,), scratch_slot, torch.int64)
        self.res_slot_mapping = full((batch,), scratch_res_slot, torch.int64) if disaggregated else None
        self.block_tables = full((batch, pages), pool.scratch_page, torch.int32)
        self.res_block_tables = (full((batch, pages), pool.scratch_residual_page, torch.int32)
                                 if disaggregated else None)
        self.seq_lens = full((batch,), 1, torch.int32)
        self.seq_slot = full((batch,), -1, torch.int64)
        self._padding = {  # what a padded row holds: a 1-token sequence on the scratch page
            "input_ids": 0, "positions": 0, "token_slot": -1, "slot_mapping": scratch_slot,
            "res_slot_mapping": scratch_res_slot, "block_tables": pool.scratch_page,
            "res_block_tables": pool.scratch_residual_page, "seq_lens": 1, "seq_slot": -1}
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping, res_slot_mapping=self.res_slot_mapping,
            block_tables=self.block_tables, res_block_tables=self.res_block_tables,
            seq_lens=self.seq_lens, query_starts=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_slot=self.seq_slot, query_lens_host=(), seq_lens_host=(), seq_slot_host=(), decode_only=True)
        rows = torch.arange(batch, device=device)

        def forward() -> torch.Tensor:
            return model.forward(self.input_ids, self.positions, self.token_slot, meta, pool, rows, use_lora)

        # Warm up on a side stream (allocator and library handles settle), then capture.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.logits = forward()

    def run(self, batch: Batch) -> torch.Tensor:
        """Replay for a decode batch built on the host; returns logits [real rows, vocab]."""
        n = batch.input_ids.shape[0]
        meta = batch.meta
        width = meta.block_tables.shape[1]
        sources = {"input_ids": batch.input_ids, "positions": batch.positions, "token_slot": batch.token_slot,
                   "slot_mapping": meta.slot_mapping, "res_slot_mapping": meta.res_slot_mapping,
                   "block_tables": meta.block_tables, "res_block_tables": meta.res_block_tables,
                   "seq_lens": meta.seq_lens, "seq_slot": meta.seq_slot}
        for name, src in sources.items():
            dst = getattr(self, name)
            if dst is None:
                continue
            # Pad on the host, then one copy per buffer (no device-side fill kernels).
            host = torch.full(dst.shape, self._padding[name], dtype=dst.dtype)
            if dst.dim() == 2:
                host[:n, :width] = src
            else:
                host[:n] = src
            dst.copy_(host, non_blocking=True)
        self.graph.replay()
        return self.logits[:n]
