"""Failure isolation: one bad request never touches another session, and no unwritten KV is
ever served. The scenarios of the bug report as regression tests, then the fault-injection
state machine (``fault_machine.py``) in every layout, cascade on and off."""
import pytest
from fault_machine import FaultMachine, Injected
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from forkserve import Engine, ForkServeConfig, KVLayout, plus_config
from forkserve.backend.mock import MockBackend
from forkserve.errors import (
    AdapterInUseError,
    BackendError,
    CapacityError,
    ContextLengthError,
    OutOfPagesError,
)


def _mock(**kw):
    return MockBackend(ForkServeConfig(page_size=4, num_pages=64, vocab_size=512, **kw))


def _fresh(tokens, n, **kw):
    eng = Engine(_mock(**kw))
    return eng.generate(eng.open(tokens).id, n).tokens


def test_a_request_that_can_never_fit_is_refused_at_the_verb_and_harms_nobody():
    eng = Engine(_mock())
    good = eng.open([1, 2, 3, 4])
    first = eng.generate(good.id, 3).tokens
    with pytest.raises(CapacityError, match="needs 75 unified pages"):
        eng.open([7] * 300)
    assert eng.generate(good.id, 3).tokens == _fresh([1, 2, 3, 4] + list(first), 3)
    other = eng.open([5, 6, 7])
    assert eng.generate(other.id, 2).tokens == _fresh([5, 6, 7], 2)
    eng.commit(good.id, eng.tip(good.id), [9, 9])
    eng.check_integrity()


def test_waiting_for_pages_fails_only_the_waiter_and_writes_nothing():
    """Two sessions whose prompts fit alone but not together: the one that cannot get pages
    fails (its verb raises), the other decodes, and no table runs ahead of its KV."""
    eng = Engine(_mock())
    a = eng.open(list(range(1, 161)))       # 40 of 64 pages
    eng.generate(a.id, 1)
    b = eng.open(list(range(200, 320)))     # 30 more: must wait for a's pages
    with pytest.raises(OutOfPagesError):
        eng.generate(b.id, 2)
    eng.check_integrity()
    before = eng.committed_tokens(a.id)
    assert eng.generate(a.id, 2).tokens == _fresh(before, 2)
    eng.close(a.id)
    assert eng.generate(b.id, 2).tokens == _fresh(list(range(200, 320)), 2)
    eng.check_integrity()


def test_a_backend_error_for_one_item_fails_that_session_alone():
    backend = _mock()
    eng = Engine(backend)
    good, bad = eng.open([1, 2, 3, 4, 5]), eng.open([6, 7, 8])
    backend.fault = lambda item: (Injected("boom") if item.seq_id in eng.sessions[bad.id].tree.nodes
                                  else None)
    eng.start_generate(bad.id, 4)
    out = eng.generate(good.id, 4).tokens
    assert out == _fresh([1, 2, 3, 4, 5], 4)
    err = eng.sessions[bad.id].error
    assert isinstance(err, BackendError) and isinstance(err.__cause__, Injected)
    assert eng.generation(bad.id).finish_reason == "error"
    eng.check_integrity()
    backend.fault = None
    assert eng.generate(bad.id, 2).tokens == _fresh([6, 7, 8], 2)  # the next verb retries


def test_a_failed_commit_leaves_the_session_exactly_as_before():
    backend = MockBackend(plus_config(page_size=4, num_pages=64, vocab_size=512))
    eng = Engine(backend)
    h = eng.open([1, 2, 3, 4, 5, 6])
    kid = eng.fork(h.id, h.tip, "k", [9, 9, 9])
    eng.speculate(h.id, kid)
    eng.drain_slack()
    tip, committed = eng.tip(h.id), eng.committed_tokens(h.id)
    nodes = {n.id: (n.state, n.kv_len) for n in eng.sessions[h.id].tree.nodes.values()}
    backend.fault = lambda item: Injected("tail")
    with pytest.raises(BackendError):
        eng.commit(h.id, tip, [9, 9, 7, 7, 7])
    backend.fault = None
    assert (eng.tip(h.id), eng.committed_tokens(h.id)) == (tip, committed)
    assert {n.id: (n.state, n.kv_len) for n in eng.sessions[h.id].tree.nodes.values()} == nodes
    eng.check_integrity()
    cr = eng.commit(h.id, tip, [9, 9, 7, 7, 7])  # and the same commit then lands, binding kid
    assert cr.bound_node == kid and kid not in cr.aborted


