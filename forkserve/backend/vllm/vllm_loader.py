"""Build vLLM's in-process ``LLM`` for VllmBackend. GPU only: imports vLLM here, lazily.

vLLM 0.26.0 pins a CUDA build of torch, so it is an optional extra
(``pip install -e ".[vllm]"``) and the rest of ForkServe never imports it. On the lent H200,
vLLM comes from the wheel parts built by ``shared/tools/vllm-carry.sh`` (docs/VLLM_BACKEND.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from forkserve.backend.vllm.adapters import AdapterTable
from forkserve.backend.vllm.block_pinner import KvManagerPinner
from forkserve.backend.vllm.phase_runner import VllmApi
from forkserve.config import ForkServeConfig

INSTALL_HINT = ('VllmBackend needs vLLM 0.26.0 and a CUDA GPU: pip install -e ".[vllm]" '
                '(on the lent H200: the parts of shared/tools/vllm-carry.sh, see '
                'docs/VLLM_BACKEND.md)')


@dataclass(frozen=True)
class LoadedEngine:
    llm: Any
    engine: Any
    api: VllmApi
    pinner: KvManagerPinner | None
    tokenizer: Any


def import_vllm() -> tuple[Any, Any, Any]:
    """(LLM, SamplingParams, LoRARequest), or an ImportError that says how to get them."""
    # The pinner needs the scheduler in this process; the multiprocess engine core also hung
    # at start on the H200 (vllm-carry.sh). vLLM reads this when the engine is built.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return LLM, SamplingParams, LoRARequest


def build_llm(model: str, config: ForkServeConfig, *, max_loras: int, gpu_memory_utilization: float,
              max_lora_rank: int, llm_kwargs: dict[str, Any]) -> Any:
    """vLLM's ``LLM`` with the control plane's page size as block size and prefix caching on;
    ``max_loras`` 0 builds it without LoRA support. ``llm_kwargs`` pass through (e.g.
    ``load_format="dummy"``, ``skip_tokenizer_init=True``, ``num_gpu_blocks_override``)."""
    llm_cls, _, _ = import_vllm()
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"{INSTALL_HINT}; no CUDA device is visible")
    kwargs: dict[str, Any] = dict(
        model=model, block_size=config.page_size, enable_prefix_caching=True,
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=config.max_context)
    if max_loras:
        kwargs.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
    kwargs.update(llm_kwargs)
    llm = llm_cls(**kwargs)
    _check_capacity(llm.llm_engine, config)
    return llm


def api() -> VllmApi:
    _, sampling_params, lora_request = import_vllm()
    return VllmApi(sampling_params, lora_request)


def load_engine(model: str, config: ForkServeConfig, adapters: AdapterTable, *,
                gpu_memory_utilization: float, cow_blocks: bool, max_lora_rank: int,
                llm_kwargs: dict[str, Any]) -> LoadedEngine:
    llm = build_llm(model, config, max_loras=len(adapters),
                    gpu_memory_utilization=gpu_memory_utilization, max_lora_rank=max_lora_rank,
                    llm_kwargs=llm_kwargs)
    engine = llm.llm_engine
    pinner = KvManagerPinner.attach(engine) if cow_blocks else None
    tokenizer = None if llm_kwargs.get("skip_tokenizer_init") else llm.get_tokenizer()
    return LoadedEngine(llm, engine, api(), pinner, tokenizer)


def _check_capacity(engine: Any, config: ForkServeConfig) -> None:
    """Every control-plane page may pin one vLLM block, and vLLM still needs room for the
    partial tail blocks it recomputes: its pool must exceed ``num_pages``."""
    blocks = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    blocks = getattr(blocks, "num_gpu_blocks", None)
    if blocks is not None and blocks <= config.num_pages:
        raise RuntimeError(f"vLLM allocated {blocks} KV blocks, not more than the control "
                           f"plane's num_pages={config.num_pages}: lower num_pages or raise "
                           f"gpu_memory_utilization")
