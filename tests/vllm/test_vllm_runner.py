"""PhaseRunner against the fake engine: what reaches vLLM's add_request, and what comes back."""
from __future__ import annotations

import pytest
from vllm_fakes import FAKE_API, FakeBlock, FakeLLMEngine, FakePinner, next_token

from forkserve.backend.vllm import PhasePlan, PhaseRunner, RequestPlan, RequestSampling
from forkserve.backend.vllm.adapters import LoraRef

GREEDY = RequestSampling(0.0, 1.0, None)


def _req(rid, prompt, lora=None, returns=True, pins=()):
    return RequestPlan(rid, int(rid[-1]), tuple(prompt), lora, GREEDY, returns, False, False,
                       1, pins)


def test_one_phase_is_one_batch_with_our_ids_and_params():
    engine = FakeLLMEngine(block_size=4)
    lora = LoraRef("planner", 1, "/a/planner")
    runner = PhaseRunner(engine, FAKE_API, None)
    out = runner.run(PhasePlan((_req("r1", range(6), lora), _req("r2", range(5), lora, False))))
    assert engine.steps == [["r1", "r2"]]
    first = engine.requests[0]
    assert first.params.kwargs == dict(n=1, max_tokens=1, temperature=0.0, top_p=1.0, seed=None,
                                       ignore_eos=True, detokenize=False)
    assert first.lora is engine.requests[1].lora  # one LoRARequest object per adapter
    assert out["r1"].token == next_token(list(range(6)), "planner") and out["r2"].token is None
    assert out["r2"].cached_tokens == 4  # r2's first block was computed by r1 in the same batch


def test_pins_are_taken_at_finish_and_hold_the_block():
    engine = FakeLLMEngine(block_size=4)
    runner = PhaseRunner(engine, FAKE_API, FakePinner(engine))
    out = runner.run(PhasePlan((_req("r1", range(9), pins=((0, 11), (1, 12))),)))
    assert sorted(out["r1"].pins) == [0, 1]
    assert all(b.ref == 1 for b in out["r1"].pins.values())  # the request's own ref is gone


def test_a_foreign_unfinished_request_is_refused():
    engine = FakeLLMEngine()
    engine.add_request("other", {"prompt_token_ids": [1]}, FAKE_API.sampling_params(
        n=1, max_tokens=1, ignore_eos=True))
    with pytest.raises(RuntimeError, match="did not submit"):
        PhaseRunner(engine, FAKE_API, None).run(PhasePlan((_req("r1", [1, 2]),)))


class _StuckEngine(FakeLLMEngine):
    """vLLM with a request it cannot schedule: it waits, finishing nothing, until aborted."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []
        self.blocks = [FakeBlock(("held", i), ref=1) for i in range(3)]

    def step(self):
        return []

    def abort_request(self, request_ids):
        self.aborted += request_ids
        for r in self.queue:  # vLLM frees an aborted request's blocks (through the pinner)
            r.blocks = self.blocks
            for hook in self.free_hooks:
                hook(r)
            for block in r.blocks:
                block.ref -= 1
        self.queue = []


def test_a_phase_vllm_cannot_schedule_is_aborted_not_waited_on_forever():
    engine = _StuckEngine()
    runner = PhaseRunner(engine, FAKE_API, FakePinner(engine))
    with pytest.raises(RuntimeError, match="finished nothing"):
        runner.run(PhasePlan((_req("fs-0-1", range(3, 40), pins=((0, 5),)),)))
    assert engine.aborted == ["fs-0-1"] and not engine.has_unfinished_requests()
    # The pinner caught block 0 as the abort freed it; the runner let it go again.
    assert [b.ref for b in engine.blocks] == [0, 0, 0]
