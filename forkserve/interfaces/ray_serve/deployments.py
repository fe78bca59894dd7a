"""The Serve application: an ``Engine`` deployment (N replicas, routed by the
TreeAffinityRouter) behind a CPU ``Frontend`` deployment (the HTTP ingress).

``build_application`` is what ``forkserve serve --replicas N`` deploys; ``build_app`` is
the same from a Serve config file (``serve run forkserve/interfaces/ray_serve/serve_config.yaml``):
its ``args`` are ReplicaSpec's fields, and the file's ``deployments`` section may override
replicas, resources and the router's settings.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from forkserve.interfaces.ray_serve.engine_replica import EngineReplica, ReplicaSpec
from forkserve.interfaces.ray_serve.frontend import Frontend
from forkserve.interfaces.ray_serve.router import TreeAffinityRouter
from forkserve.interfaces.server.access import DEFAULT_ACCESS, AccessConfig

# Concurrent calls one Engine replica accepts. Serve's default of 5 would queue agents in
# the router while the engine could decode them together: a tick decodes one token for
# every generating session (up to max_batch_tokens = 8192), so KV pages bound a replica,
# not the batch. Tree verbs are short; generations hold a slot until they end.
DEFAULT_MAX_ONGOING = 256
# How often replicas publish their summary: the router's view of caches lags by this much
# (its owner map does not lag).
DEFAULT_STATS_PERIOD_S = 2.0


def build_application(spec: ReplicaSpec, *, replicas: int,
                      max_ongoing_requests: int = DEFAULT_MAX_ONGOING,
                      stats_period_s: float = DEFAULT_STATS_PERIOD_S, num_cpus: float = 1.0,
                      num_gpus: float = 0.0, router_kwargs: Mapping[str, float] | None = None,
                      health_check_period_s: float = 10.0, access: AccessConfig = DEFAULT_ACCESS,
                      router_class: type | str | None = None) -> Application:
    """``access``: the Frontend's API keys, public prefixes (SECURITY.md). ``router_class``:
    another request router, as a class or ``"module:Class"`` (benchmarks compare Serve's
    own); ``router_kwargs`` are then its own."""
    engine = serve.deployment(EngineReplica, name="Engine").options(
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        health_check_period_s=health_check_period_s,
        request_router_config=RequestRouterConfig(
            request_router_class=router_class or TreeAffinityRouter,
            request_router_kwargs=dict(router_kwargs or {}),
            request_routing_stats_period_s=stats_period_s,
        ),
    )
    # The Frontend only parses, tokenizes and awaits the engine: no CPU reserved, so it
    # never competes with the engines for the cluster's cores.
    frontend = serve.deployment(Frontend, name="Frontend").options(
        num_replicas=1, max_ongoing_requests=4 * max_ongoing_requests,
        ray_actor_options={"num_cpus": 0})
    return frontend.bind(engine.bind(spec), access)


_SPEC_FIELDS = {f.name for f in dataclasses.fields(ReplicaSpec)}


def build_app(args: Mapping[str, Any]) -> Application:
    """Application builder for Serve config files: ``args`` holds ReplicaSpec's fields
    (``loras`` as a NAME: PATH mapping) plus ``replicas``, ``max_ongoing_requests``,
    ``stats_period_s``, ``num_cpus``, ``num_gpus``."""
    unknown = set(args) - _SPEC_FIELDS - {"replicas", "max_ongoing_requests", "stats_period_s",
                                          "num_cpus", "num_gpus"}
    if unknown:
        raise ValueError(f"unknown args for the forkserve application: {sorted(unknown)}")
    fields = {k: v for k, v in args.items() if k in _SPEC_FIELDS}
    if "model_path" not in fields:  # as `forkserve serve`: the demo model, on the CPU
        from forkserve.backend.torch import find_smollm2_gguf
        fields["model_path"] = str(find_smollm2_gguf())
        fields.setdefault("device", "cpu")
    fields["loras"] = tuple(sorted(dict(fields.get("loras") or {}).items()))
    spec = ReplicaSpec(**fields)
    return build_application(spec, replicas=int(args.get("replicas", 2)),
                             max_ongoing_requests=int(args.get("max_ongoing_requests",
                                                               DEFAULT_MAX_ONGOING)),
                             stats_period_s=float(args.get("stats_period_s",
                                                           DEFAULT_STATS_PERIOD_S)),
                             num_cpus=float(args.get("num_cpus", 1.0)),
                             num_gpus=float(args.get("num_gpus", 0.0)))
