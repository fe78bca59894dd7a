"""A table's first publish resumes after the pages its match took (``PrefixIndex.match_at``),
and in-flight deduplication hashes a writer's pages from that prefix on (``page_hash``):
both equal what the walk from the root did before, entry for entry and LRU stamp for stamp."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forkserve import Engine, ForkServeConfig
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import PageKind
from forkserve.control.host_tier import HostTier
from forkserve.control.metrics import EngineMetrics
from forkserve.control.page_hash import ROOT_SEED, ChainSeed, PageChain
from forkserve.control.page_pool import PagePool
from forkserve.control.prefix_index import (
    BASE,
    UNSALTED,
    AdapterNamespace,
    CacheSalt,
    PrefixIndex,
    _chain,
)

P = 2  # tokens per page
TRUNKS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9])
SCOPES = ((BASE, 0), (AdapterNamespace("a"), 0), (AdapterNamespace("a", 0, 4), 2))
SALTS = (CacheSalt(), CacheSalt("t"))


class _NoCopies:
    """A host tier's backend that keeps no bytes (the index's bookkeeping is under test)."""

    def offload_pages(self, kind, copies):
        pass

    def restore_pages(self, kind, copies):
        pass


class _World:
    """One index and its sessions; ``fast``: a table's first publish resumes from its match's
    cursor (the engine now), else from the root (the engine before)."""

    def __init__(self, fast: bool) -> None:
        self.fast = fast
        self.pool = PagePool(PageKind.RESIDUAL, 48, P)
        # Room for every entry a run can make: which ones a full host drops would depend on
        # LRU ties, which eviction breaks by object identity (so would a partial eviction:
        # the worlds evict everything evictable at once, a set that does not depend on ties).
        host = HostTier(PageKind.RESIDUAL, 512, P, _NoCopies(), EngineMetrics())
        self.index = PrefixIndex(self.pool, host)
        self.sessions: dict[int, dict] = {}

    def open(self, sid, path, scope, salt):
        namespace, base_pages = scope
        if self.pool.num_free < 12:
            self.index.evict()  # room for a restore, which would evict only what it lacks
        hit = self.index.match_at(namespace, path[:len(path) - 1], base_pages, salt)
        self.pool.incref(hit.pages)  # the table keeps what it matched
        self.sessions[sid] = {"path": path, "ns": namespace, "base": base_pages, "salt": salt,
                              "pages": list(hit.pages),
                              "cursor": hit.cursor if self.fast else None}
        return hit

    def write(self, sid, pages):
        s = self.sessions[sid]
        n = min(pages, len(s["path"]) // P - len(s["pages"]))
        if n > self.pool.num_free:
            self.index.evict()
        if 0 < n <= self.pool.num_free:
            s["pages"] += self.pool.alloc(n)

    def publish(self, sid):
        s = self.sessions[sid]
        s["cursor"] = self.index.insert(s["ns"], s["path"][:len(s["pages"]) * P], s["pages"],
                                        s["cursor"], s["base"], s["salt"])

    def close(self, sid):
        self.pool.decref(self.sessions.pop(sid)["pages"])

    def snapshot(self):
        """Every entry's place, residence and LRU stamp (page ids aside: eviction breaks LRU
        ties by object identity, so two worlds may free, and then reuse, other ids)."""
        return {(key.namespace, key.salt, prefix): (node.page is None, node.last_access)
                for key, prefix, node in self.index._walk()}


# (op, session, trunk, scope, salt, pages written, path length): a publish follows each write,
# as in the engine.
OPS = st.lists(st.tuples(st.sampled_from(["open", "write", "close", "evict"]),
                         st.integers(0, 2), st.integers(0, 1), st.integers(0, 2),
                         st.integers(0, 1), st.integers(1, 6), st.integers(2, 12)),
               max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_resumed_first_publish_equals_the_walk_from_the_root(ops):
    fast, ref = _World(True), _World(False)
    for op, sid, trunk, scope, salt, pages, length in ops:
        path = TRUNKS[trunk][:length] + [100 + sid]
        for world in (fast, ref):
            live = sid in world.sessions
            if op == "open" and not live:
                world.open(sid, path, SCOPES[scope], SALTS[salt])
            elif op == "write" and live:
                world.write(sid, pages)
                world.publish(sid)
            elif op == "close" and live:
                world.close(sid)
            elif op == "evict":
                world.index.evict()
            world.index.check_integrity()
        assert fast.snapshot() == ref.snapshot()
        assert (fast.index.num_pages, fast.index.num_offloaded, fast.pool.num_free) == \
            (ref.index.num_pages, ref.index.num_offloaded, ref.pool.num_free)
        for s in fast.sessions.values():
            # A cursor's seed is the chain of the path's pages before it, hashed from the root.
            seed = s["cursor"].seed if s["cursor"] is not None else ROOT_SEED
            full = PageChain.at(ROOT_SEED).extend(s["path"][:seed.pages * P], P)
            assert seed == ChainSeed(full.end, full.hashes[-1] if seed.pages else ROOT_SEED.hash)


@given(st.lists(st.integers(0, 5), max_size=40), st.integers(0, 20), st.integers(1, 4))
def test_a_chain_resumed_from_a_seed_equals_its_tail_hashed_from_the_root(tokens, cut, page):
    whole = PageChain.at(ROOT_SEED).extend(tokens, page)
    k = min(cut, whole.end)
    seed = ChainSeed(k, whole.hashes[k - 1] if k else ROOT_SEED.hash)
    tail = PageChain.at(seed).extend(tokens, page)
    assert (tail.first, tail.end) == (k, whole.end)
    assert list(tail.run(k, whole.end)) == list(whole.run(k, whole.end))
    grown = PageChain.at(ROOT_SEED).extend(tokens[:cut], page).extend(tokens, page)
    assert list(grown.hashes) == list(whole.hashes)


def test_index_entries_keep_their_prefix_chain():
    pool = PagePool(PageKind.BASE, 8, P)
    index = PrefixIndex(pool)
    path = TRUNKS[0][:8]
    index.insert(BASE, path, pool.alloc(4))
    chain = PageChain.at(ROOT_SEED).extend(path, P)
    for _, prefix, node in index._walk():
        assert _chain(node) == node.chain == chain.hashes[len(prefix) // P - 1]


def test_a_session_on_a_published_context_hashes_and_publishes_only_its_own_pages():
    """256 agents on one 8K context cost a walk of the context per agent, twice, per prefill
    tick; now the first publish and the claims start where the agent's match ended."""
    eng = Engine(MockBackend(ForkServeConfig(page_size=16, num_pages=256, vocab_size=2048,
                                             max_batch_tokens=256)))
    context = list(range(1, 513))  # 32 pages
    lead = eng.open(context + [7]).id
    eng.generate(lead, 2)
    sid = eng.open(context + [600] * 40).id
    tip = eng.sessions[sid].tree.tip
    assert tip.publish_cursor.base.pages == 32  # from the match in open
    walked, seeds = [], []
    insert, chain = eng.kv.index.insert, eng.stepper.dedup.chain

    def counted(namespace, tokens, pages, resume=None, base_pages=0, salt=UNSALTED):
        walked.append(len(pages) - (resume.pages if resume is not None else 0))
        return insert(namespace, tokens, pages, resume, base_pages, salt)

    def seeded(node_id, path, seed):
        seeds.append(seed.pages)
        return chain(node_id, path, seed)

    eng.kv.index.insert, eng.stepper.dedup.chain = counted, seeded
    eng.generate(sid, 2)
    eng.check_integrity()
    assert walked and max(walked) <= 3  # its 2.5 new pages, never the 32 matched ones
    assert seeds and set(seeds) == {32}
