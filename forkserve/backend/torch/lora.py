"""LoRA adapters: PEFT folders in, per-layer stacked device tensors out.

Many adapters stay resident in fixed slots of preallocated stacks, so adding or removing
one never reallocates (captured CUDA graphs keep pointing at the same memory). Each
token picks its adapter through a 0/1 mask over the stacked rank columns:

    shrink:  h = (x @ A_all) * mask      A_all [in, slots * r_max]   (one matmul, all slots)
    expand:  y += h @ B_all              B_all [slots * r_max, out]  (zero rows for other slots)

so a batch mixing adapters is two dense matmuls per projection, with no gather and no
per-adapter loop. B is stored pre-multiplied by alpha / r (the kernel contract).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file

from forkserve.backend.torch.checkpoint_files import read_json_object, reading
from forkserve.backend.torch.errors import AdapterFormatError, AdapterShapeError
from forkserve.backend.torch.model_config import ModelConfig

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Projections that share an input are shrunk by one matmul.
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",),
                                      "gate_up": ("gate", "up"), "down": ("down",)}
MAX_RANK = 64
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"
                  r"\.lora_([AB])\.weight$")


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-able projection."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q": (h, cfg.q_size), "k": (h, cfg.kv_size), "v": (h, cfg.kv_size),
            "o": (cfg.q_size, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # (layer, target) -> (A [rank, in], B [out, rank] already multiplied by scaling), float32
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # Activated LoRA (PEFT ``alora_invocation_tokens``): the adapter applies from the last
    # occurrence of these tokens on; None for a plain LoRA (applies everywhere).
    invocation_tokens: tuple[int, ...] | None = None

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(t for _, t in self.weights)


def load_peft_adapter(path: str | Path, name: str | None = None) -> LoraAdapter:
    folder = Path(path)
    cfg_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not folder.exists():
        raise AdapterFormatError(f"adapter path {folder} does not exist")
    if not cfg_file.is_file() or not weights_file.is_file():
        raise AdapterFormatError(f"{folder} is not a PEFT LoRA folder "
                                 "(needs adapter_config.json and adapter_model.safetensors)")
    acfg = read_json_object(cfg_file, AdapterFormatError)
    if acfg.get("peft_type", "LORA") != "LORA":
        raise AdapterFormatError(f"{folder}: peft_type {acfg.get('peft_type')!r} is not LORA")
    for flag, bad in (("use_dora", True), ("rank_pattern", None), ("alpha_pattern", None),
                      ("modules_to_save", None)):
        value = acfg.get(flag)
        if value and (bad is None or value == bad):
            raise AdapterFormatError(f"{folder}: {flag}={value!r} is not supported")
    if acfg.get("bias", "none") != "none":
        raise AdapterFormatError(f"{folder}: bias={acfg['bias']!r} is not supported (only 'none')")
    try:
        rank, alpha = int(acfg["r"]), float(acfg.get("lora_alpha", acfg["r"]))
    except (KeyError, TypeError, ValueError) as e:
        raise AdapterFormatError(
            f"{cfg_file}: \"r\" and \"lora_alpha\" must be numbers ({e!r})") from e
    if rank <= 0:
        raise AdapterFormatError(f"{cfg_file}: r={rank} must be positive")
    scaling = alpha / math.sqrt(rank) if acfg.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    tensors = reading(weights_file, AdapterFormatError, lambda: load_file(weights_file))
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterFormatError(f"{folder}: unsupported tensor {key!r}")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor.float()
    weights = {}
    for (layer, target), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterFormatError(f"{folder}: layer {layer} {target}_proj lacks lora_A or "
                                     f"lora_B")
        weights[(layer, target)] = (ab["A"], ab["B"] * scaling)
    invocation = _invocation_tokens(folder, acfg.get("alora_invocation_tokens"))
    return LoraAdapter(name=name or folder.name, rank=rank, scaling=scaling, weights=weights,
                       invocation_tokens=invocation)


def _invocation_tokens(folder: Path, value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    # bool is an int subclass: `true` in a config is a typo, not token 1.
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        raise AdapterFormatError(f"{folder}: alora_invocation_tokens must be a non-empty list of "
                                 f"token ids (ints >= 0), got {value!r}")
    return tuple(value)


def check_fits(adapter: LoraAdapter, cfg: ModelConfig, max_rank: int,
               targets: tuple[str, ...]) -> None:
    """Raise AdapterShapeError unless every tensor of the adapter fits the model and stacks."""
    shapes = target_shapes(cfg)
    bad = [t for t in adapter.invocation_tokens or () if t >= cfg.vocab_size]
    if bad:
        raise AdapterShapeError(f"adapter {adapter.name!r}: alora_invocation_tokens {bad[:5]} "
                                f"outside the model's vocabulary [0, {cfg.vocab_size})")
    if adapter.rank > max_rank:
        raise AdapterShapeError(f"adapter {adapter.name!r} has rank {adapter.rank} > "
                                f"max_lora_rank {max_rank}")
    for (layer, target), (a, b) in adapter.weights.items():
        if target not in targets:
            raise AdapterShapeError(f"adapter {adapter.name!r} targets {target}_proj, which is "
                                    f"not among the backend's lora_targets {targets}")
        if not 0 <= layer < cfg.num_layers:
            raise AdapterShapeError(f"adapter {adapter.name!r} has layer {layer}; the model has "
                                    f"{cfg.num_layers} layers")
        fan_in, fan_out = shapes[target]
        if tuple(a.shape) != (adapter.rank, fan_in) or tuple(b.shape) != (fan_out, adapter.rank):
            raise AdapterShapeError(
                f"adapter {adapter.name!r} layer {layer} {target}_proj: A {tuple(a.shape)}, "
                f"B {tuple(b.shape)} do not fit the model (expected A ({adapter.rank}, "
                f"{fan_in}), B ({fan_out}, {adapter.rank}))")


class LoraStack:
    """Resident adapters of one model, stacked per layer into fixed device tensors."""

    def __init__(self, cfg: ModelConfig, targets: tuple[str, ...], max_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        if not 1 <= max_rank <= MAX_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_RANK}], got {max_rank}")
        unknown = set(targets) - set(TARGETS)
        if unknown:
            raise ValueError(f"unknown lora_targets {sorted(unknown)}; choose from {TARGETS}")
        self.cfg, self.max_slots, self.max_rank = cfg, max_slots, max_rank
        self.targets = tuple(t for t in TARGETS if t in targets)
        self.groups = {g: tuple(t for t in ts if t in self.targets) for g, ts in GROUPS.items()}
        self.groups = {g: ts for g, ts in self.groups.items() if ts}
        width = max_slots * max_rank
        shapes = target_shapes(cfg)
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            self.a.append({g: torch.zeros(shapes[ts[0]][0], len(ts) * width, device=device,
                                          dtype=dtype)
                           for g, ts in self.groups.items()})
            self.b.append({t: torch.zeros(width, shapes[t][1], device=device, dtype=dtype)
                           for t in self.targets})
        self.col_slot = torch.arange(width, device=device) // max_rank

    @property
    def width(self) -> int:
        return self.max_slots * self.max_rank

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter (already checked with check_fits) into a slot; missing targets
        stay zero."""
        self.clear(slot)
        r, w = adapter.rank, self.width
        for (layer, target), (a, b) in adapter.weights.items():
            group = next(g for g, ts in self.groups.items() if target in ts)
            col = self.groups[group].index(target) * w + slot * self.max_rank
            self.a[layer][group][:, col:col + r].copy_(a.t())
            row = slot * self.max_rank
            self.b[layer][target][row:row + r].copy_(b.t())

    def clear(self, slot: int) -> None:
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for layer in range(self.cfg.num_layers):
            for group, ts in self.groups.items():
                for j in range(len(ts)):
                    at = j * self.width
                    self.a[layer][group][:, at + cols.start:at + cols.stop].zero_()
            for t in self.targets:
                self.b[layer][t][cols].zero_()

    def token_mask(self, token_slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots * r_max] 0/1: the rank columns of each token's adapter (none for slot -1)."""
        return (self.col_slot[None, :] == token_slot[:, None]).to(dtype)

    def group_masks(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``token_mask`` repeated once per target of each group ([T, G * width]): made once
        per forward instead of once per layer and group."""
        return {g: mask if len(ts) == 1 else mask.repeat(1, len(ts))
                for g, ts in self.groups.items()}

    def shrink(self, layer: int, group: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x A for every target of the group, masked to each token's adapter: [T, G * width].
        ``mask``: ``token_mask`` or the group's ``group_masks`` entry."""
        h = x @ self.a[layer][group]
        g = len(self.groups[group])
        return h * (mask if mask.shape[-1] == h.shape[-1] else mask.repeat(1, g))

    def part(self, group: str, target: str, h: torch.Tensor) -> torch.Tensor:
        j = self.groups[group].index(target)
        return h[:, j * self.width:(j + 1) * self.width]

    def expand_(self, layer: int, target: str, h_part: torch.Tensor, out: torch.Tensor) -> None:
        """out += h_part @ B (in place; out may be a column slice of a fused projection)."""
        out.addmm_(h_part, self.b[layer][target])

    def collapse(self, h_part: torch.Tensor) -> torch.Tensor:
        """Masked [T, slots * r_max] -> [T, r_max]: each token's own x A (the residual cache
        row)."""
        return h_part.view(h_part.shape[0], self.max_slots, self.max_rank).sum(dim=1)

    def residuals(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        """The residual rows of the qkv group's k and v targets from its masked shrink ``h``
        ([T, G * width]): ``collapse`` of each part, in one reduction where both are
        targeted (their parts are adjacent). Each row holds one slot's nonzero values, so
        the sum is exact in any order."""
        ts = [t for t in ("k", "v") if t in self.groups.get("qkv", ())]
        if len(ts) < 2:
            return {t: self.collapse(self.part("qkv", t, h)) for t in ts}
        j = self.groups["qkv"].index("k")
        both = h[:, j * self.width:(j + 2) * self.width]
        rows = both.view(h.shape[0], 2, self.max_slots, self.max_rank).sum(dim=2)
        return {"k": rows[:, 0], "v": rows[:, 1]}

    def slot_residuals(self, layer: int, x: torch.Tensor, rows: torch.Tensor,
                       slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The residual rows ``x[rows] A_t`` of adapter ``slots`` (one slot per row; -1 gives
        zeros) for the qkv group's k and v targets: [E, r_max] each. One matmul over the
        forward's distinct tokens, then a gather: a context that many adapters read is
        multiplied once, not once per adapter (``shrink`` of the repeated rows would build an
        [E, slots * r_max] product, which grows with the square of the adapter count)."""
        keep = (slots >= 0).unsqueeze(1).to(x.dtype)
        slot = slots.clamp(min=0)
        a, out = self.a[layer]["qkv"], {}
        for t in (t for t in ("k", "v") if t in self.groups.get("qkv", ())):
            j = self.groups["qkv"].index(t) * self.width
            full = (x @ a[:, j:j + self.width]).view(-1, self.max_slots, self.max_rank)
            out[t] = full[rows, slot] * keep
        return out

    def b_stack(self, layer: int, target: str) -> torch.Tensor | None:
        """B of every slot as [slots, r_max, out] (the residual-attention kernel's operand)."""
        b = self.b[layer].get(target)
        return None if b is None else b.view(self.max_slots, self.max_rank, -1)
