"""Exactness is a policy: base pages carry their provenance in their key. A base-model
request after an adapter published the same prefix reads only base-model K/V (in every
layout), adapters share each other's base pages only under ``ShareBase.CROSS_ADAPTER``."""
import pytest
import torch

from forkserve import Engine, ForkServeConfig, KVLayout, ShareBase

PROMPT = [5, 6, 7, 8, 40, 41, 42, 43, 44, 45, 46, 47, 9]


def _engine(model_dir, layout, share=ShareBase.CROSS_ADAPTER):
    from forkserve.backend.torch import TorchBackend

    path, adapters = model_dir
    cfg = ForkServeConfig(page_size=4, num_pages=256, num_residual_pages=256, kv_layout=layout,
                          share_base=share, adaptive_high_water=0.0)
    backend = TorchBackend(cfg, path, adapters, device="cpu", dtype=torch.float32,
                           attention="eager", use_cuda_graphs=False)
    return Engine(backend)


def _run(eng, adapter, tokens, n=6):
    h = eng.open(tokens, adapter=adapter)
    out = eng.generate(h.id, n).tokens
    eng.close(h.id)
    return out


def _logits_of(eng, adapter, tokens):
    """The generated tokens and the logits of every model forward the request ran."""
    model, seen = eng.backend.model, []
    forward = model.forward

    def recording(*args, **kwargs):
        seen.append(forward(*args, **kwargs).clone())
        return seen[-1]

    model.forward = recording
    try:
        return _run(eng, adapter, tokens), seen
    finally:
        del model.forward


@pytest.mark.parametrize("layout", list(KVLayout))
def test_the_base_model_never_reads_an_adapters_pages(model_dir, layout):
    eng = _engine(model_dir, layout)
    _run(eng, "planner", PROMPT)                 # publishes the prompt's pages
    before = eng.metrics.hash_hit_tokens
    out, logits = _logits_of(eng, None, PROMPT)
    assert eng.metrics.hash_hit_tokens == before  # nothing the adapter wrote was reused
    plain_out, plain_logits = _logits_of(_engine(model_dir, layout), None, PROMPT)
    assert out == plain_out
    # The plain model's logits at every step, bit for bit: same steps over the same K/V.
    assert len(logits) == len(plain_logits) > 0
    assert all(torch.equal(a, b) for a, b in zip(logits, plain_logits, strict=True))
    eng.check_integrity()


@pytest.mark.parametrize("layout", [KVLayout.DISAGGREGATED, KVLayout.FULL_REUSE])
def test_adapters_share_base_pages_only_when_the_policy_says_so(model_dir, layout):
    shared = _engine(model_dir, layout)
    _run(shared, "planner", PROMPT)
    before = shared.metrics.base_hit_tokens
    _run(shared, "critic", PROMPT)
    assert shared.metrics.base_hit_tokens - before >= 8  # cross-adapter sharing

    exact = _engine(model_dir, layout, ShareBase.EXACT)
    _run(exact, "planner", PROMPT)
    before = exact.metrics.base_hit_tokens
    out = _run(exact, "critic", PROMPT)
    assert exact.metrics.base_hit_tokens == before
    assert out == _run(_engine(model_dir, layout, ShareBase.EXACT), "critic", PROMPT)
    _run(exact, "critic", PROMPT)
    assert exact.metrics.base_hit_tokens - before >= 8  # its own pages still hit
    exact.check_integrity()
