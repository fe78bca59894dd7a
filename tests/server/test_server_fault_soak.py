"""Failure isolation behind the server: a loopback soak where about 10% of the requests are
bad (over-long prompts, unknown models and adapters, malformed JSON, mid-stream
disconnects, a request the backend fails on) among greedy good requests. The good
requests' texts equal a run without the bad ones, no good request gets a 5xx, and no page
leaks. A request the backend fails on gets its own error while the rest of its batch runs.
"""
from __future__ import annotations

import dataclasses
import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from server_testlib import MAX_CONTEXT, MODEL_NAME, quiescent_pages, start, wait_until

from forkserve.interfaces.client import BranchAPIError, BranchClient

# A token no good request prefills (the pad token: text never encodes to it). The backend
# fails every prefill that contains it, as a request-specific backend fault would.
POISON = 0


@pytest.fixture(scope="module")
def faulty_server(tiny_model_dir):
    with start(tiny_model_dir, num_pages=1024) as server:
        def poison(engine) -> None:
            step = engine.backend.step

            def failing_step(work):
                if any(not w.decode and POISON in w.tokens for w in work):
                    raise RuntimeError("injected backend fault")
                return step(work)
            engine.backend.step = failing_step
            # Every step through the poisoned ``step``: none may take the backend's ``launch``.
            engine.backend.capabilities = dataclasses.replace(engine.backend.capabilities,
                                                              launch=False)
        server.on_engine(poison)
        yield server


@pytest.fixture(scope="module")
def http(faulty_server):
    with httpx.Client(base_url=faulty_server.url, timeout=60) as c:
        yield c


@dataclass(frozen=True)
class Req:
    name: str
    path: str
    body: dict | bytes
    stream: bool = False
    disconnect: bool = False  # leave the stream after its first event


def good_requests(n: int) -> list[Req]:
    rng = random.Random(0)
    words = ["Thought:", "Action: search", "Observation:", "the cache", "pages", "fox", "def main"]
    out = []
    for i in range(n):
        model = (MODEL_NAME, "planner", "critic")[i % 3]
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        common = {"model": model, "max_tokens": 8, "temperature": 0}
        if i % 3 == 0:
            out.append(Req(f"chat{i}", "/v1/chat/completions",
                           {**common, "messages": [{"role": "user", "content": text}]}))
        else:
            out.append(Req(f"cmpl{i}", "/v1/completions", {**common, "prompt": text},
                           stream=i % 3 == 2))
    return out


BAD = [  # (request, the status it must get)
    (Req("over-long", "/v1/completions", {"model": MODEL_NAME, "prompt": "word " * MAX_CONTEXT,
                                          "max_tokens": 4}), 400),
    (Req("unknown adapter", "/v1/chat/completions",
         {"model": "no-such-lora", "messages": [{"role": "user", "content": "hi"}]}), 404),
    (Req("unknown model", "/v1/completions", {"model": "nope", "prompt": "hi"}), 404),
    (Req("malformed JSON", "/v1/chat/completions", b'{"model": "tiny-llama", "messages": ['), 400),
    (Req("disconnect", "/v1/completions", {"model": "planner", "prompt": "The quick brown fox",
                                           "max_tokens": 300, "temperature": 0, "stream": True},
         stream=True, disconnect=True), None),
    (Req("backend fault", "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 6, POISON, 8],
                                              "max_tokens": 4}), 500),
    (Req("backend fault, streamed", "/v1/completions",
         {"model": "critic", "prompt": [9, POISON, 10], "max_tokens": 4, "stream": True},
         stream=True), 500),
]


def send(http: httpx.Client, req: Req) -> tuple[int | None, str]:
    """(status, text); a stream's status is its in-band error code when it has one."""
    if isinstance(req.body, bytes):
        r = http.post(req.path, content=req.body, headers={"content-type": "application/json"})
        return r.status_code, r.text
    if not req.stream:
        r = http.post(req.path, json=req.body)
        if r.status_code != 200:
            return r.status_code, r.text
        choice = r.json()["choices"][0]
        return 200, choice["message"]["content"] if "message" in choice else choice["text"]
    text = []
    with http.stream("POST", req.path, json={**req.body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return event["error"]["code"], event["error"]["message"]
            if req.disconnect:
                return None, ""  # closing the connection mid-stream
            text += [c.get("text") or (c.get("delta") or {}).get("content") or ""
                     for c in event["choices"]]
    return 200, "".join(text)


def run(http: httpx.Client, reqs: list[Req]) -> dict[str, tuple[int | None, str]]:
    with ThreadPoolExecutor(8) as pool:
        return dict(zip([r.name for r in reqs], pool.map(lambda r: send(http, r), reqs),
                        strict=True))


def settled(server) -> tuple[int, int, int]:
    """Once every session ended: (pages used, published, used after evict_all); integrity
    checked."""
    wait_until(lambda: quiescent_pages(server)[0] == 0)

    def audit(e):
        e.check_integrity()
        used, published = e.pool.num_used, e.index.num_pages
        e.evict_all()
        e.check_integrity()
        return used, published, e.pool.num_used
    return server.on_engine(audit)


def test_bad_requests_change_no_good_answer_and_leak_nothing(faulty_server, http):
    good = good_requests(45)
    free_before = faulty_server.on_engine(lambda e: e.pool.num_free)
    baseline = run(http, good)
    assert all(status == 200 for status, _ in baseline.values()), baseline
    mixed = good + [req for req, _ in BAD]
    random.Random(1).shuffle(mixed)
    results = run(http, mixed)
    assert {name: results[name] for name in baseline} == baseline  # 200 and the same greedy text
    for req, status in BAD:
        assert results[req.name][0] == status, (req.name, results[req.name])
    used, published, after_evict = settled(faulty_server)
    assert used == published and after_evict == 0
    assert faulty_server.on_engine(lambda e: e.pool.num_free) == free_before


def test_a_branch_generation_the_backend_fails_ends_alone_and_keeps_the_session(faulty_server,
                                                                                http):
    poisoned = http.post("/v1/sessions",
                         json={"model": MODEL_NAME, "tokens": [7, POISON, 9]}).json()
    healthy = http.post("/v1/sessions", json={"model": MODEL_NAME, "tokens": [7, 8, 9]}).json()
    body = {"max_tokens": 4, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        bad, good = pool.map(lambda s: http.post(f"/v1/sessions/{s['session_id']}/generate",
                                                 json=body),
                             (poisoned, healthy))
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "BackendError", bad.text
    assert good.status_code == 200 and len(good.json()["tokens"]) == 4
    with http.stream("POST", f"/v1/sessions/{poisoned['session_id']}/generate",
                     json={**body, "stream": True}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1]["error"]["code"] == 500, lines
    with BranchClient(faulty_server.url) as client, pytest.raises(BranchAPIError) as e:
        list(client.stream(poisoned["session_id"], 4, ignore_eos=True))
    assert e.value.status == 500 and e.value.type == "BackendError"
    # The failed session is still there (a branch session outlives a failed verb) and closes.
    for s in (poisoned, healthy):
        assert http.delete(f"/v1/sessions/{s['session_id']}").status_code == 200
    used, published, after_evict = settled(faulty_server)
    assert used == published and after_evict == 0
