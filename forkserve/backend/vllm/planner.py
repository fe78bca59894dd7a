"""plan_step: a SeqWork batch -> a StepPlan (pure; reads the TokenShadow, writes nothing)."""
from __future__ import annotations

from typing import Mapping, Sequence

from forkserve.backend.protocol import PageId, PageKind, SamplingParams, SeqWork
from forkserve.backend.vllm.adapters import AdapterTable
from forkserve.backend.vllm.lookahead import eligible
from forkserve.backend.vllm.plan import PhasePlan, RequestPlan, RequestSampling, StepPlan
from forkserve.backend.vllm.token_shadow import TokenShadow
from forkserve.config import KVForm

_GREEDY_WRITE = RequestSampling(temperature=0.0, top_p=1.0, seed=None)
_SEED_MOD = 1 << 63


def plan_step(work: Sequence[SeqWork], shadow: TokenShadow, adapters: AdapterTable, *,
              step_index: int, two_class: bool, cow_blocks: bool, decode_ahead: int = 1,
              max_context: int | None = None,
              served_pins: Mapping[int, Sequence[tuple[int, PageId]]] | None = None) -> StepPlan:
    """One request per item; committed requests first. ``two_class`` puts speculative
    requests in a second phase, so vLLM never batches them ahead of committed ones;
    otherwise vLLM's own scheduler sees one phase. ``cow_blocks`` asks each request to pin
    the blocks of the pages it completed (docs/VLLM_BACKEND.md: the page mapping), and the
    ``served_pins`` of its sequence: (page index, page id) that steps served from the
    lookahead completed, still behind the same page ids and before this write.
    ``decode_ahead``: a committed plain decode (``lookahead.eligible``) asks for that many
    tokens, clamped so prompt + tokens stay within ``max_context``."""
    p = shadow.page_size
    committed: list[RequestPlan] = []
    speculative: list[RequestPlan] = []
    unpin: list[int] = []
    if len({item.seq_id for item in work}) != len(work):
        raise ValueError("a step holds at most one item per sequence (request ids are per seq)")
    for item in work:
        if item.form is not KVForm.MERGED or item.slots.residual_pages is not None:
            raise ValueError(f"seq {item.seq_id}: vLLM stores merged K/V ({PageKind.UNIFIED.value} "
                             f"pages); the split form and residual pages need a residual pool")
        if not item.tokens:
            raise ValueError(f"seq {item.seq_id}: empty write")
        lora = adapters.resolve(item.adapter_id)
        prefix = shadow.read(item.slots.pages, item.start_pos, item.adapter_id, item.seq_id)
        end = item.start_pos + len(item.tokens)
        if -(-end // p) > len(item.slots.pages):
            raise ValueError(f"seq {item.seq_id}: pages cover {len(item.slots.pages) * p} tokens, "
                             f"write reaches position {end - 1}")
        first, last = item.start_pos // p, (end - 1) // p
        touched = item.slots.pages[first:last + 1]
        unpin.extend(touched)
        pins = ()
        if cow_blocks:
            earlier = tuple((j, page) for j, page in (served_pins or {}).get(item.seq_id, ())
                            if (j + 1) * p <= item.start_pos and item.slots.pages[j] == page)
            pins = earlier + tuple((j, item.slots.pages[j]) for j in range(first, end // p))
        ahead = 1
        if decode_ahead > 1 and eligible(item):
            room = decode_ahead if max_context is None else max_context - end
            ahead = max(1, min(decode_ahead, room))
        request = RequestPlan(
            request_id=f"fs-{step_index}-{item.seq_id}", seq_id=item.seq_id,
            prompt=tuple(prefix) + tuple(item.tokens), lora=lora,
            sampling=_sampling(item.sampling, end, ahead), returns_token=item.sampling is not None,
            speculative=item.speculative, decode=item.decode, new_tokens=len(item.tokens),
            pin_blocks=pins)
        (speculative if item.speculative else committed).append(request)
    if two_class and committed and speculative:
        phases = (PhasePlan(tuple(committed)), PhasePlan(tuple(speculative)))
    else:
        phases = (PhasePlan(tuple(committed + speculative)),)
    return StepPlan(phases, tuple(unpin))


def _sampling(sampling: SamplingParams | None, position: int,
              max_tokens: int = 1) -> RequestSampling:
    if sampling is None:
        return _GREEDY_WRITE
    seed = sampling.seed
    if seed is not None:
        # Every request restarts its seeded generator: offset the seed by the position so
        # consecutive requests do not draw one random stream's first value again. With
        # decode-ahead the ``max_tokens`` tokens of one request come from that one stream
        # (seeded at its first position). A rerun of the same verbs with the same
        # ``vllm_decode_ahead`` makes the same requests (lookahead is served or dropped
        # deterministically), so the same seed gives the same tokens; a different K draws
        # different (equally distributed) tokens.
        seed = (seed + position) % _SEED_MOD
    return RequestSampling(sampling.temperature, sampling.top_p, seed, max_tokens)
