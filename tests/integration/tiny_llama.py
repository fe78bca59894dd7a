"""A tiny random Llama (context 256) and two PEFT adapters (q, k, v, o) saved to disk, so
tests and the fault bench go through the real loaders."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def save_tiny_llama(root: Path, layers: int = 2) -> tuple[Path, dict[str, Path]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(root / "model")
    adapters = {}
    for i, name in enumerate(("planner", "critic")):
        torch.manual_seed(10 + i)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"),
                              LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        peft.save_pretrained(root / name)
        adapters[name] = root / name
    return root / "model", adapters
