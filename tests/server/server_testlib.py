"""Shared by tests/server: a tiny random Llama with a real tokenizer (byte-level BPE + chat
template) and two PEFT adapters saved to disk, served on loopback, so tests go through every
real loader. (A uniquely named module: every test folder has its own conftest.)"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import torch

from forkserve.config import app_config
from forkserve.interfaces.server.access import DEFAULT_ACCESS, AccessConfig
from forkserve.interfaces.server.launcher import RunningServer, serve_in_thread
from forkserve.interfaces.server.served_model import load_served_model

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["Thought: I should look at the files first.", "Action: search[forkserve pages]",
          "Observation: the tool returned three results.", "Final Answer: the cache is shared.",
          "The quick brown fox jumps over the lazy dog.", "def main():\n    return 0\n"]
MAX_CONTEXT = 384
MODEL_NAME = "tiny-llama"
DEMO_NAME = "smollm2"


def save_tokenizer(path: Path) -> int:
    """A byte-level BPE (any text encodes) trained on a few lines; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320,
                                  special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                   bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return len(fast)


def save_model(root: Path) -> tuple[Path, dict[str, Path]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = root / MODEL_NAME
    vocab = save_tokenizer(path)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_CONTEXT,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    adapters = {}
    for i, name in enumerate(("planner", "critic")):
        torch.manual_seed(10 + i)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                              LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        peft.save_pretrained(root / name)
        adapters[name] = root / name
    return path, adapters


def start(tiny_model_dir, session_ttl_s: float = 600.0, access: AccessConfig = DEFAULT_ACCESS,
          **config) -> "contextlib.AbstractContextManager[RunningServer]":
    path, adapters = tiny_model_dir
    cfg = app_config(page_size=4, num_pages=config.pop("num_pages", 2048), num_residual_pages=2048,
                     **config)
    model = load_served_model(path, config=cfg, loras=adapters, device="cpu", dtype="float32",
                              attention="eager")
    return serve_in_thread(model, session_ttl_s=session_ttl_s, access=access)


def quiescent_pages(running: RunningServer) -> tuple[int, int, int]:
    """(sessions, pages used, pages published): no leak means used == published."""
    return running.on_engine(lambda e: (len(e.sessions), e.pool.num_used, e.index.num_pages))


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for a condition the server reaches on its own (a disconnect's abort runs on the
    engine thread after the client has left); the timeout is generous, the poll is short."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.02)
