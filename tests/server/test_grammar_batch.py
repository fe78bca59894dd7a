"""The batched grammar mask: one xgrammar call fills a step's rows (each constraint at its own
position), and the sampler's table unpacking blocks exactly the tokens the bits disallow."""

from __future__ import annotations

import json

import torch

from forkserve.backend.protocol import SamplingParams
from forkserve.backend.torch.sampler import Sampler, mask_bias
from forkserve.interfaces.server.grammar import GrammarConstraint

SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["add", "sub"]}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}



def test_mask_bias_reads_every_bit():
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    words = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(1))
    allowed = torch.tensor([[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
                            for r in range(3)])
    want = torch.where(allowed, 0.0, float("-inf"))
    assert torch.equal(mask_bias(words, vocab, torch.float32), want)


def test_one_call_fills_rows_at_different_positions(grammars, tokenizer):
    """Rows in different grammar states, in a scrambled order, one of them rolled back: the
    batch fill writes what each matcher alone would."""
    compiled = grammars.json_schema(SCHEMA, "response_format")
    ids = tokenizer.encode('{"name": "add", "n": 12}')
    constraints = [GrammarConstraint(compiled, 0) for _ in range(4)]
    depths = [0, 3, len(ids), 5]
    for c, depth in zip(constraints, depths, strict=True):
        for pos, token in enumerate(ids[:depth]):
            c.accept(token, pos)
    positions = [0, 3, 2, 5]  # the third is asked about position 2: it rolls back
    words = (len(tokenizer.hf) + 31) // 32
    batched = torch.zeros(4, words, dtype=torch.int32)
    rows = [(c, 3 - i, pos) for i, (c, pos) in enumerate(zip(constraints, positions, strict=True))]
    constraints[0].filler.fill(batched, rows)
    for c, row, pos in rows:
        alone = torch.zeros(1, words, dtype=torch.int32)
        c.matcher_at(pos).fill_next_token_bitmask(alone, 0)
        assert torch.equal(batched[row], alone[0])
    assert not torch.equal(batched[3], batched[2])  # the states differ, so do the masks


def test_a_batch_of_constrained_rows_samples_only_allowed_tokens(grammars, tokenizer):
    sampler = Sampler(torch.device("cpu"))
    vocab = len(tokenizer.hf)
    compiled = grammars.json_schema(SCHEMA, "response_format")
    constraints = [GrammarConstraint(compiled, 0) for _ in range(3)]
    params = [SamplingParams(temperature=1.0, seed=seed, constraint=c)
              for seed, c in enumerate(constraints)]
    gen = torch.Generator().manual_seed(0)
    texts: list[list[int]] = [[], [], []]
    for pos in range(40):
        live = [i for i, c in enumerate(constraints) if not c.completed]
        if not live:
            break
        tokens = sampler.sample(torch.randn(len(live), vocab, generator=gen),
                                [params[i] for i in live], [pos] * len(live))
        for i, token in zip(live, tokens, strict=True):
            texts[i].append(token)
    for t in texts:
        reply = json.loads(tokenizer.decode([x for x in t if x not in tokenizer.eos_token_ids]))
        assert reply["name"] in ("add", "sub") and isinstance(reply["n"], int)
