"""TokenShadow, PinTable, AdapterTable: the bookkeeping under the vLLM plans."""
from __future__ import annotations

import pytest

from forkserve.backend.vllm import AdapterTable, PinTable, TokenShadow
from forkserve.errors import InvalidRequestError


def test_shadow_reads_back_what_was_written_across_pages():
    s = TokenShadow(8, 4)
    assert s.write([2, 5], 0, [1, 2, 3, 4, 5, 6], "a", 1) == (2, 5)
    assert s.read([2, 5], 6, "a", 1) == [1, 2, 3, 4, 5, 6]
    assert s.read([2, 5], 0, "a", 1) == []


def test_a_page_restarted_at_slot_zero_forgets_its_previous_owner():
    s = TokenShadow(8, 4)
    s.write([3], 0, [1, 2, 3, 4], None, 1)
    s.write([3], 0, [9], None, 2)  # the pool reallocated page 3
    assert s.read([3], 1, None, 2) == [9]
    with pytest.raises(AssertionError, match="never written"):
        s.read([3], 2, None, 2)


def test_reading_another_adapters_kv_is_caught():
    s = TokenShadow(8, 4)
    s.write([0], 0, [1, 2], "planner", 1)
    with pytest.raises(AssertionError, match="another adapter"):
        s.read([0], 2, "critic", 2)


def test_copy_duplicates_tokens_and_owners():
    s = TokenShadow(8, 4)
    s.write([1], 0, [7, 8, 9], "a", 1)
    s.copy(1, 6)
    assert s.read([6], 3, "a", 2) == [7, 8, 9]


def test_pin_table_hold_and_drop():
    pins: PinTable[str] = PinTable()
    assert pins.hold(4, "blk") is None and 4 in pins and len(pins) == 1
    assert pins.hold(4, "blk2") == "blk"
    assert pins.drop(4) == "blk2" and pins.drop(4) is None and len(pins) == 0


def test_adapter_ids_are_stable_and_start_at_one():
    t = AdapterTable({"b": "/b", "a": "/a"})
    assert (t.adapter_id("a"), t.adapter_id("b")) == (1, 2)
    assert t.resolve(None) is None and t.resolve(2).name == "b"
    with pytest.raises(InvalidRequestError):
        t.resolve(3)
    assert len(t) == 2 and len(AdapterTable()) == 0
