"""``forkserve serve --replicas N``: the Ray Serve deployment of ForkServe.

    forkserve serve --replicas 2 [--model PATH] [--lora NAME=PATH ...] [--layout ...]
                    [--ray-address auto] [--gpus-per-replica 1] [--cpus-per-replica 1]
                    [--max-ongoing-requests 256] [--stats-period 2.0]

Every option of the one-process ``forkserve serve`` means the same here (they are parsed
by its own parser); the options above are the Ray ones. With no ``--ray-address`` a local
Ray instance starts without its dashboard; when ``--host`` is a loopback address, Ray's node
address, its dashboard host and Serve's HTTP proxy are the loopback address too. Ray 2.60
still opens gRPC ports of the GCS, raylet and workers on every interface (it has no option
to bind them): docs/SCALE_OUT.md lists them and how to firewall them. Ctrl-C shuts Serve and
Ray down and exits 130, without a traceback. The same application deploys from a Serve
config file: ``serve run forkserve/interfaces/ray_serve/serve_config.yaml``.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from forkserve.interfaces.ray_serve.deployments import (
    DEFAULT_MAX_ONGOING,
    DEFAULT_STATS_PERIOD_S,
    build_application,
)
from forkserve.interfaces.ray_serve.engine_replica import ReplicaSpec
from forkserve.interfaces.server import preflight
from forkserve.interfaces.server.access import checked_access
from forkserve.interfaces.server.app import build_parser as server_parser
from forkserve.interfaces.server.limits import UNLIMITED
from forkserve.interfaces.server.served_model import served_name
from forkserve.interfaces.server.sharing_cost import load_sharing_cost
from forkserve.interfaces.usage import ArgumentParser, UsageError

log = logging.getLogger("forkserve.ray_serve")
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"--replicas takes a positive count, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="forkserve serve", add_help=False,
                                 description="ForkServe on Ray Serve: N engine replicas, "
                                             "tree-sticky routing")
    ap.add_argument("--replicas", type=_positive, required=True,
                    help="engine replicas (one per GPU)")
    ap.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    ap.add_argument("--gpus-per-replica", type=float,
                    help="GPUs per engine replica (default: 1 when the driver sees CUDA, else 0)")
    ap.add_argument("--cpus-per-replica", type=float, default=1.0,
                    help="CPUs Ray reserves per engine replica (default: 1)")
    ap.add_argument("--torch-threads", type=int, help="torch threads per CPU replica")
    ap.add_argument("--max-ongoing-requests", type=int, default=DEFAULT_MAX_ONGOING,
                    help="concurrent calls per engine replica (Serve's default of 5 starves the "
                         "batch)")
    ap.add_argument("--stats-period", type=float, default=DEFAULT_STATS_PERIOD_S,
                    help="seconds between replicas' routing-stats reports")
    return ap


def local_ray_options(host: str) -> dict[str, object]:
    """``ray.init`` options of a local Ray behind ``--host``: no dashboard; on a loopback
    host, the node address and dashboard host are loopback as well."""
    options: dict[str, object] = {"address": "local", "include_dashboard": False}
    if host in _LOOPBACK:
        options.update(_node_ip_address="127.0.0.1", dashboard_host="127.0.0.1")
    return options


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ours, rest = parser.parse_known_args(argv)
    if {"-h", "--help"} & set(rest):
        parser.print_help()  # the Ray options, then every option of the one-process server
        print()
    sp = server_parser()
    args = sp.parse_args(rest)
    access = checked_access(args)
    if access.limits != UNLIMITED:
        # The Frontend does not see the replicas' pages: refuse rather than ignore a limit.
        raise UsageError("per-key limits are not enforced with --replicas yet")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_path = args.model
    if model_path is None:
        from forkserve.backend.torch import find_smollm2_gguf
        model_path = str(find_smollm2_gguf())
        args.device = args.device or "cpu"
    # The replicas load the model: a bad path or adapter is one line here, before Ray starts.
    preflight.check_model_path(model_path)
    preflight.check_adapters(args.lora, served_name(model_path, args.served_model_name))
    spec = ReplicaSpec(model_path=str(model_path), loras=tuple(args.lora),
                       served_model_name=args.served_model_name,
                       layout=args.layout, share_base=args.share_base, system=args.system,
                       num_pages=args.num_pages,
                       page_size=args.page_size,
                       device=args.device, dtype=args.dtype, attention=args.attention,
                       cuda_graphs=not args.no_cuda_graphs, session_ttl_s=args.session_ttl,
                       torch_threads=ours.torch_threads)
    try:
        config = spec.config()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.quality_report:
        spec = replace(spec, sharing_cost=load_sharing_cost(args.quality_report, config))
    import ray
    from ray import serve

    gpus = ours.gpus_per_replica
    if gpus is None:
        import torch
        gpus = 1.0 if torch.cuda.is_available() and args.device != "cpu" else 0.0
    ray.init(**({"address": ours.ray_address} if ours.ray_address
                else local_ray_options(args.host)))
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_application(spec, replicas=ours.replicas,
                                max_ongoing_requests=ours.max_ongoing_requests,
                                stats_period_s=ours.stats_period, num_cpus=ours.cpus_per_replica,
                                num_gpus=gpus, access=access)
        log.info("deploying %d engine replicas of %s on Ray Serve at http://%s:%d", ours.replicas,
                 model_path, args.host, args.port)
        serve.run(app, name="forkserve", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        # Serve re-raises Ctrl-C out of its wait loop so the caller shuts down: that is
        # the whole of a clean exit here, not an error.
        log.info("interrupted: shutting down the replicas")
        if ours.ray_address:  # a joined cluster keeps running, without this application
            serve.delete("forkserve")
        else:
            serve.shutdown()
        return 130
    finally:
        ray.shutdown()
    return 0
