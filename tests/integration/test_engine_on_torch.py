"""The control plane driving the real engine: committed output equals a baseline that
prefilled only the committed tokens (tiny random Llama saved to safetensors, CPU, greedy)."""
import random

import pytest
import torch

from forkserve import Engine, ForkServeConfig, KVLayout, plus_config

VOCAB = 96


def _backend(model_dir, layout, cascade, **overrides):
    from forkserve.backend.torch import TorchBackend

    path, adapters = model_dir
    make = plus_config if cascade else ForkServeConfig
    cfg = make(**{**dict(page_size=4, num_pages=512, num_residual_pages=512, kv_layout=layout,
                         max_batch_tokens=256, spec_chunk=16, early_abort_probe_tokens=2,
                         speculate_budget_tokens=3, node_ttl_s=None), **overrides})
    return TorchBackend(cfg, path, adapters, device="cpu", dtype=torch.float32,
                        attention="eager", use_cuda_graphs=False)


@pytest.mark.parametrize("layout,adapter,cascade", [
    (KVLayout.UNIFIED, None, False),
    (KVLayout.UNIFIED, "planner", True),
    (KVLayout.DISAGGREGATED, "critic", True),
])
def test_committed_output_equals_a_committed_only_baseline(model_dir, layout, adapter, cascade):
    backend = _backend(model_dir, layout, cascade)
    aid = None if adapter is None else backend.adapter_id(adapter)
    eng = Engine(backend)
    rng = random.Random(hash((layout, adapter)) & 0xFFFF)
    draw = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    h = eng.open(draw(13), adapter=aid)
    committed = eng.committed_tokens(h.id)
    outputs = []
    for step in range(3):
        tip = eng.tip(h.id)
        kids, residuals = [], []
        for _ in range(3):
            residual = draw(rng.randrange(2, 9))
            if residuals and rng.random() < 0.5:  # share a prefix with a sibling
                residual = residuals[-1][:rng.randrange(1, len(residuals[-1]) + 1)] + residual
            residuals.append(residual)
            kids.append(eng.fork(h.id, tip, f"s{step}", residual))
        for k in kids:
            eng.speculate(h.id, k, priority=rng.choice([0.3, 0.9, 1.0]))
        eng.drain_slack()
        chosen = rng.choice(residuals)
        tokens = chosen[:rng.randrange(1, len(chosen) + 1)] + draw(rng.randrange(0, 4))
        eng.commit(h.id, tip, tokens)
        committed = committed + tokens
        out = eng.generate(h.id, 4)
        outputs.append((list(committed), out.tokens))
        committed = committed + list(out.tokens)
        eng.check_integrity()
    assert eng.committed_tokens(h.id) == committed

    baseline = Engine(_backend(model_dir, layout, False))
    for prefix, tokens in outputs:
        hb = baseline.open(prefix, adapter=aid)
        assert baseline.generate(hb.id, len(tokens)).tokens == tokens
        baseline.close(hb.id)
    eng.close(h.id)
    eng.evict_all()
    assert eng.pool.num_used == 0


@pytest.mark.parametrize("layout,adapter", [
    (KVLayout.UNIFIED, None),
    (KVLayout.DISAGGREGATED, "critic"),
])
def test_a_burst_on_one_trunk_equals_a_committed_only_baseline(model_dir, layout, adapter):
    """Five sessions opened at once on one 37-token trunk, prefilled in 16-token chunks: the
    oldest writes the trunk and publishes it chunk by chunk, the others wait and match it
    (in-flight deduplication); each generates what a fresh engine given only its prompt does."""
    from forkserve.config import PrefixDedup

    backend = _backend(model_dir, layout, False, max_batch_tokens=16)
    aid = None if adapter is None else backend.adapter_id(adapter)
    eng = Engine(backend)
    rng = random.Random(7)
    trunk = [rng.randrange(3, VOCAB) for _ in range(37)]
    prompts = [trunk + [rng.randrange(3, VOCAB) for _ in range(3)] for _ in range(5)]
    sids = [eng.open(p, adapter=aid).id for p in prompts]
    for sid in sids:
        eng.start_generate(sid, 4)
    while any(eng.sessions[s].decode_left for s in sids):
        assert eng.tick()
        eng.check_integrity()
    assert eng.metrics.dedup_held > 0
    # The leader's 40 tokens, then each follower its last 4 (its trunk's 9 full pages matched).
    assert eng.metrics.prefill_tokens == 40 + 4 * 4
    baseline = Engine(_backend(model_dir, layout, False, prefix_dedup=PrefixDedup.OFF))
    for sid, prompt in zip(sids, prompts, strict=True):
        hb = baseline.open(prompt, adapter=aid)
        assert tuple(eng.sessions[sid].generated) == baseline.generate(hb.id, 4).tokens
        baseline.close(hb.id)


def test_unknown_adapter_is_rejected_at_the_verb_without_side_effects(model_dir):
    from forkserve.errors import UnknownAdapterError

    backend = _backend(model_dir, KVLayout.UNIFIED, False)
    eng = Engine(backend)
    with pytest.raises(UnknownAdapterError, match="not resident"):
        eng.open([5, 6, 7], adapter=999)
    assert not eng.sessions and eng.pool.num_used == 0
    h = eng.open([5, 6, 7], adapter=backend.adapter_id("planner"))
    with pytest.raises(UnknownAdapterError):
        eng.fork(h.id, h.tip, "x", [8], adapter=999)
    assert len(eng.sessions[h.id].tree.nodes) == 1
