"""The router's decisions and the replica summary, without a cluster: fake replicas that
carry only what TreeAffinityRouter reads (an id and routing_stats)."""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import yaml

pytest.importorskip("ray.serve")
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest, ReplicaID

from forkserve.adapter_key import adapter_key
from forkserve.backend.protocol import PageKind
from forkserve.config import ForkServeConfig
from forkserve.control.kv_cache import KVCache
from forkserve.control.prefix_index import BASE, AdapterNamespace
from forkserve.engine.cache_stats import published_pages
from forkserve.interfaces.ray_serve.placement import RecentRoutes
from forkserve.interfaces.ray_serve.protocol import RouteHint
from forkserve.interfaces.ray_serve.router import TreeAffinityRouter, TwoChoicesRouter
from forkserve.interfaces.ray_serve.stats import (
    BASE_SCOPE,
    ReplicaSummary,
    index_hashes,
    matched_pages,
    page_hashes,
    pages_per_adapter,
)

DEPLOYMENT = DeploymentID(name="Engine", app_name="forkserve")
P = 4


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(self.name, DEPLOYMENT)


def summary(prefix: list[int] = (), residual: dict[str, int] | None = None, used: int = 0,
            rate: float = 0.0) -> dict[str, Any]:
    hashes = frozenset(page_hashes(BASE_SCOPE, list(prefix), P))
    return ReplicaSummary(hashes, residual or {}, 100 - used, 0, 0, live_pages=used, page_size=P,
                          token_rate=rate).to_dict()


def request(method: str, hint: RouteHint, internal_id: str | None = None) -> PendingRequest:
    meta = RequestMetadata(request_id="r",
                           internal_request_id=internal_id or f"i-{method}-{hint.tree_id}",
                           call_method=method)
    return PendingRequest(args=[hint], kwargs={}, metadata=meta)


def route(router: TreeAffinityRouter, replicas: list[FakeReplica], method: str,
          hint: RouteHint) -> list[list[str]]:
    async def go() -> list[list[str]]:
        pr = request(method, hint)
        ranks = await router.choose_replicas(replicas, pr)
        if method in ("open", "close"):
            router.on_request_routed(pr, ranks[0][0].replica_id, None)
        return [[r.name for r in rank] for rank in ranks]
    return asyncio.run(go())


def new_router(**weights: float) -> TreeAffinityRouter:
    router = TreeAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**weights)
    return router


def open_hint(tree: int, tokens: list[int], adapter: str | None = None) -> RouteHint:
    return RouteHint(tree, adapter, page_hashes(BASE_SCOPE, tokens, P))


def test_page_hashes_are_chained_and_only_cover_full_pages() -> None:
    a = page_hashes(BASE_SCOPE, list(range(10)), P)
    assert len(a) == 2
    # the partial page is not hashed
    assert page_hashes(BASE_SCOPE, list(range(8)) + [99, 98], P) == a
    # page 2's hash depends on page 1
    assert page_hashes(BASE_SCOPE, [7] + list(range(1, 10)), P)[1] != a[1]
    assert page_hashes("planner", list(range(10)), P) != a  # scopes never collide
    assert matched_pages(page_hashes(BASE_SCOPE, list(range(16)), P), frozenset(a)) == 2


def test_index_hashes_match_the_prompt_hashes_of_published_pages() -> None:
    kv = KVCache(ForkServeConfig(page_size=P, num_pages=64), [PageKind.UNIFIED])
    tokens = list(range(3, 15))
    kv.index.insert(BASE, tokens, kv.pool.alloc(3))
    kv.index.insert(AdapterNamespace(adapter_key(0)), tokens[:8], kv.pool.alloc(2))
    pages = published_pages(kv)
    names = {adapter_key(0): "planner"}
    published = index_hashes(pages, P, names)
    assert matched_pages(page_hashes(BASE_SCOPE, tokens + [1, 2], P), published) == 3
    assert matched_pages(page_hashes("planner", tokens, P), published) == 2
    assert pages_per_adapter(pages, names) == {"planner": 2}


