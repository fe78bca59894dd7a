"""WaitingSessions: the admission queue's aggregate (``Queued``) kept as sessions come and go
equals a recount of the queue, whatever the order of arrivals, opens and cancellations."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkserve.control.layout_policy import NOTHING_QUEUED, Queued
from forkserve.control.prefix_index import UNSALTED, CacheSalt
from forkserve.control.waiting_sessions import Waiter, WaitingSessions
from forkserve.errors import InvalidStateError

PAGE = 4
SALTS = (UNSALTED, CacheSalt("tenant-a"))


def recount(members: list[tuple[Waiter, list[int]]], opening: Waiter,
            prompt: list[int]) -> Queued:
    """``Queued`` from scratch: every other waiter, the mean footprint rounded up, the full
    pages of ``prompt`` every other waiter's prompt (in the same boundary) starts with."""
    others = [(w, p) for w, p in members if w is not opening]
    if not others:
        return NOTHING_QUEUED

    def common_pages(a: list[int], b: list[int]) -> int:
        n = 0
        while (n + 1) * PAGE <= min(len(a), len(b)) and \
                a[n * PAGE:(n + 1) * PAGE] == b[n * PAGE:(n + 1) * PAGE]:
            n += 1
        return n
    shared = min(common_pages(prompt, p) if w.salt == opening.salt else 0 for w, p in others)
    tokens = sum(w.footprint for w, _ in others)
    return Queued(len(others), -(-tokens // len(others)), shared * PAGE)


# Prompts over a small alphabet with a common lead, so prefixes often agree for some pages.
prompts = st.builds(lambda lead, tail: [7] * lead + tail, st.integers(0, 12),
                    st.lists(st.integers(1, 2), max_size=10))
ops = st.lists(st.tuples(st.sampled_from(["add", "open", "cancel", "peek"]), prompts,
                         st.integers(0, 40), st.sampled_from(SALTS), st.integers(0, 10 ** 6)),
               max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_the_aggregate_equals_a_recount(ops):
    queue = WaitingSessions(PAGE)
    members: list[tuple[Waiter, list[int]]] = []
    for op, prompt, extra, salt, pick in ops:
        if op == "add" or not members:
            waiter = queue.waiter(prompt, len(prompt) + extra, salt)
            queue.add(waiter)
            members.append((waiter, prompt))
            continue
        waiter, its_prompt = members[pick % len(members)]
        if op == "peek":  # a queued request sized before it is admitted: itself left out
            assert queue.queued(waiter) == recount(members, waiter, its_prompt)
            continue
        # "open" takes the head (FIFO), "cancel" any waiter; both leave the queue.
        waiter, its_prompt = members.pop(0 if op == "open" else pick % len(members))
        queue.remove(waiter)
        assert waiter not in queue
        assert queue.queued(waiter) == recount(members, waiter, its_prompt)
        outsider = queue.waiter(prompt, len(prompt) + extra, salt)
        assert queue.queued(outsider) == recount(members, outsider, prompt)
    assert len(queue) == len(members)
    for waiter, _ in list(members):
        queue.remove(waiter)
    assert len(queue) == 0 and not queue._prefixes and queue._tokens == 0  # nothing left over


def test_a_waiter_joins_and_leaves_once():
    queue = WaitingSessions(PAGE)
    waiter = queue.waiter([1] * 8, 10)
    queue.add(waiter)
    with pytest.raises(InvalidStateError):
        queue.add(waiter)
    queue.remove(waiter)
    with pytest.raises(InvalidStateError):
        queue.remove(waiter)
    assert queue.queued(waiter) == NOTHING_QUEUED


def test_a_queue_that_holds_for_room_says_so_even_empty():
    """The bench driver's queue holds a session until its pages fit: every answer says so, the
    last of a burst's too (nothing behind it, yet it still waits for its merged wave)."""
    queue = WaitingSessions(PAGE, holds_for_room=True)
    me = queue.waiter([1] * 8, 10)
    assert queue.queued(me) == Queued(holds_for_room=True)
    queue.add(queue.waiter([1] * 8, 30))
    assert queue.queued(me) == Queued(1, 30, 8, holds_for_room=True)


def test_the_shared_prefix_is_every_waiters_and_within_one_boundary():
    queue = WaitingSessions(PAGE)
    context = list(range(1, 17))  # 4 pages
    for i in range(3):
        queue.add(queue.waiter(context + [100 + i] * 4, 30))
    me = queue.waiter(context + [99] * 4, 20)
    assert queue.queued(me) == Queued(3, 30, 16)
    queue.add(queue.waiter(context[:8] + [5] * 8, 30))  # shares 2 pages only
    assert queue.queued(me) == Queued(4, 30, 8)
    other_tenant = queue.waiter(context + [99] * 4, 20, CacheSalt("tenant-b"))
    assert queue.queued(other_tenant) == Queued(4, 30, 0)
