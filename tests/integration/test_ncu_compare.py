"""benchmarks/ncu_compare.py: ncu raw pages side by side (h200_issue15.sh 73)."""
from __future__ import annotations

import json

import pytest

from benchmarks import ncu_compare


def raw_page(time_us: str, inst: str, barrier: float, wait: float) -> str:
    """An ``ncu --csv --page raw`` output as ncu prints it after the application's lines:
    a header, a units row, one launch (numbers with thousands separators)."""
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "smsp__inst_executed.sum",
              "launch__registers_per_thread",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_not_issued_per_issue_active.ratio"]
    units = ["", "", "ns", "inst", "register/thread", "ratio", "ratio", "ratio"]
    row = ["0", "k(int, float)", time_us, inst, "168", str(barrier), str(wait), "9.0"]
    quote = lambda cells: ",".join(f'"{c}"' for c in cells)  # noqa: E731
    return "\n".join(["ws prefill ...: 0.2460 ms (graph replay)", "==PROF== Disconnected",
                      quote(header), quote(units), quote(row)]) + "\n"


def test_two_runs_side_by_side(tmp_path, capsys):
    fa4 = tmp_path / "fa4.csv"
    ws = tmp_path / "ws.csv"
    fa4.write_text(raw_page("135,500", "1,000,000", 0.2, 1.5))
    ws.write_text(raw_page("246,000", "2,500,000", 2.1, 1.0))
    out = tmp_path / "cmp" / "ncu.json"
    assert ncu_compare.main([f"fa4={fa4}", f"ws={ws}", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    row = saved["table"]["warp instructions"]
    assert row["values"] == {"fa4": 1_000_000.0, "ws": 2_500_000.0}
    assert row["over_fa4"]["ws"] == pytest.approx(2.5)
    time = saved["table"]["time (us)"]  # ncu's nanoseconds, in microseconds
    assert time["values"]["fa4"] == pytest.approx(135.5)
    assert time["over_fa4"]["ws"] == pytest.approx(246 / 135.5)
    # Stall reasons by size, the "not issued" total left out; the raw page kept whole.
    assert list(saved["stalls"]["ws"]) == ["barrier", "wait"]
    assert list(saved["stalls"]["fa4"]) == ["wait", "barrier"]
    assert saved["raw"]["ws"]["Kernel Name"] == "k(int, float)"
    printed = capsys.readouterr().out
    assert "2,500,000.00 (2.50x)" in printed and "ws: barrier 2.10, wait 1.00" in printed
    # A metric a run lacks is a dash, not an error.
    assert saved["table"]["blocks"]["values"] == {"fa4": None, "ws": None}


@pytest.mark.parametrize("bad", ["no_equals", "missing", "no_page"])
def test_an_unusable_input_is_one_line(tmp_path, capsys, bad):
    page = tmp_path / "p.csv"
    page.write_text("==PROF== No kernels were profiled.\n")
    arg = {"no_equals": str(page), "missing": f"x={tmp_path / 'absent.csv'}",
           "no_page": f"x={page}"}[bad]
    assert ncu_compare.main([arg]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncu_compare: ") and err.count("\n") == 1


def source_page(rows: list[tuple[str, str, str, str]]) -> str:
    """An ``ncu --page source --print-source sass --csv`` output: the kernel's name, a
    header, one row per SASS instruction (address, text, stall samples, executed)."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
              "Instructions Executed", "stall_barrier", "stall_wait",
              "stall_barrier (Not Issued)"]
    quote = lambda cells: ",".join(f'"{c}"' for c in cells)  # noqa: E731
    lines = ['"Kernel Name","k",', quote(header)]
    for addr, text, samples, executed in rows:
        barrier = samples if "USETMAXREG" in text else "0"
        lines.append(quote([addr, f"      {text}", samples, executed, barrier,
                            "0" if barrier != "0" else samples, "0"]))
    return "\n".join(lines) + "\n"


def test_source_pages_by_class(tmp_path, capsys):
    """``--source``: executed instructions by class and opcode over ``--per``, stall samples
    by class and reason, the warps parked at ``USETMAXREG`` counted apart."""
    a = tmp_path / "a.csv"
    b = tmp_path / "b.csv"
    a.write_text(source_page([("0x10", "FMUL R1, R2, R3 ;", "4", "1,000"),
                              ("0x20", "@P0 MUFU.EX2 R4, R5 ;", "2", "500"),
                              ("0x30", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;", "1",
                               "100")]))
    b.write_text(source_page([("0x10", "FMUL R1, R2, R3 ;", "6", "3,000"),
                              ("0x20", "UIADD3 UR4, UR4, 0x40, URZ ;", "2", "1,000"),
                              ("0x30", "USETMAXREG.DEALLOC.CTAPOOL 0x28 ;", "900", "3")]))
    out = tmp_path / "src.json"
    assert ncu_compare.main(["--source", "--per", "10", f"a={a}", f"b={b}",
                             "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs["a"]["instructions"] == 160.0
    assert runs["a"]["by_class"]["fp32"] == 100.0 and runs["a"]["by_class"]["exp2"] == 50.0
    assert runs["a"]["by_class"]["wgmma"] == 10.0
    assert runs["b"]["by_class"]["uniform"] == 100.0  # UIADD3; the parked row left out
    assert runs["b"]["instructions"] == 400.0
    assert runs["b"]["parked_samples"] == 900.0 and runs["b"]["stall_samples"] == {
        "wait": 8.0, "barrier": 0.0}
    assert runs["a"]["top_opcodes"] == {"FMUL": 100.0, "MUFU": 50.0, "HGMMA": 10.0}
    printed = capsys.readouterr().out
    assert "parked at setmaxnreg: 900 (apart)" in printed and "(2.50x)" in printed


def test_source_needs_a_source_page(tmp_path, capsys):
    raw = tmp_path / "raw.csv"
    raw.write_text(raw_page("1", "1", 0.1, 0.1))
    assert ncu_compare.main(["--source", f"x={raw}"]) == 2
    assert "no ncu source page" in capsys.readouterr().err


def test_source_pages_list_each_mbarrier_wait_with_its_retries(tmp_path, capsys):
    """A try-wait's later rows of the same text (the retry blocks after the kernel's body)
    are its retries; the branch after the wait samples its warps too; the waits come most
    retried first."""
    page = tmp_path / "w.csv"
    ready = "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR10+0x36210], R24 ;"
    full_k = "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x361f0], R58 ;"
    page.write_text(source_page([
        ("0x10", ready, "13", "1,000"), ("0x20", "@!P2 BRA 0x400 ;", "700", "1,000"),
        ("0x30", full_k, "4", "1,000"), ("0x40", "@!P0 BRA 0x410 ;", "50", "1,000"),
        ("0x50", "FMUL R1, R2, R3 ;", "9", "1,000"),
        ("0x400", "@!P2 " + ready, "1", "11,000"), ("0x410", full_k, "0", "50")]))
    out = tmp_path / "w.json"
    assert ncu_compare.main(["--source", f"x={page}", "--out", str(out)]) == 0
    waits = json.loads(out.read_text())["runs"]["x"]["waits"]
    assert [(w["address"], w["tries"], w["retries"], w["retries_per_try"], w["samples"])
            for w in waits] == [("0x10", 1000.0, 11000.0, 11.0, 714.0),
                                ("0x30", 1000.0, 50.0, 0.05, 54.0)]
    assert waits[0]["wait"] == ready  # the retry's predicate dropped: one wait
    assert "wait at 0x10: 11.0 retries a try" in capsys.readouterr().out
