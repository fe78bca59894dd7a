"""Frozen plans: what one Backend step becomes on vLLM, before anything runs.

A ``StepPlan`` is one ``SeqWork`` batch translated: every item is one vLLM request whose
prompt is the item's whole sequence as token ids (vLLM's prefix cache supplies the part it
already holds), grouped into phases; each phase is submitted together and stepped to
completion, like one ``LLM.generate`` call.
"""
from __future__ import annotations

from dataclasses import dataclass

from forkserve.backend.protocol import PageId
from forkserve.backend.vllm.adapters import LoraRef


@dataclass(frozen=True)
class RequestSampling:
    """vLLM ``SamplingParams`` of one request: one new token (the Engine decodes one position
    per step), or ``max_tokens`` for a decode-ahead request (the first is returned, the rest
    kept in the ``Lookahead``); EOS ignored (the Engine applies stop tokens itself)."""

    temperature: float
    top_p: float
    seed: int | None
    max_tokens: int = 1


@dataclass(frozen=True)
class RequestPlan:
    request_id: str
    seq_id: int
    prompt: tuple[int, ...]
    lora: LoraRef | None
    sampling: RequestSampling
    # False for a write-only item (SeqWork.sampling is None): the request runs so its KV
    # lands in vLLM's cache, and the token it samples is dropped.
    returns_token: bool
    speculative: bool
    decode: bool
    new_tokens: int  # len(SeqWork.tokens): what the control plane asked to write
    # (block index in this request, control-plane page id): full pages this write completed;
    # each page id pins the request's block at that index once the request finishes. It also
    # names full pages earlier steps served from the lookahead completed (no request pinned
    # them; this prompt holds their blocks).
    pin_blocks: tuple[tuple[int, PageId], ...] = ()


@dataclass(frozen=True)
class PhasePlan:
    requests: tuple[RequestPlan, ...]


@dataclass(frozen=True)
class StepPlan:
    phases: tuple[PhasePlan, ...]
    # Pages this step writes into: whatever vLLM block they pinned no longer matches them.
    unpin: tuple[PageId, ...]

    def requests(self) -> tuple[RequestPlan, ...]:
        return tuple(r for phase in self.phases for r in phase.requests)
