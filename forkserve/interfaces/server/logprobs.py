"""Log-probabilities in the OpenAI shapes: chat ``logprobs.content`` and completions'
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``."""

from __future__ import annotations

from typing import Callable, Sequence

from forkserve.interfaces.server.schemas import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)
from forkserve.interfaces.server.token_log import SampledToken

TokenText = Callable[[int], str]  # one token id -> its text (special tokens kept)


def chat_logprobs(records: Sequence[SampledToken], text: TokenText, top: int) -> ChatLogprobs:
    def entry(tok: int, lp: float) -> tuple[str, float, list[int]]:
        s = text(tok)
        return s, lp, list(s.encode("utf-8"))

    content = []
    for r in records:
        s, lp, b = entry(r.token, r.logprob)
        content.append(
            TokenLogprob(
                token=s,
                logprob=lp,
                bytes=b,
                top_logprobs=[
                    TopLogprob(token=t, logprob=v, bytes=bb)
                    for t, v, bb in (entry(i, x) for i, x in r.top[:top])
                ],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    records: Sequence[SampledToken], text: TokenText, top: int, offset: int
) -> CompletionLogprobs:
    """``offset``: characters of the choice's text before its first reported token. An echoed
    prompt's records come first when asked (its first token: logprob and top None, as OpenAI
    and vLLM report it)."""
    tokens = [text(r.token) for r in records]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[r.logprob for r in records],
        top_logprobs=[
            _top_by_text(r.top[:top], text) if r.logprob is not None else None for r in records
        ]
        if top
        else None,
        text_offset=offsets,
    )


def _top_by_text(top: Sequence[tuple[int, float]], text: TokenText) -> dict[str, float]:
    """The completions shape keys the top tokens by text: where two share one (byte pieces of
    one character), the more likely one's value stays."""
    out: dict[str, float] = {}
    for token, value in top:
        out.setdefault(text(token), value)
    return out
