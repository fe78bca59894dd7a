"""The residual host tier on the real backend: a residual page parked on the host and
brought back into other page ids gives the same logits as one never evicted."""
from __future__ import annotations

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, PAGE, make_config, prompt

from forkserve.backend.protocol import GREEDY, HostCopy, KVSlots, PageKind, SeqWork
from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch.errors import InvalidWorkError
from forkserve.config import KVForm, KVLayout


def test_offload_then_restore_reproduces_the_logits(models, adapters):
    backend = TorchBackend(make_config(KVLayout.DISAGGREGATED).replace(host_residual_pages=8),
                           models["llama"], adapters=adapters, device=DEVICE, dtype=DTYPE)
    a = backend.adapter_id("qkvo")
    ctx, question = prompt(70, 4 * PAGE), prompt(71, 3)
    base, residual = (0, 1, 2, 3), (0, 1, 2, 3)
    backend.step([SeqWork(0, tuple(ctx), 0, KVSlots(base, residual), a, form=KVForm.SPLIT)])

    def ask(res_pages: tuple[int, ...]) -> torch.Tensor:
        slots = KVSlots(base + (10,), res_pages)
        work = SeqWork(1, tuple(question), len(ctx), slots, a, GREEDY, form=KVForm.SPLIT)
        return backend.forward([work], all_logits=True).logits[0]

    reference = ask(residual + (10,))
    copies = [HostCopy(page, 7 - i) for i, page in enumerate(residual)]
    backend.offload_pages(PageKind.RESIDUAL, copies)
    for t in backend.pool.tensors_of(PageKind.RESIDUAL):  # the freed pages get reused
        t[:, list(residual)] = 0
    assert not torch.equal(ask(residual + (10,)), reference)  # the residual matters
    moved = (20, 21, 22, 23)
    backend.restore_pages(PageKind.RESIDUAL, [HostCopy(m, c.slot) for m, c in zip(moved, copies, strict=True)])
    assert torch.equal(ask(moved + (24,)), reference)


def test_host_copies_are_checked_before_anything_moves(models):
    unified = TorchBackend(make_config(KVLayout.UNIFIED).replace(host_residual_pages=4), models["llama"],
                           device=DEVICE, dtype=DTYPE)
    with pytest.raises(InvalidWorkError, match="residual pages"):
        unified.offload_pages(PageKind.RESIDUAL, [HostCopy(0, 0)])
    backend = TorchBackend(make_config(KVLayout.DISAGGREGATED).replace(host_residual_pages=4),
                           models["llama"], device=DEVICE, dtype=DTYPE)
    before = backend.host.k.clone()
    with pytest.raises(InvalidWorkError, match="outside"):
        backend.offload_pages(PageKind.RESIDUAL, [HostCopy(0, 0), HostCopy(0, 4)])
    assert torch.equal(backend.host.k, before)
