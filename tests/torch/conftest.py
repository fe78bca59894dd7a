"""Session fixtures: tiny checkpoints and PEFT adapters, built once per test run.

Without CUDA the Triton kernels run under the interpreter (test_attention_backends.py wires
them into the model): TRITON_INTERPRET must be set before triton is first imported.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from torch_testlib import save_peft_adapter, save_tiny_model

# tests/lib: test libraries several test folders share (gguf_testlib). Not tests/ itself:
# its folders named like packages (torch, ray, vllm) would import as namespace packages.
SHARED_LIB = str(Path(__file__).resolve().parents[1] / "lib")
if SHARED_LIB not in sys.path:
    sys.path.insert(0, SHARED_LIB)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": save_tiny_model(root / "llama", "llama", seed=0),
        "llama_sharded_tied": save_tiny_model(root / "llama_st", "llama", seed=1, shard=True,
                                              tie_word_embeddings=True),
        "llama3_rope": save_tiny_model(root / "llama3", "llama", seed=2, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}),
        "qwen2": save_tiny_model(root / "qwen2", "qwen2", seed=3),
        "qwen2_yarn_tied": save_tiny_model(root / "qwen2_yarn", "qwen2", seed=5,
                                           tie_word_embeddings=True,
                                           rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32}),
        "mistral": save_tiny_model(root / "mistral", "mistral", seed=6, sliding_window=4096),
        # transformers' GGUF reader derives head_dim from hidden / heads: keep it so here.
        "llama_plain_head": save_tiny_model(root / "llama_plain", "llama", seed=4, head_dim=16),
    }


@pytest.fixture(scope="session")
def adapters(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = models["llama"]
    return {
        "qkvo": save_peft_adapter(base, root / "qkvo", 4, ("q", "k", "v", "o"), seed=10),
        "qv": save_peft_adapter(base, root / "qv", 8, ("q", "v"), seed=11, alpha=8.0),
        "all": save_peft_adapter(base, root / "all", 2, ("q", "k", "v", "o", "gate", "up", "down"),
                                 seed=12, alpha=4.0, rslora=True),
    }
