"""A CPU double of the slice of vLLM that VllmBackend drives. It is not vLLM.

``FakeLLMEngine`` speaks the in-process ``LLMEngine`` calls PhaseRunner makes (add_request,
step, has_unfinished_requests) and models vLLM V1's prefix cache at block granularity:
full blocks keyed by (LoRA, every token up to the block's end), a fixed number of blocks,
reference counts, LRU eviction of unreferenced blocks, a hit capped below the last prompt
token, and ``num_cached_tokens`` in each output. Its "model" is MockBackend's token hash
(the next token is a deterministic function of the whole prompt and the LoRA), so a prompt
that was rebuilt wrongly from the page ids samples a different token.
``FakePinner`` holds blocks past a request's end the way KvManagerPinner does on vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from forkserve.backend.mock import MockBackend
from forkserve.backend.protocol import PageKind
from forkserve.backend.vllm import VllmApi
from forkserve.backend.vllm.block_pinner import external_id
from forkserve.config import ForkServeConfig

_HASHER = MockBackend(ForkServeConfig(num_pages=1, num_residual_pages=1))


def next_token(tokens: Sequence[int], lora: str | None) -> int:
    """MockBackend's sample for a context of ``tokens`` written by ``lora`` (unified layout)."""
    values = _HASHER.expected_values(PageKind.UNIFIED, tokens, lora)
    return _HASHER._next_token(np.asarray(values), lora)  # the mock's own hash, reused on purpose


def greedy_reference(prompt: Sequence[int], n: int, lora: str | None = None) -> list[int]:
    """What a plain run that saw only ``prompt`` generates greedily."""
    tokens, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(tokens, lora))
        tokens.append(out[-1])
    return out


class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        for k, v in kwargs.items():
            setattr(self, k, v)


@dataclass(frozen=True)
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


FAKE_API = VllmApi(sampling_params=FakeSamplingParams, lora_request=FakeLoRARequest)


@dataclass
class FakeBlock:
    key: tuple
    ref: int = 0
    last_used: int = 0


@dataclass
class _Request:
    request_id: str  # vLLM's internal id (ours + "-" + 8 hex digits, as 0.26 assigns)
    external_id: str
    tokens: list[int]
    params: FakeSamplingParams
    lora: FakeLoRARequest | None
    blocks: list[FakeBlock] = field(default_factory=list)


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class FakeOutput:
    request_id: str
    outputs: list[_Completion]
    num_cached_tokens: int
    finished: bool = True


