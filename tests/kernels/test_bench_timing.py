"""benchmarks/kernelbench/timing.py's isolation of a failing column (CPU): a run whose
eager call raises, or whose CUDA-graph capture does, is NaN with its error recorded, and
the others are still captured and replayed together. Capture and replay are stood in for
(no GPU here); what is under test is which columns reach them and what is recorded."""
from __future__ import annotations

import math

from benchmarks.kernelbench import timing


def test_a_column_that_fails_its_call_or_capture_leaves_the_rest_timed(monkeypatch) -> None:
    def ok() -> None:
        return None

    def refuses_capture() -> None:
        return None

    def raises() -> None:
        raise RuntimeError("no kernel for this shape")

    def captured(fn):
        if fn is refuses_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        return fn

    replayed = []
    monkeypatch.setattr(timing, "captured", captured)
    monkeypatch.setattr(timing, "replayed_in_turn",
                        lambda graphs, rounds: replayed.append(sorted(graphs))
                        or {name: 1.5 for name in graphs})
    res: dict = {}
    out = timing.measure_interleaved(res, "device", {"a": ok, "b": refuses_capture,
                                                     "c": raises, "d": ok}, smoke=False)
    assert replayed == [["a", "d"]]
    assert out["a"] == out["d"] == 1.5 and math.isnan(out["b"]) and math.isnan(out["c"])
    assert [e.split(":")[0] for e in res["errors"]] == ["device c", "device b capture"]
    assert timing.runs_once(res, "x", ok) and not timing.runs_once(res, "y", raises)
    assert res["errors"][-1].startswith("y: RuntimeError")
