"""Means with bootstrap 95% confidence intervals, resampling rounds (not answers).

The agents of one round share a catalog and, in the sharing layouts, one writer's K/V: their
answers are not independent. So the bootstrap draws whole rounds with replacement and takes
the mean over every observation in the drawn rounds (a cluster bootstrap); with one agent
per round it is the ordinary bootstrap. Percentile interval, fixed seed: the same units give
the same table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

RESAMPLES = 4000


@dataclass(frozen=True)
class Estimate:
    mean: float
    low: float      # 95% interval
    high: float
    n: int          # observations
    clusters: int   # rounds they came from

    def fmt(self, scale: float = 1.0, digits: int = 1) -> str:
        return (f"{self.mean * scale:+.{digits}f} [{self.low * scale:+.{digits}f}, "
                f"{self.high * scale:+.{digits}f}]")

    def fmt_share(self) -> str:
        return f"{self.mean:.1%} [{self.low:.1%}, {self.high:.1%}]"


def bootstrap(values: Sequence[float], clusters: Sequence[int], resamples: int = RESAMPLES,
              seed: int = 0, level: float = 0.95) -> Estimate:
    """Mean of ``values`` and its interval; ``clusters[i]`` is the round of ``values[i]``."""
    if len(values) != len(clusters):
        raise ValueError("one cluster id per value")
    if not values:
        raise ValueError("no observations")
    x = np.asarray(values, dtype=np.float64)
    ids, index = np.unique(np.asarray(clusters), return_inverse=True)
    sums = np.bincount(index, weights=x, minlength=len(ids))
    counts = np.bincount(index, minlength=len(ids)).astype(np.float64)
    draws = np.random.default_rng(seed).integers(0, len(ids), size=(resamples, len(ids)))
    means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Estimate(float(x.mean()), float(low), float(high), len(x), len(ids))