class FakeLLMEngine:
    def __init__(self, num_blocks: int = 100_000, block_size: int = 16) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.cache: dict[tuple, FakeBlock] = {}
        self.queue: list[_Request] = []
        self.free_hooks: list = []
        self.steps: list[list[str]] = []  # request ids of each batch, in order
        self.requests: list[_Request] = []
        self.computed_tokens = 0
        self.evictions = 0
        self._clock = 0

    # ------------------------------------------------ the LLMEngine surface
    def add_request(self, request_id: str, prompt: Mapping[str, list[int]], params: Any, *,
                    lora_request: Any = None) -> None:
        assert params.n == 1 and params.max_tokens >= 1 and params.ignore_eos
        internal = f"{request_id}-{len(self.requests) + len(self.queue):08x}"
        self.queue.append(_Request(internal, request_id, list(prompt["prompt_token_ids"]),
                                   params, lora_request))

    def has_unfinished_requests(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[FakeOutput]:
        batch, self.queue = self.queue, []
        self.steps.append([r.external_id for r in batch])
        outputs = [self._run(r) for r in batch]
        for r in batch:
            for hook in self.free_hooks:
                hook(r)
            for block in r.blocks:
                block.ref -= 1
        return outputs

    # ------------------------------------------------ prefix cache
    def lora_name(self, r: _Request) -> str | None:
        return None if r.lora is None else r.lora.lora_name

    def _run(self, r: _Request) -> FakeOutput:
        p, lora = self.block_size, self.lora_name(r)
        full = len(r.tokens) // p
        hit = 0
        # As vLLM: the last prompt token is always computed (its logits are needed).
        while (hit < (len(r.tokens) - 1) // p
               and (lora, tuple(r.tokens[:(hit + 1) * p])) in self.cache):
            hit += 1
        for j in range(full):
            key = (lora, tuple(r.tokens[:(j + 1) * p]))
            block = self.cache.get(key) if j < hit else None
            if block is None:
                block = self._allocate(key)
            block.ref += 1
            self._clock += 1
            block.last_used = self._clock
            r.blocks.append(block)
        self.computed_tokens += len(r.tokens) - hit * p
        self.requests.append(r)
        # Every token in one step: nothing here depends on how vLLM interleaves decode steps.
        tokens = greedy_reference(r.tokens, r.params.max_tokens, lora)
        return FakeOutput(r.external_id, [_Completion(tokens)], hit * p)

    def _allocate(self, key: tuple) -> FakeBlock:
        if key in self.cache:  # vLLM does not deduplicate; one entry per key is enough here
            return self.cache[key]
        if len(self.cache) >= self.num_blocks:
            idle = [b for b in self.cache.values() if b.ref == 0]
            if not idle:
                raise RuntimeError("fake vLLM: every block is referenced (out of KV blocks)")
            victim = min(idle, key=lambda b: b.last_used)
            del self.cache[victim.key]
            self.evictions += 1
        block = FakeBlock(key)
        self.cache[key] = block
        return block


class FakePinner:
    """KvManagerPinner's contract on the fake cache: a reference per held block."""

    def __init__(self, engine: FakeLLMEngine) -> None:
        self._expected: dict[str, tuple[int, ...]] = {}
        self._taken: dict[str, dict[int, FakeBlock]] = {}
        engine.free_hooks.append(self._capture)

    def expect(self, request_id: str, block_indices: Sequence[int]) -> None:
        self._expected[request_id] = tuple(block_indices)

    def take(self, request_id: str) -> Mapping[int, FakeBlock]:
        return self._taken.pop(request_id, {})

    def retain(self, handle: FakeBlock) -> None:
        handle.ref += 1

    def release(self, handle: FakeBlock) -> None:
        assert handle.ref > 0, "released a block nobody held"
        handle.ref -= 1

    def _capture(self, r: _Request) -> None:
        indices = self._expected.pop(external_id(r.request_id), ())
        taken = {}
        for j in indices:
            if j < len(r.blocks):
                r.blocks[j].ref += 1
                taken[j] = r.blocks[j]
        if indices:
            self._taken[external_id(r.request_id)] = taken


class FakeLLM:
    """The slice of ``vllm.LLM`` the benchmarks call, over a FakeLLMEngine."""

    def __init__(self, engine: FakeLLMEngine) -> None:
        self.llm_engine = engine
        self._ids = 0

    def reset_prefix_cache(self) -> bool:
        if any(b.ref for b in self.llm_engine.cache.values()):
            return False  # as vLLM: refused while a block is referenced
        self.llm_engine.cache.clear()
        return True

    def generate(self, prompts: Sequence[Mapping[str, list[int]]], params: Any, *,
                 lora_request: Any = None, use_tqdm: bool = False) -> list[FakeOutput]:
        ids = []
        for i, prompt in enumerate(prompts):
            lora = lora_request[i] if isinstance(lora_request, list) else lora_request
            self._ids += 1
            ids.append(f"generate-{self._ids}")
            self.llm_engine.add_request(ids[-1], prompt, params, lora_request=lora)
        done = {out.request_id: out for out in self.llm_engine.step()}
        return [done[i] for i in ids]


class FakeGauge:
    """KvGauge on the fake: blocks referenced when a request finishes (before its own
    references go), the most of them since ``reset``."""

    def __init__(self, engine: FakeLLMEngine) -> None:
        self._engine = engine
        self.peak_blocks = 0
        engine.free_hooks.append(lambda _request: self.read())

    def read(self) -> int:
        used = sum(1 for b in self._engine.cache.values() if b.ref)
        self.peak_blocks = max(self.peak_blocks, used)
        return used

    def reset(self) -> None:
        self.peak_blocks = sum(1 for b in self._engine.cache.values() if b.ref)
