"""Overlap: the steady-decode step one tick launches and the next reads back (``config.overlap``).

A tick whose step is the steady set's rows alone launches it (``Backend.launch`` through
``launch_step``) and returns with it in flight. The next tick prepares the following step's
pages and columns while it runs, reads it back, launches the following step with the tokens
it sampled (a row whose token is a stop, or may end an aLoRA's invocation, is taken back
out first: ``SteadyRow.exits``; a row whose generation ends with the step in flight is not
prepared again), and only then applies the tokens (emit, publish): behind the next step.
Anything else — general work joining a tick, every verb and inspection (``Engine.sync``) —
reads the step back first (``sync``).

Ownership: ``StepOverlap`` owns the one ``StepHandle`` in flight from launch to its single
``result()``; the rows' pages stay the step's until then (``backend/step_handle.py``). It
owns no session state: tokens are applied through the steady set, a failure read back late
is handed to the Stepper and settled like a synchronous one (its rows become items).
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Protocol, Sequence

import numpy as np

from forkserve.backend.protocol import Backend, StepCost, StepResult
from forkserve.backend.step_handle import StepHandle, launch_step
from forkserve.control.context_tree import Node
from forkserve.control.metrics import EngineMetrics
from forkserve.control.scheduler import Grant
from forkserve.engine.steady import SteadyDecode, SteadyRow


class OverlapHost(Protocol):
    """What the overlap needs of the tick loop (``Stepper``)."""

    steady: SteadyDecode
    backend: Backend
    metrics: EngineMetrics
    clock: Callable[[], float]

    def account_cost(self, cost: StepCost, grants: Sequence[Grant]) -> None: ...

    def account_rows(self, rows: Iterable[SteadyRow]) -> None: ...

    def publish(self, node: Node) -> None: ...

    def settle_failed(self, rows: list[SteadyRow], exc: Exception) -> None: ...


class _InFlight(NamedTuple):
    """A launched step of steady rows: read back by the next tick or ``sync``."""

    handle: StepHandle
    rows: list[SteadyRow]
    version: int  # the steady set's at launch (``SteadyDecode.version``)
    positions: np.ndarray  # the launched batch's (``SteadyDecode.apply`` finds filled pages)


class StepOverlap:
    def __init__(self, host: OverlapHost) -> None:
        self.host = host
        self._inflight: _InFlight | None = None

    @property
    def pending(self) -> bool:
        """Whether a launched step waits to be read back."""
        return self._inflight is not None

    def launch(self, rows: list[SteadyRow], tokens: Sequence[int] | None = None) -> None:
        """Launch the step of ``rows`` (prepared) and keep it in flight. ``tokens``: what they
        write when the path does not hold them yet (the step before sampled them)."""
        steady = self.host.steady
        batch = steady.batch(rows, tokens)
        self._inflight = _InFlight(launch_step(self.host.backend, [], batch), rows, steady.version,
                                   batch.positions)

    def advance(self) -> bool:
        """A tick over the step in flight: prepare the next step's pages and columns while it
        runs, read it back, launch the next one with the tokens it sampled, then apply them."""
        host, steady = self.host, self.host.steady
        handle, rows, launched, positions = self._inflight
        for row in rows:
            if row.session.decode_left <= 1:  # its last token is in flight
                steady.drop(row.session.id)
        following, _ = steady.prepare(host.backend.copy_pages)
        # (The sessions ``prepare`` let go, at a boundary the pools cannot serve without
        # evicting, take the general path next tick.)
        steady.batch(following, [0] * len(following))  # warm columns
        self._inflight = None
        try:
            result = handle.result()
        except Exception as exc:  # noqa: BLE001 - settled per item, as a synchronous step's
            steady.unprepare(following)
            host.settle_failed(rows, exc)
            host.metrics.ticks += 1
            return True
        tokens = self._tokens(result, rows)
        host.account_cost(result.cost, [])
        if steady.version == launched:
            # No member left or joined since the launch: ``following`` is ``rows``, row for row.
            written = tokens
            stopped = [following[i] for i in steady.exit_rows()
                       if tokens[i] in following[i].exits]
        else:
            sampled = {row.session.id: token for row, token in zip(rows, tokens, strict=True)}
            written = [sampled[r.session.id] for r in following]
            stopped = [r for r, token in zip(following, written, strict=True)
                       if token in r.exits]
        if stopped:
            steady.unprepare(stopped)
            gone = {row.session.id for row in stopped}
            for row in stopped:
                steady.drop(row.session.id)
            kept = [(r, t) for r, t in zip(following, written, strict=True)
                    if r.session.id not in gone]
            following, written = [r for r, _ in kept], [t for _, t in kept]
        if following:
            self.launch(following, written)
        steady.apply(rows, tokens, host.clock(), host.publish, positions)
        # A member's held pages change only when it gained a page for the next step.
        host.account_rows([r for r in steady.grown if r.session.id in steady])
        host.metrics.ticks += 1
        return True

    def sync(self) -> None:
        """Read back and apply the step in flight, if any: the state every verb sees."""
        if self._inflight is None:
            return
        handle, rows, _, positions = self._inflight
        self._inflight = None
        try:
            result = handle.result()
        except Exception as exc:  # noqa: BLE001 - settled per item, as a synchronous step's
            self.host.settle_failed(rows, exc)
            return
        tokens = self._tokens(result, rows)
        self.host.account_cost(result.cost, [])
        self.host.steady.apply(rows, tokens, self.host.clock(), self.host.publish, positions)

    @staticmethod
    def _tokens(result: StepResult, rows: list[SteadyRow]) -> Sequence[int]:
        if len(result.next_tokens) != len(rows):
            raise AssertionError(f"the backend returned {len(result.next_tokens)} tokens "
                                 f"for {len(rows)} rows")
        return result.next_tokens
