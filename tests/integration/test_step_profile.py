"""bench/multilora/step_profile.py: the profiler keeps the ticks it was asked for, by kind,
and attributes their time to the right categories."""
from __future__ import annotations

import pytest
import torch

from forkserve.bench.multilora.step_profile import StepProfiler, _union_us, category, profile_lines


def test_categories_and_interval_union() -> None:
    assert category("_decode_partial_kernel") == "attention"
    assert category("_shrink_kernel") == "lora"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert category("aten::mm") == "gemm"
    assert category("Memcpy DtoH (Device -> Pinned)") == "copy"
    assert category("some_fused_rmsnorm") == "other"
    assert _union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert _union_us([]) == 0


def test_profiler_keeps_ticks_per_kind_after_skip() -> None:
    prof = StepProfiler(ticks_per_kind=2, skip=1)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    kinds = ["decode", "decode", "prefill", "decode", None, "decode", "prefill", "prefill"]
    ran = 0
    for kind in kinds:
        if prof.wants():
            ran += 1
            assert prof.run(lambda: bool(torch.mm(a, b).sum() is not None), lambda k=kind: k)
    # The first tick is skipped; the third decode tick and the idle tick keep nothing; once
    # both kinds hold two ticks the profiler stops asking.
    assert ran == 6 and prof.profiled == 4
    s = prof.summary()
    assert set(s) == {"prefill", "decode"}
    for p in s.values():
        assert p["ticks"] == 2
        assert p["by_category_ms"].get("gemm", 0.0) > 0.0
        assert any(k["name"] == "aten::mm" and k["calls"] == pytest.approx(1.0) for k in p["top"])
        assert 0.0 <= p["idle_share"] <= 1.0
    assert prof.wants() is False
    lines = profile_lines(s)
    assert lines[0].startswith("  prefill tick (2 profiled)")
    assert any("aten::mm" in x for x in lines)
    assert profile_lines(None) == []


def test_profiler_refuses_zero_ticks() -> None:
    with pytest.raises(ValueError, match="ticks_per_kind"):
        StepProfiler(0)
