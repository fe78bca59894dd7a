"""The rows of the quality table: each KV layout and sharing mode as one strategy object.

A ``Mode`` says how the engine is configured (``ForkServeConfig``: layout, ``share_base``,
recompute layers), which adapters its agents run (plain LoRA, activated LoRA, none), what
runs before the agents open (a base-model pass over the shared context), whether an agent may
reuse published pages at all, which mode its readers are paired with, and what holding the
shared context costs in KV bytes. ``evaluate.py`` knows nothing mode-specific beyond this
table; ``report.py`` prints the rows in ``ORDER``.

Modes (docs/QUALITY.md says what each one keeps exact):

* ``unified``: merged K/V per adapter, nothing shared across adapters (the reference)
* ``disaggregated``: ForkKV, the writer's base K/V + each reader's own residual (own forward)
* ``full_reuse``: the writer's merged K/V as is
* ``base_activations``: one base pass writes the base and every adapter's residual
* ``neutral``: a base-model pass writes the base (``ShareBase.NEUTRAL``); every agent
  writes its own residual in its own forward (mode a)
* ``recompute<N>``: disaggregated, and the N layers of largest measured drift are kept exact
  per reader (``config.recompute_layers``; mode b). Needs a drift profile (``drift.py``)
* ``offset<R>``: disaggregated, and each reader corrects the writer's base K/V on read by the
  pair's offset fitted on anchor prompts (``config.base_correction``; mode d): rank R of the
  ridge map from the writer's base K/V (0: the mean offset alone). ``offset`` is ``offset16``.
  Eager attention (the only path that applies it)
* ``no_lora``: no adapter at all
* ``alora_unified``: the activated-LoRA adapters (``train.py --alora``), every agent prefilling
  its whole prompt (no published page reused): the reference of the aLoRA rows
* ``alora``: the activated-LoRA adapters sharing the writer's catalog pages, which hold the
  base model's K/V (the adapter starts at the assistant-turn opener, after the catalog); its
  readers are paired with ``alora_unified`` (exact by construction: measured, not assumed)
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from forkserve.backend.protocol import PageKind
from forkserve.config import BaseCorrection, ForkServeConfig, KVLayout, ShareBase
from forkserve.control.recompute_policy import LayerDrift, most_drifting

REFERENCE = "unified"
RECOMPUTE = re.compile(r"recompute(\d+)$")
OFFSET = re.compile(r"offset(\d*)$")
OFFSET_RANK = 16  # ``offset`` alone: a rank that fits SmolLM2's 192-wide K/V in ~1.5 MB per pair


class Prelude(str, enum.Enum):
    """What writes the shared context before the agents open."""

    NONE = "none"                          # the round's writer agent, in its own forward
    BASE_ACTIVATIONS = "base_activations"  # Engine.prefill_shared: base + every residual
    NEUTRAL = "neutral"                    # a base-model request over the context


class Adapters(str, enum.Enum):
    """Which adapters the agents run."""

    LORA = "lora"    # the plain LoRA folder (``--adapters``)
    ALORA = "alora"  # the activated-LoRA folder (``--alora-adapters``, ``train.py --alora``)
    NONE = "none"    # the base model


class ContextHolding(str, enum.Enum):
    """Who holds the shared context's K/V once every agent has opened."""

    PER_AGENT = "per_agent"  # a full merged copy per agent (unified)
    ONE_COPY = "one_copy"    # one merged copy for all (full_reuse, no_lora; alora: base K/V)
    SPLIT = "split"          # one base copy + a residual page side per agent


@dataclass(frozen=True)
class Mode:
    name: str
    kv_layout: KVLayout
    holding: ContextHolding
    share_base: ShareBase = ShareBase.CROSS_ADAPTER
    prelude: Prelude = Prelude.NONE
    adapters: Adapters = Adapters.LORA
    recompute: int = 0  # layers recomputed per reader (chosen from the drift profile)
    reuse_prefix: bool = True  # False: every agent prefills its whole prompt (Engine.open)
    reference: str = REFERENCE  # the mode whose answers this mode's readers are paired with
    offset_rank: int | None = None  # offset correction at this rank (None: base K/V read as stored)

    @property
    def is_reference(self) -> bool:
        """Whether other modes' readers are paired with this one's answers (itself has none)."""
        return self.reference == self.name

    @property
    def corrects(self) -> bool:
        return self.offset_rank is not None

    def config(self, recompute_layers: Sequence[int], **sizes: int) -> ForkServeConfig:
        correction = BaseCorrection.OFFSET if self.corrects else BaseCorrection.NONE
        return ForkServeConfig(kv_layout=self.kv_layout, share_base=self.share_base,
                               recompute_layers=tuple(recompute_layers), base_correction=correction,
                               node_ttl_s=None, **sizes)

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
    Mode("no_lora", KVLayout.UNIFIED, ContextHolding.ONE_COPY, adapters=Adapters.NONE),
    # Activated LoRA: before its invocation an aLoRA is the base model, so the engine keys those
    # pages BASE in every layout (``KVCache.keys``) and every agent may read them. Unified keeps
    # the layout's exactness everywhere past the invocation too.
    Mode("alora_unified", KVLayout.UNIFIED, ContextHolding.PER_AGENT, adapters=Adapters.ALORA,
         reuse_prefix=False, reference="alora_unified"),
    Mode("alora", KVLayout.UNIFIED, ContextHolding.ONE_COPY, adapters=Adapters.ALORA,
         reference="alora_unified"),
)
FIXED = {m.name: m for m in _FIXED}
# The default run: every fixed mode of plain LoRA and a recompute sweep (SmolLM2 has 30 layers).
DEFAULT = ("unified", "disaggregated", "full_reuse", "base_activations", "neutral", "recompute5",
           "recompute10", "recompute15", "offset0", "offset", "no_lora")
# Run when activated-LoRA adapters are given; the reference first (the cosines need its states).
ALORA = ("alora_unified", "alora")
ORDER = DEFAULT + ALORA


def mode(name: str) -> Mode:
    """The mode called ``name``: a fixed one, ``recompute<N>`` or ``offset<R>``."""
    if name in FIXED:
        return FIXED[name]
    m = RECOMPUTE.match(name)
    if m is not None:
        return Mode(name, KVLayout.DISAGGREGATED, ContextHolding.SPLIT, recompute=int(m.group(1)))
    m = OFFSET.match(name)
    if m is not None:
        return Mode(name, KVLayout.DISAGGREGATED, ContextHolding.SPLIT,
                    offset_rank=int(m.group(1)) if m.group(1) else OFFSET_RANK)
    raise ValueError(f"unknown mode {name!r}; known: {sorted(FIXED)}, recompute<N> and offset<R>")


def order_key(name: str) -> tuple[int, int, str]:
    """Table order: the default run's order, other recompute counts and offset ranks beside
    theirs, rest last."""
    if name in ORDER:
        return ORDER.index(name), 0, name
    for pattern, anchor in ((RECOMPUTE, "recompute5"), (OFFSET, "offset0")):
        m = pattern.match(name)
        if m is not None:
            return ORDER.index(anchor), int(m.group(1) or OFFSET_RANK), name
    return len(ORDER), 0, name


def recompute_layers(m: Mode, drift: LayerDrift | None) -> tuple[int, ...] | None:
    """The layers ``m`` recomputes; None when it needs a drift profile and has none."""
    if not m.recompute:
        return ()
    if drift is None:
        return None
    return most_drifting(drift, m.recompute)
