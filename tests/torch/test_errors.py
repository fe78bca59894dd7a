"""Bad input raises a typed error and changes no state (pools, adapters, ids)."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch_testlib import DEVICE, DTYPE, PAGE, VOCAB, make_config, prompt, work

from forkserve.backend.protocol import KVSlots, PageKind, SeqWork
from forkserve.backend.torch import (
    AdapterFormatError,
    AdapterShapeError,
    CheckpointError,
    ContextLengthError,
    InvalidWorkError,
    TokenOutOfVocabError,
    TorchBackend,
    UnknownAdapterError,
    UnsupportedModelError,
)
from forkserve.backend.torch import backend as backend_module
from forkserve.config import KVForm, KVLayout


@pytest.fixture
def backend(models, adapters) -> TorchBackend:
    b = TorchBackend(make_config(KVLayout.DISAGGREGATED), models["llama"],
                     adapters={"qkvo": adapters["qkvo"]}, device=DEVICE, dtype=DTYPE)
    b.step([work(0, prompt(80, 9), 0, b.adapter_id("qkvo"), residual=True)])
    return b


def snapshot(b: TorchBackend) -> tuple:
    return (b.pool.k.clone(), b.pool.v.clone(), b.pool.k_res.clone(), b.pool.v_res.clone(),
            dict(b.adapters), b._next_id, [t.clone() for t in b.lora.b[0].values()])


def unchanged(b: TorchBackend, before: tuple) -> bool:
    after = snapshot(b)
    tensors_equal = all(torch.equal(x, y) for x, y in zip(before[:4], after[:4], strict=True))
    lora_equal = all(torch.equal(x, y) for x, y in zip(before[6], after[6], strict=True))
    return tensors_equal and lora_equal and before[4:6] == after[4:6]


def bad_items(b: TorchBackend) -> list[tuple[type, SeqWork]]:
    aid = b.adapter_id("qkvo")
    ok = work(1, prompt(81, 5), 0, aid, residual=True)  # valid item batched with each bad one
    return [
        (UnknownAdapterError, work(2, [3, 4], 0, 12345, residual=True)),
        (TokenOutOfVocabError, work(2, [3, VOCAB], 0)),
        (TokenOutOfVocabError, work(2, [-1], 0)),
        (ContextLengthError, work(2, prompt(82, 120), 10)),
        # pages too few
        (InvalidWorkError, SeqWork(2, tuple(range(3, 4 + PAGE)), 0, KVSlots((0,)))),
        # page id out of range
        (InvalidWorkError, SeqWork(2, (3,), 0, KVSlots((10_000,)))),
        # no residual pages
        (InvalidWorkError, SeqWork(2, (3,), 0, KVSlots((5,)), adapter_id=aid,
                                   form=KVForm.SPLIT)),
        # merged, residual
        (InvalidWorkError, SeqWork(2, (3,), 0, KVSlots((5,), (6,)), adapter_id=aid)),
        (InvalidWorkError, work(2, [], 0)),
    ], ok


def test_bad_work_raises_typed_error_and_changes_nothing(backend):
    cases, ok = bad_items(backend)
    for error, item in cases:
        before = snapshot(backend)
        with pytest.raises(error):
            backend.step([ok, item])
        assert unchanged(backend, before), error


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("side", ["base", "residual"])
def test_decode_item_with_a_page_out_of_range_is_named_alone(backend, monkeypatch, graph, side):
    """A decode batch where one item lists a page id outside its pool: InvalidWorkError names
    that item alone (``seq_ids``: the engine fails it and runs the others) and no item's KV is
    written. ``graph``: the step a CUDA graph would replay (forced here on any device), whose
    rows' tables check the page ids and refuse, after which the items' own validation names
    the item."""
    aid = backend.adapter_id("qkvo")
    backend.step([work(1, prompt(83, 30), 0), work(2, prompt(84, 40), 0, aid, residual=True)])
    items = [work(0, [5], 80, aid, residual=True, decode=True), work(1, [6], 30, decode=True),
             work(2, [7], 40, aid, residual=True, decode=True)]
    slots = items[2].slots
    limit = backend.limits.num_pages if side == "base" else backend.limits.num_residual_pages
    listed = slots.pages if side == "base" else slots.residual_pages
    beyond = (listed[0], limit, *listed[2:])  # its second page: read at any page size
    items[2] = dataclasses.replace(items[2], slots=KVSlots(beyond, slots.residual_pages)
                                   if side == "base" else KVSlots(slots.pages, beyond))
    rows = []
    if graph:
        monkeypatch.setattr(backend.runner, "replays", lambda *args: True)
        real = backend_module.of_items
        monkeypatch.setattr(backend_module, "of_items",
                            lambda *args: rows.append(real(*args)) or rows[-1])
    before = snapshot(backend)
    with pytest.raises(InvalidWorkError, match="outside") as refused:
        backend.step(items)
    assert refused.value.seq_ids == (2,)
    assert unchanged(backend, before)
    assert rows == ([None] if graph else [])


def test_bad_copy_pages(backend):
    before = snapshot(backend)
    with pytest.raises(InvalidWorkError):
        backend.copy_pages(PageKind.UNIFIED, [(0, 1)])       # not a kind of this layout
    with pytest.raises(InvalidWorkError):
        backend.copy_pages(PageKind.BASE, [(0, 1), (2, 10_000)])
    assert unchanged(backend, before)


def test_bad_adapters(backend, models, adapters, tmp_path):
    # An adapter whose q_proj A expects 65 input features (the model has 64).
    wrong = tmp_path / "wrong"
    shutil.copytree(adapters["qkvo"], wrong)
    tensors = load_file(wrong / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], 65)
    save_file(tensors, wrong / "adapter_model.safetensors")
    too_big = tmp_path / "big"
    shutil.copytree(adapters["qkvo"], too_big)
    cfg = json.loads((too_big / "adapter_config.json").read_text())
    cfg["r"] = 64
    (too_big / "adapter_config.json").write_text(json.dumps(cfg))
    dora = tmp_path / "dora"
    shutil.copytree(adapters["qkvo"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    before = snapshot(backend)
    # too_big: rank 64 > max_lora_rank 16; adapters["all"]: gate/up/down not stacked
    for error, path in [(AdapterShapeError, wrong), (AdapterShapeError, too_big),
                        (AdapterShapeError, adapters["all"]),
                        (AdapterFormatError, dora), (AdapterFormatError, tmp_path / "missing")]:
        with pytest.raises(error):
            backend.add_adapter(path.name, path)
        assert unchanged(backend, before), path
    with pytest.raises(UnknownAdapterError):
        backend.remove_adapter("nope")
    with pytest.raises(UnknownAdapterError):
        backend.adapter_id("nope")
    assert unchanged(backend, before)


def test_bad_checkpoints(models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(models["llama"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj"):
        TorchBackend(make_config(), broken, device=DEVICE, dtype=DTYPE)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        TorchBackend(make_config(), gpt2, device=DEVICE, dtype=DTYPE)


def test_yarn_with_residual_kernels_is_refused_up_front(models):
    with pytest.raises(UnsupportedModelError, match="yarn"):
        TorchBackend(make_config(KVLayout.DISAGGREGATED), models["qwen2_yarn_tied"], device=DEVICE,
                     dtype=DTYPE, attention="triton")
    # The eager path applies the factor: the same model runs there.
    TorchBackend(make_config(KVLayout.DISAGGREGATED), models["qwen2_yarn_tied"], device=DEVICE,
                 dtype=DTYPE, attention="eager")


def test_declared_capabilities_are_implemented(backend):
    caps = backend.capabilities
    assert caps.missing(backend) == ()
    assert caps.resolve_adapter and caps.host_offload  # disaggregated: a host tier for residuals
