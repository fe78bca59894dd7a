"""TokenShadow: what every control-plane page holds, as token ids (and the adapter).

vLLM keeps its own block tables; the only way to hand it "the sequence behind these page
ids" is to resubmit the tokens. So the backend mirrors each page id's contents the way
MockBackend does (token id + adapter per slot) and rebuilds a request's prompt by reading
the pages the control plane names. An aliasing or copy-on-write mistake upstream therefore
changes the prompt vLLM sees, exactly as it would change the KV a paged kernel reads.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import PageId

_UNWRITTEN = -1


class TokenShadow:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._tokens = np.full((num_pages, page_size), _UNWRITTEN, dtype=np.int64)
        # The adapter whose request wrote each slot; vLLM's prefix cache keys merged K/V by
        # LoRA, so a prompt read across an adapter boundary would hit nothing it expects.
        self._adapter: list[list[AdapterId | None]] = [[None] * page_size for _ in range(num_pages)]

    def read(self, pages: Sequence[PageId], length: int, adapter: AdapterId | None,
             seq_id: int) -> list[int]:
        """The first ``length`` tokens behind ``pages``; every slot must be written by
        ``adapter``."""
        if length == 0:
            return []
        p = self.page_size
        if -(-length // p) > len(pages):
            raise ValueError(f"seq {seq_id}: {len(pages)} pages cannot hold {length} tokens")
        idx = np.asarray(pages[:-(-length // p)], dtype=np.int64)
        values = self._tokens[idx].reshape(-1)[:length]
        if (values == _UNWRITTEN).any():
            raise AssertionError(f"seq {seq_id}: reads slot {int(np.argmax(values == _UNWRITTEN))} "
                                 f"that was never written")
        for pos in range(0, length, p):
            page = pages[pos // p]
            owners = self._adapter[page][:min(p, length - pos)]
            if any(o != adapter for o in owners):
                raise AssertionError(f"seq {seq_id}: page {page} holds another adapter's KV")
        return values.tolist()

    def write(self, pages: Sequence[PageId], start: int, tokens: Sequence[int],
              adapter: AdapterId | None, seq_id: int) -> tuple[PageId, ...]:
        """Write ``tokens`` at ``start..``; returns the pages this write touched, in order."""
        if not tokens:
            return ()
        p = self.page_size
        end = start + len(tokens)
        if -(-end // p) > len(pages):
            raise ValueError(f"seq {seq_id}: pages cover {len(pages) * p} tokens, write reaches "
                             f"position {end - 1}")
        touched = []
        for i, token in enumerate(tokens):
            pos = start + i
            page = pages[pos // p]
            if pos % p == 0:
                # A page started afresh (new, or reused after the pool freed it): whatever a
                # previous owner left in its other slots is stale and must read as unwritten.
                self._tokens[page] = _UNWRITTEN
                self._adapter[page] = [None] * p
            self._tokens[page, pos % p] = token
            self._adapter[page][pos % p] = adapter
            if not touched or touched[-1] != page:
                touched.append(page)
        return tuple(touched)

    def copy(self, src: PageId, dst: PageId) -> None:
        self._tokens[dst] = self._tokens[src]
        self._adapter[dst] = list(self._adapter[src])
