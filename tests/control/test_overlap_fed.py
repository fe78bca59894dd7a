"""Fed steps (engine/overlap.py, ``DecodeBatch.fed``): with overlap, a steady step launches
before the one in flight is read back, its tokens taken from that step's sampled tokens.
It must change nothing but the timing: the same tokens, published pages and metrics as the
overlap that reads back first and as no overlap, through stop tokens mid-batch, members
joining and leaving, verbs between ticks, and a step that fails while the next is in flight
(no page leaked, no garbage position kept)."""
import dataclasses

import pytest

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import GREEDY, SamplingParams
from forkserve.engine.overlap import StepOverlap
from forkserve.errors import BackendError

MODES = ["off", "read_back", "fed"]


class ReadBackMock(MockBackend):
    """A backend whose launch does not take fed batches: the overlap reads back first."""

    capabilities = dataclasses.replace(MockBackend.capabilities, fed_tokens=False)


@pytest.fixture
def fed_steps(monkeypatch) -> list[int]:
    """How many ticks took the fed path (one entry per tick: the rows launched)."""
    calls: list[int] = []
    original = StepOverlap._advance_fed

    def spy(self, following):
        calls.append(len(following))
        return original(self, following)

    monkeypatch.setattr(StepOverlap, "_advance_fed", spy)
    return calls


def _engine(mode: str, layout=KVLayout.UNIFIED, num_pages=256) -> tuple[Engine, MockBackend]:
    cfg = ForkServeConfig(page_size=4, num_pages=num_pages, num_residual_pages=num_pages,
                          vocab_size=300, kv_layout=layout, shared_prefix_min_tokens=8,
                          steady_decode=True, node_ttl_s=None, overlap=mode != "off")
    backend = (ReadBackMock if mode == "read_back" else MockBackend)(cfg)
    return Engine(backend), backend


def _run(eng: Engine) -> None:
    """Tick to the end without reading the engine between ticks (a read settles the step
    in flight), then check every table against what the steps wrote."""
    while eng.tick():
        pass
    eng.check_integrity()


def _workload(mode: str, layout=KVLayout.UNIFIED, stop: tuple[int, ...] = ()) -> list:
    """Agents of different lengths over one context (members leave as they end), two with
    ``stop`` tokens; mid-way verbs (fork, cancel, close) and a late joiner; then all again."""
    eng, _ = _engine(mode, layout)
    context = [5 + i % 40 for i in range(22)]
    adapters = [None, "a", "b", None, "a", None]
    handles = [eng.open(context + [7, 60 + i], adapter=adapters[i]) for i in range(6)]
    for i, h in enumerate(handles[:5]):
        eng.start_generate(h.id, 9 + 2 * i, stop=stop if i in (1, 4) else ())
    for _ in range(5):
        eng.tick()
    eng.fork(handles[0].id, eng.tip(handles[0].id), "tool", [9, 9, 9])
    eng.cancel_generate(handles[3].id)
    eng.close(handles[2].id)
    eng.start_generate(handles[5].id, 11, stop=stop)  # joins the set after its first step
    for _ in range(3):
        eng.tick()
    eng.tick()
    _run(eng)
    live = [h for h in handles if h.id in eng.sessions]
    for h in live:
        eng.start_generate(h.id, 7, stop=stop)
    _run(eng)
    out = [(eng.committed_tokens(h.id), eng.generation(h.id)) for h in live]
    return [out, eng.published_pages(), eng.cache_stats().base.used, eng.metrics.decode_tokens]


def _stop_token() -> int:
    """A token the free run samples mid-generation (so a stop on it ends rows mid-batch)."""
    eng, _ = _engine("off")
    context = [5 + i % 40 for i in range(22)]
    h = eng.open(context + [7, 61], adapter="a")
    tokens = eng.generate(h.id, 12).tokens
    return next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
def test_fed_steps_decode_what_reading_back_first_decodes(layout, fed_steps):
    stop = (_stop_token(),)
    want = _workload("off", layout, stop)
    assert _workload("read_back", layout, stop) == want
    assert not fed_steps
    got = _workload("fed", layout, stop)
    assert len(fed_steps) >= 8, "overlapped ticks launched fed"
    # Tokens, generations, published pages, pages held and tokens decoded are the same.
    assert got == want


