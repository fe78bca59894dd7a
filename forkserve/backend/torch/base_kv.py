"""A context's base K/V as each forward computes it: what drift (``benchmarks/quality/drift.py``)
measures and offset correction (``offset_fit.py``) fits, from one backend's hidden states.

Base K/V is ``h W + b`` over the layer's attention input h (the normed residual stream before
it), without the LoRA delta and before RoPE: the part another adapter's reader takes from the
shared pages. Run on a backend of the unified layout (every item merged, no residual pages).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from forkserve.backend.torch.backend import TorchBackend


def context_hidden(backend: "TorchBackend", tokens: Sequence[int],
                   adapter_id: int | None) -> torch.Tensor:
    """The residual stream after every layer over ``tokens``, one prefill: [T, layers, hidden]."""
    from forkserve.backend.protocol import KVSlots, SeqWork

    pages = tuple(range(-(-len(tokens) // backend.config.page_size)))
    work = SeqWork(seq_id=0, tokens=tuple(tokens), start_pos=0, slots=KVSlots(pages, None),
                   adapter_id=adapter_id, sampling=None)
    return backend.forward([work], hidden_states=True).hidden[0].float()


def attention_inputs(backend: "TorchBackend", tokens: Sequence[int],
                     hidden: torch.Tensor) -> torch.Tensor:
    """What each layer's q/k/v projections read: [layers, T, hidden] (normed stream before it)."""
    w, eps = backend.model.weights, backend.model_config.rms_norm_eps
    before = [w.embed[torch.tensor(list(tokens), device=w.embed.device)].float()]
    before += list(hidden[:, :-1].unbind(1))
    return torch.stack([F.rms_norm(x, (x.shape[-1],), layer.input_norm.float(), eps)
                        for x, layer in zip(before, w.layers, strict=True)])


def kv_base(backend: "TorchBackend", h: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer n's base K and V (before RoPE) from attention inputs h [T, hidden]."""
    cfg, layer = backend.model_config, backend.model.weights.layers[n]
    qkv = F.linear(h, layer.qkv.float(),
                   layer.qkv_bias.float() if layer.qkv_bias is not None else None)
    return qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size], qkv[:, cfg.q_size + cfg.kv_size:]
