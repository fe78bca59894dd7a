"""VllmBackend on real vLLM 0.26 (GPU session only; skipped without vLLM or CUDA).

What the CPU tests cannot show: that KvManagerPinner finds vLLM's KV manager and holds real
blocks, that vLLM's prefix cache serves a child from its trunk's blocks, and that greedy
committed tokens equal a plain vLLM run of the committed prompt. The model is a tiny
config-only Llama with dummy weights, or ``FORKSERVE_VLLM_MODEL`` (a real checkpoint:
random dummy weights make near-tied logits, where a different batch shape may flip an
argmax).
"""
from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason='needs vLLM 0.26 on a CUDA GPU: pip install -e ".[vllm]"')
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from forkserve import Engine, ForkServeConfig  # noqa: E402
from forkserve.backend.vllm.bench_assets import write_model_dir  # noqa: E402
from forkserve.backend.vllm.block_pinner import KvManagerPinner  # noqa: E402
from forkserve.backend.vllm.vllm_loader import api, build_llm  # noqa: E402
from forkserve.bench.multilora import tiny_config  # noqa: E402
from forkserve.engine.vllm_backend import VllmBackend  # noqa: E402

CFG = ForkServeConfig(num_pages=512, hbm_tokens=512 * 16, max_context=4096, vocab_size=512)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = os.environ.get("FORKSERVE_VLLM_MODEL")
    kwargs = dict(enforce_eager=True, num_gpu_blocks_override=2048)
    if model is None:
        model = str(write_model_dir(tiny_config(), tmp_path_factory.mktemp("tiny")))
        kwargs.update(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    return build_llm(model, CFG, max_loras=0, gpu_memory_utilization=0.3, max_lora_rank=16,
                     llm_kwargs=kwargs)


@pytest.fixture(scope="module")
def pinner(llm):
    return KvManagerPinner.attach(llm.llm_engine)


def _backend(llm, pinner):
    llm.reset_prefix_cache()
    return VllmBackend.on_engine(CFG, llm.llm_engine, api(), pinner=pinner)


def test_children_hit_the_trunk_and_pins_hold_real_blocks(llm, pinner):
    backend = _backend(llm, pinner)
    eng = Engine(backend)
    trunk = [(7 * i) % 500 + 3 for i in range(200)]
    h = eng.open(trunk)
    kids = [eng.fork(h.id, h.tip, f"k{i}", [10 + i] * 20) for i in range(3)]
    for k in kids:
        eng.speculate(h.id, k)
    before = backend.stats.cached_tokens
    eng.drain_slack()
    assert backend.stats.cached_tokens - before == 3 * (200 // 16) * 16
    assert len(backend.pins) > 0
    for page in range(CFG.num_pages):
        handle = backend.pins.get(page)
        if handle is not None:
            assert all(block.ref_cnt >= 1 for block in handle)
    backend.close()


def test_committed_greedy_tokens_equal_a_plain_vllm_run(llm, pinner):
    backend = _backend(llm, pinner)
    eng = Engine(backend)
    prompt = [(11 * i) % 500 + 3 for i in range(100)]
    h = eng.open(prompt)
    a = eng.fork(h.id, h.tip, "a", [40] * 12)
    b = eng.fork(h.id, h.tip, "b", [41] * 12)
    eng.speculate(h.id, a)
    eng.speculate(h.id, b, priority=0.2)
    eng.drain_slack()
    eng.commit(h.id, h.tip, [40] * 12 + [42] * 5)
    eng.generate(h.id, 32)
    committed = eng.committed_tokens(h.id)
    backend.close()
    llm.reset_prefix_cache()
    plain = llm.generate([{"prompt_token_ids": committed[:-32]}],
                         vllm.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                             detokenize=False), use_tqdm=False)
    assert committed[-32:] == list(plain[0].outputs[0].token_ids)
