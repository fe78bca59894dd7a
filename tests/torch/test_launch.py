"""TorchBackend.launch: a step queued on the device and read back later is the same step.

The handle's result equals ``step``'s for greedy, seeded-temperature, biased and logged
sampling; a DecodeBatch launches as its items; a refused step raises at ``result()`` and
writes nothing; the Engine's overlap over TorchBackend decodes what it decodes without it.
"""
from __future__ import annotations

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, make_config, prompt, work

from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.protocol import GREEDY, SamplingParams
from forkserve.backend.step_handle import StepHandle
from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch.errors import UnknownAdapterError
from forkserve.config import KVForm
from forkserve.engine import Engine


class Log:
    """A SampleLog that keeps what it is told."""

    def __init__(self) -> None:
        self.sampled: dict[int, tuple[int, float]] = {}

    def history(self, position: int) -> list[int]:
        return [t for p, (t, _) in sorted(self.sampled.items()) if p < position]

    def record(self, position, token, logprob, top) -> None:
        self.sampled[position] = (token, logprob)

    def record_prompt(self, position, token, logprob, top) -> None:
        pass


def _backend(models) -> TorchBackend:
    return TorchBackend(make_config(), models["llama"], device=DEVICE, dtype=DTYPE)


def _prefill(backend: TorchBackend, seqs: int) -> list[list[int]]:
    tokens = [prompt(seq, 9 + 3 * seq) for seq in range(seqs)]
    backend.step([work(s, tokens[s], 0, sampling=None) for s in range(seqs)])
    return tokens


def _decode_items(tokens: list[list[int]], sampling: list[SamplingParams]):
    return [work(s, [7 + s], len(t), sampling=p, decode=True)
            for s, (t, p) in enumerate(zip(tokens, sampling, strict=True))]


def test_launch_reads_back_what_step_returns(models):
    logs = [Log(), Log()]
    sampling = [GREEDY, SamplingParams(temperature=0.8, seed=3),
                SamplingParams(logit_bias=((5, 3.0),), logprobs=2, log=logs[0]),
                SamplingParams(temperature=1.0, seed=9, presence_penalty=0.5, log=logs[1])]
    ours, ref = _backend(models), _backend(models)
    tokens = _prefill(ours, 4)
    _prefill(ref, 4)
    handle = ours.launch(_decode_items(tokens, sampling))
    assert isinstance(handle, StepHandle)
    got = handle.result()
    logged = [dict(log.sampled) for log in logs]
    for log in logs:
        log.sampled.clear()
    want = ref.step(_decode_items(tokens, sampling))
    assert got.next_tokens == want.next_tokens
    assert logged == [dict(log.sampled) for log in logs]  # accept ran once, after the read-back
    assert handle.result() is got  # asked again: the same result
    assert got.cost.decode_tokens == 4 and got.cost.ms > 0


def test_a_decode_batch_launches_as_its_items(models):
    ours, ref = _backend(models), _backend(models)
    tokens = _prefill(ours, 3)
    _prefill(ref, 3)
    items = _decode_items(tokens, [GREEDY] * 3)
    batch = DecodeBatch(tuple(s.seq_id for s in items), tuple(s.tokens[0] for s in items),
                        tuple(s.start_pos for s in items), tuple(s.slots.pages for s in items),
                        (None,) * 3, (KVForm.MERGED,) * 3, (None,) * 3, (0,) * 3, (GREEDY,) * 3,
                        (None,) * 3)
    got = ours.launch(items[:1], DecodeBatch(*(column[1:] for column in batch.__dict__.values())))
    assert got.result().next_tokens == ref.step(items).next_tokens


def test_a_refused_launch_raises_at_result_and_writes_nothing(models):
    backend = _backend(models)
    tokens = _prefill(backend, 1)
    before = backend.forward([work(0, [7], len(tokens[0]), decode=True)]).logits[0]
    bad = work(1, [3, 4], 0, adapter=42)  # no such adapter
    handle = backend.launch([bad])
    with pytest.raises(UnknownAdapterError):
        handle.result()
    after = backend.forward([work(0, [7], len(tokens[0]), decode=True)]).logits[0]
    assert torch.equal(before, after)


def test_engine_overlap_over_torch_decodes_the_same_tokens(models):
    def run(overlap: bool) -> list[list[int]]:
        cfg = make_config().replace(overlap=overlap, steady_decode=True, node_ttl_s=None)
        engine = Engine(TorchBackend(cfg, models["llama"], device=DEVICE, dtype=DTYPE))
        handles = [engine.open(prompt(s, 11 + 2 * s)) for s in range(3)]
        for i, h in enumerate(handles):
            engine.start_generate(h.id, 10 + i)
        while engine.tick():
            engine.check_integrity()
        engine.sync()
        return [list(engine.generation(h.id).tokens) for h in handles]

    assert run(True) == run(False)
