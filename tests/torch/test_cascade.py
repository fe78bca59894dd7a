"""Cascade (shared-prefix) attention in TorchBackend and the Engine equals the ungrouped path.

On CPU the Triton kernels run under the interpreter (forced), so the cascade kernels are the
ones exercised; the oracle is EagerAttention, which reads every item's whole table.
"""
from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch_testlib import (  # noqa: E402
    DEVICE,
    DTYPE,
    PAGE,
    REL_TOL,
    make_config,
    prompt,
    rel_err,
    work,
)

from forkserve import Engine, kernels  # noqa: E402
from forkserve.backend.protocol import SharedPrefix  # noqa: E402
from forkserve.backend.torch import TorchBackend  # noqa: E402
from forkserve.backend.torch.errors import InvalidWorkError  # noqa: E402
from forkserve.backend.torch.kernel_attention import KernelAttention  # noqa: E402
from forkserve.config import KVLayout  # noqa: E402
from forkserve.control.sharing import PrefixSharing  # noqa: E402

# Context A ends mid-page (its last page is each agent's own copy); context B is page-aligned.
CTX_A, CTX_B = 64 // PAGE * PAGE + 2, 32
CTX_A_PAGES, CTX_B_PAGES = (tuple(range(200, 200 + CTX_A // PAGE)),
                            tuple(range(230, 230 + CTX_B // PAGE)))
GROUPS = {0: "A", 1: "A", 2: "A", 3: "B", 4: "B", 5: None}  # agent -> context; agent 5 reads alone


def triton_attention():
    return KernelAttention(use_triton=True) if DEVICE.type == "cpu" else "triton"


def pages_of(agent: int) -> tuple[int, ...]:
    own = tuple(range(agent * 32, agent * 32 + 32))
    shared = {"A": CTX_A_PAGES, "B": CTX_B_PAGES}.get(GROUPS[agent], ())
    return shared + own[:32 - len(shared)]


def run(backend: TorchBackend, names: dict[int, str | None], residual: bool,
        steps: int = 2) -> torch.Tensor:
    """Each context's first agent prefills it whole; the others only from its last full page
    (reading the first agent's pages); then teacher-forced decode steps of all six, marked by
    the control plane's PrefixSharing. Returns every decode step's logits."""
    context = {"A": prompt(1, CTX_A), "B": prompt(2, CTX_B), None: []}
    ids = {a: None if n is None else backend.adapter_id(n) for a, n in names.items()}
    lens, prefill = {}, []
    for agent, group in GROUPS.items():
        tokens = context[group] + prompt(10 + agent, 3 + agent)
        first = group is None or min(a for a, g in GROUPS.items() if g == group) == agent
        start = 0 if first else len(context[group]) // PAGE * PAGE
        prefill.append(work(agent, tokens[start:], start, ids[agent], residual=residual,
                            pages=pages_of(agent)))
        lens[agent] = len(tokens)
    backend.forward(prefill[:1] + prefill[3:4])  # the contexts' writers first
    backend.forward(prefill[1:3] + prefill[4:])
    out = []
    for step in range(steps):
        items = [work(a, [prompt(50 + a, steps)[step]], lens[a] + step, ids[a], residual=residual,
                      pages=pages_of(a), decode=True) for a in GROUPS]
        items = PrefixSharing(PAGE, min_tokens=PAGE).annotate(items)
        assert {w.shared_prefix.group for w in items if w.shared_prefix is not None} == {0, 1}
        out.append(torch.cat(backend.forward(items).logits))
    return torch.stack(out)


@pytest.mark.parametrize("graphs", [False, True] if DEVICE.type == "cuda" else [False])
@pytest.mark.parametrize("layout,named", [
    (KVLayout.UNIFIED, False),          # no LoRA
    (KVLayout.FULL_REUSE, True),        # adapters reading one adapter's merged pages
    (KVLayout.DISAGGREGATED, True),     # split form: shared base pages, own residuals
])
def test_grouped_decode_equals_ungrouped(models, adapters, layout, named, graphs, monkeypatch):
    names = {a: ("qkvo", "qv")[a % 2] if named else None for a in GROUPS}
    names[5] = None
    calls = []
    split = layout is KVLayout.DISAGGREGATED
    name = "cascade_residual_decode" if split else "cascade_decode"
    real = getattr(kernels, name)
    tiles = 12 if split else 5  # the tile table's position among the arguments
    monkeypatch.setattr(kernels, name,
                        lambda *a, **k: calls.append(a[tiles].shape) or real(*a, **k))
    out = {}
    for attention in ("eager", triton_attention()):
        backend = TorchBackend(make_config(layout), models["llama"],
                               adapters={k: adapters[k] for k in ("qkvo", "qv")}, device=DEVICE,
                               dtype=DTYPE, attention=attention, use_cuda_graphs=graphs)
        out[attention == "eager"] = run(backend, names, residual=layout is KVLayout.DISAGGREGATED)
    assert rel_err(out[False], out[True]) < REL_TOL
    if not graphs:  # two tiles: group A (agents 0-2 fit one tile: 64 agents / GQA group 2), group B
        assert calls and all(shape[0] == 2 for shape in calls)


def test_engine_agents_over_one_context_decode_as_without_cascade(models, monkeypatch):
    """Through the Stepper's one call site: four sessions over one published context, generating
    together, give the tokens they give with the backend's cascade off."""
    calls = []
    real = kernels.cascade_decode
    monkeypatch.setattr(kernels, "cascade_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    context = prompt(3, CTX_A)
    outputs = {}
    for cascade in (True, False):
        backend = TorchBackend(make_config(KVLayout.UNIFIED).replace(shared_prefix_min_tokens=PAGE),
                               models["llama"], device=DEVICE, dtype=DTYPE,
                               attention=triton_attention(), use_cuda_graphs=False)
        backend.cascade_attention = cascade
        engine = Engine(backend)
        first = engine.open(context + prompt(20, 3))
        engine.generate(first.id, 1)  # prefills and publishes the context's full pages
        sessions = [first.id] + [engine.open(context + prompt(21 + i, 2 + i)).id for i in range(3)]
        for s in sessions:
            engine.start_generate(s, 3)
        while engine.tick():
            pass
        outputs[cascade] = [engine.generation(s).tokens for s in sessions]
        engine.check_integrity()
    assert outputs[True] == outputs[False]
    assert calls


def test_a_false_sharing_claim_is_rejected_before_any_write(models):
    backend = TorchBackend(make_config(), models["llama"], device=DEVICE, dtype=DTYPE,
                           use_cuda_graphs=False)
    items = [work(a, [5], 4 * PAGE, decode=True) for a in (0, 1)]  # own pages: nothing shared
    items = [dataclasses.replace(w, shared_prefix=SharedPrefix(0, 4)) for w in items]
    with pytest.raises(InvalidWorkError):
        backend.forward(items)


@pytest.mark.parametrize("agents", [8, 32])
def test_graphs_captured_ahead_cover_every_batch_over_one_context(agents):
    """Every decode batch of n rows over one shared prefix replays a graph captured ahead
    (a key left to capture on use costs a timed decode step two eager forwards and a
    capture: with one tile slot captured, every batch past ``agents`` rows did)."""
    from forkserve.backend.torch import cascade as cascade_tiles
    from forkserve.backend.torch.cuda_graph import BATCH_BUCKETS
    from forkserve.backend.torch.runner import ahead_keys, key_of

    ahead = set(ahead_keys(BATCH_BUCKETS[-1], 530, True, [True], agents))
    for n in range(1, BATCH_BUCKETS[-1] + 1):
        plan = cascade_tiles.plan([SharedPrefix(0, 512)] * n, PAGE, agents)
        tiles = len(plan.tile_rows) if plan is not None else 0
        assert key_of(n, 530, True, True, tiles) in ahead, n
    assert ahead_keys(8, 530, True, [True], None) == tuple(
        (b, 1024, True, True, 0, False) for b in (1, 2, 4, 8))
    # A layout that serves both forms: each split key also with merged rows among its own.
    assert ahead_keys(2, 530, True, [False, True], None, mixed=True) == (
        (1, 1024, True, False, 0, False), (1, 1024, True, True, 0, False),
        (1, 1024, True, True, 0, True), (2, 1024, True, False, 0, False),
        (2, 1024, True, True, 0, False), (2, 1024, True, True, 0, True))
