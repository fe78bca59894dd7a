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
