"""Token sampling: greedy, or temperature + top-p with a per-request seed.

A seeded request draws from a generator seeded by (seed, position), so its tokens do not
depend on which other requests share the batch, nor on how its prompt was chunked.
"""
from __future__ import annotations

from typing import Sequence

import torch

from forkserve.backend.protocol import SamplingParams

_MIX = 1_000_003  # odd multiplier spreading (seed, position) over the 63-bit seed space


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches top_p; renormalize."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._unseeded = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
               greedy: torch.Tensor | None = None) -> list[int]:
        """logits [N, vocab] float32; positions: the position each sampled token will take;
        greedy: logits.argmax(-1) when already computed (inside a CUDA graph)."""
        if all(p.temperature == 0.0 for p in params):
            return (greedy if greedy is not None else logits.argmax(dim=-1)).tolist()
        out = logits.argmax(dim=-1)
        for row, (p, pos) in enumerate(zip(params, positions, strict=True)):
            if p.temperature == 0.0:
                continue
            probs = top_p_filter(torch.softmax(logits[row] / p.temperature, dim=-1), p.top_p)
            if p.seed is None:
                gen = self._unseeded
            else:
                gen = torch.Generator(device=logits.device).manual_seed((p.seed * _MIX + pos) % (1 << 63))
            out[row] = torch.multinomial(probs, 1, generator=gen)[0]
        return out.tolist()
