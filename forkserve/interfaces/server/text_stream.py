"""TextStream: generated token ids -> text deltas, with OpenAI ``stop`` strings.

A stop string ends the generation; the text is cut before it (OpenAI semantics) unless
``keep_stop_text``.

Decodes the whole generation each time (simple, and exact for tokenizers whose decode
merges across tokens); holds back an incomplete UTF-8 character and any tail that could
still become a stop string, so a streamed delta never has to be taken back.
"""
from __future__ import annotations

from typing import Callable, Sequence

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (),
                 keep_stop_text: bool = False) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        # Keep the text through the end of the last token: a branch session keeps every
        # generated token in its context, so its text must show them all.
        self._keep_stop_text = keep_stop_text
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._emitted = 0
        self.stopped = False  # a stop string was found; the text ends before it

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        """The new text that is safe to emit after ``ids``."""
        if self.stopped:
            return ""
        self._ids.extend(ids)
        text = self._decode(self._ids)
        if self._stop:
            search_from = max(0, self._emitted - self._hold)
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._take(text, None if self._keep_stop_text else min(hits))
        end = len(text) - self._hold
        if text.endswith(_REPLACEMENT):
            end = min(end, len(text.rstrip(_REPLACEMENT)))
        return self._take(text, end)

    def finish(self) -> str:
        """Everything not emitted yet (the generation is over)."""
        if self.stopped:
            return ""
        return self._take(self._decode(self._ids), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self._emitted:
            return ""
        delta = text[self._emitted:end]
        self._emitted = end
        return delta
