"""Activated LoRA in the control plane (MockBackend, every layout): pages before the
invocation are base pages shared with the base model and other aLoRAs; the activation
point follows the last occurrence, and K/V written under an older point is recomputed."""
import pytest

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.control.activation import Invocation
from forkserve.errors import InvalidRequestError

P = 4
INVOCATIONS = {"a": (250, 251), "b": (252,)}
# Config overrides per layout; the adaptive layout both merged (plenty of room) and split
# (a high-water mark of 0 splits every adapter's session).
LAYOUTS = [pytest.param({"kv_layout": layout}, id=layout.value) for layout in KVLayout] + [
    pytest.param({"kv_layout": KVLayout.ADAPTIVE, "adaptive_high_water": 0.0}, id="adaptive-split")]


def _engine(layout: dict) -> Engine:
    cfg = ForkServeConfig(page_size=P, num_pages=256, num_residual_pages=256, vocab_size=300,
                          node_ttl_s=None, **layout)
    return Engine(MockBackend(cfg, invocations=INVOCATIONS))


def _assert_kv_is_the_path(eng: Engine, sid: int) -> None:
    """Every stored slot is the base model's before the activation point, the adapter's after."""
    session = eng.sessions[sid]
    node = session.tree.tip
    path = session.tree.path_tokens(node)
    start = eng.kv.adapter_start(node.table, node.adapter)
    for table in node.table.tables():
        want = eng.backend.expected_values(table.pool.kind, path[:table.length], node.adapter,
                                           eng.kv.form_of(node.table, node.adapter),
                                           adapter_start=len(path) if start is None else start)
        assert (eng.backend.kv_values(table.pool.kind, table.pages, table.length) == want).all()


