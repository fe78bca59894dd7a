"""D1, the residual host tier: evicted residual pages are parked on the host and brought
back instead of recomputed; the host's own LRU drops what does not fit; outputs never change."""
import pytest

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import HostCopy, PageKind
from forkserve.control.host_tier import HostTier
from forkserve.control.metrics import EngineMetrics
from forkserve.control.page_pool import PagePool
from forkserve.control.prefix_index import AdapterNamespace, PrefixIndex

CFG = ForkServeConfig(page_size=4, num_pages=128, num_residual_pages=12, host_residual_pages=32,
                      vocab_size=300, kv_layout=KVLayout.DISAGGREGATED, node_ttl_s=None)
CONTEXT = list(range(10, 42))  # 8 pages
OTHER = list(range(50, 98))    # 12 pages: pushes the first context's residual out of 12


class RecordingBackend(MockBackend):
    def __init__(self, config):
        super().__init__(config)
        self.items = []

    def step_batched(self, work, batch):  # ``step`` comes here too
        self.items.extend([*work, *(batch.items() if batch is not None else ())])
        return super().step_batched(work, batch)

    def residual_written(self):
        return sum(len(w.tokens) for w in self.items
                   if w.write_residual and w.slots.residual_pages is not None)


def _turn(eng, tokens, n=3):
    h = eng.open(tokens, adapter="planner")
    out = eng.generate(h.id, n).tokens
    eng.close(h.id)
    return out


def _pressured(config):
    """The first context published, then pushed off the residual pool by another one."""
    backend = RecordingBackend(config)
    eng = Engine(backend)
    _turn(eng, CONTEXT)
    _turn(eng, OTHER, 1)
    eng.check_integrity()
    backend.items.clear()
    return eng, backend


def _baseline(config, tokens, n=3):
    eng = Engine(MockBackend(config))
    h = eng.open(tokens, adapter="planner")
    return eng.generate(h.id, n).tokens


def test_offloaded_residual_is_restored_not_recomputed_and_outputs_do_not_change():
    eng, backend = _pressured(CFG)
    assert eng.metrics.offloaded_pages == 8 and eng.residual_index.num_offloaded == 8
    assert eng.index.num_pages >= 8  # base pool has room: its index never evicted
    out = _turn(eng, CONTEXT + [7])
    assert out == _baseline(CFG, CONTEXT + [7])
    assert eng.metrics.restored_pages == 8 and eng.metrics.restored_tokens == 32
    assert backend.residual_written() == 1 + 2  # the new token and two decode steps, no context
    eng.check_integrity()


def test_full_host_tier_drops_its_lru_for_good_and_the_rest_is_recomputed():
    cfg = CFG.replace(host_residual_pages=4)
    eng, backend = _pressured(cfg)
    # Pages parked and dropped within one eviction pass are never copied.
    assert eng.metrics.offloaded_pages == 4 and eng.metrics.host_dropped_pages == 4
    # The deepest pages went first, so the host keeps the context's first half (a prefix).
    kept = sorted(len(e.prefix) for e in eng.residual_index.offloaded_entries())
    assert kept == [4, 8, 12, 16]
    out = _turn(eng, CONTEXT + [7])
    assert out == _baseline(cfg, CONTEXT + [7])
    assert eng.metrics.restored_tokens == 16
    assert backend.residual_written() == 16 + 1 + 2
    eng.check_integrity()


def test_without_a_host_tier_eviction_drops_as_before():
    eng, backend = _pressured(CFG.replace(host_residual_pages=0))
    assert eng.kv.host_tier is None and eng.metrics.offloaded_pages == 0
    assert eng.residual_index.num_offloaded == 0
    _turn(eng, CONTEXT + [7])
    assert backend.residual_written() == len(CONTEXT) + 1 + 2
    assert eng.metrics.restored_pages == 0


