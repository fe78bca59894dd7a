"""KvManagerPinner: hold vLLM KV blocks past their request's end. GPU only; vLLM internals.

vLLM's public API cannot pin a block. In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the
scheduler's ``KVCacheManager`` lives in this process, so the pinner wraps its ``free``: when
a request we marked with ``expect`` finishes, the blocks at the expected indices get one
extra reference (``block_pool.touch``) before vLLM drops the request's own. A block with a
reference is never evicted; vLLM's prefix cache still finds it by hash, so a later request
whose prompt covers the same tokens (same LoRA) reuses it. ``release`` returns the reference
(``block_pool.free_blocks``): the block becomes an ordinary evictable cache entry.

Checked against vLLM 0.26.0's source: ``Scheduler._free_request_blocks`` calls
``kv_cache_manager.free(request)`` for a normal finish (it defers through
``pop_blocks_for_free`` only with a KV connector, which VllmBackend never configures);
``get_blocks(request_id).blocks`` is one block list per KV-cache group; ``block_pool.touch``
and ``free_blocks`` take block sequences; ``KVCacheBlock.block_hash`` / ``ref_cnt``. The
scheduler's ``Request`` carries vLLM's internal id, ``f"{our_id}-{8 hex}"``
(``InputProcessor.assign_request_id``), so the pinner maps it back. ``attach`` checks that
surface and fails with the attribute it missed. Without it, pass ``cow_blocks=False`` (plain
LRU prefix cache).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

Blocks = tuple  # one vLLM KVCacheBlock per KV-cache group, for one block index


def external_id(internal_id: str) -> str:
    """The id we passed to ``add_request``: vLLM 0.26 appends ``-`` and 8 hex digits."""
    head, sep, tail = internal_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return head
    return internal_id


class KvManagerPinner:
    def __init__(self, kv_cache_manager: Any) -> None:
        self._kvm = kv_cache_manager
        self._pool = kv_cache_manager.block_pool
        self._expected: dict[str, tuple[int, ...]] = {}
        self._taken: dict[str, dict[int, Blocks]] = {}
        free = kv_cache_manager.free

        def free_and_capture(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._capture(request)
            return free(request, *args, **kwargs)

        kv_cache_manager.free = free_and_capture

    @classmethod
    def attach(cls, llm_engine: Any) -> KvManagerPinner:
        """Find the scheduler's KV manager behind an in-process ``LLMEngine``."""
        path = ("engine_core", "engine_core", "scheduler", "kv_cache_manager")
        obj = llm_engine
        for i, name in enumerate(path):
            if not hasattr(obj, name):
                raise RuntimeError(
                    f"cow_blocks needs vLLM's KV manager in this process: llm_engine."
                    f"{'.'.join(path[:i + 1])} is missing (set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                    f"before importing vLLM, or pass cow_blocks=False)")
            obj = getattr(obj, name)
        for name in ("free", "get_blocks", "block_pool"):
            if not hasattr(obj, name):
                raise RuntimeError(f"cow_blocks: vLLM's KVCacheManager has no {name!r} in this "
                                   f"version; pass cow_blocks=False")
        for name in ("touch", "free_blocks"):
            if not hasattr(obj.block_pool, name):
                raise RuntimeError(f"cow_blocks: vLLM's BlockPool has no {name!r} in this "
                                   f"version; pass cow_blocks=False")
        return cls(obj)

    def expect(self, request_id: str, block_indices: Sequence[int]) -> None:
        self._expected[request_id] = tuple(block_indices)

    def take(self, request_id: str) -> Mapping[int, Blocks]:
        self._expected.pop(request_id, None)
        return self._taken.pop(request_id, {})

    def retain(self, handle: Blocks) -> None:
        self._pool.touch(list(handle))

    def release(self, handle: Blocks) -> None:
        self._pool.free_blocks(list(handle))

    def _capture(self, request: Any) -> None:
        rid = request.request_id
        if rid not in self._expected:
            rid = external_id(rid)
        indices = self._expected.pop(rid, None)
        if not indices:
            return
        groups = self._kvm.get_blocks(request.request_id).blocks
        taken: dict[int, Blocks] = {}
        for j in indices:
            blocks = tuple(group[j] for group in groups if j < len(group))
            # Only a full, hashed block can be found again by a later prompt.
            if len(blocks) == len(groups) and all(getattr(b, "block_hash", None) is not None
                                                  for b in blocks):
                self._pool.touch(list(blocks))
                taken[j] = blocks
        self._taken[rid] = taken
