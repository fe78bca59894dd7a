"""benchmarks/residual_prefill_bench.py at its smoke shapes (CPU, Triton interpreter): every
case row names the route the policy takes and times each route eagerly and, where a graph
holds it, by device time, as ratios to the best unified route; the JSON and PNG land."""
from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_script import load_script

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU smoke shapes; on CUDA run the bench itself")


def test_smoke_rows(tmp_path) -> None:
    bench = load_script("residual_prefill_bench")
    assert bench.main(["--smoke", "--out", str(tmp_path), "--tag", "rp", "--warm-jobs", "2"]) == 0
    res = json.loads((tmp_path / "rp.json").read_text())
    # Two spawned processes built the Triton routes of both cases: paged and fused at each.
    assert res["warm"]["jobs"] == 2 and res["warm"]["calls"] == 4
    assert [(r["batch"], r["new"], r["keys"]) for r in res["rows"]] == bench.SMOKE_CASES
    for row in res["rows"]:
        # No FA4 nor ws on CPU: the Triton routes, the policy's pick recorded with them.
        assert row["policy_route"] in ("fused", "merged") and row["baseline"] == "paged"
        assert set(row["residual"]) == {"fused", "flash", "auto"}
        assert row["over_baseline"]["fused"] == pytest.approx(
            row["residual"]["fused"] / row["unified"]["paged"])
        assert set(row["device"]) == {"unified_paged", "residual_fused"}
        assert row["device_over_best_unified"]["unified_paged"] == pytest.approx(1.0)
    assert (tmp_path / "rp.png").stat().st_size > 0


def test_the_warm_up_shares_call_every_triton_route_once() -> None:
    """The workers' shares are disjoint and together call every route at every case but
    FA4's (built in the timed process) and ``auto`` (one of the others)."""
    bench = load_script("residual_prefill_bench")
    shares = [bench.warm_share((True, None, frozenset(), i, 3)) for i in range(3)]
    called = [c for share in shares for c in share]
    assert len(called) == len(set(called))
    assert sorted(called) == sorted(f"{b}x{n}/{k} {route}" for b, n, k in bench.SMOKE_CASES
                                    for route in ("paged", "fused"))
    assert not set(bench.NOT_WARMED) & {c.split()[1] for c in called}


def test_an_unknown_launch_to_skip_is_one_line(tmp_path, capsys) -> None:
    bench = load_script("residual_prefill_bench")
    with pytest.raises(SystemExit) as e:
        bench.main(["--smoke", "--out", str(tmp_path), "--skip-launches", "ws_m96_s3"])
    assert e.value.code == 2
    assert "unknown ws launch ws_m96_s3" in capsys.readouterr().err.splitlines()[-1]


