"""A tiny random Llama with its own small BPE tokenizer and chat template, saved as an HF
folder, so the quality pipeline runs end to end in seconds without SmolLM2."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' "
                 "+ message['content'] "
                 "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")

needs_bfcl = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None,
                                reason="BFCL data missing: pip install --no-deps "
                                       "bfcl-eval==2026.3.23")


def tiny_model(folder: Path, texts: list[str], vocab: int = 1024) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192,
                      eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id,
                      pad_token_id=fast.pad_token_id, initializer_range=0.1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def tiny_gguf(folder: Path, path: Path, tied: bool = False) -> Path:
    """``folder``'s model (tiny_model) as a Q8_0 GGUF with its BPE tokenizer and chat template,
    what transformers' GGUF loader reads; ``tied``: without output.weight (as Qwen2.5-0.5B)."""
    import json

    import gguf
    from gguf_testlib import add_llama_header, add_weight, write_out
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_header(w, cfg, len(tok))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_token_list([t for t, _ in vocab])
    special = set(tok.all_special_tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t, _ in vocab])
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, t in load_file(folder / "model.safetensors").items():
        if tied and name == "lm_head.weight":
            continue
        a = t.float().numpy()
        gname = names.get_name(name, try_suffixes=(".weight",))
        add_weight(w, gname, a, gguf.GGMLQuantizationType.Q8_0)
    write_out(w)
    return path
