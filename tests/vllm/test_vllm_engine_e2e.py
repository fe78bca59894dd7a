"""The Engine on VllmBackend over a fake vLLM engine, end to end on CPU.

These tests check the *translation* — page ids -> prompts, verbs -> requests and phases,
pins and their release — not vLLM: the fake engine (vllm_fakes.py) models vLLM's prefix
cache and samples with MockBackend's token hash. What vLLM itself does with the requests is
checked on the GPU (test_vllm_gpu.py).
"""
from __future__ import annotations

import random
import sys

import pytest
from vllm_fakes import FAKE_API, FakeLLMEngine, FakePinner, greedy_reference

from forkserve import Engine, ForkServeConfig
from forkserve.backend.byte_tokenizer import ByteTokenizer
from forkserve.backend.mock import MockBackend
from forkserve.config import KVLayout
from forkserve.engine.vllm_backend import VllmBackend

_tok = ByteTokenizer()
system_and_user_tokens = _tok.encode("System: you are a shell agent.\nUser: list /tmp\n"
                                     "Action: run({\"cmd\": \"ls /tmp\"})\n")
wrap = _tok.encode("Observation: ")
recov = _tok.encode("Thought: the command failed, retry with sudo.")
observation = _tok.encode("a.txt b.txt\n")


def _vllm(config=None, blocks=100_000, **kw):
    config = config or ForkServeConfig()
    engine = FakeLLMEngine(num_blocks=blocks, block_size=config.page_size)
    pinner = FakePinner(engine) if kw.get("cow_blocks", True) else None
    return VllmBackend.on_engine(config, engine, FAKE_API, pinner=pinner, **kw), engine


def _quickstart(backend):
    eng = Engine(backend)
    h = eng.open(system_and_user_tokens)
    happy = eng.fork(h.id, h.tip, "bash", wrap)  # p = 1 known suffix
    fail = eng.fork(h.id, h.tip, "err", recov)
    eng.speculate(h.id, happy, t_idle_ms=2900)
    eng.speculate(h.id, fail, priority=0.2, t_idle_ms=2900)
    eng.drain_slack()
    cr = eng.commit(h.id, h.tip, wrap + observation)
    eng.generate(h.id, 128)
    return eng, h, cr, happy, fail


@pytest.mark.parametrize("two_class", [False, True])
def test_seed_quickstart_on_vllm_backend_matches_a_committed_only_run(two_class):
    backend, _ = _vllm(two_class=two_class)
    eng, h, cr, happy, fail = _quickstart(backend)
    assert cr.bound_node == happy and cr.matched_tokens == len(wrap)
    assert cr.prefilled_tokens == len(observation) and fail in cr.aborted
    prompt = system_and_user_tokens + wrap + observation
    committed = eng.committed_tokens(h.id)
    # Greedy committed tokens equal a plain run that saw only the committed tokens...
    assert committed == prompt + greedy_reference(prompt, 128)
    # ...and the MockBackend run of the same verbs, token for token.
    mock_eng, mock_h, *_ = _quickstart(MockBackend(ForkServeConfig()))
    assert committed == mock_eng.committed_tokens(mock_h.id)
    eng.check_integrity()
    assert len(backend.pins) <= eng.config.num_pages


