"""The steady-decode set (engine/steady.py): sessions in plain decode skip the per-item path
and are stepped as one DecodeBatch, with overlap or without. It must change nothing but the
cost: the same tokens, metrics and pages as the general path, in every layout, through page
boundaries, stop tokens, verbs that arrive mid-generation, a pool too short for a boundary,
and a failing row."""
import pytest

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.capabilities import Capabilities
from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import GREEDY, SamplingParams
from forkserve.backend.step_handle import run_step
from forkserve.config import KVForm
from forkserve.control.sharing import PrefixSharing
from forkserve.errors import BackendError

LAYOUTS = [KVLayout.UNIFIED, KVLayout.DISAGGREGATED, KVLayout.ADAPTIVE, KVLayout.FULL_REUSE]


class CountingMock(MockBackend):
    """Counts the rows that arrived as DecodeBatch columns."""

    rows = 0

    def step_batched(self, work, batch):
        self.rows += len(batch) if batch is not None else 0
        return super().step_batched(work, batch)


def _engine(steady: bool, layout=KVLayout.UNIFIED, num_pages=256,
            **kw) -> tuple[Engine, CountingMock]:
    cfg = ForkServeConfig(page_size=4, num_pages=num_pages, num_residual_pages=num_pages,
                          vocab_size=300, kv_layout=layout, shared_prefix_min_tokens=8,
                          steady_decode=steady, node_ttl_s=None, **kw)
    backend = CountingMock(cfg)
    return Engine(backend), backend


def _workload(eng: Engine) -> list:
    """Agents over one shared context, some with adapters, decoding at once; mid-way one
    forks and commits, one is cancelled, one stops on a token; then all decode again."""
    context = [5 + i % 40 for i in range(22)]
    adapters = [None, "a", "b", None, "a", None]
    handles = [eng.open(context + [7, 60 + i], adapter=adapters[i]) for i in range(6)]
    for i, h in enumerate(handles):
        eng.start_generate(h.id, 9 + i, stop=(77,) if i == 5 else ())
    for _ in range(4):
        eng.tick()
        eng.check_integrity()
    eng.fork(handles[1].id, eng.tip(handles[1].id), "tool", [9, 9, 9])
    eng.cancel_generate(handles[2].id)
    while eng.tick():
        eng.check_integrity()
    eng.commit(handles[1].id, eng.tip(handles[1].id), [9, 9, 9])
    for h in handles:
        warm = SamplingParams(temperature=0.7, seed=3)
        eng.start_generate(h.id, 6, sampling=warm if h is handles[3] else GREEDY)
    while eng.tick():
        eng.check_integrity()
    return [(eng.committed_tokens(h.id), eng.generation(h.id)) for h in handles]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_steady_set_gives_what_the_general_path_gives(layout, overlap):
    general, _ = _engine(False, layout)
    steady, backend = _engine(True, layout, overlap=overlap)
    assert _workload(steady) == _workload(general)
    assert backend.rows > 40, "most decode steps ran as DecodeBatch rows"
    for name in ("decode_tokens", "prefill_tokens", "ticks", "peak_pages", "failed_items"):
        assert getattr(steady.metrics, name) == getattr(general.metrics, name), name
    assert [s.peak_tokens for s in steady.sessions.values()] == \
        [s.peak_tokens for s in general.sessions.values()]
    assert steady.published_pages() == general.published_pages()


def _stop_run(steady: bool, overlap: bool, stop: tuple[int, ...]) -> tuple[list, object]:
    """Four agents decode 12 tokens each; the third stops on ``stop``. Nothing reads the
    engine between ticks (a read settles the step in flight): with overlap, each tick after
    the first reads back the step the one before launched."""
    eng, _ = _engine(steady, overlap=overlap)
    context = [5 + i % 40 for i in range(22)]
    handles = [eng.open(context + [7, 60 + i]) for i in range(4)]
    for h in handles:
        eng.start_generate(h.id, 12, stop=stop if h is handles[2] else ())
    while eng.tick():
        pass
    eng.check_integrity()
    return [eng.generation(h.id) for h in handles], eng.published_pages()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_sampled_while_the_members_stay_ends_that_generation_alone(overlap):
    # With overlap, the step read back is the rows launched, row for row, when no member
    # left or joined since (StepOverlap.advance): the stop is found among them, taken back
    # out of the step already prepared, and the others go on.
    free, _ = _stop_run(False, False, ())
    tokens = free[2].tokens
    stop = next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    expected = _stop_run(False, False, (stop,))
    assert expected[0][2].finish_reason == "stop" and len(expected[0][2].tokens) < 12
    assert _stop_run(True, overlap, (stop,)) == expected


