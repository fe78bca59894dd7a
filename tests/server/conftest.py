"""Fixtures of tests/server (helpers live in server_testlib.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from server_testlib import DEMO_NAME, save_model, start

from forkserve.backend.torch.tokenizer import Tokenizer
from forkserve.interfaces.server.grammar import GrammarCompiler
from forkserve.interfaces.server.launcher import RunningServer


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks to group the tests
def pytest_collection_modifyitems(items) -> None:
    """Every test of the demo server on one xdist worker (``--dist loadgroup``): a session
    fixture is built once a worker, and loading SmolLM2 is the slow part of its tests."""
    for item in items:
        if "demo_server" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("demo_server"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    return save_model(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> RunningServer:
    with start(tiny_model_dir) as running:
        yield running


@pytest.fixture(scope="session")
def demo_server() -> RunningServer:
    """The demo model (SmolLM2-135M-Instruct, CPU) served once for every test that needs a real
    model's tokenizer and template (the agent-framework acceptance tests)."""
    from forkserve.backend.torch import find_smollm2_gguf
    from forkserve.config import app_config
    from forkserve.interfaces.server.launcher import serve_in_thread
    from forkserve.interfaces.server.served_model import load_served_model

    try:
        gguf = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"the demo model package is not installed: {exc}")
    model = load_served_model(gguf, config=app_config(num_pages=1024), device="cpu",
                              dtype="float32", attention="eager", name=DEMO_NAME)
    with serve_in_thread(model) as running:
        yield running


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir) -> Tokenizer:
    """The tiny model's tokenizer (the grammar, tool-format and legality unit tests)."""
    return Tokenizer.load(tiny_model_dir[0])


@pytest.fixture(scope="session")
def grammars(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, len(tokenizer.hf), tokenizer.eos_token_ids)
