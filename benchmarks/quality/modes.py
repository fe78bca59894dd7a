"""The rows of the quality table: each KV layout and sharing mode as one strategy object.

A ``Mode`` says how the engine is configured (``ForkServeConfig``: layout, ``share_base``,
recompute layers), what runs before the agents open (a base-model pass over the shared
context), and what holding the shared context costs in KV bytes. ``evaluate.py`` knows
nothing mode-specific beyond this table; ``report.py`` prints the rows in ``ORDER``.

Modes (docs/QUALITY.md says what each one keeps exact):

* ``unified``: merged K/V per adapter, nothing shared across adapters (the reference)
* ``disaggregated``: ForkKV, the writer's base K/V + each reader's own residual (own forward)
* ``full_reuse``: the writer's merged K/V as is
* ``base_activations``: one base pass writes the base and every adapter's residual
* ``neutral``: a base-model pass writes the base (``ShareBase.NEUTRAL``); every agent
  writes its own residual in its own forward (mode a)
* ``recompute<N>``: disaggregated, and the N layers of largest measured drift are kept exact
  per reader (``config.recompute_layers``; mode b). Needs a drift profile (``drift.py``)
* ``no_lora``: no adapter at all
"""
from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from forkserve.backend.protocol import PageKind
from forkserve.config import ForkServeConfig, KVLayout, ShareBase
from forkserve.control.recompute_policy import LayerDrift, most_drifting

REFERENCE = "unified"
RECOMPUTE = re.compile(r"recompute(\d+)$")


class Prelude(str, enum.Enum):
    """What writes the shared context before the agents open."""

    NONE = "none"                          # the round's writer agent, in its own forward
    BASE_ACTIVATIONS = "base_activations"  # Engine.prefill_shared: base + every residual
    NEUTRAL = "neutral"                    # a base-model request over the context


class ContextHolding(str, enum.Enum):
    """Who holds the shared context's K/V once every agent has opened."""

    PER_AGENT = "per_agent"  # a full merged copy per agent (unified)
    ONE_COPY = "one_copy"    # one merged copy for all (full_reuse, no_lora)
    SPLIT = "split"          # one base copy + a residual page side per agent


@dataclass(frozen=True)
class Mode:
    name: str
    kv_layout: KVLayout
    holding: ContextHolding
    share_base: ShareBase = ShareBase.CROSS_ADAPTER
    prelude: Prelude = Prelude.NONE
    lora: bool = True
    recompute: int = 0  # layers recomputed per reader (chosen from the drift profile)

    def config(self, recompute_layers: Sequence[int], **sizes: int) -> ForkServeConfig:
        return ForkServeConfig(kv_layout=self.kv_layout, share_base=self.share_base,
                               recompute_layers=tuple(recompute_layers), node_ttl_s=None, **sizes)

    def context_kv_bytes(self, per_token: Mapping[PageKind, int], tokens: int, agents: int) -> int:
        """KV bytes the shared context occupies with ``agents`` agents on it (``per_token``:
        the backend's measured bytes per token per page kind; a residual page carries the
        recomputed layers' own K/V)."""
        if self.holding is ContextHolding.PER_AGENT:
            return agents * tokens * per_token[PageKind.UNIFIED]
        if self.holding is ContextHolding.ONE_COPY:
            return tokens * per_token[PageKind.UNIFIED]
        return tokens * (per_token[PageKind.BASE] + agents * per_token[PageKind.RESIDUAL])


_FIXED = (
    Mode("unified", KVLayout.UNIFIED, ContextHolding.PER_AGENT),
    Mode("disaggregated", KVLayout.DISAGGREGATED, ContextHolding.SPLIT),
    Mode("full_reuse", KVLayout.FULL_REUSE, ContextHolding.ONE_COPY),
    Mode("base_activations", KVLayout.DISAGGREGATED, ContextHolding.SPLIT,
         prelude=Prelude.BASE_ACTIVATIONS),
    Mode("neutral", KVLayout.DISAGGREGATED, ContextHolding.SPLIT, ShareBase.NEUTRAL,
         Prelude.NEUTRAL),
    Mode("no_lora", KVLayout.UNIFIED, ContextHolding.ONE_COPY, lora=False),
)
FIXED = {m.name: m for m in _FIXED}
# The default run: every fixed mode and a recompute sweep (SmolLM2 has 30 layers).
DEFAULT = ("unified", "disaggregated", "full_reuse", "base_activations", "neutral", "recompute5",
           "recompute10", "recompute15", "no_lora")
ORDER = DEFAULT


def mode(name: str) -> Mode:
    """The mode called ``name``: a fixed one, or ``recompute<N>``."""
    if name in FIXED:
        return FIXED[name]
    m = RECOMPUTE.match(name)
    if m is None:
        raise ValueError(f"unknown mode {name!r}; known: {sorted(FIXED)} and recompute<N>")
    return Mode(name, KVLayout.DISAGGREGATED, ContextHolding.SPLIT, recompute=int(m.group(1)))


def order_key(name: str) -> tuple[int, int, str]:
    """Table order: the default run's order, other recompute counts beside theirs, rest last."""
    m = RECOMPUTE.match(name)
    if name in ORDER:
        return ORDER.index(name), 0, name
    if m is not None:
        return ORDER.index("recompute5"), int(m.group(1)), name
    return len(ORDER), 0, name


def load_drift(path: Path) -> LayerDrift:
    """The drift profile readers of another adapter's base pages see (``drift.py``'s
    ``adapter_writer``: the mean over adapter pairs)."""
    d = json.loads(path.read_text())["adapter_writer"]
    return LayerDrift(tuple(d["k"]), tuple(d["v"]))


def recompute_layers(m: Mode, drift: LayerDrift | None) -> tuple[int, ...] | None:
    """The layers ``m`` recomputes; None when it needs a drift profile and has none."""
    if not m.recompute:
        return ()
    if drift is None:
        return None
    return most_drifting(drift, m.recompute)
