"""The closed-loop driver: W agent workflows over one engine, admitted as their KV fits.

A workflow is admitted when the pools can hold its whole footprint (context + instruction +
every turn), so memory contention shows as waiting, the way a serving engine queues
requests it cannot fit. Agent 0 prefills the shared context first; the others then find it
published (with ``base_activations`` one base pass publishes it for every agent; with
``neutral`` a base-model request publishes its base pages).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable

from forkserve.bench.multilora.systems import ContextWriter
from forkserve.config import KVForm, KVLayout, PrefixDedup
from forkserve.control.layout_policy import Queued
from forkserve.control.waiting_sessions import Waiter, WaitingSessions
from forkserve.engine import Engine

if TYPE_CHECKING:
    from forkserve.bench.multilora.step_profile import StepProfiler
    from forkserve.bench.multilora.workload import MultiLoraParams


class Workflow:
    """One agent's closed loop over the engine: its turns, pauses and latencies."""

    def __init__(self, index: int, adapter, prompt: list[int], params: MultiLoraParams) -> None:
        self.index, self.adapter, self.prompt, self.params = index, adapter, prompt, params
        self.session: int | None = None
        self.turn = 0
        self.turn_started = 0.0
        self.resume_at: float | None = None
        self.latencies: list[float] = []
        self.outputs: list[list[int]] = []
        self.needs: dict[str, int] | None = None   # pages per side reserved at admission
        self.split = False
        # Stateless turns (``params.reopen``): the committed history the next turn re-sends.
        self.history: list[int] | None = None

    def footprint_tokens(self) -> int:
        p = self.params
        return len(self.prompt) + p.turns * (p.gen + p.observation)


class PageCensus:
    """Distinct base and residual pages over a changing set of holders, by reference count:
    adding or dropping a holder costs its own pages, never a recount of everyone's."""

    def __init__(self) -> None:
        self._pages: dict[object, tuple[Sequence[int], Sequence[int]]] = {}
        self._refs: tuple[Counter, Counter] = (Counter(), Counter())

    def holders(self) -> set:
        return set(self._pages)

    def add(self, holder, base: Sequence[int], residual: Sequence[int]) -> None:
        self._pages[holder] = (base, residual)
        for refs, pages in zip(self._refs, (base, residual), strict=True):
            refs.update(pages)

    def drop(self, holder) -> None:
        for refs, pages in zip(self._refs, self._pages.pop(holder), strict=True):
            refs.subtract(pages)
            for page in pages:
                if refs[page] <= 0:
                    del refs[page]

    def distinct(self) -> tuple[int, int]:
        return len(self._refs[0]), len(self._refs[1])


def observation(turn: int, index: int, length: int, vocab: int) -> list[int]:
    """Agent ``index``'s tool output after ``turn`` (fixed ids, so every system sees the same)."""
    return [(97 + 31 * turn + 7 * index + i) % (vocab - 3) + 3 for i in range(length)]


