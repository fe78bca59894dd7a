"""PhaseRunner: submit one PhasePlan to a vLLM engine and step it to completion.

It talks to the in-process V1 ``LLMEngine`` that ``LLM`` wraps (``llm.llm_engine``):
``add_request`` with our own request ids, then ``step()`` until nothing is unfinished —
what ``LLM.generate`` does internally, minus the id counter we could not see. Own ids let
the pinner recognise our requests when vLLM frees them. vLLM's classes come in through
``VllmApi``, so this module imports nothing from vLLM (tests pass a fake engine).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, Protocol, Sequence, TypeVar

from forkserve.backend.vllm.adapters import LoraRef
from forkserve.backend.vllm.plan import PhasePlan, RequestPlan

Handle = TypeVar("Handle")


@dataclass(frozen=True)
class VllmApi:
    """The two vLLM constructors the runner needs (``vllm.SamplingParams``,
    ``vllm.lora.request.LoRARequest``), injected so tests can pass doubles."""

    sampling_params: Callable[..., Any]
    lora_request: Callable[..., Any]


class EngineLike(Protocol):
    def add_request(self, request_id: str, prompt: Any, params: Any, *,
                    lora_request: Any = None) -> Any: ...

    def step(self) -> Sequence[Any]: ...

    def has_unfinished_requests(self) -> bool: ...

    def abort_request(self, request_ids: list[str]) -> None: ...


class Pinner(Protocol[Handle]):
    """Holds vLLM blocks of finished requests (docs/VLLM_BACKEND.md: pinning)."""

    def expect(self, request_id: str, block_indices: Sequence[int]) -> None: ...

    def take(self, request_id: str) -> Mapping[int, Handle]: ...

    def retain(self, handle: Handle) -> None: ...

    def release(self, handle: Handle) -> None: ...


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    token: int | None          # None for a write-only request
    # Tokens a decode-ahead request produced past ``token`` (max_tokens > 1), in order.
    ahead: tuple[int, ...]
    cached_tokens: int         # prompt tokens vLLM found in its prefix cache
    pins: Mapping[int, Any]    # block index -> pinner handle

    def ahead_tokens(self) -> tuple[int, ...]:
        """Every token the request returned: ``token``, then ``ahead``."""
        return () if self.token is None else (self.token, *self.ahead)


# Steps in a row that finish nothing before a phase counts as stuck. A long prefill finishes
# nothing for a few steps (chunks); a request vLLM cannot allocate waits forever, silently.
STALL_STEPS = 1000


def step_until_done(engine: EngineLike, request_ids: list[str]) -> list[Any]:
    """``step()`` until nothing is unfinished (what ``LLM.generate`` does); the finished
    outputs. A phase whose blocks vLLM's pool cannot hold (every other block pinned) would
    wait forever: after ``STALL_STEPS`` steps that finish nothing, its requests are aborted
    and this raises, so the engine stays usable and the caller sees why."""
    finished: list[Any] = []
    idle = 0
    while engine.has_unfinished_requests():
        outs = [out for out in engine.step() if out.finished]
        finished += outs
        idle = 0 if outs else idle + 1
        if idle >= STALL_STEPS:
            engine.abort_request(request_ids)
            raise RuntimeError(f"vLLM finished nothing in {STALL_STEPS} steps: its KV pool "
                               f"cannot hold these requests (blocks pinned or too few)")
    return finished


class PhaseRunner(Generic[Handle]):
    def __init__(self, engine: EngineLike, api: VllmApi, pinner: Pinner[Handle] | None) -> None:
        self.engine, self.api, self.pinner = engine, api, pinner
        self._loras: dict[LoraRef, Any] = {}

    def run(self, phase: PhasePlan) -> dict[str, RequestResult]:
        if self.engine.has_unfinished_requests():
            # A leftover request would be stepped with ours and its output lost.
            raise RuntimeError("vLLM engine has unfinished requests that ForkServe did not submit")
        plans = {r.request_id: r for r in phase.requests}
        for r in phase.requests:
            if r.pin_blocks and self.pinner is not None:
                self.pinner.expect(r.request_id, [j for j, _ in r.pin_blocks])
            self.engine.add_request(r.request_id, {"prompt_token_ids": list(r.prompt)},
                                    self._params(r), lora_request=self._lora(r.lora))
        try:
            outputs = step_until_done(self.engine, list(plans))
        except RuntimeError:
            # Aborting freed the requests through the pinner: let go what it caught.
            for request_id in plans:
                for handle in (self.pinner.take(request_id) if self.pinner else {}).values():
                    self.pinner.release(handle)
            raise
        results: dict[str, RequestResult] = {}
        for out in outputs:
            if out.request_id in plans:
                plan = plans[out.request_id]
                # Cumulative output (vLLM's default kind): every token the request produced.
                ids = tuple(out.outputs[0].token_ids)
                token = ids[0] if plan.returns_token else None
                ahead = ids[1:] if plan.returns_token else ()
                pins = self.pinner.take(plan.request_id) if self.pinner is not None else {}
                results[out.request_id] = RequestResult(out.request_id, token, ahead,
                                                        int(out.num_cached_tokens or 0), pins)
        missing = sorted(set(plans) - set(results))
        if missing:
            raise RuntimeError(f"vLLM finished without output for requests {missing}")
        return results

    def _params(self, r: RequestPlan) -> Any:
        s = r.sampling
        return self.api.sampling_params(n=1, max_tokens=s.max_tokens, temperature=s.temperature,
                                        top_p=s.top_p, seed=s.seed, ignore_eos=True,
                                        detokenize=False)

    def _lora(self, ref: LoraRef | None) -> Any:
        if ref is None:
            return None
        if ref not in self._loras:
            self._loras[ref] = self.api.lora_request(lora_name=ref.name, lora_int_id=ref.int_id,
                                                     lora_path=ref.path)
        return self._loras[ref]
