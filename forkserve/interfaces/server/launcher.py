"""Run the server on a loopback port in a background thread (tests, benchmarks, examples).

The caller keeps the ``ServedModel``, so it can check the engine's own accounting after
the clients are done (``running.on_engine(lambda eng: eng.cache_stats().base.used)``).
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from forkserve.engine import Engine
from forkserve.interfaces.server.access import DEFAULT_ACCESS, AccessConfig
from forkserve.interfaces.server.app import KEEP_ALIVE_S, create_app
from forkserve.interfaces.server.served_model import ServedModel
from forkserve.interfaces.server.state import ServerState

T = TypeVar("T")


@dataclass(frozen=True)
class RunningServer:
    url: str                 # http://127.0.0.1:PORT
    model: ServedModel
    state: ServerState       # the app's: its worker, metrics and tenancy, as the routes see them

    def on_engine(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread (the engine is not thread-safe)."""
        return self.state.worker.run_sync(lambda: fn(self.model.engine))


@contextlib.contextmanager
def serve_in_thread(model: ServedModel, *, session_ttl_s: float = 600.0,
                    access: AccessConfig = DEFAULT_ACCESS,
                    startup_timeout_s: float = 30.0) -> Iterator[RunningServer]:
    import uvicorn

    app = create_app(model, session_ttl_s=session_ttl_s, access=access)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                          timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="forkserve-http",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", model, app.state.forkserve)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
