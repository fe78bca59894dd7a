"""Fixtures of tests/ray: one loopback Ray cluster and one Serve application for the whole
session (Ray's start-up is the slow part), its Frontend keyed for two tenants. The tiny model
comes from tests/server's helpers, so both suites serve the same checkpoint through the same
loaders."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from server_testlib import save_model

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

# Imported after the skips: they need ray.
from ray_testlib import KEY, OTHER_KEY, STATS_PERIOD_S, Cluster  # noqa: E402

from forkserve.interfaces.ray_serve.deployments import build_application  # noqa: E402
from forkserve.interfaces.ray_serve.engine_replica import ReplicaSpec  # noqa: E402
from forkserve.interfaces.server.access import AccessConfig  # noqa: E402
from forkserve.interfaces.server.auth import ApiKeys  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks to group the tests
def pytest_collection_modifyitems(items) -> None:
    """Every test of the cluster on one xdist worker (``--dist loadgroup``): a session fixture
    is built once a worker, and Ray's start-up is the slow part of its tests."""
    for item in items:
        if "cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("ray_cluster"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    path, adapters = save_model(tmp_path_factory.mktemp("ray_model"))
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=2,
             log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = ReplicaSpec(model_path=str(path),
                       loras=tuple(sorted((k, str(v)) for k, v in adapters.items())),
                       layout="disaggregated", num_pages=512, page_size=4, device="cpu",
                       dtype="float32", attention="eager", cuda_graphs=False, torch_threads=1)
    # Half a CPU per engine: the replica Serve starts after a kill fits beside the survivor.
    # No token-rate term: at page size 4, the few dozen tokens one test just ran would weigh
    # as much as the handful of pages the next one checks affinity for (the term has its
    # unit test in test_ray_router_unit.py; live pages and fresh routes still count).
    app = build_application(spec, replicas=2, stats_period_s=STATS_PERIOD_S, num_cpus=0.5,
                            router_kwargs={"rate_horizon_s": 0.0},
                            health_check_period_s=1.0,
                            access=AccessConfig(ApiKeys({KEY: "tests", OTHER_KEY: "other"})))
    serve.run(app, name="forkserve", route_prefix="/")
    try:
        yield Cluster(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()
