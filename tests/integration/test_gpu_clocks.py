"""bench/gpu_clocks.py: a stand-in ``nvidia-smi`` (a shell script printing what the real one
prints for the query, then waiting as its -lms loop does) is sampled over a region and ended
on exit; lines with an unreported field are left out; no card or no command starts nothing."""
from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from forkserve.bench.gpu_clocks import QUERY, ClockSampler, ClockSummary, summarize


def fake_smi(tmp_path: Path, lines: list[str]) -> tuple[Path, Path, Path]:
    """The script, the file it writes its arguments to, and the file it touches once it has
    printed (so the test waits for real output, not for a guessed time)."""
    args, printed = tmp_path / "args", tmp_path / "printed"
    script = tmp_path / "nvidia-smi"
    body = "".join(f"echo '{line}'\n" for line in lines)
    script.write_text(f'#!/bin/sh\necho "$@" > {args}\n{body}touch {printed}\nexec sleep 60\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, args, printed


def test_a_region_is_sampled_and_the_child_ended(tmp_path):
    script, args, printed = fake_smi(tmp_path, ["1980, 120.5, 37", "1410, 695.0, 58",
                                                "[N/A], 100.0, 40", "1620, 690.5, 59"])
    with ClockSampler("GPU-abc", period_ms=100, command=str(script)) as sampler:
        for _ in range(200):
            if printed.exists():
                break
            time.sleep(0.05)
        child = sampler._proc
        assert child is not None and child.poll() is None
    assert child.poll() is not None  # ended on exit, not left sampling
    assert sampler.summary == ClockSummary(3, 1670.0, 1410.0, 502.0, 59.0)
    assert args.read_text().split() == ["--id=GPU-abc", f"--query-gpu={QUERY}",
                                        "--format=csv,noheader,nounits", "-lms=100"]
    assert "SM 1,670 MHz mean (min 1,410), 502 W, 59 C max" == sampler.summary.line()


def test_the_child_is_ended_when_the_region_raises(tmp_path):
    script, _, _ = fake_smi(tmp_path, ["1980, 120.5, 37"])
    with pytest.raises(RuntimeError), ClockSampler("0", command=str(script)) as sampler:
        child = sampler._proc
        raise RuntimeError("the run failed")
    assert child.poll() is not None


def test_no_card_or_no_command_starts_nothing(tmp_path):
    script, args, _ = fake_smi(tmp_path, ["1980, 120.5, 37"])
    with ClockSampler(None, command=str(script)) as sampler:
        assert sampler._proc is None
    assert sampler.summary is None and not args.exists()
    with ClockSampler("0", command=str(tmp_path / "missing")) as sampler:
        assert sampler._proc is None
    assert sampler.summary is None


def test_lines_without_a_figure_summarize_to_none():
    assert summarize(["[N/A], [N/A], 40", "", "No devices were found"]) is None
    assert summarize(["1000, 100, 30", "2000, 300, 50"]) == ClockSummary(2, 1500.0, 1000.0,
                                                                         200.0, 50.0)


def test_the_bench_records_none_on_the_cpu(tmp_path):
    """A CPU run's rows carry no clocks (no card); a row with them prints its clock line."""
    import json
    from dataclasses import asdict, replace

    from forkserve.bench.multilora import RunResult, main
    from forkserve.bench.multilora.report import format_table

    assert main(["react", "--tiny", "--workflows", "1", "--systems", "unified", "--context",
                 "64", "--turns", "1", "--gen", "2", "--out", str(tmp_path)]) == 0
    [row] = json.loads((tmp_path / "react_multilora_tiny.json").read_text())["results"]
    assert row["gpu_clocks"] is None
    r = RunResult.from_json(row)
    assert "the card" not in format_table([r], "react")
    hot = replace(r, gpu_clocks=asdict(ClockSummary(9, 1500.0, 1290.0, 650.0, 59.0)))
    assert ("unified W=1: the card through the run: SM 1,500 MHz mean (min 1,290), 650 W, "
            "59 C max") in format_table([hot], "react")


def test_only_the_timed_runs_sample_the_card(tmp_path, monkeypatch):
    """The warm-up and each rehearsal run too, untimed: with a card to sample, only the
    timed runs start ``nvidia-smi`` (one a system and W), so no child runs for figures that
    nobody reads."""
    from forkserve.bench.multilora import main, workload

    cards = []

    class Recording(ClockSampler):
        def __enter__(self):
            cards.append(self.card)
            return self  # starts no child: nothing here has a card

    monkeypatch.setattr(workload, "card_of", lambda device: "GPU-x")
    monkeypatch.setattr(workload, "ClockSampler", Recording)
    assert main(["react", "--tiny", "--workflows", "1", "2", "--systems", "unified",
                 "--context", "64", "--turns", "1", "--gen", "2", "--warmup",
                 "--out", str(tmp_path)]) == 0
    assert sorted(cards, key=str) == ["GPU-x", "GPU-x", None, None, None]