def test_children_hit_the_trunk_in_vllms_prefix_cache():
    backend, fake = _vllm()
    eng = Engine(backend)
    trunk = list(range(3, 3 + 200))
    h = eng.open(trunk)
    kids = [eng.fork(h.id, h.tip, f"k{i}", [100 + i] * 20) for i in range(3)]
    for k in kids:
        eng.speculate(h.id, k)
    fake.computed_tokens = 0
    backend.stats.cached_tokens = 0
    eng.drain_slack()
    full = (len(trunk) // 16) * 16
    child_requests = [r for r in fake.requests
                      if r.external_id.endswith(tuple(f"-{k}" for k in kids))]
    assert len(child_requests) == 3
    # Each child prompt is trunk + residual; vLLM computes only the partial trunk page + residual.
    assert backend.stats.cached_tokens == 3 * full
    assert fake.computed_tokens == 3 * (len(trunk) - full + 20)


def test_pins_keep_the_trunk_cached_under_pressure_and_lru_alone_does_not():
    """A tiny vLLM block pool (40 blocks, more than the control plane's 24 pages, as
    vllm_loader requires): a burst of other sessions evicts an unpinned trunk."""
    def run(cow_blocks):
        cfg = ForkServeConfig(num_pages=24, hbm_tokens=24 * 16)
        backend, fake = _vllm(cfg, blocks=40, cow_blocks=cow_blocks)
        eng = Engine(backend)
        h = eng.open(list(range(3, 3 + 160)))               # 10 full pages
        eng.generate(h.id, 1)
        for i in range(4):                                  # other traffic: 4 x 10 blocks
            o = eng.open([200 + i] * 160)
            eng.generate(o.id, 1)
            eng.close(o.id)
            eng.evict_all()
        before = fake.computed_tokens
        kid = eng.fork(h.id, h.tip, "k", [7] * 16)  # writes the parent's generated token first
        eng.speculate(h.id, kid)
        eng.drain_slack()
        return fake.computed_tokens - before, fake

    pinned, _ = run(True)
    unpinned, fake = run(False)
    # Pinned: the parent's last token, then the child's partial page + residual.
    assert pinned == 1 + 1 + 16
    # LRU alone: the trunk was evicted, the parent's flush recomputes all 161 tokens.
    assert unpinned == 161 + 1 + 16 and fake.evictions > 0


def test_abort_and_reuse_release_pins():
    cfg = ForkServeConfig(num_pages=40, hbm_tokens=40 * 16)
    backend, fake = _vllm(cfg)
    eng = Engine(backend)
    h = eng.open(list(range(3, 3 + 64)))
    eng.generate(h.id, 1)
    for round_ in range(6):  # residuals of 3 full pages each, aborted every round
        kids = [eng.fork(h.id, h.tip, f"k{i}", [50 + round_ + i] * 48) for i in range(3)]
        for k in kids:
            eng.speculate(h.id, k)
        eng.drain_slack()
        for k in kids:
            eng.abort(h.id, k)
    # Page ids were reused, so their old pins were released; every pin is on a page id.
    assert backend.stats.pins_released > 0
    assert len(backend.pins) <= cfg.num_pages
    held = sum(b.ref for b in fake.cache.values())
    assert held == len(backend.pins)  # no reference leaked in vLLM's pool
    eng.check_integrity()
    backend.close()  # a benchmark reusing the vLLM engine: nothing stays held
    assert len(backend.pins) == 0 and sum(b.ref for b in fake.cache.values()) == 0


def _script(eng, rng, adapters):
    """A random agent loop: open, fork, speculate, commit (often a branch), generate."""
    sessions = []
    for s in range(3):
        adapter = adapters[s % len(adapters)]
        sessions.append(eng.open([rng.randrange(3, 250) for _ in range(rng.randrange(20, 60))],
                                 adapter=adapter).id)
    for _ in range(4):
        for sid in sessions:
            tip = eng.tip(sid)
            branches = [[rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))]
                        for _ in range(3)]
            kids = [eng.fork(sid, tip, f"b{i}", b) for i, b in enumerate(branches)]
            for i, k in enumerate(kids):
                eng.speculate(sid, k, priority=1.0 if i == 0 else 0.3)
        eng.drain_slack()
        for sid in sessions:
            pick = rng.choice([0, 1, 2, None])
            tokens = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 20))]
            if pick is not None:
                tokens = (list(eng.node(sid, eng.tip(sid)).children[pick].tokens)
                          [:rng.randrange(1, 30)] + tokens)
            eng.commit(sid, eng.tip(sid), tokens)
            eng.generate(sid, rng.randrange(1, 24))
    return [eng.committed_tokens(s) for s in sessions]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_agent_loops_match_mock_backend_token_for_token(seed):
    adapters = [None, "planner", "critic"]
    lora = {"planner": "/a/planner", "critic": "/a/critic"}
    cfg = ForkServeConfig(vocab_size=256, page_size=8)
    backend, _ = _vllm(cfg, lora_modules=lora, two_class=seed == 1)
    on_vllm = Engine(backend)
    got = _script(on_vllm, random.Random(seed), adapters)
    want = _script(Engine(MockBackend(cfg)), random.Random(seed), adapters)
    assert got == want
    on_vllm.check_integrity()
    assert backend.stats.cached_tokens > 0 and backend.stats.requests > 0


def test_config_and_import_guards():
    with pytest.raises(ValueError, match="unified"):
        _vllm(ForkServeConfig(kv_layout=KVLayout.DISAGGREGATED))
    with pytest.raises(ValueError, match="pinner"):
        VllmBackend.on_engine(ForkServeConfig(), FakeLLMEngine(), FAKE_API)
    assert "vllm" not in sys.modules or sys.modules["vllm"] is not None  # import stays lazy
    if "vllm" not in sys.modules:
        with pytest.raises(ImportError, match=r'pip install -e "\.\[vllm\]"'):
            VllmBackend(ForkServeConfig(), model="/nonexistent")
