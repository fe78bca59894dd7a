"""Unified-layout logits against Hugging Face transformers on tiny random checkpoints."""
from __future__ import annotations

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, REL_TOL, hf_logits, make_config, prompt, rel_err, work

from forkserve.backend.torch import ModelConfig, TorchBackend


def backend_for(path, **kw) -> TorchBackend:
    return TorchBackend(make_config(), path, device=DEVICE, dtype=DTYPE, **kw)


def prefill_logits(backend: TorchBackend, seq: int, tokens: list[int], chunk: int,
                   adapter: int | None = None) -> torch.Tensor:
    """Run `tokens` in chunks of `chunk`; logits of every position."""
    out = []
    for start in range(0, len(tokens), chunk):
        step = backend.forward([work(seq, tokens[start:start + chunk], start, adapter)],
                               all_logits=True)
        out.append(step.logits[0])
    return torch.cat(out)


@pytest.mark.parametrize("name", ["llama", "llama_sharded_tied", "llama3_rope", "qwen2",
                                  "qwen2_yarn_tied", "mistral"])
def test_prefill_matches_hf(models, name):
    tokens = prompt(0, 23)
    backend = backend_for(models[name])
    ours = prefill_logits(backend, 0, tokens, chunk=len(tokens))
    assert rel_err(ours, hf_logits(models[name], tokens)) < REL_TOL


def test_config_reading(models):
    cfg = ModelConfig.from_folder(models["qwen2"])
    assert cfg.attention_bias and cfg.num_kv_heads == 2 and cfg.num_heads == 4
    assert ModelConfig.from_folder(models["llama_sharded_tied"]).tie_word_embeddings
    assert len(list(models["llama_sharded_tied"].glob("*.safetensors"))) > 1
    assert ModelConfig.from_folder(models["llama3_rope"]).rope.rope_type == "llama3"
    yarn = ModelConfig.from_folder(models["qwen2_yarn_tied"])
    assert yarn.rope.rope_type == "yarn" and yarn.tie_word_embeddings
    assert ModelConfig.from_folder(models["mistral"]).architecture == "mistral"


@pytest.mark.parametrize("chunk", [1, 5, 8])
def test_chunked_prefill_and_decode_match_hf(models, chunk):
    """Chunks of any size (1 = token-by-token decode) give the full-prompt logits."""
    tokens = prompt(1, 21)
    backend = backend_for(models["qwen2"])
    assert rel_err(prefill_logits(backend, 3, tokens, chunk),
                   hf_logits(models["qwen2"], tokens)) < REL_TOL


def test_mixed_batch_prefill_and_decode(models):
    """One step holding a prefill chunk of one sequence and decodes of two others."""
    path = models["llama"]
    backend = backend_for(path)
    a, b, c = prompt(2, 9), prompt(3, 12), prompt(4, 17)
    backend.step([work(0, a[:-1], 0), work(1, b[:-1], 0)])
    out = backend.forward([work(0, a[-1:], len(a) - 1), work(2, c[:10], 0),
                           work(1, b[-1:], len(b) - 1)], all_logits=True)
    assert rel_err(out.logits[0][-1], hf_logits(path, a)[-1]) < REL_TOL
    assert rel_err(out.logits[1], hf_logits(path, c[:10])) < REL_TOL
    assert rel_err(out.logits[2][-1], hf_logits(path, b)[-1]) < REL_TOL


