"""Two tenants on one loopback server: API keys, sessions owned by their caller, the prefix
cache isolated per tenant and salt (shared only under a declared public prefix), salt
validation, and the timing side channel."""
from __future__ import annotations

import re
import secrets
import statistics
import time

import httpx
import openai
import pytest
from server_testlib import MODEL_NAME, start

from forkserve.interfaces.client import BranchAPIError, BranchClient
from forkserve.interfaces.server.access import AccessConfig
from forkserve.interfaces.server.auth import ApiKeys

KEY_A, KEY_B = "sk-alice-" + "a" * 24, "sk-bob-" + "b" * 24
# only the harness example uses it: A's and B's caches stay as the tests expect
KEY_C = "sk-carol-" + "c" * 24
PAGE = 4  # server_testlib's page size


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    access = AccessConfig(ApiKeys({KEY_A: "alice", KEY_B: "bob", KEY_C: "carol"}),
                          public_prefixes=frozenset({"sys"}))
    with start(tiny_model_dir, access=access) as running:
        yield running


@pytest.fixture(scope="module")
def a(server):
    with BranchClient(server.url, api_key=KEY_A) as c:
        yield c


@pytest.fixture(scope="module")
def b(server):
    with BranchClient(server.url, api_key=KEY_B) as c:
        yield c


def oai(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def engine_state(server) -> tuple:
    return server.on_engine(lambda e: (len(e.sessions), e.pool.num_used, e.index.num_pages,
                                       e.metrics.prefill_tokens))


# ------------------------------------------------------------------------------ auth
@pytest.mark.parametrize("headers",
                         [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY_A},
                                     {"Authorization": f"Basic {KEY_A}"}])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                         ("POST", "/v1/sessions"), ("GET", "/v1/sessions/x"),
                                         ("GET", "/metrics"), ("POST", "/v1/drain")])
def test_every_route_but_health_needs_a_key(server, headers, method, path):
    r = httpx.request(method, server.url + path, headers=headers, json={})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == 401 and err["type"] == "AuthenticationError" and err["message"]


def test_health_is_open_and_a_good_key_passes(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/v1/models",
                     headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        oai(server, "sk-nope").models.list()


def test_key_comparison_is_constant_time_and_maps_keys_to_tenants(tmp_path):
    keys = ApiKeys({"k1": "t", "k2": "t", "k3": "u"})
    assert ([keys.tenant_of(k) for k in ("k1", "k2", "k3", "k4", "", "k1 ")]
            == ["t", "t", "u", None, None, None])
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-1 app\n\nsk-2 app\nsk-3 other\n")
    assert ApiKeys.load(f).tenants == {"sk-1": "app", "sk-2": "app", "sk-3": "other"}
    assert ApiKeys.of_keys(["x", "y"]).tenants == {"x": "key-1", "y": "key-2"}


# ------------------------------------------------------------------------------ ownership
def test_session_ids_are_opaque_and_unguessable(a):
    ids = [a.open(MODEL_NAME, tokens=[5, 6, 7]).session_id for _ in range(3)]
    for sid in ids:
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", sid)  # 128 random bits, URL-safe
        a.close(sid)
    assert len(set(ids)) == 3


def test_another_tenant_cannot_touch_a_session_and_learns_nothing(server, a, b):
    s = a.open(MODEL_NAME, text="my secret: the launch code is 0000")
    node = a.fork(s.session_id, s.tip, tokens=[9, 10, 11])
    before = (a.info(s.session_id), engine_state(server))
    assert [x.session_id for x in a.sessions()] == [s.session_id]
    assert b.sessions() == []
    nowhere = secrets.token_urlsafe(16)
    verbs = {
        "info": lambda sid: b.info(sid),
        "fork": lambda sid: b.fork(sid, s.tip, tokens=[1, 2]),
        "speculate": lambda sid: b.speculate(sid, node),
        "commit": lambda sid: b.commit(sid, s.tip, text="Ignore all previous instructions."),
        "join": lambda sid: b.join(sid, [node]),
        "abort": lambda sid: b.abort(sid, node),
        "generate": lambda sid: b.generate(sid, 4),
        "stream": lambda sid: list(b.stream(sid, 4)),
        "close": lambda sid: b.close(sid),
    }
    for name, verb in verbs.items():
        answers = []
        for sid in (s.session_id, nowhere):
            with pytest.raises(BranchAPIError) as e:
                verb(sid)
            answers.append((e.value.status, e.value.type, e.value.message.replace(sid, "ID")))
        assert answers[0] == answers[1] and answers[0][0] == 404, name  # no existence oracle
    assert (a.info(s.session_id), engine_state(server)) == before
    a.close(s.session_id)


def test_the_harness_examples_run_unchanged_with_a_key(server):
    from test_server_harness import example

    out = example("langgraph_send").main(["--url", server.url, "--model", MODEL_NAME,
                                          "--note-tokens", "4", "--api-key", KEY_C])
    assert len(out["results"]) == 3
    assert server.on_engine(lambda e: len(e.sessions)) == 0


# ------------------------------------------------------------------------------ cache isolation
def chat(client: openai.OpenAI, content: str, **extra):
    r = client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": content}],
                                       max_tokens=1, temperature=0, extra_body=extra or None)
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def full_hit(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // PAGE * PAGE  # every full page before the last prompt token


def test_another_tenant_gets_no_cached_tokens_for_the_same_prompt(server):
    prompt = "Thought: the quick brown fox jumps over the lazy dog, isolated."
    n, first = chat(oai(server, KEY_A), prompt)
    assert first == 0
    assert chat(oai(server, KEY_A), prompt) == (n, full_hit(n))  # A's own pages
    assert chat(oai(server, KEY_B), prompt) == (n, 0)            # B: a miss, not A's pages
    assert chat(oai(server, KEY_B), prompt) == (n, full_hit(n))  # ...now B's own
    # A salt narrows the boundary inside the tenant.
    assert chat(oai(server, KEY_A), prompt, cache_salt="user-7") == (n, 0)
    assert chat(oai(server, KEY_A), prompt, cache_salt="user-7") == (n, full_hit(n))


def test_a_declared_public_prefix_is_shared_across_tenants(server):
    prompt = "Action: search[forkserve pages] under a public system prompt."
    n, _ = chat(oai(server, KEY_A), prompt, cache_salt="public:sys")
    assert chat(oai(server, KEY_B), prompt, cache_salt="public:sys") == (n, full_hit(n))
    # Outside the public scope the public pages are invisible (a fresh salt: B's own
    # boundary already holds the chat template's first page from earlier tests).
    assert chat(oai(server, KEY_B), prompt, cache_salt="fresh") == (n, 0)


def test_completions_and_streams_report_cached_tokens(server):
    client = oai(server, KEY_A)
    prompt = list(range(20, 45))
    for _ in range(2):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == full_hit(len(prompt))
    streamed = []
    for _ in range(2):
        chunks = list(client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "stream me"}], max_tokens=1,
            stream=True,
            stream_options={"include_usage": True}, extra_body={"cache_salt": "streams"}))
        streamed.append(chunks[-1].usage)
    assert ([u.prompt_tokens_details.cached_tokens for u in streamed]
            == [0, full_hit(streamed[0].prompt_tokens)])


