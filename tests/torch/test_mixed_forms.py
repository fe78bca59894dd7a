"""The adaptive layout's mixed decode batches: merged and split rows in one batch run the
split form's path with each row's form as data (a merged row writes its merged K/V to its
base page, no residual, and is read as "no residual"). Such a batch computes what the two
forms compute as separate batches, the same logits and the same K/V in every base and
residual page, with cascade groups on and off and rows without an adapter among them, and
it replays the split CUDA graph instead of running eagerly.

On CPU the Triton kernels run under the interpreter (forced), as in test_cascade.py.
"""
from __future__ import annotations

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
    as_decode_batch,
    make_config,
    prompt,
    rel_err,
    work,
)

from forkserve import kernels  # noqa: E402
from forkserve.backend.protocol import SeqWork  # noqa: E402
from forkserve.backend.torch import TorchBackend  # noqa: E402
from forkserve.backend.torch.cascade import plan  # noqa: E402
from forkserve.backend.torch.decode_rows import of_items  # noqa: E402
from forkserve.backend.torch.errors import InvalidWorkError  # noqa: E402
from forkserve.backend.torch.kept_tables import KeptTables  # noqa: E402
from forkserve.backend.torch.kernel_attention import KernelAttention  # noqa: E402
from forkserve.backend.torch.runner import graph_key  # noqa: E402
from forkserve.config import KVLayout  # noqa: E402
from forkserve.control.sharing import PrefixSharing  # noqa: E402

CTX = 2 * PAGE + 2  # ends mid-page: each reader's last context page is its own
# agent -> (adapter, split form, context): "S" base pages the split rows and the base model
# share, "M" merged pages of one adapter, None alone. Agent 2 has no adapter.
AGENTS = {0: ("qkvo", True, "S"), 1: ("qv", True, "S"), 2: (None, True, "S"),
          3: ("qkvo", False, "M"), 4: ("qkvo", False, "M"), 5: ("qv", False, None)}
