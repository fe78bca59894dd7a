"""A model of residual_prefill_wide.py's barrier protocol, run under random interleavings.

Gluon has no interpreter, so the kernel's hand-off between its four roles (the loader warp,
the rebuilding warp group, two consumer warp groups) cannot run on the CPU; a hang or a
slot read before it lands costs a GPU call. This model replays the same waits and arrivals
(mbarrier phase-parity semantics: a wait on parity ``p`` passes once the barrier's phase bit
is no longer ``p``, so a fresh barrier passes a wait on 1) with TMA copies landing in any
order, and checks at every read that the slot holds the tile it should (the key rebuilt
where the row has an adapter), that no copy overwrites what a role still reads, and that
every run ends. Change it with the kernel's protocol.

Round 29 found with it that the rebuilding warp group, waiting on a slot's values only at a
split's last tile (to zero its stale rows), could pass on the parity of a phase two tiles
old: it now waits on every tile's values (``test_waiting_on_the_last_values_alone_aliases``
keeps that reading).

``key_slots = 3`` (round 39) is the deep key ring: three key slots beside two of values, the
cos|sin read by the rebuild from global memory (no buffers, no barriers of their own), the
loader issuing a tile's keys before the values of the tile before, the rebuild handing over
keys alone (``keyed``) and never waiting on values but the last tile's, which land on a
barrier of their own (``last_v``, one phase a program, so no wait on it can alias); it
zeroes their stale rows and says so (``zeroed``). The consumers wait on every other tile's
values themselves, in order.

``thread_arrive`` (round 30) releases a buffer by every thread's arrival, the barrier
counting threads: here a warp group's release is ``threads`` arrivals with other roles (and
landing copies) free to run between them."""
from __future__ import annotations

import random
from collections.abc import Generator

import pytest

VALUE_SLOTS, HALVES = 2, 2  # residual_prefill_wide.SLOTS; 128-key tiles of two cos|sin halves


