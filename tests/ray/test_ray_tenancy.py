"""The Ray Serve Frontend enforces the one-process server's access rules: API keys on every
route but /health, sessions owned by their tenant (404 alike for unknown and not-yours),
validated cache salts. The session's cluster (conftest.py), keyed for two tenants."""
from __future__ import annotations

import re
import secrets

import httpx
import pytest
from ray_testlib import KEY, OTHER_KEY, Cluster

from forkserve.interfaces.client import BranchAPIError, BranchClient

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def url(cluster: Cluster) -> str:
    return cluster.url


def test_keys_are_required_on_every_route_but_health(url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for method, path, body in [("GET", "/v1/models", None),
                               ("POST", "/v1/sessions", {"model": MODEL, "text": "hi"}),
                               ("GET", "/v1/sessions/x", None),
                               ("POST", "/v1/chat/completions", chat), ("POST", "/v1/drain", None)]:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            r = httpx.request(method, url + path, headers=headers, json=body)
            assert (r.status_code == 401
                    and r.json()["error"]["type"] == "AuthenticationError"), (path, r.text)
    assert httpx.get(url + "/health").status_code == 200


def test_sessions_belong_to_their_tenant(url):
    # A: a tenant no other test uses; B: the one test_ray_routing.py drives.
    with BranchClient(url, api_key=OTHER_KEY) as a, BranchClient(url, api_key=KEY) as b:
        s = a.open(MODEL, tokens=[5, 6, 7, 8, 9])
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", s.session_id)
        assert [x.session_id for x in a.sessions()] == [s.session_id]
        assert s.session_id not in [x.session_id for x in b.sessions()]
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
    r = httpx.post(url + "/v1/sessions",
                   json={"model": MODEL, "tokens": [5, 6], "cache_salt": salt},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
