"""Decode-ahead on VllmBackend over the fake vLLM engine (CPU): a committed plain decode asks
for K tokens, later steps that write exactly them are served from the Lookahead."""
from __future__ import annotations

import random

import pytest
from test_vllm_engine_e2e import _quickstart, _script, _vllm
from vllm_fakes import greedy_reference

from forkserve import Engine, ForkServeConfig
from forkserve.backend.protocol import GREEDY, KVSlots, PageKind, SamplingParams, SeqWork

PROMPT = tuple(range(3, 3 + 37))
PAGES = KVSlots(tuple(range(8)))


def _backend(k, **cfg):
    return _vllm(ForkServeConfig(vllm_decode_ahead=k, **cfg))


def _decode(backend, steps, sampling=GREEDY, prompt=PROMPT, pages=PAGES):
    """Prefill ``prompt`` for seq 0, then ``steps`` decode steps; the tokens sampled."""
    out = list(backend.step([SeqWork(0, prompt, 0, pages, None, sampling)]).next_tokens)
    for _ in range(steps):
        pos = len(prompt) + len(out) - 1
        out += backend.step([SeqWork(0, (out[-1],), pos, pages, None, sampling,
                                     decode=True)]).next_tokens
    return out


@pytest.mark.parametrize("two_class", [False, True])
def test_greedy_tokens_with_k8_equal_k1_through_the_engine(two_class):
    runs = {}
    for k in (1, 8):
        backend, fake = _backend(k)
        backend.two_class = two_class
        eng, h, *_ = _quickstart(backend)
        runs[k] = (eng.committed_tokens(h.id), backend.stats, len(fake.requests))
        eng.check_integrity()
    assert runs[8][0] == runs[1][0]
    assert runs[1][1].ahead_served == 0 and runs[8][1].ahead_served > 100
    assert runs[8][2] < runs[1][2] // 4  # one request per K decode steps
    # Pages completed by served steps are pinned by the next request: the same pins.
    assert runs[8][1].pins_taken == runs[1][1].pins_taken


@pytest.mark.parametrize("seed", [0, 1])
def test_random_agent_loops_k8_equal_k1(seed):
    """Forks, commits of other text and generates of random lengths: lookahead contradicted
    all the time, tokens unchanged."""
    lora = {"planner": "/a/planner", "critic": "/a/critic"}
    got = {}
    for k in (1, 8):
        cfg = ForkServeConfig(vocab_size=256, page_size=8, vllm_decode_ahead=k)
        backend, _ = _vllm(cfg, lora_modules=lora)
        eng = Engine(backend)
        got[k] = _script(eng, random.Random(seed), [None, "planner", "critic"])
        eng.check_integrity()
        got[f"stats{k}"] = backend.stats
    assert got[8] == got[1]
    assert got["stats8"].ahead_served > 0 and got["stats8"].ahead_dropped > 0


def test_a_served_step_makes_no_vllm_call():
    backend, fake = _backend(8)
    out = _decode(backend, 1)  # prefill (1 token), then a decode asking for 8
    assert [r.params.max_tokens for r in fake.requests] == [1, 8]
    calls = len(fake.steps)
    out += _decode_more(backend, out, 7)
    assert len(fake.requests) == 2 and len(fake.steps) == calls  # 7 steps, no vLLM call
    assert backend.stats.ahead_served == 7 and backend.stats.requests == 2
    out += _decode_more(backend, out, 1)  # lookahead spent: a request again
    assert len(fake.requests) == 3
    assert out == greedy_reference(PROMPT, 10)


def _decode_more(backend, out, steps, sampling=GREEDY):
    got = []
    for _ in range(steps):
        tokens = out + got
        got += backend.step([SeqWork(0, (tokens[-1],), len(PROMPT) + len(tokens) - 1,
                                     KVSlots(tuple(range(8))), None, sampling,
                                     decode=True)]).next_tokens
    return got


def test_another_token_drops_the_lookahead_and_the_next_step_resubmits():
    backend, fake = _backend(8)
    out = _decode(backend, 1)
    pos = len(PROMPT) + 1
    other = (out[-1] + 1) % 200 + 3
    tok = backend.step([SeqWork(0, (other,), pos, KVSlots(tuple(range(8))), None, GREEDY,
                                decode=True)]).next_tokens[0]
    assert backend.stats.ahead_dropped == 7 and backend.stats.ahead_served == 0
    assert len(fake.requests) == 3
    assert tok == greedy_reference(PROMPT + (out[0], other), 1)[0]


