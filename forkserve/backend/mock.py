"""MockBackend: the Backend protocol with no GPU and no model.

Its "KV cache" stores token ids in pages, and the token it samples is a hash of the
context it *reads back through the page table*. So every aliasing, copy-on-write or
index mistake of the control plane changes the sampled tokens, and the invariant
"committed output equals a run that prefilled only committed tokens" is a real check.
Reading a slot nobody wrote raises: the control plane handed out a page it never filled.
Costs come from ``CostModel`` (modeled ms, not a GPU trace).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from forkserve.backend.byte_tokenizer import ByteTokenizer
from forkserve.backend.cost_model import CostModel
from forkserve.backend.protocol import (PageId, PageKind, SeqWork, StepCost, StepResult)
from forkserve.config import ForkServeConfig

_UNWRITTEN = -1
_HASH_MOD = (1 << 61) - 1


class MockBackend:
    def __init__(self, config: ForkServeConfig | None = None, cost_model: CostModel | None = None) -> None:
        self.config = config or ForkServeConfig()
        self.cost_model = cost_model or CostModel()
        self.tokenizer = ByteTokenizer()
        p = self.config.page_size
        self._kv = {PageKind.UNIFIED: np.full((self.config.num_pages, p), _UNWRITTEN, dtype=np.int64)}

    def page_kinds(self) -> tuple[PageKind, ...]:
        return (PageKind.UNIFIED,)

    def copy_pages(self, kind: PageKind, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        kv = self._kv[kind]
        for src, dst in pairs:
            kv[dst] = kv[src]

    def transfer_cost(self, tokens: int) -> StepCost:
        return StepCost(ms=self.cost_model.transfer_ms(tokens))

    def step(self, work: Sequence[SeqWork]) -> StepResult:
        kv = self._kv[PageKind.UNIFIED]
        p = self.config.page_size
        next_tokens: list[int | None] = []
        calls = prefill_tokens = decode_tokens = context_read = 0
        for item in work:
            pages = np.asarray(item.slots.pages, dtype=np.int64)
            positions = np.arange(item.start_pos, item.start_pos + len(item.tokens))
            if len(positions) and positions[-1] // p >= len(pages):
                raise ValueError(f"seq {item.seq_id}: pages cover {len(pages) * p} tokens, "
                                 f"write reaches position {positions[-1]}")
            kv[pages[positions // p], positions % p] = item.tokens
            if item.decode:
                decode_tokens += len(item.tokens)
            else:
                calls += 1
                prefill_tokens += len(item.tokens)
            if item.sampling is None:
                next_tokens.append(None)
                continue
            length = item.start_pos + len(item.tokens)
            context = kv[pages].reshape(-1)[:length]
            if (context == _UNWRITTEN).any():
                raise AssertionError(f"seq {item.seq_id}: reads KV slot "
                                     f"{int(np.argmax(context == _UNWRITTEN))} that was never written")
            context_read += length
            next_tokens.append(self._next_token(context))
        prefill_ms = self.cost_model.prefill_ms(calls, prefill_tokens)
        ms = prefill_ms + (self.cost_model.decode_ms(context_read) if decode_tokens else 0.0)
        return StepResult(tuple(next_tokens), StepCost(ms, prefill_tokens, decode_tokens, calls, prefill_ms))

    def _next_token(self, context: np.ndarray) -> int:
        """A deterministic function of the whole context (a polynomial hash)."""
        h = 1469598103934665603
        for t in context.tolist():
            h = (h * 1099511628211 + t + 1) % _HASH_MOD
        # Stay inside the printable byte range so generated text can be scored and shown.
        return ByteTokenizer.OFFSET + 32 + h % 95
