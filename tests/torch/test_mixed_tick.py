"""A tick of general items beside steady rows (``TorchBackend.launch(work, batch)``, issue 21):
the rows keep their column path and the kept tables, and the tick's tokens, logits and
written K/V equal those of the same step run as items, for a prefill and for a committed
tail beside the rows (in their cascade group or not), with cascade on and off, unified and
disaggregated; the next steady tick reuses the tables the mixed tick kept. An item that
disagrees with its group's rows sends the step to the items' path, which refuses it.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, PAGE, as_decode_batch, make_config, pages_for, prompt, work

from forkserve import kernels
from forkserve.backend.protocol import SharedPrefix
from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch import backend as backend_module
from forkserve.backend.torch.errors import InvalidWorkError
from forkserve.backend.torch.kernel_attention import KernelAttention
from forkserve.backend.torch.pending_step import PendingStep
from forkserve.config import KVLayout

SHARED = 2    # pages of the context the base rows share (one cascade group)
ROWS = 6      # rows 1..ROWS; the odd ones run an adapter (split where the layout splits)
TAIL_SEQ = ROWS + 1
GROUPED_SEQ = ROWS + 2  # a base session on the shared context: its tail joins the rows' group
GROUPED_PAGES = pages_for(0)[:SHARED] + pages_for(2)[:SHARED]  # pages no row uses


def _row_pages(seq: int) -> tuple[int, ...]:
    own = pages_for(seq)
    return own if seq % 2 else pages_for(0)[:SHARED] + own[SHARED:]


def _setup(models, adapters, layout: KVLayout, cascade: bool,
           attention="auto") -> tuple[TorchBackend, list]:
    """A backend holding a shared context, the rows' prompts and the tail's session; the
    rows' first decode items."""
    backend = TorchBackend(make_config(layout), models["llama"],
                           adapters={"qkvo": adapters["qkvo"]}, device=DEVICE, dtype=DTYPE,
                           attention=attention)
    backend.cascade_attention = cascade
    split = layout is KVLayout.DISAGGREGATED
    context = prompt(0, SHARED * PAGE)
    backend.step([work(0, context, 0, sampling=None)])
    prefill, rows = [], []
    for s in range(1, ROWS + 1):
        adapter = 0 if s % 2 else None
        start = 0 if adapter is not None else len(context)
        # Positions 8..13 over 3 ticks: no row crosses into a wider table (a full rebuild).
        tokens = prompt(s, SHARED * PAGE + s - 1 - start)
        prefill.append(work(s, tokens, start, adapter, sampling=None, residual=split,
                            pages=_row_pages(s)))
        rows.append(work(s, [7 + s], start + len(tokens), adapter, residual=split, decode=True,
                         pages=_row_pages(s),
                         shared_prefix=None if adapter is not None else SharedPrefix(0, SHARED)))
    # The tail's session: longer than any row, so its table is the widest.
    prefill.append(work(TAIL_SEQ, prompt(TAIL_SEQ, 30), 0, 0, sampling=None, residual=split))
    prefill.append(work(GROUPED_SEQ, prompt(GROUPED_SEQ, PAGE), len(context), sampling=None,
                        pages=GROUPED_PAGES))
    backend.step(prefill)
    return backend, rows


def _general(kind: str, split: bool) -> list:
    if kind == "prefill":  # a new session's prompt, not sampling
        return [work(TAIL_SEQ + 1, prompt(50, 9), 0, sampling=None, pages=pages_for(0)[SHARED:])]
    if kind == "grouped":
        return [work(GROUPED_SEQ, [5, 6, 9], (SHARED + 1) * PAGE, pages=GROUPED_PAGES,
                     shared_prefix=SharedPrefix(0, SHARED))]
    return [work(TAIL_SEQ, [5, 6, 9], 30, 0, residual=split)]  # a committed tail, sampling


def _pools(backend: TorchBackend) -> list[torch.Tensor]:
    pool = backend.pool
    return [t for t in (pool.k, pool.v, getattr(pool, "k_res", None), getattr(pool, "v_res", None))
            if t is not None]


@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
@pytest.mark.parametrize("kind", ["prefill", "tail", "grouped"])
def test_a_mixed_tick_equals_its_items_and_keeps_the_tables(models, adapters, monkeypatch, kind,
                                                             layout, cascade):
    ours, rows = _setup(models, adapters, layout, cascade)
    ref, _ = _setup(models, adapters, layout, cascade)
    real = backend_module.of_batch
    rebuilt: list[bool] = []

    def spied(batch, limits, slots, scratch, scratch_res, kept):
        got = real(batch, limits, slots, scratch, scratch_res, kept)
        rebuilt.append(kept.pages.changed is None)
        return got

    monkeypatch.setattr(backend_module, "of_batch", spied)
    steady = as_decode_batch(rows)
    general = _general(kind, layout is KVLayout.DISAGGREGATED)
    for tick in range(3):
        # The same page objects every tick, as the steady set hands them; tick 1 is mixed.
        batch = dataclasses.replace(steady, tokens=tuple(t + tick for t in steady.tokens),
                                    positions=steady.positions + tick)
        work_now = general if tick == 1 else []
        handle = ours.launch(work_now, batch)
        assert isinstance(handle, PendingStep)
        got = handle.output()
        want = ref.forward([*work_now, *batch.items()])
        assert got.result.next_tokens == want.result.next_tokens
        assert got.result.cost == dataclasses.replace(want.result.cost, ms=got.result.cost.ms)
        for a, b in zip(got.logits, want.logits, strict=True):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b)
        for a, b in zip(_pools(ours), _pools(ref), strict=True):
            assert torch.equal(a, b)
    # Every tick, the mixed one too, took the rows from their columns; only the first built
    # the tables afresh.
    assert rebuilt == [True, False, False]


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
def test_a_mixed_ticks_rows_read_their_shared_context_once(models, adapters, monkeypatch,
                                                             layout):
    """With the Triton kernels (the interpreter on CPU), the rows of a tick that also
    prefills take the decode kernels with their cascade tiles, as a decode-only tick's do, and
    the tick equals the same step run as items (which plans the same tiles), bit for bit."""
    attention = (lambda: KernelAttention(use_triton=True)) if DEVICE.type == "cpu" else (
        lambda: "triton")
    ours, rows = _setup(models, adapters, layout, True, attention())
    ref, _ = _setup(models, adapters, layout, True, attention())
    tiled = []
    for name in ("cascade_decode", "cascade_residual_decode"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, **k: tiled.append(1) or
                            _real(*a, **k))
    general = _general("prefill", layout is KVLayout.DISAGGREGATED)
    batch = as_decode_batch(rows)
    got = ours.launch(general, batch).output()
    assert tiled, "the rows' shared context was read per row"
    want = ref.forward([*general, *batch.items()])
    assert got.result.next_tokens == want.result.next_tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        assert a is None or torch.equal(a, b)


def test_an_item_that_disagrees_with_its_rows_group_is_refused(models, adapters):
    backend, rows = _setup(models, adapters, KVLayout.UNIFIED, True)
    wrong = GROUPED_PAGES[::-1]  # not the rows' shared pages
    item = work(GROUPED_SEQ, [5, 6, 9], (SHARED + 1) * PAGE, pages=wrong,
                shared_prefix=SharedPrefix(0, SHARED))
    with pytest.raises(InvalidWorkError) as refused:
        backend.launch([item], as_decode_batch(rows)).result()
    assert refused.value.seq_ids  # validation named a member of the group