def test_republishing_an_offloaded_prefix_adopts_the_new_page_and_frees_the_slot():
    pool = PagePool(PageKind.RESIDUAL, 4, 4)
    backend = MockBackend(CFG)
    host = HostTier(PageKind.RESIDUAL, 2, 4, backend, EngineMetrics())
    index = PrefixIndex(pool, host)
    ns, tokens = AdapterNamespace("a"), (1, 2, 3, 4)
    (page,) = pool.alloc(1)
    backend._kv[PageKind.RESIDUAL][page] = backend.expected_values(PageKind.RESIDUAL, tokens, "a")
    index.insert(ns, tokens, [page])
    pool.decref([page])
    assert index.evict(1) == 1 and index.num_offloaded == 1 and host.num_free == 1
    (fresh,) = pool.alloc(1)
    index.insert(ns, tokens, [fresh])
    assert (index.num_pages, index.num_offloaded, host.num_free) == (1, 0, 2)
    assert index.match(ns, tokens) == [fresh]
    index.check_integrity()


def test_host_copies_reject_bad_input_and_change_nothing():
    backend = MockBackend(CFG)
    before = backend.host_values(0).copy()
    with pytest.raises(ValueError, match="residual pages"):
        backend.offload_pages(PageKind.BASE, [HostCopy(0, 0)])
    with pytest.raises(ValueError, match="outside"):
        backend.offload_pages(PageKind.RESIDUAL,
                              [HostCopy(0, 0), HostCopy(0, CFG.host_residual_pages)])
    assert (backend.host_values(0) == before).all()
    with pytest.raises(ValueError, match="host_residual_pages"):
        ForkServeConfig(host_residual_pages=-1)


def _offloads_per_tick(n_sessions):
    """Offload calls (pages each) in every tick of ``n_sessions`` sessions prefilled and decoded
    together over a residual pool full of cache: every write evicts, every tick crosses pages."""
    backend = RecordingBackend(CFG.replace(num_residual_pages=16))
    eng = Engine(backend)
    _turn(eng, OTHER, 1)  # 12 residual pages of cache
    _turn(eng, CONTEXT, 1)
    ticks = []
    offload = backend.offload_pages
    backend.offload_pages = lambda kind, copies: (ticks[-1].append(len(copies)),
                                                  offload(kind, copies))
    for i in range(n_sessions):
        eng.start_generate(eng.open([200 + 3 * i, 201, 202], adapter="planner").id, 6)
    ticks.append([])
    while eng.tick():
        ticks.append([])
    eng.check_integrity()
    assert all(eng.generation(h) is not None for h in range(3, 3 + n_sessions))
    return ticks


def test_a_tick_offloads_in_one_batch_whatever_the_number_of_pages():
    """Eviction runs once per pool per tick (``KVCache.evict_for``), so its host copies are one
    call however many items need pages: the prefill tick and each page boundary alike."""
    few, many = _offloads_per_tick(2), _offloads_per_tick(5)
    assert max(map(len, few)) == max(map(len, many)) == 1
    assert sum(map(sum, many)) > sum(map(sum, few))
    assert max(max(t, default=0) for t in many) > 1  # some call carried several pages


def test_no_host_slot_or_page_leaks_on_failure_abort_and_close():
    eng, backend = _pressured(CFG)
    h = eng.open(CONTEXT + [7], adapter="planner")  # restores the parked context
    assert eng.metrics.restored_pages == 8
    injected = []
    backend.fault = lambda work: (injected.append(work) or ValueError("injected") if not injected
                                  else None)
    eng.start_generate(h.id, 3)
    while eng.tick():
        eng.check_integrity()
    assert injected and eng.generation(h.id).finish_reason == "error"
    backend.fault = None
    eng.abort(h.id)  # the whole session
    eng.check_integrity()
    other = eng.open(OTHER, adapter="planner")  # parks the context again
    eng.check_integrity()
    eng.close(other.id)
    eng.evict_all()
    eng.check_integrity()
    assert eng.kv.host_tier.num_free == CFG.host_residual_pages
    assert all(pool.num_free == pool.num_pages for pool in eng.kv.pools())
