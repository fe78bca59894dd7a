"""drift.py on the tiny model with random adapters, against transformers + peft."""
import json

import pytest
import torch
from quality_testlib import needs_bfcl

pytestmark = needs_bfcl


def hf_kv_drift(model_dir, adapters, writer, reader, tokens, layer):
    """Independent oracle: attention inputs from transformers + peft, projected by k_proj/v_proj."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def inputs(name):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
        if name != "base":
            model = PeftModel.from_pretrained(model, adapters / name).to(torch.float64)
            model = model.merge_and_unload()
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_hidden_states=True)
            stream = out.hidden_states[layer][0]
            return model.model.layers[layer].input_layernorm(stream)
    hx, hw = inputs(reader), inputs(writer)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).model.layers[layer]
    with torch.no_grad():  # the base projections: what the reader reads from the base pages
        return [float((proj(hx) - proj(hw)).norm() / proj(hx).norm())
                for proj in (plain.self_attn.k_proj, plain.self_attn.v_proj)]


def test_drift_per_layer_matches_an_independent_oracle(tiny, tmp_path):
    from benchmarks.quality import drift, train
    from benchmarks.quality.evaluate import EvalParams, common_prefix, load_inputs

    adapters = tmp_path / "adapters"
    assert train.main(["--model", str(tiny), "--out", str(adapters), "--device", "cpu",
                       "--max-steps", "2", "--batch", "2", "--distractors", "1", "--heldout", "4",
                       "--rank", "4", "--init", "random"]) == 0
    params = EvalParams(rounds=2, distractors=1, heldout=4)
    result = drift.run(tiny, adapters, params, tmp_path, "test", rounds=1)
    tasks = ["simple_python", "multiple", "parallel", "live_simple"]
    assert len(result.pairs) == len(tasks) * len(tasks)  # 3 other adapters + the base, per reader
    assert result.rounds == 1 and result.context_tokens > 100
    for p in result.pairs:
        assert p.k[0] == 0.0 and p.v[0] == 0.0  # layer 0 reads the embeddings
        assert all(d > 1e-4 for d in p.k[1:] + p.v[1:])  # random adapters move later layers
    saved = json.loads((tmp_path / "quality_test_drift.json").read_text())
    assert saved["base_writer"]["writer"] == "base" and len(saved["adapter_writer"]["k"]) == 3
    assert (tmp_path / "quality_test_drift.png").stat().st_size > 0

    prompts = load_inputs(tiny, adapters, params).prompts[0]
    context = prompts[0][:common_prefix(prompts)]
    for writer, reader in (("multiple", "parallel"), ("base", "simple_python")):
        pair = next(p for p in result.pairs if (p.writer, p.reader) == (writer, reader))
        for layer in (1, 2):
            k, v = hf_kv_drift(tiny, adapters, writer, reader, context, layer)
            assert pair.k[layer] == pytest.approx(k, rel=1e-3)
            assert pair.v[layer] == pytest.approx(v, rel=1e-3)
