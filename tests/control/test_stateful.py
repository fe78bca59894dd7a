"""Random sequences of every verb, with the invariants checked after each step.

* refcounts never negative and equal to the holders (``check_integrity``);
* the prefix index holds only committed tokens (every published page's path is a prefix
  of a committed sequence, and the backend's page really holds those tokens);
* committed tokens equal the model's record, and every greedy ``generate`` equals a fresh
  engine that only ever saw the committed tokens;
* after all sessions end, pages are free or held only by the index, and evicting the
  index frees them all;
* decoupled eviction (seed 001): pressure on one pool, through ``KVCache.make_room`` as a
  tick applies it, never evicts the other tree (its pages and its host copies unchanged);
* residual and merged pages are keyed by the adapter's version: an adapter reloaded between
  sessions (``AdapterReloads``) never reads the old version's pages;
* every tick plan serves committed work before speculation (``scheduler_oracle``);
* the cascade always keeps the winner (child 0) and known suffixes (p = 1);
* sessions opened in a burst on one prefix (``burst_open``) wait for each other's in-flight
  pages: every invariant above holds mid-prefill, whatever verb comes next.
"""
import sys

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from scheduler_oracle import check_plan

from forkserve import Engine, ForkServeConfig, KVLayout, plus_config
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import PageKind
from forkserve.config import KVForm
from forkserve.control.cascade import Action
from forkserve.control.context_tree import NodeState
from forkserve.control.layout_policy import Queued
from forkserve.errors import BranchCapError, OutOfPagesError

