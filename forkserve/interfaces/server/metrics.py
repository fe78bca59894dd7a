"""``/metrics``: Prometheus text format, read from the engine's own accounting.

Engine figures are snapshotted on the engine thread at scrape time (the engine is not
thread-safe), then exposed through a custom collector; HTTP request counts are ordinary
prometheus-client counters, fed by an ASGI middleware that sees every response status.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forkserve.control.cascade import Action
from forkserve.engine import Engine
from forkserve.interfaces.server.engine_worker import EngineWorker, WorkerStats


@dataclass(frozen=True)
class EngineSnapshot:
    pages_used: dict[str, int]      # pool kind -> pages in use
    pages_free: dict[str, int]
    index_pages: dict[str, int]     # prefix tree (base / residual) -> published pages
    sessions: int
    counters: dict[str, float]      # EngineMetrics scalars, cumulative
    actions: dict[str, int]         # speculative residuals by cascade action
    peak_pages: int
    worker: WorkerStats


def take_snapshot(engine: Engine, worker: EngineWorker) -> EngineSnapshot:
    """Engine thread only."""
    cache = engine.cache_stats()
    pools = {p.kind.value: p for p in cache.pools()}
    trees = {"base": cache.base.published}
    if cache.residual is not None:
        trees["residual"] = cache.residual.published
    snap = engine.metrics.snapshot()
    actions = snap.pop("actions")
    peak = snap.pop("peak_pages")
    return EngineSnapshot({k: p.used for k, p in pools.items()},
                          {k: p.free for k, p in pools.items()}, trees,
                          engine.num_sessions(), snap, actions, peak, worker.stats())


_COUNTER_HELP = {
    "prefill_tokens": "tokens prefilled (committed and speculative)",
    "decode_tokens": "tokens decoded",
    "pruned": "speculative residuals dropped before any prefill",
    "probe_aborts": "early-abort probes that did not clear tau",
    "dropped_chunks": "speculative chunks dropped because their trunk moved",
    "ttl_expired": "speculative branches expired by TTL",
    "slack_filled_tokens": "known-suffix tokens prefilled from freed speculative budget",
    "transfer_tokens": "tokens moved over the prefill->decode connector (modeled)",
    "ticks": "scheduler ticks",
}


class EngineCollector:
    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        used = GaugeMetricFamily("forkserve_pages_used", "KV pages in use, per pool",
                                 labels=["pool"])
        free = GaugeMetricFamily("forkserve_pages_free", "free KV pages, per pool", labels=["pool"])
        for pool, n in s.pages_used.items():
            used.add_metric([pool], n)
            free.add_metric([pool], s.pages_free[pool])
        index = GaugeMetricFamily("forkserve_prefix_index_pages",
                                  "pages published in the prefix index, per tree", labels=["tree"])
        for tree, n in s.index_pages.items():
            index.add_metric([tree], n)
        yield from (used, free, index)
        prefilled = s.counters["prefill_tokens"]
        ratio = GaugeMetricFamily("forkserve_prefix_hit_ratio",
                                  "tokens a prefix tree served / (served + prefilled), since "
                                  "start; tree=all: every side of the KV came from the index",
                                  labels=["tree"])
        hit_tokens = CounterMetricFamily("forkserve_prefix_hit_tokens",
                                         "tokens served from a prefix tree", labels=["tree"])
        for tree, key in (("all", "hash_hit_tokens"), ("base", "base_hit_tokens"),
                          ("residual", "residual_hit_tokens")):
            if tree == "residual" and "residual" not in s.index_pages:
                continue
            hits = s.counters[key]
            ratio.add_metric([tree], hits / (hits + prefilled) if hits + prefilled else 0.0)
            hit_tokens.add_metric([tree], hits)
        yield from (ratio, hit_tokens)
        for name, help_text in _COUNTER_HELP.items():
            yield CounterMetricFamily(f"forkserve_{name}", help_text, value=s.counters[name])
        actions = CounterMetricFamily("forkserve_speculative_residuals",
                                      "speculated residuals by cascade action", labels=["action"])
        # Every action from the start, at 0 until it happens: a series that appears only
        # with its first event makes a scraper's rate() miss that event.
        for action in Action:
            actions.add_metric([action.value], s.actions.get(action.value, 0))
        yield actions
        w = s.worker
        for name, help_text, value in (
                ("peak_pages", "most KV pages in use at once", s.peak_pages),
                ("sessions_open", "sessions alive in the engine", s.sessions),
                ("sessions_leased", "branch-API sessions held by clients", w.leased_sessions),
                ("queue_depth", "engine commands waiting to run", w.queue_depth),
                ("waiting_sessions", "opens waiting to run: the admission queue the adaptive "
                 "layout weighs", w.waiting_sessions),
                ("active_generations", "generations being decoded", w.active_generations),
                ("decode_tokens_per_second", "decode throughput over the last 10 s",
                 w.decode_tokens_per_s),
                ("prefill_tokens_per_second", "prefill throughput over the last 10 s",
                 w.prefill_tokens_per_s)):
            yield GaugeMetricFamily(f"forkserve_{name}", help_text, value=value)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("forkserve_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.engine = EngineCollector()
        self.registry.register(self.engine)

    async def render(self, worker: EngineWorker) -> bytes:
        self.engine.snapshot = await worker.call(lambda: take_snapshot(worker.engine, worker))
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting responses by route template and status (a plain ASGI
    wrapper, so streaming responses and disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.requests.labels(getattr(route, "path", "unmatched"),
                                             str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counting_send)
