"""The branch client against a live server: every verb, streaming, and disconnects."""
from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_testlib import MODEL_NAME, quiescent_pages, wait_until

from forkserve.interfaces.client import BranchAPIError, BranchClient


@pytest.fixture(scope="module")
def client(server) -> BranchClient:
    with BranchClient(server.url) as c:
        yield c


def test_agent_step_binds_the_known_wrapper_and_prefills_only_the_tail(server, client):
    s = client.open(MODEL_NAME, messages=[{"role": "user", "content": "List the files."}])
    wrapper, guess = [40, 41, 42, 43, 44], [40, 41, 90, 91]
    happy = client.fork(s.session_id, s.tip, tokens=wrapper, label="wrapper")
    err = client.fork(s.session_id, s.tip, tokens=guess, label="error")
    assert client.speculate(s.session_id, happy, priority=1.0,
                            t_idle_ms=500).action in ("prefill", "hash_partial")
    client.speculate(s.session_id, err, priority=0.2)
    client.drain()
    observation = wrapper + [50, 51, 52]
    c = client.commit(s.session_id, s.tip, tokens=observation)
    assert c.bound_node == happy and c.matched_tokens == len(wrapper)
    assert c.prefilled_tokens == 3 and err in c.aborted
    out = client.generate(s.session_id, 5, ignore_eos=True)
    assert len(out.tokens) == 5 and out.tip == c.tip
    assert client.info(s.session_id).committed_tokens == s.committed_tokens + len(observation) + 5
    client.close(s.session_id)
    sessions, used, published = quiescent_pages(server)
    assert sessions == 0 and used == published


def test_branch_generate_equals_the_openai_completion(server, client):
    prompt = [7, 8, 9, 10, 11, 12, 13]
    s = client.open(MODEL_NAME, tokens=prompt)
    ours = client.generate(s.session_id, 8, ignore_eos=True)
    client.close(s.session_id)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    theirs = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    if theirs.choices[0].finish_reason == "length":  # greedy: same tokens unless EOS came first
        assert ours.text == theirs.choices[0].text


def test_concurrent_generations_share_decode_steps(server, client):
    sessions = [client.open(MODEL_NAME, tokens=[40 + i, 41, 42]) for i in range(4)]
    ticks_before = server.on_engine(lambda e: e.metrics.ticks)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda s: client.generate(s.session_id, 48, ignore_eos=True),
                             sessions))
    ticks = server.on_engine(lambda e: e.metrics.ticks) - ticks_before
    assert all(len(o.tokens) == 48 for o in outs)
    assert ticks < 0.75 * 4 * 48  # one tick decodes every generating session: batched, not in turns
    for s in sessions:
        client.close(s.session_id)


def test_join_commits_branches_one_after_another(client):
    s = client.open("critic", text="Plan:")
    a = client.fork(s.session_id, s.tip, text=" step one")
    b = client.fork(s.session_id, s.tip, text=" step two")
    for n in (a, b):
        client.speculate(s.session_id, n, priority=0.5)
    c = client.join(s.session_id, [a, b], separator_text="\n")
    info = client.info(s.session_id)
    assert (info.tip == c.tip and info.committed_tokens > s.committed_tokens + 4
            and info.model == "critic")
    client.close(s.session_id)


def test_abort_one_branch_then_commit_of_it_is_refused(client):
    s = client.open(MODEL_NAME, text="Thought:")
    n = client.fork(s.session_id, s.tip, text=" maybe")
    r = client.abort(s.session_id, n)
    assert n in r.released_nodes
    with pytest.raises(BranchAPIError) as e:
        client.commit(s.session_id, n, text="x")
    assert e.value.status == 409
    client.close(s.session_id)


def test_streamed_generation_matches_and_early_exit_aborts_the_session(server, client):
    s = client.open(MODEL_NAME, tokens=[20, 21, 22])
    chunks = list(client.stream(s.session_id, 6, ignore_eos=True))
    assert chunks[-1].finish_reason == "length" and sum(len(c.tokens) for c in chunks) == 6
    # Leave the stream after the first chunk: the connection closes mid-generation.
    for _ in client.stream(s.session_id, 300, ignore_eos=True):
        break
    wait_until(lambda: quiescent_pages(server)[0] == 0)
    with pytest.raises(BranchAPIError) as e:
        client.info(s.session_id)
    assert e.value.status == 404
    _, used, published = quiescent_pages(server)
    assert used == published


def test_openai_stream_disconnect_frees_the_pages(server):
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 300,
            "temperature": 0, "stream": True}
    before = server.on_engine(lambda e: e.metrics.decode_tokens)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    wait_until(lambda: quiescent_pages(server)[0] == 0)
    _, used, published = quiescent_pages(server)
    assert used == published
    assert server.on_engine(lambda e: e.metrics.decode_tokens) - before < 300


def test_non_streamed_request_of_a_vanished_client_is_aborted(server):
    # The client leaves once all 16 choices are decoding (an event, not a fixed delay).
    body = json.dumps({"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 300,
                       "temperature": 0, "n": 16}).encode()
    before = server.on_engine(lambda e: e.metrics.decode_tokens)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"content-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: server.on_engine(lambda e: sum(s.decode_left > 0
                                                          for s in e.sessions.values())) == 16)
    wait_until(lambda: quiescent_pages(server)[0] == 0)
    _, used, published = quiescent_pages(server)
    assert used == published
    assert server.on_engine(lambda e: e.metrics.decode_tokens) - before < 16 * 300
    with httpx.Client(base_url=server.url) as http:
        wait_until(lambda: 'forkserve_http_requests_total{route="/v1/completions",status="499"}'
                   in http.get("/metrics").text)


def test_a_generating_session_refuses_other_verbs(client):
    s = client.open(MODEL_NAME, tokens=[30, 31, 32])
    stream = client.stream(s.session_id, 200, ignore_eos=True)
    next(stream)
    with pytest.raises(BranchAPIError) as e:
        client.fork(s.session_id, s.tip, tokens=[1])
    assert e.value.status == 409
    stream.close()


def test_metrics_expose_pools_actions_and_throughput(client):
    """The series a dashboard reads, after one request of this test's own (the module's
    other tests may run elsewhere, or after it): every cascade action's counter is there
    from the start, at 0 until that action happens."""
    s = client.open(MODEL_NAME, tokens=[30, 31, 32])
    client.close(s.session_id)
    text = client.metrics()
    for name in ("forkserve_pages_used{pool=\"unified\"}",
                 "forkserve_prefix_index_pages{tree=\"base\"}",
                 "forkserve_speculative_residuals_total{action=",
                 "forkserve_decode_tokens_per_second",
                 "forkserve_queue_depth", "forkserve_http_requests_total{route=\"/v1/sessions\"",
                 "forkserve_prefix_hit_ratio{tree=\"base\"}",
                 "forkserve_prefix_hit_tokens_total{tree=\"all\"}"):
        assert name in text, name


def test_the_client_shows_which_replica_served_it():
    import httpx

    from forkserve.interfaces.client import REPLICA_HEADER, BranchClient

    def handler(request: httpx.Request) -> httpx.Response:
        body = {"ticks": 0, "prefill_tokens": 0, "decode_tokens": 0, "slack_filled_tokens": 0}
        return httpx.Response(200, json=body, headers={REPLICA_HEADER: "replica-1"})

    http = httpx.Client(base_url="http://frontend", transport=httpx.MockTransport(handler))
    client = BranchClient("http://frontend", http=http)
    assert client.last_replica is None
    client.drain()
    assert client.last_replica == "replica-1"
