"""The answer-token loss of train.py: equal to HF's ``model(labels=...).loss`` and its
gradients at every micro-batch size (plain and activated LoRA), and a step whose gradients are
not finite leaves the adapter as it was."""
import pytest
import torch
from quality_testlib import needs_bfcl

pytestmark = needs_bfcl


def _setup(tiny, alora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.quality.data import build_tasks
    from benchmarks.quality.train import TrainParams, assistant_opener, batches

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    invocation = assistant_opener(tokenizer) if alora else None
    extra = {"alora_invocation_tokens": list(invocation)} if alora else {}
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                      target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                                      **extra))
    params = TrainParams(batch=4, distractors=1, alora=alora)
    rows = next(batches(tokenizer, build_tasks(heldout=4, seed=0), 0, params, invocation))
    assert len({len(ids) for ids, _ in rows}) > 1  # padding is exercised
    return model, tokenizer.pad_token_id, rows, invocation


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("alora", [False, True])
def test_equals_hf_loss_at_every_micro_batch(tiny, alora):
    from benchmarks.quality.answer_loss import backward_answer_loss, micro_batch
    from benchmarks.quality.train import alora_offsets

    model, pad, rows, invocation = _setup(tiny, alora)
    cpu = torch.device("cpu")

    def extra(part, width):
        return {"alora_offsets": alora_offsets(part, width, len(invocation))} if alora else {}

    inputs = micro_batch(rows, pad, cpu)
    reference = model(**inputs, **extra(rows, inputs["input_ids"].shape[1])).loss
    reference.backward()
    want = _grads(model)
    assert want
    for micro in (1, 3, len(rows)):
        model.zero_grad(set_to_none=True)
        loss = backward_answer_loss(model, rows, micro, pad, cpu, extra if alora else None)
        torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)
        got = _grads(model)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_a_non_finite_step_is_skipped_and_counted(tiny, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from benchmarks.quality import train

    real = train.backward_answer_loss
    calls = []

    def poisoned(model, *args, **kw):  # the second step's gradients are NaN
        loss = real(model, *args, **kw)
        calls.append(1)
        if len(calls) == 2:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return loss

    monkeypatch.setattr(train, "backward_answer_loss", poisoned)
    monkeypatch.setattr(train, "MAX_SKIPPED", 0.5)
    assert train.main(["--model", str(tiny), "--out", str(tmp_path), "--device", "cpu",
                       "--categories", "simple_python", "--max-steps", "3", "--batch", "2",
                       "--distractors", "1", "--heldout", "4", "--rank", "4"]) == 0
    import json
    log = json.loads((tmp_path / "train_log.json").read_text())["tasks"][0]
    assert log["skipped_steps"] == [1] and len(log["losses"]) == 3
    weights = load_file(tmp_path / "simple_python" / "adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_too_many_non_finite_steps_fail_the_task(tiny, tmp_path, monkeypatch):
    from benchmarks.quality import train

    real = train.backward_answer_loss

    def poisoned(model, *args, **kw):
        loss = real(model, *args, **kw)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("inf"))
        return loss

    monkeypatch.setattr(train, "backward_answer_loss", poisoned)
    with pytest.raises(train.NonFiniteTraining, match="non-finite gradients at steps"):
        train.main(["--model", str(tiny), "--out", str(tmp_path), "--device", "cpu",
                    "--categories", "simple_python", "--max-steps", "3", "--batch", "2",
                    "--distractors", "1", "--heldout", "4", "--rank", "4"])
    assert not (tmp_path / "simple_python").exists()


def test_sync_free_alora_layers_give_pefts_loss_and_gradients(tiny):
    from benchmarks.quality.alora_mask import sync_free
    from benchmarks.quality.answer_loss import backward_answer_loss, micro_batch
    from benchmarks.quality.train import alora_offsets

    model, pad, rows, invocation = _setup(tiny, True)
    cpu = torch.device("cpu")

    def extra(part, width):
        return {"alora_offsets": alora_offsets(part, width, len(invocation))}

    inputs = micro_batch(rows, pad, cpu)
    reference = model(**inputs, **extra(rows, inputs["input_ids"].shape[1])).loss  # PEFT's
    reference.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with sync_free():
        loss = backward_answer_loss(model, rows, 2, pad, cpu, extra)
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)
    got = _grads(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)
    from peft.tuners.lora.variants import ALoraLinearVariant

    assert ALoraLinearVariant.forward.__module__.startswith("peft")  # PEFT's forward is back


def test_sync_free_alora_layers_select_no_tokens_on_the_host(tiny):
    """PEFT's aLoRA layer picks its tokens with a boolean mask (``nonzero``: a device-to-host
    sync on a GPU) in every adapted layer; the sync-free forward never does."""
    from torch.profiler import profile

    from benchmarks.quality.alora_mask import sync_free
    from benchmarks.quality.answer_loss import micro_batch
    from benchmarks.quality.train import alora_offsets

    model, pad, rows, invocation = _setup(tiny, True)
    inputs = micro_batch(rows, pad, torch.device("cpu"))
    offsets = alora_offsets(rows, inputs["input_ids"].shape[1], len(invocation))

    def nonzeros() -> int:
        with torch.no_grad(), profile() as prof:
            model(**inputs, alora_offsets=offsets)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::nonzero")

    layers = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    assert nonzeros() >= layers > 0  # PEFT's forward: one per adapted layer at least
    with sync_free():
        assert nonzeros() == 0


def test_the_activation_mask_is_pefts():
    from benchmarks.quality.alora_mask import activation_mask

    mask = activation_mask([2, None, 9, 0], 5, torch.device("cpu"))
    assert mask.tolist() == [[False, False, False, True, True], [False] * 5, [True] * 5,
                             [False] * 5]
