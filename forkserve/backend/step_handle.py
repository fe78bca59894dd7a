"""Launching a step and reading it back: ``launch_step(backend, work, batch) -> StepHandle``.

A backend with ``launch(work, batch)`` (``Capabilities.launch``) starts the step and returns
at once (TorchBackend: the forward is queued on the device stream; MockBackend: the step runs
when its result is asked for); ``StepHandle.result()`` blocks until the sampled tokens are on
the host and raises whatever the step raised. Any other backend runs the step inside
``launch_step`` (``step_batched`` where ``Capabilities.columns`` says it has one, else
``step`` over ``[*work, *batch.items()]``) and the handle only holds the result: the control
plane speaks one form to both.

Ownership: the handle belongs to the control plane from launch to ``result()``, which is
asked exactly once. Until then the step's pages are the step's: the control plane may
allocate new pages and build the next step's columns, but neither rewrites nor frees a page
the step writes or reads (``engine/stepper.py`` resolves the handle before any verb runs).
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.protocol import Backend, SeqWork, StepResult


@runtime_checkable
class StepHandle(Protocol):
    def result(self) -> StepResult:
        """The step's sampled tokens (``work``'s items, then the batch's rows)."""


class Done:
    """A step that already ran: its result, or the exception it raised (raised on ``result``)."""

    def __init__(self, result: StepResult | None = None, error: Exception | None = None) -> None:
        self._result, self._error = result, error

    def result(self) -> StepResult:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def launch_step(backend: Backend, work: Sequence[SeqWork], batch: DecodeBatch | None) -> StepHandle:
    """Start one backend step over ``work`` then ``batch``'s rows."""
    if backend.capabilities.launch:
        return backend.launch(work, batch)
    try:
        return Done(run_step(backend, work, batch))
    except Exception as exc:  # noqa: BLE001 - handed to whoever asks for the result
        return Done(error=exc)


def run_step(backend: Backend, work: Sequence[SeqWork], batch: DecodeBatch | None) -> StepResult:
    """One synchronous step: one sampled token per item, then per row (a fed batch's tokens
    read from the earlier step's handle first: ``DecodeBatch.resolved``)."""
    if batch is not None and batch.fed is not None:
        batch = batch.resolved()
    if batch is None or not len(batch):
        return backend.step(work)
    if backend.capabilities.columns:
        return backend.step_batched(work, batch)
    return backend.step(step_items(work, batch))


def step_items(work: Sequence[SeqWork], batch: DecodeBatch | None) -> list[SeqWork]:
    """A step as items alone: ``work``, then ``batch``'s rows (for a backend without columns)."""
    return [*work, *batch.items()] if batch is not None and len(batch) else list(work)


class Deferred:
    """A step that runs when its result is first asked for (the mock's model of a device that
    works in the background); later calls return the same result or raise the same error."""

    def __init__(self, run: Callable[[], StepResult]) -> None:
        self._run: Callable[[], StepResult] | None = run
        self._done: Done | None = None

    def result(self) -> StepResult:
        if self._done is None:
            run, self._run = self._run, None
            try:
                self._done = Done(run())
            except Exception as exc:  # noqa: BLE001 - kept for every later call
                self._done = Done(error=exc)
        return self._done.result()
