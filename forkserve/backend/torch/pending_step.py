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

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from forkserve.backend.protocol import SeqWork, StepCost, StepResult
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
    where the step ran inside ``launch``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._t0 = time.perf_counter()
        self._start = self._event() if self.cuda else None
        self._end: torch.cuda.Event | None = None
        self._ms: float | None = None

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
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
    work: Sequence[SeqWork]
    per_item: tuple[torch.Tensor | None, ...]   # each item's logits rows (or None)
    hidden: tuple[torch.Tensor, ...]
    sampling: Sequence[SeqWork]                 # the items that sample, in order
    last: torch.Tensor                          # their logits, one row each
    tokens: torch.Tensor | None                 # their tokens: pinned host copy in flight
    sampler: Sampler
    clock: StepClock
    _output: StepOutput | None = None

    def result(self) -> StepResult:
        return self.output().result

    def output(self) -> StepOutput:
        """The step's tokens and logits once the device has produced them."""
        if self._output is None:
            self._output = self._finish()
        return self._output

    def _finish(self) -> StepOutput:
        ms = self.clock.wait()
        tokens = self.tokens.tolist() if self.tokens is not None else []
        self.sampler.accept(self.last, [s.sampling for s in self.sampling],
                            [s.start_pos + len(s.tokens) for s in self.sampling], tokens)
        for rows, s in zip(self.per_item, self.work, strict=True):
            if s.prompt_logprobs is not None:
                record_prompt(rows, s.tokens, s.start_pos, s.prompt_logprobs)
        it = iter(tokens)
        next_tokens = tuple(next(it) if s.sampling is not None else None for s in self.work)
        prefill = [s for s in self.work if not s.decode]
        cost = StepCost(ms=ms, prefill_tokens=sum(len(s.tokens) for s in prefill),
                        decode_tokens=len(self.work) - len(prefill), prefill_calls=len(prefill))
        return StepOutput(StepResult(next_tokens, cost), self.per_item, self.hidden)
