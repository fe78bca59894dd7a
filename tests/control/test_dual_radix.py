"""ForkKV's cache management in the control plane: typed keys, decoupled eviction,
partial hits that recompute only the missing side, cross-adapter forks."""
from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import PageKind
from forkserve.control.dual_radix_tree import BaseKey, DualRadixTree, ResidualKey
from forkserve.control.page_pool import PagePool

CFG = ForkServeConfig(page_size=4, num_pages=128, num_residual_pages=128, vocab_size=300,
                      kv_layout=KVLayout.DISAGGREGATED)


class RecordingBackend(MockBackend):
    """A MockBackend that remembers which side each work item wrote."""

    def __init__(self, config):
        super().__init__(config)
        self.items = []

    def step_batched(self, work, batch):  # ``step`` comes here too
        self.items.extend([*work, *(batch.items() if batch is not None else ())])
        return super().step_batched(work, batch)

    def written(self):
        base = sum(len(w.tokens) for w in self.items if w.write_base)
        residual = sum(len(w.tokens) for w in self.items
                       if w.write_residual and w.slots.residual_pages is not None)
        return base, residual


def test_residual_keys_never_cross_adapters_or_versions():
    tree = DualRadixTree(PagePool(PageKind.BASE, 16, 4), PagePool(PageKind.RESIDUAL, 16, 4))
    tokens = (1, 2, 3, 4, 5, 6, 7, 8)
    for pool in (tree.base.pool, tree.residual.pool):
        pool.alloc(2)
    tree.insert(BaseKey(tokens), [0, 1], ResidualKey("a", 0, tokens), [0, 1])
    assert tree.match(BaseKey(tokens), ResidualKey("a", 0, tokens)).residual_pages == [0, 1]
    assert tree.match(BaseKey(tokens), ResidualKey("b", 0, tokens)).residual_pages == []
    assert tree.match(BaseKey(tokens), ResidualKey("a", 1, tokens)).residual_pages == []
    assert tree.match(BaseKey(tokens), ResidualKey("b", 0, tokens)).base_pages == [0, 1]
    # Typed keys: token tuples that would collide as glued strings ("1,23" vs "12,3") do not.
    assert ResidualKey("a", 0, (1, 23)) != ResidualKey("a", 0, (12, 3))


def _published_context(backend, adapter, context):
    eng = Engine(backend)
    h = eng.open(context, adapter=adapter)
    eng.generate(h.id, 1)
    eng.close(h.id)
    return eng


def test_partial_hit_with_the_base_evicted_recomputes_only_the_base():
    backend = RecordingBackend(CFG)
    context = list(range(10, 42))  # 8 pages
    eng = _published_context(backend, "a", context)
    eng.index.evict()  # the base tree's LRU alone
    assert eng.residual_index.num_pages == 8 and eng.index.num_pages == 0
    backend.items.clear()
    h = eng.open(context + [7], adapter="a")
    eng.generate(h.id, 1)
    base, residual = backend.written()
    assert residual == 1                 # only the new token on the residual side
    assert base == len(context) + 1      # the evicted base is recomputed
    assert eng.metrics.residual_hit_tokens == 32
    eng.check_integrity()


def test_partial_hit_with_the_residual_evicted_recomputes_only_the_residual():
    backend = RecordingBackend(CFG)
    context = list(range(10, 42))
    eng = _published_context(backend, "a", context)
    eng.residual_index.evict()
    assert eng.index.num_pages == 8 and eng.residual_index.num_pages == 0
    backend.items.clear()
    h = eng.open(context + [7], adapter="a")
    eng.generate(h.id, 1)
    base, residual = backend.written()
    assert base == 1
    assert residual == len(context) + 1
    eng.check_integrity()


def test_another_adapter_shares_the_base_and_computes_its_own_residual():
    backend = RecordingBackend(CFG)
    context = list(range(10, 42))
    eng = _published_context(backend, "planner", context)
    backend.items.clear()
    h = eng.open(context + [7], adapter="critic")
    out = eng.generate(h.id, 3)
    base, residual = backend.written()
    # The new token and two decode steps write both sides; the shared context only the residual.
    assert base == 1 + 2 and residual == len(context) + 1 + 2
    baseline = Engine(MockBackend(CFG))
    hb = baseline.open(context + [7], adapter="critic")
    assert baseline.generate(hb.id, 3).tokens == out.tokens


