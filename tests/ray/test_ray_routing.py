"""Two Engine replicas of the tiny model behind the Frontend, on loopback (conftest.py).

The tests share one cluster and run in file order: the last one kills a replica."""
from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray_testlib import AUTH, KEY, STATS_PERIOD_S, Cluster

from forkserve.interfaces.client import BranchAPIError, BranchClient
from forkserve.interfaces.ray_serve.frontend import REPLICA_HEADER

MODEL = "tiny-llama"
_rng = random.Random(7)


def fresh_tokens(n: int) -> list[int]:
    """Tokens no other test used: 4 + n random ids make every prompt's pages unique."""
    return [_rng.randrange(3, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> httpx.Client:
    with httpx.Client(base_url=cluster.url, timeout=60, headers=AUTH) as c:
        yield c


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def open_tree(client: httpx.Client, tokens: list[int], model: str = MODEL) -> tuple[int, str]:
    r = client.post("/v1/sessions", json={"model": model, "tokens": tokens})
    return ok(r)["session_id"], r.headers[REPLICA_HEADER]


def publish(client: httpx.Client, tokens: list[int], model: str = MODEL) -> str:
    """A tree that prefills ``tokens`` and closes: its full pages stay published."""
    sid, replica = open_tree(client, tokens, model)
    ok(client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 1}))
    ok(client.delete(f"/v1/sessions/{sid}"))
    return replica


@pytest.fixture(scope="module")
def prefix_on(client: httpx.Client) -> dict[str, list[int]]:
    """A published 6-page prefix on each replica. New trees with no match are spread by
    load, so a few leaders reach both. No wait for the replicas' stats: the router counts
    what it just routed (placement.RecentRoutes) until their summaries show it. A replica
    still starting (a loaded CI machine) is not routed to yet: trees keep coming, a stats
    period apart after the first 16, for up to 60 s."""
    found: dict[str, list[int]] = {}
    deadline, trees = time.monotonic() + 60.0, 0
    while len(found) < 2 and time.monotonic() < deadline:
        if trees >= 16:
            time.sleep(STATS_PERIOD_S)
        tokens = fresh_tokens(24)
        found.setdefault(publish(client, tokens), tokens)
        trees += 1
    assert len(found) == 2, "new trees never reached the second replica"
    return found


def test_every_verb_of_a_tree_lands_on_its_owner(client: httpx.Client) -> None:
    for _ in range(4):
        sid, owner = open_tree(client, fresh_tokens(10))
        seen = {owner}
        tip = ok(client.get(f"/v1/sessions/{sid}"))["tip"]
        r = client.post(f"/v1/sessions/{sid}/fork", json={"parent": tip, "tokens": fresh_tokens(3)})
        seen.add(r.headers[REPLICA_HEADER])
        node = ok(r)["node"]
        r = client.post(f"/v1/sessions/{sid}/speculate", json={"node": node})
        seen.add(r.headers[REPLICA_HEADER])
        ok(r)
        r = client.post(f"/v1/sessions/{sid}/commit", json={"tip": tip, "tokens": fresh_tokens(5)})
        seen.add(r.headers[REPLICA_HEADER])
        ok(r)
        r = client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 3, "ignore_eos": True})
        seen.add(r.headers[REPLICA_HEADER])
        assert len(ok(r)["tokens"]) == 3
        r = client.delete(f"/v1/sessions/{sid}")
        seen.add(r.headers[REPLICA_HEADER])
        ok(r)
        assert seen == {owner}


def test_a_new_tree_goes_where_its_prefix_is_published(client: httpx.Client,
                                                       prefix_on: dict[str, list[int]]) -> None:
    for replica, prefix in prefix_on.items():
        for _ in range(3):  # a random router would miss one of six placements with p = 63/64
            sid, where = open_tree(client, prefix + fresh_tokens(6))
            assert where == replica
            ok(client.delete(f"/v1/sessions/{sid}"))


def test_an_adapters_second_agent_prefers_its_residual_pages(
        client: httpx.Client, prefix_on: dict[str, list[int]]) -> None:
    # Place each adapter's first agent by a base prefix: planner on one replica, critic on the
    # other.
    home = {}
    for adapter, (replica, prefix) in zip(("planner", "critic"), prefix_on.items(), strict=False):
        # 16 pages of residual: the log term must clear a page or two of load that the
        # previous test's trees may still show in a summary up to one period old.
        home[adapter] = publish(client, prefix + fresh_tokens(40), model=adapter)
        assert home[adapter] == replica
    # The first agents are closed, but a summary taken before their close still counts their
    # pages as live load (up to one stats period), which would outweigh the residual term:
    # let two polls pass, so the placement sees the pages as cache.
    time.sleep(2 * STATS_PERIOD_S)
    # Second agents share no base page with anything: only the residual pages pull them.
    for adapter in ("planner", "critic", "planner", "critic"):
        sid, where = open_tree(client, fresh_tokens(12), model=adapter)
        assert where == home[adapter], adapter
        ok(client.delete(f"/v1/sessions/{sid}"))


