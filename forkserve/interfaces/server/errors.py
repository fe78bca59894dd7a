"""Errors as OpenAI-style JSON bodies: ``{"error": {"message", "type", "param", "code"}}``.

Engine errors carry their own ``http_status`` (4xx for bad requests); pydantic validation
errors, malformed JSON included, are 400 as in the OpenAI API; anything unexpected is a
500 with the traceback logged, never a crash of the server.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forkserve.errors import ForkServeError
from forkserve.interfaces.server.disconnect import ClientDisconnected

log = logging.getLogger("forkserve.server")


# FastAPI's answer to a body that fails before JSON decoding (invalid UTF-8): JSON errors
# come as a RequestValidationError, this one as a bare HTTPException with this detail.
_FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"


class APIError(Exception):
    """A request the server refuses before it reaches the engine."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.headers = headers  # e.g. Retry-After on a 429, WWW-Authenticate on a 401


def error_response(status: int, message: str, type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param,
                                   "code": status}},
                        status_code=status, headers=headers)


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A request validation failure as (message, param), in the client's terms: fields are
    named as in its JSON (``messages.0.content``, not ``body.messages.0.content``), and a
    body that is not JSON says so, where FastAPI would name a character offset as a field."""
    for e in errors:
        if e.get("type") == "json_invalid":
            loc = tuple(e.get("loc", ()))
            at = f" at character {loc[-1]}" if len(loc) > 1 else ""
            detail = (e.get("ctx") or {}).get("error")
            return f"the request body is not valid JSON ({detail or 'decode error'}{at})", None
    parts, param = [], None
    for e in errors:
        field = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        if not field and e.get("type") == "value_error":  # a rule across fields: its own words
            parts.append(str(e.get("msg")).removeprefix("Value error, "))
            continue
        if not field:  # the body itself: missing, or not an object
            missing = e.get("type") == "missing"
            parts.append("the request body is missing; send a JSON object" if missing
                         else "the request body must be a JSON object")
            continue
        param = param or field
        parts.append(f"{field}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def backend_error_status(exc: Exception) -> int | None:
    """4xx for the torch backend's typed request errors (ValueError / KeyError subclasses)."""
    from forkserve.backend.torch.errors import TorchBackendError, UnknownAdapterError

    if isinstance(exc, UnknownAdapterError):
        return 404
    if isinstance(exc, TorchBackendError):
        return 400
    return None


def stream_error(exc: Exception) -> dict[str, Any]:
    """The in-band error of a stream whose headers (200) are already sent: the same body
    a plain response would have had."""
    if isinstance(exc, APIError):
        status, message, kind = exc.status, exc.message, exc.type
    elif isinstance(exc, (ForkServeError, ClientDisconnected)):
        status, message, kind = exc.http_status, str(exc), type(exc).__name__
    else:
        status = backend_error_status(exc) or 500
        if status == 500:
            log.error("stream failed", exc_info=exc)
        message, kind = str(exc), type(exc).__name__
    return {"error": {"message": message, "type": kind, "param": getattr(exc, "param", None),
                      "code": status}}


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
        message, param = validation_message(exc.errors())
        return error_response(400, message, "BadRequestError", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _FASTAPI_BODY_PARSE_ERROR:
            return error_response(400, "the request body is not valid JSON (not UTF-8 text)",
                                  "BadRequestError")
        return error_response(exc.status_code, str(exc.detail), "HTTPError")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        status = backend_error_status(exc)
        if status is not None:
            return error_response(status, str(exc), type(exc).__name__)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              "InternalServerError")
