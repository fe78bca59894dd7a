"""Token sampling: greedy, or temperature + top-p with a per-request seed; logit_bias,
presence / frequency penalties, grammar masks and log-probabilities per request.

A seeded request draws from a generator seeded by (seed, position), so its tokens do not
depend on which other requests share the batch, nor on how its prompt was chunked.

Everything beyond temperature / top-p works on the logits the step already produced (after
a CUDA graph's replay, outside it), row by row for the requests that ask, so a batch of
plain requests keeps the graph's argmax and pays nothing.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Sequence

import torch

from forkserve.backend.protocol import (
    BitmaskFiller,
    PromptLogprobs,
    SamplingParams,
    TokenConstraint,
)

_MIX = 1_000_003  # odd multiplier spreading (seed, position) over the 63-bit seed space
# Byte value -> what its 8 bits (lowest first) add to 8 tokens' logits: 0 allowed, -inf not.
# A bitmask's int32 words, read as little-endian bytes, become an additive mask in one table
# lookup, and one in-place add applies it (a bool masked_fill is several times slower on CPU).
_BYTE_BIAS = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0,
                         float("-inf"))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches top_p; renormalize."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def mask_bias(bitmask: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """int32 words [rows, ceil(vocab/32)] (bit j of word i: token 32i+j, little-endian as
    xgrammar and llguidance write them) -> [rows, vocab] of 0 (allowed) and -inf (not)."""
    table = _bias_table(bitmask.device, dtype)
    rows = bitmask.shape[0]
    return table.index_select(0, bitmask.view(torch.uint8).flatten().int()).view(rows, -1)[:,
                                                                                           :vocab]


@functools.cache
def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _BYTE_BIAS.to(device, dtype)


def record_prompt(logits: torch.Tensor, tokens: Sequence[int], start: int,
                  request: PromptLogprobs) -> None:
    """Prompt log-probabilities of one prefill chunk (``logits``: a row per token, position
    ``start`` first): row i predicts the prompt token at ``start + i + 1``, the chunk's next
    token or, for its last row, ``request.following`` (none when the chunk ends the prompt)."""
    targets = list(tokens[1:]) + ([request.following] if request.following is not None else [])
    if not targets:
        return
    logprobs = torch.log_softmax(logits[:len(targets)].float(), dim=-1)
    index = torch.tensor(targets, device=logprobs.device)[:, None]
    picked = logprobs.gather(-1, index)[:, 0].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if request.top:
        values, ids = logprobs.topk(request.top, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                              strict=True)]
    for j, (token, lp, top) in enumerate(zip(targets, picked, tops, strict=True)):
        request.log.record_prompt(start + j + 1, token, lp, top)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._unseeded = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               positions: Sequence[int], greedy: torch.Tensor | None = None) -> list[int]:
        """logits [N, vocab] float32; positions: the position each sampled token will take;
        greedy: logits.argmax(-1) when already computed (inside a CUDA graph)."""
        tokens = self.draw(logits, params, positions, greedy).tolist()
        self.accept(logits, params, positions, tokens)
        return tokens

    def draw(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
             greedy: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled tokens as a device tensor [N], queued behind ``logits`` without waiting
        for the device: the host reads them back when it needs them (``TorchBackend.launch``).
        Grammar masks and penalties read host state the previous step's ``accept`` wrote."""
        if not all(p.plain for p in params):
            logits = self._adjust(logits, params, positions)
            greedy = None  # the graph's argmax saw the unadjusted logits
        if all(p.temperature == 0.0 for p in params):
            return greedy if greedy is not None else logits.argmax(dim=-1)
        out = logits.argmax(dim=-1)
        for row, (p, pos) in enumerate(zip(params, positions, strict=True)):
            if p.temperature == 0.0:
                continue
            probs = top_p_filter(torch.softmax(logits[row] / p.temperature, dim=-1), p.top_p)
            if p.seed is None:
                gen = self._unseeded
            else:
                gen = torch.Generator(device=logits.device).manual_seed(
                    (p.seed * _MIX + pos) % (1 << 63))
            out[row] = torch.multinomial(probs, 1, generator=gen)[0]
        return out

    def accept(self, raw: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
               tokens: Sequence[int]) -> None:
        """The host's half of sampling, once ``draw``'s tokens are read back: grammars advance
        past them and log-probabilities (of ``raw``, the model's own logits) are recorded."""
        for row, (p, pos, token) in enumerate(zip(params, positions, tokens, strict=True)):
            if p.constraint is not None:
                p.constraint.accept(token, pos)
            if p.log is not None:
                self._record(raw[row], p, pos, token)

    def _adjust(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                positions: Sequence[int]) -> torch.Tensor:
        """Bias, penalties, then the grammar mask, on a copy (graph outputs stay untouched)."""
        logits = logits.clone()
        vocab = logits.shape[-1]
        for row, (p, pos) in enumerate(zip(params, positions, strict=True)):
            if p.logit_bias:
                ids, bias = zip(*p.logit_bias, strict=True)
                logits[row, list(ids)] += torch.tensor(bias, dtype=logits.dtype,
                                                       device=logits.device)
            if (p.presence_penalty or p.frequency_penalty) and p.log is not None:
                counts = Counter(p.log.history(pos))
                if counts:
                    ids = torch.tensor(list(counts), device=logits.device)
                    n = torch.tensor(list(counts.values()), dtype=logits.dtype,
                                     device=logits.device)
                    logits[row, ids] -= p.frequency_penalty * n + p.presence_penalty
        rows = [row for row, p in enumerate(params) if p.constraint is not None]
        if rows:
            # Masks are computed on the host by the grammar engine, every row of a kind of
            # constraint in one call, then applied where the logits live.
            bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
            kinds: dict[BitmaskFiller, list[tuple[TokenConstraint, int, int]]] = {}
            for i, row in enumerate(rows):
                constraint = params[row].constraint
                kinds.setdefault(constraint.filler, []).append((constraint, i, positions[row]))
            for filler, items in kinds.items():
                filler.fill(bitmask, items)
            bias = mask_bias(bitmask.to(logits.device, non_blocking=True), vocab, logits.dtype)
            if len(rows) == len(params):
                logits.add_(bias)
            else:
                logits[torch.tensor(rows, device=logits.device)] += bias
        return logits

    @staticmethod
    def _record(raw: torch.Tensor, p: SamplingParams, pos: int, token: int) -> None:
        """Log-probabilities of the model's own distribution at this position (before bias,
        penalties, masks and temperature, as vLLM reports them by default)."""
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            values, ids = logprobs.topk(p.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        p.log.record(pos, token, float(logprobs[token]), top)
