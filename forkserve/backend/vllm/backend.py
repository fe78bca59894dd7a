"""VllmBackend: the Backend protocol on vLLM V1 (in-process ``LLM``), UNIFIED pages only.

Page ids stay the control plane's (protocol.py). vLLM keeps its own block tables; the two
meet through content, not ids (docs/VLLM_BACKEND.md):

* every ``SeqWork`` becomes one vLLM request whose prompt is the sequence read back through
  the item's page ids (``TokenShadow``) plus the new tokens; vLLM's prefix cache computes
  only what it does not hold — a child forked from a trunk hits the trunk's blocks;
* with ``cow_blocks`` each full page id pins the vLLM block holding the same contents
  (``PinTable`` + a ``Pinner``), so vLLM cannot evict a trunk the control plane still holds;
  writing into a page id (reallocation, mid-page truncation) or copying onto it drops the pin;
* decode-ahead (``config.vllm_decode_ahead`` = K > 1): a committed plain decode asks for K
  tokens; the rest are served from a ``Lookahead`` on later steps that write exactly them,
  with no vLLM request (a step served whole makes no vLLM call);
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
from forkserve.backend.vllm.lookahead import Lookahead
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
        self.lookahead = Lookahead(config.page_size)
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
        # Decode-ahead: items whose next token vLLM already produced are served from the
        # lookahead (no request); everything a write contradicts is dropped first.
        served = self.lookahead.serve(work, self.stats.steps)
        todo = [item for item in work if item.seq_id not in served]
        served_pins = {}
        if self.cow_blocks:
            for item in todo:
                held = [(j, page) for j, page in self.lookahead.take_unpinned(item.seq_id)
                        if self.pins.get(page) is None]
                if held:
                    served_pins[item.seq_id] = held
        plan = plan_step(todo, self.shadow, self.adapters, step_index=self.stats.steps,
                         two_class=self.two_class, cow_blocks=self.cow_blocks,
                         decode_ahead=self.config.vllm_decode_ahead,
                         max_context=self.config.max_context, served_pins=served_pins)
        for item in work:
            touched = self.shadow.write(item.slots.pages, item.start_pos, item.tokens,
                                        item.adapter_id, item.seq_id)
            if item.seq_id in served:  # no request: unpin what it wrote, as plan.unpin does
                for page in touched:
                    self._drop_pin(page)
        for page in plan.unpin:
            self._drop_pin(page)
        t0 = time.perf_counter()
        results = {}
        for phase in plan.phases:
            results.update(self.runner.run(phase))
        ms = (time.perf_counter() - t0) * 1000.0
        items = {item.seq_id: item for item in todo}
        for request in plan.requests():
            result = results[request.request_id]
            self.stats.prompt_tokens += len(request.prompt)
            self.stats.cached_tokens += result.cached_tokens
            for block, page in request.pin_blocks:
                handle = result.pins.get(block)
                if handle is not None:  # None: vLLM had not cached that block, nothing to hold
                    self._hold_pin(page, handle)
            if request.sampling.max_tokens > 1:
                self.lookahead.keep(items[request.seq_id], result.ahead_tokens(), self.stats.steps)
        self.stats.steps += 1
        self.stats.phases += len(plan.phases)
        self.stats.requests += len(plan.requests())
        self.stats.ahead_served = self.lookahead.served
        self.stats.ahead_dropped = self.lookahead.dropped
        by_seq = {r.seq_id: results[r.request_id].token for r in plan.requests()}
        by_seq.update(served)
        return StepResult(tuple(by_seq[item.seq_id] for item in work), _cost(work, ms))

    def copy_pages(self, kind: PageKind, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        if kind is not PageKind.UNIFIED:
            raise ValueError(f"VllmBackend stores {PageKind.UNIFIED.value} pages only, not "
                             f"{kind.value}")
        self.lookahead.drop_pages(dst for _, dst in pairs)
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
        reuses one ``LLM`` across runs) without blocks held by page ids nobody owns; drop
        every lookahead."""
        self.lookahead.clear()
        self.stats.ahead_dropped = self.lookahead.dropped
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
