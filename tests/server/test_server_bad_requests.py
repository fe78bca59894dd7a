"""Bad requests get a 4xx with an OpenAI-style JSON error body and change no engine state."""
from __future__ import annotations

import httpx
import pytest
from server_testlib import MAX_CONTEXT, MODEL_NAME


def engine_state(server):
    def snap(e):
        trees = {sid: (s.tree.tip.id, len(s.tree.nodes), len(s.tree.committed))
                 for sid, s in e.sessions.items()}
        m = e.metrics.snapshot()
        m.pop("peak_pages")
        return trees, e.pool.num_used, e.index.num_pages, m
    return server.on_engine(snap)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def live_session(http):
    """A session with one aborted branch, present while the bad requests arrive."""
    s = http.post("/v1/sessions", json={"model": MODEL_NAME, "tokens": [5, 6, 7, 8, 9]}).json()
    sid, tip = s["session_id"], s["tip"]
    node = http.post(f"/v1/sessions/{sid}/fork",
                     json={"parent": tip, "tokens": [10, 11]}).json()["node"]
    http.post(f"/v1/sessions/{sid}/abort", json={"node": node}).raise_for_status()
    return sid, tip, node


LONG = "word " * MAX_CONTEXT

CASES = [
    ("unknown model", "POST", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404),
    ("unknown adapter", "POST", "/v1/chat/completions",
     {"model": "no-such-lora", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("negative max_tokens", "POST", "/v1/completions",
     {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}, 400),
    ("prompt too long", "POST", "/v1/completions",
     {"model": MODEL_NAME, "prompt": LONG, "max_tokens": 4}, 400),
    ("prompt + max_tokens too long", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
      "max_tokens": MAX_CONTEXT}, 400),
    ("token out of vocabulary", "POST", "/v1/completions",
     {"model": MODEL_NAME, "prompt": [1, 10 ** 6]}, 400),
    ("empty messages", "POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400),
    ("bad temperature", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ("echo with more than 20 logprobs", "POST", "/v1/completions",
     {"model": MODEL_NAME, "prompt": "x", "logprobs": 21, "echo": True}, 400),
    ("unimplemented field", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
      "reasoning_effort": "low"}, 400),
    ("unimplemented message field", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]},
     400),
    ("tool message without tool_call_id", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "tool", "content": "4"}]}, 400),
    ("named tool_choice not in tools", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400),
    ("a tool schema the grammar cannot enforce", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": "required",
      "tools": [{"type": "function",
                 "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]}, 400),
    ("logit_bias out of vocabulary", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
      "logit_bias": {"1000000": 5}}, 400),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("open: unknown model", "POST", "/v1/sessions", {"model": "nope", "text": "hi"}, 404),
    ("open: two prompts", "POST", "/v1/sessions", {"model": MODEL_NAME, "text": "a", "tokens": [1]},
     400),
    ("open: prompt too long", "POST", "/v1/sessions", {"model": MODEL_NAME, "text": LONG}, 400),
    ("open: token out of vocabulary", "POST", "/v1/sessions",
     {"model": MODEL_NAME, "tokens": [1, 10 ** 6]}, 400),
    ("unknown session", "POST", "/v1/sessions/999999/fork", {"parent": 1, "tokens": [1]}, 404),
    ("negative generate budget", "POST", "/v1/sessions/{sid}/generate", {"max_tokens": -3}, 400),
    ("generate past the context", "POST", "/v1/sessions/{sid}/generate",
     {"max_tokens": MAX_CONTEXT}, 400),
    ("unknown node", "POST", "/v1/sessions/{sid}/fork", {"parent": 10 ** 6, "tokens": [1]}, 404),
    ("fork of an aborted branch", "POST", "/v1/sessions/{sid}/fork",
     {"parent": "{node}", "tokens": [1]}, 409),
    ("commit of an aborted branch", "POST", "/v1/sessions/{sid}/commit",
     {"tip": "{node}", "tokens": [1]}, 409),
    ("commit of empty tokens", "POST", "/v1/sessions/{sid}/commit", {"tip": "{tip}", "tokens": []},
     400),
    ("speculate priority > 1", "POST", "/v1/sessions/{sid}/speculate",
     {"node": "{node}", "priority": 2}, 400),
    ("abort of the committed tip", "POST", "/v1/sessions/{sid}/abort", {"node": "{tip}"}, 409),
    ("join of nothing", "POST", "/v1/sessions/{sid}/join", {"nodes": []}, 400),
    ("unknown route", "GET", "/v1/nothing", None, 404),
]


def _fill(value, ids):
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if (isinstance(value, str) and value.startswith("{") and value.endswith("}")
            and value[1:-1] in ids):
        return ids[value[1:-1]]
    return value


@pytest.mark.parametrize("name,method,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_a_4xx_json_error_and_changes_nothing(server, http, live_session, name,
                                                             method, path, body, status):
    sid, tip, node = live_session
    ids = {"sid": sid, "tip": tip, "node": node}
    before = engine_state(server)
    r = http.request(method, path.format(sid=sid), json=_fill(body, ids))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == status
    assert engine_state(server) == before
    assert server.state.worker.waiting_sessions() == 0  # nor the admission queue


@pytest.mark.parametrize("body,message", [(b'{"model": "x", "messages": [', "is not valid JSON"),
                                          (b"\xff not json", "is not valid JSON"),
                                          (b"[1, 2]", "must be a JSON object"),
                                          (b"", "is missing")])
def test_malformed_json_is_a_400_that_says_so(server, http, body, message):
    before = engine_state(server)
    for path in ("/v1/chat/completions", "/v1/sessions", "/v1/sessions/1/commit"):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (message in err["message"] and err["param"] is None
                and err["type"] == "BadRequestError"), err
    assert engine_state(server) == before
