"""TorchBackend.launch: a step queued on the device and read back later is the same step.

The handle's result equals ``step``'s for greedy, seeded-temperature, biased and logged
sampling; a DecodeBatch launches as its items; a refused step raises at ``result()`` and
writes nothing; the Engine's overlap over TorchBackend decodes what it decodes without it.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, as_decode_batch, make_config, prompt, work

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
    got = ours.launch(items[:1], DecodeBatch(*(column[1:] for name, column in batch.__dict__.items()
                                               if name != "fed")))
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


def _fed_run(models, mode: str, stop: tuple[int, ...] = ()) -> list:
    """Engine decode over TorchBackend: overlap off, reading back first (no ``fed_tokens``),
    or fed (the next step's tokens taken from the step in flight on the device)."""
    cfg = make_config().replace(overlap=mode != "off", steady_decode=True, node_ttl_s=None)
    backend = TorchBackend(cfg, models["llama"], device=DEVICE, dtype=DTYPE)
    if mode == "read_back":
        backend.capabilities = dataclasses.replace(backend.capabilities, fed_tokens=False)
    engine = Engine(backend)
    handles = [engine.open(prompt(s, 11 + 2 * s)) for s in range(4)]
    for i, h in enumerate(handles):
        engine.start_generate(h.id, 9 + 2 * (i % 2), stop=stop if i in (1, 2) else ())
    for _ in range(3):
        engine.tick()
    engine.cancel_generate(handles[3].id)  # a verb between ticks settles the step in flight
    while engine.tick():
        pass
    engine.check_integrity()
    return [engine.generation(h.id) for h in handles]


def test_engine_fed_steps_over_torch_decode_the_same_tokens(models, monkeypatch):
    fed_from_device = []
    original = TorchBackend._fed

    def spy(self, batch):
        tensor = original(self, batch)
        fed_from_device.append(tensor is not None)
        return tensor

    monkeypatch.setattr(TorchBackend, "_fed", spy)
    free = _fed_run(models, "off")
    tokens = free[1].tokens
    stop = (next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i]),)
    want = _fed_run(models, "off", stop)
    assert want[1].finish_reason == "stop" and len(want[1].tokens) < len(free[1].tokens)
    assert _fed_run(models, "read_back", stop) == want
    assert not fed_from_device
    assert _fed_run(models, "fed", stop) == want
    assert len(fed_from_device) >= 5 and all(fed_from_device)


def test_a_fed_batch_reads_the_earlier_steps_tokens_before_it_is_read_back(models):
    ours, ref = _backend(models), _backend(models)
    tokens = _prefill(ours, 3)
    _prefill(ref, 3)
    items = _decode_items(tokens, [GREEDY] * 3)
    first = ours.launch([], as_decode_batch(items))
    nxt = [work(s.seq_id, [0], s.start_pos + 1, sampling=GREEDY, decode=True) for s in items]
    second = ours.launch([], dataclasses.replace(as_decode_batch(nxt), fed=first))
    want1 = ref.step(items).next_tokens
    fed = [work(s.seq_id, [t], s.start_pos, sampling=GREEDY, decode=True)
           for s, t in zip(nxt, want1, strict=True)]
    assert first.result().next_tokens == want1
    assert second.result().next_tokens == ref.step(fed).next_tokens
    # Tracked writes: the rows run as items, the earlier step's tokens read on the host.
    ours.track_writes()
    third = ours.launch([], dataclasses.replace(
        as_decode_batch([work(s.seq_id, [0], s.start_pos + 1, sampling=GREEDY, decode=True)
                for s in nxt]), fed=second))
    assert len(third.result().next_tokens) == 3


def test_a_batch_fed_from_a_failed_step_fails(models):
    backend = _backend(models)
    tokens = _prefill(backend, 1)
    bad = backend.launch([work(1, [3, 4], 0, adapter=42)])  # refused: no such adapter
    items = _decode_items(tokens, [GREEDY])
    fed = backend.launch([], dataclasses.replace(as_decode_batch(items), fed=bad))
    with pytest.raises(UnknownAdapterError):
        fed.result()



def test_graph_capture_pauses_the_cycle_collector_and_restores_it():
    """A collection inside a capture may free a dead backend's CUDA objects, an illegal call
    while capturing (the CUDA suite aborted so): the collector waits for the capture, then
    comes back as it was, also when the capture raises."""
    import gc

    from forkserve.backend.torch.cuda_graph import collector_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller's own pause stays
    finally:
        gc.enable()
