"""The ``forkserve`` command: ``serve``, ``demo``, ``bench fanout|react|mapreduce``.

A user error (a bad flag or path, a checkpoint the loaders refuse) is one line on stderr
and exit status 2, never a traceback; Ctrl-C ends the command quietly with status 130
(the shell's 128 + SIGINT).
"""
from __future__ import annotations

import sys

from forkserve.interfaces.usage import ArgumentParser, UsageError

COMMANDS = ("serve", "demo", "bench")
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "forkserve" + (f" {argv[0]}" if argv and argv[0] in COMMANDS else "")
    try:
        return _run(argv)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(argv: list[str]) -> int:
    ap = ArgumentParser(
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
        return EXIT_USAGE
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
            ap.parse_args(argv)  # raises the usage error
        if rest[0] == "fanout":
            from forkserve.bench.fanout import main as fanout_main
            return fanout_main(rest[1:])
        from forkserve.bench.multilora import main as multilora_main
        return multilora_main(rest)
    ap.parse_args(argv)  # an unknown command: raises the usage error
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
