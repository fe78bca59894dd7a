"""KvManagerPinner over a double of vLLM 0.26's KVCacheManager surface (CPU).

The double has exactly what the pinner reads in 0.26.0 (block_pinner.py's docstring):
``free(request)``, ``get_blocks(internal_id).blocks`` (one list per KV-cache group),
``block_pool.touch`` / ``free_blocks``, blocks with ``ref_cnt`` and ``block_hash``, and
internal request ids suffixed the way ``InputProcessor.assign_request_id`` does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from forkserve.backend.vllm.block_pinner import KvManagerPinner, external_id


@dataclass(eq=False)
class Block:
    block_hash: object
    ref_cnt: int = 0


class Pool:
    def touch(self, blocks):
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        for b in blocks:
            assert b.ref_cnt > 0
            b.ref_cnt -= 1


@dataclass
class KvManager:
    block_pool: Pool = field(default_factory=Pool)
    held: dict = field(default_factory=dict)  # internal id -> per-group block lists
    freed: list = field(default_factory=list)

    def allocate(self, internal_id: str, groups: list[list[Block]]) -> SimpleNamespace:
        for group in groups:
            self.block_pool.touch(group)
        self.held[internal_id] = groups
        return SimpleNamespace(request_id=internal_id)

    def get_blocks(self, internal_id: str) -> SimpleNamespace:
        return SimpleNamespace(blocks=tuple(self.held[internal_id]))

    def free(self, request) -> None:
        for group in self.held.pop(request.request_id):
            self.block_pool.free_blocks(reversed(group))
        self.freed.append(request.request_id)


def test_external_id_strips_vllms_suffix_only():
    assert external_id("fs-12-3-0a1b2c3d") == "fs-12-3"
    assert external_id("fs-12-3") == "fs-12-3"
    assert external_id("fs-12-3-xyz") == "fs-12-3-xyz"


def test_expected_full_hashed_blocks_outlive_their_request():
    kvm = KvManager()
    pinner = KvManagerPinner(kvm)
    blocks = [Block(("h", i)) for i in range(3)] + [Block(None)]  # the last one is partial
    request = kvm.allocate("fs-0-7-deadbeef", [blocks])
    pinner.expect("fs-0-7", [0, 2, 3])
    kvm.free(request)  # what Scheduler._free_request_blocks calls at finish
    assert kvm.freed == ["fs-0-7-deadbeef"]
    taken = pinner.take("fs-0-7")
    assert set(taken) == {0, 2}  # the unhashed block cannot be found again: not held
    assert [b.ref_cnt for b in blocks] == [1, 0, 1, 0]
    pinner.retain(taken[0])
    pinner.release(taken[0])
    pinner.release(taken[0])
    pinner.release(taken[2])
    assert [b.ref_cnt for b in blocks] == [0, 0, 0, 0]
    with pytest.raises(AssertionError):
        pinner.release(taken[2])


def test_requests_not_expected_are_left_alone():
    kvm = KvManager()
    pinner = KvManagerPinner(kvm)
    blocks = [Block(("h", 0))]
    kvm.free(kvm.allocate("other-0a1b2c3d", [blocks]))
    assert pinner.take("other") == {} and blocks[0].ref_cnt == 0


def test_attach_names_what_is_missing():
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(free=None, block_pool=Pool())))))
    with pytest.raises(RuntimeError, match="get_blocks"):
        KvManagerPinner.attach(engine)
    with pytest.raises(RuntimeError, match="engine_core.engine_core"):
        KvManagerPinner.attach(SimpleNamespace(engine_core=SimpleNamespace()))
