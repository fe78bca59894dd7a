"""Tokenizer from the model's own folder or GGUF file (transformers' loaders, offline only)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from forkserve.backend.torch.errors import CheckpointError


class Tokenizer:
    """Thin wrapper: ids in and out as plain lists, the chat template, the stop ids."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer

    @classmethod
    def load(cls, model_path: str | Path) -> "Tokenizer":
        from transformers import AutoTokenizer  # heavy import: only when a tokenizer is asked for

        path = Path(model_path)
        try:
            if path.suffix == ".gguf":
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
            else:
                tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"no usable tokenizer at {path}: {e}") from e
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self._tok.eos_token_id
        return () if eos is None else (eos,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat (the model's own template); raises if the model has none."""
        if not getattr(self._tok, "chat_template", None):
            raise CheckpointError("this tokenizer has no chat template")
        out = self._tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
