"""The ``forkserve`` command: ``serve``, ``demo``, ``bench fanout|react|mapreduce``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="forkserve", description="Branch-aware LLM serving for agents",
        epilog="'forkserve COMMAND --help' shows each command's flags. The benchmark workloads "
               "are specified in docs/WORKLOADS.md.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server with branch endpoints",
                   add_help=False)
    sub.add_parser("demo", help="LoRA agents over a shared context on a real model, on CPU",
                   add_help=False)
    bench = sub.add_parser(
        "bench", help="benchmark workloads of docs/WORKLOADS.md (--tiny: minutes on a CPU)",
        description="Run one workload of docs/WORKLOADS.md, every system side by side; writes "
                    "JSON and PNG to --out (default ./forkserve-bench-results) and exits 1 if a "
                    "run failed. 'forkserve bench WORKLOAD --help' lists its flags.",
        epilog="examples: forkserve bench fanout | forkserve bench react --tiny | "
               "forkserve bench mapreduce --tiny")
    bench.add_argument("workload", choices=["fanout", "react", "mapreduce"],
                       help="fanout: seed 000's cost-model table (MockBackend, seconds); react, "
                            "mapreduce: seed 001's multi-LoRA workloads (8B shape on a GPU, or "
                            "--tiny: a 2-layer model on the CPU)")
    if not argv:
        ap.print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        if any(a == "--replicas" or a.startswith("--replicas=") for a in rest):
            # Several engine replicas behind Ray Serve (forkserve/interfaces/ray_serve/).
            from forkserve.interfaces.ray_serve.launcher import main as ray_serve_main
            return ray_serve_main(rest)
        from forkserve.interfaces.server.app import main as serve_main
        return serve_main(rest)
    if command == "demo":
        from forkserve.interfaces.demo import main as demo_main
        return demo_main(rest)
    if command == "bench":
        if not rest or rest[0] not in ("fanout", "react", "mapreduce"):
            ap.parse_args(argv)  # prints the usage error
        if rest[0] == "fanout":
            from forkserve.bench.fanout import main as fanout_main
            return fanout_main(rest[1:])
        from forkserve.bench.multilora import main as multilora_main
        return multilora_main(rest)
    ap.parse_args(argv)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
