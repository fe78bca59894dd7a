"""Activated LoRA as a quality mode (issue 16, item 3c) on the tiny random model: train.py
--alora derives the invocation from the chat template, the saved adapters load in the engine
and match PEFT's own forward, and the alora mode's readers reuse the writer's catalog pages
and answer exactly as the aLoRA agents that reuse nothing."""
import json
import sys
from dataclasses import make_dataclass
from pathlib import Path

import pytest
import torch
from quality_testlib import needs_bfcl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch"))
from torch_testlib import REL_TOL, hf_logits, rel_err  # noqa: E402

pytestmark = needs_bfcl
OPENER = "<|im_start|>assistant\n"  # what the tiny model's template appends for the answer


def _train(tiny, out, *extra):
    from benchmarks.quality import train

    return train.main(["--model", str(tiny), "--out", str(out), "--device", "cpu",
                       "--max-steps", "2", "--batch", "2", "--distractors", "1", "--heldout", "4",
                       "--rank", "4", "--init", "random", *extra])


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """(plain LoRA adapters, aLoRA adapters): the same recipe, 2 steps from a random init."""
    root = tmp_path_factory.mktemp("alora_adapters")
    assert _train(tiny, root / "qkvo") == 0
    assert _train(tiny, root / "alora", "--alora") == 0
    return root / "qkvo", root / "alora"


def test_the_invocation_is_the_templates_assistant_opener(tiny):
    from transformers import AutoTokenizer

    from benchmarks.quality.train import assistant_opener

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    opener = assistant_opener(tokenizer)
    assert tokenizer.decode(list(opener)) == OPENER
    # A template that opens no assistant turn has no invocation to derive.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="assistant-turn opener"):
        assistant_opener(tokenizer)


def test_the_offsets_passed_to_peft_are_the_ones_its_scan_finds(tiny):
    """train.py hands PEFT each row's aLoRA offset (no per-step device scan): the same values
    PEFT's own calculate_alora_offsets finds in the padded batch."""
    from peft import LoraConfig
    from peft.tuners.lora.variants import calculate_alora_offsets
    from transformers import AutoTokenizer

    from benchmarks.quality.answer_loss import micro_batch
    from benchmarks.quality.data import build_tasks
    from benchmarks.quality.train import TrainParams, alora_offsets, assistant_opener, batches

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    invocation = assistant_opener(tokenizer)
    tasks = build_tasks(heldout=4, seed=0)
    params = TrainParams(batch=4, distractors=1, alora=True)
    config = {"default": LoraConfig(alora_invocation_tokens=list(invocation))}
    for index in range(len(tasks)):
        batch = next(batches(tokenizer, tasks, index, params, invocation))
        ids = micro_batch(batch, tokenizer.pad_token_id, torch.device("cpu"))["input_ids"]
        assert len({len(row) for row, _ in batch}) > 1  # padded rows: offsets count the pads
        assert alora_offsets(batch, ids.shape[1], len(invocation)) == \
            calculate_alora_offsets(config, "default", ids)


def test_a_peft_without_alora_is_refused():
    import peft

    from benchmarks.quality.train import PeftTooOld, check_peft_alora

    check_peft_alora(peft.LoraConfig, peft.__version__)
    older = make_dataclass("LoraConfig", [("r", int, 8), ("lora_alpha", int, 8)])
    with pytest.raises(PeftTooOld, match="alora_invocation_tokens.*installed peft 0.17.1"):
        check_peft_alora(older, "0.17.1")


