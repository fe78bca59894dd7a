"""Which mode of the quality benchmark (``benchmarks/quality``, docs/QUALITY.md) a deployment
runs as: the one mapping from an engine configuration to a row of its report.

The server's ``/v1/models`` card (``interfaces/server/sharing_cost.py``), the multi-LoRA
bench's systems (``bench/multilora/systems.py``) and ``benchmarks/sharing_tradeoff.py``, which
joins their figures, all ask here, so a quality row and a speed row meet under one name.
Plain config in, a name out: nothing here reads a report.
"""
from __future__ import annotations

from forkserve.config import BaseCorrection, ForkServeConfig, KVLayout, ShareBase


def quality_mode(config: ForkServeConfig) -> str | None:
    """The quality report's mode whose readers read base K/V as this deployment's adapters
    do; None where no adapter reads another forward's base K/V (exact by construction)."""
    if config.kv_layout is KVLayout.UNIFIED or config.share_base is ShareBase.EXACT:
        return None
    return deployment_mode(config)


def deployment_mode(config: ForkServeConfig, *, lora: bool = True, activated: bool = False,
                    base_pass: bool = False) -> str:
    """The quality report's mode that runs as this deployment does, exact ones included: the
    one mapping from a configuration to a row of ``benchmarks/quality`` (the server's card,
    the multi-LoRA bench's systems and ``benchmarks/sharing_tradeoff.py`` all ask here).
    ``lora``: the agents run adapters (False: the base model); ``activated``: they are
    activated LoRAs; ``base_pass``: one base-model pass writes every agent's residual of the
    shared context (``Engine.prefill_shared``), which the config does not say."""
    if not lora:
        return "no_lora"
    if activated:
        if config.kv_layout is not KVLayout.UNIFIED:
            raise NoQualityMode("activated LoRA was measured in the unified layout only, not "
                                f"{config.kv_layout.value}")
        return "alora"
    if config.kv_layout is KVLayout.UNIFIED or config.share_base is ShareBase.EXACT:
        return "unified"  # every adapter reads only K/V its own forward wrote
    if base_pass:
        return "base_activations"
    if config.share_base is ShareBase.NEUTRAL:
        return "neutral"
    if config.kv_layout is KVLayout.FULL_REUSE:
        return "full_reuse"
    if config.base_correction is BaseCorrection.OFFSET:
        return "offset"
    if config.recompute_layers:
        return f"recompute{len(config.recompute_layers)}"
    # Adaptive splits a session only where it must; a split reader reads as disaggregated.
    return "disaggregated"


class NoQualityMode(ValueError):
    """A deployment no mode of the quality benchmark runs as."""
