"""API keys: who is calling. Every route but ``/health`` needs ``Authorization: Bearer KEY``.

``ApiKeys`` maps each key to its tenant: the name that owns sessions, salts the prefix
cache and is charged against the limits (``tenancy.py``). ``--api-key KEY`` (repeatable)
gives each key a tenant of its own (``key-1``, ``key-2``, ... in order); ``--api-keys-file``
maps keys to tenants explicitly, one ``KEY TENANT`` per line (``#`` comments), so several
keys of one application share its sessions, cache and limits.

With no keys at all (loopback only, see ``access.py``) every caller is ``ANONYMOUS``: one
tenant, as before authentication existed.

Keys are compared with ``hmac.compare_digest`` against every configured key (no early
exit), so the time a refusal takes says nothing about how much of a key was right.
``ApiKeyAuth`` is a plain ASGI middleware (not ``BaseHTTPMiddleware``, which would buffer
streamed replies); it answers 401 itself, with the OpenAI error body, before any route
runs, and hands the tenant on in ``request.state.tenant``. The Ray Serve Frontend, whose
app Serve copies before any middleware could be added, calls ``authenticate`` per route.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Mapping

from fastapi import Depends, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from forkserve.interfaces.server.errors import APIError, error_response

ANONYMOUS = "anonymous"
# Routes a load balancer or orchestrator probes without credentials.
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class ApiKeys:
    """Key -> tenant. Immutable for the server's lifetime (restart to rotate keys)."""

    tenants: Mapping[str, str]

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ValueError("ApiKeys needs at least one key")
        for key, tenant in self.tenants.items():
            if not key or not key.isprintable() or " " in key:
                raise ValueError("an API key must be non-empty printable text without spaces")
            if not tenant or not tenant.isprintable():
                raise ValueError(f"tenant names must be non-empty printable text, got {tenant!r}")

    @classmethod
    def of_keys(cls, keys: list[str]) -> "ApiKeys":
        """``--api-key`` values: each key its own tenant, named by its position."""
        return cls({key: f"key-{i}" for i, key in enumerate(keys, 1)})

    @classmethod
    def load(cls, path: str | Path) -> "ApiKeys":
        """A keys file: ``KEY TENANT`` per line; blank lines and ``#`` comments skipped."""
        tenants: dict[str, str] = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'KEY TENANT'")
            if parts[0] in tenants:
                raise ValueError(f"{path}:{n}: the same key is listed twice")
            tenants[parts[0]] = parts[1]
        return cls(tenants)

    def merged(self, other: "ApiKeys | None") -> "ApiKeys":
        if other is None:
            return self
        if set(self.tenants) & set(other.tenants):
            raise ValueError("the same key is given twice")
        return ApiKeys({**self.tenants, **other.tenants})

    def tenant_of(self, presented: str) -> str | None:
        """The tenant of a presented key, None if it matches none. Constant time in the key:
        every configured key is compared, whatever matched."""
        found = None
        given = presented.encode()
        for key, tenant in self.tenants.items():
            if hmac.compare_digest(key.encode(), given):
                found = tenant
        return found


def authenticate(keys: ApiKeys | None, authorization: str | None) -> str:
    """The tenant of a request's ``Authorization`` header; raises the 401 ``APIError``."""
    if keys is None:
        return ANONYMOUS
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("missing API key (send 'Authorization: Bearer KEY')")
    tenant = keys.tenant_of(token.strip())
    if tenant is None:
        raise _unauthorized("invalid API key")
    return tenant


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "AuthenticationError", headers={"WWW-Authenticate": "Bearer"})


class ApiKeyAuth:
    """ASGI middleware: 401 for a missing or unknown key; the tenant into the request's state."""

    def __init__(self, app: ASGIApp, keys: ApiKeys | None) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                       if k.lower() == b"authorization"),
                      None)
        try:
            tenant = authenticate(self.keys, header)
        except APIError as e:
            await error_response(e.status, e.message, e.type,
                                 headers=e.headers)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def tenant_of(request: Request) -> str:
    """The authenticated tenant of a request (set by ``ApiKeyAuth``)."""
    return request.state.tenant


# A route parameter ``tenant: TenantDep`` receives the caller's tenant.
TenantDep = Annotated[str, Depends(tenant_of)]
