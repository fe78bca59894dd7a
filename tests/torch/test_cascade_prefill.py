"""Cascade prefill in KernelAttention (backend/torch/cascade_prefill.py) equals the ungrouped
path: prefill chunks marked as one group (``SeqWork.shared_prefix``) attend their shared
prefix once, each its own suffix, merged by log-sum-exp. One layer call over hand-built
pools (shared prefix pages, each chunk's own pages after them), then one engine forward
through ``batch.build``'s marks. Tiny shapes, float32 on CPU (the kernels under the
interpreter)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from itertools import accumulate  # noqa: E402

from torch_testlib import DEVICE, REL_TOL, make_config, prompt, rel_err, work  # noqa: E402

from forkserve.backend.protocol import SharedPrefix  # noqa: E402
from forkserve.backend.torch import TorchBackend  # noqa: E402
from forkserve.backend.torch.attention import AttentionMetadata, EagerAttention  # noqa: E402
from forkserve.backend.torch.kernel_attention import KernelAttention  # noqa: E402
from forkserve.backend.torch.kv_pool import LayerKV  # noqa: E402
from forkserve.backend.torch.rope import Rope, RopeConfig  # noqa: E402
from forkserve.control.sharing import PrefixSharing  # noqa: E402
from forkserve.kernels import CostPrefillPolicy, FixedPrefillPolicy, flash_support  # noqa: E402

HQ, HKV, D, PAGE, PAGES = 4, 2, 32, 16, 48
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
ROPE = Rope(RopeConfig(theta=10000.0), D, DEVICE)
# Shared contexts: A ends mid-page (2 shared pages, then each chunk's own copy of its 5-key
# tail), B is page-aligned. A chunk: (context or None, new tokens, marked).
CONTEXT = {"A": 37, "B": 32, None: 0}
CASCADE = FixedPrefillPolicy(cascade=True)
UNGROUPED = FixedPrefillPolicy()


def build_step(chunks: list[tuple[str | None, int, bool]], seed: int = 0):
    """Pools holding each context's shared pages and every chunk's own pages, the step's
    q/k/v (the chunks' new tokens) and metadata with the marks of the chunks marked."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE, DTYPE)

    kv = LayerKV(k=rand(PAGES, PAGE, HKV, D), v=rand(PAGES, PAGE, HKV, D), k_res=None,
                 v_res=None)
    free = iter(range(1, PAGES))  # page 0: scratch
    shared = {c: [next(free) for _ in range(n // PAGE)] for c, n in CONTEXT.items()}
    groups = {c: i for i, c in enumerate(c for c in CONTEXT if c)}
    tables, slots, marks = [], [], []
    for ctx, new, marked in chunks:
        start, end = CONTEXT[ctx], CONTEXT[ctx] + new
        own = [next(free) for _ in range(-(-end // PAGE) - len(shared[ctx]))]
        pages = shared[ctx] + own
        tables.append(pages)
        slots.extend(pages[at // PAGE] * PAGE + at % PAGE for at in range(start, end))
        marks.append(SharedPrefix(groups[ctx], len(shared[ctx])) if marked else None)
    width = max(len(t) for t in tables)
    qlens = [new for _, new, _ in chunks]
    seq_lens = tuple(CONTEXT[c] + n for c, n, _ in chunks)

    def ints(values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    meta = AttentionMetadata(
        slot_mapping=ints(slots), res_slot_mapping=None,
        block_tables=ints([t + [0] * (width - len(t)) for t in tables], torch.int32),
        res_block_tables=None, seq_lens=ints(seq_lens, torch.int32),
        query_starts=ints([0, *accumulate(qlens)], torch.int32),
        seq_slot=ints([-1] * len(chunks)), query_lens_host=tuple(qlens), seq_lens_host=seq_lens,
        seq_slot_host=(-1,) * len(chunks), decode_only=False, shared_prefix_host=tuple(marks))
    t = sum(qlens)
    return kv, meta, dict(q=rand(t, HQ, D), k=rand(t, HKV, D), v=rand(t, HKV, D))


def attend(attention, kv: LayerKV, meta: AttentionMetadata, step: dict) -> torch.Tensor:
    pools = LayerKV(kv.k.clone(), kv.v.clone(), None, None)
    return attention.forward(step["q"], step["k"], step["v"], None, None, pools, None, None,
                             meta, ROPE)


def check(chunks, policy=CASCADE, routes=("cascade",)) -> None:
    """``policy`` against the ungrouped Triton path and the eager reference, same inputs; the
    routes ``policy``'s attention took."""
    kv, meta, step = build_step(chunks)
    grouped = KernelAttention(use_triton=True, prefill_policy=policy)
    out = attend(grouped, kv, meta, step)
    for ref in (EagerAttention(), KernelAttention(use_triton=True, prefill_policy=UNGROUPED)):
        assert rel_err(out, attend(ref, kv, meta, step)) < REL_TOL
    assert set(grouped.prefill_routes) == set(routes), grouped.prefill_routes


def test_group_whose_prefix_ends_mid_page():
    check([("A", 6, True), ("A", 11, True), ("A", 3, True)])


def test_group_of_one_falls_back():
    check([("A", 6, True), ("B", 9, True)], routes=("paged",))


def test_two_groups_in_one_step():
    check([("A", 6, True), ("B", 4, True), ("A", 9, True), ("B", 13, True)])


def test_group_beside_an_ungrouped_chunk():
    """A chunk over the same context left unmarked (the control plane did not group it) and
    a chunk over no context keep the batch route beside the group."""
    check([("B", 7, True), (None, 12, False), ("B", 5, True), ("B", 8, False)],
          routes=("cascade", "paged"))


def test_mixed_step_with_decode_rows():
    """Decode rows (one token; marked too: their own tiles' business) beside the group."""
    check([("A", 1, True), ("A", 7, True), ("B", 1, False), ("A", 10, True), ("A", 1, True)],
          routes=("cascade", "decode_rows"))


def test_policy_threshold():
    """Chunks of 6 and 10 over a 32-key prefix: a ratio of 4 takes CASCADE, 8 does not,
    None (the default: grouping lost every H200 row) never; a group needs two members."""
    chunks = [("A", 6, True), ("A", 10, True)]
    check(chunks, CostPrefillPolicy(cascade_prefix_ratio=4.0), routes=("cascade",))
    # Ungrouped, the batch takes the unified route: the pages through FlashAttention-4 where
    # flash_support finds it (the H200 with flash-attn-4), else the Triton kernel.
    fa4 = flash_support(torch.zeros(1, HQ, D, dtype=DTYPE, device=DEVICE),
                        torch.zeros(1, PAGE, HKV, D, dtype=DTYPE, device=DEVICE)).paged
    check(chunks, CostPrefillPolicy(cascade_prefix_ratio=8.0),
          routes=("paged_flash" if fa4 else "paged",))
    assert not CostPrefillPolicy().cascade_group(8192, (32, 32))
    on = CostPrefillPolicy(cascade_prefix_ratio=64.0)
    assert on.cascade_group(8192, (128,) * 32)
    assert not on.cascade_group(8192, (1024,) * 32)
    assert not on.cascade_group(8192, (32,))
    assert not FixedPrefillPolicy().cascade_group(8192, (32, 32))


def _engine(models, cascade: bool) -> tuple[TorchBackend, KernelAttention]:
    attention = KernelAttention(use_triton=True, prefill_policy=CASCADE)
    backend = TorchBackend(make_config(), models["llama"], device=DEVICE, dtype=DTYPE,
                           attention=attention, use_cuda_graphs=False)
    backend.cascade_attention = cascade
    return backend, attention


def _chunks(backend: TorchBackend) -> list:
    """Agent 0 prefills a context ending mid-page; agents 1-4 each a chunk over its full
    pages, marked by the control plane's PrefixSharing (one group)."""
    from torch_testlib import PAGE as ENGINE_PAGE
    context = prompt(1, 5 * ENGINE_PAGE + 2)
    backend.forward([work(0, context + prompt(9, 2), 0, pages=_pages(0), sampling=None)])
    start = 5 * ENGINE_PAGE
    items = [work(a, (context + prompt(10 + a, 3 + a))[start:], start, pages=_pages(a))
             for a in range(1, 5)]
    items = PrefixSharing(ENGINE_PAGE, min_tokens=ENGINE_PAGE).annotate(items)
    assert all(w.shared_prefix is not None for w in items)
    return items


def _pages(agent: int) -> tuple[int, ...]:
    return tuple(range(100, 105)) + tuple(range(agent * 24, agent * 24 + 24))


def test_engine_chunks_over_one_context(models):
    """Through ``TorchBackend.forward``: the group's logits equal those of the same backend
    with cascade attention off."""
    logits = {}
    for cascade in (True, False):
        backend, attention = _engine(models, cascade)
        logits[cascade] = torch.cat(backend.forward(_chunks(backend)).logits)
        assert ("cascade" in attention.prefill_routes) == cascade, attention.prefill_routes
    assert rel_err(logits[True], logits[False]) < REL_TOL


def test_engine_mixed_tick_with_steady_rows(models):
    """A tick of the grouped chunks beside a steady row (``launch(work, batch)``: the rows
    joined after the items, ``mixed_batch.join``) equals the same step run as items with
    cascade attention off."""
    from torch_testlib import as_decode_batch
    out = {}
    for cascade in (True, False):
        backend, attention = _engine(models, cascade)
        chunks = _chunks(backend)
        batch = as_decode_batch([work(0, [7], 24, pages=_pages(0), decode=True)])
        if cascade:
            joined = []
            real = backend.runner.forward_mixed
            backend.runner.forward_mixed = lambda *a, _j=joined, _f=real: _j.append(1) or _f(*a)
            got = backend.launch(chunks, batch).output()
            assert joined and {"cascade", "decode_rows"} <= set(attention.prefill_routes)
        else:
            got = backend.forward([*chunks, *batch.items()])
        out[cascade] = torch.cat(got.logits)
    assert rel_err(out[True], out[False]) < REL_TOL