def test_greedy_generation_matches_hf_generate(models):
    from transformers import AutoModelForCausalLM

    path = models["llama"]
    tokens = prompt(5, 10)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float64)
    ref = hf.generate(torch.tensor([tokens]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(tokens):].tolist()
    backend = backend_for(path)
    out = [backend.step([work(0, tokens, 0)]).next_tokens[0]]
    for i in range(7):
        out.append(backend.step([work(0, out[-1:], len(tokens) + i)]).next_tokens[0])
    # bf16 may flip a near-tie; float32 must agree exactly.
    if DTYPE == torch.float32:
        assert out == ref
    else:
        assert out[:2] == ref[:2]


def test_step_reports_costs(models):
    backend = backend_for(models["llama"])
    r = backend.step([work(0, prompt(6, 7), 0), work(1, prompt(7, 5), 0, sampling=None)])
    assert r.next_tokens[1] is None and isinstance(r.next_tokens[0], int)
    assert r.cost.prefill_tokens == 12 and r.cost.prefill_calls == 2 and r.cost.ms > 0
    r = backend.step([work(0, [5], 7, decode=True)])
    assert r.cost.decode_tokens == 1 and r.cost.prefill_tokens == 0


def test_triton_glue_matches_hf(models):
    """RoPE and SiLU * up through the Triton glue kernels (kernels/glue.py; the interpreter
    without CUDA) inside the model: prefill chunks and token-by-token decode, q/k/v bias."""
    from forkserve.backend.torch.fused import Fusions

    tokens = prompt(1, 13)
    backend = backend_for(models["qwen2"], compile_fusions=False)
    backend.model.fx = Fusions(compile=False, triton=True)
    ours = prefill_logits(backend, 3, tokens[:9], chunk=9)
    ours = torch.cat([ours, prefill_logits_from(backend, 3, tokens, start=9)])
    assert rel_err(ours, hf_logits(models["qwen2"], tokens)) < REL_TOL


def prefill_logits_from(backend: TorchBackend, seq: int, tokens: list[int],
                        start: int) -> torch.Tensor:
    """Decode ``tokens[start:]`` one step each after a prefill of ``tokens[:start]``."""
    return torch.cat([backend.forward([work(seq, tokens[i:i + 1], i)], all_logits=True).logits[0]
                      for i in range(start, len(tokens))])


def skinny_backend(models, name: str):
    """A 16-bit backend over the tiny ``name`` (fp16 in the interpreter: the kernel's operands
    are 16-bit) and a ``SkinnyLinear`` whose tuning names every projection of it at every
    row class, at one small tile."""
    from forkserve.kernels.skinny_gemm import ShapeKey, SkinnyLinear, SkinnyTile, SkinnyTuning

    dtype = DTYPE if DTYPE != torch.float32 else torch.float16
    backend = TorchBackend(make_config(), models[name], device=DEVICE, dtype=dtype,
                           compile_fusions=False)
    cfg = backend.model_config
    shapes = [(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, False),
              (cfg.hidden_size, cfg.num_heads * cfg.head_dim, False),
              (cfg.intermediate_size, cfg.hidden_size, True),
              (cfg.hidden_size, cfg.intermediate_size, False),
              (cfg.vocab_size, cfg.hidden_size, False)]
    tile = SkinnyTile(block_n=16, block_k=32, warps=4, stages=2)
    tuning = SkinnyTuning({"dev": {ShapeKey(n, k, m, silu): tile
                                   for n, k, silu in shapes for m in (16, 32, 64)}})
    return backend, SkinnyLinear(tuning, "dev")


def test_skinny_linear_in_the_model(models, monkeypatch):
    """Every projection through the skinny GEMM (kernels/skinny_gemm.py, the interpreter
    without CUDA) where a tuning names its shape, the MLP's SiLU * up in its epilogue: the
    same logits as F.linear's, prefill and decode, q/k/v bias (qwen2). fp16: the kernel's
    operands are 16-bit."""
    from forkserve.backend.torch.fused import Fusions
    from forkserve.kernels import skinny_gemm

    backend, mm = skinny_backend(models, "qwen2")
    tokens = prompt(2, 11)

    def logits(fx: Fusions) -> torch.Tensor:
        backend.model.fx = fx
        ours = prefill_logits(backend, 4, tokens[:8], chunk=8)
        return torch.cat([ours, prefill_logits_from(backend, 4, tokens, start=8)])

    plain = logits(Fusions(compile=False, triton=True))
    calls = []
    kernel = skinny_gemm.skinny_mm
    monkeypatch.setattr(skinny_gemm, "skinny_mm",
                        lambda *a, **k: calls.append(k.get("silu", False)) or kernel(*a, **k))
    skinny = logits(Fusions(compile=False, triton=True, skinny=mm))
    # 4 forwards x (2 layers x 4 projections + lm_head), one of each layer's with SiLU.
    assert len(calls) == 4 * 9 and sum(calls) == 4 * 2
    assert rel_err(skinny, plain) < 3e-3


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_folded_norms_in_the_model(models, monkeypatch, name):
    """``fold_norms``: every RMSNorm inside the skinny GEMM that reads it (qkv, gate_up, the
    lm_head) and the residual adds in the epilogues of o and down: the logits of the unfolded
    skinny path, prefill and decode, q/k/v bias (qwen2). A chunk over the kernel's 64 rows
    and a LoRA step do not fold (``Fusions.folds``)."""
    from forkserve.backend.torch.fused import Fusions
    from forkserve.kernels import skinny_gemm

    backend, mm = skinny_backend(models, name)
    tokens = prompt(4, 11)

    def logits(fx: Fusions) -> torch.Tensor:
        backend.model.fx = fx
        ours = prefill_logits(backend, 4, tokens[:8], chunk=8)
        return torch.cat([ours, prefill_logits_from(backend, 4, tokens, start=8)])

    unfolded = logits(Fusions(compile=False, triton=True, skinny=mm))
    calls = []
    kernel = skinny_gemm.skinny_mm
    monkeypatch.setattr(skinny_gemm, "skinny_mm", lambda *a, **k: calls.append(
        ("norm" in k, "residual" in k)) or kernel(*a, **k))
    folded_fx = Fusions(compile=False, triton=True, skinny=mm, fold_norms=True)
    folded = logits(folded_fx)
    # 4 forwards x (2 layers x (qkv, gate_up) + lm_head) norms, 4 x 2 layers x (o, down) adds
    assert calls.count((True, False)) == 4 * 5 and calls.count((False, True)) == 4 * 4
    # The folded norm rounds elsewhere (1/rms in fp32 after the product, not a 16-bit normed
    # x before it), so in bf16 the two paths differ by an ulp or two: each is held to the
    # fp32 reference instead, the folded one no further from it than the unfolded one.
    ref = hf_logits(models[name], tokens)
    assert rel_err(folded, ref) <= 1.25 * rel_err(unfolded, ref) + 1e-3
    assert rel_err(folded, unfolded) < (3e-3 if backend.dtype == torch.float16 else 1.2e-2)
    assert not folded_fx.folds(65, lora=False) and not folded_fx.folds(8, lora=True)
    assert folded_fx.folds(64, lora=False)
