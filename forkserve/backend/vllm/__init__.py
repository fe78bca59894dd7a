"""vLLM V1 as the execution layer (L1) under the ForkServe control plane.

Everything here except ``vllm_loader`` and ``block_pinner`` is plain Python: it imports
neither vLLM nor CUDA, so the translation from the Backend protocol to vLLM requests is
unit-tested on CPU (``tests/vllm/``). ``VllmBackend`` imports vLLM only when it is built
with a model path. Design and page mapping: docs/VLLM_BACKEND.md.
"""
from forkserve.backend.vllm.adapters import AdapterTable, LoraRef
from forkserve.backend.vllm.backend import VllmBackend
from forkserve.backend.vllm.phase_runner import PhaseRunner, VllmApi
from forkserve.backend.vllm.pin_table import PinTable
from forkserve.backend.vllm.plan import PhasePlan, RequestPlan, RequestSampling, StepPlan
from forkserve.backend.vllm.planner import plan_step
from forkserve.backend.vllm.token_shadow import TokenShadow

__all__ = ["AdapterTable", "LoraRef", "PhasePlan", "PhaseRunner", "PinTable", "RequestPlan",
           "RequestSampling", "StepPlan", "TokenShadow", "VllmApi", "VllmBackend", "plan_step"]