def test_concurrent_agents_each_stay_on_one_replica(client: httpx.Client) -> None:
    def agent(_: int) -> set[str]:
        sid, owner = open_tree(client, fresh_tokens(12))
        seen = {owner}
        for _ in range(2):
            r = client.post(f"/v1/sessions/{sid}/generate",
                            json={"max_tokens": 4, "ignore_eos": True})
            ok(r)
            seen.add(r.headers[REPLICA_HEADER])
            tip = ok(client.get(f"/v1/sessions/{sid}"))["tip"]
            r = client.post(f"/v1/sessions/{sid}/commit",
                            json={"tip": tip, "tokens": fresh_tokens(4)})
            ok(r)
            seen.add(r.headers[REPLICA_HEADER])
        ok(client.delete(f"/v1/sessions/{sid}"))
        return seen

    with ThreadPoolExecutor(8) as pool:
        per_agent = list(pool.map(agent, range(8)))
    assert all(len(seen) == 1 for seen in per_agent)
    assert len(set().union(*per_agent)) == 2  # equal new trees are spread, not piled on one


def test_refusals_cross_the_frontend_as_clean_errors(client: httpx.Client) -> None:
    r = client.post("/v1/sessions", json={"model": "nobody", "tokens": [5, 6]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert client.get("/v1/sessions/12345").status_code == 404
    sid, _ = open_tree(client, fresh_tokens(6))
    r = client.post(f"/v1/sessions/{sid}/commit", json={"tip": 999, "tokens": [5]})
    assert r.status_code == 404 and "Traceback" not in r.text
    r = client.post(f"/v1/sessions/{sid}/fork", json={"parent": 1, "tokens": [10**6]})
    assert r.status_code == 400, r.text
    ok(client.delete(f"/v1/sessions/{sid}"))


def test_streams_match_the_unstreamed_answers(client: httpx.Client) -> None:
    prompt = fresh_tokens(10)
    sid, owner = open_tree(client, prompt)
    with client.stream("POST", f"/v1/sessions/{sid}/generate",
                       json={"max_tokens": 5, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == owner
        lines = [json.loads(line) for line in r.iter_lines() if line]
    streamed = [t for line in lines for t in line["tokens"]]
    assert len(streamed) == 5 and lines[-1]["finish_reason"] == "length"
    # The ledger saw the stream's end: the tree's committed length includes the tokens.
    assert ok(client.get(f"/v1/sessions/{sid}"))["committed_tokens"] == len(prompt) + 5
    control, _ = open_tree(client, prompt)
    assert ok(client.post(f"/v1/sessions/{control}/generate",
                          json={"max_tokens": 5, "ignore_eos": True}))["tokens"] == streamed
    for s in (sid, control):
        ok(client.delete(f"/v1/sessions/{s}"))

    body = {"model": "critic", "prompt": "The quick brown fox", "max_tokens": 4, "n": 2,
            "temperature": 0}
    whole = ok(client.post("/v1/completions", json=body))
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = {0: "", 1: ""}
    for e in events[:-1]:
        for choice in json.loads(e)["choices"]:
            text[choice["index"]] += choice["text"]
    assert [text[0], text[1]] == [c["text"] for c in whole["choices"]]

    # Chat streams as the one-process server's do (server/openai_wire.py): every choice's
    # role first, then its content, then an empty delta with its finish_reason; usage last.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "n": 2, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=chat) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["delta"]["role"] for c in chunks[0]["choices"]] == ["assistant", "assistant"]
    ends = [c for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert (sorted(c["index"] for c in ends) == [0, 1]
            and all(c["delta"]["content"] is None for c in ends))
    assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["usage"]["completion_tokens"] <= 6


def test_models_list_the_adapters_and_the_served_defaults(client: httpx.Client) -> None:
    cards = {c["id"]: c for c in ok(client.get("/v1/models"))["data"]}
    assert cards[MODEL]["parent"] is None and cards["critic"]["parent"] == MODEL
    assert all(c["sampling_defaults"] == {"temperature": 1.0, "top_p": 1.0, "source": "openai"}
               and c["share_base"] == "cross_adapter" for c in cards.values())


def test_the_branch_client_drives_the_cluster_like_one_server(cluster: Cluster) -> None:
    """The Python client of the one-process server, unchanged, against the Frontend: the
    agent step of tests/server (speculate a known wrapper, drain, commit binds it)."""
    with BranchClient(cluster.url, api_key=KEY) as client:
        s = client.open(MODEL, messages=[{"role": "user", "content": "List the files."}])
        wrapper, guess = [40, 41, 42, 43, 44], [40, 41, 90, 91]
        happy = client.fork(s.session_id, s.tip, tokens=wrapper, label="wrapper")
        err = client.fork(s.session_id, s.tip, tokens=guess, label="error")
        client.speculate(s.session_id, happy, priority=1.0, t_idle_ms=500)
        client.speculate(s.session_id, err, priority=0.2)
        client.drain()
        c = client.commit(s.session_id, s.tip, tokens=wrapper + [50, 51, 52])
        assert c.bound_node == happy and c.matched_tokens == len(wrapper) and err in c.aborted
        out = client.generate(s.session_id, 5, ignore_eos=True)
        assert len(out.tokens) == 5 and out.tip == c.tip
        assert (client.info(s.session_id).committed_tokens
                == s.committed_tokens + len(wrapper) + 3 + 5)
        client.close(s.session_id)


def metrics(client: httpx.Client) -> dict[str, dict[tuple, float]]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_gather_every_replica_under_its_label(client: httpx.Client) -> None:
    m = metrics(client)
    up = {dict(k)["replica"]: v for k, v in m["forkserve_replica_up"].items()}
    assert len(up) == 2 and set(up.values()) == {1.0}
    prefilled = {dict(k)["replica"]: v for k, v in m["forkserve_prefill_tokens_total"].items()}
    assert set(prefilled) == set(up) and all(v > 0 for v in prefilled.values())  # both served trees
    hits = {dict(k)["tree"] for k in m["forkserve_cluster_prefix_hit_ratio"]}
    assert hits == {"all", "base", "residual"}
    assert m["forkserve_cluster_prefix_hit_ratio"][(("tree", "base"),)] > 0  # the prefix tests hit
    assert m["forkserve_tree_moves_total"][()] == 0
    assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_the_http_proxy_listens_on_loopback_only(cluster: Cluster) -> None:
    port = int(cluster.url.rsplit(":", 1)[1])
    listening = {c.laddr.ip for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening == {"127.0.0.1"}


def test_killing_a_replica_loses_no_committed_token(client: httpx.Client) -> None:
    prompt = fresh_tokens(14)
    sid, victim = open_tree(client, prompt)
    g1 = ok(client.post(f"/v1/sessions/{sid}/generate",
                        json={"max_tokens": 4, "ignore_eos": True}))["tokens"]
    tip = ok(client.get(f"/v1/sessions/{sid}"))["tip"]
    extra = fresh_tokens(5)
    ok(client.post(f"/v1/sessions/{sid}/commit", json={"tip": tip, "tokens": extra}))
    info = ok(client.get(f"/v1/sessions/{sid}"))
    committed = prompt + g1 + extra
    assert info["committed_tokens"] == len(committed)

    # Kill the replica mid-generation: the stream, already under way, ends with a retryable
    # error, which BranchClient raises as such (the replica it came from in last_replica).
    with BranchClient(str(client.base_url), api_key=KEY) as branch:
        chunks = branch.stream(sid, 300, ignore_eos=True)
        assert next(chunks).tokens and branch.last_replica == victim
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        with pytest.raises(BranchAPIError) as cut:
            list(chunks)
    assert cut.value.status == 503, cut.value

    # The client goes on from the committed tip it knew: the tree is re-opened elsewhere from
    # its committed tokens (the cut generation was never committed) and the old tip id still
    # names it.
    more = fresh_tokens(3)
    r = client.post(f"/v1/sessions/{sid}/commit", json={"tip": info["tip"], "tokens": more})
    assert r.status_code == 200, r.text
    assert r.headers[REPLICA_HEADER] != victim
    r = client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 5, "ignore_eos": True})
    after = ok(r)["tokens"]
    assert (ok(client.get(f"/v1/sessions/{sid}"))["committed_tokens"]
            == len(committed + more + after))

    # Greedy decoding from the re-opened tree equals decoding from a fresh tree on the
    # same tokens: the committed context came back whole.
    control, _ = open_tree(client, committed + more)
    assert ok(client.post(f"/v1/sessions/{control}/generate",
                          json={"max_tokens": 5, "ignore_eos": True}))["tokens"] == after
    for s in (sid, control):
        ok(client.delete(f"/v1/sessions/{s}"))


def test_metrics_count_the_fail_over_move(client: httpx.Client) -> None:
    m = metrics(client)
    assert m["forkserve_tree_moves_total"][()] >= 1  # the killed replica's tree, re-opened