def _fresh_run(layout, path, adapter, n):
    eng = _engine(layout)
    h = eng.open(path, adapter=adapter)
    return eng.generate(h.id, n).tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alora_prompt_hits_base_pages_and_matches_a_run_without_sharing(layout):
    eng = _engine(layout)
    context = list(range(10, 34))  # 6 full pages
    h = eng.open(context)
    eng.generate(h.id, 3)
    eng.close(h.id)
    outs = {}
    for adapter, ask in (("a", [40, 250, 251, 41]), ("b", [42, 43, 252, 44, 45])):
        before = eng.metrics.base_hit_tokens
        s = eng.open(context + ask, adapter=adapter)
        assert eng.metrics.base_hit_tokens - before == len(context)
        outs[adapter] = eng.generate(s.id, 5).tokens
        _assert_kv_is_the_path(eng, s.id)
        eng.check_integrity()
        assert outs[adapter] == _fresh_run(layout, context + ask, adapter, 5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_invocation_is_the_base_model(layout):
    eng = _engine(layout)
    path = list(range(10, 27))
    base = eng.generate(eng.open(path).id, 4).tokens
    s = eng.open(path, adapter="a")
    assert eng.generate(s.id, 4).tokens == base
    _assert_kv_is_the_path(eng, s.id)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_later_invocation_moves_the_activation_point(layout):
    """A commit that repeats the invocation (and one that completes it across the commit
    boundary) makes K/V after the old point stale: the result equals a fresh run."""
    eng = _engine(layout)
    path = list(range(10, 20)) + [250, 251] + list(range(20, 29))
    s = eng.open(path, adapter="a")
    eng.generate(s.id, 2)
    starts = []
    for tokens, n in (([30, 31, 250, 251, 32], 3), ([33, 250], 0), ([251, 34, 35], 3)):
        eng.commit(s.id, eng.tip(s.id), tokens)
        out = eng.generate(s.id, n).tokens
        committed = eng.committed_tokens(s.id)
        starts.append(eng.sessions[s.id].tree.tip.table.adapter_start)
        assert starts[-1] == Invocation(INVOCATIONS["a"]).last_start(committed, 0)
        _assert_kv_is_the_path(eng, s.id)
        eng.check_integrity()
        if n:
            assert out == _fresh_run(layout, committed[:-n], "a", n)
    # Moved by the first commit, kept by the second, moved across the boundary by the third
    # (onto a token whose K/V was already written as the base model's).
    assert 10 < starts[0] == starts[1] < starts[2]


def test_prefill_shared_refuses_an_alora():
    eng = _engine({"kv_layout": KVLayout.DISAGGREGATED})
    with pytest.raises(InvalidRequestError, match="activated LoRA"):
        eng.prefill_shared(list(range(10, 30)), ["a"])
    assert eng.pool.num_used == 0


@pytest.mark.parametrize("layout", [
    pytest.param({"kv_layout": KVLayout.DISAGGREGATED}, id="disaggregated"),
    pytest.param({"kv_layout": KVLayout.ADAPTIVE, "adaptive_high_water": 0.0},
                 id="adaptive-split")])
def test_alora_residual_pages_round_trip_through_the_host_tier(layout):
    """The residual index's offload/restore works over a path that crosses from BASE-keyed
    (zero residual) pages into the aLoRA's namespace: a re-open restores them, same output."""
    eng = _engine({**layout, "host_residual_pages": 64})
    path = list(range(10, 34)) + [250, 251] + list(range(40, 58))
    s = eng.open(path, adapter="a")
    first = eng.generate(s.id, 5).tokens
    eng.close(s.id)
    namespaces = {type(e.namespace).__name__ for e in eng.residual_index.entries()}
    assert namespaces == {"BaseNamespace", "AdapterNamespace"}
    parked = eng.residual_index.num_pages
    eng.residual_index.evict()
    assert eng.residual_index.num_offloaded == parked and eng.residual_index.num_pages == 0
    s = eng.open(path, adapter="a")
    # at least all but the page kept to sample from
    assert eng.metrics.restored_pages >= len(path) // P - 1
    assert eng.generate(s.id, 5).tokens == first
    _assert_kv_is_the_path(eng, s.id)
    eng.check_integrity()


class _Counting(MockBackend):
    """Counts the decode rows that came as the steady set's columns."""

    steady_rows = 0

    def launch(self, work, batch):
        self.steady_rows += 0 if batch is None else len(batch)
        return super().launch(work, batch)


@pytest.mark.parametrize("at", [0, 10], ids=["first-token", "mid-generation"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("layout", LAYOUTS[:2])
def test_an_invocation_generated_in_steady_decode_moves_the_point(layout, overlap, at):
    """An aLoRA decodes in the steady set (and with overlap, launched ahead) until it samples
    a token that may end its invocation: it leaves (or, sampled by the prompt's step, never
    joins), the general path moves the point and recomputes, and it joins again. Every token
    is what a fresh run over its path samples."""
    prompt, n = list(range(10, 27)), 24
    cfg = ForkServeConfig(page_size=P, num_pages=256, num_residual_pages=256, vocab_size=300,
                          node_ttl_s=None, overlap=overlap, **layout)
    plain = Engine(MockBackend(cfg))
    base = list(plain.generate(plain.open(prompt).id, n).tokens)
    # Not invoked by the prompt: the base model's tokens until the pair that ends at ``at``.
    invocations = {"c": tuple((prompt + base)[len(prompt) + at - 1:len(prompt) + at + 1])}
    eng = Engine(_Counting(cfg, invocations=invocations))
    s = eng.open(prompt, adapter="c")
    out = list(eng.generate(s.id, n).tokens)
    assert out[:at + 1] == base[:at + 1] and out != base
    path = eng.committed_tokens(s.id)
    assert eng.sessions[s.id].tree.tip.table.adapter_start == Invocation(
        invocations["c"]).last_start(path, 0) >= len(prompt) - 1
    _assert_kv_is_the_path(eng, s.id)
    eng.check_integrity()
    assert eng.backend.steady_rows >= n - 6  # all but the steps around each join
    for i in range(n):
        fresh = Engine(MockBackend(cfg, invocations=invocations))
        assert fresh.generate(fresh.open(prompt + out[:i], adapter="c").id, 1).tokens == (out[i],)
