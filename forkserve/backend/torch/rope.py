"""Rotary position embedding: neox rotate-half with an inv_freq tensor (shared kernel contract).

Scaled variants change only inv_freq (linear, llama3, yarn) and, for yarn, a constant
factor on cos/sin. RoPE is linear in its input, which is what lets the disaggregated
layout apply it late: RoPE(x W_k + x A_k B_k) = RoPE(x W_k) + RoPE((x A_k) B_k).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from forkserve.backend.torch.errors import UnsupportedModelError
from forkserve.kernels.rope import rotate_signed

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported (supported: "
                f"{', '.join(ROPE_TYPES)})")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs write
        # `rope_theta` and an optional `rope_scaling` whose type key is `type` or `rope_type`.
        params = dict(d.get("rope_parameters") or {})
        if not params:
            params = dict(d.get("rope_scaling") or {})
            params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        if "partial_rotary_factor" in params and params["partial_rotary_factor"] != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        orig = params.get("original_max_position_embeddings")
        factor = params.get("factor")
        if rope_type == "yarn" and factor is None:
            factor = d["max_position_embeddings"] / orig
        return cls(
            theta=float(params.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            factor=float(factor if factor is not None else 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(orig) if orig is not None else None,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )

    def inv_freq_and_scale(self, head_dim: int) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim/2] float32, factor on cos/sin), bit-compatible with HF's init."""
        base = 1.0 / (self.theta
                      ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.rope_type == "default":
            return base, 1.0
        if self.rope_type == "linear":
            return base / self.factor, 1.0
        if self.rope_type == "llama3":
            return self._llama3(base), 1.0
        return self._yarn(head_dim)

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_len = self.original_max_position
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = ((old_len / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self, dim: int) -> tuple[torch.Tensor, float]:
        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        factor = self.factor
        attn = self.attention_factor
        if attn is None:
            if self.mscale and self.mscale_all_dim:
                attn = get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim)
            else:
                attn = get_mscale(factor)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (factor * pos_freqs)
        keep = 1 - ramp
        return interpolation * (1 - keep) + extrapolation * keep, float(attn)


class Rope:
    """Applies RoPE at arbitrary absolute positions (positions are data, so CUDA graphs replay)."""

    def __init__(self, config: RopeConfig, head_dim: int, device: torch.device) -> None:
        inv_freq, scale = config.inv_freq_and_scale(head_dim)
        self.inv_freq = inv_freq.to(device)
        self.scale = scale

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin [..., head_dim] for integer positions [...], in float32 like HF.

        The sign of rotate-half's first half is folded into sin (-sin | +sin), so apply_rope
        needs only a roll instead of a slice, negation and concatenation (fewer kernels)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        cos = torch.cat((freqs, freqs), dim=-1).cos() * self.scale
        sin = freqs.sin() * self.scale
        return cos.to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim]; cos/signed_sin from Rope.cos_sin, broadcast over heads
    (``kernels.rope.rotate_signed``, the one form the kernels' eager twins share)."""
    return rotate_signed(x, cos, signed_sin)
