"""Tokenizer from the model's own folder or GGUF file (transformers' loaders, offline only)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from forkserve.backend.torch.errors import CheckpointError
from forkserve.backend.torch.gguf_hf_copy import tokenizer_copy


class Tokenizer:
    """Thin wrapper: ids in and out as plain lists, the chat template, the stop ids."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer

    @classmethod
    def load(cls, model_path: str | Path) -> "Tokenizer":
        from transformers import AutoTokenizer  # heavy import: only when a tokenizer is asked for

        path = Path(model_path)
        try:
            # A GGUF's tokenizer comes from its saved copy: building it from the GGUF takes
            # seconds at every load (gguf_hf_copy.py).
            folder = tokenizer_copy(path) if path.suffix == ".gguf" else path
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
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

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (grammar engines build their token tables from it)."""
        return self._tok

    @property
    def chat_template(self) -> str:
        return getattr(self._tok, "chat_template", None) or ""

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a chat (the model's own template, given ``tools`` if any); raises if the
        model has none."""
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat template")
        out = self._tok.apply_chat_template(list(messages),
                                            add_generation_prompt=add_generation_prompt,
                                            tokenize=True, tools=list(tools) if tools else None)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def render_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The chat as text (what a template does with tools and tool calls is probed on it)."""
        return self._tok.apply_chat_template(list(messages), add_generation_prompt=False,
                                             tokenize=False, tools=list(tools) if tools else None)