# A tiny alphabet makes loops, hash hits and shared prefixes frequent.
TOKENS = st.lists(st.integers(3, 8), min_size=1, max_size=12)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class VerbMachine(RuleBasedStateMachine):
    config = ForkServeConfig(page_size=4, num_pages=512, branch_cap=3, node_ttl_s=5.0,
                             vocab_size=300, hbm_tokens=2048, spec_chunk=8, max_batch_tokens=64)

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.versions: dict[str, int] = {}  # adapters reloaded so far: name -> current version
        self.backend = self.make_backend()
        self.engine = Engine(self.backend, clock=self.clock)
        self.committed: dict[int, list[int]] = {}
        self.ever_committed: list[tuple[int, ...]] = []
        # Every plan a tick makes (its inputs and grants), for ``committed_work_first``.
        self.plans: list[tuple] = []
        plan = self.engine.scheduler.plan

        def logged_plan(*args):
            grants = plan(*args)
            self.plans.append((*args, grants))
            return grants
        self.engine.scheduler.plan = logged_plan

    # ------------------------------------------------------------ helpers
    def _nodes(self, data, sid, state=None):
        nodes = [n for n in self.engine.sessions[sid].tree.nodes.values()
                 if n.live and (state is None or n.state is state)]
        return nodes

    def _pick_session(self, data):
        return data.draw(st.sampled_from(sorted(self.engine.sessions)))

    def _record(self, sid, tokens):
        self.committed[sid] += list(tokens)
        self.ever_committed.append(tuple(self.committed[sid]))

    # -------------------------------------------------------------- rules
    adapters = (None,)
    invocations: dict = {}  # activated LoRA adapters: name -> invocation tokens

    def make_backend(self) -> MockBackend:
        return MockBackend(self.config, invocations=self.invocations,
                           adapter_versions=self.versions)

    @rule(tokens=TOKENS, data=st.data())
    def open(self, tokens, data):
        h = self.engine.open(tokens, adapter=data.draw(st.sampled_from(self.adapters)))
        self.committed[h.id] = list(tokens)
        self.ever_committed.append(tuple(tokens))

    @rule(data=st.data(), prefix=st.lists(st.integers(3, 8), min_size=4, max_size=40),
          suffixes=st.lists(st.lists(st.integers(3, 8), max_size=5), min_size=2, max_size=4),
          ticks=st.integers(0, 3))
    def burst_open(self, data, prefix, suffixes, ticks):
        """Sessions opened in one burst on one prefix (in-flight deduplication: the oldest
        writes it, the others wait for its pages); some ticks run before the next rule, which
        may abort, close or fail the leader mid-prefill."""
        for i, suffix in enumerate(suffixes):
            tokens = prefix + suffix
            # The rest of the burst waits behind this one (the adaptive layout weighs it).
            queued = Queued(len(suffixes) - i - 1, len(prefix) + 5, len(prefix))
            h = self.engine.open(tokens, adapter=data.draw(st.sampled_from(self.adapters)),
                                 queued=queued)
            self.committed[h.id] = list(tokens)
            self.ever_committed.append(tuple(tokens))
        for _ in range(ticks):
            self.engine.tick()

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data(), tokens=TOKENS)
    def fork(self, data, tokens):
        sid = self._pick_session(data)
        tree = self.engine.sessions[sid].tree
        parents = [tree.tip] + self._nodes(data, sid, NodeState.SPECULATIVE)
        parent = data.draw(st.sampled_from(parents))
        if data.draw(st.booleans()) and parent.children:
            # Siblings that share a prefix exercise LCP binding and partial pages.
            sib = data.draw(st.sampled_from(parent.children))
            tokens = sib.tokens[:data.draw(st.integers(0, len(sib.tokens)))] + tokens
        try:
            self.engine.fork(sid, parent.id, "b", tokens,
                             adapter=data.draw(st.sampled_from(self.adapters)))
        except BranchCapError:
            assert len(parent.live_children()) == self.config.branch_cap

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data(), priority=st.sampled_from([0.1, 0.5, 1.0]),
          idle=st.sampled_from([None, 0.0, 5000.0]))
    def speculate(self, data, priority, idle):
        sid = self._pick_session(data)
        cands = [n for n in self._nodes(data, sid, NodeState.SPECULATIVE) if not n.speculated]
        if cands:
            node = data.draw(st.sampled_from(cands))
            self.engine.speculate(sid, node.id, priority=priority, t_idle_ms=idle)

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data(), residuals=st.lists(TOKENS, min_size=2, max_size=3))
    def fan_out_and_commit(self, data, residuals):
        """The agent step as a unit: fork k, speculate, drain, commit one that happened."""
        sid = self._pick_session(data)
        tip = self.engine.sessions[sid].tree.tip
        if len(tip.live_children()) + len(residuals) > self.config.branch_cap:
            return
        if data.draw(st.booleans()):
            # Residuals that repeat recent history: loops the cascade skips, but never the winner.
            history = self.committed[sid]
            residuals = [history[-data.draw(st.integers(4, 16)):] for _ in residuals]
        kids = [self.engine.fork(sid, tip.id, f"r{i}", r) for i, r in enumerate(residuals)]
        for k in kids:
            self.engine.speculate(sid, k, priority=data.draw(st.sampled_from([0.2, 0.9, 1.0])))
        self.engine.drain_slack()
        chosen = data.draw(st.sampled_from(residuals))
        tokens = chosen[:data.draw(st.integers(1, len(chosen)))] + data.draw(
            st.lists(st.integers(3, 8), max_size=5))
        self.engine.commit(sid, tip.id, tokens)
        self._record(sid, tokens)

    @rule()
    def drain(self):
        self.engine.drain_slack()

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data(), tail=st.lists(st.integers(3, 8), max_size=6))
    def commit(self, data, tail):
        sid = self._pick_session(data)
        tree = self.engine.sessions[sid].tree
        tip = tree.tip
        branches = [n for n in self._nodes(data, sid, NodeState.SPECULATIVE)]
        tokens = list(tail)
        if branches and data.draw(st.booleans()):
            b = data.draw(st.sampled_from(branches))
            rel = tree.path_tokens(b)[tip.end:]
            tokens = rel[:data.draw(st.integers(0, len(rel)))] + tokens
        if not tokens:
            tokens = [5]
        result = self.engine.commit(sid, tip.id, tokens)
        new_tip = self.engine.node(sid, result.tip)
        assert new_tip.kv_len == new_tip.end  # commit returns with the tail prefilled
        self._record(sid, tokens)

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data())
    def join(self, data):
        sid = self._pick_session(data)
        tip = self.engine.sessions[sid].tree.tip
        kids = [c for c in tip.live_children() if c.start == tip.end]
        if not kids:
            return
        chosen = data.draw(st.lists(st.sampled_from(kids), min_size=1, max_size=2, unique=True))
        tree = self.engine.sessions[sid].tree
        joined = []
        for i, k in enumerate(chosen):
            joined += ([7] if i else []) + tree.path_tokens(k)[tip.end:]
        self.engine.join(sid, [k.id for k in chosen], separator=[7])
        self._record(sid, joined)

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data(), n=st.integers(0, 6))
    def generate(self, data, n):
        sid = self._pick_session(data)
        before = list(self.committed[sid])
        adapter = self.engine.node(sid, self.engine.tip(sid)).adapter
        out = self.engine.generate(sid, n)
        baseline = Engine(self.make_backend())
        hb = baseline.open(before, adapter=adapter)
        assert out.tokens == baseline.generate(hb.id, n).tokens
        self._record(sid, out.tokens)

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data())
    def abort_branch(self, data):
        sid = self._pick_session(data)
        nodes = self._nodes(data, sid, NodeState.SPECULATIVE)
        if nodes:
            self.engine.abort(sid, data.draw(st.sampled_from(nodes)).id)

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data(), close=st.booleans())
    def end_session(self, data, close):
        sid = self._pick_session(data)
        (self.engine.close if close else self.engine.abort)(sid)
        del self.committed[sid]

    @rule(residual=st.booleans(), pages=st.integers(1, 8), committed=st.booleans())
    def pressure(self, residual, pages, committed):
        """Decoupled eviction: a write short of ``pages`` pages in one pool, through
        ``KVCache.make_room`` (for committed work also preempting speculation and pause pins),
        never touches the other tree. Both directions: base pressure and residual pressure."""
        self._pressure(residual, pages, committed)

    def _pressure(self, residual: bool, pages: int, committed: bool) -> None:
        kv = self.engine.kv
        pool = kv.residual_pool if residual else kv.pool
        if pool is None:
            return
        other = kv.index if pool is kv.residual_pool else kv.residual_index
        before = _contents(other)
        preempt = self.engine.stepper.preempt_speculative if committed else None
        try:
            kv.make_room(pool, pool.num_free + pages, preempt)
        except OutOfPagesError:
            pass  # less to give than asked: still pressure, the same rule holds
        assert _contents(other) == before, f"{pool.kind.value} pressure changed the other tree"

    @rule(dt=st.sampled_from([1.0, 6.0]))
    def advance_clock(self, dt):
        self.clock.now += dt
        self.engine.tick()

    # --------------------------------------------------------- invariants
    @invariant()
    def integrity(self):
        self.engine.check_integrity()

    @invariant()
    def committed_work_first(self):
        for plan in self.plans:
            check_plan(self.config, *plan)
        self.plans.clear()

    @invariant()
    def winner_and_known_suffixes_kept(self):
        """Child 0 and p = 1 residuals never meet a loop skip, an admission rule or an early
        abort: the cascade keeps them (with the cascade off, everything is a plain prefill)."""
        kept = {Action.HASH_SKIP, Action.HASH_PARTIAL, Action.PREFILL}
        for session in self.engine.sessions.values():
            for node in session.tree.nodes.values():
                if node.decision is None:
                    continue
                if not self.config.cascade:
                    assert node.decision.action is Action.PREFILL
                elif node.child_index == 0 or node.priority >= 1.0:
                    assert node.decision.action in kept, f"node {node.id}: {node.decision}"

    @invariant()
    def committed_matches_record(self):
        for sid, tokens in self.committed.items():
            assert self.engine.committed_tokens(sid) == tokens

    @invariant()
    def every_table_reads_its_own_path(self):
        """What a node's pages hold is exactly its path: no alias was written through."""
        for session in self.engine.sessions.values():
            for node in session.tree.nodes.values():
                if node.table is None:
                    continue
                path = session.tree.path_tokens(node)
                for table in node.table.tables():
                    kind = table.pool.kind
                    stored = self.backend.kv_values(kind, table.pages, table.length)
                    want = self.backend.expected_values(
                        kind, path[:table.length], node.adapter,
                        self.engine.kv.form_of(node.table, node.adapter),
                        _start(node.table.adapter_start))
                    assert (stored == want).all(), f"node {node.id} {kind.value}"

    @invariant()
    def index_holds_only_committed_pages(self):
        p = self.config.page_size
        for index in (self.engine.index, self.engine.residual_index):
            if index is None:
                continue
            kind = index.pool.kind
            for entry in index.entries():
                assert any(seq[:len(entry.prefix)] == entry.prefix
                           for seq in self.ever_committed), \
                    f"published prefix {entry.prefix} was never committed"
                adapter = getattr(entry.namespace, "adapter", None)
                stored = self.backend.kv_values(kind, [entry.page], p)
                # A base-side page under an adapter's namespace holds merged K/V.
                want = self.backend.expected_values(
                    kind, entry.prefix[-p:], adapter, KVForm.MERGED,
                    _start(getattr(entry.namespace, "adapter_start", 0)), len(entry.prefix) - p,
                    getattr(entry.namespace, "adapter_version", 0))
                assert (stored == want).all()

    def teardown(self):
        for sid in list(self.engine.sessions):
            self.engine.close(sid)
        self.engine.check_integrity()
        assert self.engine.pool.num_used == self.engine.index.num_pages
        self.engine.evict_all()
        assert self.engine.pool.num_used == 0


