"""PEFT's activated-LoRA layers without a host sync in every layer, for training.

PEFT (0.21) applies an aLoRA adapter in each adapted layer by building the offsets tensor from
a Python list on the device and picking the activated tokens with a boolean mask: a blocking
copy and a device-to-host sync (the mask's count) in each of the 4 x L layers of every
forward. On the H200 that left the GPU waiting on the host: Qwen's four aLoRA tasks saved
nothing in 540 s where the plain ones took 275 s each (2026-12-02). ``sync_free`` swaps that
forward, while training runs, for one that multiplies the adapter's output by the mask: the
same values and gradients (a masked position adds exactly 0), the mask built once per forward
and shared by every layer. Inference keeps PEFT's forward (evaluation runs the engine's
own aLoRA path, not PEFT's).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

# The mask of the forward in flight: every layer of one forward asks with the same key.
_last: dict[tuple[Any, ...], torch.Tensor] = {}


def activation_mask(offsets: Sequence[int | None], length: int,
                    device: torch.device) -> torch.Tensor:
    """[rows, length] bool: True on the last ``offsets[i]`` positions of row i (None: none),
    as PEFT's ``ALoraLinearVariant.forward`` defines them; one host-to-device copy per forward."""
    key = (tuple(offsets), length, device)
    mask = _last.get(key)
    if mask is None:
        counts = torch.tensor([0 if o is None else min(int(o), length) for o in offsets])
        mask = (torch.arange(length).unsqueeze(0) >= (length - counts).unsqueeze(1)).to(device)
        _last.clear()
        _last[key] = mask
    return mask


def _forward(module: Any, active_adapter: str, x: torch.Tensor, result: torch.Tensor,
             **kwargs: Any) -> torch.Tensor:
    offsets = kwargs.get("alora_offsets")
    if offsets is None:  # no invocation anywhere: PEFT's own (rare) path
        return _peft_forward(module, active_adapter=active_adapter, x=x, result=result, **kwargs)
    lora_a, lora_b = module.lora_A[active_adapter], module.lora_B[active_adapter]
    dropout, scaling = module.lora_dropout[active_adapter], module.scaling[active_adapter]
    length = result.shape[1] if result.dim() == 3 else 1
    mask = activation_mask(offsets, length, result.device)
    delta = lora_b(lora_a(dropout(x.to(lora_a.weight.dtype)))) * scaling
    return result + delta * mask.view(*result.shape[:-1], 1).to(delta.dtype)


_peft_forward: Any = None


@contextmanager
def sync_free() -> Iterator[None]:
    """PEFT's aLoRA linear layers use ``_forward`` inside the block (not thread-safe: one
    training loop per process, as train.py runs)."""
    global _peft_forward
    from peft.tuners.lora.variants import ALoraLinearVariant

    _peft_forward = ALoraLinearVariant.forward
    ALoraLinearVariant.forward = staticmethod(_forward)
    try:
        yield
    finally:
        ALoraLinearVariant.forward = staticmethod(_peft_forward)
        _peft_forward = None
        _last.clear()