@pytest.mark.parametrize("overlap", [False, True])
def test_a_boundary_the_pool_cannot_serve_goes_back_to_the_general_path(overlap):
    """Every page is taken but the index's: the boundary needs make_room (evict), which only
    the general path does; the result is the same as with the set off."""
    outs = []
    for flag in (False, True):
        eng, _ = _engine(flag, num_pages=24, overlap=overlap and flag)
        first = eng.open(list(range(10, 42)))          # 8 pages, published then closed
        eng.generate(first.id, 1)
        eng.close(first.id)
        hs = [eng.open([100 + i, 1, 2, 3, 4, 5]) for i in range(4)]
        for h in hs:
            eng.start_generate(h.id, 12)
        while eng.tick():
            eng.check_integrity()
        outs.append([eng.generation(h.id) for h in hs])
        assert eng.cache_stats().base.used <= 24
    assert outs[0] == outs[1]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_row_fails_its_session_alone_and_leaves_the_set(overlap):
    eng, backend = _engine(True, overlap=overlap)
    hs = [eng.open([3, 4, 5, 6 + i]) for i in range(4)]
    for h in hs:
        eng.start_generate(h.id, 10)
    eng.tick()
    eng.tick()
    assert len(eng.stepper.steady) == 4
    bad = hs[2].tip
    backend.fault = lambda item: RuntimeError("device lost") if item.seq_id == bad else None
    while eng.tick():
        eng.check_integrity()
    assert isinstance(eng.sessions[hs[2].id].error, BackendError)
    assert eng.generation(hs[2].id).finish_reason == "error"
    good = [eng.generation(h.id) for h in hs if h is not hs[2]]
    assert all(g.finish_reason == "length" and len(g.tokens) == 10 for g in good)
    # The others match a run where the bad session never existed.
    clean, _ = _engine(True)
    ref = [clean.open([3, 4, 5, 6 + i]) for i in (0, 1, 3)]
    assert [clean.generate(h.id, 10).tokens for h in ref] == [g.tokens for g in good]
    # The failed session retries on its next verb, from where its KV is whole.
    backend.fault = None
    assert len(eng.generate(hs[2].id, 3).tokens) == 3
    eng.check_integrity()


def test_a_verb_takes_the_session_out_of_the_set():
    eng, _ = _engine(True)
    h = eng.open([3, 4, 5, 6])
    eng.start_generate(h.id, 20)
    eng.tick()
    assert h.id in eng.stepper.steady
    eng.fork(h.id, eng.tip(h.id), "branch", [1, 2])
    assert h.id not in eng.stepper.steady
    eng.tick()  # a session with a speculative branch stays on the general path
    assert h.id not in eng.stepper.steady


def test_a_backend_without_step_batched_gets_the_rows_as_items():
    """``run_step``'s fallback is the same step: the mock's column path and its item path
    sample the same tokens for the same rows."""
    cfg = ForkServeConfig(page_size=4, num_pages=16, vocab_size=300)
    columns, items = MockBackend(cfg), MockBackend(cfg)
    for backend in (columns, items):
        backend.step_batched([], DecodeBatch((1,), (9,), (0,), ((0,),), (None,), (KVForm.MERGED,),
                                             (None,), (1,), (GREEDY,), (None,)))
    batch = DecodeBatch((1, 2), (5, 6), (1, 0), ((0,), (1,)), (None, None),
                        (KVForm.MERGED, KVForm.MERGED), (None, None), (2, 1), (GREEDY, GREEDY),
                        (None, None))

    class ItemsOnly:  # the protocol's step, nothing more
        config = cfg
        capabilities = Capabilities()

        def step(self, work):
            return items.step(work)

    expected = columns.step_batched([], batch).next_tokens
    assert run_step(ItemsOnly(), [], batch).next_tokens == expected


class GroupCheckingMock(MockBackend):
    """Asserts that every step's cascade groups are what ``PrefixSharing`` computes afresh
    over the step's rows: the set keeps its groups across page boundaries (steady.py)."""

    checked = 0

    def step_batched(self, work, batch):
        if batch is not None:
            sharing = PrefixSharing(self.config.page_size, self.config.shared_prefix_min_tokens)
            rows = [(w.slots.pages, w.start_pos) for w in work]
            rows += list(zip(batch.pages, batch.positions, strict=True))
            got = [w.shared_prefix for w in work] + list(batch.shared_prefix)
            assert got == sharing.marks(rows)
            self.checked += 1
        return super().step_batched(work, batch)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_groups_kept_across_boundaries_are_the_groups_recomputed(layout, overlap):
    cfg = ForkServeConfig(page_size=4, num_pages=256, num_residual_pages=256, vocab_size=300,
                          kv_layout=layout, shared_prefix_min_tokens=8, node_ttl_s=None,
                          overlap=overlap)
    backend = GroupCheckingMock(cfg)
    _workload(Engine(backend))
    assert backend.checked > 10
