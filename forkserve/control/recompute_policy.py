"""Which decoder layers a reader recomputes under selective recompute (docs/QUALITY.md, mode b).

DroidSpeak's rule: recompute the layers whose reused K/V is furthest from the reader's own,
share the rest. The drift per layer is measured offline (``benchmarks/quality/drift.py``:
``||(h_X - h_W) W|| / ||h_X W||`` over shared contexts); this policy turns that profile and a
budget into ``ForkServeConfig.recompute_layers``, the one place the choice is made. Plain
numbers in, layer indices out: the control plane never sees a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerDrift:
    """A measured drift profile: per decoder layer, how far a reader's base K and V (read
    from another writer) are from its own, relative to its own."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v) or not self.k:
            raise ValueError(f"a drift profile needs one K and one V value per layer, got "
                             f"{len(self.k)} and {len(self.v)}")
        if any(not d >= 0.0 for d in self.k + self.v):  # NaN fails too
            raise ValueError("drift values must be >= 0")

    @property
    def layers(self) -> int:
        return len(self.k)

    def per_layer(self) -> tuple[float, ...]:
        """K and V weigh alike: both feed the same attention."""
        return tuple((a + b) / 2 for a, b in zip(self.k, self.v, strict=True))


def most_drifting(drift: LayerDrift, count: int) -> tuple[int, ...]:
    """The ``count`` layers of largest drift, in layer order (ties: the earlier layer, whose
    error the later layers inherit). 0 shares every layer, ``drift.layers`` recomputes all."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= drift.layers:
        raise ValueError(f"recompute count must be an int in [0, {drift.layers}], got {count!r}")
    scores = drift.per_layer()
    ranked = sorted(range(drift.layers), key=lambda n: (-scores[n], n))
    return tuple(sorted(ranked[:count]))


def resampled(drift: LayerDrift, layers: int) -> LayerDrift:
    """``drift`` measured on a model of another depth, read at ``layers`` layers: layer n takes
    the profile's layer at the same relative depth (nearest). Drift grows with depth (errors
    accumulate through the residual stream), so relative depth is what carries over; a
    profile of the model itself comes back unchanged."""
    if layers < 1:
        raise ValueError(f"a model has at least one layer, got {layers}")
    if layers == drift.layers:
        return drift
    at = [round(n * (drift.layers - 1) / max(1, layers - 1)) for n in range(layers)]
    return LayerDrift(tuple(drift.k[i] for i in at), tuple(drift.v[i] for i in at))
