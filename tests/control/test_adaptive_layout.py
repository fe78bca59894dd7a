"""The adaptive layout (seed 003, D3) on the MockBackend: merged under light load, split
under pressure, under contention (an admission queue that would not fit merged; where
admission holds sessions for room, not within ``split_waves`` waves) or where the
adapter's residual is published; each form shares what its rules allow; ``layout_form``
answers what ``open`` then does."""
import dataclasses

import pytest

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.config import KVForm, ShareBase
from forkserve.control.layout_policy import LayoutSignals, PressurePolicy, Queued
from forkserve.errors import InvalidRequestError

CONTEXT = [7 + i % 50 for i in range(64)]  # 16 pages of 4 tokens


def engine(high_water: float, share_base: ShareBase = ShareBase.CROSS_ADAPTER) -> Engine:
    cfg = ForkServeConfig(page_size=4, num_pages=128, num_residual_pages=512, vocab_size=300,
                          kv_layout=KVLayout.ADAPTIVE, adaptive_high_water=high_water,
                          share_base=share_base, node_ttl_s=None)
    return Engine(MockBackend(cfg))


def form_of(eng: Engine, sid: int) -> KVForm:
    node = eng.node(sid, eng.tip(sid))
    return eng.kv.form_of(node.table, node.adapter)


def test_pressure_policy_rules():
    policy = PressurePolicy(high_water=0.5)
    assert policy.choose(LayoutSignals(True, 0, 10, 100)) is KVForm.MERGED
    assert policy.choose(LayoutSignals(True, 0, 51, 100)) is KVForm.SPLIT    # past the mark
    assert policy.choose(LayoutSignals(True, 4, 10, 100)) is KVForm.SPLIT    # residual published
    assert policy.choose(LayoutSignals(False, 0, 99, 100)) is KVForm.MERGED  # the base model


def test_pressure_policy_weighs_the_queue_and_holds_its_form():
    # A queue whose controller opens every session as it comes (the server): no waves.
    policy = PressurePolicy(high_water=0.5, hysteresis=0.2, split_waves=2.0)
    def choose(projected, queued_merged=0, queued_split=0, held=0):
        return policy.choose(LayoutSignals(True, 0, projected, 100, held, queued_merged,
                                           queued_split))
    # Contended (10 + 60 > 50, and the queue splits into fewer pages): split, however little
    # this session's own pages are; ``split_waves`` does not apply, nothing would hold the
    # queue back until merged room frees.
    assert choose(10, 60, 8) is KVForm.SPLIT
    assert choose(45, 60, 8) is KVForm.SPLIT
    assert choose(45, 4, 2) is KVForm.MERGED      # the queue fits merged: no room held back
    assert choose(45, 60, 60) is KVForm.MERGED    # splitting saves nothing: merged is faster
    # Hysteresis: while the context is served split, merged only under 50% - 20%.
    assert choose(40, held=5) is KVForm.SPLIT
    assert choose(25, held=5) is KVForm.MERGED
    assert choose(40) is KVForm.MERGED
    # Past the mark with nothing queued: split (nothing would make it wait for room).
    assert choose(60) is KVForm.SPLIT


def held(projected: int, queued_merged: int = 0, queued_split: int = 0, split_held: int = 0,
         session_pages: int = 10) -> LayoutSignals:
    """Signals from an admission controller that holds a session until its pages fit (pool
    100 pages); ``session_pages``: this prompt's own."""
    return LayoutSignals(True, 0, projected, 100, split_held, queued_merged, queued_split,
                         session_pages, holds_for_room=True)


@pytest.mark.parametrize("queued_merged,form", [
    (60, KVForm.MERGED),   # 10 + 60 = 1.4 marks: the queue runs merged in two waves
    (89, KVForm.MERGED),   # 10 + 89 = 1.98 marks: still within two waves
    (95, KVForm.SPLIT),    # 10 + 95 = 2.1 marks: more waves than split's slower attention costs
])
def test_a_held_queue_splits_only_past_split_waves_marks(queued_merged, form):
    policy = PressurePolicy(high_water=0.5, split_waves=2.0)
    assert policy.choose(held(10, queued_merged, 8)) is form
    # split_waves 1: round 7's rule, a queue that does not fit merged beside it splits.
    assert PressurePolicy(high_water=0.5).choose(held(10, queued_merged, 8)) is KVForm.SPLIT


