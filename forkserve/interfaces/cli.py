"""The ``forkserve`` command: ``serve``, ``demo``, ``bench fanout|react|mapreduce``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="forkserve", description="Branch-aware LLM serving for agents")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server with branch endpoints",
                   add_help=False)
    sub.add_parser("demo", help="LoRA agents over a shared context on a real model, on CPU",
                   add_help=False)
    bench = sub.add_parser("bench", help="benchmark workloads of workloads.md")
    bench.add_argument("workload", choices=["fanout", "react", "mapreduce"])
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
            fanout_main(rest[1:])
        else:
            from forkserve.bench.multilora import main as multilora_main
            multilora_main(rest)
        return 0
    ap.parse_args(argv)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
