"""VllmBackend on real vLLM 0.26 (GPU session only; skipped without vLLM or CUDA).

What the CPU tests cannot show: that vLLM starts from our config-only model folder, that
KvManagerPinner finds vLLM's KV manager and holds real blocks, that vLLM's prefix cache
serves a child from its trunk's blocks (and reports it in ``num_cached_tokens``), that every
verb runs, and that greedy committed tokens are what plain vLLM picks on the committed
prompt (with and without LoRA).

The engine: benchmarks/h200_vllm.py runs this file in-process through ``pytest.main`` with
its own engine (Llama-3-8B shape, dummy weights, 32 LoRAs), offered as the ``vllm_harness``
fixture by a plugin, so one engine start serves the tests and the benchmarks. Run alone,
the file starts a tiny config-only Llama with dummy weights, or ``FORKSERVE_VLLM_MODEL`` (a
real checkpoint: random dummy weights make near-tied logits, where a different batch shape
may flip an argmax). LoRA tests need the harness's adapters.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason='needs vLLM 0.26 on a CUDA GPU: pip install -e ".[vllm]"')
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from forkserve import Engine, ForkServeConfig  # noqa: E402
from forkserve.backend.vllm.bench_assets import write_model_dir  # noqa: E402
from forkserve.backend.vllm.block_pinner import KvManagerPinner  # noqa: E402
from forkserve.backend.vllm.native import run_batch  # noqa: E402
from forkserve.backend.vllm.vllm_loader import api, build_llm  # noqa: E402
from forkserve.bench.multilora import tiny_config  # noqa: E402
from forkserve.engine.vllm_backend import VllmBackend  # noqa: E402

CFG = ForkServeConfig(num_pages=512, hbm_tokens=512 * 16, max_context=4096, vocab_size=512,
                      node_ttl_s=None)


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory):
    try:
        return request.getfixturevalue("vllm_harness")
    except pytest.FixtureLookupError:
        pass
    model = os.environ.get("FORKSERVE_VLLM_MODEL")
    kwargs = dict(enforce_eager=True, num_gpu_blocks_override=2048)
    if model is None:
        model = str(write_model_dir(tiny_config(), tmp_path_factory.mktemp("tiny")))
        kwargs.update(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    llm = build_llm(model, CFG, max_loras=0, gpu_memory_utilization=0.3, max_lora_rank=16,
                    llm_kwargs=kwargs)
    return SimpleNamespace(llm=llm, api=api(), pinner=KvManagerPinner.attach(llm.llm_engine),
                           agents=0, lora_modules=dict)


def _backend(harness, **kw):
    assert harness.llm.reset_prefix_cache(), "a block is still held by an earlier test"
    return VllmBackend.on_engine(CFG, harness.llm.llm_engine, harness.api,
                                 pinner=harness.pinner, **kw)


def _greedy(n: int, **kw):
    return vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False,
                               **kw)


TOP_K, TOL = 5, 0.1  # nats


def assert_plain_vllm_agrees(harness, committed: list[int], generated: int, lora=None) -> None:
    """The Engine's greedy tokens against plain vLLM on the committed prompt. Dummy weights
    leave near-tied logits, so a different batch shape may flip an exact argmax: every token
    must be, on the same prefix in plain vLLM, among the top 5 of the 128K (or 512) vocab and
    within 0.1 nats of the best; a prompt rebuilt wrongly from page ids fails that. The exact
    agreement of a free-running plain decode is printed (and is exact with real weights)."""
    start = len(committed) - generated
    prefixes = [{"prompt_token_ids": committed[:start + i]} for i in range(generated)]
    forced = harness.llm.generate(prefixes, _greedy(1, logprobs=TOP_K), lora_request=lora,
                                  use_tqdm=False)
    for i, out in enumerate(forced):
        top = out.outputs[0].logprobs[0]
        best = max(lp.logprob for lp in top.values())
        token = committed[start + i]
        assert token in top and top[token].logprob >= best - TOL, (
            f"token {i}: {token} is not a near-argmax of plain vLLM: "
            f"{sorted(((lp.logprob, t) for t, lp in top.items()), reverse=True)}")
    free = harness.llm.generate([prefixes[0]], _greedy(generated), lora_request=lora,
                                use_tqdm=False)[0].outputs[0].token_ids
    same = sum(a == b for a, b in zip(free, committed[start:], strict=True))
    print(f"exact greedy agreement with a plain vLLM decode: {same}/{generated}")


def test_engine_started_with_more_blocks_than_the_control_plane_pins(harness):
    assert vllm.__version__.startswith("0.26")
    blocks = harness.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    assert blocks > CFG.num_pages


def test_children_hit_the_trunk_and_pins_hold_real_blocks(harness):
    backend = _backend(harness)
    eng = Engine(backend)
    trunk = [(7 * i) % 500 + 3 for i in range(200)]
    h = eng.open(trunk)
    kids = [eng.fork(h.id, h.tip, f"k{i}", [10 + i] * 20) for i in range(3)]
    for k in kids:
        eng.speculate(h.id, k)
    before = backend.stats.cached_tokens
    eng.drain_slack()
    # Every child's prompt is trunk + residual: vLLM serves the trunk's 12 full blocks.
    assert backend.stats.cached_tokens - before == 3 * (200 // 16) * 16
    held = [backend.pins.get(page) for page in range(CFG.num_pages)]
    held = [handle for handle in held if handle is not None]
    assert held and all(block.ref_cnt >= 1 for handle in held for block in handle)
    backend.close()
    assert harness.llm.reset_prefix_cache()  # close() let every pinned block go


def test_committed_tokens_are_plain_vllms_greedy_choices(harness):
    backend = _backend(harness)
    eng = Engine(backend)
    prompt = [(11 * i) % 500 + 3 for i in range(100)]
    h = eng.open(prompt)
    a = eng.fork(h.id, h.tip, "a", [40] * 12)
    b = eng.fork(h.id, h.tip, "b", [41] * 12)
    eng.speculate(h.id, a)
    eng.speculate(h.id, b, priority=0.2)
    eng.drain_slack()
    result = eng.commit(h.id, h.tip, [40] * 12 + [42] * 5)
    assert result.bound_node == a and b in result.aborted
    eng.generate(h.id, 32)
    committed = eng.committed_tokens(h.id)
    assert committed[:-32] == prompt + [40] * 12 + [42] * 5
    backend.close()
    assert harness.llm.reset_prefix_cache()
    assert_plain_vllm_agrees(harness, committed, 32)


def test_abort_and_close_release_every_pin(harness):
    backend = _backend(harness)
    eng = Engine(backend)
    h = eng.open([(5 * i) % 500 + 3 for i in range(64)])
    kid = eng.fork(h.id, h.tip, "kid", [9] * 48)
    eng.speculate(h.id, kid)
    eng.drain_slack()
    assert backend.stats.pins_taken >= 4 + 3  # the trunk's 4 full pages, the kid's 3
    eng.abort(h.id, kid)
    eng.generate(h.id, 4)
    eng.close(h.id)
    backend.close()
    assert backend.stats.pins_released == backend.stats.pins_taken
    assert harness.llm.reset_prefix_cache()


def test_plain_batch_computes_a_shared_trunk_once(harness):
    assert harness.llm.reset_prefix_cache()
    trunk = [(13 * i) % 500 + 3 for i in range(256)]
    prompts = [trunk + [20 + k] * 32 for k in range(4)]
    batch = run_batch(harness.llm.llm_engine, harness.api, prompts, 1)
    # docs/ANCHORS.md: vLLM 0.26 computes a new trunk once for children that
    # arrive together.
    assert batch.computed_tokens == 256 + 4 * 32
    assert all(len(t) == 1 for t in batch.tokens)


def test_lora_committed_tokens_are_plain_vllms_lora_choices(harness):
    if not harness.agents:
        pytest.skip("the standalone engine has no adapters (run through benchmarks/h200_vllm.py)")
    modules = harness.lora_modules()
    backend = _backend(harness, lora_modules=modules)
    eng = Engine(backend)
    prompt = [(17 * i) % 500 + 3 for i in range(80)]
    h = eng.open(prompt, adapter="agent1")
    eng.generate(h.id, 16)
    committed = eng.committed_tokens(h.id)
    backend.close()
    assert harness.llm.reset_prefix_cache()
    ref = backend.adapters.resolve("agent1")
    lora = harness.api.lora_request(lora_name=ref.name, lora_int_id=ref.int_id,
                                    lora_path=ref.path)
    assert_plain_vllm_agrees(harness, committed, 16, lora)