class Driver:
    """Runs every workflow over one engine: admission by reserved pages, the turn loop, and
    the figures a RunResult reads back (peak KV, tick times, the shared context per agent)."""

    def __init__(self, engine: Engine, flows: list[Workflow], params: MultiLoraParams,
                 sizes: dict[str, int], on_turn: Callable[[], object] | None,
                 context: list[int], writer: ContextWriter = ContextWriter.AGENT,
                 profiler: StepProfiler | None = None) -> None:
        self.engine, self.flows, self.params, self.on_turn = engine, flows, params, on_turn
        self.profiler = profiler
        self.context, self.writer = context, writer
        self.base_bytes = sizes["base"]
        self.res_bytes = sizes["residual"]
        self.peak_bytes = 0
        self.decode_ticks = 0
        self.waited_s = 0.0
        self.prompt_tokens = 0
        cache = engine.cache_stats()
        # Pages per side of the KV ("base": the unified or base pool; "residual"): admission
        # reserves against these.
        self.capacity = {"base": cache.base.pages}
        if cache.residual is not None:
            self.capacity["residual"] = cache.residual.pages
        self.reserved: dict[str, int] = {}
        self.admitted: list[Workflow] = []
        # The workflows never admitted, kept as they leave (``_queued``): the admission queue
        # the adaptive layout weighs, read in O(1) per open rather than recounted. It holds a
        # workflow until its pages fit (``_fits``), so a merged one waits for its wave.
        self._waiting = WaitingSessions(params.page_size, holds_for_room=True)
        self._waiters: dict[Workflow, Waiter] = {}
        for flow in flows:
            self._waiters[flow] = self._waiting.waiter(flow.prompt, flow.footprint_tokens())
            self._waiting.add(self._waiters[flow])
        self.context_pages = params.context // params.page_size
        self.context_kv_per_agent = 0.0
        self._context_holders = 0
        self._census = PageCensus()
        self.prefill_tick_s = 0.0
        self.prefill_tick_tokens: list[int] = []   # the prefill tokens of each prefill tick
        self.decode_tick_s = 0.0
        # The pass that writes the shared context before any agent opens (base_activations,
        # neutral): inside the makespan, in neither tick bucket.
        self.context_write_s = 0.0
        self.decode_only_ticks = 0
        # D1's host copies inside decode-only ticks: calls, pages and the host's ms.
        self.decode_copy_calls = 0
        self.decode_copy_pages = 0
        self.decode_copy_ms = 0.0

    def _tick(self) -> bool:
        m = self.engine.metrics
        before, prefill_before = m.decode_tokens, m.prefill_tokens
        copies = _host_copies(m)
        t0 = time.perf_counter()
        if self.profiler is not None and self.profiler.wants():
            did = self.profiler.run(self.engine.tick, lambda: (
                "prefill" if m.prefill_tokens > prefill_before
                else "decode" if m.decode_tokens > before else None))
        else:
            did = self.engine.tick()
        elapsed = time.perf_counter() - t0
        if m.prefill_tokens > prefill_before:
            self.prefill_tick_s += elapsed
            self.prefill_tick_tokens.append(m.prefill_tokens - prefill_before)
        elif m.decode_tokens > before:
            self.decode_tick_s += elapsed
            self.decode_only_ticks += 1
            calls, pages, ms = (now - then
                                for now, then in zip(_host_copies(m), copies, strict=True))
            self.decode_copy_calls += calls
            self.decode_copy_pages += pages
            self.decode_copy_ms += ms
        if m.decode_tokens > before:
            self.decode_ticks += 1
        # Not cache_stats(): it settles a step in flight, which would undo the overlap measured.
        used = self.engine.pages_in_use()
        self.peak_bytes = max(self.peak_bytes,
                              used.base * self.base_bytes + used.residual * self.res_bytes)
        return did

    def _needs(self, flow: Workflow) -> dict[str, int]:
        """Pages per pool this workflow will hold at its peak. Where its form shares the base
        side across agents, the shared context is counted once (by the first agent)."""
        if flow.needs is not None:
            return flow.needs
        return self._needs_as(flow, self._may_split(flow) and (
            self.engine.layout_form(flow.prompt, adapter=flow.adapter,
                                    queued=self._queued(flow)) is KVForm.SPLIT))

    def _may_split(self, flow: Workflow) -> bool:
        """Whether ``flow``'s form is the layout's to choose: an adapter's, beside a residual
        pool (otherwise merged, with no probe)."""
        return flow.adapter is not None and "residual" in self.capacity

    def _needs_as(self, flow: Workflow, split: bool) -> dict[str, int]:
        """``_needs`` with the form given."""
        p = self.params.page_size
        total = -(-flow.footprint_tokens() // p)
        layout = self.engine.config.kv_layout
        # Where the adapter applies only after the context (none, or an aLoRA invoked by the
        # instruction), the context's pages are the base model's: BASE-keyed in every layout.
        start = self.engine.kv.path_start(flow.adapter, flow.prompt)
        base_context = start is None or start >= self.params.context
        shared = layout is KVLayout.FULL_REUSE or split or base_context
        base = total - (self.context_pages if shared and self._shares_context(split) else 0)
        needs = {"base": base}
        if split:
            needs["residual"] = total
        return needs

    def _queued(self, flow: Workflow) -> Queued:
        """The workflows never admitted, behind ``flow`` (their footprint, the prefix of
        ``flow``'s first prompt they all share: the context): what the adaptive layout weighs
        against the budget."""
        return self._waiting.queued(self._waiters[flow])

    def _measure_context_kv(self, flows: list[Workflow]) -> None:
        """Bytes of the pages holding the shared context, each page counted once, over the
        agents holding it — kept at the most agents seen at once. Runs inside the timed loop
        (once per agent's first turn), so a holder's context pages are read once, when it
        starts holding (a live session's written prefix does not move), and counted in
        ``_census``: W agents cost O(W x context pages), not that times W."""
        holders = {f.session for f in flows
                   if f.session is not None and self._written(f) >= self.params.context}
        if len(holders) <= self._context_holders:
            return
        n = self.context_pages
        counted = self._census.holders()
        for session in counted - holders:
            self._census.drop(session)
        for session in holders - counted:
            t = self.engine.session_pages(session)
            self._census.add(session, t.base[:n], () if t.residual is None else t.residual[:n])
        self._context_holders = len(holders)
        base, residual = self._census.distinct()
        stored = base * self.base_bytes + residual * self.res_bytes
        self.context_kv_per_agent = stored / len(holders)

    def _shares_context(self, split: bool) -> bool:
        """Whether a running workflow of the same form holds the context written (so the index
        cannot evict it, and a new agent finds it instead of writing its own copy), or is
        prefilling it under in-flight deduplication (a later prefill waits for its pages
        instead of writing its own copy: the adaptive layout splits agents admitted
        together)."""
        if self.writer is not ContextWriter.AGENT:
            return True
        in_flight = self.engine.config.prefix_dedup is PrefixDedup.IN_FLIGHT
        return any(f.split == split and f.session is not None
                   and (in_flight or self._written(f) >= self.params.context)
                   for f in self.admitted)

    def _written(self, flow: Workflow) -> int:
        """Tokens of ``flow``'s committed path whose KV is written."""
        return self.engine.node(flow.session, self.engine.tip(flow.session)).kv_len

    def _fits(self, flow: Workflow) -> bool:
        """Admit a workflow only if what every admitted workflow may still claim fits."""
        if self._no_form_fits(flow):
            return False
        needs = self._needs(flow)
        if self._room_for(needs):
            for side, n in needs.items():
                self.reserved[side] = self.reserved.get(side, 0) + n
            if flow.needs is None:  # first admitted: it leaves the queue (a reopen never rejoins)
                self._waiting.remove(self._waiters[flow])
            flow.needs, flow.split = needs, "residual" in needs
            self.admitted.append(flow)
            return True
        return False

    def _no_form_fits(self, flow: Workflow) -> bool:
        """A workflow whose form is the layout's to choose fits in neither form: the form
        cannot change ``_fits``' answer, so the layout's probe (``layout_form``: ~0.5-1 ms of
        index walks at an 8K prompt) is skipped. The head of the queue would otherwise pay it
        at every tick it waits for its wave (docs/MULTILORA.md "Round 16")."""
        return flow.needs is None and self._may_split(flow) and not any(
            self._room_for(self._needs_as(flow, split)) for split in (False, True))

    def _room_for(self, needs: dict[str, int]) -> bool:
        return all(self.reserved.get(side, 0) + n <= self.capacity[side]
                   for side, n in needs.items())

    def _close(self, flow: Workflow, pin: bool | None = None) -> None:
        """``pin``: as ``Engine.close`` (None: the config's); a last turn pins nothing, as a
        server pins only a reply that ends in tool calls (a pause follows)."""
        self.engine.close(flow.session, pin=pin)
        for side, n in self._needs(flow).items():
            self.reserved[side] -= n
        self.admitted.remove(flow)

    def _open(self, flow: Workflow, tokens: list[int] | None = None) -> None:
        tokens = flow.prompt if tokens is None else tokens
        flow.session = self.engine.open(tokens, adapter=flow.adapter,
                                        queued=self._queued(flow)).id
        self.prompt_tokens += len(tokens)
        flow.turn_started = time.perf_counter()
        self.engine.start_generate(flow.session, self.params.gen)

    def _check_shared_pass_fits(self) -> None:
        """The one base pass writes every agent's context residual at once, before any
        admission: say so plainly rather than fail inside the engine."""
        pages = self.capacity.get("residual")
        need = len(self.flows) * (-(-len(self.context) // self.params.page_size))
        if pages is not None and need > pages:
            raise RuntimeError(f"the base pass writes {len(self.flows)} agents' context residuals "
                               f"at once: {need} residual pages, the pool has {pages} "
                               f"(raise --residual-share or --kv-budget-gib)")

    def _base_request(self) -> None:
        session = self.engine.open(self.context, adapter=None).id
        self.engine.generate(session, 1)
        self.engine.close(session)

    def _context_write(self, write: Callable[[], object]) -> None:
        """The shared context's write pass, under the profiler where the run has one (its
        wall time then includes the profiler's, as a profiled tick's does)."""
        if self.profiler is None:
            write()
        else:
            def tick() -> bool:
                write()
                return True
            self.profiler.run(tick, lambda: "context_write")

    def _open_first(self) -> tuple[list[Workflow], list[Workflow]]:
        """Agent 0 prefills the shared context and the rest find it published; with
        base_activations one base pass publishes it for every agent first, with neutral a
        base-model request publishes its base pages. Returns (active, waiting)."""
        if self.writer is ContextWriter.BASE_ACTIVATIONS:
            self._check_shared_pass_fits()
            t0 = time.perf_counter()
            self._context_write(lambda: self.engine.prefill_shared(
                self.context, [f.adapter for f in self.flows]))
            self.context_write_s = time.perf_counter() - t0
            return [], list(self.flows)
        if self.writer is ContextWriter.BASE_MODEL:
            t0 = time.perf_counter()
            self._context_write(self._base_request)
            self.context_write_s = time.perf_counter() - t0
            return [], list(self.flows)
        first = self.flows[0]
        if not self._fits(first):
            raise RuntimeError("one workflow needs more KV than the whole budget")
        self._open(first)
        while self._written(first) < len(first.prompt) - 1:
            self._tick()
        return [first], self.flows[1:]

    def _admit(self, active: list[Workflow], waiting: list[Workflow]) -> None:
        while waiting and self._fits(waiting[0]):
            flow = waiting.pop(0)
            self._open(flow)
            active.append(flow)
        if waiting and not active:  # nothing holds a reservation, and still it does not fit
            raise RuntimeError("a workflow needs more KV than the whole budget")

    def react(self) -> None:
        active, waiting = self._open_first()
        while active or waiting:
            now = time.perf_counter()
            self._admit(active, waiting)
            for flow in list(active):
                if flow.resume_at is None and self.engine.generation(flow.session) is not None:
                    flow.latencies.append(time.perf_counter() - flow.turn_started)
                    flow.outputs.append(list(self.engine.generation(flow.session).tokens))
                    flow.turn += 1
                    if flow.turn == 1:
                        self._measure_context_kv(active)
                    if self.on_turn is not None:
                        self.on_turn()
                    if flow.turn == self.params.turns:
                        self._close(flow, pin=False)
                        active.remove(flow)
                        continue
                    if self.params.reopen:  # the pause frees the session and its reservation
                        flow.history = self.engine.committed_tokens(flow.session)
                        self._close(flow)
                        flow.session = None
                    flow.resume_at = now + self.params.pause_s
            if self.params.lockstep and all(f.resume_at is not None for f in active) and active:
                resume = max(f.resume_at for f in active)
                for f in active:
                    f.resume_at = resume
            for flow in active:
                if flow.resume_at is not None and now >= flow.resume_at:
                    obs = observation(flow.turn, flow.index, self.params.observation,
                                       self.engine.config.vocab_size)
                    if flow.session is None:  # a stateless turn: re-send the history when it fits
                        if not self._fits(flow):
                            continue
                        self._open(flow, flow.history + obs)
                    else:
                        self.engine.commit(flow.session, self.engine.tip(flow.session), obs,
                                           wait=False)
                        self.prompt_tokens += len(obs)
                        self.engine.start_generate(flow.session, self.params.gen)
                    flow.turn_started, flow.resume_at = time.perf_counter(), None
            if not self._tick():
                pending = [f.resume_at for f in active if f.resume_at is not None]
                if pending:
                    sleep = min(pending) - time.perf_counter()
                    if sleep > 0:
                        time.sleep(sleep)
                else:
                    t0 = time.perf_counter()
                    time.sleep(0.001)
                    self.waited_s += time.perf_counter() - t0

    def mapreduce(self) -> None:
        active, waiting = self._open_first()
        while active or waiting:
            self._admit(active, waiting)
            for flow in list(active):
                if self.engine.generation(flow.session) is not None:
                    self._measure_context_kv(active)
                    flow.latencies.append(time.perf_counter() - flow.turn_started)
                    flow.outputs.append(list(self.engine.generation(flow.session).tokens))
                    self._close(flow)
                    active.remove(flow)
                    if self.on_turn is not None:
                        self.on_turn()
            self._tick()
        reducer = self.flows[0]
        merged = list(reducer.prompt) + [t for f in self.flows for t in f.outputs[-1]]
        start = time.perf_counter()
        session = self.engine.open(merged, adapter=reducer.adapter).id
        self.prompt_tokens += len(merged)
        self.engine.start_generate(session, self.params.gen)
        while self.engine.generation(session) is None:
            self._tick()
        reducer.latencies.append(time.perf_counter() - start)
        reducer.outputs.append(list(self.engine.generation(session).tokens))
        self.engine.close(session)


def _host_copies(m) -> tuple[int, int, float]:
    """The engine's host-tier copies so far: calls, pages, host ms."""
    return (m.host_offload_calls + m.host_restore_calls, m.offloaded_pages + m.restored_pages,
            m.host_copy_ms)
