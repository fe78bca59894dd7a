"""plan_step: SeqWork batches -> vLLM request plans (pure Python, no vLLM)."""
from __future__ import annotations

import pytest

from forkserve.backend.protocol import GREEDY, KVSlots, SamplingParams, SeqWork
from forkserve.backend.vllm import AdapterTable, TokenShadow, plan_step
from forkserve.errors import InvalidRequestError

P = 4


def _shadow_with(pages, tokens, adapter=None) -> TokenShadow:
    shadow = TokenShadow(num_pages=32, page_size=P)
    shadow.write(pages, 0, tokens, adapter, seq_id=0)
    return shadow


def _plan(work, shadow, adapters=None, **kw):
    kw.setdefault("two_class", False)
    kw.setdefault("cow_blocks", True)
    return plan_step(work, shadow, adapters or AdapterTable(), step_index=7, **kw)


def test_child_prompt_is_the_trunk_read_through_aliased_pages_plus_its_residual():
    trunk = list(range(10, 20))                        # 10 tokens: pages 0, 1 full, 2 half
    shadow = _shadow_with([0, 1, 2], trunk)
    shadow.copy(2, 5)                                  # CoW of the partial page for the child
    child = SeqWork(3, (90, 91, 92), 10, KVSlots((0, 1, 5, 6)), sampling=GREEDY, speculative=True)
    (req,) = _plan([child], shadow).requests()
    assert req.prompt == tuple(trunk) + (90, 91, 92)
    assert req.request_id == "fs-7-3" and req.returns_token and req.speculative
    # Positions 10..12 complete page 5 (slots 8..11); page 6 stays partial.
    assert req.pin_blocks == ((2, 5),)
    assert _plan([child], shadow).unpin == (5, 6)


def test_write_only_item_runs_greedy_and_drops_its_token():
    shadow = TokenShadow(32, P)
    item = SeqWork(1, tuple(range(8)), 0, KVSlots((3, 4)), sampling=None)
    (req,) = _plan([item], shadow).requests()
    assert not req.returns_token
    assert (req.sampling.temperature, req.sampling.max_tokens) == (0.0, 1)
    assert req.pin_blocks == ((0, 3), (1, 4))


def test_seeded_sampling_is_offset_by_position_and_greedy_stays_unseeded():
    shadow = _shadow_with([0, 1], list(range(6)))
    hot = SeqWork(1, (9,), 6, KVSlots((0, 1)), sampling=SamplingParams(0.7, 0.9, seed=5),
                  decode=True)
    (req,) = _plan([hot], shadow).requests()
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.seed) == (0.7, 0.9, 12)
    assert req.decode and req.new_tokens == 1


def test_two_class_puts_speculative_requests_in_a_second_phase():
    shadow = _shadow_with([0], [1, 2, 3])
    spec = SeqWork(2, (5, 6), 0, KVSlots((8,)), sampling=GREEDY, speculative=True)
    done = SeqWork(1, (4,), 3, KVSlots((0,)), sampling=GREEDY, decode=True)
    one = _plan([spec, done], shadow)
    assert [[r.seq_id for r in ph.requests] for ph in one.phases] == [[1, 2]]  # committed first
    two = _plan([spec, done], shadow, two_class=True)
    assert [[r.seq_id for r in ph.requests] for ph in two.phases] == [[1], [2]]
    only_committed = _plan([done], shadow, two_class=True)
    assert len(only_committed.phases) == 1


def test_cow_blocks_off_plans_no_pins():
    shadow = TokenShadow(32, P)
    item = SeqWork(1, tuple(range(8)), 0, KVSlots((3, 4)), sampling=GREEDY)
    (req,) = _plan([item], shadow, cow_blocks=False).requests()
    assert req.pin_blocks == ()


def test_adapters_resolve_by_name_or_id_into_one_lora():
    adapters = AdapterTable({"critic": "/a/critic", "planner": "/a/planner"})
    shadow = TokenShadow(32, P)
    by_name = SeqWork(1, (1, 2), 0, KVSlots((0,)), adapter_id="planner", sampling=GREEDY)
    by_id = SeqWork(2, (1, 2), 0, KVSlots((1,)), adapter_id=adapters.adapter_id("planner"),
                    sampling=GREEDY)
    a, b = _plan([by_name, by_id], shadow, adapters).requests()
    assert a.lora == b.lora and a.lora.name == "planner" and a.lora.int_id >= 1
    with pytest.raises(InvalidRequestError, match="unknown adapter"):
        _plan([SeqWork(3, (1,), 0, KVSlots((2,)), adapter_id="nope")], shadow, adapters)


@pytest.mark.parametrize("item, error", [
    (SeqWork(1, (1,), 0, KVSlots((0,), residual_pages=(1,))), "residual pages"),
    (SeqWork(1, (1,), 4, KVSlots((9, 10))), "never written"),
    (SeqWork(1, tuple(range(9)), 0, KVSlots((0, 1))), "write reaches position 8"),
])
def test_bad_work_is_refused(item, error):
    with pytest.raises((ValueError, AssertionError), match=error):
        _plan([item], TokenShadow(32, P))


def test_one_item_per_sequence():
    shadow = TokenShadow(32, P)
    a = SeqWork(1, (1,), 0, KVSlots((0,)))
    with pytest.raises(ValueError, match="one item per sequence"):
        _plan([a, a], shadow)
