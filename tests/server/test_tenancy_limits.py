"""Per-tenant limits on a loopback server: sessions, KV pages, tokens per request and per
minute. A tenant at a limit gets 429 with Retry-After (400 for a request that can never
fit); another tenant's greedy outputs are the same as without the noisy one."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_testlib import MODEL_NAME, start

from forkserve.interfaces.client import BranchAPIError, BranchClient
from forkserve.interfaces.server.access import AccessConfig
from forkserve.interfaces.server.auth import ApiKeys
from forkserve.interfaces.server.limits import Demand, TenantLimits, TenantMeter

NOISY, VICTIM, RATED = "sk-noisy-0000", "sk-victim-0000", "sk-rated-0000"
# 3 tenants x 64 pages fit in the 256-page pool: no tenant can take what another needs.
LIMITS = TenantLimits(max_sessions=3, max_pages=64, max_tokens_per_request=200,
                      tokens_per_minute=3000)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    access = AccessConfig(ApiKeys({NOISY: "noisy", VICTIM: "victim", RATED: "rated"}), LIMITS)
    with start(tiny_model_dir, access=access, num_pages=256) as running:
        yield running


def branch(server, key: str) -> BranchClient:
    return BranchClient(server.url, api_key=key)


def oai(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_sessions_limit_is_a_429_with_retry_after_for_that_tenant_only(server):
    with branch(server, NOISY) as noisy, branch(server, VICTIM) as victim:
        held = [noisy.open(MODEL_NAME, tokens=[5, 6, 7]) for _ in range(3)]
        r = httpx.post(server.url + "/v1/sessions", json={"model": MODEL_NAME, "tokens": [5, 6, 7]},
                       headers={"Authorization": f"Bearer {NOISY}"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "RateLimitError"
        mine = victim.open(MODEL_NAME, tokens=[5, 6, 7])  # the other tenant is not limited by it
        noisy.close(held[0].session_id)
        held[0] = noisy.open(MODEL_NAME, tokens=[5, 6, 7])  # a closed session frees its slot
        for s in held:
            noisy.close(s.session_id)
        victim.close(mine.session_id)


def test_pages_limit_bounds_what_a_tenant_holds(server):
    with branch(server, NOISY) as noisy:
        s = noisy.open(MODEL_NAME, tokens=list(range(3, 183)))   # 45 pages
        before = server.on_engine(lambda e: (e.pool.num_used, len(e.sessions)))
        with pytest.raises(BranchAPIError) as e:
            noisy.commit(s.session_id, s.tip, tokens=list(range(3, 83)))  # +21 pages > 64
        assert e.value.status == 429
        with pytest.raises(BranchAPIError) as e:
            noisy.generate(s.session_id, 100)
        assert e.value.status == 429
        # nothing changed
        assert server.on_engine(lambda e: (e.pool.num_used, len(e.sessions))) == before
        # this fits
        assert noisy.commit(s.session_id, s.tip, tokens=[9, 10, 11]).prefilled_tokens == 3
        noisy.close(s.session_id)


def test_a_request_that_can_never_fit_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        oai(server, VICTIM).completions.create(model=MODEL_NAME, prompt=[5] * 150, max_tokens=100)
    assert e.value.body["param"] == "max_tokens"


def test_tokens_per_minute_is_a_429_with_the_wait_in_retry_after(server):
    client = oai(server, RATED)
    statuses = []
    start_t = time.monotonic()
    for _ in range(100):  # each request takes 190 tokens; the bucket refills 50 per second
        try:
            client.completions.create(model=MODEL_NAME, prompt=[5] * 180, max_tokens=10,
                                      temperature=0)
            statuses.append(200)
        except openai.RateLimitError as e:
            statuses.append(429)
            assert 1 <= int(e.response.headers["retry-after"]) <= 60
            break
    refilled = (time.monotonic() - start_t) * 3000 / 60
    assert statuses[-1] == 429 and 3000 // 190 <= statuses.count(200) <= (3000 + refilled) // 190


def test_token_bucket_refills_with_time():
    meter = TenantMeter(TenantLimits(tokens_per_minute=600), now=0.0)
    demand = Demand(sessions=0, tokens=500, request_tokens=500, pages=0)
    meter.check(demand, sessions=0, pages=0, now=0.0)
    meter.charge(500, now=0.0)
    with pytest.raises(Exception) as e:
        meter.check(demand, sessions=0, pages=0, now=1.0)  # 110 available, 10 tokens/s
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "39"
    meter.check(demand, sessions=0, pages=0, now=40.0)


PROMPTS = ["Thought: I should look at the files first.", "Final Answer: the cache is shared.",
           "def main():\n    return 0\n", "Observation: the tool returned three results."]


def victim_outputs(server, salt: str) -> list[str]:
    client = oai(server, VICTIM)
    return [client.chat.completions.create(model=MODEL_NAME,
                                           messages=[{"role": "user", "content": p}],
                                           max_tokens=8, temperature=0,
                                           extra_body={"cache_salt": salt})
            .choices[0].message.content
            for p in PROMPTS]


def test_a_noisy_tenant_at_its_limits_does_not_change_anothers_outputs(server):
    quiet = victim_outputs(server, "quiet")  # the reference: no noisy tenant
    client = oai(server, NOISY)

    def flood(i: int) -> int:
        try:
            client.chat.completions.create(model=MODEL_NAME, max_tokens=24, temperature=0,
                                           messages=[{"role": "user",
                                                      "content": f"flood {i} " * 8}])
            return 200
        except openai.RateLimitError:
            return 429

    with ThreadPoolExecutor(8) as pool:
        flooding = [pool.submit(flood, i) for i in range(40)]
        # the victim's own salt: a miss again, as in the reference
        noisy = victim_outputs(server, "noisy")
        statuses = [f.result() for f in flooding]
    assert noisy == quiet
    assert 429 in statuses and 200 in statuses
