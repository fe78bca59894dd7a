"""Files vLLM needs to run the benchmarks' shapes: a config-only model folder and PEFT adapters.

vLLM loads models and LoRAs from folders. The benchmarks use random weights
(forkserve/bench/multilora/), so the model folder holds only ``config.json`` and vLLM
runs with ``load_format="dummy"`` (random weights, no tokenizer: token ids only); each
agent's adapter is written in PEFT format from the same ``LoraAdapter`` ForkServe's
TorchBackend serves, so both engines apply the same deltas. No vLLM import here.
"""
from __future__ import annotations

import json
from pathlib import Path

from forkserve.backend.torch.lora import LoraAdapter
from forkserve.backend.torch.model_config import ModelConfig

_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}


def write_model_dir(cfg: ModelConfig, path: Path) -> Path:
    """A Hugging Face ``config.json`` of a Llama-architecture ``ModelConfig``."""
    if cfg.architecture != "llama":
        raise ValueError(f"only llama shapes are written for vLLM, not {cfg.architecture!r}")
    if cfg.rope.rope_type != "default":
        raise ValueError(f"rope_type {cfg.rope.rope_type!r}: only default RoPE is written")
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta,
        "max_position_embeddings": cfg.max_context, "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids) or None,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_peft_adapter(adapter: LoraAdapter, path: Path) -> Path:
    """PEFT folder whose deltas equal ``adapter``'s (its B already carries the scaling, so B
    is divided back out and ``lora_alpha = scaling * rank``)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, target), (a, b) in adapter.weights.items():
        prefix = f"base_model.model.model.layers.{layer}.{_MODULE[target]}"
        tensors[f"{prefix}.lora_A.weight"] = a.detach().to("cpu", torch.float32).contiguous()
        tensors[f"{prefix}.lora_B.weight"] = (b.detach().to("cpu", torch.float32)
                                              / adapter.scaling).contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.scaling * adapter.rank,
              "target_modules": sorted({_MODULE[t].split(".")[1] for t in adapter.targets}),
              "bias": "none", "lora_dropout": 0.0, "use_rslora": False, "use_dora": False,
              "task_type": "CAUSAL_LM", "base_model_name_or_path": None}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
