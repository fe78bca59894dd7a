"""Errors as OpenAI-style JSON bodies: ``{"error": {"message", "type", "param", "code"}}``.

Engine errors carry their own ``http_status`` (4xx for bad requests); pydantic validation
errors, malformed JSON included, are 400 as in the OpenAI API; anything unexpected is a
500 with the traceback logged, never a crash of the server.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forkserve.errors import ForkServeError
from forkserve.interfaces.server.disconnect import ClientDisconnected

log = logging.getLogger("forkserve.server")


class APIError(Exception):
    """A request the server refuses before it reaches the engine."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.headers = headers  # e.g. Retry-After on a 429, WWW-Authenticate on a 401


def error_response(status: int, message: str, type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": status}},
                        status_code=status, headers=headers)


def backend_error_status(exc: Exception) -> int | None:
    """4xx for the torch backend's typed request errors (ValueError / KeyError subclasses)."""
    from forkserve.backend.torch.errors import TorchBackendError, UnknownAdapterError

    if isinstance(exc, UnknownAdapterError):
        return 404
    if isinstance(exc, TorchBackendError):
        return 400
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> JSONResponse:
        return error_response(exc.http_status, str(exc), "ClientDisconnected")

    @app.exception_handler(ForkServeError)
    async def _engine(_: Request, exc: ForkServeError) -> JSONResponse:
        return error_response(exc.http_status, str(exc), type(exc).__name__)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors)
        return error_response(400, message or "invalid request", "BadRequestError", where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "HTTPError")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        status = backend_error_status(exc)
        if status is not None:
            return error_response(status, str(exc), type(exc).__name__)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")
