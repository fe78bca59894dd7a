"""D1, base retention through tool pauses: a closed agent's base pages stay pinned for a TTL
learned from observed pauses, residual pages go to the host tier first, and the next turn
finds both sides without recomputing."""
import pytest

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.control.pause_ttl import QuantilePauseTTL

CFG = ForkServeConfig(page_size=4, num_pages=21, num_residual_pages=12, host_residual_pages=32,
                      vocab_size=300, kv_layout=KVLayout.DISAGGREGATED, node_ttl_s=None,
                      pause_pin=True, pause_ttl_prior_s=10.0)
AGENT = list(range(10, 42))     # 8 pages: the paused agent's context
STALE = list(range(100, 116))   # 4 pages: published long ago, its pin expired
BUSY = list(range(150, 198))    # 12 pages: another agent working during the pause


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _turn(eng, tokens, n=1):
    h = eng.open(tokens, adapter="planner")
    out = eng.generate(h.id, n).tokens
    eng.close(h.id)
    return out


def test_quantile_ttl_learns_from_pauses_and_rejects_bad_input():
    policy = QuantilePauseTTL(0.9, prior_s=7.0, slack=1.25, max_s=100.0)
    assert policy.ttl_s() == 7.0
    for pause in range(1, 11):
        policy.observe(float(pause))
    assert policy.ttl_s() == 9 * 1.25
    policy.observe(1000.0)
    assert policy.ttl_s() == 10 * 1.25  # one outlier moves the 0.9 quantile by one rank only
    with pytest.raises(ValueError, match=">= 0"):
        policy.observe(-1.0)
    with pytest.raises(ValueError, match="quantile"):
        QuantilePauseTTL(0.0)
    assert policy.ttl_s() == 10 * 1.25


def test_paused_base_outlives_residual_and_the_next_turn_recomputes_nothing():
    clock = Clock()
    eng = Engine(MockBackend(CFG), clock=clock)
    _turn(eng, STALE)
    clock.now = 20.0
    eng.tick()                          # the stale pin expires (TTL = prior 10 s)
    assert eng.metrics.pins_expired == 1
    _turn(eng, AGENT)                   # the agent's turn ends: a tool call starts
    agent_base = {e.page for e in eng.index.entries() if e.prefix == tuple(AGENT[:len(e.prefix)])}
    clock.now = 21.0
    _turn(eng, BUSY)                    # pressure on both pools during the pause
    # Base: the unpinned stale pages went, the paused agent's pinned pages stayed.
    assert agent_base <= {e.page for e in eng.index.entries()}
    stale = [e for e in eng.index.entries() if e.prefix[:4] == tuple(STALE[:4])]
    assert len(stale) == 1              # 3 of its 4 pages made room (21 = 8 + 12 + 1)
    # Residual: parked on the host, not dropped.
    assert eng.residual_index.num_offloaded == 12 and eng.metrics.host_dropped_pages == 0
    assert eng.metrics.pins_broken == 0
    clock.now = 25.0
    prefill_before = eng.metrics.prefill_tokens
    out = _turn(eng, AGENT + [7], 3)
    assert eng.metrics.prefill_tokens - prefill_before == 1        # the new token only
    assert eng.metrics.restored_tokens == len(AGENT)
    assert eng.metrics.pins_resumed == 1
    assert eng.kv.retention.policy.ttl_s() == 5.0 * 1.25           # the 5 s pause it measured
    baseline = Engine(MockBackend(CFG))
    h = baseline.open(AGENT + [7], adapter="planner")
    assert out == baseline.generate(h.id, 3).tokens
    eng.check_integrity()
    eng.evict_all()
    assert eng.pool.num_used == eng.residual_pool.num_used == eng.residual_index.num_offloaded == 0


def test_pins_give_way_to_committed_work_but_not_to_speculation():
    clock = Clock()
    eng = Engine(MockBackend(CFG.replace(num_residual_pages=64)), clock=clock)
    _turn(eng, AGENT)
    # Speculation fits in what is free: it never breaks a pin.
    h = eng.open(list(range(200, 240)), adapter="planner")  # 10 pages: 3 left free
    kid = eng.fork(h.id, h.tip, "guess", list(range(240, 260)))
    eng.speculate(h.id, kid, priority=0.5)
    eng.drain_slack()
    assert eng.metrics.pins_broken == 0
    # Committed work waits for nothing: speculation goes first, then the pin.
    eng.commit(h.id, h.tip, list(range(240, 256)))
    assert eng.metrics.pins_broken == 1
    eng.check_integrity()


def test_a_generation_to_commit_pause_is_measured():
    clock = Clock()
    eng = Engine(MockBackend(CFG), clock=clock)
    h = eng.open(AGENT, adapter="planner")
    eng.generate(h.id, 2)
    clock.now = 3.0
    eng.commit(h.id, eng.tip(h.id), [5, 6])
    assert eng.kv.retention.policy.ttl_s() == 3.0 * 1.25
