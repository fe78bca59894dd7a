"""PageCensus (the react bench's shared-context accounting) against a recount from scratch."""
from hypothesis import given, settings
from hypothesis import strategies as st

from forkserve.bench.multilora.driver import PageCensus

pages = st.lists(st.integers(0, 40), max_size=12, unique=True)
ops = st.lists(st.tuples(st.integers(0, 5), st.booleans(), pages, pages), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_distinct_pages_equal_a_recount_after_any_adds_and_drops(steps):
    census, held = PageCensus(), {}
    for holder, add, base, residual in steps:
        if add and holder not in held:
            census.add(holder, base, residual)
            held[holder] = (base, residual)
        elif not add and holder in held:
            census.drop(holder)
            del held[holder]
        assert census.holders() == set(held)
        assert census.distinct() == (len({p for b, _ in held.values() for p in b}),
                                     len({p for _, r in held.values() for p in r}))