def test_a_known_tree_goes_to_its_owner_only() -> None:
    router = new_router()
    a, b = FakeReplica("a", summary()), FakeReplica("b", summary(list(range(12))))
    owner = route(router, [a, b], "open", open_hint(1, [50, 51, 52, 53]))[0][0]
    for method in ("fork", "commit", "generate", "info"):
        assert route(router, [a, b], method, RouteHint(1, None)) == [[owner]]
    route(router, [a, b], "close", RouteHint(1, None))
    # Closed: no owner any more, so a late verb may go anywhere (and find no tree there).
    assert route(router, [a, b], "info", RouteHint(1, None)) == [["a", "b"]]


def test_a_new_tree_ranks_the_replica_with_its_prefix_first() -> None:
    router = new_router()
    prefix = list(range(20, 36))
    a, b = FakeReplica("a", summary()), FakeReplica("b", summary(prefix))
    ranks = route(router, [a, b], "open", open_hint(2, prefix + [1, 2, 3, 4]))
    assert ranks == [["b"], ["a"]]  # a stays as spill-over


def test_residual_pages_pull_an_adapters_new_agent() -> None:
    router = new_router()
    a, b = (FakeReplica("a", summary(residual={"critic": 40})),
            FakeReplica("b", summary(residual={"planner": 6})))
    assert route(router, [a, b], "open", open_hint(3, [9] * 8, "planner"))[0] == ["b"]
    assert route(router, [a, b], "open", open_hint(4, [9] * 8, "critic"))[0] == ["a"]


def test_a_dead_replica_loses_its_trees() -> None:
    router = new_router()
    a, b = FakeReplica("a", summary(list(range(8)))), FakeReplica("b", summary())
    assert route(router, [a, b], "open", open_hint(6, list(range(8))))[0] == ["a"]
    router.on_replica_actor_died(a.replica_id)
    # Forgotten: even offered a replica named "a" again (Serve's restart of it holds no
    # tree), the verb is not pinned there; whichever replica gets it answers NOT_RESIDENT
    # and the Frontend re-opens the tree.
    assert route(router, [a, b], "generate", RouteHint(6, None)) == [["a", "b"]]


def test_the_serve_config_file_is_a_valid_deploy_config() -> None:
    from pathlib import Path

    from ray.serve.schema import ServeDeploySchema

    import forkserve.interfaces.ray_serve as pkg
    config = yaml.safe_load((Path(pkg.__file__).parent / "serve_config.yaml").read_text())
    app = ServeDeploySchema.model_validate(config).applications[0]
    assert app.deployments[0].request_router_config["request_router_class"].endswith(
        ":TreeAffinityRouter")


def test_concurrent_calls_of_one_request_are_matched_by_identity() -> None:
    """Calls a replica makes while serving one request share its internal_request_id."""
    router = new_router()

    async def go() -> None:
        first, second = (request("generate", RouteHint(t, None), internal_id="shared")
                         for t in (7, 8))
        for pr in (first, second):
            router._pending_requests_to_fulfill.append(pr)
            router._add_pending_request_to_indices(pr)
        assert router._get_pending_request_matching_internal_request_id(second.metadata) is second
        assert router._get_pending_request_matching_internal_request_id(first.metadata) is first
    asyncio.run(go())


SYSTEM = [5, 6, 7, 8, 9, 10, 11, 12]  # a chat template's default system prompt: 2 pages


def place_sequentially(router: TreeAffinityRouter, prompts: list[list[int]]) -> Counter:
    """Each prompt opened after the last was routed, before any summary shows it."""
    a, b = FakeReplica("a", summary()), FakeReplica("b", summary())
    return Counter(route(router, [a, b], "open", open_hint(100 + i, p))[0][0]
                   for i, p in enumerate(prompts))


def test_sequential_clients_sharing_only_a_system_prompt_spread_over_replicas() -> None:
    prompts = [SYSTEM + [40 + i] * 24 for i in range(8)]
    # Prefix affinity alone follows the first client's system prompt pages everywhere...
    assert sorted(place_sequentially(new_router(load_weight=0.0), prompts).values()) == [8]
    # ...the load term weighs the 6 new pages each client brings against 2 matched ones.
    placed = place_sequentially(new_router(), prompts)
    assert min(placed["a"], placed["b"]) >= 3, placed


