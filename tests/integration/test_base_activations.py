"""residual_source = base_activations: one base-model pass over a shared context writes the
base cache and every adapter's residual from the same activations (Engine.prefill_shared)."""
import pytest
import torch
from safetensors.torch import load_file

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.adapter_key import adapter_key
from forkserve.backend.mock import MockBackend
from forkserve.errors import InvalidRequestError

CONTEXT = [3 + (i * 7) % 90 for i in range(32)]


def _torch_engine(model_dir):
    from forkserve.backend.torch import TorchBackend

    path, adapters = model_dir
    cfg = ForkServeConfig(page_size=4, num_pages=256, num_residual_pages=256,
                          kv_layout=KVLayout.DISAGGREGATED, node_ttl_s=None)
    backend = TorchBackend(cfg, path, adapters, device="cpu", dtype=torch.float32,
                           attention="eager", use_cuda_graphs=False)
    return Engine(backend), backend


def test_residuals_are_the_base_activations_times_each_adapters_A(model_dir):
    from transformers import AutoModelForCausalLM

    engine, backend = _torch_engine(model_dir)
    ids = {name: backend.adapter_id(name) for name in ("planner", "critic")}
    shared = engine.prefill_shared(CONTEXT, list(ids.values()))
    assert shared.tokens == 32 and shared.prefilled_tokens == 32
    assert engine.index.num_pages == 8 and engine.residual_index.num_pages == 16

    hf = AutoModelForCausalLM.from_pretrained(model_dir[0], torch_dtype=torch.float32)
    with torch.no_grad():
        hidden = hf(torch.tensor([CONTEXT]), output_hidden_states=True).hidden_states
    for name, aid in ids.items():
        weights = load_file(str(model_dir[1][name] / "adapter_model.safetensors"))
        pages = [e.page for e in sorted(engine.residual_index.entries(),
                                        key=lambda e: len(e.prefix))
                 if e.namespace.adapter == adapter_key(aid)]
        for layer in range(2):
            x = hf.model.layers[layer].input_layernorm(hidden[layer][0])
            a_k = next(v for k, v in weights.items()
                       if f"layers.{layer}.self_attn.k_proj.lora_A" in k)
            stored = backend.pool.layer(layer).k_res[pages].reshape(
                -1, backend.pool.layer(layer).k_res.shape[-1])
            assert torch.allclose(stored[:, :a_k.shape[0]], x @ a_k.T, atol=1e-4), (name, layer)


def test_agents_then_prefill_only_their_own_tokens(model_dir):
    engine, backend = _torch_engine(model_dir)
    aid = backend.adapter_id("critic")
    engine.prefill_shared(CONTEXT, [aid, backend.adapter_id("planner")])
    before = engine.metrics.prefill_tokens
    h = engine.open(CONTEXT + [5, 6, 7], adapter=aid)
    engine.generate(h.id, 4)
    # the context came from the index, both sides
    assert engine.metrics.prefill_tokens - before == 3
    assert engine.metrics.residual_hit_tokens == 32
    engine.check_integrity()


def test_mock_engine_equals_a_baseline_and_bad_requests_change_nothing():
    cfg = ForkServeConfig(page_size=4, num_pages=64, num_residual_pages=64, vocab_size=300,
                          kv_layout=KVLayout.DISAGGREGATED)
    engine = Engine(MockBackend(cfg))
    engine.prefill_shared(CONTEXT, ["a", "b"])
    again = engine.prefill_shared(CONTEXT, ["a", "b"])
    assert again.prefilled_tokens == 0  # already published
    h = engine.open(CONTEXT + [9], adapter="b")
    out = engine.generate(h.id, 5)
    base = Engine(MockBackend(cfg))
    assert base.generate(base.open(CONTEXT + [9], adapter="b").id, 5).tokens == out.tokens
    used = (engine.pool.num_used, engine.residual_pool.num_used)
    with pytest.raises(InvalidRequestError, match="adapter"):
        engine.prefill_shared(CONTEXT, [])
    with pytest.raises(InvalidRequestError, match="full page"):
        engine.prefill_shared([5, 6], ["a"])
    assert (engine.pool.num_used, engine.residual_pool.num_used) == used
    unified = Engine(MockBackend(cfg.replace(kv_layout=KVLayout.UNIFIED)))
    with pytest.raises(InvalidRequestError, match="disaggregated"):
        unified.prefill_shared(CONTEXT, ["a"])


def test_a_failed_shared_prefill_publishes_nothing_and_keeps_no_page():
    cfg = ForkServeConfig(page_size=4, num_pages=64, num_residual_pages=64, vocab_size=300,
                          kv_layout=KVLayout.DISAGGREGATED, max_batch_tokens=8)
    backend = MockBackend(cfg)
    engine = Engine(backend)
    backend.fault = lambda item: RuntimeError("device lost") if item.start_pos >= 8 else None
    with pytest.raises(RuntimeError, match="device lost"):
        engine.prefill_shared(CONTEXT, ["a", "b"])  # the first chunk is written, the second fails
    stats = engine.cache_stats()
    assert stats.base.used == stats.residual.used == 0
    backend.fault = None
    assert engine.prefill_shared(CONTEXT, ["a", "b"]).prefilled_tokens == len(CONTEXT)
    engine.check_integrity()
