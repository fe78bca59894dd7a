"""A split-form (disaggregated) prefill does no more work than a unified one beyond its
residual's own writes: the rows that read a side already present are left out of that
side's scatter (``AttentionMetadata.base_writes`` / ``res_writes``) rather than written to
the scratch page, and the forward's operations outside the attention kernel, counted per
aten call, exceed unified's only by the residual writes (issue 15, round 4)."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch_testlib import DEVICE, DTYPE, REL_TOL, make_config, pages_for, prompt, rel_err, work

from forkserve.backend.protocol import GREEDY, KVSlots, SeqWork
from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch.attention import EagerAttention, write_kv
from forkserve.backend.torch.batch import BatchLimits, build
from forkserve.backend.torch.decode_rows import of_items
from forkserve.backend.torch.fused import Fusions
from forkserve.backend.torch.kept_tables import KeptTables
from forkserve.backend.torch.mixed_batch import join
from forkserve.config import KVForm, KVLayout

PAGE, SCRATCH = 4, 100
SLOTS = {7: 0, 9: 1}
LIMITS = BatchLimits(vocab_size=1000, max_context=256, page_size=PAGE, num_pages=SCRATCH,
                     num_residual_pages=SCRATCH, disaggregated=True, merged_form=False)
SENTINEL = 7.0
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _item(seq: int, n: int, start: int, adapter: int | None, **flags) -> SeqWork:
    pages = tuple(range(seq * 20, seq * 20 + 20))
    res = tuple(range(seq * 20 + 5, seq * 20 + 25)) if adapter is not None else None
    return SeqWork(seq, tuple(range(3, 3 + n)), start, KVSlots(pages, res), adapter, GREEDY,
                   form=KVForm.SPLIT if adapter is not None else KVForm.MERGED, **flags)


def _expected(mapping: torch.Tensor, scratch: int) -> tuple[list[int], list[int]]:
    at = mapping.tolist()
    rows = [i for i, s in enumerate(at) if s // PAGE != scratch]
    return rows, [at[i] for i in rows]


def test_build_lists_only_the_rows_that_write():
    items = [_item(0, 5, 0, 7, write_base=False), _item(1, 3, 2, 9),
             _item(2, 4, 0, None), _item(3, 2, 6, 9, write_residual=False)]
    meta = build(items, LIMITS, SLOTS, False, torch.device("cpu"), SCRATCH, SCRATCH).meta
    for writes, mapping in ((meta.base_writes, meta.slot_mapping),
                            (meta.res_writes, meta.res_slot_mapping)):
        rows, at = _expected(mapping, SCRATCH)
        assert writes[0].tolist() == rows and writes[1].tolist() == at
    # Every row writes both sides: nothing listed (the plain scatter).
    full = build([_item(1, 3, 2, 9)], LIMITS, SLOTS, False, torch.device("cpu"), SCRATCH, SCRATCH)
    assert full.meta.base_writes is None and full.meta.res_writes is None


def test_join_lists_what_build_lists():
    """A prefill item joined with decode rows (a mixed tick) writes what build of both does,
    and, both sides split throughout, adds no k/v delta, as build's batch adds none (no
    merge mask: the model computes no k/v LoRA expansion for it)."""
    items = [_item(0, 5, 0, 7, write_base=False), _item(1, 3, 2, 9)]
    rows = [_item(2, 1, 9, 9, decode=True), _item(3, 1, 4, None, decode=True)]
    dev = torch.device("cpu")
    ref = build([*items, *rows], LIMITS, SLOTS, False, dev, SCRATCH, SCRATCH).meta
    got = join(build(items, LIMITS, SLOTS, False, dev, SCRATCH, SCRATCH),
               of_items(rows, LIMITS, SLOTS, SCRATCH, SCRATCH,
                        KeptTables(PAGE, 32)).to_batch(dev, None),
               SCRATCH, SCRATCH, PAGE).meta
    for field, mapping in (("base_writes", "slot_mapping"), ("res_writes", "res_slot_mapping")):
        assert _written(got, field, mapping) == _written(ref, field, mapping), field
    assert ref.kv_merge_mask is None and got.kv_merge_mask is None


def _written(meta, field: str, mapping: str) -> list[tuple[int, int]]:
    """(row, slot) of every write that reaches a page (writes to the scratch page left out)."""
    writes = getattr(meta, field)
    rows, at = (writes[0].tolist(), writes[1].tolist()) if writes is not None else (
        list(range(len(getattr(meta, mapping)))), getattr(meta, mapping).tolist())
    return [(r, s) for r, s in zip(rows, at, strict=True) if s // PAGE != SCRATCH]


@pytest.mark.parametrize("attention", ["eager", "triton"])
def test_reading_a_present_side_writes_neither_it_nor_the_scratch_page(models, adapters,
                                                                        attention):
    """An item whose base (or residual) pages are already written reads them untouched, no
    write reaches the scratch page, and its logits are those of the item that wrote them;
    beside it in the batch, an item that writes both sides still does (K/V projected from
    the writing rows alone where they are at most half the batch, else from all rows)."""
    backend = TorchBackend(make_config(KVLayout.DISAGGREGATED), models["llama"],
                           adapters=adapters, device=DEVICE, dtype=DTYPE, attention=attention,
                           lora_targets=TARGETS)
    if attention == "triton":  # the Triton glue too (RoPE of the compact K rows; CUDA's default)
        backend.model.fx = Fusions(compile=False, triton=True)
    pool, aid = backend.pool, backend.adapter_id("qkvo")
    tokens = prompt(70, 13)
    wrote = backend.forward([work(0, tokens, 0, aid, residual=True)]).logits[0]
    pool.k[:, pool.scratch_page] = SENTINEL
    pool.v[:, pool.scratch_page] = SENTINEL
    pool.k_res[:, pool.scratch_residual_page] = SENTINEL
    pool.v_res[:, pool.scratch_residual_page] = SENTINEL
    base = pool.k.clone()
    # No row writes base K/V: the step computes no K/V projections at all.
    step = backend.forward([work(0, tokens, 0, aid, residual=True, write_base=False)])
    assert rel_err(step.logits[0], wrote) < REL_TOL and torch.equal(pool.k, base)
    alone = backend.forward([work(1, tokens, 0, aid, residual=True)]).logits[0]
    base_1 = pool.k[:, list(pages_for(1))].clone()
    # The writing rows (a chunk at positions 5..12) are under half the batch: K/V projected
    # from them alone, rotated at their own positions.
    step = backend.forward([work(0, tokens, 0, aid, residual=True, write_base=False),
                            work(1, tokens[5:], 5, aid, residual=True)])
    assert rel_err(step.logits[0], wrote) < REL_TOL and rel_err(step.logits[1], alone) < REL_TOL
    # Item 1's pages hold the K it wrote alone: equal up to rounding only past layer 0, since
    # alone it attended on the FRESH route and here the chunk's prefix is read from pages.
    ones = list(pages_for(1))
    assert rel_err(pool.k[:, ones], base_1) < REL_TOL
    base[:, ones] = pool.k[:, ones]
    assert torch.equal(pool.k, base)
    # Most rows write (K/V projected for all rows, the writing ones taken): the same.
    step = backend.forward([work(0, tokens[:4], 0, aid, residual=True, write_base=False),
                            work(1, tokens, 0, aid, residual=True)])
    assert rel_err(step.logits[1], alone) < REL_TOL and rel_err(pool.k[:, ones], base_1) < REL_TOL
    base[:, ones] = pool.k[:, ones]
    assert torch.equal(pool.k, base)
    # Taken here: the steps above rewrote item 0's residual pages from batches of other
    # shapes, equal only up to the CPU GEMM's rounding (bitwise on some CPUs, not on others).
    res = pool.k_res.clone()
    step = backend.forward([work(0, tokens, 0, aid, residual=True, write_residual=False)])
    assert rel_err(step.logits[0], wrote) < REL_TOL
    assert torch.equal(pool.k_res[:, list(pages_for(0))], res[:, list(pages_for(0))])
    for t, scratch in ((pool.k, pool.scratch_page), (pool.v, pool.scratch_page),
                       (pool.k_res, pool.scratch_residual_page),
                       (pool.v_res, pool.scratch_residual_page)):
        assert bool((t[:, scratch] == SENTINEL).all())


# Matrix products: (the argument whose last dim is the inner one) per op.
_PRODUCTS = {"linear": 0, "matmul": 0, "mm": 0, "addmm": 1, "addmm_": 1}


class _Count(TorchDispatchMode):
    """aten calls that compute (views left out), paused inside the attention kernel; and the
    multiply-adds of the matrix products among them. Apart from them: the host tensors made
    (``lift_fresh``: ``batch.build``'s metadata, one per index tensor) and their copies to
    another device (a ``_to_copy`` from the CPU, made on CUDA only: on the CPU ``.to(device)``
    returns the tensor itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.macs = 0
        self.on = True
        self.host_tensors = 0
        self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "lift_fresh":
            self.host_tensors += 1
        elif name == "_to_copy" and args[0].device.type == "cpu" and out.device != args[0].device:
            self.uploads += 1
        elif self.on and not func.is_view:
            self.ops[name] += 1
            if name in _PRODUCTS:
                self.macs += out.numel() * args[_PRODUCTS[name]].shape[-1]
        return out


class _Counted:
    """The layer's K/V (and residual) writes counted; the attention itself not (the kernel
    benchmark compares it: residual/unified 1.01-1.09x)."""

    def __init__(self, count: _Count) -> None:
        self.count, self.inner = count, EagerAttention()

    def forward(self, q, k, v, k_res, v_res, kv, b_k, b_v, meta, rope):
        write_kv(kv, k, v, k_res, v_res, meta)
        self.count.on = False
        try:
            return self.inner.forward(q, k, v, k_res, v_res, kv, b_k, b_v, meta, rope)
        finally:
            self.count.on = True


@pytest.mark.parametrize("base_present", [False, True])
def test_split_prefill_ops_exceed_unified_only_by_the_residual_writes(models, adapters,
                                                                       base_present):
    """Counted per aten call over a whole prefill of two adapters' items: the split form's
    operations are unified's, less the k/v LoRA expands, plus per layer its two residual
    writes and one reduction of x A to the residual rows. With the base pages present
    (another agent wrote them, the react workload's case) it writes the residuals only and
    projects q alone (no K/V projection, RoPE over the q heads only)."""
    counts, macs, host, uploads = {}, {}, {}, {}
    for layout in (KVLayout.UNIFIED, KVLayout.DISAGGREGATED):
        count = _Count()
        # Plain fusions: compiled ones would run as Inductor kernels, not aten calls.
        backend = TorchBackend(make_config(layout), models["llama"], adapters=adapters,
                               device=DEVICE, dtype=DTYPE, attention=_Counted(count),
                               lora_targets=TARGETS, compile_fusions=False)
        split = layout is KVLayout.DISAGGREGATED
        ids = [backend.adapter_id("qkvo"), backend.adapter_id("all")]
        items = [work(s, prompt(80 + s, 11), 0, ids[s], residual=split,
                      write_base=not (split and base_present)) for s in range(2)]
        backend.forward(items)
        with count:
            backend.forward(items)
        counts[layout], macs[layout] = count.ops, count.macs
        host[layout], uploads[layout] = count.host_tensors, count.uploads
    layers = backend.model_config.num_layers
    unified, split = counts[KVLayout.UNIFIED], counts[KVLayout.DISAGGREGATED]
    own = 0 if base_present else 2 * layers
    assert split["index_copy_"] == own + 2 * layers
    assert split - unified == collections.Counter({"index_copy_": own, "sum": layers} if own
                                                  else {"sum": layers})
    assert sum(split.values()) <= sum(unified.values()) + 2 * layers
    # Per forward, not per layer: the split form's own metadata, res_slot_mapping and
    # res_block_tables, plus base_writes' two tensors where rows skip the base write (each one
    # small host->device copy on CUDA, none on the CPU: the CUDA run's extra `_to_copy`s).
    extra = 2 + (2 if base_present else 0)
    assert host[KVLayout.DISAGGREGATED] - host[KVLayout.UNIFIED] == extra
    assert uploads[KVLayout.DISAGGREGATED] - uploads[KVLayout.UNIFIED] == (
        0 if DEVICE.type == "cpu" else extra)
    # Fewer multiply-adds: no k/v LoRA expand, and no K/V projection where the base is present.
    cfg, tokens = backend.model_config, sum(len(item.tokens) for item in items)
    kv_projection = 2 * layers * tokens * cfg.kv_size * cfg.hidden_size
    assert macs[KVLayout.DISAGGREGATED] <= macs[KVLayout.UNIFIED] - (kv_projection if base_present
                                                                     else 1)
