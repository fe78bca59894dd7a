"""PendingStep: a TorchBackend step queued on the device, read back when first asked for.

``TorchBackend.launch`` queues the forward, the sampling and an asynchronous copy of the
sampled tokens into pinned host memory, records an event behind them and returns this
handle at once, so the control plane plans the next step while the device runs this one
(issue 21's overlap). ``result()`` waits for that event only; then the host's half of the
step runs: grammars accept the tokens, log-probabilities are recorded (``Sampler.accept``),
prompt log-probabilities are read out.

Ownership and lifetime: the handle belongs to whoever launched the step, from ``launch`` to
its first ``result()`` (later calls return the same output or raise the same error). Until
then the step's pages and its requests' grammar and log state are the step's: the caller
launches no step that depends on them first (``step_handle.py``). The logits it keeps are
the runner's copies, never a CUDA graph's output buffers, which the next replay overwrites.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from forkserve.backend.protocol import SamplingParams, SeqWork, StepCost, StepResult
from forkserve.backend.torch.sampler import Sampler, record_prompt


@dataclass(frozen=True)
class StepOutput:
    """A step's result plus the logits behind it (tests and scoring; not in the protocol)."""

    result: StepResult
    logits: tuple[torch.Tensor | None, ...]  # per item: [1 or len(tokens), vocab] float32, or None
    # per item: the residual stream after each decoder layer, [len(tokens), layers, hidden]
    # (forward(hidden_states=True) only; () otherwise)
    hidden: tuple[torch.Tensor, ...] = ()


class StepClock:
    """How long a step took: CUDA events on the step's stream (the device's time from the
    launch's first host action to the sampled tokens' copy), wall clock on a CPU device,
    where the step ran inside ``launch``. ``stream``: the step's, looked up once (None on
    a CPU device)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self._t0 = time.perf_counter()
        self._start = self._event() if self.cuda else None
        self._end: torch.cuda.Event | None = None
        self._ms: float | None = None

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def stop(self) -> None:
        """Mark the step's last queued work (the tokens' copy)."""
        if self.cuda:
            self._end = self._event()
        else:
            self._ms = (time.perf_counter() - self._t0) * 1e3

    def wait(self) -> float:
        """Block until the step's work is done; its duration in ms."""
        if self._ms is None:
            assert self._start is not None and self._end is not None, "StepClock.wait before stop"
            self._end.synchronize()
            self._ms = self._start.elapsed_time(self._end)
        return self._ms


@dataclass
class PendingStep:
    logits: torch.Tensor                  # the forward's logits rows, item after item
    counts: Sequence[int]                 # per item: its rows of ``logits`` (0, 1 or its tokens)
    hidden: tuple[torch.Tensor, ...]
    params: Sequence[SamplingParams]      # of the items that sample, in order
    positions: Sequence[int]              # the position each of their tokens takes
    samples: Sequence[bool] | None        # per item, whether it samples; None: every item does
    prompts: Sequence[tuple[int, SeqWork]]  # (index, item) of the items asking prompt log-probs
    cost: StepCost                        # the step's tokens; its ms once read back
    last: torch.Tensor                    # the sampling items' logits, one row each
    tokens: torch.Tensor | None           # their tokens: pinned host copy in flight
    sampler: Sampler
    clock: StepClock
    # The sampled tokens on the device [sampling items], what a fed step after this one
    # reads as its input ids before this one is read back (``DecodeBatch.fed``).
    drawn: torch.Tensor | None = None
    _result: StepResult | None = None

    def feeds(self, rows: int) -> torch.Tensor | None:
        """The device tensor a step of ``rows`` rows fed from this one reads, row for row:
        None unless every item sampled one token and there are ``rows`` of them."""
        if self.drawn is None or (self.samples is not None and not all(self.samples)) \
                or self.drawn.shape[0] != rows:
            return None
        return self.drawn

    def sampled(self) -> list[int]:
        """The sampled tokens, waited for, without the host's half of the step (``result``
        runs it once, later): what a fed step that cannot read ``drawn`` writes."""
        if self._result is not None:
            return list(self._result.next_tokens)
        self.clock.wait()
        return self.tokens.tolist() if self.tokens is not None else []

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._finish()
        return self._result

    def output(self) -> StepOutput:
        """The step's tokens and logits once the device has produced them."""
        return StepOutput(self.result(), self._per_item(), self.hidden)

    def _per_item(self) -> tuple[torch.Tensor | None, ...]:
        """Each item's rows of the logits (a step's result alone never needs them: at
        hundreds of rows one slice each is a visible share of the host's step)."""
        ends = itertools.accumulate(self.counts)
        return tuple(self.logits[e - n:e] if n else None
                     for n, e in zip(self.counts, ends, strict=True))

    def _finish(self) -> StepResult:
        ms = self.clock.wait()
        tokens = self.tokens.tolist() if self.tokens is not None else []
        self.sampler.accept(self.last, self.params, self.positions, tokens)
        if self.prompts:
            per_item = self._per_item()
            for i, s in self.prompts:
                record_prompt(per_item[i], s.tokens, s.start_pos, s.prompt_logprobs)
        if self.samples is None:
            next_tokens = tuple(tokens)
        else:
            it = iter(tokens)
            next_tokens = tuple(next(it) if sampled else None for sampled in self.samples)
        return StepResult(next_tokens, dataclasses.replace(self.cost, ms=ms))
