"""EngineWorker: the one thread that owns the Engine.

The engine is single-threaded and its verbs block (a commit prefills, a generate decodes),
so every verb runs on this thread, in arrival order, and HTTP handlers await the result.
Generation is batched: each generation is queued with ``Engine.start_generate``, and each
round is one ``Engine.tick`` that decodes a token for every generating session in one
step (prefills and speculation share what is left), then the commands that arrived
meanwhile run, so a new request never waits for a long completion to end. When nothing
is queued the thread runs idle ticks: that is where speculative branches are prefilled
during a tool pause.

Admission: the server opens a request's session as soon as the engine thread reaches its
command, so the requests waiting for admission are the opens queued behind the one running
(a burst that arrived during a tick). Every open, an OpenAI choice's or a branch session's,
goes through ``open``: ``WaitingSessions`` keeps the waiters as they are submitted and taken,
and each open receives the queue behind it as ``Queued``: the adaptive layout sees the
backlog (splits a burst that would not fit merged) and nothing recounts the queue.

Ownership: a session opened for one OpenAI request lives as long as its generation: it is
closed when the generation ends, aborted when its client goes away. A session opened through
the branch API is leased: any verb on it renews the lease, and a session idle past
``session_ttl_s`` is closed here, so a client that vanishes cannot leak pages.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import SamplingParams
from forkserve.control.layout_policy import Queued
from forkserve.control.prefix_index import UNSALTED, CacheSalt
from forkserve.control.waiting_sessions import Waiter, WaitingSessions
from forkserve.engine import Engine
from forkserve.engine.session import Session
from forkserve.interfaces.server.errors import APIError
from forkserve.interfaces.server.text_stream import TextStream

log = logging.getLogger("forkserve.server")
T = TypeVar("T")

_RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window


class _Abandoned(Exception):
    """An open whose caller was cancelled while it waited: nothing was opened, and nobody
    reads this (the caller's ``call`` is cancelled)."""


@dataclass(frozen=True)
class GenerationSpec:
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    # A session opened for this one request (OpenAI endpoints): closed when the generation
    # ends, so its committed full pages stay published for the next request's prefix.
    close_when_done: bool = False
    # The text keeps the stop string (and the rest of its last token): the branch API
    # shows exactly what the session's context now holds.
    keep_stop_text: bool = False
    # With close_when_done: pin the session's KV through a tool pause when its text says one
    # begins (a reply that ends in tool calls), so the follow-up request resumes from it.
    pin_if: Callable[[str], bool] | None = None


@dataclass(frozen=True)
class Chunk:
    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" on the last chunk


@dataclass(frozen=True)
class WorkerStats:
    queue_depth: int
    waiting_sessions: int  # opens among those commands: the admission queue
    active_generations: int
    leased_sessions: int
    decode_tokens_per_s: float
    prefill_tokens_per_s: float


class Generation:
    """The consumer's side of one generation: an async iterator of chunks."""

    def __init__(self, spec: GenerationSpec, worker: "EngineWorker") -> None:
        self.spec = spec
        self.session_id: int | None = None  # set on the engine thread when it starts
        self._worker = worker
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        self.cancelled = False
        self.finished = False

    def cancel(self) -> None:
        """Stop generating and abort the session: its client is gone, so are its pages.

        Thread-safe and non-blocking, so a task that is being cancelled can call it."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._worker._wake()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    async def collect(self) -> Chunk:
        """The whole generation as one chunk."""
        text, tokens, reason = [], [], None
        async for chunk in self:
            text.append(chunk.text)
            tokens.extend(chunk.tokens)
            reason = chunk.finish_reason
        return Chunk("".join(text), tuple(tokens), reason)

    def _deliver(self, item: Chunk | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancelled = True


class _Job:
    def __init__(self, gen: Generation, stream: TextStream, session: Session) -> None:
        self.gen, self.stream, self.session = gen, stream, session
        self.sent = 0  # tokens of session.generated already delivered

    @property
    def owed(self) -> bool:
        """Tokens to decode, or a prompt whose log-probabilities are asked for still to
        prefill (``max_tokens=0`` with echo + logprobs: scoring a prompt decodes nothing)."""
        session = self.session
        if session.decode_left:
            return True
        tip = session.tree.tip
        return (self.gen.spec.sampling.prompt_logprobs is not None and not session.generated
                and tip.kv_len < tip.end)


class EngineWorker:
    def __init__(self, engine: Engine, decode: Callable[[list[int]], str], *,
                 session_ttl_s: float = 600.0) -> None:
        self.engine = engine
        self._decode = decode
        self.session_ttl_s = session_ttl_s
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any],
                                                concurrent.futures.Future] | None] = \
            queue.SimpleQueue()
        self._jobs: dict[int, _Job] = {}
        self._leases: dict[int, float] = {}
        self._rates: collections.deque[tuple[float, int, int]] = collections.deque()
        # Opens submitted and not yet run: joined on the submitting thread, left on this one
        # as they open (or on the submitting one as their caller is cancelled).
        self._waiting = WaitingSessions(engine.config.page_size)
        self._waiting_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="forkserve-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        self._thread.join()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return fut

    def run_sync(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the engine thread from a non-async thread (tests, tools)."""
        return self.submit(fn).result(timeout)

    async def call(self, fn: Callable[[], T], undo: Callable[[T], Any] | None = None) -> T:
        """Run ``fn`` on the engine thread. If the caller is cancelled before the result
        arrives (its client went away), ``undo(result)`` runs instead of leaking it."""
        fut = self.submit(fn)
        try:
            return await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            if undo is not None:
                def _undo(f: concurrent.futures.Future) -> None:
                    if not f.cancelled() and f.exception() is None:
                        self.submit(lambda: undo(f.result()))
                fut.add_done_callback(_undo)
            raise

    async def generate(self, session_id: int, spec: GenerationSpec) -> Generation:
        """Decode on an existing session's committed tip."""
        gen = Generation(spec, self)

        def register() -> Generation:
            self.ensure_idle(session_id)
            self.engine.tip(session_id)  # an unknown session is a 404 before anything starts
            self._register(session_id, gen)
            return gen
        return await self.call(register, undo=Generation.cancel)

    async def open(self, prompt: list[int], max_tokens: int, opener: Callable[[Queued], T], *,
                   salt: CacheSalt = UNSALTED, undo: Callable[[T], Any]) -> T:
        """Run ``opener(queued)`` on the engine thread, which opens a session on ``prompt`` in
        ``salt``'s boundary given the opens waiting behind it (``queued``). Until it runs, this
        open waits in the admission queue, its footprint ``prompt`` + ``max_tokens``; it leaves
        the queue as it runs (whatever then happens to it), or as its caller is cancelled (its
        client went away: nothing is opened). ``undo``: as ``call``'s, for a caller cancelled
        once its open ran."""
        waiter = self._waiting.waiter(prompt, len(prompt) + max_tokens, salt)
        with self._waiting_lock:
            self._waiting.add(waiter)
        try:
            return await self.call(lambda: opener(self._admit(waiter)), undo=undo)
        except asyncio.CancelledError:
            # A client gone before its turn leaves the queue now (the opens ahead of it no
            # longer weigh it) and ``_admit`` opens nothing for it; gone after its turn, its
            # session is undone.
            self._leave(waiter)
            raise

    async def open_and_generate(self, tokens: list[int], adapter: AdapterId | None,
                                spec: GenerationSpec, *, salt: CacheSalt = UNSALTED,
                                opener: Callable[[Queued], int] | None = None) -> Generation:
        """Open a session on ``tokens`` in ``salt``'s boundary (through ``open``: the admission
        queue) and decode on it (one OpenAI choice). ``opener(queued)`` opens it instead, on
        this thread, and returns its id (the server's tenancy: limits, cache salt, ownership)."""
        gen = Generation(spec, self)

        def register(queued: Queued) -> Generation:
            sid = opener(queued) if opener is not None else self.engine.open(
                tokens, adapter=adapter, salt=salt, queued=queued).id
            try:
                self._register(sid, gen)
            except Exception:
                self.engine.abort(sid)
                raise
            return gen
        return await self.open(tokens, spec.max_tokens, register, salt=salt,
                               undo=Generation.cancel)

    def waiting_sessions(self) -> int:
        """Opens submitted and not yet run (the admission queue)."""
        with self._waiting_lock:
            return len(self._waiting)

    def _leave(self, waiter: Waiter) -> None:
        """``waiter``'s caller is gone; a no-op once its open has begun."""
        with self._waiting_lock:
            if waiter in self._waiting:
                self._waiting.remove(waiter)

    # ------------------------------------------------------------ engine thread only
    def _admit(self, waiter: Waiter) -> Queued:
        """``waiter`` leaves the queue to open: the queue behind it, as the engine weighs it.
        Runs first in its command, so a waiter leaves before anything that may fail."""
        with self._waiting_lock:
            if waiter not in self._waiting:
                raise _Abandoned("the client left before its open's turn")
            self._waiting.remove(waiter)
            return self._waiting.queued(waiter)

    def ensure_idle(self, session_id: int) -> None:
        """Verbs other than generate may not interleave with a session's decode."""
        if session_id in self._jobs:
            raise APIError(409, f"session {session_id} is generating; wait for it to finish",
                           "ConflictError")

    def lease(self, session_id: int) -> None:
        self._leases[session_id] = time.monotonic() + self.session_ttl_s

    def release(self, session_id: int) -> None:
        self._leases.pop(session_id, None)

    def stats(self) -> WorkerStats:
        decode_rate = prefill_rate = 0.0
        if len(self._rates) >= 2:
            (t0, d0, p0), (t1, d1, p1) = self._rates[0], self._rates[-1]
            if t1 > t0:
                decode_rate, prefill_rate = (d1 - d0) / (t1 - t0), (p1 - p0) / (t1 - t0)
        return WorkerStats(self._commands.qsize(), self.waiting_sessions(), len(self._jobs),
                           len(self._leases), decode_rate, prefill_rate)

    def _register(self, session_id: int, gen: Generation) -> None:
        spec = gen.spec
        session = self.engine.start_generate(session_id, spec.max_tokens, sampling=spec.sampling,
                                             stop=spec.stop_ids)
        gen.session_id = session_id
        stream = TextStream(self._decode, spec.stop_strings, spec.keep_stop_text)
        self._jobs[session_id] = _Job(gen, stream, session)

    def _end_job(self, sid: int, job: _Job, *, failed: bool) -> None:
        """Drop a finished, failed or cancelled job and settle its session."""
        del self._jobs[sid]
        job.gen.finished = True
        if not self.engine.has_session(sid):
            return
        if job.gen.cancelled or (failed and job.gen.spec.close_when_done):
            self._leases.pop(sid, None)
            self.engine.abort(sid)
        elif job.gen.spec.close_when_done:
            pin_if = job.gen.spec.pin_if
            self.engine.close(sid,
                              pin=pin_if(self._decode(job.stream.token_ids)) if pin_if else None)
        elif sid in self._leases:
            self.lease(sid)

    def _wake(self) -> None:
        self._commands.put(None)

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._run_commands(block=False)
                if self._jobs:
                    self._generation_round()
                elif not self._idle_tick():
                    self._run_commands(block=True)
                self._expire_leases()
                self._sample_rates()
            except Exception:  # noqa: BLE001 - the server outlives one bad iteration; it is logged
                log.exception("engine worker iteration failed")
        self._run_commands(block=False)

    def _run_commands(self, block: bool) -> None:
        timeout = 1.0 if block else None
        while True:
            try:
                item = (self._commands.get(timeout=timeout) if timeout
                        else self._commands.get_nowait())
            except queue.Empty:
                return
            timeout = None  # after the first command, drain without waiting
            if item is None:
                continue
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def _idle_tick(self) -> bool:
        """Speculative work (or a queued prefill) while no request waits."""
        try:
            return self.engine.tick()
        except Exception:
            log.exception("idle tick failed")
            return False

    def _generation_round(self) -> None:
        """One engine tick decodes a token for every generating session in one batch (plus
        queued prefills and speculation in what is left); then each job gets its new tokens."""
        for sid, job in list(self._jobs.items()):
            if job.gen.cancelled:
                self._end_job(sid, job, failed=False)
        if not self._jobs:
            return
        owed = any(job.owed for job in self._jobs.values())
        try:
            progressed = self.engine.tick() if owed else True
        except Exception as exc:  # noqa: BLE001 - every request in the batch hears of it
            # A request's own failure never leaves tick (it is Session.error, below): this
            # is an engine bug, and no job can trust its session any more.
            log.exception("decode tick failed")
            self._fail_all(exc)
            return
        for sid, job in list(self._jobs.items()):
            if job.session.error is not None:
                log.warning("session %d failed: %s: %s", sid, type(job.session.error).__name__,
                            job.session.error)
                self._fail_job(sid, job, job.session.error)
            else:
                self._deliver_new_tokens(sid, job)
        if not progressed and self._jobs:
            # Tokens are owed but the scheduler planned nothing: a bug, not a client error.
            self._fail_all(RuntimeError("the engine made no progress on pending generations"))

    def _deliver_new_tokens(self, sid: int, job: _Job) -> None:
        session = job.session
        tokens = tuple(session.generated[job.sent:])
        job.sent += len(tokens)
        text = job.stream.push(tokens)
        reason = None
        if job.stream.stopped:
            reason = "stop"
            self.engine.cancel_generate(sid)
        elif not job.owed:
            reason = session.finish_reason
        if reason is not None:
            text += job.stream.finish()
            self._end_job(sid, job, failed=False)
        if text or tokens or reason:
            job.gen._deliver(Chunk(text, tokens, reason))

    def _fail_job(self, sid: int, job: _Job, exc: Exception) -> None:
        """End one job with an error; its consumer raises it (the HTTP status comes from
        the error's ``http_status``: a JSON error, or an in-band error event in a stream)."""
        self._end_job(sid, job, failed=True)
        job.gen._deliver(exc)

    def _fail_all(self, exc: Exception) -> None:
        for sid, job in list(self._jobs.items()):
            self._fail_job(sid, job, exc)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        expired = [s for s, deadline in self._leases.items()
                   if deadline < now and s not in self._jobs]
        for sid in expired:
            del self._leases[sid]
            if self.engine.has_session(sid):
                log.info("session %d idle for %.0f s: closed", sid, self.session_ttl_s)
                self.engine.close(sid)

    def _sample_rates(self) -> None:
        now = time.monotonic()
        if self._rates and now - self._rates[-1][0] < 0.25:
            return
        m = self.engine.metrics
        self._rates.append((now, m.decode_tokens, m.prefill_tokens))
        while self._rates and now - self._rates[0][0] > _RATE_WINDOW_S:
            self._rates.popleft()
