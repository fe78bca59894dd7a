"""In-flight prefix deduplication (control/inflight.py): sessions opened in one burst on one
prefix compute it once; a leader that goes away mid-prefill hands the waiters back to the
normal path; a reader waits only for pages it may read."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import PageKind
from forkserve.config import PrefixDedup, ShareBase
from forkserve.control.inflight import ClaimRun, ClaimStreams, InflightDedup, Writer
from forkserve.control.metrics import EngineMetrics
from forkserve.control.prefix_index import BASE, UNSALTED
from forkserve.control.scheduler import Demand, WorkClass
from forkserve.errors import OutOfPagesError

TRUNK = list(range(1, 513))  # 32 pages of 16


def _engine(dedup=PrefixDedup.IN_FLIGHT, **kw):
    kw = {"page_size": 16, "num_pages": 1024, "max_batch_tokens": 128, "vocab_size": 2048, **kw}
    return Engine(MockBackend(ForkServeConfig(prefix_dedup=dedup, **kw)))


def _fresh(tokens, n, adapter=None, **kw):
    eng = _engine(PrefixDedup.OFF, **kw)
    return eng.generate(eng.open(tokens, adapter=adapter).id, n).tokens


def _burst(eng, k, adapter=None):
    return [eng.open(TRUNK + [600 + i] * 5, adapter=adapter).id for i in range(k)]


def _run(eng, sids, n=3):
    for sid in sids:
        eng.start_generate(sid, n)
    while any(eng.sessions[s].decode_left for s in sids if s in eng.sessions):
        assert eng.tick()
        eng.check_integrity()
    return {s: tuple(eng.sessions[s].generated) for s in sids if s in eng.sessions}


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
def test_a_burst_on_one_trunk_computes_it_once_and_commits_the_same_tokens(layout):
    on, off = _engine(kv_layout=layout), _engine(PrefixDedup.OFF, kv_layout=layout)
    out_on, out_off = _run(on, _burst(on, 10)), _run(off, _burst(off, 10))
    assert list(out_on.values()) == list(out_off.values())
    # The leader writes 517 tokens; each follower matches the 32 trunk pages and computes
    # its 5-token suffix only (decode steps are counted apart).
    assert on.metrics.prefill_tokens == 517 + 9 * 5
    assert off.metrics.prefill_tokens == 10 * 517
    assert on.metrics.dedup_held > 0 and off.metrics.dedup_held == 0
    assert on.metrics.hash_hit_tokens == 9 * 512


def test_a_pool_that_fits_one_copy_admits_the_whole_burst():
    """32 trunk pages + a page per session fit; two trunk copies do not (the H200 router
    bench's `OutOfPagesError` with every agent computing its own copy)."""
    tight = {"num_pages": 48}
    eng = _engine(**tight)
    out = _run(eng, _burst(eng, 10))
    assert all(eng.sessions[s].error is None for s in out)
    assert out[next(iter(out))] == _fresh(TRUNK + [600] * 5, 3, **tight)
    assert eng.metrics.failed_items == 0
    off = _engine(PrefixDedup.OFF, **tight)
    with pytest.raises(OutOfPagesError):
        for sid in _burst(off, 10):
            off.generate(sid, 3)


@pytest.mark.parametrize("how", ["abort", "close", "fail"])
def test_a_leader_gone_mid_prefill_hands_the_waiters_over(how):
    eng = _engine()
    leader, *rest = _burst(eng, 3)
    for sid in (leader, *rest):
        eng.start_generate(sid, 3)
    eng.tick()  # the leader writes (and publishes) its first 128 tokens; the others wait
    assert eng.metrics.prefill_tokens == 128 and eng.metrics.dedup_held == 2
    if how == "abort":
        eng.abort(leader)
    elif how == "close":
        eng.close(leader)
    else:
        eng.backend.fault = lambda item: RuntimeError("boom") \
            if item.seq_id in eng.sessions[leader].tree.nodes else None
        eng.tick()  # only the leader runs, and fails alone
        eng.backend.fault = None
        assert eng.sessions[leader].error is not None
        assert eng.metrics.prefill_tokens == 128
    out = _run(eng, rest)
    for i, sid in enumerate(rest, start=1):
        assert eng.sessions[sid].error is None
        assert out[sid] == _fresh(TRUNK + [600 + i] * 5, 3)
    # The first waiter takes over where the published pages end; the second waits for it.
    assert eng.metrics.prefill_tokens - 128 == (517 - 128) + 5
    if how == "fail":  # the failed leader retries at its next verb, as a follower of nobody
        assert eng.generate(leader, 3).tokens == _fresh(TRUNK + [600] * 5, 3)
    eng.check_integrity()


def _adapters(share, **kw):
    return _engine(kv_layout=KVLayout.DISAGGREGATED, share_base=share, **kw)


def test_cross_adapter_waits_for_the_base_pages_and_computes_its_own_residual():
    eng = _adapters(ShareBase.CROSS_ADAPTER)
    a = eng.open(TRUNK + [600] * 5, adapter="a").id
    b = eng.open(TRUNK + [601] * 5, adapter="b").id
    out = _run(eng, [a, b])
    assert eng.metrics.dedup_held > 0
    assert eng.metrics.base_hit_tokens == 512 and eng.metrics.residual_hit_tokens == 0
    assert eng.metrics.residual_prefill_tokens == 2 * 517  # b's residual is b's alone
    assert eng.pool.num_used == 32 + 2 * 1  # one copy of the trunk's base pages
    assert out[b] == _fresh(TRUNK + [601] * 5, 3, adapter="b", kv_layout=KVLayout.DISAGGREGATED)


def test_exact_share_base_waits_only_for_its_own_adapter():
    eng = _adapters(ShareBase.EXACT)
    a = eng.open(TRUNK + [600] * 5, adapter="a").id
    b = eng.open(TRUNK + [601] * 5, adapter="b").id
    _run(eng, [a, b])
    assert eng.metrics.dedup_held == 0 and eng.metrics.base_hit_tokens == 0
    assert eng.metrics.prefill_tokens == 2 * 517
    same = _adapters(ShareBase.EXACT)
    _run(same, [same.open(TRUNK + [600 + i] * 5, adapter="a").id for i in range(2)])
    assert same.metrics.dedup_held > 0 and same.metrics.prefill_tokens == 517 + 5


def test_a_session_that_wants_every_logit_never_waits():
    eng = _engine()
    first = eng.open(TRUNK + [600] * 5).id
    whole = eng.open(TRUNK + [601] * 5, reuse_prefix=False).id
    _run(eng, [first, whole])
    assert eng.metrics.dedup_held == 0 and eng.metrics.prefill_tokens == 2 * 517


def _writer(node, rank, start, pages, follows=True):
    """Page ``i``'s hash is ``i``, under one stream."""
    stream = (ClaimStreams()(PageKind.UNIFIED, BASE, UNSALTED),)
    return Writer(node, rank, start, pages[0], (ClaimRun(pages, stream, stream),), follows)


def test_the_oldest_writer_leads_and_a_follower_stops_before_the_first_claimed_page():
    writers = {1: _writer(1, 5, 64, range(4, 12)),       # the oldest: leads pages 4-11
               2: _writer(2, 7, 40, range(2, 12)),       # its own 2-3 (40..63), then waits
               3: _writer(3, 6, 64, range(4, 8)),        # all claimed: held
               4: _writer(4, 9, 0, range(0, 8), False)}  # wants every logit: never waits
    demands = [Demand(n, 200, False, WorkClass.COMMITTED) for n in (2, 1, 3, 4)]
    demands.append(Demand(9, 1, True, WorkClass.COMMITTED))  # decode steps are no writers
    dedup = InflightDedup(16, EngineMetrics())
    out = dedup.admit(demands, lambda d, chain_of, streams: writers[d.node_id])
    assert [(d.node_id, d.tokens) for d in out] == [(2, 64 - 40), (1, 200), (4, 200), (9, 1)]
    assert dedup.waiting == {2, 3} and dedup.metrics.dedup_held == 1


def _stops_per_page_keys(writers):
    """Where each writer stops, by the rule as it was built before runs: a set of keys per
    page, tested and claimed page by page (the reference for ``Writer``'s run-wise sets)."""
    claimed, stops = set(), []
    for w in writers:
        pages = [(run, page) for run in w.runs for page in run.hashes]
        writes = [frozenset((s, page) for s in run.writes) for run, page in pages]
        reads = [frozenset((s, page) for s in run.reads) for run, page in pages]
        stop = len(pages) if not w.follows or not claimed else next(
            (i for i, keys in enumerate(reads) if not keys.isdisjoint(claimed)), len(pages))
        for keys in writes[:stop]:
            claimed |= keys
        stops.append(stop)
    return stops


_STREAMS = st.lists(st.integers(0, 2), max_size=2).map(tuple)
_RUN = st.builds(lambda hashes, writes, extra: ClaimRun(hashes, writes, writes + extra),
                 st.lists(st.integers(0, 8), max_size=6), _STREAMS, _STREAMS)
_WRITERS = st.lists(st.builds(lambda runs, follows: Writer(0, 0, 0, 0, tuple(runs), follows),
                              st.lists(_RUN, min_size=1, max_size=3), st.booleans()),
                    max_size=5)


@settings(max_examples=300, deadline=None)
@given(_WRITERS)
def test_run_wise_claims_stop_where_per_page_keys_did(writers):
    claimed, stops = {}, []
    for w in writers:
        stop = w.first_claimed(claimed)
        w.claim(stop, claimed)
        stops.append(stop)
    assert stops == _stops_per_page_keys(writers)
