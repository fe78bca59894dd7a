"""The server's admission queue reaches the adaptive layout: opens waiting behind the engine
thread (a burst that arrived during a tick) are passed to ``Engine.open`` as ``Queued``, so a
burst that would not fit merged splits where the policy says, requests opened with nothing
behind them stay merged, and a request that leaves (its client gone, its open refused)
leaves the queue and the pools as they were."""
from __future__ import annotations

import asyncio
import threading

import pytest

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import GREEDY
from forkserve.config import KVForm
from forkserve.control.layout_policy import NOTHING_QUEUED, Queued
from forkserve.errors import InvalidRequestError
from forkserve.interfaces.server.engine_worker import EngineWorker, GenerationSpec

CONTEXT = [7 + i % 50 for i in range(64)]  # 16 pages of 4 tokens
SPEC = GenerationSpec(max_tokens=2, sampling=GREEDY, stop_ids=frozenset(), stop_strings=())
BURST = 12


def engine() -> Engine:
    # 12 agents of 19 pages at their peak against a mark of 115 pages (0.9 x 128): the burst
    # does not fit merged; split, the context is written once.
    return Engine(MockBackend(ForkServeConfig(page_size=4, num_pages=128, num_residual_pages=512,
                                              vocab_size=300, kv_layout=KVLayout.ADAPTIVE,
                                              adaptive_high_water=0.9, node_ttl_s=None)))


def prompt(i: int) -> list[int]:
    return CONTEXT + [200 + i] * 8


def form_of(eng: Engine, sid: int) -> KVForm:
    node = eng.node(sid, eng.tip(sid))
    return eng.kv.form_of(node.table, node.adapter)


def replay(queued_of) -> list[KVForm]:
    """The burst opened straight on an engine, the i-th told ``queued_of(i)``."""
    eng = engine()
    return [form_of(eng, eng.open(prompt(i), adapter=f"agent{i}", queued=queued_of(i)).id)
            for i in range(BURST)]


class Served:
    """An EngineWorker over the adaptive engine, its thread held by ``gate`` while requests
    arrive, as a tick would hold it."""

    def __init__(self) -> None:
        self.engine = engine()
        self.worker = EngineWorker(self.engine, lambda ids: "")
        self.gate = threading.Event()

    def __enter__(self) -> "Served":
        self.worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()
        self.worker.stop()

    async def burst(self, n: int, cancel: frozenset[int] = frozenset(),
                    refuse: frozenset[int] = frozenset()) -> list:
        """``n`` requests arriving while the engine thread is busy; those in ``cancel`` lose
        their client before it frees, those in ``refuse`` fail their open."""
        self.worker.submit(self.gate.wait)

        def open_as(i: int):
            if i not in refuse:
                return None
            def refused(queued: Queued) -> int:
                raise InvalidRequestError("refused")
            return refused
        tasks = [asyncio.ensure_future(self.worker.open_and_generate(
            prompt(i), f"agent{i}", SPEC, opener=open_as(i))) for i in range(n)]
        await asyncio.sleep(0)  # each task submits its open, in arrival order
        assert self.worker.waiting_sessions() == n
        for i in cancel:
            tasks[i].cancel()
        # Let the cancellations land (each leaves the queue) before the engine thread frees:
        # set at once, the gate let the thread admit a cancelled open first, whose two-token
        # generation could then finish before its undo arrived, keeping its session.
        await asyncio.sleep(0)
        assert self.worker.waiting_sessions() == n - len(cancel)
        self.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    async def forms(self, gens) -> list[KVForm]:
        """The sessions' forms, read while their generations are still this loop's."""
        forms = await self.worker.call(lambda: [form_of(self.engine, g.session_id)
                                                for g in gens])
        for gen in gens:
            await gen.collect()
        return forms


def test_a_burst_splits_where_the_policy_says():
    with Served() as served:
        async def burst():
            return await served.forms(await served.burst(BURST))
        forms = asyncio.run(burst())
    # What the policy says for each open given the requests still behind it.
    expected = replay(lambda i: Queued(BURST - i - 1, len(prompt(i)) + SPEC.max_tokens,
                                       len(CONTEXT)))
    assert forms == expected
    # The first open already sees the burst behind it, which would not fit merged: split.
    assert forms[0] is KVForm.SPLIT and forms[-1] is KVForm.SPLIT
    # Blind to the queue, more of the burst would open merged and take the room first.
    assert expected.count(KVForm.MERGED) < replay(lambda i: NOTHING_QUEUED).count(KVForm.MERGED)


def test_requests_with_nothing_behind_them_stay_merged():
    # Opened one at a time, five fit merged under the mark: the 5th of the burst split only
    # because the rest of the burst waited behind it.
    with Served() as served:
        async def one_by_one():
            served.gate.set()
            return await served.forms([await served.worker.open_and_generate(
                prompt(i), f"agent{i}", SPEC) for i in range(5)])
        assert asyncio.run(one_by_one()) == [KVForm.MERGED] * 5
        assert served.worker.stats().waiting_sessions == 0


@pytest.mark.parametrize("cancel,refuse", [({0, 5, 11}, set()), (set(), {1, 7})])
def test_requests_that_leave_leak_nothing(cancel, refuse):
    with Served() as served:
        async def burst():
            results = await served.burst(BURST, frozenset(cancel), frozenset(refuse))
            kept = [r for i, r in enumerate(results) if i not in cancel | refuse]
            await served.forms(kept)  # their generations run to the end
            return results, kept
        results, kept = asyncio.run(burst())
        assert all(isinstance(results[i], asyncio.CancelledError) for i in cancel)
        assert all(isinstance(results[i], InvalidRequestError) for i in refuse)
        assert served.worker.waiting_sessions() == 0

        def audit(eng: Engine):
            # Cancelled clients' sessions are aborted once their open ran (nothing else holds
            # them); the rest finished their generation and are closed here.
            live = set(eng.sessions)
            for sid in live:
                eng.close(sid, pin=False)
            eng.check_integrity()
            eng.evict_all()
            return live, eng.pool.num_used, eng.residual_pool.num_used
        live, base, residual = served.worker.run_sync(lambda: audit(served.engine))
        assert live == {g.session_id for g in kept}
        assert (base, residual) == (0, 0)
