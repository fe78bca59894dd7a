"""The model folder and PEFT adapters the vLLM benchmark hands to vLLM (written on CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from forkserve.backend.torch.lora import load_peft_adapter
from forkserve.backend.vllm.bench_assets import write_model_dir, write_peft_adapter
from forkserve.bench.multilora import random_adapter, tiny_config


def test_model_dir_carries_the_shape(tmp_path):
    cfg = tiny_config()
    data = json.loads((write_model_dir(cfg, tmp_path / "m") / "config.json").read_text())
    assert data["architectures"] == ["LlamaForCausalLM"]
    assert (data["num_hidden_layers"], data["num_key_value_heads"], data["head_dim"]) == (2, 2, 32)


def test_peft_adapter_round_trips_to_the_same_deltas(tmp_path):
    cfg = tiny_config()
    adapter = random_adapter(cfg, "agent0", 16, torch.device("cpu"), seed=0)
    back = load_peft_adapter(write_peft_adapter(adapter, tmp_path / "agent0"))
    assert back.rank == 16 and back.weights.keys() == adapter.weights.keys()
    for key, (a, b) in adapter.weights.items():
        torch.testing.assert_close(back.weights[key][0], a)
        torch.testing.assert_close(back.weights[key][1], b)


def test_only_llama_default_rope_is_written(tmp_path):
    cfg = tiny_config()
    with pytest.raises(ValueError, match="llama"):
        write_model_dir(type(cfg)(**{**cfg.__dict__, "architecture": "qwen2"}), tmp_path)