def test_trained_alora_adapters_load_and_match_peft(tiny, trained):
    from transformers import AutoTokenizer

    from benchmarks.quality.data import build_tasks, eval_rounds
    from forkserve.backend.protocol import KVSlots, SeqWork
    from forkserve.backend.torch import TorchBackend
    from forkserve.backend.torch.lora import load_peft_adapter
    from forkserve.config import ForkServeConfig
    from forkserve.control.activation import Invocation

    _, alora = trained
    log = json.loads((alora / "train_log.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert tokenizer.decode(log["alora_invocation_tokens"]) == OPENER and log["params"]["alora"]
    task = log["tasks"][2]["task"]
    adapter = load_peft_adapter(alora / task, task)
    assert adapter.invocation_tokens == tuple(log["alora_invocation_tokens"])

    # An evaluation prompt (catalog, question, opener) and a few answer tokens after it.
    example = eval_rounds(build_tasks(heldout=4, seed=0), 1, 1, 0)[0].examples[2]
    tokens = tokenizer.apply_chat_template(example.messages(False), add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    tokens = list(tokens) + tokenizer.encode("[f(a=1)]")
    start = Invocation(adapter.invocation_tokens).last_start(tokens, 0)
    assert start is not None and start > len(tokens) // 2
    backend = TorchBackend(ForkServeConfig(page_size=16, num_pages=128), tiny, {task: alora / task},
                           device="cpu", dtype=torch.float32, attention="eager",
                           use_cuda_graphs=False)
    pages = tuple(range(-(-len(tokens) // 16)))
    ours = backend.forward([SeqWork(0, tuple(tokens), 0, KVSlots(pages),
                                    backend.adapter_id(task), adapter_start=start)],
                           all_logits=True).logits[0]
    peft_logits, base = hf_logits(tiny, tokens, alora / task), hf_logits(tiny, tokens)
    assert rel_err(ours, peft_logits) < REL_TOL
    # Not vacuous: the base model before the opener, the trained adapter from it on.
    assert rel_err(peft_logits[:start], base[:start]) < REL_TOL
    assert rel_err(peft_logits[start:], base[start:]) > 0.05


def test_alora_readers_share_the_base_pages_and_answer_as_alone(tiny, trained, tmp_path):
    from benchmarks.quality import units
    from benchmarks.quality.evaluate import EvalParams, evaluate
    from benchmarks.quality.modes import ALORA
    from benchmarks.quality.report import summaries, write_outputs

    qkvo, alora = trained
    params = EvalParams(rounds=2, distractors=1, max_new=6, heldout=4, block=1)
    folder, cache = tmp_path / "quality_alora", tmp_path / "cache"
    with pytest.raises(ValueError, match="--alora-adapters"):
        evaluate(tiny, qkvo, params, folder, cache, ALORA)
    with pytest.raises(ValueError, match="no alora_invocation_tokens"):  # plain ones refused
        evaluate(tiny, qkvo, params, folder, cache, ALORA, alora_dir=qkvo)
    with pytest.raises(ValueError, match="give --adapters"):
        evaluate(tiny, None, params, folder, cache, ("unified",))
    evaluate(tiny, qkvo, params, folder, cache, ("unified",), log=lambda m: None)
    # The aLoRA rows need no plain adapters (a later session may no longer have them).
    evaluate(tiny, None, params, folder, cache, ALORA, log=lambda m: None, alora_dir=alora)

    by = units.load(folder)  # the plain and the aLoRA units merge: one table
    alone = {a.key: a for a in units.agents_of(by["alora_unified"])}
    assert all(a.reused_tokens == 0 for a in alone.values())
    k = len(params.categories)
    shared = units.agents_of(by["alora"])
    readers = [a for a in shared if not a.writer]
    assert len(readers) == params.rounds * (k - 1)
    for a in readers:  # every full page of the catalog comes from the writer's base pages
        assert a.reused_tokens == a.shared_tokens // params.page_size * params.page_size > 0
        assert a.tokens == alone[a.key].tokens
        assert len(a.layer_cos) == 3 and min(a.layer_cos) > 1 - 1e-5 and a.compared_tokens > 0
    prefill = {lay: sum(u.prefill_tokens for u in us) for lay, us in by.items()}
    kv = {lay: sum(u.context_kv_bytes for u in us) for lay, us in by.items()}
    assert prefill["alora"] < prefill["alora_unified"] and kv["alora"] * k == kv["alora_unified"]

    rows = {s.layout: s for s in summaries(by)}
    measured = rows["alora"].paired
    assert rows["alora"].reference == "alora_unified" and rows["alora_unified"].paired is None
    assert measured.identical.mean == 1.0 and measured.delta_f1.mean == 0.0
    assert measured.delta_f1.n == len(readers)
    # aLoRA against plain LoRA: every answer, paired with unified's.
    vs = rows["alora_unified"].vs_lora
    assert vs.delta_f1.n == params.rounds * k and rows["unified"].vs_lora is None
    unified = {a.key: a for a in units.agents_of(by["unified"])}
    assert vs.identical.mean == sum(a.tokens == unified[a.key].tokens
                                    for a in alone.values()) / len(alone)
    table = write_outputs(folder, "alora smoke")
    assert "| alora | 2 | 8 |" in table and "Against plain LoRA" in table
    assert "| alora_unified | 8 |" in table
