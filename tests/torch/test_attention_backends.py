"""The Triton kernels wired into the model (natively on CUDA, under TRITON_INTERPRET=1 on
CPU: conftest.py) and CUDA graphs agree with eager attention, which shares no code with them."""
from __future__ import annotations

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, REL_TOL, make_config, prompt, rel_err, work

from forkserve.backend.torch import TorchBackend
from forkserve.backend.torch.kernel_attention import KernelAttention
from forkserve.config import KVLayout
from forkserve.kernels import CostPrefillPolicy, FixedPrefillPolicy, PrefillRoute


def decode_run(backend: TorchBackend, names: list[str | None], residual: bool,
               steps: int = 4) -> torch.Tensor:
    """Mixed-adapter prefill (ragged path) then decode steps (decode path); all sampled logits.
    Decode tokens are fixed (teacher-forced): a greedy near-tie flipping between two bf16
    implementations would otherwise compound into unrelated sequences."""
    ids = [None if n is None else backend.adapter_id(n) for n in names]
    prompts = [prompt(110 + i, 5 + 3 * i) for i in range(len(names))]
    forced = [prompt(130 + i, steps) for i in range(len(names))]
    step = backend.forward([work(i, p, 0, ids[i], residual=residual)
                            for i, p in enumerate(prompts)])
    logits = [torch.cat(step.logits)]
    lens = [len(p) for p in prompts]
    for s in range(steps):
        step = backend.forward([work(i, [forced[i][s]], lens[i], ids[i], residual=residual,
                                     decode=True)
                                for i in range(len(names))])
        logits.append(torch.cat(step.logits))
        lens = [n + 1 for n in lens]
    return torch.stack(logits)


@pytest.mark.parametrize("prefill", ["policy", "flash", "fresh"])
@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
def test_kernel_attention_matches_eager(models, adapters, layout, prefill):
    """Mixed adapters, prefill and decode (two-pass). Prefill: the default policy's route (the
    merged residual variant at these lengths; on a GPU the flash route where the batch is
    long enough), or the flash route forced (on CPU: the pack kernel under the interpreter,
    SDPA per sequence), or the cost policy with FRESH thresholds these short cold prompts
    pass. ``use_triton=True`` forces the kernels on CPU too; 16-token pages."""
    policy = {"flash": FixedPrefillPolicy(PrefillRoute.FLASH, PrefillRoute.FLASH),
              "fresh": CostPrefillPolicy(fresh_min_new_tokens=2,
                                         residual_fresh_min_new_tokens=2)}.get(prefill)
    attention = KernelAttention(use_triton=True, prefill_policy=policy)
    assert_kernels_match_eager(decode_run, models, adapters, layout, attention)
    if prefill == "flash":  # one prefill step: every layer took the flash route
        assert set(attention.prefill_routes) == {"flash"}
    elif prefill == "fresh":  # cold prompts (the split layout: the item without an adapter)
        assert attention.prefill_routes["fresh"] > 0


def assert_kernels_match_eager(run, models, adapters, layout: KVLayout,
                               attention: KernelAttention) -> None:
    """``run`` over mixed adapters (and the base model) gives the same logits with
    ``attention`` as with eager attention; 16-token pages."""
    names = ["qkvo", None, "qv", "qkvo"]
    config = make_config(layout).replace(page_size=16)
    eager, kernels = (
        run(TorchBackend(config, models["llama"],
                         adapters={k: adapters[k] for k in ("qkvo", "qv")}, device=DEVICE,
                         dtype=DTYPE, attention=choice, use_cuda_graphs=False),
            names, residual=layout is KVLayout.DISAGGREGATED)
        for choice in ("eager", attention))
    assert rel_err(kernels, eager) < REL_TOL


def mixed_run(backend: TorchBackend, names: list[str | None], residual: bool) -> torch.Tensor:
    """Prefill, then one step where items 0 and 2 decode a token while 1 and 3 prefill a
    chunk (a mixed tick), then a decode step; every logit of the last two steps."""
    ids = [None if n is None else backend.adapter_id(n) for n in names]
    prompts = [prompt(150 + i, 20 + 7 * i) for i in range(len(names))]
    backend.forward([work(i, p, 0, ids[i], residual=residual) for i, p in enumerate(prompts)])
    lens = [len(p) for p in prompts]
    chunks = [prompt(170 + i, 1 if i % 2 == 0 else 6) for i in range(len(names))]
    mixed = backend.forward([work(i, c, lens[i], ids[i], residual=residual)
                             for i, c in enumerate(chunks)])
    lens = [n + len(c) for n, c in zip(lens, chunks, strict=True)]
    after = backend.forward([work(i, prompt(190 + i, 1), lens[i], ids[i], residual=residual,
                                  decode=True) for i in range(len(names))])
    return torch.cat([*mixed.logits, *after.logits])


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
def test_decode_rows_of_a_prefill_step_take_the_decode_kernels(models, adapters, layout):
    """A step of one-token items beside chunks attends the former with the decode kernels
    (``step_rows.py``), the latter on their prefill route: the same logits as eager
    attention, in this step and the next (the pages it wrote)."""
    attention = KernelAttention(use_triton=True)
    assert_kernels_match_eager(mixed_run, models, adapters, layout, attention)
    assert attention.prefill_routes["decode_rows"] > 0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("attention", ["eager", "triton"])
@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
def test_cuda_graph_decode_matches_eager(models, adapters, layout, attention):
    names = ["qkvo", None, "qv"]
    out = {}
    for graphs in (False, True):
        backend = TorchBackend(make_config(layout), models["llama"],
                               adapters={k: adapters[k] for k in ("qkvo", "qv")}, device=DEVICE,
                               dtype=DTYPE, attention=attention, use_cuda_graphs=graphs)
        out[graphs] = decode_run(backend, names, residual=layout is KVLayout.DISAGGREGATED)
        if graphs:
            assert backend.runner.captured_graphs
    assert rel_err(out[True], out[False]) < REL_TOL
