"""The fan-out rows of the H200 run (forkserve/bench/fanout_real.py) on CPU engines.

The MockBackend *is* the cost model, so its measured row must equal the prediction; the
Engine on VllmBackend (fake vLLM) must take the same cascade decisions and compute what the
prefix cache leaves; plain "vLLM" (fake) must compute each session's trunk once, as
docs/ANCHORS.md measured on the H200 (3840 tokens for the small size).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from vllm_fakes import FAKE_API, FakeLLMEngine, FakePinner

from forkserve.backend.mock import MockBackend
from forkserve.bench.fanout_real import (
    SIZES,
    engine_row,
    format_rows,
    native_row,
    plot,
    real_config,
    variants,
)
from forkserve.engine.vllm_backend import VllmBackend

SMALL = SIZES["small"]


@pytest.mark.parametrize("distinct", [True, False])
def test_mock_row_equals_the_cost_model(distinct):
    params = replace(SMALL, distinct_trunks=distinct)
    row = engine_row("mock", "small", params, MockBackend(real_config(params, 32000, 4096)))
    assert row.computed_tokens == row.model_prefill_tokens
    assert row.peak_kv_tokens == row.model_peak_kv_tokens == 10 * (256 + 32)
    assert row.actions["draft_skip"] == 10  # the loop thought of every session
    # The winner is a hash hit for sessions 2-10 only when they share the trunk.
    assert row.actions.get("hash_skip", 0) == (0 if distinct else 9)


def test_vllm_backend_row_takes_the_mock_decisions_and_counts_what_vllm_computed():
    params = replace(SMALL, distinct_trunks=True)
    fake = FakeLLMEngine(num_blocks=20_000)
    cfg = real_config(params, 32000, 4096)
    backend = VllmBackend.on_engine(cfg, fake, FAKE_API, pinner=FakePinner(fake))

    def reset():
        backend.close()
        fake.cache.clear()

    row = engine_row("vllm_backend", "small", params, backend,
                     computed=lambda: backend.stats.computed_tokens(), reset=reset)
    mock = engine_row("mock", "small", params, MockBackend(cfg))
    assert row.actions == mock.actions and row.pruned == mock.pruned
    # vLLM recomputes at most a partial page per request beyond what the Engine asked.
    slack = 16 * len(fake.requests)
    assert mock.computed_tokens <= row.computed_tokens < row.submitted_tokens + slack
    assert not any(b.ref for b in fake.cache.values())  # reset released every pin


def test_plain_vllm_row_computes_each_trunk_once():
    fake = FakeLLMEngine()
    distinct = replace(SMALL, distinct_trunks=True)
    row = native_row("small", distinct, fake, FAKE_API, reset=fake.cache.clear)
    assert row.submitted_tokens == 10 * 4 * (256 + 32)
    assert row.computed_tokens == 10 * (256 + 4 * 32) == 3840
    shared = native_row("small", SMALL, fake, FAKE_API, reset=fake.cache.clear)
    # Sessions 2-10 repeat session 1's prompts: only the block under each last token.
    assert shared.computed_tokens == 384 + 9 * 4 * 16


def test_report_prints_ratios_and_plots(tmp_path):
    params = replace(SMALL, sessions=2, distinct_trunks=True)
    fake = FakeLLMEngine()
    rows = [engine_row("mock", "small", params, MockBackend(real_config(params, 32000, 4096))),
            native_row("small", params, fake, FAKE_API, reset=fake.cache.clear)]
    text = format_rows(rows)
    assert "mock / vllm (small, distinct): computed" in text
    plot(rows, tmp_path / "fanout.png")
    assert (tmp_path / "fanout.png").stat().st_size > 0
    assert len(variants()) == 4