def test_a_held_session_past_the_mark_waits_merged_unless_it_never_fits():
    policy = PressurePolicy(high_water=0.5, hysteresis=0.2, split_waves=2.0)
    # Past the mark (60 > 50), queue or not: merged, admission holds it for its wave rather
    # than open it split beside the merged sessions (a mixed batch decodes slowest).
    assert policy.choose(held(60)) is KVForm.MERGED
    assert policy.choose(held(60, 30, 8)) is KVForm.MERGED
    # Its own pages alone pass the mark: merged room never comes, so it splits (no deadlock).
    assert policy.choose(held(60, session_pages=55)) is KVForm.SPLIT
    assert policy.choose(held(20, session_pages=55)) is KVForm.MERGED  # under the mark: fits
    # The context served split (hysteresis): past the lowered mark (35 > 30) it joins that
    # base for its own pages instead of waiting merged beside the split sessions; under it
    # the room is there, merged.
    assert policy.choose(held(35, split_held=5)) is KVForm.SPLIT
    assert policy.choose(held(25, split_held=5)) is KVForm.MERGED
    # Not held: round 7's rule, past the mark splits.
    assert policy.choose(dataclasses.replace(held(60), holds_for_room=False)) is KVForm.SPLIT


def test_layout_form_passes_the_hold_and_the_prompts_pages():
    """``choose_form`` tells the policy whether the queue's controller holds for room (an empty
    queue's too) and this prompt's own pages."""
    seen = []

    class Spy(PressurePolicy):
        def choose(self, signals):
            seen.append(signals)
            return super().choose(signals)

    cfg = ForkServeConfig(page_size=4, num_pages=128, num_residual_pages=512, vocab_size=300,
                          kv_layout=KVLayout.ADAPTIVE, node_ttl_s=None)
    eng = Engine(MockBackend(cfg))
    eng.kv.policy = Spy(high_water=0.9, split_waves=2.0)
    eng.layout_form(CONTEXT + [9], adapter="planner", queued=Queued(holds_for_room=True))
    eng.layout_form(CONTEXT + [9], adapter="planner", queued=Queued(3, 80, 64))
    assert [(s.holds_for_room, s.session_pages) for s in seen] == [(True, 17), (False, 17)]


def test_split_waves_is_validated_and_reaches_the_policy():
    eng = Engine(MockBackend(ForkServeConfig(page_size=4, vocab_size=300, node_ttl_s=None,
                                             kv_layout=KVLayout.ADAPTIVE,
                                             adaptive_split_waves=3.0)))
    assert eng.kv.policy.split_waves == 3.0
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="adaptive_split_waves"):
            ForkServeConfig(adaptive_split_waves=bad)


def open_burst(eng: Engine, sessions: int) -> list[int]:
    """``sessions`` agents over CONTEXT, each its own adapter and 8 tokens of its own, opened
    as an admission controller would: each told how many wait behind it."""
    ids = []
    for i in range(sessions):
        queued = Queued(sessions - i - 1, len(CONTEXT) + 8, len(CONTEXT))
        tokens = CONTEXT + [200 + i] * 8
        assert eng.layout_form(tokens, adapter=f"agent{i}", queued=queued) \
            is eng.layout_form(tokens, adapter=f"agent{i}", queued=queued)
        form = eng.layout_form(tokens, adapter=f"agent{i}", queued=queued)
        ids.append(eng.open(tokens, adapter=f"agent{i}", queued=queued).id)
        assert form_of(eng, ids[-1]) is form
    return ids


def test_contention_splits_the_burst_so_every_agent_fits():
    # 12 agents of 18 pages: 216 merged against a mark of 115 (0.9 x 128); split, the 16
    # context pages once and 2 pages each. The first agent already sees the queue would not
    # fit merged, so the whole burst splits (without the queue, 6 would open merged): no
    # merged agent re-reads its own copy of the context beside the split ones' shared base.
    eng = engine(high_water=0.9)
    ids = open_burst(eng, 12)
    assert [form_of(eng, sid) for sid in ids] == [KVForm.SPLIT] * 12
    for sid in ids:
        eng.start_generate(sid, 2)
    while any(eng.generation(sid) is None for sid in ids):
        eng.tick()
    split = [eng.node(sid, eng.tip(sid)).table for sid in ids]
    assert all(t.base.pages[:16] == split[0].base.pages[:16] for t in split)  # one base copy
    eng.check_integrity()


@pytest.mark.parametrize("sessions", [1, 3])
def test_light_load_stays_merged_with_a_queue(sessions):
    eng = engine(high_water=0.9)
    assert {form_of(eng, sid) for sid in open_burst(eng, sessions)} == {KVForm.MERGED}


def test_contention_does_not_split_where_split_shares_nothing():
    """Under ``EXACT`` a split session reads only its own adapter's base pages: splitting the
    queue would save nothing, so the burst stays merged up to the plain mark."""
    eng = engine(high_water=0.9, share_base=ShareBase.EXACT)
    forms = [form_of(eng, sid) for sid in open_burst(eng, 12)]
    assert forms[:6] == [KVForm.MERGED] * 6  # 6 x 17 prompt pages: under the mark