def test_engine_commit_of_other_text_and_abort_drop_the_lookahead():
    backend, fake = _backend(8)
    ref, _ = _backend(1)
    runs = []
    for b in (backend, ref):
        eng = Engine(b)
        h = eng.open(list(PROMPT))
        eng.generate(h.id, 3)                      # lookahead left over
        kid = eng.fork(h.id, h.tip, "k", [9, 9, 9])
        eng.speculate(h.id, kid)
        eng.drain_slack()
        eng.abort(h.id, kid)
        eng.commit(h.id, eng.tip(h.id), [5, 6, 7])  # other text than the lookahead
        if b is backend:
            before = len(fake.requests)
        eng.generate(h.id, 4)
        runs.append(eng.committed_tokens(h.id))
        eng.check_integrity()
    assert runs[0] == runs[1]
    assert backend.stats.ahead_dropped > 0
    assert len(fake.requests) > before  # the first decode after the commit is a request


def test_copy_onto_a_lookahead_page_drops_it():
    backend, _ = _backend(8)
    _decode(backend, 1)
    backend.copy_pages(PageKind.UNIFIED, [(7, 1)])  # page 1 holds positions 16..31
    assert backend.stats.requests == 2 and len(backend.lookahead) == 0
    assert backend.lookahead.dropped == 7


def test_another_sequence_writing_onto_its_pages_drops_it():
    backend, fake = _backend(8)
    _decode(backend, 1)
    # seq 1 restarts page 2 (positions 32..47 of seq 0, where its lookahead writes next).
    backend.step([SeqWork(1, (5,) * 4, 0, KVSlots((2,)), None, None)])
    assert len(backend.lookahead) == 0 and backend.stats.ahead_dropped == 7


def test_pins_taken_equal_released_after_close_with_k8():
    backend, fake = _backend(8, num_pages=64, hbm_tokens=64 * 16)
    eng = Engine(backend)
    h = eng.open(list(range(3, 3 + 70)))
    eng.generate(h.id, 60)
    kid = eng.fork(h.id, h.tip, "k", [11] * 20)
    eng.speculate(h.id, kid)
    eng.drain_slack()
    eng.commit(h.id, eng.tip(h.id), [4] * 5)
    eng.generate(h.id, 30)
    assert backend.stats.ahead_served > 0 and backend.stats.pins_taken > 0
    eng.check_integrity()
    backend.close()
    assert backend.stats.pins_taken == backend.stats.pins_released
    assert len(backend.pins) == 0 and sum(b.ref for b in fake.cache.values()) == 0


def test_seeded_sampling_reproducible_across_runs():
    sampling = SamplingParams(temperature=0.8, seed=1234)
    runs = []
    for _ in range(2):
        backend, fake = _backend(8)
        out = _decode(backend, 12, sampling)
        runs.append((out, [(r.params.seed, r.params.max_tokens) for r in fake.requests]))
    assert runs[0] == runs[1]
    # One seeded request per K tokens, its seed offset by the position it starts at.
    assert runs[0][1] == [(1234 + len(PROMPT), 1), (1234 + len(PROMPT) + 1, 8),
                          (1234 + len(PROMPT) + 9, 8)]


def test_ahead_is_clamped_at_max_context():
    backend, fake = _backend(8, max_context=len(PROMPT) + 4)
    out = _decode(backend, 4)
    # The decode at position 37 makes a 38-token prompt: 41 - 38 = 3 tokens fit; the next
    # request's 41-token prompt leaves no room, so it asks for one (as K=1 would).
    assert [r.params.max_tokens for r in fake.requests] == [1, 3, 1]
    assert all(len(r.tokens) + r.params.max_tokens <= 42 for r in fake.requests)
    assert out == greedy_reference(PROMPT, 5)


def test_per_token_sampling_and_speculative_items_do_not_decode_ahead():
    class Log:
        def history(self, position):
            return []

        def record(self, *a):
            pass

        def record_prompt(self, *a):
            pass

    backend, fake = _backend(8)
    _decode(backend, 2, SamplingParams(presence_penalty=0.5, log=Log()))
    assert {r.params.max_tokens for r in fake.requests} == {1}
    backend, fake = _backend(8)
    backend.step([SeqWork(0, PROMPT, 0, KVSlots(tuple(range(8))), None, GREEDY,
                          speculative=True, decode=True)])
    assert fake.requests[-1].params.max_tokens == 1


def test_k1_is_todays_behaviour_and_k_is_validated():
    backend, fake = _backend(1)
    _decode(backend, 5)
    assert len(fake.requests) == 6 and {r.params.max_tokens for r in fake.requests} == {1}
    assert backend.stats.as_dict()["ahead_served"] == 0
    assert "ahead_dropped" in backend.stats.as_dict()
    with pytest.raises(ValueError, match="vllm_decode_ahead"):
        ForkServeConfig(vllm_decode_ahead=0)
