"""PublicSessionIds: the ids callers see for their sessions, each bound to one tenant.

An internal id (an engine session id, or a Ray Serve tree id) is a small sequential
integer: anyone could guess the next. A caller sees instead a random 128-bit URL-safe id,
valid only for the tenant that opened it; ``resolve`` answers the same 404 for an id that
never existed and for another tenant's (no existence oracle: 403 would confirm it exists).

Lifetime: ``bind`` at open, ``forget`` at close (or when the owner learns the session
ended on its own). Not thread-safe: the one-process server touches it on the engine thread
only, the Ray Serve Frontend on its event loop only.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from forkserve.interfaces.server.errors import APIError

PUBLIC_ID_BYTES = 16  # 128 bits, as token_urlsafe's base64: 22 characters


@dataclass(frozen=True)
class Binding:
    internal: int
    tenant: str


class PublicSessionIds:
    def __init__(self) -> None:
        self._by_public: dict[str, Binding] = {}
        self._public_of: dict[int, str] = {}

    def bind(self, internal: int, tenant: str) -> str:
        public = secrets.token_urlsafe(PUBLIC_ID_BYTES)
        self._by_public[public] = Binding(internal, tenant)
        self._public_of[internal] = public
        return public

    def resolve(self, tenant: str, public: str) -> int:
        binding = self._by_public.get(public)
        if binding is None or binding.tenant != tenant:
            raise APIError(404, f"session {public!r} not found", "NotFoundError", "session_id")
        return binding.internal

    def public_id(self, internal: int) -> str:
        return self._public_of[internal]

    def of_tenant(self, tenant: str) -> list[tuple[str, int]]:
        """(public id, internal id) of the tenant's sessions, oldest first."""
        return sorted(((p, b.internal) for p, b in self._by_public.items() if b.tenant == tenant),
                      key=lambda pair: pair[1])

    def forget(self, internal: int) -> None:
        public = self._public_of.pop(internal, None)
        if public is not None:
            del self._by_public[public]
