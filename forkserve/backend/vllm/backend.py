"""VllmBackend: the Backend protocol on vLLM V1 (in-process ``LLM``), UNIFIED pages only.

Page ids stay the control plane's (protocol.py). vLLM keeps its own block tables; the two
meet through content, not ids (docs/VLLM_BACKEND.md):

* every ``SeqWork`` becomes one vLLM request whose prompt is the sequence read back through
  the item's page ids (``TokenShadow``) plus the new tokens; vLLM's prefix cache computes
  only what it does not hold — a child forked from a trunk hits the trunk's blocks;
* with ``cow_blocks`` each full page id pins the vLLM block holding the same contents
  (``PinTable`` + a ``Pinner``), so vLLM cannot evict a trunk the control plane still holds;
  writing into a page id (reallocation, mid-page truncation) or copying onto it drops the pin;
* one step is one phase (``two_class=False``: vLLM's scheduler sees all requests) or two
  (committed, then speculative).

Build it with a model path (imports vLLM; needs ``pip install -e ".[vllm]"`` and a CUDA GPU)
or, for tests, ``VllmBackend.on_engine`` with any engine that speaks ``PhaseRunner``'s
protocol.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from forkserve.backend.capabilities import Capabilities
from forkserve.backend.protocol import PageId, PageKind, SeqWork, StepCost, StepResult
from forkserve.backend.vllm.adapters import AdapterTable
from forkserve.backend.vllm.phase_runner import EngineLike, PhaseRunner, Pinner, VllmApi
from forkserve.backend.vllm.pin_table import PinTable
from forkserve.backend.vllm.planner import plan_step
from forkserve.backend.vllm.step_stats import VllmStats
from forkserve.backend.vllm.token_shadow import TokenShadow
from forkserve.config import ForkServeConfig, KVLayout


class VllmBackend:
    # None of the optional parts: adapters are resolved (name or id) at the step, vLLM's
    # prefix cache does its own eviction, and each step runs to its end.
    capabilities = Capabilities()

    def __init__(self, config: ForkServeConfig | None = None, *, model: str,
                 gpu_memory_utilization: float = 0.45, two_class: bool = False,
                 cow_blocks: bool = True, lora_modules: Mapping[str, str] | None = None,
                 max_lora_rank: int = 16, **llm_kwargs: Any) -> None:
        from forkserve.backend.vllm.vllm_loader import load_engine

        config = config or ForkServeConfig()
        _check_config(config)
        adapters = AdapterTable(lora_modules)
        loaded = load_engine(model, config, adapters, gpu_memory_utilization=gpu_memory_utilization,
                             cow_blocks=cow_blocks, max_lora_rank=max_lora_rank,
                             llm_kwargs=llm_kwargs)
        self.llm = loaded.llm
        self._setup(config, loaded.engine, loaded.api, loaded.pinner, adapters, two_class,
                    cow_blocks, loaded.tokenizer)

    @classmethod
    def on_engine(cls, config: ForkServeConfig, engine: EngineLike, api: VllmApi, *,
                  pinner: Pinner | None = None, lora_modules: Mapping[str, str] | None = None,
                  two_class: bool = False, cow_blocks: bool = True) -> VllmBackend:
        """A backend over an engine that is already built (a test double, or an ``LLM``'s
        ``llm_engine`` the caller configured itself)."""
        _check_config(config)
        if cow_blocks and pinner is None:
            raise ValueError("cow_blocks=True needs a pinner (or pass cow_blocks=False)")
        backend = cls.__new__(cls)
        backend.llm = None
        backend._setup(config, engine, api, pinner, AdapterTable(lora_modules), two_class,
                       cow_blocks, None)
        return backend

    def _setup(self, config: ForkServeConfig, engine: EngineLike, api: VllmApi,
               pinner: Pinner | None, adapters: AdapterTable, two_class: bool,
               cow_blocks: bool, tokenizer: Any) -> None:
        self.config = config
        self.adapters = adapters
        self.two_class, self.cow_blocks = two_class, cow_blocks
        self.shadow = TokenShadow(config.num_pages, config.page_size)
        self.pins: PinTable = PinTable()
        self.pinner = pinner if cow_blocks else None
        self.runner = PhaseRunner(engine, api, self.pinner)
        self.stats = VllmStats()
        self._tokenizer = tokenizer

    # ------------------------------------------------------------------ protocol
    def page_kinds(self) -> tuple[PageKind, ...]:
        return (PageKind.UNIFIED,)

    def adapter_id(self, name: str) -> int:
        return self.adapters.adapter_id(name)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise AttributeError("this VllmBackend runs on token ids only (no tokenizer loaded)")
        return self._tokenizer

    def step(self, work: Sequence[SeqWork]) -> StepResult:
        plan = plan_step(work, self.shadow, self.adapters, step_index=self.stats.steps,
                         two_class=self.two_class, cow_blocks=self.cow_blocks)
        for item in work:
            self.shadow.write(item.slots.pages, item.start_pos, item.tokens, item.adapter_id,
                              item.seq_id)
        for page in plan.unpin:
            self._drop_pin(page)
        t0 = time.perf_counter()
        results = {}
        for phase in plan.phases:
            results.update(self.runner.run(phase))
        ms = (time.perf_counter() - t0) * 1000.0
        for request in plan.requests():
            result = results[request.request_id]
            self.stats.prompt_tokens += len(request.prompt)
            self.stats.cached_tokens += result.cached_tokens
            for block, page in request.pin_blocks:
                handle = result.pins.get(block)
                if handle is not None:  # None: vLLM had not cached that block, nothing to hold
                    self._hold_pin(page, handle)
        self.stats.steps += 1
        self.stats.phases += len(plan.phases)
        self.stats.requests += len(work)
        by_seq = {r.seq_id: results[r.request_id].token for r in plan.requests()}
        return StepResult(tuple(by_seq[item.seq_id] for item in work), _cost(work, ms))

    def copy_pages(self, kind: PageKind, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        if kind is not PageKind.UNIFIED:
            raise ValueError(f"VllmBackend stores {PageKind.UNIFIED.value} pages only, not "
                             f"{kind.value}")
        for src, dst in pairs:
            self.shadow.copy(src, dst)
            self._drop_pin(dst)
            handle = self.pins.get(src)
            if handle is not None and self.pinner is not None:
                # Same contents, same vLLM block: the copy holds it too.
                self.pinner.retain(handle)
                self._hold_pin(dst, handle)

    def close(self) -> None:
        """Release every pin, so the vLLM engine can serve another backend (a benchmark that
        reuses one ``LLM`` across runs) without blocks held by page ids nobody owns."""
        for handle in self.pins.drain():
            if self.pinner is not None:
                self.pinner.release(handle)
                self.stats.pins_released += 1

    def transfer_cost(self, tokens: int) -> StepCost:
        # One vLLM instance: no prefill->decode connector, nothing moves.
        return StepCost()

    def _hold_pin(self, page: PageId, handle: Any) -> None:
        self.stats.pins_taken += 1
        if self.pins.hold(page, handle) is not None:
            raise AssertionError(f"page {page} was pinned twice without a write between")

    def _drop_pin(self, page: PageId) -> None:
        handle = self.pins.drop(page)
        if handle is not None and self.pinner is not None:
            self.pinner.release(handle)
            self.stats.pins_released += 1


def _check_config(config: ForkServeConfig) -> None:
    if config.kv_layout is not KVLayout.UNIFIED:
        raise ValueError(f"VllmBackend needs kv_layout=unified (vLLM stores merged K/V per "
                         f"LoRA); got {config.kv_layout.value}")
    if config.disaggregated_prefill:
        raise ValueError("VllmBackend runs one vLLM instance: disaggregated_prefill has no "
                         "connector")


def _cost(work: Sequence[SeqWork], ms: float) -> StepCost:
    prefill = sum(len(w.tokens) for w in work if not w.decode)
    decode = sum(len(w.tokens) for w in work if w.decode)
    calls = sum(1 for w in work if not w.decode)
    # vLLM runs prefill and decode in one batch; ms is measured for the whole step, so the
    # prefill share is estimated by tokens (the Engine refines its ms-per-token from it).
    prefill_ms = ms * prefill / max(1, prefill + decode)
    return StepCost(ms, prefill, decode, calls, prefill_ms)