def test_light_load_stays_merged_and_shares_nothing_across_adapters():
    eng = engine(high_water=0.9)
    assert eng.layout_form(CONTEXT, adapter="planner") is KVForm.MERGED
    a = eng.open(CONTEXT, adapter="planner").id
    eng.generate(a, 2)
    b = eng.open(CONTEXT, adapter="critic").id
    assert form_of(eng, a) is form_of(eng, b) is KVForm.MERGED
    assert eng.node(b, eng.tip(b)).kv_len == 0          # merged K/V of another adapter: no hit
    out = eng.generate(b, 2)
    eng.check_integrity()
    baseline = Engine(MockBackend(ForkServeConfig(page_size=4, vocab_size=300)))
    assert out.tokens == baseline.generate(baseline.open(CONTEXT, adapter="critic").id, 2).tokens


def test_pressure_splits_and_split_sessions_share_the_base():
    # 25 pages: the first 16-page context fits merged, the next does not
    eng = engine(high_water=0.2)
    a = eng.open(CONTEXT, adapter="planner").id
    eng.generate(a, 2)
    assert form_of(eng, a) is KVForm.MERGED
    assert eng.layout_form(CONTEXT, adapter="critic") is KVForm.SPLIT
    b = eng.open(CONTEXT, adapter="critic").id
    eng.generate(b, 2)
    c = eng.open(CONTEXT, adapter="writer").id
    assert form_of(eng, b) is form_of(eng, c) is KVForm.SPLIT
    base_b = eng.node(b, eng.tip(b)).table.base.pages[:15]
    # the base is shared across adapters
    assert eng.node(c, eng.tip(c)).table.base.pages[:15] == base_b
    assert eng.node(c, eng.tip(c)).table.residual.length == 0         # its residual is its own
    eng.generate(c, 2)
    eng.check_integrity()


def test_a_published_residual_splits_even_under_light_load():
    eng = engine(high_water=0.9)
    eng.prefill_shared(CONTEXT, ["planner", "critic"])
    assert eng.layout_form(CONTEXT + [9], adapter="critic") is KVForm.SPLIT
    sid = eng.open(CONTEXT + [9], adapter="critic").id
    assert eng.node(sid, eng.tip(sid)).kv_len == len(CONTEXT)        # both sides found: no prefill
    assert eng.layout_form(CONTEXT, adapter="writer") is KVForm.MERGED  # nothing published for it


def test_layout_form_rejects_bad_input_without_state_change():
    eng = engine(high_water=0.9)
    with pytest.raises(InvalidRequestError):
        eng.layout_form([], adapter="planner")
    assert not eng.sessions and eng.pool.num_used == 0


def test_cached_pages_are_not_load():
    """Another adapter's closed session leaves its merged pages published but held by nothing:
    evictable, so they do not push the next session past the mark (it fits merged)."""
    eng = engine(high_water=0.2)  # 25 pages: one 16-page context fits merged, two do not
    a = eng.open(CONTEXT, adapter="planner").id
    eng.generate(a, 2)
    eng.close(a)
    assert eng.pool.num_used >= 16
    assert eng.layout_form(CONTEXT, adapter="critic") is KVForm.MERGED
    b = eng.open(CONTEXT, adapter="critic").id
    eng.generate(b, 2)  # the planner's cached pages are evicted to make room
    assert form_of(eng, b) is KVForm.MERGED
    eng.check_integrity()


@pytest.mark.parametrize("close", [False, True])
def test_a_session_reopening_its_merged_context_stays_merged(close):
    """An agent's next turn over its published merged context takes those pages, not new ones:
    merged fits (counting the prompt again split it, and its residual was prefilled anew)."""
    eng = engine(high_water=0.2)
    a = eng.open(CONTEXT, adapter="planner").id
    eng.generate(a, 2)
    if close:
        eng.close(a, pin=True)  # pinned through the tool pause: load, and its own prefix
    turn = CONTEXT + [9] * 8
    assert eng.layout_form(turn, adapter="planner") is KVForm.MERGED
    b = eng.open(turn, adapter="planner").id
    assert form_of(eng, b) is KVForm.MERGED
    assert eng.node(b, eng.tip(b)).kv_len == len(CONTEXT)  # the context's merged pages matched
    eng.generate(b, 2)
    assert eng.layout_form(CONTEXT, adapter="critic") is KVForm.SPLIT  # another adapter: no fit
    eng.check_integrity()


def test_neutral_contention_splits_over_the_base_models_pages():
    """Under ``NEUTRAL`` split sessions of other adapters share only the base model's pages:
    with its pass over the context held, the burst splits as under ``CROSS_ADAPTER``."""
    eng = engine(high_water=0.9, share_base=ShareBase.NEUTRAL)
    base = eng.open(CONTEXT + [9]).id
    eng.generate(base, 2)
    ids = open_burst(eng, 12)
    assert [form_of(eng, sid) for sid in ids] == [KVForm.SPLIT] * 12
    tables = [eng.node(sid, eng.tip(sid)).table for sid in ids]
    assert all(t.base.pages[:16] == tables[0].base.pages[:16] for t in tables)
    eng.check_integrity()
