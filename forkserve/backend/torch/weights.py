"""Model weights in the engine's layout: q/k/v fused into one matrix, gate/up into another.

Fusing keeps one matmul per projection group (fewer kernels per decode step); the loaders
convert HF / GGUF tensors into this layout once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from forkserve.backend.torch.model_config import ModelConfig


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor           # [hidden]
    qkv: torch.Tensor                  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None      # [q_size + 2 * kv_size] (Qwen2)
    o: torch.Tensor                    # [hidden, q_size]
    post_norm: torch.Tensor            # [hidden]
    gate_up: torch.Tensor              # [2 * intermediate, hidden]
    down: torch.Tensor                 # [hidden, intermediate]


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor                # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor           # [hidden]
    lm_head: torch.Tensor              # [vocab, hidden]; the embedding itself when tied

    def nbytes(self) -> int:
        """Bytes of distinct weight storage (a tied head is counted once)."""
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def random_weights(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                   seed: int = 0, std: float = 0.02) -> ModelWeights:
    """Random weights of cfg's shape, made on the device (benchmarks: no checkpoint to read)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * std

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    qkv_out = cfg.q_size + 2 * cfg.kv_size
    layers = tuple(
        LayerWeights(
            input_norm=ones(cfg.hidden_size),
            qkv=normal(qkv_out, cfg.hidden_size),
            qkv_bias=normal(qkv_out) if cfg.attention_bias else None,
            o=normal(cfg.hidden_size, cfg.q_size),
            post_norm=ones(cfg.hidden_size),
            gate_up=normal(2 * cfg.intermediate_size, cfg.hidden_size),
            down=normal(cfg.hidden_size, cfg.intermediate_size),
        )
        for _ in range(cfg.num_layers)
    )
    embed = normal(cfg.vocab_size, cfg.hidden_size)
    head = embed if cfg.tie_word_embeddings else normal(cfg.vocab_size, cfg.hidden_size)
    return ModelWeights(embed=embed, layers=layers, final_norm=ones(cfg.hidden_size), lm_head=head)
