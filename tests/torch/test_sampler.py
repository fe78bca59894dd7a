"""Sampling: greedy, seeded temperature / top-p independent of batch composition."""
from __future__ import annotations

import torch
from torch_testlib import DEVICE, DTYPE, make_config, prompt, work

from forkserve.backend.protocol import SamplingParams
from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch.sampler import Sampler, top_p_filter


def test_top_p_filter_keeps_smallest_covering_set():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = top_p_filter(probs, 0.7)
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]]))
    p = SamplingParams(temperature=1.0, seed=7)
    draws = [sampler.sample(logits, [p], [pos])[0] for pos in range(2000)]
    again = [sampler.sample(logits, [p], [pos])[0] for pos in range(2000)]
    assert draws == again
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.04)
    top = [sampler.sample(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=1)], [i])[0]
           for i in range(50)]
    assert set(top) == {0}


def test_seeded_tokens_do_not_depend_on_batch(models):
    backend = TorchBackend(make_config(), models["llama"], device=DEVICE, dtype=DTYPE)
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=3)
    tokens = prompt(90, 8)
    alone = backend.step([work(0, tokens, 0, sampling=p)]).next_tokens[0]
    batched = backend.step([work(1, prompt(91, 5), 0, sampling=SamplingParams(temperature=1.0)),
                            work(0, tokens, 0, sampling=p)]).next_tokens[1]
    assert alone == batched
