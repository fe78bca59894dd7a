"""The card's SM clock, power and temperature through a timed region, sampled by an
``nvidia-smi`` child process.

Prefill drives an H100 or H200 to its power cap, where the SM clock falls as the card
heats (1,980 MHz at rest, 1,290-1,620 at the 700 W cap in round 36). Two systems timed one
after the other may then differ by the card alone. A run records what the card did, so a
reader can tell a slower system from a hotter card.

``ClockSampler`` owns its child: ``__exit__`` always ends it, whether the region raised or
not. Where there is no card (a CPU run) or no ``nvidia-smi``, nothing is started and the
summary stays None.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import IO

QUERY = "clocks.sm,power.draw,temperature.gpu"


@dataclass(frozen=True)
class ClockSummary:
    """What the card did over a region: samples taken, SM clock (mean and lowest), mean
    power draw and the highest temperature."""

    samples: int
    sm_mhz_mean: float
    sm_mhz_min: float
    power_w_mean: float
    temp_c_max: float

    def line(self) -> str:
        return (f"SM {self.sm_mhz_mean:,.0f} MHz mean (min {self.sm_mhz_min:,.0f}), "
                f"{self.power_w_mean:.0f} W, {self.temp_c_max:.0f} C max")


def summarize(lines: list[str]) -> ClockSummary | None:
    """Lines of ``nvidia-smi --format=csv,noheader,nounits`` for ``QUERY``; a line with a
    field the card did not report ("[N/A]") is left out. None: no usable line."""
    rows = []
    for line in lines:
        try:
            clock, power, temp = (float(x) for x in line.split(","))
        except ValueError:
            continue
        rows.append((clock, power, temp))
    if not rows:
        return None
    clocks, powers, temps = zip(*rows, strict=True)
    return ClockSummary(len(rows), round(sum(clocks) / len(rows), 1), min(clocks),
                        round(sum(powers) / len(rows), 1), max(temps))


class ClockSampler:
    """``with ClockSampler(card) as s: ...`` then ``s.summary``. ``card``: what
    ``nvidia-smi --id`` takes (an index or a "GPU-<uuid>"; None: no card, nothing sampled);
    ``period_ms``: between samples."""

    def __init__(self, card: str | None, period_ms: int = 250, command: str = "nvidia-smi") -> None:
        self.card = card
        self.period_ms = period_ms
        self.command = command
        self.summary: ClockSummary | None = None
        self._proc: subprocess.Popen | None = None
        self._out: IO[str] | None = None

    def __enter__(self) -> ClockSampler:
        exe = shutil.which(self.command) if self.card is not None else None
        if exe is None:
            return self
        # A file, not a pipe: nobody reads while the region runs, and a pipe would fill.
        self._out = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            [exe, f"--id={self.card}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             f"-lms={self.period_ms}"], stdout=self._out, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None or self._out is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._out.seek(0)
        self.summary = summarize(self._out.read().splitlines())
        self._out.close()
        self._proc = self._out = None


def card_of(device) -> str | None:
    """``nvidia-smi``'s id of a torch CUDA device (its UUID: CUDA's index and NVML's may
    differ under CUDA_VISIBLE_DEVICES); None for any other device."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
