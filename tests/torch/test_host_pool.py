"""The residual host tier on the real backend: a residual page parked on the host and
brought back into other page ids holds the same bits and gives the same logits as one never
evicted; a batch of copies costs a fixed number of operations; offloads still in flight land
in issue order before a restore reads their slots."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, PAGE, make_config, prompt

from forkserve.backend.protocol import GREEDY, HostCopy, KVSlots, PageKind, SeqWork
from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch.copy_lane import CopyLane
from forkserve.backend.torch.errors import InvalidWorkError
from forkserve.backend.torch.host_pool import HostResidualPool
from forkserve.backend.torch.kv_pool import KVPool
from forkserve.bench.multilora.workload import tiny_config
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
    backend.restore_pages(PageKind.RESIDUAL,
                          [HostCopy(m, c.slot) for m, c in zip(moved, copies, strict=True)])
    assert torch.equal(ask(moved + (24,)), reference)


def test_host_copies_are_checked_before_anything_moves(models):
    unified = TorchBackend(make_config(KVLayout.UNIFIED).replace(host_residual_pages=4),
                           models["llama"], device=DEVICE, dtype=DTYPE)
    with pytest.raises(InvalidWorkError, match="residual pages"):
        unified.offload_pages(PageKind.RESIDUAL, [HostCopy(0, 0)])
    backend = TorchBackend(make_config(KVLayout.DISAGGREGATED).replace(host_residual_pages=4),
                           models["llama"], device=DEVICE, dtype=DTYPE)
    before = backend.host.k.clone()
    with pytest.raises(InvalidWorkError, match="outside"):
        backend.offload_pages(PageKind.RESIDUAL, [HostCopy(0, 0), HostCopy(0, 4)])
    assert torch.equal(backend.host.k, before)


def _offload_restore(backend, pages, slots, moved):
    """Park ``pages`` in ``slots``, blank them, bring them back into ``moved``."""
    backend.offload_pages(PageKind.RESIDUAL,
                          [HostCopy(p, s) for p, s in zip(pages, slots, strict=True)])
    for t in backend.pool.tensors_of(PageKind.RESIDUAL):
        t[:, list(pages)] = 0
    backend.restore_pages(PageKind.RESIDUAL,
                          [HostCopy(m, s) for m, s in zip(moved, slots, strict=True)])


def test_restored_pages_equal_the_written_ones_bitwise(models, adapters):
    backend = TorchBackend(make_config(KVLayout.DISAGGREGATED).replace(host_residual_pages=8),
                           models["llama"], adapters=adapters, device=DEVICE, dtype=DTYPE)
    pages = (0, 1, 2, 3)
    backend.step([SeqWork(0, tuple(prompt(72, 4 * PAGE)), 0, KVSlots(pages, pages),
                          backend.adapter_id("qkvo"), form=KVForm.SPLIT)])
    written = [t[:, list(pages)].clone() for t in backend.pool.tensors_of(PageKind.RESIDUAL)]
    moved = (30, 12, 21, 5)  # out of order: each page lands where its copy says
    _offload_restore(backend, pages, (6, 0, 3, 7), moved)
    for before, t in zip(written, backend.pool.tensors_of(PageKind.RESIDUAL), strict=True):
        assert torch.equal(t[:, list(moved)], before)


class _CountingLane(CopyLane):
    """Counts the lane's operations; with ``late`` its copies to the host land only when
    waited for (a device copy still in flight)."""

    def __init__(self, device, late=False):
        super().__init__(device)
        self.calls, self.late = Counter(), late

    def indices(self, values):
        self.calls["indices"] += 1
        return super().indices(values)

    def to_host(self, src):
        self.calls["to_host"] += 1
        out, landed = super().to_host(src)
        return (out, _Late(landed)) if self.late else (out, landed)

    def to_device(self, src):
        self.calls["to_device"] += 1
        return super().to_device(src)


class _Late:
    """Not done until waited for; the wait is the real copy's (on CUDA the bytes are on their
    way until then)."""

    def __init__(self, landed):
        self.inner, self.landed = landed, False

    def done(self):
        return self.landed

    def wait(self):
        self.inner.wait()
        self.landed = True


def _host_pool(slots=16, late=False):
    pool = KVPool(tiny_config(), KVLayout.DISAGGREGATED, PAGE, 32, 32, 8, DEVICE, DTYPE)
    for t in pool.tensors_of(PageKind.RESIDUAL):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(5)).to(t))
    host = HostResidualPool(pool, slots)
    host.lane = _CountingLane(host.lane.device, late)
    return pool, host


@pytest.mark.parametrize("n", [1, 12])
def test_a_batch_costs_the_same_operations_whatever_its_size(n):
    """One index copy and one transfer per call, whatever its pages: never one per page."""
    _, host = _host_pool()
    host.offload([HostCopy(p, p) for p in range(n)])
    assert host.lane.calls == Counter(indices=1, to_host=1)
    host.lane.calls.clear()
    host.restore([HostCopy(20 + i, i) for i in range(n)])
    assert host.lane.calls == Counter(indices=1, to_device=1)


def test_offloads_land_in_issue_order_and_a_restore_waits_only_for_its_slots():
    pool, host = _host_pool(late=True)
    k, _ = pool.tensors_of(PageKind.RESIDUAL)
    host.offload([HostCopy(1, 0)])
    host.offload([HostCopy(2, 0), HostCopy(3, 1)])  # slot 0 again: the later bytes win
    host.offload([HostCopy(4, 5)])
    assert len(host._landing) == 3 and not host.k.any()  # nothing landed: copies in flight
    host.restore([HostCopy(10, 0)])
    assert len(host._landing) == 1  # the offload of slot 5 is still in flight
    # The host tier lives in host memory whatever the device: compare there.
    assert torch.equal(k[:, 10], k[:, 2]) and torch.equal(host.k[:, 1], k[:, 3].cpu())
    host.settle()
    assert not host._landing and torch.equal(host.k[:, 5], k[:, 4].cpu())
