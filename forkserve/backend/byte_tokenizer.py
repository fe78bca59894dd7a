"""A byte-level tokenizer: token id = UTF-8 byte + offset. No files, no download.

The MockBackend speaks it so workloads can be written as text and scorers can read it.
"""
from __future__ import annotations

from typing import Sequence


class ByteTokenizer:
    OFFSET = 3  # 0 pad, 1 bos, 2 eos
    eos_token_id = 2
    vocab_size = 256 + OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")
