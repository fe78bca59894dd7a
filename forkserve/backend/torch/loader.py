"""Load an HF checkpoint folder (config.json + safetensors, sharded or not) into ModelWeights.

Reads tensor by tensor from memory-mapped safetensors files and fuses q/k/v and gate/up
on the way, so peak host memory is about one layer beyond the weights themselves.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from forkserve.backend.torch.errors import CheckpointError
from forkserve.backend.torch.model_config import ModelConfig
from forkserve.backend.torch.weights import LayerWeights, ModelWeights

TensorGetter = Callable[[str], torch.Tensor]


def _safetensors_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or by opening every shard."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / fname for name, fname in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            for name in handle.keys():
                where[name] = f
    return where


def load_hf_folder(path: str | Path, device: torch.device,
                   dtype: torch.dtype) -> tuple[ModelConfig, ModelWeights]:
    folder = Path(path)
    cfg = ModelConfig.from_folder(folder)
    where = _safetensors_index(folder)
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise CheckpointError(f"tensor {name!r} missing from checkpoint {folder}")
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(f, framework="pt")
        return handles[f].get_tensor(name)

    return cfg, assemble_weights(cfg, get, device, dtype)


def assemble_weights(cfg: ModelConfig, get: TensorGetter, device: torch.device,
                     dtype: torch.dtype) -> ModelWeights:
    """Build ModelWeights from HF-named tensors (`model.layers.{i}.self_attn.q_proj.weight`...)."""

    def load(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = get(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=dtype)

    h, i = cfg.hidden_size, cfg.intermediate_size
    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        q = load(p + "self_attn.q_proj.weight", (cfg.q_size, h))
        k = load(p + "self_attn.k_proj.weight", (cfg.kv_size, h))
        v = load(p + "self_attn.v_proj.weight", (cfg.kv_size, h))
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([load(p + f"self_attn.{x}_proj.bias", (size,))
                              for x, size in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size))])
        gate = load(p + "mlp.gate_proj.weight", (i, h))
        up = load(p + "mlp.up_proj.weight", (i, h))
        layers.append(LayerWeights(
            input_norm=load(p + "input_layernorm.weight", (h,)),
            qkv=torch.cat([q, k, v]),
            qkv_bias=bias,
            o=load(p + "self_attn.o_proj.weight", (h, cfg.q_size)),
            post_norm=load(p + "post_attention_layernorm.weight", (h,)),
            gate_up=torch.cat([gate, up]),
            down=load(p + "mlp.down_proj.weight", (h, i)),
        ))
    embed = load("model.embed_tokens.weight", (cfg.vocab_size, h))
    # Tied checkpoints may still store lm_head; the config flag decides, as in HF.
    head = embed if cfg.tie_word_embeddings else load("lm_head.weight", (cfg.vocab_size, h))
    return ModelWeights(embed=embed, layers=tuple(layers),
                        final_norm=load("model.norm.weight", (h,)), lm_head=head)
