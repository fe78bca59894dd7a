"""ServerState: what every route needs, hung on ``app.state.forkserve``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from forkserve.interfaces.server.engine_worker import EngineWorker
from forkserve.interfaces.server.metrics import ServerMetrics
from forkserve.interfaces.server.served_model import ServedModel
from forkserve.interfaces.server.tenancy import Tenancy


@dataclass(frozen=True)
class ServerState:
    model: ServedModel
    worker: EngineWorker
    metrics: ServerMetrics
    tenancy: Tenancy  # engine thread only, like the engine


def server_state(request: Request) -> ServerState:
    return request.app.state.forkserve


# A route parameter ``st: StateDep`` receives the server's state.
StateDep = Annotated[ServerState, Depends(server_state)]
