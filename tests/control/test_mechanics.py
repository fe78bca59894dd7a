"""Each mechanism of seed 000 in isolation, on the MockBackend."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_oracle import check_plan

from forkserve import AdmitMode, Engine, ForkServeConfig, plus_config
from forkserve.backend.byte_tokenizer import ByteTokenizer
from forkserve.backend.mock import MockBackend
from forkserve.control.cascade import Action
from forkserve.control.context_tree import NodeState
from forkserve.control.scheduler import Demand, TickScheduler, WorkClass
from forkserve.control.scorers import LegalityScorer, LoopScorer

tok = ByteTokenizer()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def engine(cfg=None, clock=None):
    cfg = cfg or ForkServeConfig(page_size=4, num_pages=256, vocab_size=300)
    return Engine(MockBackend(cfg), clock=clock or Clock())


def baseline_generate(cfg, tokens, n):
    e = Engine(MockBackend(cfg))
    return e.generate(e.open(tokens).id, n).tokens


def test_fork_aliases_trunk_and_copies_only_the_shared_partial_page():
    eng = engine()
    h = eng.open(list(range(10, 20)))          # 10 tokens: 2 full pages + a partial one
    eng.drain_slack()
    used = eng.pool.num_used
    a = eng.fork(h.id, h.tip, "a", [5])
    assert eng.pool.num_used == used           # fork is a page-table copy
    trunk = eng.node(h.id, h.tip).table.pages
    assert eng.node(h.id, a).table.pages == trunk
    eng.speculate(h.id, a)
    eng.drain_slack()
    child = eng.node(h.id, a).table.pages
    assert child[:2] == trunk[:2]              # full trunk pages stay shared
    assert child[2] != trunk[2]                # the partial page was copied before the write
    assert eng.pool.num_used == used + 1
    eng.check_integrity()


def test_abort_releases_to_the_spine_and_cascades_through_childless_speculation():
    eng = engine()
    h = eng.open(list(range(10, 26)))
    a = eng.fork(h.id, h.tip, "a", [5, 6, 7, 8])
    eng.speculate(h.id, a)
    eng.drain_slack()
    b = eng.fork(h.id, a, "b", [9, 9])
    eng.speculate(h.id, b)
    eng.drain_slack()
    spine_pages = eng.pool.num_used
    res = eng.abort(h.id, b)
    assert set(res.released_nodes) == {a, b}   # a had no live child left
    assert eng.node(h.id, a).state is NodeState.ABORTED
    assert eng.pool.num_used == spine_pages - 2
    eng.check_integrity()


def test_speculative_pages_are_never_published():
    cfg = ForkServeConfig(page_size=4, num_pages=256, vocab_size=300)
    eng = engine(cfg)
    h = eng.open(list(range(10, 18)))
    a = eng.fork(h.id, h.tip, "a", list(range(30, 42)))
    eng.speculate(h.id, a)
    eng.drain_slack()
    assert eng.index.num_pages == 2            # only the committed root's full pages
    assert {e.prefix for e in eng.index.entries()} == {tuple(range(10, 14)), tuple(range(10, 18))}
    eng.commit(h.id, h.tip, list(range(30, 38)))
    assert eng.index.num_pages == 4


def test_lcp_commit_splits_a_mid_page_and_prefills_only_the_tail():
    cfg = ForkServeConfig(page_size=4, num_pages=256, vocab_size=300)
    eng = engine(cfg)
    trunk = list(range(10, 18))
    h = eng.open(trunk)
    a = eng.fork(h.id, h.tip, "a", [1, 2, 3, 4, 5, 6])
    b = eng.fork(h.id, h.tip, "b", [1, 2, 9])
    for n in (a, b):
        eng.speculate(h.id, n)
    eng.drain_slack()
    cr = eng.commit(h.id, h.tip, [1, 2, 3, 7, 7])  # diverges inside a's second page
    assert (cr.bound_node, cr.matched_tokens, cr.prefilled_tokens) == (a, 3, 2)
    # The bound branch is released (its pages live on in the tip) but is not "aborted".
    assert set(cr.aborted) == {b}
    assert eng.node(h.id, a).state is NodeState.ABORTED
    out = eng.generate(h.id, 8)
    assert out.tokens == baseline_generate(cfg, trunk + [1, 2, 3, 7, 7], 8)
    eng.check_integrity()


def test_a_fully_prefilled_known_suffix_commits_with_zero_compute():
    eng = engine()
    h = eng.open(list(range(10, 30)))
    wrap = [5, 6, 7, 8, 9]
    k = eng.fork(h.id, h.tip, "wrap", wrap)
    eng.speculate(h.id, k, t_idle_ms=1000)
    eng.drain_slack()
    before = eng.metrics.prefill_tokens + eng.metrics.decode_tokens
    cr = eng.commit(h.id, h.tip, wrap)
    eng.generate(h.id, 1)  # the first token comes from the cached step
    assert cr.prefilled_tokens == 0
    assert eng.metrics.prefill_tokens + eng.metrics.decode_tokens == before


def test_known_suffix_is_pinned_through_the_tool_pause_then_expires():
    clock = Clock()
    cfg = ForkServeConfig(page_size=4, num_pages=256, vocab_size=300, node_ttl_s=1.0)
    eng = engine(cfg, clock)
    h = eng.open(list(range(10, 30)))
    k = eng.fork(h.id, h.tip, "wrap", [5, 6, 7])
    g = eng.fork(h.id, h.tip, "guess", [8, 9])
    eng.speculate(h.id, k, t_idle_ms=3000)              # fits: pinned for 3 s
    eng.speculate(h.id, g, priority=0.4, t_idle_ms=3000)
    eng.drain_slack()
    assert eng.node(h.id, k).pinned_until == pytest.approx(103.0)
    clock.now += 2.0
    eng.tick()
    assert eng.node(h.id, g).state is NodeState.ABORTED  # TTL
    assert eng.node(h.id, k).state is NodeState.SPECULATIVE  # pinned
    clock.now += 2.0
    eng.tick()
    assert eng.node(h.id, k).state is NodeState.ABORTED
    assert eng.metrics.ttl_expired == 2
    eng.check_integrity()


def test_slack_from_a_dropped_residual_fills_a_page_aligned_prefix_of_the_known_suffix():
    cfg = plus_config(page_size=4, num_pages=256, vocab_size=300, prefill_ms_per_token=1.0)
    eng = engine(cfg)
    trunk = tok.encode("Thought: look at the logs first. ") * 2
    h = eng.open(trunk)
    known = eng.fork(h.id, h.tip, "wrap", list(range(40, 60)))   # 20 tokens ~ 20 ms > pause
    loop = eng.fork(h.id, h.tip, "loop", trunk[-10:])             # a repeat: draft skip, frees 10
    assert eng.speculate(h.id, known, t_idle_ms=5).action is Action.PREFILL
    assert eng.node(h.id, known).slack_only
    eng.drain_slack()
    assert eng.node(h.id, known).kv_len == len(trunk)            # no slack yet: nothing written
    assert eng.speculate(h.id, loop, priority=0.3).action is Action.DRAFT_SKIP
    eng.drain_slack()
    assert eng.node(h.id, known).kv_len == len(trunk) + 8        # 10 freed -> 8, page-aligned
    assert eng.metrics.slack_filled_tokens == 8


def test_parent_generation_change_drops_queued_speculation():
    eng = engine()
    h = eng.open(list(range(10, 30)))
    a = eng.fork(h.id, h.tip, "a", list(range(40, 60)))
    eng.speculate(h.id, a, priority=0.5)
    eng.generate(h.id, 2)  # the trunk moves before a is run
    eng.drain_slack()
    assert eng.node(h.id, a).kv_len == 20  # only the aliased trunk: no residual written
    assert eng.metrics.dropped_chunks == 1


def test_scheduler_committed_first_and_zero_speculation_under_saturation():
    cfg = ForkServeConfig(max_batch_tokens=100, spec_chunk=32, hbm_tokens=1000)
    s = TickScheduler(cfg)
    committed = [Demand(1, 1, True, WorkClass.COMMITTED), Demand(2, 60, False, WorkClass.COMMITTED)]
    spec = [Demand(3, 50, False, WorkClass.SPECULATIVE, 0.5),
            Demand(4, 30, False, WorkClass.SPECULATIVE, 1.0)]
    grants = s.plan(committed, spec, decode_slots=4, spec_memory_tokens=1000)
    # 3's chunk does not fit
    assert [(g.node_id, g.tokens) for g in grants] == [(1, 1), (2, 60), (4, 30)]
    saturated = [Demand(2, 500, False, WorkClass.COMMITTED)]
    assert all(g.work_class is WorkClass.COMMITTED for g in s.plan(saturated, spec, 4, 1000))
    assert s.plan([], spec, 4, spec_memory_tokens=0) == []               # no memory left
    assert s.decode_slots(2, 500) == 4                                    # C = floor(H / M_spine)
    assert s.decode_slots(32, 1000) == 32    # 32 sessions over one shared 1000-token context


def test_speculation_stops_at_chunk_boundaries():
    cfg = ForkServeConfig(page_size=4, num_pages=256, vocab_size=300, spec_chunk=8,
                          max_batch_tokens=8)
    eng = engine(cfg)
    h = eng.open(list(range(10, 14)))
    a = eng.fork(h.id, h.tip, "a", list(range(40, 60)))
    eng.speculate(h.id, a, priority=0.5)
    assert eng.tick() and eng.node(h.id, a).kv_len == 4 + 8
    assert eng.tick() and eng.node(h.id, a).kv_len == 4 + 16


@pytest.mark.parametrize("mode,kept", [(AdmitMode.WINNER, 1), (AdmitMode.TOP_M, 3),
                                       (AdmitMode.ALPHA, 2), (AdmitMode.SCORE, 5)])
def test_admit_modes(mode, kept):
    cfg = plus_config(page_size=4, num_pages=512, vocab_size=300, admit_mode=mode, admit_alpha=0.7)
    eng = engine(cfg)
    h = eng.open(tok.encode("User: plan the trip. "))
    kids = [eng.fork(h.id, h.tip, f"t{i}", tok.encode(f"Thought: option {i} is good"))
            for i in range(5)]
    actions = [eng.speculate(h.id, k, priority=0.4).action for k in kids]
    assert actions[0] is Action.PREFILL  # the winner is always kept
    assert sum(a is Action.PREFILL for a in actions) == kept
    assert all(a in (Action.PREFILL, Action.REJECTED) for a in actions)


def test_winner_and_known_suffix_are_kept_even_when_they_loop():
    """The same looping residual three times: child 0 (the winner) and a known suffix
    (p = 1) are prefilled; any other child is loop-skipped. (test_admit_modes cannot tell:
    every rule admits child 0 there anyway.)"""
    eng = engine(plus_config(page_size=4, num_pages=256, vocab_size=300))
    h = eng.open(tok.encode("User: plan the trip to Paris. Thought: plan the trip to Paris."))
    loop = tok.encode(" plan the trip to Paris.")
    kids = [eng.fork(h.id, h.tip, f"t{i}", loop) for i in range(3)]
    actions = [eng.speculate(h.id, k, priority=p).action
               for k, p in zip(kids, (0.3, 0.3, 1.0), strict=True)]
    assert actions == [Action.PREFILL, Action.DRAFT_SKIP, Action.PREFILL]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), max_batch=st.integers(1, 96), chunk=st.integers(1, 32),
       slots=st.integers(1, 6), memory=st.integers(0, 100))
def test_scheduler_plans_committed_work_first(data, max_batch, chunk, slots, memory):
    """Random demands under budget and memory contention: every plan satisfies
    scheduler_oracle (committed fully served before any speculation, memory left to it)."""
    cfg = ForkServeConfig(max_batch_tokens=max_batch, spec_chunk=chunk)
    sizes = st.tuples(st.booleans(), st.integers(1, 40))
    committed = [Demand(i, 1 if dec else n, dec, WorkClass.COMMITTED)
                 for i, (dec, n) in enumerate(data.draw(st.lists(sizes, max_size=6)))]
    speculative = [Demand(100 + i, 1 if dec else n, dec, WorkClass.SPECULATIVE, p)
                   for i, (dec, n, p) in enumerate(data.draw(st.lists(
                       st.tuples(st.booleans(), st.integers(1, 40),
                                 st.sampled_from([0.2, 0.5, 1.0])),
                       max_size=6)))]
    grants = TickScheduler(cfg).plan(committed, speculative, slots, memory)
    check_plan(cfg, committed, speculative, slots, memory, 0, grants)


def test_loop_scorer_and_legality_scorer():
    hist = tok.encode("Thought: I should check the weather in Paris today.")
    loop = LoopScorer().score(hist, tok.encode("check the weather in Paris today."))
    fresh = LoopScorer().score(hist, tok.encode("Let me book a train to Lyon."))
    assert loop.is_loop and loop.value < 0.15
    assert not fresh.is_loop and fresh.value > 0.45
    legal = LegalityScorer(tok.decode)
    assert legal.score([], tok.encode('Action: search({"q": "x"})')).value == 1.0
    assert legal.score([], tok.encode('Action: search({"q": x})')).value == pytest.approx(0.22)
    assert legal.score([], tok.encode('Action: search({"q": "x"')).value == pytest.approx(0.22)
    assert legal.score([], tok.encode('<tool_call>{"name": "f"}</tool_call>')).value == 1.0
    assert legal.score([], tok.encode("just prose")).value == 1.0


def _winner_committed(eng):
    """Two sessions on one trunk; the first commits a winner (published). Returns the trunk,
    the winner and the second session."""
    trunk = tok.encode("System: agent. User: go.  ")  # 26 tokens
    winner = tok.encode('Action: go({"x": 1})')
    h1, h2 = eng.open(trunk), eng.open(trunk)
    k1 = eng.fork(h1.id, h1.tip, "w", winner)
    eng.speculate(h1.id, k1)
    eng.drain_slack()
    eng.commit(h1.id, h1.tip, winner)
    return trunk, winner, h2


def test_a_published_prefix_does_not_spare_illegal_text_its_probe():
    """An illegal call opening like a committed one hits the index for that prefix, and is
    still early-aborted: its miss tail is prefilled and probed, then dropped."""
    cfg = plus_config(page_size=4, num_pages=256, vocab_size=300)
    eng = engine(cfg)
    trunk, winner, h2 = _winner_committed(eng)
    eng.fork(h2.id, h2.tip, "w", winner)
    bad = eng.fork(h2.id, h2.tip, "bad", tok.encode('Action: go({"x": 1, "y": ]})'))
    d = eng.speculate(h2.id, bad, priority=0.5)
    assert d.action is Action.EARLY_ABORT and d.score < cfg.tau
    assert d.hit_tokens > 0 and d.miss_tokens == len(eng.node(h2.id, bad).tokens) - d.hit_tokens
    eng.drain_slack()
    assert not eng.node(h2.id, bad).live and eng.metrics.probe_aborts == 1
    eng.check_integrity()


def test_hash_skip_across_sessions_and_partial_hit_on_open():
    cfg = plus_config(page_size=4, num_pages=256, vocab_size=300)
    eng = engine(cfg)
    trunk, winner, h2 = _winner_committed(eng)
    k2 = eng.fork(h2.id, h2.tip, "w", winner)
    d = eng.speculate(h2.id, k2)
    assert d.action is Action.HASH_PARTIAL and d.miss_tokens == (len(trunk) + len(winner)) % 4
    h3 = eng.open(trunk + winner + [7])
    assert eng.node(h3.id, h3.tip).kv_len == (len(trunk) + len(winner)) // 4 * 4
    eng.check_integrity()


def test_queued_generations_of_many_sessions_decode_in_one_batch():
    cfg = ForkServeConfig(page_size=4, num_pages=256, vocab_size=300)
    eng = engine(cfg)
    prompts = [list(range(10 + i, 20 + i)) for i in range(3)]
    handles = [eng.open(p) for p in prompts]
    for h in handles:
        eng.start_generate(h.id, 5)
        assert eng.generation(h.id) is None
    ticks = 0
    while eng.tick():
        ticks += 1
    assert ticks == 5  # 1 prefill tick + 4 decode ticks, all three sessions in each
    for h, p in zip(handles, prompts, strict=True):
        assert eng.generation(h.id).tokens == baseline_generate(cfg, p, 5)


def test_cancel_generate_keeps_what_was_generated():
    eng = engine()
    h = eng.open(list(range(10, 20)))
    eng.start_generate(h.id, 50)
    eng.tick()
    eng.tick()
    done = eng.cancel_generate(h.id)
    assert len(done.tokens) == 2 and eng.generation(h.id) == done
    assert not eng.tick() or eng.generation(h.id) == done  # nothing more is decoded
    assert eng.committed_tokens(h.id)[-2:] == list(done.tokens)


def test_speculation_gets_only_the_memory_committed_work_leaves_and_yields_it_back():
    cfg = ForkServeConfig(page_size=4, num_pages=12, vocab_size=300, hbm_tokens=4 * 12,
                          max_batch_tokens=64, spec_chunk=64, node_ttl_s=None)
    eng = engine(cfg)
    h = eng.open(list(range(10, 18)))                            # 2 pages
    eng.drain_slack()
    spec = eng.fork(h.id, h.tip, "guess", list(range(20, 36)))   # 4 pages once written
    eng.speculate(h.id, spec, priority=0.3)
    other = eng.open(list(range(40, 68)))                         # 7 pages of committed prefill
    assert eng.tick()
    assert eng.node(other.id, other.tip).kv_len == 28
    assert eng.node(h.id, spec).kv_len == 8                       # 3 pages left: no chunk fits
    eng.close(other.id)
    eng.evict_all()
    eng.drain_slack()
    assert eng.node(h.id, spec).kv_len == 24                      # room again: it ran
    late = eng.open(list(range(100, 128)))                        # needs 7 of 6 free pages
    eng.drain_slack()
    assert eng.node(h.id, spec).state is NodeState.ABORTED         # preempted for committed work
    assert eng.node(late.id, late.tip).kv_len == 28
    eng.check_integrity()
