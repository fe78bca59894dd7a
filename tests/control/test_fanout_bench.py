"""The fan-out table: the arithmetic of workloads.md, and the cascade's figures."""
import json

import pytest

from forkserve.bench.fanout import FanoutParams, main, run_system
from forkserve.config import PrefixDedup


@pytest.fixture(scope="module")
def rows():
    """The seed's arithmetic: every open computes its own trunk (no in-flight dedup)."""
    params = FanoutParams(prefix_dedup=PrefixDedup.OFF)
    return {s: run_system(s, params) for s in ("apc", "alias", "disagg", "cascade")}


def test_in_flight_dedup_computes_the_shared_trunk_once():
    """Ten sessions opened in one wave on one trunk: the first computes its 256 tokens, the
    nine others wait for its pages and recompute only the last page (its logits are needed).
    apc's 40 requests (4 distinct thoughts x 10 equal trunks) compute what plain vLLM does:
    one trunk + thought, three more thoughts, and the last page of the 36 repeats."""
    params = FanoutParams()
    assert params.prefix_dedup is PrefixDedup.IN_FLIGHT
    apc, cascade = run_system("apc", params), run_system("cascade", params)
    assert apc.prefill_tokens == 288 + 3 * 32 + 36 * 16 == 960
    assert cascade.prefill_tokens == 256 + 9 * 16 + 32 + 320 + 320 == 1072
    assert cascade.transfer_tokens == 672 and cascade.peak_kv_tokens == 2880


def test_apc_alias_disagg_rows_equal_the_arithmetic(rows):
    s, t, r, k = 10, 256, 32, 4
    assert rows["apc"].prefill_tokens == s * k * (t + r) == 11520
    assert rows["apc"].prefill_calls == s * k
    assert rows["apc"].fanout_ms == pytest.approx(0.021 * 40 + 0.012 * 11520)
    assert rows["alias"].prefill_tokens == s * (t + k * r) == 3840
    assert rows["alias"].peak_kv_tokens == 3840
    assert rows["alias"].fanout_ms == pytest.approx(47.1, abs=0.05)
    assert rows["disagg"].transfer_tokens == rows["disagg"].prefill_tokens == 11520
    assert rows["disagg"].fanout_ms == pytest.approx(162.1, abs=0.05)
    assert rows["apc"].peak_kv_tokens == rows["disagg"].peak_kv_tokens == 11520


def test_cascade_row(rows):
    c = rows["cascade"]
    assert c.peak_kv_tokens == 10 * (256 + 32) == 2880
    assert c.pruned == 10
    assert c.prefill_tokens == 3232 and c.transfer_tokens == 672
    assert c.actions == {"prefill": 11, "hash_skip": 9, "draft_skip": 10, "early_abort": 10}
    assert c.probe_aborts == 10  # the illegal thought never clears tau


def test_cli_writes_json_and_png_and_says_where(tmp_path, capsys):
    assert main(["--sessions", "3", "--prefix-dedup", "off", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fanout.json").read_text())
    assert [r["system"] for r in data["rows"]] == ["apc", "alias", "disagg", "cascade"]
    assert data["rows"][0]["prefill_tokens"] == 3 * 4 * 288
    assert (tmp_path / "fanout.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "cascade" in out
    assert f"wrote {tmp_path / 'fanout.json'}" in out and f"wrote {tmp_path / 'fanout.png'}" in out