def _contents(index) -> set | None:
    """Everything an index holds: device entries and host copies (None: no such tree)."""
    if index is None:
        return None
    return set(index.entries()) | set(index.offloaded_entries())


def _start(adapter_start: int | None) -> int:
    """Where adapter values begin: an aLoRA not invoked on the path (None) never applies."""
    return sys.maxsize if adapter_start is None else adapter_start


class AdapterReloads:
    """Mixed into the machines with adapters: new weights under an adapter's id while no live
    node uses it (its sessions drained). Every baseline backend is built by ``make_backend``,
    so it sees the new version; a machine that builds baselines otherwise leaves this out."""

    @rule(data=st.data())
    def reload_adapter(self, data):
        in_use = {n.adapter for s in self.engine.sessions.values()
                  for n in s.tree.nodes.values() if n.live}
        idle = [a for a in self.adapters if a is not None and a not in in_use]
        if idle:
            adapter = data.draw(st.sampled_from(idle))
            self.versions[adapter] = self.backend.reload_adapter(adapter)


class CascadeVerbMachine(VerbMachine):
    config = plus_config(page_size=4, num_pages=512, branch_cap=3, node_ttl_s=5.0,
                         vocab_size=300, hbm_tokens=2048, spec_chunk=8, max_batch_tokens=64,
                         early_abort_probe_tokens=2, speculate_budget_tokens=4)


