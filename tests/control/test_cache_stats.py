"""``Engine.cache_stats`` / ``published_pages``: the interfaces' read-only view of the cache
agrees with the pools, trees, pins and host tier it summarises."""
from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.adapter_key import adapter_key
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import PageKind
from forkserve.engine import PoolStats

P = 4
CFG = ForkServeConfig(page_size=P, num_pages=128, num_residual_pages=12, host_residual_pages=32,
                      vocab_size=300, kv_layout=KVLayout.DISAGGREGATED, node_ttl_s=None,
                      pause_pin=True, pause_ttl_prior_s=10.0)
CONTEXT = list(range(10, 42))  # 8 pages
OTHER = list(range(50, 98))    # 12 pages: pushes the first context's residual to the host


def _turn(eng: Engine, tokens: list[int], adapter: int | str = "planner") -> None:
    h = eng.open(tokens, adapter=adapter)
    eng.generate(h.id, 1)
    eng.close(h.id)


def test_a_fresh_engine_reports_empty_pools_of_the_configured_sizes():
    stats = Engine(MockBackend(CFG)).cache_stats()
    assert stats.page_size == P
    assert stats.base == PoolStats(PageKind.BASE, 128, 0, 0, 128, 0)
    assert stats.residual == PoolStats(PageKind.RESIDUAL, 12, 0, 0, 12, 0)
    assert (stats.pins, stats.pinned_pages, stats.offloaded_pages) == (0, 0, 0)
    assert stats.host_slots_free == 32
    unified = Engine(MockBackend(CFG.replace(kv_layout=KVLayout.UNIFIED))).cache_stats()
    assert unified.residual is None and unified.pools() == (unified.base,)
    assert unified.base.kind is PageKind.UNIFIED


def test_stats_follow_publishing_pins_and_the_host_tier():
    eng = Engine(MockBackend(CFG))
    _turn(eng, CONTEXT)
    first = eng.cache_stats()
    assert first.base.published >= len(CONTEXT) // P
    assert first.residual.published == len(CONTEXT) // P
    assert first.pins == 1 and first.pinned_pages >= len(CONTEXT) // P
    assert first.base.used + first.base.free == 128
    # The session is closed: its residual pages are cache only (not load); its base pages
    # are pinned.
    assert first.residual.live == 0 < first.residual.used
    assert first.base.live >= first.pinned_pages
    _turn(eng, OTHER)
    second = eng.cache_stats()
    assert second.offloaded_pages == len(CONTEXT) // P
    assert second.host_slots_free == 32 - second.offloaded_pages
    assert first.offloaded_pages == 0  # a summary is a copy: it never changes under the engine
    assert [p.used for p in second.pools()] == [pool.num_used for pool in eng.kv.pools()]


def test_published_pages_list_every_device_page_parent_first_with_its_adapter():
    eng = Engine(MockBackend(CFG))
    _turn(eng, CONTEXT)
    pages = eng.published_pages()
    stats = eng.cache_stats()
    base = [p for p in pages if not p.residual]
    residual = [p for p in pages if p.residual]
    assert len({p.prefix for p in base}) == stats.base.published
    assert all(p.adapter is None for p in base)
    assert len(residual) == stats.residual.published
    assert {p.adapter for p in residual} == {"planner"}
    for tree in (base, residual):
        for i, page in enumerate(tree):
            assert len(page.prefix) % P == 0
            if len(page.prefix) > P:
                assert any(q.prefix == page.prefix[:-P] for q in tree[:i])


def test_a_published_page_names_its_adapter_by_the_key_adapter_key_makes():
    """The backend's id may be an int (TorchBackend's are): L4 maps pages back to adapter
    names through ``adapter_key`` (ServedModel.adapter_names), so the two spellings must agree."""
    eng = Engine(MockBackend(CFG, adapters=[7]))
    _turn(eng, CONTEXT, adapter=7)
    assert {p.adapter for p in eng.published_pages() if p.residual} == {adapter_key(7)}


def test_session_pages_copy_out_the_tip_and_every_live_branch():
    eng = Engine(MockBackend(CFG))
    h = eng.open(CONTEXT, adapter="planner")
    eng.generate(h.id, 1)
    branch = eng.fork(h.id, eng.tip(h.id), "b", list(range(100, 109)))
    tip = eng.node(h.id, eng.tip(h.id)).table
    eng.speculate(h.id, branch, priority=1.0)
    eng.drain_slack()
    pages = eng.session_pages(h.id)
    assert (pages.length, pages.base, pages.residual) == (tip.length, tuple(tip.base.pages),
                                                          tuple(tip.residual.pages))
    own = set(eng.node(h.id, branch).table.base.pages) - set(tip.base.pages)
    assert own and set(tip.base.pages) | own == pages.base_held  # aliased trunk pages once
    eng.abort(h.id, branch)
    assert eng.session_pages(h.id).base_held == frozenset(tip.base.pages)
