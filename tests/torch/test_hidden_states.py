"""TorchBackend.forward(hidden_states=True): the residual stream after every layer, per item,
against transformers + peft (output_hidden_states), in prefill chunks, decodes and a mixed batch."""
from __future__ import annotations

import pytest
import torch
from torch_testlib import DEVICE, DTYPE, REL_TOL, hf_model, make_config, prompt, rel_err, work

from forkserve.backend.torch import TorchBackend


def hf_hidden(model_dir, tokens, adapter_dir=None) -> torch.Tensor:
    """[tokens, layers, hidden]: transformers' stream after each decoder layer, fp32 on the CPU."""
    with torch.no_grad():
        model = hf_model(model_dir, adapter_dir)
        out = model(torch.tensor([list(tokens)]), output_hidden_states=True)
    # hidden_states[0] is the embedding; transformers hands the last layer's stream over
    # after the final norm.
    return torch.stack([h[0] for h in out.hidden_states[1:]], dim=1).float()


@pytest.mark.parametrize("adapter", [None, "qkvo"])
def test_hidden_states_match_hf_over_chunks_and_decodes(models, adapters, adapter):
    path = models["llama"]
    backend = TorchBackend(make_config(), path, {"a": adapters["qkvo"]}, device=DEVICE, dtype=DTYPE)
    aid = backend.adapter_id("a") if adapter else None
    tokens, other = prompt(5, 19), prompt(6, 7)
    rows = []
    for start, end in ((0, 8), (8, 17)):  # two prefill chunks, then one decode per step
        out = backend.forward([work(0, tokens[start:end], start, aid)], hidden_states=True)
        rows.append(out.hidden[0])
    backend.step([work(1, other, 0)])
    for pos in (17, 18):  # each decode shares its step with another sequence's
        pair = [work(1, tokens[pos:pos + 1], len(other), decode=True),
                work(0, tokens[pos:pos + 1], pos, aid, decode=True)]
        out = backend.forward(pair, hidden_states=True)
        assert [h.shape[0] for h in out.hidden] == [1, 1]
        rows.append(out.hidden[1])
    # Compared on the CPU in fp32, where the reference lives (the rows are on DEVICE, in DTYPE).
    ours = torch.cat(rows).float().cpu()
    num_layers = backend.model_config.num_layers
    assert ours.shape == (len(tokens), num_layers, backend.model_config.hidden_size)
    ref = hf_hidden(path, tokens, adapters["qkvo"] if adapter else None)
    assert ref.shape == ours.shape
    w, eps = backend.model.weights.final_norm, backend.model_config.rms_norm_eps
    ours[:, -1] = torch.nn.functional.rms_norm(ours[:, -1], (ours.shape[-1],), w.float().cpu(), eps)
    per_layer = [round(rel_err(ours[:, n], ref[:, n]), 4) for n in range(num_layers)]
    assert rel_err(ours, ref) < REL_TOL, f"relative error per layer {per_layer}"


def test_without_hidden_states_nothing_is_returned_and_logits_are_unchanged(models):
    backend = TorchBackend(make_config(), models["llama"], device=DEVICE, dtype=DTYPE)
    tokens = prompt(7, 11)
    plain = backend.forward([work(0, tokens, 0)], all_logits=True)
    assert plain.hidden == ()
    with_hidden = backend.forward([work(1, tokens, 0)], all_logits=True, hidden_states=True)
    assert torch.equal(plain.logits[0], with_hidden.logits[0])