SPLIT = [a for a, (_, split, _) in AGENTS.items() if split]
MERGED = [a for a in AGENTS if a not in SPLIT]
CTX_PAGES = {"S": tuple(range(200, 200 + CTX // PAGE)), "M": tuple(range(220, 220 + CTX // PAGE))}
STEPS = 2


def triton_attention():
    return KernelAttention(use_triton=True) if DEVICE.type == "cpu" else "triton"


def pages_of(agent: int) -> tuple[int, ...]:
    shared = CTX_PAGES.get(AGENTS[agent][2], ())
    return shared + tuple(range(agent * 32, agent * 32 + 32 - len(shared)))


def backend_for(models, adapters, attention, cascade: bool,
                graphs: bool = False) -> tuple[TorchBackend, dict[int, int | None]]:
    """An adaptive backend after every agent's prefill (each context's first agent writes it,
    the others start at its last full page, reading those pages); the agents' adapter ids."""
    backend = TorchBackend(make_config(KVLayout.ADAPTIVE), models["llama"],
                           adapters={k: adapters[k] for k in ("qkvo", "qv")}, device=DEVICE,
                           dtype=DTYPE, attention=attention, use_cuda_graphs=graphs)
    backend.cascade_attention = cascade
    ids = {a: None if name is None else backend.adapter_id(name)
           for a, (name, _, _) in AGENTS.items()}
    context = {"S": prompt(1, CTX), "M": prompt(2, CTX), None: []}
    writers, readers = [], []
    for agent, (_, split, group) in AGENTS.items():
        tokens = context[group] + prompt(10 + agent, 3 + agent)
        first = group is None or min(a for a, g in AGENTS.items() if g[2] == group) == agent
        start = 0 if first else CTX // PAGE * PAGE
        item = work(agent, tokens[start:], start, ids[agent], residual=split, pages=pages_of(agent))
        (writers if first else readers).append(item)
    backend.forward(writers)
    backend.forward(readers)
    return backend, ids


def decode_items(ids: dict[int, int | None], agents, step: int) -> list[SeqWork]:
    items = [work(a, [prompt(50 + a, STEPS)[step]], CTX + 3 + a + step, ids[a],
                  residual=AGENTS[a][1], pages=pages_of(a), decode=True) for a in agents]
    return PrefixSharing(PAGE, min_tokens=PAGE).annotate(items)


def decode(backend: TorchBackend, ids: dict[int, int | None], batches) -> dict[int, torch.Tensor]:
    """Teacher-forced decode steps, each step's agents cut into ``batches``; logits per agent."""
    out: dict[int, list[torch.Tensor]] = {a: [] for a in AGENTS}
    for step in range(STEPS):
        for agents in batches:
            items = decode_items(ids, agents, step)
            for a, logits in zip(agents, backend.forward(items).logits, strict=True):
                out[a].append(logits)
    return {a: torch.stack(rows) for a, rows in out.items()}


def pools(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """Every real page of the four pools (the scratch pages take padding and skipped writes)."""
    pool = backend.pool
    return {"k": pool.k[:, :pool.scratch_page], "v": pool.v[:, :pool.scratch_page],
            "k_res": pool.k_res[:, :pool.scratch_residual_page],
            "v_res": pool.v_res[:, :pool.scratch_residual_page]}


@pytest.mark.parametrize("attention,cascade",
                         [("eager", False), ("triton", False), ("triton", True)])
def test_mixed_batch_equals_its_forms_as_separate_batches(models, adapters, attention, cascade,
                                                          monkeypatch):
    """Merged pages in the residual pools' place: a merged row writes no residual page (the
    split rows' are compared), and its base page holds what the merged-only batch writes."""
    tiles = []
    real = kernels.cascade_residual_decode
    monkeypatch.setattr(kernels, "cascade_residual_decode",
                        lambda *a, **k: tiles.append(a[12].shape[0]) or real(*a, **k))
    choice = triton_attention() if attention == "triton" else "eager"
    mixed, ids = backend_for(models, adapters, choice, cascade)
    together = decode(mixed, ids, [list(AGENTS)])
    # One split-form cascade launch per layer reads both groups: the split rows and the base
    # model's over shared base pages, the merged rows over their adapter's merged pages.
    assert tiles == ([2] * STEPS * 2 if cascade else [])
    alone, ids = backend_for(models, adapters, choice, cascade)
    apart = decode(alone, ids, [SPLIT, MERGED])
    for a in AGENTS:
        assert rel_err(together[a], apart[a]) < REL_TOL, a
    expect = pools(alone)
    for name, got in pools(mixed).items():
        assert rel_err(got, expect[name]) < REL_TOL, name


def test_mixed_decode_batch_takes_the_split_graph(models, adapters):
    """The graph decision: a batch of both forms replays the split graph, cascade tiles
    included (it ran eagerly before); a merged-only batch the merged one."""
    backend, ids = backend_for(models, adapters, "eager", cascade=True)

    def key(agents):
        items = decode_items(ids, agents, 0)
        rows = of_items(items, backend.limits, backend._slots(), backend.pool.scratch_page,
                        backend.pool.scratch_residual_page, KeptTables(PAGE, 16))
        return graph_key(rows, plan([w.shared_prefix for w in items], PAGE, 16))

    mixed = key(list(AGENTS))
    # LoRA, split, two tiles, merged rows among the split ones
    assert mixed is not None and mixed[2] and mixed[3] and mixed[4] == 2 and mixed[5]
    assert not key(MERGED)[3]
    # Split rows alone take the plain split graph (no k/v delta computed), not the mixed one.
    alone = key(SPLIT)
    assert alone[3] and not alone[5]


def test_mixed_steady_rows_launch_from_their_columns(models, adapters, monkeypatch):
    """Steady rows of both forms are read from their columns (they ran as items before) and
    sample what the same rows sample as items."""
    tokens, rows = {}, []
    for columns in (False, True):
        backend, ids = backend_for(models, adapters, "eager", cascade=True)
        real = backend.runner.forward_rows
        monkeypatch.setattr(backend.runner, "forward_rows",
                            lambda *a, real=real: rows.append(1) or real(*a))
        items = decode_items(ids, list(AGENTS), 0)
        step = backend.launch([], as_decode_batch(items)) if columns else backend.launch(items)
        tokens[columns] = step.result().next_tokens
    assert rows == [1] and tokens[True] == tokens[False]


def test_merged_adapter_items_are_refused_where_adapters_split(models, adapters):
    """The disaggregated layout's split graphs carry no form column: merged K/V of an
    adapter is refused there, as split K/V is where there is no residual pool."""
    backend = TorchBackend(make_config(KVLayout.DISAGGREGATED), models["llama"], adapters=adapters,
                           device=DEVICE, dtype=DTYPE, use_cuda_graphs=False)
    with pytest.raises(InvalidWorkError) as err:
        backend.forward([work(0, [5, 6], 0, backend.adapter_id("qv"), residual=False)])
    assert err.value.seq_ids == (0,)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("together", [True, False])
def test_mixed_batch_graph_replay_equals_eager(models, adapters, cascade, together):
    """Both forms in one batch replay the mixed split graph; the split agents alone the plain
    one (no k/v delta computed), the merged ones the merged graph: each as eager computes."""
    batches = [list(AGENTS)] if together else [SPLIT, MERGED]
    out = {}
    for graphs in (False, True):
        backend, ids = backend_for(models, adapters, "triton", cascade, graphs)
        out[graphs] = decode(backend, ids, batches)
        if graphs:
            splits = {key[5] for key in backend.runner.captured_graphs if key[3]}
            assert splits == {together}, splits
    for a in AGENTS:
        assert rel_err(out[True][a], out[False][a]) < REL_TOL, a
