"""Activated LoRA against peft's own aLoRA: the adapter applies from the last occurrence of
its invocation tokens, the base model before it (and everywhere when it is absent); through
the Engine an aLoRA prompt shares the base model's published pages."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch_testlib import (
    DEVICE,
    DTYPE,
    REL_TOL,
    hf_logits,
    make_config,
    prompt,
    rel_err,
    save_peft_adapter,
    work,
)

from forkserve import Engine
from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch.errors import AdapterFormatError, AdapterShapeError
from forkserve.backend.torch.lora import load_peft_adapter
from forkserve.config import KVLayout
from forkserve.control.activation import Invocation

INVOKE = (7, 11, 13)


@pytest.fixture(scope="module")
def alora(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("alora")
    return save_peft_adapter(models["llama"], root / "alora", 4, ("q", "k", "v", "o", "down"),
                             seed=21, invocation=INVOKE)


def _with_invocation(body: list[int], at: int) -> list[int]:
    return body[:at] + list(INVOKE) + body[at:]


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED, KVLayout.ADAPTIVE])
def test_logits_match_peft_alora(models, alora, layout):
    """Invocation twice (the last one counts) and absent, chunked through the mixed batch
    (adaptive: the first item split, the second merged, in one batch)."""
    path = models["llama"]
    backend = TorchBackend(make_config(layout), path, adapters={"a": alora}, device=DEVICE,
                           dtype=DTYPE)
    aid = backend.adapter_id("a")
    assert backend.adapter_invocation(aid) == INVOKE
    prompts = [_with_invocation(_with_invocation(prompt(50, 14), 3), 12), prompt(51, 15)]
    logits = [[] for _ in prompts]
    for lo, hi in ((0, 9), (9, None)):
        items = []
        for i, p in enumerate(prompts):
            start = Invocation(INVOKE).last_start(p, 0)
            chunk = p[lo:hi]
            residual = layout is KVLayout.DISAGGREGATED or (layout is KVLayout.ADAPTIVE and i == 0)
            items.append(work(i, chunk, lo, aid, residual=residual,
                              adapter_start=start if start is not None else lo + len(chunk)))
        out = backend.forward(items, all_logits=True)
        for i in range(len(prompts)):
            logits[i].append(out.logits[i])
    for i, p in enumerate(prompts):
        ours = torch.cat(logits[i])
        assert rel_err(ours, hf_logits(path, p, alora)) < REL_TOL, i
    # Not vacuous: the invoked prompt differs from the base model after the invocation only.
    start = Invocation(INVOKE).last_start(prompts[0], 0)
    ref, base = hf_logits(path, prompts[0], alora), hf_logits(path, prompts[0])
    assert (rel_err(ref[:start], base[:start]) < REL_TOL
            and rel_err(ref[start:], base[start:]) > 0.05)
    # Absent invocation: peft runs the base model everywhere, and so do we.
    assert rel_err(torch.cat(logits[1]), hf_logits(path, prompts[1])) < REL_TOL


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED, KVLayout.ADAPTIVE])
def test_engine_alora_shares_the_base_prefix(models, alora, layout):
    path = models["llama"]

    def engine() -> Engine:
        backend = TorchBackend(make_config(layout), path, adapters={"a": alora}, device=DEVICE,
                               dtype=DTYPE)
        return Engine(backend)

    context = prompt(60, 29)
    ask = list(INVOKE) + prompt(61, 3)
    shared = engine()
    aid = shared.backend.adapter_id("a")
    h = shared.open(context)
    shared.generate(h.id, 2)
    shared.close(h.id)  # publishes the base model's pages of the context
    published = {e.page for e in shared.index.entries()}
    before = shared.metrics.base_hit_tokens
    a = shared.open(context + ask, adapter=aid)
    hit = shared.metrics.base_hit_tokens - before
    p = shared.pool.page_size
    assert hit == len(context) // p * p  # every page wholly before the invocation
    root = shared.node(a.id, shared.tip(a.id))
    assert set(root.table.base.pages[:hit // p]) <= published  # aliased, not recomputed
    out = shared.generate(a.id, 4).tokens
    shared.check_integrity()

    alone = engine()
    b = alone.open(context + ask, adapter=aid)
    # bf16 may flip a near-tie (the aliased context's K/V came from a prefill of another
    # shape; H200, round 21: the third token); float32 must agree exactly (test_model's rule).
    agree = len(out) if DTYPE == torch.float32 else 2
    assert alone.generate(b.id, 4).tokens[:agree] == out[:agree]
    # And the tokens are peft's greedy continuation.
    seq = context + ask
    for token in out[:agree]:
        assert int(hf_logits(path, seq, alora)[-1].argmax()) == token
        seq = seq + [token]


def _rewritten(alora, tmp_path, value):
    bad = tmp_path / "bad"
    shutil.copytree(alora, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = value
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("value", [[], "7 11", [7, 1.5], [True, 2], [-1], {"a": 1}])
def test_bad_invocation_tokens_are_rejected(alora, tmp_path, value):
    with pytest.raises(AdapterFormatError, match="alora_invocation_tokens"):
        load_peft_adapter(_rewritten(alora, tmp_path, value))


def test_invocation_outside_the_vocabulary_is_rejected_without_side_effects(models, alora,
                                                                            tmp_path):
    backend = TorchBackend(make_config(), models["llama"], device=DEVICE, dtype=DTYPE)
    with pytest.raises(AdapterShapeError, match="outside the model's vocabulary"):
        backend.add_adapter("a", _rewritten(alora, tmp_path, [7, 100_000]))
    assert backend.adapters == {}