def test_agents_of_a_long_shared_context_stay_together_under_load() -> None:
    context = list(range(100, 164))  # 16 pages: each next agent would recompute them elsewhere
    placed = place_sequentially(new_router(), [context + [200 + i] * P for i in range(6)])
    assert sorted(placed.values()) == [6]


def test_kv_pressure_and_token_rate_outweigh_a_short_prefix_match() -> None:
    router = new_router()
    hint = open_hint(9, SYSTEM + [77] * 8)
    full = FakeReplica("a", summary(SYSTEM, used=90))
    busy = FakeReplica("a", summary(SYSTEM, rate=400.0))  # 100 pages of tokens a second
    idle = FakeReplica("b", summary())
    assert route(router, [full, idle], "open", hint)[0] == ["b"]
    assert route(router, [busy, idle], "open", open_hint(10, SYSTEM + [78] * 8))[0] == ["b"]
    # Idle and equal but for the prefix: the prefix wins.
    assert route(router, [FakeReplica("a", summary(SYSTEM)), idle], "open",
                 open_hint(11, SYSTEM))[0] == ["a"]


def test_recent_routes_count_until_their_ttl() -> None:
    now = [0.0]
    recent = RecentRoutes(4.0, clock=lambda: now[0])
    recent.add(open_hint(1, list(range(8)), "planner"), new_pages=2)
    assert (recent.new_pages() == 2 and recent.adapter_pages("planner") == 2
            and len(recent.hashes()) == 2)
    recent.closed(1)  # published cache now: still matched, no longer load
    assert (recent.new_pages() == 0 and recent.adapter_pages("planner") == 2
            and len(recent.hashes()) == 2)
    now[0] = 4.5
    assert recent.new_pages() == 0 and recent.hashes() == frozenset()


def test_a_burst_of_opens_sees_each_other_before_any_is_routed() -> None:
    """Lockstep agents open at once: every open is scored before Serve reports any routed."""
    router = new_router()
    a, b = FakeReplica("a", summary()), FakeReplica("b", summary())
    contexts = [list(range(100, 164)), list(range(300, 364))]

    async def burst() -> list[str]:
        hints = [open_hint(200 + i, contexts[i % 2] + [400 + i] * P) for i in range(8)]
        return [(await router.choose_replicas([a, b], request("open", h)))[0][0].name
                for h in hints]
    placed = asyncio.run(burst())
    assert (len({placed[i] for i in (0, 2, 4, 6)}) == 1
            and len({placed[i] for i in (1, 3, 5, 7)}) == 1)
    assert placed[0] != placed[1]  # the second context goes where the first's load is not


def test_an_open_serve_sent_elsewhere_is_counted_where_it_went() -> None:
    router = new_router()
    a, b = FakeReplica("a", summary()), FakeReplica("b", summary())
    hint = open_hint(300, list(range(100, 164)))

    async def go() -> None:
        pr = request("open", hint)
        first = (await router.choose_replicas([a, b], pr))[0][0]
        other = b if first is a else a
        router.on_request_routed(pr, other.replica_id, None)  # the best was full
        assert router._recent_of(other.replica_id).has(300)
        assert not router._recent_of(first.replica_id).has(300)
    asyncio.run(go())


def test_the_two_choices_baseline_ignores_prefixes_but_keeps_owners() -> None:
    router = TwoChoicesRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    replicas = [FakeReplica("a", summary(list(range(64)))), FakeReplica("b", summary()),
                FakeReplica("c", summary())]
    hint = open_hint(500, list(range(64)))
    picks = {tuple(sorted(route(router, replicas, "open", replace(hint, tree_id=500 + i))[0]))
             for i in range(40)}
    # any two, the prefix's holder or not
    assert all(len(p) == 2 for p in picks) and len(picks) == 3
    placed = route(router, replicas, "open", replace(hint, tree_id=600))[0][0]
    assert route(router, replicas, "generate", RouteHint(600, None)) == [[placed]]
