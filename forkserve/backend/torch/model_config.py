"""ModelConfig: the architecture facts the engine needs, read from an HF config.json.

Llama, Mistral and Qwen2 share one decoder (pre-norm, SwiGLU, GQA, neox RoPE); they
differ only in q/k/v bias (Qwen2), tied embeddings, RoPE scaling and sliding windows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from forkserve.backend.torch.checkpoint_files import read_json_object
from forkserve.backend.torch.errors import CheckpointError, UnsupportedModelError
from forkserve.backend.torch.rope import RopeConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_context: int
    attention_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """n of seed 001: the width of one K (or V) row, n_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {arch!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {d['hidden_act']!r} is not supported "
                                        "(only silu)")
        if d.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = int(d.get("head_dim") or hidden // num_heads)
        max_context = int(d.get("max_position_embeddings", 4096))
        # A sliding window only changes attention beyond the window: capping the context at
        # the window keeps full attention exact instead of implementing the window.
        window = d.get("sliding_window")
        uses_window = d.get("use_sliding_window", arch == "mistral")
        if window and uses_window:
            max_context = min(max_context, int(window))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # Qwen2 always has q/k/v bias (its config has no flag); Llama/Mistral say so.
        bias = True if arch == "qwen2" else bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_dict(d),
            max_context=max_context,
            attention_bias=bias,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        folder = Path(path)
        if not folder.exists():
            raise CheckpointError(f"model path {folder} does not exist")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"no config.json in {folder} (an HF model folder needs one)")
        d = read_json_object(cfg_path, CheckpointError)
        try:
            return cls.from_hf_dict(d)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{cfg_path}: {e}") from e
        except KeyError as e:
            raise CheckpointError(f"{cfg_path} lacks the field {e.args[0]!r}") from e
        except (TypeError, ValueError, ArithmeticError) as e:
            # int("abc"), int(None), a zero head count: a field of the wrong type or value.
            raise CheckpointError(f"{cfg_path} has an invalid value "
                                  f"({type(e).__name__}: {e})") from e


def llama3_8b_config() -> ModelConfig:
    """Llama-3-8B's shape (for benchmarks with random weights; no checkpoint needed)."""
    return ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0), max_context=8192 * 2, attention_bias=False,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001,))
