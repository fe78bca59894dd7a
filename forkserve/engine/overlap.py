"""Overlap: the steady-decode step one tick launches and the next reads back (``config.overlap``).

A tick whose step is the steady set's rows alone launches it (``Backend.launch`` through
``launch_step``) and returns with it in flight. The next tick (``advance``) prepares the
following step's pages and columns while it runs, then takes one of two paths:

- Fed (the steady case): no member joined or left since the launch (``SteadyDecode.version``;
  so no row is at its last token: those were dropped before ``prepare``), every row's
  sampling is plain (no grammar, penalty, bias or log-probabilities: nothing reads host
  state the earlier step's ``accept`` writes, nothing records a token of the step that
  follows), and the backend declares ``Capabilities.fed_tokens``. The following step is
  launched *before* the one in flight is read back, its rows those rows again, row for row,
  its tokens taken on the device from the earlier step's sampled tokens
  (``DecodeBatch.fed``). Then the earlier step is read back and applied. A row whose token
  was a stop or an aLoRA exit (``SteadyRow.exits``) wrote, in the step now in flight, a
  position its session will not keep, and sampled a token it must not take: the step in
  flight is then read back at once, those rows' results discarded and their preparation
  undone (``steady.unprepare``: a page it took goes back only after the step that writes it
  is read back; nothing of theirs is applied or published), the others' tokens applied.
  If the earlier step fails at ``result()``, the one in flight read its tokens and fails
  with it: it is waited for, its preparation undone, and the earlier step's rows settled
  like a synchronous failure (``settle_failed``).
- Read back first (anything else): read the step back, launch the following step with the
  tokens it sampled (a row whose token is in its ``exits`` is taken back out first; a row
  whose generation ends with the step in flight is not prepared again), then apply them
  (emit, publish): behind the next step.
Anything else — general work joining a tick, every verb and inspection (``Engine.sync``) —
reads the step back first (``sync``).

Ownership: ``StepOverlap`` owns the steps in flight from launch to their single
``result()``; a step's pages stay the step's until then (``backend/step_handle.py``). At
most two are in flight, and two only inside ``advance`` (the earlier one being read back,
the fed one launched behind it); between ticks one is, so ``sync`` reads back one step and
every verb sees every step applied in order. A fed step's handle holds the earlier one's
(its tokens on the device) until it is read back. It owns no session state: tokens are
applied through the steady set, a failure read back late is handed to the Stepper and
settled like a synchronous one (its rows become items).
"""
from __future__ import annotations