def test_a_stop_mid_batch_discards_that_rows_fed_result_and_keeps_no_position(fed_steps):
    stop = _stop_token()
    outs = []
    for mode in MODES:
        eng, _ = _engine(mode)
        context = [5 + i % 40 for i in range(22)]
        handles = [eng.open(context + [7, 60 + i], adapter="a" if i == 1 else None)
                   for i in range(4)]
        for h in handles:
            eng.start_generate(h.id, 12, stop=(stop,))
        _run(eng)
        gens = [eng.generation(h.id) for h in handles]
        for h in handles:  # every table ends one short of its path: its last token unwritten
            tip = eng.sessions[h.id].tree.tip
            assert tip.table.base.length == tip.end - 1
        outs.append((gens, eng.published_pages(), eng.cache_stats().base.used))
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert outs[0][0][1].finish_reason == "stop"
    assert fed_steps


def test_rows_with_host_sampling_state_are_never_fed(fed_steps):
    class Log:
        def __init__(self):
            self.seen = {}

        def history(self, position):
            return [t for p, t in sorted(self.seen.items()) if p < position]

        def record(self, position, token, logprob, top):
            self.seen[position] = token

        def record_prompt(self, *args):
            pass

    eng, _ = _engine("fed")
    hs = [eng.open([3, 4, 5, 6 + i]) for i in range(3)]
    eng.start_generate(hs[0].id, 10)
    eng.start_generate(hs[1].id, 10, sampling=SamplingParams(logprobs=1, log=Log()))
    eng.start_generate(hs[2].id, 10, sampling=GREEDY)
    _run(eng)
    assert not fed_steps


def test_a_failure_while_the_fed_step_is_in_flight_fails_both_and_leaks_nothing(fed_steps):
    want = {}
    ref, _ = _engine("off")
    rh = [ref.open([3, 4, 5, 6 + i]) for i in range(4)]
    for h in rh:
        want[h.id] = ref.generate(h.id, 14).tokens
    eng, backend = _engine("fed")
    hs = [eng.open([3, 4, 5, 6 + i]) for i in range(4)]
    for h in hs:
        eng.start_generate(h.id, 14)
    for _ in range(5):
        eng.tick()
    assert fed_steps
    bad = hs[2].tip
    # The next step read back (the one in flight) fails for one row, with a fed step behind it.
    backend.fault = lambda item: RuntimeError("device lost") if item.seq_id == bad else None
    before = len(fed_steps)
    eng.tick()
    assert len(fed_steps) == before + 1
    backend.fault = None
    _run(eng)
    assert isinstance(eng.sessions[hs[2].id].error, BackendError)
    assert eng.generation(hs[2].id).finish_reason == "error"
    for h, r in zip(hs, rh, strict=True):
        if h is not hs[2]:
            assert eng.generation(h.id).tokens == want[r.id]
    eng.check_integrity()  # refcounts equal holders: no page of the failed steps leaked
    for h in hs:
        eng.close(h.id, pin=False)
    eng.check_integrity()
    assert eng.cache_stats().base.used == len(eng.published_pages())


def test_a_fed_step_that_fails_after_a_stop_settles_its_rows_and_drops_the_stopped(fed_steps):
    """A stop in the step read back with a fed step in flight, and that fed step failing for
    another row: the stopped row's preparation is undone, the failing row's session fails
    alone, the rest goes on as without overlap."""
    eng, _ = _engine("off")
    free = [eng.generate(eng.open([3, 4, 5, 6 + i]).id, 12).tokens for i in range(4)]
    i = next(k for k, t in enumerate(free[2]) if k >= 3 and t not in free[2][:k])
    stop, bad_pos = free[2][i], 4 + i  # the fed step behind the stop writes position 4 + i
    outs = []
    for mode in MODES:
        eng, backend = _engine(mode)
        hs = [eng.open([3, 4, 5, 6 + k]) for k in range(4)]
        bad = hs[0].tip
        backend.fault = lambda item, bad=bad: (RuntimeError("device lost")
                                               if item.seq_id == bad and item.start_pos == bad_pos
                                               else None)
        for h in hs:
            eng.start_generate(h.id, 12, stop=(stop,) if h is hs[2] else ())
        _run(eng)
        outs.append(([eng.generation(h.id) for h in hs], eng.published_pages(),
                     eng.cache_stats().base.used))
        for h in hs:
            eng.close(h.id, pin=False)
        eng.check_integrity()
    assert outs[0][0][0].finish_reason == "error" and outs[0][0][2].finish_reason == "stop"
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert fed_steps
