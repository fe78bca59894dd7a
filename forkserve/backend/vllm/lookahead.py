"""Lookahead: decode tokens vLLM already produced for a sequence, ahead of the Engine.

Decode-ahead (docs/VLLM_BACKEND.md): a committed plain decode asks vLLM for K tokens in one
request; the step returns the first and the rest are kept here, per sequence. While the
Engine then writes exactly those tokens, one per step, at the expected positions through
the same pages, with the same adapter and sampling, the next token is served from here and
vLLM gets no request: the history behind the pages is exactly the request's prompt plus the
tokens served since, so vLLM would have produced the same token.

Ownership and lifetime: one ``Lookahead`` belongs to one ``VllmBackend`` and is touched only
by its ``step``, ``copy_pages`` and ``close``. An entry lives until it is served out,
contradicted (another token, position, adapter, sampling, pages; a non-decode or speculative
write of its sequence; any other write or copy onto its pages) or dropped (idle too long,
``close``). Dropping costs only speed: the next step of that sequence becomes a request.

It also keeps, per sequence, the full pages that served steps completed: no request wrote
them, so no request pinned them; the sequence's next request pins them (its prompt holds
those blocks), unless a write or copy touched them first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import PageId, SamplingParams, SeqWork

# An entry not served for this many steps is dropped (its sequence finished or paused):
# the lookahead holds at most the sequences that decoded lately.
MAX_IDLE_STEPS = 64


def eligible(item: SeqWork) -> bool:
    """A committed decode whose sampling vLLM applies whole: temperature, top-p, seed. The
    Engine's per-token parts (penalties, logit bias, constraints, logprobs) and prompt
    logprobs need the Engine between tokens, so such items never decode ahead."""
    s = item.sampling
    return (item.decode and not item.speculative and s is not None and s.plain
            and s.prompt_logprobs is None and item.prompt_logprobs is None
            and len(item.tokens) == 1)


def sampling_key(s: SamplingParams) -> tuple[float, float, int | None]:
    return (s.temperature, s.top_p, s.seed)


@dataclass
class _Entry:
    pos: int                       # where the Engine's next write is expected
    token: int                     # the token expected there (returned by the last step)
    queue: list[int]               # tokens the next served steps return, in order
    pages: tuple[PageId, ...]      # the pages holding positions 0..pos-1
    # The request's adapter. (VllmBackend's requests ignore ``adapter_start``, so it is not
    # part of the match: it would only follow whatever the request did.)
    adapter_id: AdapterId | None
    sampling: tuple[float, float, int | None]
    last_step: int
    page_set: frozenset[PageId] = field(init=False)

    def __post_init__(self) -> None:
        self.page_set = frozenset(self.pages)


class Lookahead:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._entries: dict[int, _Entry] = {}
        # seq id -> (page index, page id) completed by served steps, not pinned yet.
        self._unpinned: dict[int, list[tuple[int, PageId]]] = {}
        self._unpinned_step: dict[int, int] = {}
        self.served = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, item: SeqWork, tokens: Sequence[int], step: int) -> None:
        """A request for ``item`` returned ``tokens`` (the first went back to the Engine)."""
        self._drop(item.seq_id)
        if len(tokens) < 2:
            return
        end = item.start_pos + len(item.tokens)
        assert item.sampling is not None
        self._entries[item.seq_id] = _Entry(
            end, tokens[0], list(tokens[1:]), tuple(item.slots.pages[:-(-end // self.page_size)]),
            item.adapter_id, sampling_key(item.sampling), step)

    def serve(self, work: Sequence[SeqWork], step: int) -> dict[int, int]:
        """Served items' next tokens by seq id. Drops first every entry a write of this step
        contradicts: a write of its own sequence that is not the expected one, or any other
        sequence's write onto its pages."""
        touched: dict[PageId, set[int]] = {}
        p = self.page_size
        for item in work:
            end = item.start_pos + len(item.tokens)
            for j in range(item.start_pos // p, -(-end // p)):
                if j < len(item.slots.pages):
                    touched.setdefault(item.slots.pages[j], set()).add(item.seq_id)
        if touched:
            self._drop_touching(touched)
        out: dict[int, int] = {}
        for item in work:
            entry = self._entries.get(item.seq_id)
            if entry is None:
                continue
            if not self._matches(entry, item):
                self._drop(item.seq_id)
                continue
            out[item.seq_id] = entry.queue.pop(0)
            self.served += 1
            end = entry.pos + 1
            if end % p == 0:  # a full page no request will pin: the next request does
                self._unpinned.setdefault(item.seq_id, []).append((end // p - 1,
                                                                   item.slots.pages[end // p - 1]))
                self._unpinned_step[item.seq_id] = step
            if entry.queue:
                entry.token, entry.pos = out[item.seq_id], end
                entry.pages = tuple(item.slots.pages[:-(-end // p)])
                entry.page_set = frozenset(entry.pages)
                entry.last_step = step
            else:
                del self._entries[item.seq_id]
        for seq_id in [s for s, e in self._entries.items() if step - e.last_step > MAX_IDLE_STEPS]:
            self._drop(seq_id)
        for seq_id in [s for s, t in self._unpinned_step.items() if step - t > MAX_IDLE_STEPS]:
            self.take_unpinned(seq_id)
        return out

    def take_unpinned(self, seq_id: int) -> list[tuple[int, PageId]]:
        """Pages served steps of ``seq_id`` completed, for its next request to pin."""
        self._unpinned_step.pop(seq_id, None)
        return self._unpinned.pop(seq_id, [])

    def drop_pages(self, pages: Iterable[PageId]) -> None:
        """Something wrote or copied onto ``pages`` outside ``serve`` (``copy_pages``)."""
        self._drop_touching({page: set() for page in pages})

    def clear(self) -> None:
        for seq_id in list(self._entries):
            self._drop(seq_id)
        self._unpinned.clear()
        self._unpinned_step.clear()

    # ------------------------------------------------------------------ internals
    def _matches(self, entry: _Entry, item: SeqWork) -> bool:
        return (eligible(item) and item.tokens == (entry.token,) and item.start_pos == entry.pos
                and item.adapter_id == entry.adapter_id
                and item.sampling is not None and sampling_key(item.sampling) == entry.sampling
                and tuple(item.slots.pages[:len(entry.pages)]) == entry.pages
                and entry.pos // self.page_size < len(item.slots.pages))

    def _drop_touching(self, touched: dict[PageId, set[int]]) -> None:
        pages = touched.keys()
        for seq_id, entry in list(self._entries.items()):
            hit = entry.page_set.intersection(pages)
            # Its own sequence writing its own pages is judged by _matches, not here.
            if any(touched[page] - {seq_id} or not touched[page] for page in hit):
                self._drop(seq_id)
        for seq_id, held in list(self._unpinned.items()):
            kept = [(j, page) for j, page in held
                    if page not in touched or touched[page] == {seq_id}]
            if kept:
                self._unpinned[seq_id] = kept
            else:
                self.take_unpinned(seq_id)

    def _drop(self, seq_id: int) -> None:
        entry = self._entries.pop(seq_id, None)
        if entry is not None:
            self.dropped += len(entry.queue)