from dataclasses import replace
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
        # Whether every member's sampling is plain, at the steady set's version it was read.
        self._plain: tuple[int, bool] = (-1, False)

    @property
    def pending(self) -> bool:
        """Whether a launched step waits to be read back."""
        return self._inflight is not None

    def launch(self, rows: list[SteadyRow], tokens: Sequence[int] | None = None,
               fed: StepHandle | None = None) -> None:
        """Launch the step of ``rows`` (prepared) and keep it in flight. ``tokens``: what they
        write when the path does not hold them yet (the step before sampled them); ``fed``:
        the step before, not read back, whose sampled tokens they write row for row."""
        steady = self.host.steady
        batch = steady.batch(rows, tokens, fed)
        self._inflight = _InFlight(launch_step(self.host.backend, [], batch), rows, steady.version,
                                   batch.positions)

    def advance(self) -> bool:
        """A tick over the step in flight: prepare the next step's pages and columns while it
        runs; launch the next one fed from it on the device, or read it back and launch the
        next one with the tokens it sampled; then apply its tokens."""
        host, steady = self.host, self.host.steady
        handle, rows, launched, positions = self._inflight
        for row in rows:
            if row.session.decode_left <= 1:  # its last token is in flight
                steady.drop(row.session.id)
        following, _ = steady.prepare(host.backend.copy_pages)
        # (The sessions ``prepare`` let go, at a boundary the pools cannot serve without
        # evicting, take the general path next tick.)
        if following and steady.version == launched and self._feeds(following):
            return self._advance_fed(following)
        steady.batch(following, [0] * len(following))  # warm columns
        self._inflight = None
        try:
            result = handle.result()
        except Exception as exc:  # noqa: BLE001 - settled per item, as a synchronous step's
            return self._failed(rows, following, exc)
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

    def _failed(self, rows: list[SteadyRow], following: list[SteadyRow], exc: Exception) -> bool:
        """The step of ``rows`` failed when read back: undo ``following``'s preparation (no
        step writing it is in flight any more) and settle ``rows`` like a synchronous
        failure; the tick is over."""
        self.host.steady.unprepare(following)
        self.host.settle_failed(rows, exc)
        self.host.metrics.ticks += 1
        return True

    def _feeds(self, rows: list[SteadyRow]) -> bool:
        """Whether the next step of ``rows`` (the members, row for row the step in flight's)
        may launch fed from the step in flight, before it is read back."""
        capabilities = self.host.backend.capabilities
        if not (capabilities.launch and capabilities.fed_tokens):
            return False
        version = self.host.steady.version
        if self._plain[0] != version:
            self._plain = (version, all(row.sampling.plain for row in rows))
        return self._plain[1]

    def _advance_fed(self, following: list[SteadyRow]) -> bool:
        """``advance``'s fed path: ``following`` (the rows in flight, row for row) launched
        with their tokens taken from the step in flight on the device, then that step read
        back and applied."""
        host, steady = self.host, self.host.steady
        handle, rows, _, positions = self._inflight
        self.launch(following, fed=handle)
        try:
            result = handle.result()
        except Exception as exc:  # noqa: BLE001 - settled per item, as a synchronous step's
            # The step just launched read the failed step's tokens: it fails with it. Its
            # pages are written until it ends: wait for it, then undo its preparation.
            fed, self._inflight = self._inflight, None
            _wait(fed.handle)
            return self._failed(rows, following, exc)
        tokens = self._tokens(result, rows)
        host.account_cost(result.cost, [])
        exited = {rows[i].session.id for i in steady.exit_rows() if tokens[i] in rows[i].exits}
        steady.apply(rows, tokens, host.clock(), host.publish, positions)
        if exited:
            self._settle_exited(exited)
        host.account_rows([r for r in steady.grown if r.session.id in steady])
        host.metrics.ticks += 1
        return True

    def _settle_exited(self, exited: set[int]) -> None:
        """Read back the fed step in flight, some of whose rows (session ids ``exited``) left
        the set at the token they wrote in it: their results are discarded and their
        preparation undone (the step that wrote their position is done); the others' tokens
        are applied."""
        host, steady = self.host, self.host.steady
        handle, rows, _, positions = self._inflight
        self._inflight = None
        dropped = [r for r in rows if r.session.id in exited]
        keep = [i for i, r in enumerate(rows) if r.session.id not in exited]
        kept = [rows[i] for i in keep]
        try:
            result = handle.result()
        except Exception as exc:  # noqa: BLE001 - settled per item, as a synchronous step's
            steady.unprepare(dropped)
            if kept:
                host.settle_failed(kept, exc)
            return
        tokens = self._tokens(result, rows)
        # The discarded rows ran but decoded nothing (the metrics count what the other
        # overlap paths count).
        host.account_cost(replace(result.cost,
                                  decode_tokens=result.cost.decode_tokens - len(dropped)), [])
        steady.unprepare(dropped)
        if kept:
            steady.apply(kept, [tokens[i] for i in keep], host.clock(), host.publish,
                         positions[keep])

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


def _wait(handle: StepHandle) -> None:
    """Wait for a step whose result is discarded (a fed step of a failed one)."""
    try:
        handle.result()
    except Exception:  # noqa: BLE001, S110 - it failed with the step it read: nothing to settle
        pass
