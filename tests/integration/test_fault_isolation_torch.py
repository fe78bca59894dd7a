"""Failure isolation on the real engine (tiny Llama, CPU): the report's scenario, and a small
fault-injection budget (``benchmarks/fault_bench.py`` runs hundreds)."""
import pytest
import torch
import torch_faults

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.errors import ContextLengthError, UnknownAdapterError


def test_an_over_long_request_is_refused_and_the_good_session_stays_exact(model_dir):
    from forkserve.backend.torch import TorchBackend

    path, adapters = model_dir
    make = lambda: TorchBackend(ForkServeConfig(page_size=4, num_pages=1024), path, adapters,  # noqa: E731
                                device="cpu", dtype=torch.float32, attention="eager",
                                use_cuda_graphs=False)
    backend = make()
    backend.track_writes()
    eng = Engine(backend)
    assert eng.config.max_context == 256  # the loaded model's window, not the config default
    good = eng.open([5, 6, 7, 8, 40, 41, 42, 43, 44])
    eng.generate(good.id, 3)
    with pytest.raises(ContextLengthError, match="context window of 256"):
        eng.open([9] * 1100)
    eng.commit(good.id, eng.tip(good.id), [10, 11, 12, 13, 14])
    eng.check_integrity()
    committed = eng.committed_tokens(good.id)
    out = eng.generate(good.id, 6).tokens
    fresh = Engine(make())
    assert out == fresh.generate(fresh.open(committed).id, 6).tokens
    # A session on the published prefix reads only KV that was written for it.
    hit = eng.open(committed[:16] + [7])
    assert eng.metrics.hash_hit_tokens >= 12
    assert (eng.generate(hit.id, 4).tokens
            == fresh.generate(fresh.open(committed[:16] + [7]).id, 4).tokens)
    eng.check_integrity()
    # Adapters by name, where users have names; an unknown one is refused at the verb.
    h = eng.open([5, 6, 7], adapter="planner")
    assert eng.node(h.id, eng.tip(h.id)).adapter == backend.adapter_id("planner")
    with pytest.raises(UnknownAdapterError):
        eng.open([5, 6, 7], adapter="nobody")


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED, KVLayout.ADAPTIVE])
def test_injected_faults_never_reach_another_session(model_dir, layout):
    report = torch_faults.run(model_dir, layout, faults=8, seed=hash(layout.value) & 0xFF)
    assert report.faults >= 8 and report.checked_outputs > 0
    assert report.cross_session_effects == 0
