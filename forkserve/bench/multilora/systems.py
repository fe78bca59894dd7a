"""The systems the multi-LoRA workloads compare: each a KV layout plus how its agents' adapters
and the shared context are set up, and the quality benchmark's mode it runs as."""
from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from forkserve.config import ForkServeConfig, KVLayout, ShareBase
from forkserve.sharing_mode import deployment_mode

# The alora system's invocation, one for every agent (a deployment invokes its aLoRAs with one
# string). Ids below 3 occur in no context, instruction or observation (those draw from 3 on),
# so only each instruction's own copy invokes the adapter and no observation moves the point.
ALORA_INVOCATION = (1, 2)
# ``recompute<N>``: disaggregated, N layers kept exact per reader (recompute_choice.py).
RECOMPUTE = re.compile(r"recompute(\d+)$")


class ContextWriter(str, enum.Enum):
    """What writes the shared context before the agents open."""

    AGENT = "agent"                        # agent 0, in its own forward
    BASE_ACTIVATIONS = "base_activations"  # Engine.prefill_shared: base + every residual
    BASE_MODEL = "base_model"              # a base-model request: BASE pages (neutral)


@dataclass(frozen=True)
class System:
    layout: KVLayout
    lora: bool = True        # every agent its own adapter (False: every agent the base model)
    writer: ContextWriter = ContextWriter.AGENT
    # Activated LoRA: each adapter applies from these tokens on, and each agent's instruction
    # starts with them, so the shared context is the base model's for every agent.
    invocation: tuple[int, ...] | None = None
    share_base: ShareBase = ShareBase.CROSS_ADAPTER
    recompute: int = 0       # layers each reader keeps exact (recompute_choice.py picks them)

    def config(self, recompute_layers: Sequence[int] = (), **sizes) -> ForkServeConfig:
        """The engine's config for this system (``sizes``: pages, budget and limits)."""
        return ForkServeConfig(kv_layout=self.layout, share_base=self.share_base,
                               recompute_layers=tuple(recompute_layers), **sizes)

    def quality_mode(self, recompute_layers: Sequence[int] = ()) -> str:
        """The quality benchmark's mode this system runs as (the one mapping, sharing_cost.py)."""
        return deployment_mode(self.config(recompute_layers), lora=self.lora,
                               activated=self.invocation is not None,
                               base_pass=self.writer is ContextWriter.BASE_ACTIVATIONS)


# Insertion order is the plots' color order: a new system goes last, so colors stay put.
SPECS: dict[str, System] = {
    "unified": System(KVLayout.UNIFIED),
    "disaggregated": System(KVLayout.DISAGGREGATED),
    "disaggregated_base": System(KVLayout.DISAGGREGATED, writer=ContextWriter.BASE_ACTIVATIONS),
    "adaptive": System(KVLayout.ADAPTIVE),
    "full_reuse": System(KVLayout.FULL_REUSE),
    "no_lora": System(KVLayout.UNIFIED, lora=False),
    # Merged K/V: pages wholly before the activation point are keyed BASE, so the one copy
    # of the context serves every agent (the disaggregated layout would add zero residuals).
    "alora": System(KVLayout.UNIFIED, invocation=ALORA_INVOCATION),
    # Mode a: a base-model request writes the context's base pages; every agent reads them and
    # computes its own residual, and never reads another adapter's base pages.
    "neutral": System(KVLayout.DISAGGREGATED, writer=ContextWriter.BASE_MODEL,
                      share_base=ShareBase.NEUTRAL),
}
# The default run. ``recompute<N>`` is run by name: N must fit the model's depth.
SYSTEMS = tuple(SPECS)


class UnknownSystem(ValueError):
    """A system name that is neither in SPECS nor ``recompute<N>``."""


def spec(name: str) -> System:
    """The system called ``name``: one of SPECS, or ``recompute<N>`` (mode b)."""
    if name in SPECS:
        return SPECS[name]
    m = RECOMPUTE.match(name)
    if m is not None and int(m.group(1)) > 0:
        return System(KVLayout.DISAGGREGATED, recompute=int(m.group(1)))
    raise UnknownSystem(f"unknown system {name!r}; known: {', '.join(SYSTEMS)} and "
                        "recompute<N> (N >= 1)")


def plot_order(names: Sequence[str]) -> list[str]:
    """``names`` in color order: SPECS' order, then the recompute systems by N."""
    extra = sorted({n for n in names if n not in SPECS}, key=lambda n: (len(n), n))
    return list(SYSTEMS) + extra
