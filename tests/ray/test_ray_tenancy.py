"""The Ray Serve Frontend enforces the one-process server's access rules: API keys on every
route but /health, sessions owned by their tenant (404 alike for unknown and not-yours),
validated cache salts. One engine replica with keys, on loopback."""
from __future__ import annotations

import re
import secrets
import socket
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from server_testlib import save_model

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from forkserve.interfaces.client import BranchAPIError, BranchClient
from forkserve.interfaces.ray_serve.deployments import build_application
from forkserve.interfaces.ray_serve.engine_replica import ReplicaSpec
from forkserve.interfaces.server.access import AccessConfig
from forkserve.interfaces.server.auth import ApiKeys

MODEL = "tiny-llama"
KEY_A, KEY_B = "sk-ray-alice", "sk-ray-bob"


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    path, _ = save_model(tmp_path_factory.mktemp("ray_tenancy_model"))
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=2,
             log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = ReplicaSpec(model_path=str(path), num_pages=256, page_size=4, device="cpu", dtype="float32",
                       attention="eager", cuda_graphs=False, torch_threads=1)
    access = AccessConfig(ApiKeys({KEY_A: "alice", KEY_B: "bob"}))
    serve.run(build_application(spec, replicas=1, num_cpus=0.5, access=access), name="forkserve", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_keys_are_required_on_every_route_but_health(url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/sessions", {"model": MODEL, "text": "hi"}),
                               ("GET", "/v1/sessions/x", None), ("POST", "/v1/chat/completions", chat),
                               ("POST", "/v1/drain", None)]:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            r = httpx.request(method, url + path, headers=headers, json=body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", (path, r.text)
    assert httpx.get(url + "/health").status_code == 200


def test_sessions_belong_to_their_tenant(url):
    with BranchClient(url, api_key=KEY_A) as a, BranchClient(url, api_key=KEY_B) as b:
        s = a.open(MODEL, tokens=[5, 6, 7, 8, 9])
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", s.session_id)
        assert [x.session_id for x in a.sessions()] == [s.session_id] and b.sessions() == []
        nowhere = secrets.token_urlsafe(16)
        for verb in (lambda sid: b.info(sid), lambda sid: b.commit(sid, s.tip, tokens=[1]),
                     lambda sid: b.generate(sid, 2), lambda sid: b.close(sid)):
            answers = []
            for sid in (s.session_id, nowhere):
                with pytest.raises(BranchAPIError) as e:
                    verb(sid)
                answers.append((e.value.status, e.value.message.replace(sid, "ID")))
            assert answers[0] == answers[1] and answers[0][0] == 404
        c = a.commit(s.session_id, s.tip, tokens=[10, 11])
        assert c.session_id == s.session_id
        assert a.close(s.session_id).committed_tokens == 7


@pytest.mark.parametrize("salt", ["", "x" * 10_240, "a\x00b", "public:undeclared"])
def test_bad_cache_salt_is_a_400(url, salt):
    r = httpx.post(url + "/v1/sessions", json={"model": MODEL, "tokens": [5, 6], "cache_salt": salt},
                   headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
