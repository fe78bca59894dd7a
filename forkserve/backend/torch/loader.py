"""Load an HF checkpoint folder (config.json + safetensors, sharded or not) into ModelWeights.

Reads tensor by tensor from memory-mapped safetensors files and fuses q/k/v and gate/up
on the way, so peak host memory is about one layer beyond the weights themselves.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from tqdm import tqdm

from forkserve.backend.torch.checkpoint_files import read_json_object, reading
from forkserve.backend.torch.errors import CheckpointError
from forkserve.backend.torch.model_config import ModelConfig
from forkserve.backend.torch.weights import LayerWeights, ModelWeights

TensorGetter = Callable[[str], torch.Tensor]


def _safetensors_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or by opening every shard."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no \"weight_map\" object")
        where = {name: folder / str(fname) for name, fname in weight_map.items()}
        missing = sorted({str(f) for f in where.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: "
                                  f"{', '.join(missing[:3])}")
        return where
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    where = {}
    for f in files:
        for name in reading(f, CheckpointError, functools.partial(_tensor_names, f)):
            where[name] = f
    return where


def _tensor_names(f: Path) -> list[str]:
    with safe_open(f, framework="pt") as handle:
        return list(handle.keys())


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
            handles[f] = reading(f, CheckpointError, lambda: safe_open(f, framework="pt"))
        return reading(f, CheckpointError, lambda: handles[f].get_tensor(name))

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
    # Seconds to minutes for a real model (a GGUF dequantizes here): a bar on a terminal,
    # none in a log or a test (disable=None: only where stderr is a TTY).
    for n in tqdm(range(cfg.num_layers), desc="loading weights", unit="layer", leave=False,
                  disable=None):
        p = f"model.layers.{n}."
        q = load(p + "self_attn.q_proj.weight", (cfg.q_size, h))
        k = load(p + "self_attn.k_proj.weight", (cfg.kv_size, h))
        v = load(p + "self_attn.v_proj.weight", (cfg.kv_size, h))
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([load(p + f"self_attn.{x}_proj.bias", (size,))
                              for x, size in (("q", cfg.q_size), ("k", cfg.kv_size),
                                              ("v", cfg.kv_size))])
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
