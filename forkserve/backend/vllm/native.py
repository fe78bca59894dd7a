"""Plain vLLM, no control plane: the baseline rows of the side-by-side benchmarks.

``run_batch`` submits prompts to the in-process ``LLMEngine`` together and steps it to
completion, as ``LLM.generate`` does, but through ``add_request`` / ``step`` so the caller
gets vLLM's own accounting per request (``num_cached_tokens``: what its prefix cache
supplied) and, with a ``KvGauge``, the most KV blocks referenced at once. Nothing here
imports vLLM (its classes come through ``VllmApi``), so tests drive it on the fake engine.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence

from forkserve.backend.vllm.adapters import LoraRef
from forkserve.backend.vllm.phase_runner import EngineLike, VllmApi

_IDS = itertools.count()


@dataclass(frozen=True)
class NativeBatch:
    tokens: tuple[tuple[int, ...], ...]  # generated, per prompt, in submission order
    prompt_tokens: int
    cached_tokens: int                   # prompt tokens vLLM's prefix cache supplied
    seconds: float

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def run_batch(engine: EngineLike, api: VllmApi, prompts: Sequence[Sequence[int]],
              max_tokens: int, loras: Sequence[LoraRef | None] | None = None) -> NativeBatch:
    """Greedy, EOS ignored, ``max_tokens`` per prompt; ``loras[i]`` is prompt i's adapter."""
    if engine.has_unfinished_requests():
        raise RuntimeError("vLLM engine has unfinished requests that this batch did not submit")
    params = api.sampling_params(n=1, max_tokens=max_tokens, temperature=0.0, top_p=1.0,
                                 seed=None, ignore_eos=True, detokenize=False)
    requests: dict[LoraRef, Any] = {}
    ids = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        ref = loras[i] if loras is not None else None
        if ref is not None and ref not in requests:
            requests[ref] = api.lora_request(lora_name=ref.name, lora_int_id=ref.int_id,
                                             lora_path=ref.path)
        ids.append(f"native-{next(_IDS)}")
        engine.add_request(ids[-1], {"prompt_token_ids": list(prompt)}, params,
                           lora_request=None if ref is None else requests[ref])
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    seconds = time.perf_counter() - t0
    missing = [i for i in ids if i not in done]
    if missing:
        raise RuntimeError(f"vLLM finished without output for requests {missing}")
    return NativeBatch(tuple(tuple(done[i].outputs[0].token_ids) for i in ids),
                       sum(len(p) for p in prompts),
                       sum(int(done[i].num_cached_tokens or 0) for i in ids), seconds)
