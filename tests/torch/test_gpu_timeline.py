"""GpuTimeline: off by default; on, it pairs consecutive decode steps and splits their
device time into busy and idle (the host's planning between them)."""
from __future__ import annotations

import time

from torch_testlib import make_config, prompt, work

from forkserve.backend.torch import TorchBackend


def test_timeline_is_off_by_default_and_pairs_decode_steps(models) -> None:
    backend = TorchBackend(make_config(), models["llama"], device="cpu")
    assert backend.gpu_timeline is None
    backend.step([work(0, prompt(0, 8), 0)])  # no timeline: nothing recorded, nothing breaks
    timeline = backend.record_gpu_timeline()
    backend.step([work(1, prompt(1, 8), 0)])  # a prefill: never part of a decode pair
    for pos in range(8, 11):
        backend.step([work(1, [5], pos, decode=True)])
        time.sleep(0.02)  # the host "plans" between decode steps: the device idles
    summary = timeline.summary()
    assert summary.decode_steps == 3
    assert summary.idle_ms >= 2 * 20  # two gaps between the three decode steps
    assert summary.busy_ms > 0
    assert summary.idle_share == summary.idle_ms / (summary.idle_ms + summary.busy_ms)
    timeline.reset()
    assert timeline.summary().decode_steps == 0
