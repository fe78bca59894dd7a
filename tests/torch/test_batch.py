"""Decode rows: the CUDA-graph inputs (`decode_rows.of_items`) and the steady rows' columns
(`of_batch`, with its eager tensors `to_batch`) hold exactly what `build` computes; `of_batch`
answers None wherever `validate` refuses a row."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_testlib import as_decode_batch

from forkserve.backend.protocol import GREEDY, KVSlots, SeqWork, SharedPrefix
from forkserve.backend.torch import cascade as cascade_tiles
from forkserve.backend.torch.batch import BatchLimits, build, validate
from forkserve.backend.torch.decode_rows import ROW_FIELDS, TABLE_FIELDS, of_batch, of_items
from forkserve.backend.torch.kept_tables import KeptTables
from forkserve.config import KVForm
from forkserve.errors import ForkServeError

PAGE, PAGES, SCRATCH = 16, 64, 500
SLOTS = {7: 0, 9: 3}


# layout -> (the pool keeps residual pages, an adapter's item may run merged)
LAYOUTS = {"unified": (False, True), "disaggregated": (True, False), "adaptive": (True, True)}


def _limits(layout: str) -> BatchLimits:
    disaggregated, merged_form = LAYOUTS[layout]
    return BatchLimits(vocab_size=1000, max_context=PAGES * PAGE, page_size=PAGE, num_pages=SCRATCH,
                       num_residual_pages=SCRATCH, disaggregated=disaggregated,
                       merged_form=merged_form)


def _work(rng: random.Random, layout: str, steady: bool, n: int = 8) -> list[SeqWork]:
    """Decode items; ``steady``: as steady rows are (both sides written, the pages they read
    listed, no aLoRA) over one shared prefix of 3 pages. Adaptive: merged and split rows."""
    disaggregated, merged_form = LAYOUTS[layout]
    shared = tuple(rng.sample(range(SCRATCH), 3))
    work = []
    for i in range(n):
        at = rng.randrange(3 * PAGE, 40 * PAGE)
        adapter = rng.choice([None, 7, 9])
        table = shared + tuple(rng.sample(range(SCRATCH), PAGES - 3))
        split = disaggregated and adapter is not None and (not merged_form or rng.random() < 0.5)
        res = tuple(rng.sample(range(SCRATCH), PAGES)) if split else None
        if steady:
            table, res = table[:at // PAGE + 1], res[:at // PAGE + 1] if res else None
        work.append(SeqWork(i, (rng.randrange(1000),), at, KVSlots(table, res), adapter, GREEDY,
                            decode=True, write_base=steady or rng.random() < 0.7,
                            write_residual=steady or rng.random() < 0.7,
                            form=KVForm.SPLIT if split else KVForm.MERGED,
                            adapter_start=0 if adapter is not None else at + 1,
                            shared_prefix=SharedPrefix(0, 3) if steady else None))
    return work


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("steady", [False, True])
def test_decode_rows_equal_build(layout, steady):
    disaggregated = LAYOUTS[layout][0]
    work = _work(random.Random(0), layout, steady)
    ref = build(work, _limits(layout), SLOTS, False, torch.device("cpu"), SCRATCH, SCRATCH)
    # Over kept tables of earlier items too: every row new, or two rows new (rewritten alone).
    kept, other = KeptTables(PAGE, 32), _work(random.Random(5), layout, steady)
    for earlier in (other, [*work[:-2], *other[-2:]]):
        of_items(earlier, _limits(layout), SLOTS, SCRATCH, SCRATCH, kept)
        for name in TABLE_FIELDS:
            assert np.array_equal(
                getattr(of_items(work, _limits(layout), SLOTS, SCRATCH, SCRATCH, kept), name),
                getattr(of_items(work, _limits(layout), SLOTS, SCRATCH, SCRATCH,
                                 KeptTables(PAGE, 32)), name)), name
    rows = of_items(work, _limits(layout), SLOTS, SCRATCH, SCRATCH, kept)
    expect = {"input_ids": ref.input_ids, "positions": ref.positions, "token_slot": ref.token_slot,
              "slot_mapping": ref.meta.slot_mapping, "seq_lens": ref.meta.seq_lens,
              "seq_slot": ref.meta.seq_slot, "block_tables": ref.meta.block_tables}
    if disaggregated:
        expect |= {"res_slot_mapping": ref.meta.res_slot_mapping,
                   "res_block_tables": ref.meta.res_block_tables}
    # The form column: a split graph's merge mask (the seed mixes both forms in adaptive).
    merge = ref.meta.kv_merge_mask
    assert (merge is not None) == (layout == "adaptive")
    expect["kv_merge"] = (torch.zeros(len(work), dtype=torch.int64) if merge is None
                          else merge[:, 0].long())
    for name, value in expect.items():
        assert np.array_equal(getattr(rows, name), value.numpy()), name
    if not steady:
        return
    columns = of_batch(as_decode_batch(work), _limits(layout), SLOTS, SCRATCH, SCRATCH,
                       KeptTables(PAGE, 32))
    for name in (*ROW_FIELDS, *TABLE_FIELDS):
        assert np.array_equal(getattr(columns, name), getattr(rows, name)), name
    assert columns.has_adapter == rows.has_adapter
    # The eager tensors of the columns are build's, field for field.
    plan = cascade_tiles.plan([s.shared_prefix for s in work], PAGE, 32)
    ref = build(work, _limits(layout), SLOTS, False, torch.device("cpu"), SCRATCH, SCRATCH, plan)
    got = columns.to_batch(torch.device("cpu"), plan)
    for field in ("input_ids", "positions", "token_slot", "logits_indices", "use_lora"):
        a, b = getattr(got, field), getattr(ref, field)
        assert ((torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor)
                else a == b), field
    for field in dataclasses.fields(ref.meta):
        a, b = getattr(got.meta, field.name), getattr(ref.meta, field.name)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert (a is not None and b is not None and torch.equal(a, b)
                    and a.dtype == b.dtype), field.name
        elif field.name == "cascade":
            assert all(torch.equal(x, y)
                       for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b),
                                       strict=True)), field.name
        else:
            assert a == b, field.name


def _refusals(work: list[SeqWork]) -> dict[str, list[SeqWork]]:
    """One bad row each, as ``validate`` refuses it."""
    first = work[0]

    def replaced(**changes) -> list[SeqWork]:
        return [dataclasses.replace(first, **changes), *work[1:]]

    pages = first.slots.pages
    return {
        "token": replaced(tokens=(1000,)),
        "position": replaced(start_pos=PAGES * PAGE),
        "adapter": replaced(adapter_id=8),
        "short table": replaced(slots=KVSlots(pages[:-1], first.slots.residual_pages)),
        "page id": replaced(slots=KVSlots((*pages[:-1], SCRATCH), first.slots.residual_pages)),
        "group pages": replaced(shared_prefix=SharedPrefix(0, 2)),
        "group ids": replaced(slots=KVSlots((SCRATCH - 1, *pages[1:]), first.slots.residual_pages)),
        "form": replaced(form=KVForm.SPLIT if first.form is KVForm.MERGED else KVForm.MERGED),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_of_batch_refuses_what_validate_refuses(layout):
    work = _work(random.Random(1), layout, steady=True)
    work[0] = dataclasses.replace(work[0], adapter_id=7, adapter_start=0)
    if LAYOUTS[layout][0]:  # the first row in the split form, so the form flip is a conflict
        work[0] = dataclasses.replace(work[0], form=KVForm.SPLIT,
                                      slots=KVSlots(work[0].slots.pages, work[0].slots.pages))
    refusals = _refusals(work)
    if layout == "disaggregated":  # an adapter's merged K/V where adapters' K/V is split
        refusals["merged"] = [dataclasses.replace(work[0], form=KVForm.MERGED,
                                                  slots=KVSlots(work[0].slots.pages, None)),
                              *work[1:]]
    good = as_decode_batch(work)
    for name, bad in refusals.items():
        with pytest.raises(ForkServeError):
            validate(bad, _limits(layout), SLOTS)
        # Built afresh, and over the kept tables of the good rows (the bad row rewritten alone).
        kept = KeptTables(PAGE, 32)
        assert of_batch(good, _limits(layout), SLOTS, SCRATCH, SCRATCH, kept) is not None
        bad_batch = dataclasses.replace(good, **{
            field: tuple(getattr(as_decode_batch(bad), field)[:1]) + getattr(good, field)[1:]
            for field in ("tokens", "pages", "residual_pages", "forms", "adapter_ids", "sampling",
                          "seq_ids")}, **{
            field: getattr(as_decode_batch(bad), field)
            for field in ("positions", "adapter_starts")},
            # The same marks object where they agree: the groups' check then compares only
            # the rewritten row.
            shared_prefix=good.shared_prefix if as_decode_batch(bad).shared_prefix
            == good.shared_prefix else as_decode_batch(bad).shared_prefix)
        for tables in (KeptTables(PAGE, 32), kept):
            assert of_batch(bad_batch, _limits(layout), SLOTS, SCRATCH, SCRATCH,
                            tables) is None, name
    validate(work, _limits(layout), SLOTS)
    assert of_batch(good, _limits(layout), SLOTS, SCRATCH, SCRATCH,
                    KeptTables(PAGE, 32)) is not None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_of_items_refuses_the_pages_validate_leaves_to_it(layout):
    """``validate(page_ids=False)`` leaves the items' pages to the rows' tables: ``of_items``
    refuses (None) a table too short or a page id outside its pool, on either side, built
    afresh or over the kept tables of good items; ``validate`` then names the item."""
    work = _work(random.Random(1), layout, steady=True)
    work[0] = dataclasses.replace(work[0], adapter_id=7, adapter_start=0)
    pages = work[0].slots.pages
    if LAYOUTS[layout][0]:  # the first row in the split form: its residual pages refused too
        work[0] = dataclasses.replace(work[0], form=KVForm.SPLIT, slots=KVSlots(pages, pages))
    first = work[0]
    refusals = {name: bad for name, bad in _refusals(work).items()
                if name in ("short table", "page id")}
    if LAYOUTS[layout][0]:
        for name, res in (("short residual", pages[:-1]),
                          ("residual id", (*pages[:-1], SCRATCH))):
            refusals[name] = [dataclasses.replace(first, slots=KVSlots(pages, res)), *work[1:]]
    limits = _limits(layout)
    for name, bad in refusals.items():
        validate(bad, limits, SLOTS, page_ids=False)
        with pytest.raises(ForkServeError) as refused:
            validate(bad, limits, SLOTS)
        assert refused.value.seq_ids == (first.seq_id,), name
        kept = KeptTables(PAGE, 32)
        assert of_items(work, limits, SLOTS, SCRATCH, SCRATCH, kept) is not None
        for tables in (KeptTables(PAGE, 32), kept):
            assert of_items(bad, limits, SLOTS, SCRATCH, SCRATCH, tables) is None, name


def test_extra_residual_writes_name_each_targets_slot() -> None:
    """base_activations: every target's write of every token, rows after the batch's earlier
    items, at the target's own page for that position (a chunk starting mid-page, its pages
    indexed from the context's first)."""
    from forkserve.backend.protocol import ResidualTarget

    rng = random.Random(3)
    start, n = 2 * PAGE + 5, 3 * PAGE
    targets = tuple(ResidualTarget(a, tuple(rng.sample(range(SCRATCH), PAGES))) for a in (7, 9))
    first = SeqWork(0, (1, 2, 3), 0, KVSlots(tuple(range(4)), None), None, GREEDY)
    base = tuple(rng.sample(range(SCRATCH), PAGES))
    shared = SeqWork(1, tuple(rng.randrange(1000) for _ in range(n)), start, KVSlots(base, None),
                     None, None, form=KVForm.SPLIT, extra_residuals=targets)
    meta = build([first, shared], _limits("disaggregated"), SLOTS, False, torch.device("cpu"),
                 SCRATCH, SCRATCH).meta
    want = [(3 + j, SLOTS[t.adapter_id], t.residual_pages[(start + j) // PAGE] * PAGE
             + (start + j) % PAGE) for t in targets for j in range(n)]
    got = list(zip(meta.extra_rows.tolist(), meta.extra_token_slot.tolist(),
                   meta.extra_res_slot_mapping.tolist(), strict=True))
    assert got == want


@pytest.mark.parametrize("write_base,write_residual", [(True, True), (False, True), (True, False)])
def test_prefill_columns_follow_each_token(write_base, write_residual) -> None:
    """``build``'s per-token columns of prefill chunks that start and end mid-page (an aLoRA
    invoked mid-chunk, sides skipped to scratch), token by token as the protocol defines them."""
    rng = random.Random(11)
    items = []
    for i, (start, n, adapter_start) in enumerate([(2 * PAGE + 5, 3 * PAGE + 7, 3 * PAGE + 1),
                                                  (0, PAGE, 0), (PAGE - 1, 2, 40 * PAGE)]):
        pages = tuple(rng.sample(range(SCRATCH), PAGES))
        res = tuple(rng.sample(range(SCRATCH), PAGES))
        items.append(SeqWork(i, tuple(rng.randrange(1000) for _ in range(n)), start,
                             KVSlots(pages, res), 7, GREEDY, write_base=write_base,
                             write_residual=write_residual, form=KVForm.SPLIT,
                             adapter_start=adapter_start))
    batch = build(items, _limits("disaggregated"), SLOTS, False, torch.device("cpu"), SCRATCH,
                  SCRATCH)
    at = [s.start_pos + j for s in items for j in range(len(s.tokens))]
    owner = [s for s in items for _ in s.tokens]
    assert batch.positions.tolist() == at
    assert batch.input_ids.tolist() == [t for s in items for t in s.tokens]
    assert batch.token_slot.tolist() == [SLOTS[7] if a >= s.adapter_start else -1
                                         for a, s in zip(at, owner, strict=True)]
    assert batch.meta.slot_mapping.tolist() == [
        s.slots.pages[a // PAGE] * PAGE + a % PAGE if write_base else SCRATCH * PAGE
        for a, s in zip(at, owner, strict=True)]
    assert batch.meta.res_slot_mapping.tolist() == [
        s.slots.residual_pages[a // PAGE] * PAGE + a % PAGE if write_residual
        else SCRATCH * PAGE for a, s in zip(at, owner, strict=True)]


# What a decode item's page tuple does between two steps (``test_kept_item_tables_...``);
# "same" and "advance" weigh most, so that most steps rewrite a few rows of a kept table.
ITEM_MOVES = ("same",) * 4 + ("advance",) * 3 + ("copy", "new", "bad id", "short", "leave",
                                                  "join")
AT = 20 * PAGE - 1  # items at AT .. AT + 2: one advance from a page boundary or past it


@settings(max_examples=400, deadline=None)
@given(layout=st.sampled_from(list(LAYOUTS)), seed=st.integers(0, 2 ** 16),
       steps=st.lists(st.lists(st.sampled_from(ITEM_MOVES), min_size=1, max_size=10),
                      min_size=1, max_size=8))
def test_kept_item_tables_equal_fresh_ones_over_any_steps(layout, seed, steps):
    """Steps of decode items whose page tuples stay (the same object), advance a position
    (the same object while it lists the page, else a longer one at a page boundary), are
    copied (equal, a new object), replaced (new pages, same position), list an id outside
    the pool or too few pages, or whose items leave or join. Some tuples list pages ahead
    of the position, as a control plane may reserve them. ``of_items`` over the kept tables
    answers what it answers over fresh ones (both None where a row is refused), and a table
    handed out earlier never changes."""
    rng = random.Random(seed)
    limits = _limits(layout)
    kept = KeptTables(PAGE, 32)
    handed: list[tuple[np.ndarray, np.ndarray]] = []  # (table, its copy when handed out)

    def pages_for(at: int, ahead: int) -> tuple[int, ...]:
        return tuple(rng.randrange(SCRATCH) for _ in range(at // PAGE + 1 + ahead))

    def fresh_item(at: int) -> SeqWork:
        seq = _work(rng, layout, steady=True, n=1)[0]
        ahead = rng.choice((0, 2))
        res = pages_for(at, ahead) if seq.slots.residual_pages is not None else None
        return dataclasses.replace(seq, start_pos=at, slots=KVSlots(pages_for(at, ahead), res),
                                   adapter_start=min(seq.adapter_start, at + 1))

    def moved(seq: SeqWork, move: str) -> SeqWork | None:
        pages, res, at = seq.slots.pages, seq.slots.residual_pages, seq.start_pos
        if move in ("same", "leave"):
            return seq if move == "same" else None
        if move in ("new", "join"):
            return fresh_item(at if move == "new" else AT + rng.randrange(3))
        if move == "advance":
            at += 1
            if len(pages) <= at // PAGE:  # a page boundary past the listed pages: one more
                pages = (*pages, rng.randrange(SCRATCH))
                res = (*res, rng.randrange(SCRATCH)) if res is not None else None
        elif move == "copy":
            pages = tuple(list(pages))
        elif move == "bad id":
            pages = (*pages[:at // PAGE], SCRATCH + rng.randrange(3), *pages[at // PAGE + 1:])
        elif move == "short":
            pages = pages[:at // PAGE]
        return dataclasses.replace(seq, start_pos=at, slots=KVSlots(pages, res))

    work = [fresh_item(AT + rng.randrange(3)) for _ in range(4)]
    for moves in steps:
        nxt = []
        for i, move in enumerate(moves):
            if i >= len(work):
                move = "join"
            item = moved(work[min(i, len(work) - 1)], move)
            if item is not None:
                nxt.append(item)
        work = [dataclasses.replace(s, seq_id=i) for i, s in enumerate(nxt)] or work[:1]
        ours = of_items(work, limits, SLOTS, SCRATCH, SCRATCH, kept)
        fresh = of_items(work, limits, SLOTS, SCRATCH, SCRATCH, KeptTables(PAGE, 32))
        assert (ours is None) == (fresh is None)
        if ours is None:
            continue
        for name in (*ROW_FIELDS, *TABLE_FIELDS):
            assert np.array_equal(getattr(ours, name), getattr(fresh, name)), name
        handed += [(t, t.copy()) for t in (ours.block_tables, ours.res_block_tables)]
        assert all(np.array_equal(t, copy) for t, copy in handed)
