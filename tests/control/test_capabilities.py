"""Optional backend features are declared as data (``Capabilities``): each backend's flags
name methods it has, and the Engine acts on the flags, never on which methods exist."""
from __future__ import annotations

import dataclasses

import pytest

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.capabilities import METHODS, Capabilities
from forkserve.backend.mock import MockBackend
from forkserve.backend.vllm.backend import VllmBackend
from forkserve.errors import InvalidRequestError


def test_every_flag_names_the_methods_it_promises():
    assert set(METHODS) == {f.name for f in dataclasses.fields(Capabilities)}


@pytest.mark.parametrize("backend", [MockBackend(ForkServeConfig(kv_layout=KVLayout.ADAPTIVE)),
                                     VllmBackend], ids=["mock", "vllm"])
def test_a_backend_keeps_the_promises_of_its_flags(backend):
    assert backend.capabilities.missing(backend) == ()


def test_a_flag_without_its_methods_is_refused_at_the_engine():
    class Overclaims(MockBackend):
        capabilities = dataclasses.replace(MockBackend.capabilities, resolve_adapter=True)

    with pytest.raises(TypeError, match="resolve_adapter"):
        Engine(Overclaims())


def test_the_engine_reads_the_flags_not_the_methods():
    """The mock has ``remove_adapter``, ``adapter_version`` and ``first_unwritten``; declared
    absent, the Engine calls none of them."""
    class Quiet(MockBackend):
        capabilities = dataclasses.replace(MockBackend.capabilities, remove_adapter=False,
                                           adapter_versions=False, written_positions=False)

        def first_unwritten(self, kind, pages, length):
            raise AssertionError("first_unwritten was called")

    backend = Quiet(ForkServeConfig(page_size=4, kv_layout=KVLayout.DISAGGREGATED,
                                    vocab_size=300), adapters=["a"])
    eng = Engine(backend)
    tokens = list(range(1, 10))
    h = eng.open(tokens, adapter="a")
    eng.generate(h.id, 2)
    eng.close(h.id)
    backend.reload_adapter("a")  # versions unread: the old pages still match
    again = eng.open(tokens, adapter="a")
    assert eng.node(again.id, again.tip).table.residual.length == 8
    eng.check_integrity()
    eng.close(again.id)
    with pytest.raises(InvalidRequestError, match="cannot unload"):
        eng.remove_adapter("a")
    assert backend.knows_adapter("a")