def test_the_wide_verdict_adopts_only_a_launch_faster_at_every_case() -> None:
    """At 128 rows (64-token chunks at GQA 4) of the launches faster than the ws default at
    every case, the one lowest over the best unified route at its worst case is adopted
    (what row 3 reads), not the one lowest over the default: here the second, slower than
    the first at the 512-token case but faster where FA4 is hardest to match. At 64 rows
    (16-token chunks) one slower at a case is not, and a launch missing at a case is not
    judged."""
    bench = load_script("residual_prefill_bench")
    fast, faster, lone = "wide_m128_r200_c16_bf16", "wide_m128_r200_c16_bf16_ta", \
        "wide_m64_r232_c64_bf16_ta"

    def row(new: int, ws: float, best_unified: float, **times: float) -> dict:
        device = {"residual_ws": ws, **{f"residual_{n}": t for n, t in times.items()}}
        return {"batch": 8, "new": new, "keys": 8192 + new, "device": device,
                "device_over_best_unified": {n: t / best_unified for n, t in device.items()}}

    res = {"shape": {"n_heads": 32, "n_kv": 8}, "rows": [
        row(64, 1.0, 0.5, **{fast: 0.9, faster: 0.8}),
        row(512, 2.0, 2.0, **{fast: 1.4, faster: 1.5}),
        row(16, 1.0, 1.0, **{lone: 0.9, "wide_m64_r232_c32_bf16": 0.8}),
        row(8, 1.0, 1.0, **{lone: 1.1})]}
    verdict = bench.wide_verdict(res)
    assert verdict["128"]["cases"] == ["8x64/8256", "8x512/8704"]
    assert verdict["128"]["worst"] == {fast: pytest.approx(0.9), faster: pytest.approx(0.8)}
    assert verdict["128"]["worst_over_unified"] == {fast: pytest.approx(1.8),
                                                    faster: pytest.approx(1.6)}
    assert verdict["128"]["adopt"] == faster and verdict["128"]["key"] == [4, 128]
    assert verdict["128"]["fields"] == [2, 200, 16, True, False, False, True, False, False,
                                        False, 1, False, 2, False]
    assert verdict["64"]["worst"] == {lone: pytest.approx(1.1)}  # c32 missing at 8 tokens
    assert verdict["64"]["adopt"] is None and verdict["64"]["fields"] is None
    # The faster launch off the fused kernel's output at a case: listed, and the other taken.
    res["rows"][1]["wide_rel_err_vs_fused"] = {faster: 0.3, fast: 4e-3}
    verdict = bench.wide_verdict(res)
    assert verdict["128"]["wrong"] == [faster] and verdict["128"]["adopt"] == fast
    res["rows"][0]["wide_rel_err_vs_fused"] = {fast: float("nan")}  # NaN is never a match
    assert bench.wide_verdict(res)["128"]["adopt"] is None


def test_the_wide_verdict_wants_more_than_the_timings_spread() -> None:
    """The default launch (at 128 rows, GQA 4: ``default_launch(64)``) measured under its
    own name beside the ws column, which runs it too: its straying from 1 (here 3%) is the
    timing's spread, and a launch has to be faster than the default by more at every
    case."""
    from forkserve.kernels.residual_prefill_gluon import default_launch

    bench = load_script("residual_prefill_bench")
    default, near, far = (default_launch(64).name, "wide_m128_r200_c16_bf16_pp_ta_el",
                          "wide_m128_r200_c16_bf16")

    def row(new: int, **times: float) -> dict:
        device = {"residual_ws": 1.0, **{f"residual_{n}": t for n, t in times.items()}}
        return {"batch": 8, "new": new, "keys": 8192 + new, "device": device,
                "device_over_best_unified": device}

    res = {"shape": {"n_heads": 32, "n_kv": 8}, "rows": [
        row(64, **{default: 0.97, near: 0.98, far: 0.95}),
        row(512, **{default: 1.01, near: 0.98, far: 0.96})]}
    verdict = bench.wide_verdict(res)["128"]
    assert verdict["spread"] == pytest.approx(0.03)
    assert verdict["adopt"] == far
    res["rows"][1]["device"][f"residual_{far}"] = 0.975  # within the spread: not adopted
    verdict = bench.wide_verdict(res)["128"]
    assert verdict["adopt"] is None and verdict["worst"][near] == pytest.approx(0.98)


def test_a_unified_route_that_raises_is_left_out_of_the_baseline(monkeypatch) -> None:
    """A library route may refuse a case on the GPU (FA4's key splits did on SM 9.0): the row
    then records the refusal and takes the fastest of the other unified routes, in eager and
    device time alike."""
    bench = load_script("residual_prefill_bench")
    real = bench.case_routes

    def with_a_refusal(*args, **kwargs):
        case = real(*args, **kwargs)

        def refuses():
            raise RuntimeError("SplitKV not supported on SM 9.0")
        return case._replace(unified={**case.unified, "refusing": refuses})

    monkeypatch.setattr(bench, "case_routes", with_a_refusal)
    row = bench.run_case(bench.Setup(True), *bench.SMOKE_CASES[0])
    assert set(row["unified"]) == {"paged"} and row["baseline"] == "paged"
    assert "unified_refusing" not in row["device"]
    assert row["errors"] == ["unified refusing: RuntimeError('SplitKV not "
                             "supported on SM 9.0')"]