def test_cross_adapter_fork_allocates_residual_pages_only():
    eng = Engine(MockBackend(CFG))
    h = eng.open(list(range(10, 42)), adapter="planner")
    eng.drain_slack()
    base_used, res_used = eng.pool.num_used, eng.residual_pool.num_used
    critic = eng.fork(h.id, h.tip, "critic", [5, 6, 7, 8], adapter="critic")
    assert (eng.pool.num_used, eng.residual_pool.num_used) == (base_used, res_used)
    eng.speculate(h.id, critic)
    eng.drain_slack()
    node = eng.node(h.id, critic)
    assert node.table.base.pages[:8] == eng.node(h.id, h.tip).table.base.pages[:8]
    assert eng.pool.num_used == base_used + 1            # the critic's own 4 tokens
    assert eng.residual_pool.num_used == res_used + 9    # its residual for trunk + tokens
    cr = eng.commit(h.id, h.tip, [5, 6, 7, 8, 9])
    assert cr.bound_node == critic and cr.prefilled_tokens == 1
    assert eng.node(h.id, cr.tip).adapter == "critic"    # the session continues as the critic
    eng.abort(h.id)
    eng.evict_all()
    assert eng.pool.num_used == eng.residual_pool.num_used == 0


def test_unified_layout_cross_adapter_fork_shares_nothing():
    cfg = CFG.replace(kv_layout=KVLayout.UNIFIED)
    eng = Engine(MockBackend(cfg))
    h = eng.open(list(range(10, 42)), adapter="planner")
    eng.drain_slack()
    used = eng.pool.num_used
    critic = eng.fork(h.id, h.tip, "critic", [5, 6], adapter="critic")
    eng.speculate(h.id, critic)
    eng.drain_slack()
    assert eng.pool.num_used == used + 9  # the whole trunk again, under the critic's K/V


SMALL = CFG.replace(num_pages=16, num_residual_pages=16)


def test_base_pressure_in_a_tick_never_evicts_the_residual_tree():
    """A base-model session needs more base pages than are free: the tick evicts base pages
    only, and the adapter's published residual still serves the next session in full."""
    backend = RecordingBackend(SMALL)
    context = list(range(10, 42))  # 8 pages each side
    eng = _published_context(backend, "a", context)
    base, residual = set(eng.index.entries()), set(eng.residual_index.entries())
    h = eng.open(list(range(50, 90)))  # 10 base pages, 8 free
    eng.generate(h.id, 1)
    assert not base <= set(eng.index.entries())         # the base tree gave way
    assert set(eng.residual_index.entries()) == residual
    eng.close(h.id)
    backend.items.clear()
    h = eng.open(context + [7], adapter="a")
    eng.generate(h.id, 1)
    assert backend.written()[1] == 1                    # only the new token's residual
    eng.check_integrity()


def test_residual_pressure_in_a_tick_never_evicts_the_base_tree():
    """Another adapter's session on another context: base pages to spare, 11 residual pages
    needed with 8 free. The tick evicts residual pages only; the first context's base pages
    (held by the index alone, so evictable) stay published."""
    backend = RecordingBackend(SMALL.replace(num_pages=32))
    context = list(range(10, 42))
    eng = _published_context(backend, "a", context)
    base, residual = set(eng.index.entries()), set(eng.residual_index.entries())
    h = eng.open(list(range(50, 90)), adapter="b")
    eng.generate(h.id, 1)
    assert not residual <= set(eng.residual_index.entries())  # the residual tree gave way
    assert base <= set(eng.index.entries())
    eng.check_integrity()


def test_a_reloaded_adapter_never_reads_the_old_versions_pages():
    """ResidualKey carries the adapter's version: after a reload the residual (disaggregated)
    or merged (unified) pages of the old weights are misses, the base pages still hit, and
    the output is a fresh engine's under the new weights."""
    context = list(range(10, 42))
    for layout, written in ((KVLayout.DISAGGREGATED, (1 + 2, len(context) + 1 + 2)),
                            (KVLayout.UNIFIED, (len(context) + 1 + 2, 0))):
        cfg = CFG.replace(kv_layout=layout)
        backend = RecordingBackend(cfg)
        eng = _published_context(backend, "a", context)
        assert backend.reload_adapter("a") == 1
        backend.items.clear()
        h = eng.open(context + [7], adapter="a")
        out = eng.generate(h.id, 3)
        assert backend.written() == written, layout
        fresh = Engine(MockBackend(cfg, adapter_versions={"a": 1}))
        assert fresh.generate(fresh.open(context + [7], adapter="a").id, 3).tokens == out.tokens
        old = Engine(MockBackend(cfg))
        assert old.generate(old.open(context + [7], adapter="a").id, 3).tokens != out.tokens
        eng.check_integrity()