class MultiAdapterUnifiedMachine(AdapterReloads, CascadeVerbMachine):
    adapters = (None, "planner", "critic")


class DisaggregatedMachine(AdapterReloads, VerbMachine):
    config = plus_config(page_size=4, num_pages=512, num_residual_pages=512, branch_cap=3,
                         node_ttl_s=5.0, vocab_size=300, hbm_tokens=2048, spec_chunk=8,
                         max_batch_tokens=64, early_abort_probe_tokens=2,
                         speculate_budget_tokens=4, kv_layout=KVLayout.DISAGGREGATED)
    adapters = (None, "planner", "critic")


class OffloadMachine(DisaggregatedMachine):
    """D1: residual evictions park pages on a small host tier (its LRU drops the rest), closed
    sessions pin their base pages, and re-opening a committed sequence restores what was parked.
    ``check_integrity`` covers the host slots: each one free or held by exactly one entry."""

    config = DisaggregatedMachine.config.replace(host_residual_pages=6, pause_pin=True,
                                                 pause_ttl_prior_s=3.0)

    @rule(data=st.data(), pages=st.integers(1, 8), committed=st.booleans())
    def evict_offload_restore(self, data, pages, committed):
        index = self.engine.residual_index
        parked = index.num_offloaded
        self._pressure(True, pages, committed)
        assert index.num_offloaded >= min(parked, self.config.host_residual_pages)
        if self.ever_committed:
            tokens = list(data.draw(st.sampled_from(self.ever_committed)))
            h = self.engine.open(tokens, adapter=data.draw(st.sampled_from(self.adapters[1:])))
            self.committed[h.id] = tokens

    @invariant()
    def host_holds_what_its_entries_name(self):
        p = self.config.page_size
        for entry in self.engine.residual_index.offloaded_entries():
            want = self.backend.expected_values(PageKind.RESIDUAL, entry.prefix[-p:],
                                                entry.namespace.adapter,
                                                version=entry.namespace.adapter_version)
            assert (self.backend.host_values(entry.slot) == want).all()


