"""Both routes that open sessions wait in the one admission queue (``EngineWorker.open``): a
burst of OpenAI completions or of branch-API opens that arrives while the engine thread is
busy is counted by ``forkserve_waiting_sessions`` and reaches ``Engine.open`` as ``Queued``,
each open seeing the requests still behind it. A request that leaves (its open fails, its
client hangs up while it waits) leaves the queue and nothing behind: the opens ahead of it
no longer weigh it, the gauge returns to 0, no session is left, the rest are served."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import pytest
from server_testlib import MODEL_NAME, quiescent_pages, wait_until

from forkserve.control.layout_policy import NOTHING_QUEUED, Queued
from forkserve.errors import InvalidRequestError
from forkserve.interfaces.server.engine_worker import EngineWorker

PAGE = 4  # server_testlib.start's page size
SHARED = [30 + i for i in range(4 * PAGE)]  # the full pages every prompt of a burst starts with
BURST = 5


def prompt(i: int) -> list[int]:
    return SHARED + [100 + i] * PAGE


@dataclass(frozen=True)
class Route:
    path: str
    body: Callable[[list[int]], dict]
    max_tokens: int  # what each open reserves past its prompt


ROUTES = {
    "openai": Route("/v1/completions", lambda ids: {"model": MODEL_NAME, "prompt": ids,
                                                    "max_tokens": 1, "temperature": 0}, 1),
    "branch": Route("/v1/sessions", lambda ids: {"model": MODEL_NAME, "tokens": ids}, 0),
}
# Which requests of the burst fail their open, and which hang up while they wait.
LEAVERS = {"none leave": (frozenset(), frozenset()),
           "one refused, one gone": (frozenset({1}), frozenset({3}))}


class OpenSpy:
    """``Engine.open`` as the engine thread calls it: each prompt with the queue it was given;
    the opens of ``refuse``d requests then fail, as a refused open does."""

    def __init__(self, open_: Callable, refuse: frozenset[int]) -> None:
        self._open, self._refuse = open_, refuse
        self.seen: list[tuple[list[int], Queued]] = []

    def __call__(self, tokens, **kwargs):
        self.seen.append((list(tokens), kwargs["queued"]))
        if tokens[-1] - 100 in self._refuse:
            raise InvalidRequestError("refused")
        return self._open(tokens, **kwargs)


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        await asyncio.sleep(0.005)


async def burst(worker: EngineWorker, http: httpx.AsyncClient, route: Route,
                gone: frozenset[int]) -> list:
    """``BURST`` requests arriving while the engine thread is held (as a long tick holds it),
    released once every open waits in the queue and those in ``gone`` hung up and left it.
    A request's one command before its open (its prompt's encoding) runs behind a first gate
    and its open queues behind a second, so the opens wait, and run, in arrival order."""
    encodings, opens = threading.Event(), threading.Event()
    worker.submit(encodings.wait)
    await until(lambda: worker.stats().queue_depth == 0)
    tasks = []
    for i in range(BURST):
        tasks.append(asyncio.ensure_future(http.post(route.path, json=route.body(prompt(i)))))
        await until(lambda: worker.stats().queue_depth == len(tasks))
    worker.submit(opens.wait)
    encodings.set()
    await until(lambda: worker.waiting_sessions() == BURST)
    for i in gone:
        tasks[i].cancel()
    await until(lambda: worker.waiting_sessions() == BURST - len(gone))
    opens.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("leavers", LEAVERS.values(), ids=LEAVERS.keys())
@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_opens_wait_in_the_queue_the_engine_opens_with(server, monkeypatch, route, leavers):
    refused, gone = leavers
    engine, worker = server.model.engine, server.state.worker
    spy = OpenSpy(engine.open, refused)
    monkeypatch.setattr(engine, "open", spy)

    async def run() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            results = await burst(worker, http, route, gone)
            for r in results:
                if route.path == "/v1/sessions" and isinstance(r, httpx.Response) and r.is_success:
                    (await http.delete(f"/v1/sessions/{r.json()['session_id']}")).raise_for_status()
            gauge = (await http.get("/metrics")).text
            return results, gauge
    results, gauge = asyncio.run(run())

    opened = [i for i in range(BURST) if i not in gone]
    behind = [len(opened) - k - 1 for k in range(len(opened))]
    assert spy.seen == [(prompt(i), Queued(n, len(prompt(i)) + route.max_tokens, len(SHARED))
                         if n else NOTHING_QUEUED) for i, n in zip(opened, behind, strict=True)]
    for i, r in enumerate(results):
        if i in gone:
            assert isinstance(r, asyncio.CancelledError)
        else:
            assert r.status_code == (400 if i in refused else 200), r.text
    assert "\nforkserve_waiting_sessions 0.0\n" in gauge
    wait_until(lambda: quiescent_pages(server)[0] == 0)
    sessions, used, published = quiescent_pages(server)
    assert used == published
