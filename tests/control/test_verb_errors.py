"""Bad input raises a typed, clear error and leaves the engine exactly as it was."""
import copy

import pytest

from forkserve import Engine, ForkServeConfig
from forkserve.backend.mock import MockBackend
from forkserve.errors import (
    BranchCapError,
    CapacityError,
    ContextLengthError,
    ForkServeError,
    InvalidRequestError,
    InvalidStateError,
    UnknownNodeError,
    UnknownSessionError,
)


def _state(engine):
    """Everything observable: pool refcounts, free list, index, per-session trees."""
    sessions = {sid: (s.tree.tip.id, list(s.tree.committed),
                      sorted((n.id, n.state.value, n.kv_len, tuple(n.tokens))
                             for n in s.tree.nodes.values()))
                for sid, s in engine.sessions.items()}
    return (list(engine.pool._refs), sorted(engine.pool._free), engine.index.num_pages,
            copy.deepcopy(engine.metrics.snapshot()), sessions)


@pytest.fixture
def setup():
    # 18 pages of 16 tokens: a 300-token sequence can never fit, whatever is evicted.
    eng = Engine(MockBackend(ForkServeConfig(branch_cap=2, vocab_size=300, max_context=512,
                                             num_pages=18)))
    h = eng.open(list(range(10, 40)))
    a = eng.fork(h.id, h.tip, "a", [5, 6, 7])
    eng.speculate(h.id, a)
    eng.drain_slack()
    return eng, h, a


CASES = {
    "unknown session": (lambda e, h, a: e.fork(999, h.tip, "x", [1]), UnknownSessionError,
                        "unknown session 999"),
    "unknown node": (lambda e, h, a: e.fork(h.id, 12345, "x", [1]), UnknownNodeError,
                     "no node 12345"),
    "empty tokens": (lambda e, h, a: e.fork(h.id, h.tip, "x", []), InvalidRequestError, "empty"),
    "empty open": (lambda e, h, a: e.open([]), InvalidRequestError, "empty"),
    "out of vocab": (lambda e, h, a: e.commit(h.id, h.tip, [1, 300]), InvalidRequestError,
                     "vocabulary"),
    "negative token": (lambda e, h, a: e.open([1, -2]), InvalidRequestError, "vocabulary"),
    "negative budget": (lambda e, h, a: e.generate(h.id, -1), InvalidRequestError, "max_tokens"),
    "negative idle": (lambda e, h, a: e.speculate(h.id, e.fork(h.id, h.tip, "y", [1]),
                                                  t_idle_ms=-5),
                      InvalidRequestError, "t_idle_ms"),
    "bad priority": (lambda e, h, a: e.speculate(h.id, a, priority=1.5), InvalidRequestError,
                     "priority"),
    "too long": (lambda e, h, a: e.generate(h.id, 10_000), ContextLengthError,
                 "context window of 512"),
    "open too long": (lambda e, h, a: e.open([1] * 513), ContextLengthError, "context window"),
    "commit too long": (lambda e, h, a: e.commit(h.id, h.tip, [1] * 500), ContextLengthError,
                        "context"),
    "never fits the pool": (lambda e, h, a: e.open([1] * 300), CapacityError,
                            "needs 19 unified pages"),
    "fractional budget": (lambda e, h, a: e.generate(h.id, 2.5), InvalidRequestError, "integer"),
    "no budget": (lambda e, h, a: e.generate(h.id, None), InvalidRequestError, "integer"),
    "bool budget": (lambda e, h, a: e.generate(h.id, True), InvalidRequestError, "integer"),
    "open None": (lambda e, h, a: e.open(None), InvalidRequestError, "sequence of token ids"),
    "bool token": (lambda e, h, a: e.open([1, True]), InvalidRequestError, "not a token id"),
    "float token": (lambda e, h, a: e.open([1, 2.0]), InvalidRequestError, "not a token id"),
    "string tokens": (lambda e, h, a: e.open("abc"), InvalidRequestError, "sequence of token ids"),
    "bool adapter": (lambda e, h, a: e.open([1], adapter=True), InvalidRequestError, "adapter"),
    "bad stop": (lambda e, h, a: e.generate(h.id, 2, stop=[1.5]), InvalidRequestError,
                 "not a token id"),
    "commit speculative": (lambda e, h, a: e.commit(h.id, a, [1]), InvalidStateError,
                           "speculative"),
    "speculate twice": (lambda e, h, a: e.speculate(h.id, a), InvalidStateError,
                        "already speculated"),
    "abort committed": (lambda e, h, a: e.abort(h.id, h.tip), InvalidStateError, "committed"),
    "join nothing": (lambda e, h, a: e.join(h.id, []), InvalidRequestError, "at least one"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_rejected_without_side_effects(setup, name):
    eng, h, a = setup
    call, exc, text = CASES[name]
    if name == "negative idle":
        # The fork itself is valid; the speculate on it must change nothing further.
        node = eng.fork(h.id, h.tip, "y", [1])
        before = _state(eng)
        with pytest.raises(exc, match=text):
            eng.speculate(h.id, node, t_idle_ms=-5)
    else:
        before = _state(eng)
        with pytest.raises(exc, match=text):
            call(eng, h, a)
    assert _state(eng) == before
    eng.check_integrity()


def test_commit_of_aborted_node_and_double_commit(setup):
    eng, h, a = setup
    eng.abort(h.id, a)
    before = _state(eng)
    with pytest.raises(InvalidStateError, match="aborted"):
        eng.commit(h.id, a, [1])
    with pytest.raises(InvalidStateError, match="aborted"):
        eng.abort(h.id, a)
    assert _state(eng) == before
    eng.commit(h.id, h.tip, [1, 2])
    before = _state(eng)
    with pytest.raises(InvalidStateError, match="already committed past"):
        eng.commit(h.id, h.tip, [1, 2])  # h.tip is the old tip now
    assert _state(eng) == before


def test_fork_past_the_branch_cap(setup):
    eng, h, a = setup
    eng.fork(h.id, h.tip, "b", [8])
    before = _state(eng)
    with pytest.raises(BranchCapError, match="branch_cap"):
        eng.fork(h.id, h.tip, "c", [9])
    assert _state(eng) == before


def test_errors_carry_http_status():
    assert UnknownSessionError("x").http_status == 404
    assert InvalidStateError("x").http_status == 409
    assert (issubclass(InvalidRequestError, ForkServeError)
            and InvalidRequestError.http_status == 400)
    assert str(UnknownSessionError("unknown session 3")) == "unknown session 3"


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="page_size"):
        ForkServeConfig(page_size=0)
    with pytest.raises(ValueError, match="tau"):
        ForkServeConfig(tau=1.5)
    with pytest.raises(ValueError):
        ForkServeConfig(admit_mode="bogus")


def test_numpy_token_ids_are_token_ids():
    import numpy as np

    eng = Engine(MockBackend(ForkServeConfig(vocab_size=300)))
    h = eng.open(np.arange(10, 20, dtype=np.int64))
    ref = Engine(MockBackend(ForkServeConfig(vocab_size=300)))
    r = ref.open(list(range(10, 20)))
    assert eng.generate(h.id, np.int32(3)).tokens == ref.generate(r.id, 3).tokens
