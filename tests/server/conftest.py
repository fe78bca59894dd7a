"""Fixtures of tests/server (helpers live in server_testlib.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from server_testlib import save_model, start

from forkserve.interfaces.server.launcher import RunningServer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    return save_model(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> RunningServer:
    with start(tiny_model_dir) as running:
        yield running
