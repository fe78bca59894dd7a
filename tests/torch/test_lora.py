"""Multi-LoRA against peft: several adapters (ranks, targets, rslora) in one batch, add/remove."""
from __future__ import annotations

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, REL_TOL, hf_logits, make_config, prompt, rel_err, work

from forkserve.backend.torch import AdapterCapacityError, TorchBackend, UnknownAdapterError
from forkserve.config import KVLayout


def test_mixed_adapters_in_one_batch_match_peft(models, adapters):
    path = models["llama"]
    backend = TorchBackend(make_config(), path, adapters=adapters, device=DEVICE, dtype=DTYPE)
    names = ["qkvo", "qv", "all", None]
    prompts = [prompt(20 + i, 11 + 2 * i) for i in range(len(names))]
    ids = [None if n is None else backend.adapter_id(n) for n in names]
    # Chunked: first chunk of every sequence together, then the rest together.
    first = backend.forward([work(i, p[:6], 0, ids[i]) for i, p in enumerate(prompts)],
                            all_logits=True)
    rest = backend.forward([work(i, p[6:], 6, ids[i]) for i, p in enumerate(prompts)],
                           all_logits=True)
    for i, (name, p) in enumerate(zip(names, prompts, strict=True)):
        ours = torch.cat([first.logits[i], rest.logits[i]])
        ref = hf_logits(path, p, None if name is None else adapters[name])
        assert rel_err(ours, ref) < REL_TOL, name
    # The adapters really change the output (the comparison above is not vacuous).
    assert rel_err(hf_logits(path, prompts[0], adapters["qkvo"]),
                   hf_logits(path, prompts[0])) > 0.05


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.DISAGGREGATED])
def test_mixed_adapters_decode_batch(models, adapters, layout):
    """Decode-only batches (the graph-shaped path) with a different adapter per row."""
    path = models["llama"]
    backend = TorchBackend(make_config(layout), path, adapters=adapters, device=DEVICE, dtype=DTYPE)
    names = ["all", None, "qkvo", "qv"]
    ids = [None if n is None else backend.adapter_id(n) for n in names]
    prompts = [prompt(30 + i, 7 + i) for i in range(len(names))]
    residual = layout is KVLayout.DISAGGREGATED
    backend.step([work(i, p[:-1], 0, ids[i], residual=residual) for i, p in enumerate(prompts)])
    out = backend.forward([work(i, p[-1:], len(p) - 1, ids[i], residual=residual)
                           for i, p in enumerate(prompts)])
    for i, (name, p) in enumerate(zip(names, prompts, strict=True)):
        ref = hf_logits(path, p, None if name is None else adapters[name])[-1]
        assert rel_err(out.logits[i][0], ref) < REL_TOL, name


def test_add_and_remove_at_run_time(models, adapters):
    path = models["llama"]
    backend = TorchBackend(make_config(), path, device=DEVICE, dtype=DTYPE, max_adapters=2,
                           lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
    a = backend.add_adapter("qkvo", adapters["qkvo"])
    b = backend.add_adapter("qv", adapters["qv"])
    with pytest.raises(AdapterCapacityError):
        backend.add_adapter("all", adapters["all"])
    backend.remove_adapter("qkvo")
    with pytest.raises(UnknownAdapterError):
        backend.step([work(0, prompt(40, 5), 0, a)])
    c = backend.add_adapter("all", adapters["all"])  # reuses qkvo's slot, with a fresh id
    assert c not in (a, b) and backend.adapters == {"qv": b, "all": c}
    p = prompt(41, 9)
    out = backend.forward([work(0, p, 0, c), work(1, p, 0, b)], all_logits=True)
    assert rel_err(out.logits[0], hf_logits(path, p, adapters["all"])) < REL_TOL
    assert rel_err(out.logits[1], hf_logits(path, p, adapters["qv"])) < REL_TOL


def test_slot_residuals_equal_the_masked_shrink_of_repeated_rows():
    """base_activations' gather (one matmul over distinct tokens) against the masked shrink of
    every (token, adapter) row, the form whose product grows with the adapter count."""
    from forkserve.backend.torch.lora import LoraStack
    from forkserve.bench.multilora.workload import tiny_config
    cfg = tiny_config()
    stack = LoraStack(cfg, ("q", "k", "v"), max_slots=5, max_rank=4, device=torch.device("cpu"),
                      dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for layer in stack.a:
        layer["qkv"].copy_(torch.randn(layer["qkv"].shape, generator=gen))
    x = torch.randn(7, cfg.hidden_size, generator=gen)
    rows = torch.tensor([0, 3, 3, 6, 1, 3])
    slots = torch.tensor([0, 4, 2, -1, 1, 0])
    got = stack.slot_residuals(1, x, rows, slots)
    want = stack.residuals(stack.shrink(1, "qkv", x[rows], stack.token_mask(slots, x.dtype)))
    assert set(got) == {"k", "v"}
    for t in ("k", "v"):
        torch.testing.assert_close(got[t], want[t], rtol=1e-5, atol=1e-5)
    assert not got["k"][3].any()
