"""Helpers of the torch backend tests: tiny random checkpoints saved to disk (so every test
goes through the real loaders), HF references, work items.

FORKSERVE_TEST_DEVICE=cuda runs the suite on the GPU in bf16 (tolerances widen accordingly).
A module name of its own: every test folder has a conftest, so `from conftest import` is
ambiguous when the whole suite runs.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.protocol import GREEDY, KVSlots, SamplingParams, SeqWork
from forkserve.config import ForkServeConfig, KVForm, KVLayout

DEVICE = torch.device(os.environ.get("FORKSERVE_TEST_DEVICE", "cpu"))
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
# ||ours - ref|| / ||ref||: float32 lands near 1e-6; bf16 near 1e-2 (METHOD.md's bands).
REL_TOL = 1e-4 if DTYPE == torch.float32 else 3e-2
# Small pages on CPU so short prompts span several; the Triton kernels need at least 16.
PAGE = 4 if DEVICE.type == "cpu" else 16
PAGES_PER_SEQ = 128 // PAGE
VOCAB = 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def tiny_hf_config(arch: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    # head_dim 32 (not hidden / heads = 16): the Triton kernels need at least 32.
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    return {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch](**common)


def save_tiny_model(path: Path, arch: str, seed: int, shard: bool = False, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(arch, **overrides),
                                             attn_implementation="eager")
    with torch.no_grad():  # HF zero-initializes biases; random ones make the bias path observable
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path, max_shard_size="60KB" if shard else "5GB")
    return path


def save_peft_adapter(base: Path, path: Path, rank: int, targets: Sequence[str], seed: int,
                      alpha: float = 16.0, rslora: bool = False,
                      invocation: Sequence[int] | None = None) -> Path:
    """``invocation``: an activated LoRA (PEFT ``alora_invocation_tokens``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(seed)
    # init_lora_weights=False: B is random too, so the adapter changes the logits.
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=[f"{t}_proj" for t in targets],
                     init_lora_weights=False, use_rslora=rslora,
                     # peft finds the invocation only in its CausalLM wrapper's forward.
                     task_type="CAUSAL_LM" if invocation is not None else None,
                     alora_invocation_tokens=list(invocation) if invocation is not None else None)
    get_peft_model(model, cfg).save_pretrained(path)
    return path


def hf_model(model_dir: Path, adapter_dir: Path | None = None) -> torch.nn.Module:
    """Reference: transformers (+ peft) in float64 on CPU, eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                 dtype=torch.float64)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir, torch_dtype=torch.float64)
        model = model.to(torch.float64)
    return model


def hf_logits(model_dir: Path, tokens: Sequence[int],
              adapter_dir: Path | None = None) -> torch.Tensor:
    """The reference's logits for every position."""
    with torch.no_grad():
        return hf_model(model_dir, adapter_dir)(torch.tensor([list(tokens)])).logits[0].float()


def make_config(layout: KVLayout = KVLayout.UNIFIED, num_pages: int = 256) -> ForkServeConfig:
    return ForkServeConfig(page_size=PAGE, num_pages=num_pages, num_residual_pages=num_pages,
                           kv_layout=layout, vocab_size=VOCAB)


def pages_for(seq: int, base_offset: int = 0) -> tuple[int, ...]:
    start = base_offset + seq * PAGES_PER_SEQ
    return tuple(range(start, start + PAGES_PER_SEQ))


def work(seq: int, tokens: Sequence[int], start: int, adapter: int | None = None,
         sampling: SamplingParams | None = GREEDY, residual: bool = False,
         pages: tuple[int, ...] | None = None, **flags) -> SeqWork:
    """flags: decode, write_base, write_residual (SeqWork's own fields); ``residual``: the
    split form, with residual pages where there is an adapter (the base model has none)."""
    pages = pages if pages is not None else pages_for(seq)
    return SeqWork(seq_id=seq, tokens=tuple(tokens), start_pos=start,
                   slots=KVSlots(pages,
                                 pages_for(seq) if residual and adapter is not None else None),
                   adapter_id=adapter, sampling=sampling,
                   form=KVForm.SPLIT if residual else KVForm.MERGED, **flags)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def as_decode_batch(work: Sequence[SeqWork]) -> DecodeBatch:
    """Decode items as the steady set's columns (what ``launch(work=[], batch)`` reads)."""
    return DecodeBatch(tuple(s.seq_id for s in work), tuple(s.tokens[0] for s in work),
                       [s.start_pos for s in work], tuple(np.array(s.slots.pages) for s in work),
                       tuple(None if s.slots.residual_pages is None
                             else np.array(s.slots.residual_pages)
                             for s in work),
                       tuple(s.form for s in work), tuple(s.adapter_id for s in work),
                       [s.adapter_start for s in work], tuple(s.sampling for s in work),
                       tuple(s.shared_prefix for s in work))
