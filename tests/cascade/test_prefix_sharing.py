"""control/sharing.py: which items of a step read a common page prefix once (pure control plane)."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from forkserve.backend.protocol import KVSlots, SeqWork, SharedPrefix
from forkserve.control.sharing import PrefixGroup, PrefixSharing

P = 16


def item(seq: int, pages: list[int], start: int) -> SeqWork:
    return SeqWork(seq, (5,), start, KVSlots(tuple(pages)), decode=True)


def test_agents_over_one_context_form_one_group() -> None:
    context = list(range(100, 132))  # 32 full pages = 512 tokens
    work = [item(i, context + [500 + i], 512 + i) for i in range(6)]
    assert PrefixSharing(P).groups(work) == (PrefixGroup(tuple(range(6)), 32),)
    marked = PrefixSharing(P).annotate(work)
    assert [w.shared_prefix for w in marked] == [SharedPrefix(0, 32)] * 6
    assert [w.slots for w in marked] == [w.slots for w in work]


def test_context_ending_mid_page_shares_only_its_full_pages() -> None:
    # 300-token context: 18 full pages shared, page 18 (12 tokens) copied on write per agent.
    context = list(range(18))
    work = [item(i, context + [200 + i], 305) for i in range(3)]
    assert PrefixSharing(P).groups(work) == (PrefixGroup((0, 1, 2), 18),)


def test_only_pages_wholly_before_the_new_tokens_are_shared() -> None:
    # The second item's new token sits in page 17 (it reads but does not write it: a side
    # already present); only pages 0..16 are wholly before it.
    pages = list(range(20))
    work = [item(0, pages, 19 * P), item(1, pages, 17 * P + 3)]
    assert PrefixSharing(P).groups(work) == (PrefixGroup((0, 1), 17),)


def test_groups_of_one_and_short_prefixes_are_left_alone() -> None:
    work = [item(0, list(range(40)), 40 * P - 1),            # alone
            item(1, list(range(100, 120)), 20 * P - 1),      # shares 8 pages (128 tokens) with 2
            item(2, list(range(100, 108)) + [300], 8 * P)]
    assert PrefixSharing(P).groups(work) == ()
    assert PrefixSharing(P, min_tokens=128).groups(work) == (PrefixGroup((1, 2), 8),)
    assert PrefixSharing(P, min_tokens=None).groups(work) == ()
    assert PrefixSharing(P).annotate(work) == work


def test_several_groups_in_one_step() -> None:
    a, b = list(range(0, 20)), list(range(50, 90))
    work = [item(0, a + [7], 20 * P), item(1, b + [8], 40 * P), item(2, a + [9], 20 * P),
            item(3, [99] * 30, 30 * P), item(4, b[:30] + [10], 30 * P)]
    groups = PrefixSharing(P).groups(work)
    assert groups == (PrefixGroup((0, 2), 20), PrefixGroup((1, 4), 30))
    marks = [w.shared_prefix for w in PrefixSharing(P).annotate(work)]
    assert marks == [SharedPrefix(0, 20), SharedPrefix(1, 30), SharedPrefix(0, 20), None,
                     SharedPrefix(1, 30)]


def test_a_member_that_diverges_early_is_left_out_when_that_reads_less() -> None:
    # Four items share 64 pages; a fifth shares only the first 17 with them:
    # 3 x 64 pages saved without it beats 4 x 17 with it.
    trunk = list(range(64))
    work = [item(i, trunk + [1000 + i], 64 * P) for i in range(4)]
    work.append(item(4, trunk[:17] + list(range(2000, 2047)), 64 * P))
    assert PrefixSharing(P).groups(work) == (PrefixGroup((0, 1, 2, 3), 64),)


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 40),
                          st.integers(0, 3), st.booleans()), min_size=1, max_size=12))
def test_numpy_rows_group_as_their_tuples(specs) -> None:
    # Steady-decode rows list their pages as numpy views (engine/page_row.py), compared by
    # their bytes; items list tuples. Rows of a few trunks diverging anywhere, of
    # mixed lengths and read positions, must group the same in either form or mixed.
    trunks = [list(range(t * 1000, t * 1000 + 48)) for t in range(3)]
    rows = []
    for i, (trunk, keep, extra, short, _) in enumerate(specs):
        pages = trunks[trunk][:keep] + list(range(10_000 + 100 * i, 10_000 + 100 * i + extra))
        rows.append((pages, max(0, len(pages) - short) * P))
    sharing = PrefixSharing(P, min_tokens=2 * P)
    as_tuples = [(tuple(pages), start) for pages, start in rows]
    as_arrays = [(np.asarray(pages, dtype=np.int64), start) for pages, start in rows]
    mixed = [row if spec[4] else array
             for row, array, spec in zip(as_tuples, as_arrays, specs, strict=True)]
    expected = sharing.groups_of(as_tuples)
    assert sharing.groups_of(as_arrays) == expected
    assert sharing.groups_of(mixed) == expected