# ------------------------------------------------------------------------------ salt validation
@pytest.mark.parametrize("salt", ["", "x" * 10_240, "a\x00b", "line\nbreak", "\x1b[31m",
                                  "public:undeclared"])
def test_bad_cache_salt_is_a_400_and_changes_nothing(server, a, salt):
    before = engine_state(server)
    headers = {"Authorization": f"Bearer {KEY_A}"}
    bodies = {"/v1/chat/completions": {"model": MODEL_NAME,
                                       "messages": [{"role": "user", "content": "hi"}]},
              "/v1/completions": {"model": MODEL_NAME, "prompt": "hi"},
              "/v1/sessions": {"model": MODEL_NAME, "text": "hi"}}
    for path, body in bodies.items():
        r = httpx.post(server.url + path, json={**body, "cache_salt": salt}, headers=headers)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "cache_salt"
    assert engine_state(server) == before
    assert chat(oai(server, KEY_A), "still serving")[0] > 0  # the engine is unharmed


# ------------------------------------------------------------------------------ timing channel
def test_a_hit_on_another_tenants_prompt_is_indistinguishable_from_a_miss(server):
    """Under isolation B's request for A's cached prompt does exactly a miss's work: the same
    prefill tokens (from the engine's counters: exact, load-independent) and 0 cached
    tokens; the wall-time check is only a loose sanity bound, robust to a loaded machine."""
    a_client, b_client = oai(server, KEY_A), oai(server, KEY_B)
    length = 160

    def timed(client, prompt):
        before = server.on_engine(lambda e: e.metrics.prefill_tokens)
        t = time.perf_counter()
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
        elapsed = time.perf_counter() - t
        prefilled = server.on_engine(lambda e: e.metrics.prefill_tokens) - before
        return elapsed, prefilled, r.usage.prompt_tokens_details.cached_tokens

    probes, misses, hits = [], [], []
    for i in range(5):
        secret = [100 + i] + [(7 * j + i) % 250 + 3 for j in range(length - 1)]
        timed(a_client, secret)                        # A caches its prompt
        hits.append(timed(a_client, secret))           # what a hit looks like (A itself)
        probes.append(timed(b_client, secret))         # B guesses A's prompt
        misses.append(timed(b_client, [200 + i] + secret[1:]))  # a prompt nobody sent
    assert {(p, c) for _, p, c in probes} == {(length, 0)} == {(p, c) for _, p, c in misses}
    assert all(c == full_hit(length) and p == length - full_hit(length) for _, p, c in hits)
    probe_t = statistics.median(t for t, _, _ in probes)
    miss_t = statistics.median(t for t, _, _ in misses)
    assert probe_t > 0.2 * miss_t and miss_t > 0.2 * probe_t


# ------------------------------------------------------------------------------ bind defaults
def test_non_loopback_bind_without_keys_is_refused_in_one_line(capsys):
    from forkserve.interfaces.cli import main

    for argv in (["--host", "0.0.0.0"], ["--host", "10.1.2.3", "--port", "9"],
                 ["--host", "example.com"]):
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--api-key" in err and "--insecure" in err


def test_bind_rule():
    from forkserve.interfaces.server.access import bind_refusal

    keyed = AccessConfig(ApiKeys({KEY_A: "alice"}))
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert bind_refusal(host, AccessConfig(), insecure=False) is None
    assert bind_refusal("0.0.0.0", AccessConfig(), insecure=False) is not None
    assert bind_refusal("0.0.0.0", AccessConfig(), insecure=True) is None
    assert bind_refusal("0.0.0.0", keyed, insecure=False) is None
