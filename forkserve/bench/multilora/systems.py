"""The systems the multi-LoRA workloads compare: each a KV layout plus how its agents' adapters
and the shared context are set up."""
from __future__ import annotations

from dataclasses import dataclass

from forkserve.config import KVLayout

# The alora system's invocation, one for every agent (a deployment invokes its aLoRAs with one
# string). Ids below 3 occur in no context, instruction or observation (those draw from 3 on),
# so only each instruction's own copy invokes the adapter and no observation moves the point.
ALORA_INVOCATION = (1, 2)


@dataclass(frozen=True)
class System:
    layout: KVLayout
    lora: bool = True        # every agent its own adapter (False: every agent the base model)
    # One base-model pass over the context writes every agent's residual (base_activations).
    base_pass: bool = False
    # Activated LoRA: each adapter applies from these tokens on, and each agent's instruction
    # starts with them, so the shared context is the base model's for every agent.
    invocation: tuple[int, ...] | None = None


# Insertion order is the plots' color order: a new system goes last, so colors stay put.
SPECS: dict[str, System] = {
    "unified": System(KVLayout.UNIFIED),
    "disaggregated": System(KVLayout.DISAGGREGATED),
    "disaggregated_base": System(KVLayout.DISAGGREGATED, base_pass=True),
    "adaptive": System(KVLayout.ADAPTIVE),
    "full_reuse": System(KVLayout.FULL_REUSE),
    "no_lora": System(KVLayout.UNIFIED, lora=False),
    # Merged K/V: pages wholly before the activation point are keyed BASE, so the one copy
    # of the context serves every agent (the disaggregated layout would add zero residuals).
    "alora": System(KVLayout.UNIFIED, invocation=ALORA_INVOCATION),
}
SYSTEMS = tuple(SPECS)
