"""Stepper: the engine's tick loop — demands in, one batched backend step out.

Each tick collects what every session needs (committed: the tip's prefill, commit tail or
decode step; speculative: admitted residuals, early-abort probes; a prefill an older
in-flight prefill is writing waits for it, ``control/inflight.py``), lets the
``TickScheduler`` grant committed work first and speculation what is left, makes the pages
writable (evicting the index, preempting speculation for committed work), runs one
``Backend.step``, and applies the sampled tokens: generation, probe verdicts, publishing of
committed pages, TTL, and the metrics the benchmarks read.

It shares the Engine's sessions and KV cache; the Engine's verbs validate and record
intent, the Stepper does the work.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from forkserve.backend.protocol import (
    GREEDY,
    Backend,
    KVSlots,
    PromptLogprobs,
    SamplingParams,
    SeqWork,
    StepCost,
    StepResult,
)
from forkserve.backend.step_handle import launch_step
from forkserve.config import ForkServeConfig, KVForm
from forkserve.control.activation import adapter_start
from forkserve.control.cascade import Action
from forkserve.control.context_tree import ContextTree, Node, NodeState
from forkserve.control.dual_radix_tree import DualMatch
from forkserve.control.inflight import ChainOf, ClaimStreams, Writer, dedup_for
from forkserve.control.kv_cache import KVCache
from forkserve.control.metrics import EngineMetrics
from forkserve.control.node_kv import NodeKV, Regime
from forkserve.control.page_hash import ROOT_SEED
from forkserve.control.page_pool import PagePool
from forkserve.control.scheduler import Demand, Grant, TickScheduler, WorkClass
from forkserve.control.scorers import Scorer
from forkserve.control.shared_kv import SharedKV
from forkserve.control.sharing import PrefixSharing, marked
from forkserve.engine.overlap import StepOverlap
from forkserve.engine.session import Session
from forkserve.engine.steady import SteadyDecode, SteadyRow
from forkserve.errors import BackendError, ForkServeError, OutOfPagesError


class Stepper:
    def __init__(self, sessions: dict[int, Session], config: ForkServeConfig, kv: KVCache,
                 backend: Backend, scheduler: TickScheduler, metrics: EngineMetrics,
                 scorer: Scorer, clock: Callable[[], float]) -> None:
        self.sessions, self.config, self.kv, self.backend = sessions, config, kv, backend
        self.pool, self.residual_pool = kv.pool, kv.residual_pool
        self.scheduler, self.metrics, self.scorer, self.clock = scheduler, metrics, scorer, clock
        # Tokens freed by dropped residuals: the budget slack fill may spend.
        self.slack_tokens = 0
        # Running estimate of prefill cost, to judge whether a known suffix fits a tool pause.
        self.ms_per_token = config.prefill_ms_per_token
        self._nodes_by_id: dict[int, tuple[Session, Node]] = {}
        # Which items of a step read one shared prefix (decided here, carried by SeqWork).
        self.sharing = PrefixSharing(self.pool.page_size, config.shared_prefix_min_tokens)
        # Sessions in plain steady decode: their step skips the per-item path (steady.py).
        self.steady = SteadyDecode(kv, self.sharing)
        # Overlap: the steady step launched by the last tick, not yet read back (overlap.py).
        self.overlap = StepOverlap(self)
        # Whether a prefill waits for a prefix another one in flight is writing.
        self.dedup = dedup_for(config, metrics)
        # The positions column of the last step of steady rows ``_step`` ran.
        self._rows_positions: np.ndarray | None = None

    def tick(self) -> bool:
        """One scheduler tick; returns False when there was nothing to do. With
        ``config.overlap`` a tick of steady rows alone returns with its step in flight; the
        next tick prepares its successor before reading it back, and ``sync`` settles it."""
        self._expire_ttl()
        p = self.pool.page_size
        if not self.config.steady_decode or len(self.sessions) > min(
                self.config.max_batch_tokens,
                self.scheduler.decode_slots(len(self.sessions), self.pool.num_used * p)):
            # Not every session could be granted a decode: the scheduler chooses, item by item.
            self.sync()
            self.steady.clear()
        committed, speculative = [], []
        general = self._general()
        for session in general:
            self._demands(session, committed, speculative)
        if self.overlap.pending:
            if not committed and not speculative:
                return self.overlap.advance()
            # Other work joins this step: read the last one back first. (Its rows were the
            # steady set's alone, so the demands above do not depend on its tokens.)
            self.sync()
        # Speculation may use what is left of H and of every pool (base and residual apart).
        room = [self.config.hbm_tokens - self.pool.num_used * p, self.pool.num_free * p]
        if self.residual_pool is not None:
            room.append(self.residual_pool.num_free * p)
        spec_memory = max(0, min(room))
        rows, left = self.steady.prepare(self.backend.copy_pages)
        for session in left:  # back on the general path from this tick on
            self._demands(session, committed, speculative)
        if not committed and not speculative and not rows:
            return False
        self._nodes_by_id = {n.id: (s, n) for s in (*general, *left) for n in s.tree.nodes.values()}
        committed = self.dedup.admit(committed, self._writer)
        slots = self.scheduler.decode_slots(len(self.sessions), self.pool.num_used * p)
        grants = self.scheduler.plan(committed, speculative, slots - len(rows), spec_memory,
                                     len(rows))
        if self.config.overlap and rows and not grants:
            self.overlap.launch(rows)
            self.account_rows(self.steady.grown)
            self.metrics.ticks += 1
            return True
        if not (grants or rows) or not self._execute(grants, rows):
            return False
        self.metrics.ticks += 1
        return True

    def _general(self) -> list[Session]:
        """The sessions outside the steady set, in session order. The set difference reads
        only the sessions dict's int keys, not every member (all of them, when every session
        decodes); sorted ids are that order: ids grow with each ``open``, which adds them."""
        steady = self.steady.ids
        if not steady:
            return list(self.sessions.values())
        return [self.sessions[i] for i in sorted(self.sessions.keys() - steady)]

    def run_until(self, done: Callable[[], bool]) -> int:
        ticks = 0
        # With overlap ``done`` reads state one step behind (the step in flight still owes its
        # tokens), so it turns true a tick later, never early.
        while not done() and self.tick():
            ticks += 1
        self.sync()
        return ticks

    def sync(self) -> None:
        """Read back and apply the step in flight, if any: the state every verb sees."""
        self.overlap.sync()

    def settle_failed(self, rows: list[SteadyRow], exc: Exception) -> None:
        """A launched step of steady rows raised: they become items and are stepped again
        the synchronous way, which finds the failing ones (an engine bug propagates)."""
        items = self._as_items(rows)
        if isinstance(exc, AssertionError):
            for item in items:
                item.node.table.rollback(item.lengths)
            raise exc
        done, failed, _ = self._run(items, [])
        self._settle(items, done, failed, [], None)

    def _demands(self, session: Session, committed: list[Demand],
                 speculative: list[Demand]) -> None:
        """What one session on the general path needs this tick, appended to the two lists."""
        if session.error is not None:
            return  # a failed session waits for its next verb
        tip = session.tree.tip
        self.emit(session)
        self.activate(session.tree, tip)
        if tip.id in self.dedup.waiting:
            self._rematch(session, tip)  # its leader may have published what it waited for
        if session.decode_left > 0 and tip.kv_len == tip.end and tip.next_token is None:
            # No cached logits for the last position (a partial LCP bind, or another
            # sampling rule): recompute that one position.
            tip.table.truncate(tip.end - 1)
        pending = _regime_capped(tip, tip.end - tip.kv_len)
        idle = session.decode_left == 0 and session.generated_unwritten and not session.flush
        if pending > 0 and not idle:  # an idle session's last token waits for its next verb
            decode = session.decode_left > 0 and pending == 1 and session.generated_unwritten
            committed.append(Demand(tip.id, pending, decode, WorkClass.COMMITTED))
        for node in () if session.hold_speculation else session.tree.nodes.values():
            demand = self._spec_demand(node)
            if demand is not None:
                speculative.append(demand)

    def _writer(self, demand: Demand, chain_of: ChainOf, streams: ClaimStreams) -> Writer:
        """A committed prefill as in-flight deduplication sees it. It never waits when it
        wants every position computed (prompt log-probabilities, ``open(reuse_prefix=False)``)
        or is a commit's tail (atomic: ``Engine._unstage`` restores it as it was)."""
        session, node = self._nodes_by_id[demand.node_id]
        path = session.tree.path_tokens(node)
        # Hash from where its published prefix ends, if the table still holds all of it (the
        # claims start at its first unwritten page).
        cursor = node.publish_cursor
        seed = cursor.seed if cursor is not None else ROOT_SEED
        if seed.pages > node.kv_len // self.pool.page_size:
            seed = ROOT_SEED
        first, runs = self.kv.page_claims(node.table, node.adapter, path,
                                          chain_of(node.id, path, seed), streams)
        follows = (session.reuse_prefix and session.sampling.prompt_logprobs is None
                   and not session.hold_speculation)
        return Writer(node.id, session.id, node.kv_len, first, runs, follows)

    def _rematch(self, session: Session, tip: Node) -> None:
        """Alias what is published now for a held tip's path (keeping its last token to sample
        from)."""
        path = session.tree.path_tokens(tip)
        self.attach(tip, self.kv.match(tip.table, tip.adapter, path[:tip.end - 1]))

    def attach(self, node: Node, hit: DualMatch) -> None:
        """Alias the published pages of a match; a side that hits alone is a partial hit."""
        kv = node.table
        before = (kv.length, kv.base.length, kv.residual.length if kv.residual is not None else 0)
        kv.attach(hit.base_pages, hit.residual_pages, node.end)
        if node.publish_cursor is None:
            # Its first publish resumes after the matched pages instead of walking them again.
            node.publish_cursor = hit.cursor
        self.metrics.hash_hit_tokens += kv.length - before[0]
        self.metrics.base_hit_tokens += kv.base.length - before[1]
        if kv.residual is not None:
            self.metrics.residual_hit_tokens += kv.residual.length - before[2]

    def _spec_demand(self, node: Node) -> Demand | None:
        if node.state is not NodeState.SPECULATIVE or not node.speculated:
            return None
        action = node.decision.action
        if action.prunes or action is Action.HASH_SKIP and node.kv_len >= node.end:
            return None
        if node.parent.generation != node.spec_generation:
            node.speculated = False  # the trunk moved under it: drop the queued work
            self.metrics.dropped_chunks += 1
            return None
        if node.kv_len == node.end and node.next_token is not None and (
                node.probe_left or node.extend_left):
            self._emit_speculative(node)
        self.activate(self.sessions[node.session_id].tree, node)
        pending = _regime_capped(node, node.end - node.kv_len)
        if pending <= 0:
            return None
        if node.slack_only:
            p = self.pool.page_size
            pending = min(pending, (self.slack_tokens // p) * p)
            if pending <= 0:
                return None
        decode = pending == 1 and node.generated_count > 0
        return Demand(node.id, pending, decode, WorkClass.SPECULATIVE, node.priority)

    def _execute(self, grants: list[Grant], rows: list[SteadyRow]) -> bool:
        """Prepare pages, run one step, apply its tokens. An item that cannot run fails alone
        (its table rolled back, its session told), the others run as if it never existed;
        committed work short of pages waits. ``rows``: the steady set's members, their pages
        already prepared. Returns whether any state moved."""
        items, waiting = [], []
        self._evict_for(grants)
        for g in grants:
            session, node = self._nodes_by_id[g.node_id]
            if node.table is None:
                continue  # preempted by committed work granted earlier in this tick
            start = node.kv_len
            regime = node.table.regime()
            lengths = node.table.lengths()
            try:
                self._ensure_pages(node, g.tokens, g.work_class)
            except OutOfPagesError as exc:
                node.table.rollback(lengths)
                if g.work_class is WorkClass.COMMITTED:
                    waiting.append((session, exc))
                continue  # speculation retries when memory frees
            _assert_exclusive(node.table, start, g.tokens, regime)
            items.append(self._item(session, node, g, start, regime, lengths))
        # Preemption by a later grant of this tick may have released an earlier one's table.
        items = [i for i in items if i.node.table is not None]
        done, failed, steady_tokens = self._run(items, rows)
        self._settle(items, done, failed, rows, steady_tokens, self._rows_positions)
        if not items and not rows and waiting:
            # Nothing can run and committed work waits for pages other sessions hold: fail
            # the youngest waiter (its verb raises; a server ends that request alone).
            session, exc = max(waiting, key=lambda w: w[0].id)
            session.fail(exc)
            self.metrics.failed_items += 1
            return True
        return bool(items or rows)

    def _settle(self, items: list["_Item"], done: list[tuple["_Item", int | None]],
                failed: list[tuple["_Item", Exception]], rows: list[SteadyRow],
                steady_tokens: list[int] | None, positions: np.ndarray | None = None) -> None:
        """Apply a step's outcome: failures rolled back and told, tokens applied, sessions
        left in steady decode admitted to the set, peaks accounted."""
        for item, exc in failed:
            self._fail(item, exc)
        for item, token in done:
            self._apply(item, token)
        touched = {i.session for i in items if i.session.id in self.sessions}
        if steady_tokens is not None:
            self.steady.apply(rows, steady_tokens, self.clock(), self.publish, positions)
            # A member's held pages change only when it gained a page this tick.
            self.account_rows(self.steady.grown)
        if self.config.steady_decode:
            for item, _ in done:
                if item.node is item.session.tree.tip and item.session.id in self.sessions:
                    self.steady.admit(item.session)
        self.account(touched)

    def _item(self, session: Session, node: Node, g: Grant, start: int, regime: Regime,
              lengths: tuple[int, ...]) -> "_Item":
        sampling = None
        if start + g.tokens == node.end:
            sampling = session.sampling if node is session.tree.tip else GREEDY
        tokens = tuple(session.tree.path_slice(node, start, start + g.tokens))
        work = SeqWork(node.id, tokens, start, node.table.slots(), node.adapter, sampling,
                       speculative=g.work_class is WorkClass.SPECULATIVE, decode=g.decode,
                       write_base=regime.write_base, write_residual=regime.write_residual,
                       form=self.kv.form_of(node.table, node.adapter),
                       adapter_start=adapter_start(self.kv.adapter_start(node.table, node.adapter),
                                                   start + g.tokens),
                       prompt_logprobs=_prompt_logprobs(session, node, start + g.tokens, g.decode))
        return _Item(session, node, g, sampling, work, lengths)

    def _run(self, items: list["_Item"], rows: list[SteadyRow]
             ) -> tuple[list[tuple["_Item", int | None]], list[tuple["_Item", Exception]],
                        list[int] | None]:
        """Step ``items`` and the steady ``rows`` together; when the step raises, find whom it
        was for: the rows become items (and leave the steady set), then the items the error
        names (``seq_ids``), else by halving the batch until each failing item runs alone.
        An AssertionError is an engine bug, not a request's fault: it propagates. Returns
        the items done and failed, and the rows' sampled tokens (None: the rows did not run
        as rows)."""
        done: list[tuple[_Item, int | None]] = []
        failed: list[tuple[_Item, Exception]] = []
        steady_tokens = None
        pending = [items]
        while pending:
            group = pending.pop()
            if not group and not rows:
                continue
            try:
                result = self._step(group, rows)
            except AssertionError:
                for item in group + self._as_items(rows):
                    if item.node.table is not None:
                        item.node.table.rollback(item.lengths)
                raise
            except Exception as exc:  # noqa: BLE001 - attributed to items below, never swallowed
                if rows:
                    group, rows = group + self._as_items(rows), []
                named = set(getattr(exc, "seq_ids", ()))
                culprits = [i for i in group if i.work.seq_id in named]
                if culprits:
                    failed += [(i, exc) for i in culprits]
                    pending.append([i for i in group if i.work.seq_id not in named])
                elif len(group) == 1:
                    failed.append((group[0], exc))
                else:
                    half = len(group) // 2
                    pending += [group[half:], group[:half]]
                continue
            self.account_cost(result.cost, [i.grant for i in group])
            if len(result.next_tokens) != len(group) + len(rows):
                raise AssertionError(f"the backend returned {len(result.next_tokens)} tokens "
                                     f"for {len(group) + len(rows)} items")
            done += zip(group, result.next_tokens[:len(group)], strict=True)
            if rows:  # the first attempt ran them: nothing else is pending
                steady_tokens, rows = list(result.next_tokens[len(group):]), []
        return done, failed, steady_tokens

    def _step(self, group: list["_Item"], rows: list[SteadyRow]) -> StepResult:
        """One backend step: the items' work, annotated with cascade groups, then the rows'."""
        if not rows:
            return launch_step(self.backend, self.sharing.annotate([i.work for i in group]),
                               None).result()
        batch = self.steady.batch(rows)
        self._rows_positions = batch.positions  # the rows' positions, for ``steady.apply``
        work = [i.work for i in group]
        if work:  # one numbering of the groups over the items and the rows
            marks = self.sharing.marks([(w.slots.pages, w.start_pos) for w in work]
                                       + list(zip(batch.pages, batch.positions, strict=True)))
            work = marked(work, marks[:len(work)])
            batch = dataclasses.replace(batch, shared_prefix=tuple(marks[len(work):]))
        return launch_step(self.backend, work, batch).result()

    def _as_items(self, rows: list[SteadyRow]) -> list["_Item"]:
        """Steady rows as general items (their pages already prepared), out of the set."""
        items = []
        for row in rows:
            self.steady.drop(row.session.id)
            start = row.node.kv_len - 1
            grant = Grant(row.node.id, 1, True, WorkClass.COMMITTED)
            lengths = tuple(n - 1 for n in row.kv.lengths())
            items.append(self._item(row.session, row.node, grant, start, row.kv.regime(), lengths))
        return items

    def _fail(self, item: "_Item", exc: Exception) -> None:
        """Undo an item's page preparation and tell its owner: the committed tip's session
        gets the error; a speculative branch is dropped (speculation is best effort)."""
        session, node = item.session, item.node
        if node.table is not None:
            node.table.rollback(item.lengths)
        error = exc if isinstance(exc, ForkServeError) else BackendError(
            f"the backend failed on this request: {type(exc).__name__}: {exc}")
        if error is not exc:
            error.__cause__ = exc
        self.metrics.failed_items += 1
        if node is session.tree.tip:
            session.fail(error)
        elif node.live:
            session.tree.abort(node)

    def _apply(self, item: "_Item", token: int | None) -> None:
        session, node, g = item.session, item.node, item.grant
        node.last_touch = self.clock()
        if node is session.tree.tip:
            session.generated_unwritten = False
        if item.work.slots.residual_pages is not None and item.work.write_residual and not g.decode:
            self.metrics.residual_prefill_tokens += g.tokens  # only work that ran counts
        if g.work_class is WorkClass.SPECULATIVE and node.slack_only:
            self.slack_tokens -= g.tokens
            self.metrics.slack_filled_tokens += g.tokens
        if token is not None:
            node.next_token, node.next_token_sampling = token, item.sampling
        if node.state is NodeState.COMMITTED:
            self.publish(node)
            self.emit(session)
        else:
            self._emit_speculative(node)

    def _evict_for(self, grants: list[Grant]) -> None:
        """One eviction pass per pool for every grant's pages (``KVCache.evict_for``)."""
        needs: dict[PagePool, int] = {}
        for g in grants:
            table = self._nodes_by_id[g.node_id][1].table
            if table is not None:
                for pool, need in table.pages_needed(g.tokens).items():
                    needs[pool] = needs.get(pool, 0) + need
        self.kv.evict_for(needs)

    def _ensure_pages(self, node: Node, n: int, work_class: WorkClass) -> None:
        for pool, need in node.table.pages_needed(n).items():
            if need > pool.num_free:  # most decode steps need no page, or one the pool has
                self.kv.make_room(pool, need, self.preempt_speculative
                                  if work_class is WorkClass.COMMITTED else None)
        node.table.prepare_write(n, self.backend.copy_pages)

    def activate(self, tree: ContextTree, node: Node) -> None:
        """aLoRA: find the activation point on the node's grown path; K/V written under
        another point is cut there (and recomputed by the next demand)."""
        invocation = self.kv.invocation(node.adapter)
        if invocation is None or node.table is None:
            return
        node.activation = node.activation.extend(
            invocation, lambda s, e: tree.path_slice(node, s, e), node.end)
        if self.kv.activate(node.table, node.activation.start):
            # Logits and published pages of the cut K/V no longer describe this path.
            node.next_token = None
            node.published, node.publish_cursor = (0, 0), None

    def write_shared(self, shared: SharedKV, tokens: Sequence[int]) -> None:
        """Write a shared context (``KVCache.shared_kv``) up to ``len(tokens)``: the base model
        runs over it in chunks of the token budget, each step also writing every adapter's
        residual from the same activations. Committed work: it may preempt speculation. A
        failed step raises with the tables past their KV (the caller releases them unpublished)."""
        while shared.length < len(tokens):
            n = min(len(tokens) - shared.length, self.config.max_batch_tokens)
            start = shared.length
            for table in shared.tables():
                self.kv.make_room(table.pool, table.pages_needed(n), self.preempt_speculative)
                table.prepare_write(n, self.backend.copy_pages)
            # Node ids start at 1: seq 0 is no session's.
            work = SeqWork(0, tuple(tokens[start:start + n]), start, KVSlots(shared.base.frozen()),
                           None, None, form=KVForm.SPLIT, extra_residuals=shared.targets())
            self.account_cost(launch_step(self.backend, [work], None).result().cost, [])

    def preempt_speculative(self, pool: PagePool, need: int) -> None:
        """Committed work waits for nothing: abort unpinned speculation, lowest prior first.
        (A node being written is never speculative-and-unpinned when committed work runs.)"""
        victims = sorted((n for s in self.sessions.values() for n in s.tree.nodes.values()
                          if n.state is NodeState.SPECULATIVE and not self.pinned(n)),
                         key=lambda n: n.priority)
        index = self.kv.index_of(pool)
        for victim in victims:
            if pool.num_free >= need:
                break
            if victim.live:
                self.sessions[victim.session_id].tree.abort(victim)
                index.evict(need - pool.num_free)

    def emit(self, session: Session) -> None:
        """Hand the cached next token to a generating session (no compute needed)."""
        tip = session.tree.tip
        if session.decode_left <= 0 or tip.kv_len != tip.end or tip.next_token is None:
            return
        token = tip.next_token
        tip.next_token = None
        session.take(token)
        if session.decode_left == 0:
            session.paused_since = self.clock()

    def _emit_speculative(self, node: Node) -> None:
        """Advance an early-abort probe (or its extension) by one sampled token."""
        if node.kv_len != node.end or node.next_token is None:
            return
        if node.probe_left == 0 and node.extend_left == 0:
            return
        node.tokens.append(node.next_token)
        node.next_token = None
        node.generated_count += 1
        if node.probe_left:
            node.probe_left -= 1
            if node.probe_left == 0:
                self._judge_probe(node)
        else:
            node.extend_left -= 1

    def _judge_probe(self, node: Node) -> None:
        tree = self.sessions[node.session_id].tree
        path = tree.path_tokens(node)
        score = self.scorer.score(path[:node.start][-1024:], node.tokens)
        if score.value >= self.config.tau:
            node.extend_left = max(0, self.config.speculate_budget_tokens - node.generated_count)
            return
        self.metrics.probe_aborts += 1
        self.slack_tokens += node.kv_len - node.start
        tree.abort(node)

    def publish(self, node: Node) -> None:
        """Publish a committed node's new full pages (a no-op on most decode steps)."""
        if node.table is None:
            return
        tree = self.sessions[node.session_id].tree
        node.published, node.publish_cursor = self.kv.publish(
            node.table, node.adapter, lambda: tree.path_view(node), node.published,
            node.publish_cursor)

    def pinned(self, node: Node) -> bool:
        return node.pinned_until is not None and node.pinned_until > self.clock()

    def _expire_ttl(self) -> None:
        now = self.clock()
        self.kv.retention.expire(now)
        ttl = self.config.node_ttl_s
        if ttl is None:
            return
        for session in self.sessions.values():
            if session.id in self.steady:
                continue  # a steady session has no speculative node
            for node in list(session.tree.nodes.values()):
                if (node.state is NodeState.SPECULATIVE and not self.pinned(node)
                        and now - node.last_touch > ttl):
                    session.tree.abort(node)
                    self.metrics.ttl_expired += 1

    def account_cost(self, cost: StepCost, grants: Sequence[Grant]) -> None:
        m = self.metrics
        m.prefill_tokens += cost.prefill_tokens
        m.prefill_calls += cost.prefill_calls
        m.decode_tokens += cost.decode_tokens
        m.ms += cost.ms
        prefill_share = cost.prefill_ms
        m.prefill_ms += prefill_share
        if cost.prefill_tokens:
            self.ms_per_token = 0.8 * self.ms_per_token + 0.2 * prefill_share / cost.prefill_tokens
        if self.config.disaggregated_prefill:
            moved = sum(g.tokens for g in grants if not g.decode and
                        (g.work_class is WorkClass.SPECULATIVE or not self.config.cascade))
            if moved:
                t = self.backend.transfer_cost(moved)
                m.transfer_tokens += moved
                m.ms += t.ms
                m.prefill_ms += t.ms

    def pending_prompt_pages(self) -> int:
        """Base pages the live sessions' unwritten committed tokens will take (an upper bound:
        a write may still find some of them published)."""
        p = self.pool.page_size
        return sum(-(-(s.tree.tip.end - s.tree.tip.kv_len) // p) for s in self.sessions.values())

    def account_rows(self, rows: Iterable[SteadyRow]) -> None:
        """``account`` for steady-decode members (those that gained a page): a member has no
        speculative node and only its tip holds tables on the committed spine, so what it
        holds is its tip's pages (``test_steady_decode`` compares the peaks with the set off)."""
        p = self.pool.page_size
        self.metrics.peak_pages = max(self.metrics.peak_pages, self.pool.num_used)
        for row in rows:
            session = row.session
            session.peak_tokens = max(session.peak_tokens, len(row.base.pages) * p)

    def account(self, sessions: Iterable[Session] | None = None) -> None:
        """Peaks: physical pages, and per session the KV it could not give back. ``sessions``
        limits the per-session pass to those a step touched (the rest did not change)."""
        p = self.pool.page_size
        self.metrics.peak_pages = max(self.metrics.peak_pages, self.pool.num_used)
        for session in self.sessions.values() if sessions is None else sessions:
            tables = [n.table for n in session.tree.nodes.values() if n.table is not None
                      and not (n.state is NodeState.SPECULATIVE and self.config.cascade
                               and not self.pinned(n))]
            # Only the tip holds the spine's pages; a set is needed only when branches alias it.
            held = len(tables[0].pages) if len(tables) == 1 else len(
                {page for t in tables for page in t.pages})
            session.peak_tokens = max(session.peak_tokens, held * p)


class _Item(NamedTuple):
    """One granted item of a tick: its owner, the work sent, and where to roll back to."""

    session: Session
    node: Node
    grant: Grant
    sampling: SamplingParams | None
    work: SeqWork
    lengths: tuple[int, ...]  # the node's table sides before ``prepare_write``


def _assert_exclusive(kv: NodeKV, start: int, n: int, regime: Regime) -> None:
    """The pages a step writes are ours alone: writing a shared page would corrupt a sibling."""
    sides = ((kv.base, regime.write_base), (kv.residual, regime.write_residual))
    for table, writes in sides:
        if table is None or not writes:
            continue
        p = table.pool.page_size
        for page in table.pages[start // p:(start + n - 1) // p + 1]:
            if table.pool.refcount(page) != 1:
                raise AssertionError(f"write into shared {table.pool.kind.value} page {page}")


def _prompt_logprobs(session: Session, node: Node, end: int, decode: bool) -> PromptLogprobs | None:
    """The request's prompt log-probabilities for a prefill chunk of its prompt (the root, not
    yet committed past) that ends at ``end``; None when it did not ask or this is not one."""
    k = session.sampling.prompt_logprobs
    if k is None or decode or node is not session.tree.root or node is not session.tree.tip:
        return None
    following = session.tree.path_slice(node, end, end + 1)[0] if end < node.end else None
    return PromptLogprobs(k, following, session.sampling.log)


def _regime_capped(node: Node, pending: int) -> int:
    """A write stays inside one regime (both sides, or only the side that is missing)."""
    cap = node.table.regime().max_tokens
    return pending if cap is None else min(pending, cap)
