"""The Frontend's ``/metrics``: every Engine replica's figures under a ``replica`` label,
the cluster's prefix hit ratios, and the Frontend's own fail-over counts.

Each replica renders its engine's families itself (``EngineReplica.metrics``: the
one-process server's collector); the Frontend parses each exposition, adds the replica's
name as a label and re-exposes the families merged, so a dashboard of the one-process
server works per replica. A replica that does not answer within the scrape's timeout is
``forkserve_replica_up 0`` and contributes nothing else (a scrape never fails for it).

Replicas are found by their Serve actor names (``SERVE_REPLICA::<app>#<deployment>#<id>``,
namespace ``serve``), which Ray's GCS lists without the dashboard.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

SERVE_NAMESPACE = "serve"
_HIT_TREES = ("all", "base", "residual")


def replica_names(app: str, deployment: str) -> list[str]:
    """The live replicas of ``app``'s ``deployment``, by actor name."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix))


@dataclass(frozen=True)
class FrontendCounts:
    """The Frontend's own figures at scrape time."""

    open_trees: int
    tree_moves: int        # trees re-opened on another replica (fail-over), since start


class ClusterCollector:
    """Merges the replicas' expositions (replica name -> text, None when it did not answer)."""

    def __init__(self, texts: Mapping[str, str | None], counts: FrontendCounts) -> None:
        self._texts, self._counts = texts, counts

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        hits = {t: 0.0 for t in _HIT_TREES}
        prefilled = 0.0
        up = GaugeMetricFamily("forkserve_replica_up", "1 when the replica answered this scrape",
                               labels=["replica"])
        for replica, text in sorted(self._texts.items()):
            up.add_metric([replica], 0.0 if text is None else 1.0)
            for family in text_string_to_metric_families(text or ""):
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type)
                    merged[family.name] = out
                for s in family.samples:
                    out.add_sample(s.name, {**s.labels, "replica": replica}, s.value)
                    if s.name == "forkserve_prefix_hit_tokens_total":
                        hits[s.labels["tree"]] += s.value
                    elif s.name == "forkserve_prefill_tokens_total":
                        prefilled += s.value
        yield up
        yield from merged.values()
        ratio = GaugeMetricFamily(
            "forkserve_cluster_prefix_hit_ratio",
            "all replicas: tokens a prefix tree served / (served + prefilled)", labels=["tree"])
        for tree, n in hits.items():
            ratio.add_metric([tree], n / (n + prefilled) if n + prefilled else 0.0)
        yield ratio
        yield GaugeMetricFamily("forkserve_trees_open", "trees this Frontend holds in its ledger",
                                value=self._counts.open_trees)
        yield CounterMetricFamily("forkserve_tree_moves", "trees re-opened on another replica",
                                  value=self._counts.tree_moves)


def render(texts: Mapping[str, str | None], counts: FrontendCounts) -> bytes:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(texts, counts))
    return generate_latest(registry)