def test_adapter_removal_is_refused_while_used_and_a_removal_behind_its_back_fails_only_its_users():
    backend = MockBackend(ForkServeConfig(page_size=4, num_pages=64, vocab_size=512,
                                          kv_layout=KVLayout.DISAGGREGATED), adapters=["a", "b"])
    eng = Engine(backend)
    ha, hb = eng.open([1, 2, 3, 4, 5], adapter="a"), eng.open([1, 2, 3, 4, 5], adapter="b")
    with pytest.raises(AdapterInUseError, match="used by live sessions"):
        eng.remove_adapter("a")
    eng.start_generate(ha.id, 3)
    backend.remove_adapter("a")
    eng.generate(hb.id, 3)
    assert eng.sessions[ha.id].error is not None and eng.sessions[hb.id].error is None
    eng.check_integrity()


def test_an_over_long_prompt_is_refused_against_the_context_window():
    eng = Engine(MockBackend(ForkServeConfig(max_context=64, vocab_size=512)))
    with pytest.raises(ContextLengthError, match="context window of 64"):
        eng.open([3] * 65)
    h = eng.open([3] * 60)
    with pytest.raises(ContextLengthError):
        eng.generate(h.id, 10)
    assert eng.sessions[h.id].error is None


# ---------------------------------------------------------------- the state machines
class Unified(FaultMachine):
    config = FaultMachine.config.replace(max_context=256)


class CascadeMultiAdapter(FaultMachine):
    config = plus_config(page_size=4, num_pages=512, branch_cap=3, node_ttl_s=5.0, vocab_size=300,
                         hbm_tokens=2048, spec_chunk=8, max_batch_tokens=64, max_context=256,
                         early_abort_probe_tokens=2, speculate_budget_tokens=4)
    adapters = (None, "planner", "critic")


class Disaggregated(CascadeMultiAdapter):
    config = CascadeMultiAdapter.config.replace(kv_layout=KVLayout.DISAGGREGATED)


class Adaptive(CascadeMultiAdapter):
    config = CascadeMultiAdapter.config.replace(kv_layout=KVLayout.ADAPTIVE,
                                                adaptive_high_water=0.01)


class FullReuse(CascadeMultiAdapter):
    config = CascadeMultiAdapter.config.replace(kv_layout=KVLayout.FULL_REUSE)


class Overlap(Disaggregated):
    """Overlap on: a fault surfaces when the step in flight is read back."""

    config = Disaggregated.config.replace(overlap=True)

    @rule(dt=st.sampled_from([1.0, 6.0]))
    def advance_clock(self, dt):
        self.clock.now += dt
        self.engine.tick()
        self.engine.sync()  # the invariants read raw state


MACHINES = (Unified, CascadeMultiAdapter, Disaggregated, Adaptive, FullReuse, Overlap)
# CI budget: the fault bench (benchmarks/fault_bench.py) runs thousands of faults.
_settings = settings(max_examples=12, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestUnified = Unified.TestCase
TestCascadeMultiAdapter = CascadeMultiAdapter.TestCase
TestDisaggregated = Disaggregated.TestCase
TestAdaptive = Adaptive.TestCase
TestFullReuse = FullReuse.TestCase
TestOverlap = Overlap.TestCase
for _case in (TestUnified, TestCascadeMultiAdapter, TestDisaggregated, TestAdaptive, TestFullReuse,
              TestOverlap):
    _case.settings = _settings
