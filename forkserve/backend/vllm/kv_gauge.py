"""KvGauge: the most vLLM KV blocks referenced at once. GPU only; vLLM 0.26 internals.

A request that asks for one token finishes in the step that prefills it, so its blocks are
back in the pool before ``step()`` returns: polling between steps reads zero. The gauge
therefore reads the pool where the scheduler lets a finished request go
(``kv_cache_manager.free``, the same hook the pinner wraps): at that moment every block of
the step is still referenced (a lockstep batch peaks there too: its first finish).
Referenced means ``ref_cnt > 0`` (running requests and pins); cached blocks nobody
references are evictable and read as free, as vLLM counts them.
"""
from __future__ import annotations

from typing import Any


class KvGauge:
    def __init__(self, kv_cache_manager: Any) -> None:
        self._pool = kv_cache_manager.block_pool
        self.peak_blocks = 0
        free = kv_cache_manager.free

        def free_and_read(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.read()
            return free(request, *args, **kwargs)

        kv_cache_manager.free = free_and_read

    @classmethod
    def attach(cls, llm_engine: Any) -> KvGauge:
        """On an in-process ``LLMEngine`` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
        return cls(llm_engine.engine_core.engine_core.scheduler.kv_cache_manager)

    def used_blocks(self) -> int:
        # The pool's null block is always counted as used and never holds KV.
        return self._pool.num_gpu_blocks - self._pool.get_num_free_blocks() - 1

    def read(self) -> int:
        used = self.used_blocks()
        self.peak_blocks = max(self.peak_blocks, used)
        return used

    def reset(self) -> None:
        """Start a new measurement from what is referenced now (pins held over)."""
        self.peak_blocks = self.used_blocks()
