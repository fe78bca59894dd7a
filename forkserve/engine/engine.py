"""Engine: the verbs of seed 000 over sessions, context trees and one Backend.

    open -> fork -> speculate -> drain_slack -> commit -> generate ... -> close
                                      join / abort

Every verb validates its arguments before touching state, so a bad request raises a
typed ``ForkServeError`` and changes nothing. Work runs in ticks (``tick``): committed
work first, speculative chunks in what remains (``TickScheduler``). ``commit`` and
``generate`` are on the critical path and run ticks until their own work is done; ``fork``
and ``speculate`` only record intent; ``drain_slack`` runs the speculative backlog.

Page ownership: each live node's ``PageTable`` and the ``PrefixIndex`` own references;
the engine moves them only through those two objects (see their docstrings).
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable, Sequence

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import (
    GREEDY,
    Backend,
    SamplingParams,
)
from forkserve.config import ForkServeConfig, KVForm
from forkserve.control.admission import Candidate
from forkserve.control.cascade import Action, Cascade, Decision, Residual
from forkserve.control.context_tree import ContextTree, Node, NodeState
from forkserve.control.dual_radix_tree import DualMatch
from forkserve.control.kv_cache import KVCache
from forkserve.control.layout_policy import NOTHING_QUEUED, Queued
from forkserve.control.metrics import EngineMetrics
from forkserve.control.node_kv import NodeKV
from forkserve.control.pause_ttl import PauseTTL
from forkserve.control.prefix_index import UNSALTED, CacheSalt
from forkserve.control.scheduler import TickScheduler
from forkserve.control.scorers import (
    CompositeScorer,
    LegalityScorer,
    LoopScorer,
    Scorer,
)
from forkserve.engine.cache_stats import (
    CacheStats,
    PagesInUse,
    PublishedPage,
    SessionPages,
    cache_stats,
    pages_in_use,
    published_pages,
    session_pages,
)
from forkserve.engine.integrity import check_integrity
from forkserve.engine.request_checks import RequestChecks, count, token_ids
from forkserve.engine.results import (
    AbortResult,
    CommitResult,
    DrainReport,
    GenerateResult,
    SessionHandle,
    SessionSummary,
    SharedPrefill,
)
from forkserve.engine.session import Session
from forkserve.engine.stepper import Stepper
from forkserve.errors import (
    AdapterInUseError,
    BranchCapError,
    InvalidRequestError,
    InvalidStateError,
    OutOfPagesError,
    UnknownNodeError,
    UnknownSessionError,
)


class Engine:
    def __init__(self, backend: Backend, *, scorer: Scorer | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 pause_ttl: PauseTTL | None = None) -> None:
        """``pause_ttl``: how long a closed session's base pages stay pinned (with
        ``config.pause_pin``); default: a quantile of observed pauses (``QuantilePauseTTL``)."""
        self.backend = backend
        self.config: ForkServeConfig = backend.config
        self.metrics = EngineMetrics()
        self.capabilities = caps = backend.capabilities
        missing = caps.missing(backend)
        if missing:
            raise TypeError(f"{type(backend).__name__} declares capabilities it lacks the methods "
                            f"of: {', '.join(missing)}")
        self.kv = KVCache(self.config, backend.page_kinds(),
                          backend.adapter_version if caps.adapter_versions else None,
                          backend.adapter_invocation if caps.activated_lora else None,
                          metrics=self.metrics,
                          host=backend if caps.host_offload else None,
                          pause_ttl=pause_ttl)
        # Shorthands for the engine and its tests: the pools and the two sides of the
        # DualRadixTree (the interfaces read `cache_stats()` instead).
        self.pool, self.residual_pool = self.kv.pool, self.kv.residual_pool
        self.cache, self.index, self.residual_index = (self.kv.tree, self.kv.index,
                                                       self.kv.residual_index)
        self.scorer = scorer or CompositeScorer([LoopScorer(), LegalityScorer(_text_of(backend))])
        self.cascade = Cascade(self.config, self.scorer)
        self.scheduler = TickScheduler(self.config)
        self.clock = clock
        self.sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self._sids = itertools.count(1)
        self.checks = RequestChecks(self.config, backend, caps, self.pool, self.residual_pool)
        self.stepper = Stepper(self.sessions, self.config, self.kv, backend, self.scheduler,
                               self.metrics, self.scorer, clock)

    # ------------------------------------------------------------------ verbs
    def open(self, tokens: Sequence[int], *, adapter: AdapterId | None = None,
             salt: CacheSalt = UNSALTED, reuse_prefix: bool = True,
             queued: Queued = NOTHING_QUEUED) -> SessionHandle:
        """Start a session whose committed root is ``tokens``; its prefill is queued. ``salt``:
        the trust boundary its pages are matched and published in (every fork keeps it).
        ``reuse_prefix=False``: prefill every token though published pages cover a prefix
        (its logits are wanted: prompt log-probabilities); what it writes is still published.
        ``queued``: the sessions an admission controller holds back behind this one (the
        adaptive layout's form weighs them: ``layout_policy.Queued``)."""
        self.stepper.sync()
        tokens = self.checks.tokens(tokens)
        adapter = self.checks.adapter(adapter)
        self.checks.context(len(tokens))
        form = self._form(tokens, adapter, salt, queued)
        self.checks.fits(len(tokens), form is KVForm.SPLIT and adapter is not None)
        sid = next(self._sids)
        root = Node(next(self._ids), sid, None, "root", tokens, 0,
                    self.kv.new_kv(adapter, form, salt), NodeState.COMMITTED, adapter=adapter)
        session = Session(sid, ContextTree(root), adapter, reuse_prefix=reuse_prefix)
        self.sessions[sid] = session
        if reuse_prefix:
            self._attach_published(session, root, keep_last=True)
        self.kv.retention.resume(root.table.base.pages, self.clock())
        self.stepper.account()
        return SessionHandle(sid, root.id)

    def layout_form(self, tokens: Sequence[int], *, adapter: AdapterId | None = None,
                    queued: Queued = NOTHING_QUEUED) -> KVForm:
        """The form (merged or split K/V) ``open(tokens, adapter=adapter, queued=queued)``
        would give the session's pages now: fixed by the layout, except in the adaptive one,
        where it depends on memory pressure, on the admission queue and on what is published
        (an admission controller sizes a request by it before opening)."""
        self.stepper.sync()
        tokens = self.checks.tokens(tokens)
        return self._form(tokens, self.checks.adapter(adapter), queued=queued)

    def _form(self, tokens: Sequence[int], adapter: AdapterId | None,
              salt: CacheSalt = UNSALTED, queued: Queued = NOTHING_QUEUED) -> KVForm:
        return self.kv.choose_form(adapter, tokens, self.stepper.pending_prompt_pages(), salt,
                                   queued)

    def fork(self, session_id: int, parent_id: int, label: str, tokens: Sequence[int], *,
             adapter: AdapterId | None = None) -> int:
        """A speculative child of ``parent_id`` holding ``tokens``; aliases the parent's pages."""
        session = self._mutable(session_id)
        parent = self._node(session, parent_id)
        tokens = self.checks.tokens(tokens)
        if parent.state is NodeState.ABORTED:
            raise InvalidStateError(f"cannot fork aborted node {parent_id}")
        if parent.state is NodeState.COMMITTED and parent is not session.tree.tip:
            raise InvalidStateError(f"node {parent_id} is behind the committed tip "
                                    f"{session.tree.tip.id}; fork from the tip")
        if len(parent.live_children()) >= self.config.branch_cap:
            raise BranchCapError(f"node {parent_id} already has {self.config.branch_cap} live "
                                 f"children (branch_cap)")
        self.checks.context(parent.end + len(tokens))
        adapter = self.checks.adapter(adapter)
        adapter = adapter if adapter is not None else parent.adapter
        self.checks.fits(parent.end + len(tokens), parent.table is not None
                         and parent.table.residual is not None)
        if parent.table is None or parent.kv_len < parent.end:
            # The trunk must exist before it can be aliased: run the parent's pending work.
            session.error, session.flush = None, True
            try:
                self.stepper.run_until(lambda: parent.kv_len >= parent.end or not parent.live
                                       or session.error is not None)
            finally:
                session.flush = False
            if session.error is not None:
                raise session.error
            if not parent.live:
                raise InvalidStateError(f"node {parent_id} was dropped while its trunk was written")
        child = Node(next(self._ids), session_id, parent, label, tokens, parent.end,
                     self.kv.fork_kv(parent.table, parent.adapter, adapter), NodeState.SPECULATIVE,
                     adapter=adapter,
                     last_touch=self.clock())
        session.tree.add(child)
        self.stepper.account()
        return child.id

    def speculate(self, session_id: int, node_id: int, *, priority: float = 1.0,
                  t_idle_ms: float | None = None) -> Decision:
        """Run the cascade on one residual and queue what it keeps.

        ``priority`` is the harness's prior that this residual is the one committed;
        1.0 marks a known suffix (p = 1), admitted first and pinned for the tool pause
        ``t_idle_ms`` when its prefill fits in it.
        """
        session = self._mutable(session_id)
        node = self._node(session, node_id)
        if not 0.0 <= priority <= 1.0:
            raise InvalidRequestError(f"priority must be in [0, 1], got {priority}")
        if t_idle_ms is not None and t_idle_ms < 0:
            raise InvalidRequestError(f"t_idle_ms must be >= 0, got {t_idle_ms}")
        if node.state is not NodeState.SPECULATIVE:
            raise InvalidStateError(f"node {node_id} is {node.state.value}; only a forked "
                                    f"branch can be speculated")
        if node.speculated:
            raise InvalidStateError(f"node {node_id} was already speculated")
        tree = session.tree
        path = tree.path_tokens(node)
        known = priority >= 1.0
        hit = self._match(session, node, path) if self.config.cascade else DualMatch([], None)
        hit_tokens = max(0, min(hit.covered_pages * self.pool.page_size, node.end) - node.start)
        admitted = [Candidate(s.child_index, s.priority, s.decision.score or 0.0)
                    for s in node.parent.children
                    if s is not node and s.speculated and s.decision is not None
                    and not s.decision.action.prunes]
        residual = Residual(node.child_index, priority, known, path[:node.start][-1024:],
                            node.tokens, hit_tokens)
        decision, _ = self.cascade.decide(residual, admitted)
        now = self.clock()
        node.priority, node.decision, node.speculated, node.last_touch = (
            priority, decision, True, now)
        node.spec_generation = node.parent.generation
        self.metrics.actions[decision.action.value] += 1
        if decision.action.prunes:
            self.metrics.pruned += 1
            self.stepper.slack_tokens += len(node.tokens)
        if decision.hit_tokens:
            self.stepper.attach(node, hit)
        if decision.action is Action.EARLY_ABORT:
            node.probe_left = self.config.early_abort_probe_tokens
        if known and t_idle_ms is not None:
            if decision.miss_tokens * self.stepper.ms_per_token <= t_idle_ms:
                node.pinned_until = now + t_idle_ms / 1000.0
            else:
                node.slack_only = True  # too long for the pause: fill it from freed budget only
        self.stepper.account()
        return decision

    def prefill_shared(self, tokens: Sequence[int], adapters: Sequence[AdapterId]) -> SharedPrefill:
        """``residual_source = base_activations``: one base-model pass over a context that many
        agents share writes the base pages and, from the same activations, every listed
        adapter's rank-r residual; all are published, so each agent that then opens the context
        finds both sides and prefills only what follows it. Lossier than each agent's own
        forward pass (its residual sees the base model's activations, not its own) — the
        quality benchmark measures by how much. Disaggregated and adaptive layouts (in the
        adaptive one, an agent that opens on a published residual takes the split form)."""
        self.stepper.sync()
        tokens = self.checks.tokens(tokens)
        self.checks.context(len(tokens))
        adapters = list(dict.fromkeys(adapters))
        if self.residual_pool is None:
            raise InvalidRequestError("prefill_shared (base_activations) needs the disaggregated "
                                      "or adaptive layout")
        if not adapters or any(a is None for a in adapters):
            raise InvalidRequestError("prefill_shared needs at least one adapter, and no None")
        for a in adapters:
            self.checks.adapter(a)
            if self.kv.invocation(a) is not None:
                raise InvalidRequestError(f"adapter {a!r} is an activated LoRA: its agents read "
                                          "the shared context's base pages as they are; "
                                          "prefill_shared is for plain adapters")
        p = self.config.page_size
        context = tokens[:len(tokens) // p * p]  # only full pages can be published
        if not context:
            raise InvalidRequestError(f"a shared context needs at least one full page ({p} tokens)")
        before = self.metrics.prefill_tokens
        shared = self.kv.shared_kv(context, adapters)
        try:
            self.stepper.write_shared(shared, context)
            self.kv.publish_shared(shared, context)
        finally:
            shared.release()  # the index keeps what was published
        self.stepper.account()
        return SharedPrefill(len(context), tuple(adapters), self.metrics.prefill_tokens - before)

    def drain_slack(self) -> DrainReport:
        """Run ticks until no speculative (or committed) work is left."""
        self.stepper.sync()
        before = self.metrics.snapshot()
        ticks = self.stepper.run_until(lambda: False)
        after = self.metrics
        return DrainReport(ticks, after.prefill_tokens - before["prefill_tokens"],
                           after.decode_tokens - before["decode_tokens"],
                           after.slack_filled_tokens - before["slack_filled_tokens"])

    def commit(self, session_id: int, node_id: int, tokens: Sequence[int], *,
               wait: bool = True) -> CommitResult:
        """Commit ``tokens`` after the tip ``node_id``: bind the speculative branch with the
        longest common prefix, abort the other branches, prefill only the unmatched tail.

        ``wait=False`` queues the tail as committed work and returns at once (a driver of many
        sessions batches their tails into one tick); ``prefilled_tokens`` is then what was queued.
        """
        session = self._mutable(session_id)
        tip = self._committable_tip(session, node_id)
        tokens = self.checks.tokens(tokens)
        self.checks.context(tip.end + len(tokens))
        self.checks.fits(tip.end + len(tokens), tip.table.residual is not None)
        tree = session.tree
        best, matched = None, 0
        for cand in self._branches_at(tip):
            written = tree.path_tokens(cand)[tip.end:cand.kv_len]
            lcp = _common_prefix(written, tokens)
            if lcp > matched:
                best, matched = cand, lcp
        lengths = tip.table.lengths()
        if best is not None:
            table = best.table.fork(best.table.adapter_start)
            table.truncate(tip.end + matched)
        else:
            table, tip.table = tip.table, None  # the new tip takes over the spine's pages
        # The session continues under the adapter whose KV it bound (planner -> critic).
        adapter = best.adapter if best is not None else tip.adapter
        new_tip = Node(next(self._ids), session_id, tip, "commit", list(tokens), tip.end,
                       table, NodeState.COMMITTED, adapter=adapter)
        if adapter == tip.adapter:
            new_tip.activation = tip.activation  # the same path, grown: scan only the new tokens
        if best is not None and matched == len(tokens) == best.kv_len - tip.end \
                and best.end == best.kv_len:
            new_tip.next_token, new_tip.next_token_sampling = (best.next_token,
                                                               best.next_token_sampling)
        # Staged: the old tip keeps its table and the branches live until the tail is
        # written, so a failed tail puts everything back (``_unstage``).
        unwritten, session.generated_unwritten = session.generated_unwritten, False
        session.error = None
        tree.stage_tip(new_tip)
        self._attach_published(session, new_tip, keep_last=new_tip.next_token is None)
        before = self.metrics.prefill_tokens
        if wait:
            session.hold_speculation = True
            try:
                self.stepper.run_until(lambda: (new_tip.kv_len >= new_tip.end
                                                or session.error is not None))
            finally:
                session.hold_speculation = False
            if new_tip.kv_len < new_tip.end:
                error = session.error or OutOfPagesError(
                    f"session {session_id}: the commit's tail could not be scheduled")
                self._unstage(session, tip, table if best is None else None, lengths, unwritten)
                raise error
        if session.paused_since is not None:  # the tool pause since the last generation ends
            self.kv.retention.policy.observe(self.clock() - session.paused_since)
            session.paused_since = None
        # The bound branch is released too (the tip forked its table) but was not discarded.
        aborted = tuple(n.id for c in tip.live_children() if c is not new_tip
                        for n in tree.abort(c) if n is not best)
        tree.settle_tip(tip)
        tip.generation += 1
        bound = best.id if best is not None else None
        if not wait:
            self.stepper.account()
            return CommitResult(session_id, new_tip.id, bound, matched,
                                new_tip.end - new_tip.kv_len, aborted)
        self.stepper.publish(new_tip)
        self.stepper.account()
        return CommitResult(session_id, new_tip.id, bound, matched,
                            self.metrics.prefill_tokens - before, aborted)

    def _unstage(self, session: Session, tip: Node, taken: NodeKV | None,
                 lengths: tuple[int, ...], unwritten: bool) -> None:
        """A commit whose tail failed: the tip, its table and its branches as before."""
        if taken is not None:  # the spine's pages go back to the old tip, at their old lengths
            session.tree.tip.table = None
            taken.rollback(lengths)
            tip.table = taken
        session.tree.unstage_tip(tip)
        session.generated_unwritten = unwritten
        session.error = None  # the verb raises it; the session is as it was
        self.stepper.account()

    def join(self, session_id: int, node_ids: Sequence[int], *,
             separator: Sequence[int] = ()) -> CommitResult:
        """Commit several branches' tokens one after another (a fan-in, e.g. LangGraph Send)."""
        session = self._mutable(session_id)
        if not node_ids:
            raise InvalidRequestError("join needs at least one branch")
        tip = session.tree.tip
        parts = []
        for nid in node_ids:
            node = self._node(session, nid)
            if node.state is not NodeState.SPECULATIVE:
                raise InvalidStateError(f"node {nid} is {node.state.value}; join takes live "
                                        "branches")
            if not self._descends_at(node, tip):
                raise InvalidStateError(f"node {nid} does not branch from the tip {tip.id}")
            parts.append(session.tree.path_tokens(node)[tip.end:])
        joined = list(parts[0])
        for part in parts[1:]:
            joined += list(separator) + list(part)
        return self.commit(session_id, tip.id, joined)

    def generate(self, session_id: int, max_tokens: int, *, sampling: SamplingParams = GREEDY,
                 stop: Iterable[int] = ()) -> GenerateResult:
        """Decode up to ``max_tokens`` on the committed spine (stops early at a stop token)."""
        session = self.start_generate(session_id, max_tokens, sampling=sampling, stop=stop)
        self.stepper.run_until(lambda: session.decode_left == 0)
        self.stepper.account()
        if session.error is not None:
            raise session.error
        if session.decode_left:
            session.fail(OutOfPagesError(f"session {session_id}: its decode could not be "
                                         "scheduled"))
            raise session.error
        return self.generation(session_id)

    def start_generate(self, session_id: int, max_tokens: int, *,
                       sampling: SamplingParams = GREEDY, stop: Iterable[int] = ()) -> Session:
        """Queue a generation without running it: ticks decode every queued session in one
        batch (drivers and servers with many sessions use this; ``generate`` waits)."""
        session = self._mutable(session_id)
        max_tokens = count("max_tokens", max_tokens)
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError("sampling must be SamplingParams, got "
                                      f"{type(sampling).__name__}")
        stop = frozenset(token_ids(stop, "stop", allow_empty=True))
        tip = session.tree.tip
        self.checks.context(tip.end + max_tokens)
        # The last sampled token's KV is written only if another verb follows.
        self.checks.fits(tip.end + max_tokens - 1, tip.table.residual is not None)
        session.error = None
        session.begin_generate(max_tokens, sampling, stop)
        if tip.next_token is not None and tip.next_token_sampling != sampling:
            tip.next_token = None
        if max_tokens:
            tip.generation += 1
        self.stepper.emit(session)
        if self.config.steady_decode:
            self.stepper.steady.admit(session)  # the cached token was just emitted
        return session

    def cancel_generate(self, session_id: int) -> GenerateResult:
        """Stop a queued generation now (a stop string seen by the caller, a client gone);
        the tokens already generated stay committed."""
        session = self._mutable(session_id)
        if session.decode_left:
            session.decode_left = 0
            session.paused_since = self.clock()
        return GenerateResult(tuple(session.generated), session.finish_reason)

    def generation(self, session_id: int) -> GenerateResult | None:
        """The session's generation so far; ``None`` while tokens are still owed. After a
        failure (``finish_reason`` "error"), ``Session.error`` says why. It does not settle a
        step in flight (``config.overlap``): a session in that step still owes its token, so
        the answer is ``None`` until a later tick applies it — a driver polling every session
        each tick keeps the overlap."""
        session = self._lookup(session_id)
        if session.decode_left:
            return None
        return GenerateResult(tuple(session.generated), session.finish_reason)

    def abort(self, session_id: int, node_id: int | None = None) -> AbortResult:
        """Abort one speculative branch (and its subtree), or, with no node, the whole session."""
        session = self._mutable(session_id)
        free_before = self.pool.num_free
        if node_id is None:
            released = [n.id for n in session.tree.nodes.values()
                        if n.state is NodeState.SPECULATIVE]
            session.tree.release_all()
            del self.sessions[session_id]
        else:
            node = self._node(session, node_id)
            if node.state is not NodeState.SPECULATIVE:
                raise InvalidStateError(f"node {node_id} is {node.state.value}; only a "
                                        f"speculative branch can be aborted")
            released = [n.id for n in session.tree.abort(node)]
        self.stepper.account()
        return AbortResult(tuple(released), self.pool.num_free - free_before)

    def remove_adapter(self, adapter: AdapterId) -> None:
        """Unload an adapter from the backend; refused while a live node uses it (drain or
        close those sessions first), so no queued work is left pointing at it."""
        self.stepper.sync()
        adapter = self.checks.adapter(adapter)
        if adapter is None:
            raise InvalidRequestError("remove_adapter needs an adapter, got None")
        users = sorted({s.id for s in self.sessions.values() for n in s.tree.nodes.values()
                        if n.live and n.adapter == adapter})
        if users:
            raise AdapterInUseError(f"adapter {adapter!r} is used by live sessions {users[:8]}; "
                                    f"close them first")
        if not self.capabilities.remove_adapter:
            raise InvalidRequestError("this backend cannot unload adapters")
        self.backend.remove_adapter(adapter)

    def close(self, session_id: int, *, pin: bool | None = None) -> None:
        """End a session: its committed full pages stay published, everything else is freed.
        With ``pin`` (default: ``config.pause_pin``) its base pages are pinned through the
        expected tool pause (a server that sees a reply end in tool calls asks for it)."""
        session = self._mutable(session_id)
        tip = session.tree.tip
        self.stepper.publish(tip)
        if self.config.pause_pin if pin is None else pin:
            self.kv.pin_published(tip.table, tip.adapter, session.tree.committed, self.clock())
        session.tree.release_all()
        del self.sessions[session_id]
        self.stepper.account()

    # ------------------------------------------------------------------ ticks
    def tick(self) -> bool:
        """One scheduler tick; returns False when there was nothing to do. With
        ``config.overlap`` the tick may return with its step in flight: every verb settles it
        first; a driver that reads ``sessions`` or ``metrics`` directly calls ``sync``."""
        return self.stepper.tick()

    def sync(self) -> None:
        """Read back and apply the step in flight (``config.overlap``); a no-op otherwise."""
        self.stepper.sync()

    def _attach_published(self, session: Session, node: Node, keep_last: bool) -> None:
        """Alias published pages for the node's committed path (the prefix-cache hit)."""
        path = session.tree.path_tokens(node)
        limit = len(path) - 1 if keep_last else len(path)  # keep one token to sample from
        self.stepper.attach(node, self._match(session, node, path[:max(limit, 0)]))

    def _match(self, session: Session, node: Node, path: Sequence[int]) -> DualMatch:
        # An aLoRA's keys depend on its activation point on the node's whole path.
        self.stepper.activate(session.tree, node)
        return self.kv.match(node.table, node.adapter, path)

    def _branches_at(self, tip: Node) -> list[Node]:
        out = []
        for child in tip.live_children():
            if child.state is NodeState.SPECULATIVE and child.start == tip.end:
                out.extend(n for n in child.subtree() if n.live and n.table is not None)
        return out

    @staticmethod
    def _descends_at(node: Node, tip: Node) -> bool:
        while node.parent is not None and node.parent is not tip:
            node = node.parent
        return node.parent is tip and node.start == tip.end

    def _committable_tip(self, session: Session, node_id: int) -> Node:
        node = self._node(session, node_id)
        if node.state is NodeState.ABORTED:
            raise InvalidStateError(f"node {node_id} was aborted; it cannot be committed")
        if node.state is NodeState.SPECULATIVE:
            raise InvalidStateError(f"node {node_id} is speculative: commit extends the committed "
                                    f"tip {session.tree.tip.id} with the tokens that happened")
        if node is not session.tree.tip:
            raise InvalidStateError(f"node {node_id} was already committed past; the tip is "
                                    f"{session.tree.tip.id}")
        return node

    def _mutable(self, session_id: int) -> Session:
        """The session a verb is about to change: it leaves the steady-decode set first (the
        general path sees every change a verb makes)."""
        session = self._session(session_id)
        self.stepper.steady.drop(session_id)
        return session

    def _session(self, session_id: int) -> Session:
        self.stepper.sync()  # every verb and reading sees the last step applied
        return self._lookup(session_id)

    def _lookup(self, session_id: int) -> Session:
        try:
            return self.sessions[session_id]
        except (KeyError, TypeError):
            raise UnknownSessionError(f"unknown session {session_id!r}") from None

    @staticmethod
    def _node(session: Session, node_id: int) -> Node:
        try:
            return session.tree.nodes[node_id]
        except (KeyError, TypeError):
            raise UnknownNodeError(f"session {session.id} has no node {node_id!r}") from None

    # ----------------------------------------------------------- inspection
    def tip(self, session_id: int) -> int:
        return self._session(session_id).tree.tip.id

    def node(self, session_id: int, node_id: int) -> Node:
        return self._node(self._session(session_id), node_id)

    def committed_tokens(self, session_id: int) -> list[int]:
        return list(self._session(session_id).tree.committed)

    def cache_stats(self) -> CacheStats:
        """Pools, prefix trees, pins and host tier, copied out (the interfaces' view)."""
        self.stepper.sync()
        return cache_stats(self.kv)

    def pages_in_use(self) -> PagesInUse:
        """Pages held in each pool now, a step in flight's included. Unlike ``cache_stats`` it
        does not settle that step (``config.overlap``): a per-tick poll that must not stall it."""
        return pages_in_use(self.kv)

    def published_pages(self) -> tuple[PublishedPage, ...]:
        """Every page the prefix trees publish, copied out (replica routing summaries)."""
        self.stepper.sync()
        return published_pages(self.kv)

    def has_session(self, session_id: int) -> bool:
        """Whether ``session_id`` is open (closed, aborted and expired sessions are not)."""
        return session_id in self.sessions

    def num_sessions(self) -> int:
        return len(self.sessions)

    def session_summary(self, session_id: int) -> SessionSummary:
        """The session's adapter and KV peak, copied out (the interfaces read no Session)."""
        session = self._session(session_id)
        return SessionSummary(session.adapter, session.peak_tokens)

    def session_pages(self, session_id: int) -> SessionPages:
        """The pages a session holds, copied out (tenant quotas, benches' KV accounting)."""
        return session_pages(self._session(session_id))

    def evict_all(self) -> int:
        self.stepper.sync()
        return self.kv.evict_all()

    def check_integrity(self) -> None:
        """Refcounts equal holders exactly; tables are consistent; aborted nodes hold nothing;
        what the backend can tell was written covers every table (``engine/integrity.py``)."""
        self.stepper.sync()
        check_integrity(self.sessions.values(), self.kv,
                        self.backend.first_unwritten if self.capabilities.written_positions
                        else None)



def _text_of(backend: Backend) -> Callable[[Sequence[int]], str]:
    """The backend's detokenizer, loaded on first use; a model shipped without tokenizer
    files reads as no text (legality scoring then sees nothing to reject)."""
    def decode(ids: Sequence[int]) -> str:
        try:
            tokenizer = backend.tokenizer
        except (AttributeError, RuntimeError, ValueError):
            return ""
        return tokenizer.decode(ids)
    return decode




def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
