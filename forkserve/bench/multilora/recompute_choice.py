"""Which layers the bench's ``recompute<N>`` systems recompute, and where that choice came from.

The quality benchmark picks them from a drift profile measured on its model
(``benchmarks/quality/drift.py``; ``control/recompute_policy.py`` decides). The bench runs
another model (the 8B shape, or the tiny one on the CPU) with random adapters, which have no
profile of their own, so by default it takes the committed SmolLM2 profile, read at the
bench model's depth; ``--drift`` names another. Speed depends on how many layers are
recomputed, hardly on which, so the borrowed profile is good enough for a speed figure; each
row says which profile chose its layers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from forkserve.control.recompute_policy import LayerDrift, most_drifting, resampled

# The SmolLM2-135M profile of the H200 quality run (docs/QUALITY.md), beside this checkout.
DEFAULT_DRIFT = Path(__file__).resolve().parents[3] / "benchmarks" / "results" \
    / "quality_h200_drift.json"


def load_drift(path: Path) -> LayerDrift:
    """The drift profile readers of another adapter's base pages see (``drift.py``'s
    ``adapter_writer``: the mean over adapter pairs)."""
    try:
        d = json.loads(Path(path).read_text())["adapter_writer"]
    except FileNotFoundError:
        raise FileNotFoundError(f"drift profile {path} does not exist (benchmarks/quality/"
                                "drift.py writes one; --drift names it)") from None
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a drift profile of drift.py ({e!r})") from None
    return LayerDrift(tuple(d["k"]), tuple(d["v"]))


@dataclass(frozen=True)
class RecomputeChoice:
    layers: tuple[int, ...]
    model_layers: int
    profile: Path
    profile_layers: int

    def note(self) -> str:
        read = "" if self.profile_layers == self.model_layers else \
            f", its {self.profile_layers} layers read at this model's depth"
        return (f"recompute layers {list(self.layers)} of {self.model_layers}: the most drifting "
                f"by {self.profile.name}{read}")


def choose(count: int, model_layers: int, profile: Path | None = None) -> RecomputeChoice:
    """The ``count`` most drifting layers of a ``model_layers``-layer model by ``profile``
    (None: the committed SmolLM2 one)."""
    path = DEFAULT_DRIFT if profile is None else Path(profile)
    drift = load_drift(path)
    layers = most_drifting(resampled(drift, model_layers), count)
    return RecomputeChoice(layers, model_layers, path, drift.layers)