class FullReuseMachine(DisaggregatedMachine):
    config = DisaggregatedMachine.config.replace(kv_layout=KVLayout.FULL_REUSE)


class ALoraMachine(DisaggregatedMachine):
    """Activated LoRA in every verb: the invocation (5, 6) is frequent in this alphabet, so
    activation points appear, move with commits, and split pages between BASE and adapter keys."""

    invocations = {"alora": (5, 6)}
    adapters = (None, "planner", "alora")


class ALoraUnifiedMachine(ALoraMachine):
    config = MultiAdapterUnifiedMachine.config


class AdaptiveMachine(DisaggregatedMachine):
    # A low high-water mark: sessions open merged, then split once a few pages are in use.
    config = DisaggregatedMachine.config.replace(kv_layout=KVLayout.ADAPTIVE,
                                                 adaptive_high_water=0.01)


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
class OverlapMachine(DisaggregatedMachine):
    """Overlap on (``config.overlap``): the blocking verbs pipeline their ticks; a bare tick
    is settled (``Engine.sync``) before the invariants read the engine's raw state."""

    config = DisaggregatedMachine.config.replace(overlap=True)

    @rule(dt=st.sampled_from([1.0, 6.0]))
    def advance_clock(self, dt):
        self.clock.now += dt
        self.engine.tick()
        self.engine.sync()


TestVerbs = VerbMachine.TestCase
TestVerbs.settings = _settings
TestCascadeVerbs = CascadeVerbMachine.TestCase
TestCascadeVerbs.settings = _settings
TestMultiAdapterUnified = MultiAdapterUnifiedMachine.TestCase
TestMultiAdapterUnified.settings = _settings
TestDisaggregated = DisaggregatedMachine.TestCase
TestDisaggregated.settings = _settings
TestOffload = OffloadMachine.TestCase
TestOffload.settings = _settings
TestFullReuse = FullReuseMachine.TestCase
TestFullReuse.settings = _settings
TestAdaptive = AdaptiveMachine.TestCase
TestAdaptive.settings = _settings
TestALora = ALoraMachine.TestCase
TestALora.settings = _settings
TestALoraUnified = ALoraUnifiedMachine.TestCase
TestALoraUnified.settings = _settings
TestOverlap = OverlapMachine.TestCase
TestOverlap.settings = _settings
