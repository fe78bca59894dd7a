"""``PrefixIndex.num_cache_only`` (one pass, ``PagePool.held_only``) counts the pages
``cache_only`` names, page by page, through publishes, table references taken and dropped,
and evictions; ``held_run`` (one walk) counts the held pages of a path's leading device run
that ``probe`` and ``cache_only`` name."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from forkserve.backend.protocol import PageKind
from forkserve.control.page_pool import PagePool
from forkserve.control.prefix_index import BASE, PrefixIndex

P = 2  # tokens per page

OPS = st.lists(st.tuples(st.sampled_from(["publish", "hold", "drop", "evict"]),
                         st.integers(0, 3)), max_size=40)


def per_page(index: PrefixIndex) -> int:
    return sum(1 for page in index.held_refs() if index.cache_only(page))


def held_per_page(index: PrefixIndex, tokens: list[int]) -> int:
    run = itertools.takewhile(lambda page: page is not None, index.probe(BASE, tokens))
    return sum(1 for page in run if not index.cache_only(page))


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_the_count_is_cache_only_page_by_page(ops):
    pool = PagePool(PageKind.BASE, 24, P)
    index = PrefixIndex(pool)
    held: list[list[int]] = []   # tables' references, as a session's table holds them
    for op, k in ops:
        if op == "publish" and pool.num_free >= 3:
            pages = pool.alloc(3)  # a table's pages: the index takes its own references
            index.insert(BASE, [k, 1, 2, 3, 4, 5 + k], pages)
            held.append(pages)
        elif op == "hold" and held:
            pool.incref(held[k % len(held)])
            held.append(list(held[k % len(held)]))
        elif op == "drop" and held:
            pool.decref(held.pop(k % len(held)))
        elif op == "evict":
            index.evict(k)
        assert index.num_cache_only == per_page(index)
        for path in ([k, 1, 2, 3, 4, 5 + k] for k in range(4)):
            assert index.held_run(BASE, path) == held_per_page(index, path)