class Barrier:
    """An mbarrier: ``count`` arrivals complete a phase and flip its bit."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.phase ^= 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:
        return self.phase != parity


class Program:
    """One program's roles as generators (each ``yield`` a point where another role or a
    landing copy may run), over ``n_tiles`` tiles; ``last_values_only``: the protocol
    before round 29, the rebuilding group waiting on the values at the last tile alone and
    each consumer on every tile's before its value products; ``pingpong``: the consumers'
    score products in turns (``WideLaunch.pingpong``); ``overlap``: one consumer, the next
    tile's scores read from before this tile's softmax until its end (``overlap``);
    ``threads``: the arrivals a warp group's release makes (``thread_arrive``: one a
    thread); ``key_slots``: 2, or 3 for the deep key ring (``WideLaunch.key_slots``)."""

    def __init__(self, n_tiles: int, has_res: bool, last_values_only: bool = False,
                 pingpong: bool = False, overlap: bool = False, threads: int = 1,
                 key_slots: int = 2) -> None:
        self.n, self.has_res, self.last_values_only = n_tiles, has_res, last_values_only
        self.ks, self.deep = key_slots, key_slots == 3
        self.consumers = 1 if overlap else 2
        self.overlap, self.threads = overlap, threads
        self.pingpong, self.turn = pingpong, [Barrier(threads), Barrier(threads)]
        self.scoring: list[int] = []  # the consumers that issued a tile's scores, in order
        self.full_k = [Barrier(1) for _ in range(self.ks)]
        self.full_v = [Barrier(1) for _ in range(VALUE_SLOTS)]
        # The key handed over: with its values (``ready``) or, deep, alone (``keyed``).
        self.ready = [Barrier(1) for _ in range(self.ks)]
        self.empty_k = [Barrier(self.consumers * threads) for _ in range(self.ks)]
        self.empty_v = [Barrier(self.consumers * threads) for _ in range(VALUE_SLOTS)]
        self.cs_full = [Barrier(1) for _ in range(HALVES)]
        self.cs_free = [Barrier(threads) for _ in range(HALVES)]
        self.last_v, self.zeroed = Barrier(1), Barrier(1)
        self.started = Barrier(self.consumers + 1)
        self.keys: list = [None] * self.ks  # (tile, rebuilt)
        self.values: list = [None] * VALUE_SLOTS  # tile, or (tile, "zeroed")
        self.cos_sin: list = [None] * HALVES
        self.readers: dict = {("k", s): set() for s in range(self.ks)} | {
            ("v", s): set() for s in range(VALUE_SLOTS)}
        self.copies: list = []  # TMA copies in flight: each lands as one call

    @staticmethod
    def wait(bar: Barrier, parity: int) -> Generator:
        while not bar.passed(parity):
            yield

    def release(self, bar: Barrier) -> Generator:
        """A warp group's release of what ``bar`` guards (``residual_prefill_wide._release``)."""
        for t in range(self.threads):
            if t:
                yield
            bar.arrive()

    def copy(self, store: list, index: int, value, bar: Barrier) -> None:
        store[index] = None  # in flight: nothing there to read

        def land() -> None:
            store[index] = value
            bar.arrive()
        self.copies.append(land)

    def loader(self) -> Generator:
        self.started.arrive()
        if self.deep:
            if self.n > 0:
                yield from self.load_keys(0)
            for i in range(self.n):
                if i + 1 < self.n:  # the next tile's keys before this one's values
                    yield from self.load_keys(i + 1)
                yield from self.load_values(i, self.last_v if i == self.n - 1 else None)
            return
        for i in range(self.n):
            yield from self.load_keys(i)
            if self.has_res:
                for h in range(HALVES):
                    yield from self.wait(self.cs_free[h], (i & 1) ^ 1)
                    self.copy(self.cos_sin, h, i, self.cs_full[h])
            yield from self.load_values(i)

    def load_keys(self, i: int) -> Generator:
        s = i % self.ks
        yield from self.wait(self.empty_k[s], ((i // self.ks) & 1) ^ 1)
        assert not self.readers["k", s], f"tile {i}'s keys over keys still read"
        self.copy(self.keys, s, (i, False), self.full_k[s])

    def load_values(self, i: int, bar: Barrier | None = None) -> Generator:
        s = i % VALUE_SLOTS
        yield from self.wait(self.empty_v[s], ((i // VALUE_SLOTS) & 1) ^ 1)
        assert not self.readers["v", s], f"tile {i}'s values over values still read"
        self.copy(self.values, s, i, self.full_v[s] if bar is None else bar)

    def rebuild(self) -> Generator:
        if self.n > 0:
            yield from self.wait(self.started, 0)
        for i in range(self.n):
            s, sv = i % self.ks, i % VALUE_SLOTS
            yield from self.wait(self.full_k[s], (i // self.ks) & 1)
            assert self.keys[s] == (i, False), f"rebuilt tile {i} from {self.keys[s]}"
            if self.has_res:
                for h in range(HALVES if not self.deep else 0):
                    yield from self.wait(self.cs_full[h], i & 1)
                    assert self.cos_sin[h] == i, f"tile {i} rotated by {self.cos_sin[h]}"
                    yield
                    yield from self.release(self.cs_free[h])
                yield  # the rebuild (deep: its cos|sin from global memory)
                self.keys[s] = (i, True)
            if self.deep:
                self.ready[s].arrive()
                if i == self.n - 1:
                    yield from self.wait(self.last_v, 0)
                    assert self.values[sv] == i, f"tile {i} zeroed {self.values[sv]}'s values"
                    self.values[sv] = (i, "zeroed")
                    self.zeroed.arrive()
                continue
            if not self.last_values_only or i == self.n - 1:
                yield from self.wait(self.full_v[s], (i // VALUE_SLOTS) & 1)
                assert self.values[s] == i, f"tile {i} zeroed {self.values[s]}'s values"
            self.ready[s].arrive()

    def values_of(self, i: int) -> Generator:
        """Deep: the consumer's own wait on tile ``i``'s values, the last tile's once
        zeroed; then (any ring) the check that the slot holds them."""
        sv = i % VALUE_SLOTS
        if self.deep and i == self.n - 1:
            yield from self.wait(self.zeroed, 0)
            assert self.values[sv] == (i, "zeroed"), f"tile {i} unzeroed: {self.values[sv]}"
            return
        if self.deep:
            yield from self.wait(self.full_v[sv], (i // VALUE_SLOTS) & 1)
        assert self.values[sv] == i, f"tile {i}'s products on {self.values[sv]}'s values"

    def consumer(self, w: int) -> Generator:
        if self.overlap:
            yield from self.overlapped_consumer()
            return
        self.started.arrive()
        if self.n > 0:
            yield from self.wait(self.ready[0], 0)
        for i in range(self.n):
            s, sv = i % self.ks, i % VALUE_SLOTS
            yield from self.wait(self.ready[s], (i // self.ks) & 1)
            assert self.keys[s] == (i, self.has_res), f"scored tile {i} on {self.keys[s]}"
            if self.pingpong:
                yield from self.wait(self.turn[w], (i & 1) ^ (1 - w))
            self.scoring.append(w)
            if self.pingpong:
                yield from self.release(self.turn[1 - w])
            yield from self.reading(("k", s), w)
            yield from self.release(self.empty_k[s])
            yield  # the softmax
            if self.last_values_only:  # then the consumers waited on the values themselves
                yield from self.wait(self.full_v[sv], (i // VALUE_SLOTS) & 1)
            yield from self.values_of(i)
            yield from self.reading(("v", sv), w)
            yield from self.release(self.empty_v[sv])

    def overlapped_consumer(self) -> Generator:
        """The one consumer with ``overlap``: tile ``i + 1``'s keys read (its score products
        in flight) from before tile ``i``'s softmax to that tile's end."""
        self.started.arrive()
        if self.n > 0:
            yield from self.wait(self.ready[0], 0)
            assert self.keys[0] == (0, self.has_res), f"scored tile 0 on {self.keys[0]}"
        for i in range(self.n):
            s, nxt, sv = i % self.ks, (i + 1) % self.ks, i % VALUE_SLOTS
            yield from self.release(self.empty_k[s])
            if i + 1 < self.n:
                yield from self.wait(self.ready[nxt], ((i + 1) // self.ks) & 1)
                assert self.keys[nxt] == (i + 1, self.has_res), \
                    f"scored tile {i + 1} on {self.keys[nxt]}"
                self.readers["k", nxt].add(0)
            yield  # the softmax, the next scores in flight
            yield from self.values_of(i)
            yield from self.reading(("v", sv), 0)
            self.readers["k", nxt].discard(0)
            yield from self.release(self.empty_v[sv])

    def reading(self, what: tuple, w: int) -> Generator:
        self.readers[what].add(w)
        yield
        self.readers[what].discard(w)

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        roles = {"loader": self.loader(), "rebuild": self.rebuild()}
        roles |= {f"consumer{w}": self.consumer(w) for w in range(self.consumers)}
        for _ in range(100_000):
            if not roles and not self.copies:
                return
            if self.copies and (not roles or rng.random() < 0.3):
                self.copies.pop(rng.randrange(len(self.copies)))()
                continue
            name = rng.choice(sorted(roles))
            try:
                next(roles[name])
            except StopIteration:
                del roles[name]
        raise AssertionError(f"no progress: {sorted(roles)} wait forever")


# A release by one arrival, or by a thread's each (``thread_arrive``; three model the count).
THREADS = pytest.mark.parametrize("threads", [1, 3])


@THREADS
@pytest.mark.parametrize("has_res", [True, False])
@pytest.mark.parametrize("n_tiles", [0, 1, 2, 3, 4, 7])
def test_the_protocol_hands_every_tile_over_in_order(n_tiles: int, has_res: bool,
                                                     threads: int) -> None:
    for seed in range(200):
        Program(n_tiles, has_res, threads=threads).run(seed)


@THREADS
@pytest.mark.parametrize("has_res", [True, False])
@pytest.mark.parametrize("n_tiles", [1, 2, 5])
def test_the_consumers_take_turns_at_their_scores(n_tiles: int, has_res: bool,
                                                  threads: int) -> None:
    """With ``pingpong`` the score products alternate, consumer 0 first, every run ending."""
    for seed in range(200):
        program = Program(n_tiles, has_res, pingpong=True, threads=threads)
        program.run(seed)
        assert program.scoring == [0, 1] * n_tiles


@THREADS
@pytest.mark.parametrize("has_res", [True, False])
@pytest.mark.parametrize("n_tiles", [0, 1, 2, 3, 6])
def test_one_consumer_scoring_a_tile_ahead(n_tiles: int, has_res: bool, threads: int) -> None:
    """``overlap``: the next tile's keys are read while they are held (not released until
    that tile's turn), every run ending."""
    for seed in range(200):
        Program(n_tiles, has_res, overlap=True, threads=threads).run(seed)


def test_a_release_short_of_its_count_hangs() -> None:
    """The counts follow the releases: a warp group arriving once where the barrier counts
    its threads leaves the loader waiting (the model's hang, not a pass)."""
    program = Program(3, True, threads=3)
    program.release = lambda bar: (bar.arrive() for _ in range(1))
    with pytest.raises(AssertionError, match="wait forever"):
        program.run(0)


def test_waiting_on_the_last_values_alone_aliases() -> None:
    """The model catches the protocol round 29 fixed: some interleaving zeroes a slot's
    values (or hands them over) before they land."""
    with pytest.raises(AssertionError, match="zeroed"):
        for seed in range(2000):
            Program(3, False, last_values_only=True).run(seed)


@THREADS
@pytest.mark.parametrize("has_res", [True, False])
@pytest.mark.parametrize("n_tiles", [0, 1, 2, 3, 4, 7])
@pytest.mark.parametrize("form", ["two", "pingpong", "overlap"])
def test_the_deep_key_ring_hands_every_tile_over_in_order(n_tiles: int, has_res: bool,
                                                          threads: int, form: str) -> None:
    """``key_slots = 3``: keys a tile ahead of values, the values waited on by the consumers,
    the last tile's zeroed by the rebuild first; every run ending."""
    for seed in range(200):
        program = Program(n_tiles, has_res, pingpong=form == "pingpong",
                          overlap=form == "overlap", threads=threads, key_slots=3)
        program.run(seed)
        if form == "pingpong":
            assert program.scoring == [0, 1] * n_tiles


def test_the_deep_ring_without_its_last_value_barrier_aliases() -> None:
    """Why the last tile's values land on a barrier of their own: on their slot's, the
    rebuild's one wait there (it waits on no other tile's values) may pass on the parity of
    a phase two tiles old, and zero values that have not landed."""
    class OnItsSlot(Program):
        def load_values(self, i: int, bar: Barrier | None = None) -> Generator:
            yield from super().load_values(i)

        def wait(self, bar: Barrier, parity: int) -> Generator:
            if bar is self.last_v:
                sv = (self.n - 1) % VALUE_SLOTS
                bar, parity = self.full_v[sv], ((self.n - 1) // VALUE_SLOTS) & 1
            yield from Program.wait(bar, parity)

    with pytest.raises(AssertionError, match="zeroed"):
        for seed in range(2000):
            OnItsSlot(3, True, key_slots=3).run(seed)
