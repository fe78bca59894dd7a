"""Tenancy: which tenant owns which engine session, under which public id, within which limits.

The Engine knows nothing of tenants: its session ids are small sequential integers. The
server never shows them. A branch session is exposed under a random 128-bit URL-safe id
bound to the tenant that opened it; a request of any other tenant for that id gets the same
404 as for an id that never existed (no existence oracle). OpenAI choices are sessions too
(never exposed), owned for as long as their generation runs, so they count against the
tenant's limits.

Every session is opened with its request's ``CacheSalt`` (``cache_salt.py``), so its pages
are matched and published only within its tenant's boundary.

Lifetime: an entry is made by ``open`` and dropped by ``close``; a session the engine
worker closed on its own (an OpenAI choice that finished, a branch session whose lease
expired) is pruned the next time its tenant is looked at, or at any ``open`` — engine ids
are never reused, so a stale entry can never name another session. Engine thread only, like
the engine it describes: no locks.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import AbstractSet, Callable, Sequence, TypeVar

from forkserve.control.prefix_index import CacheSalt
from forkserve.engine import Engine
from forkserve.interfaces.server.cache_salt import cache_salt
from forkserve.interfaces.server.errors import APIError
from forkserve.interfaces.server.limits import Demand, TenantLimits, TenantMeter

PUBLIC_ID_BYTES = 16  # 128 bits
T = TypeVar("T")


@dataclass(frozen=True)
class Opened:
    engine_id: int
    public_id: str | None   # None: an OpenAI choice, never exposed
    cached_tokens: int      # prompt tokens served from the prefix cache at open


@dataclass(frozen=True)
class Owned:
    public_id: str
    engine_id: int


class Tenancy:
    def __init__(self, engine: Engine, limits: TenantLimits = TenantLimits(),
                 public_prefixes: AbstractSet[str] = frozenset(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.limits = limits
        self.public_prefixes = frozenset(public_prefixes)
        self._clock = clock
        self._owner: dict[int, str] = {}          # engine id -> tenant, every session opened here
        self._by_public: dict[str, int] = {}      # public id -> engine id (branch sessions)
        self._public_of: dict[int, str] = {}      # engine id -> public id
        self._meters: dict[str, TenantMeter] = {}

    # ------------------------------------------------------------ any thread (pure)
    def salt(self, tenant: str, raw: str | None) -> CacheSalt:
        """The request's validated trust boundary (400 for a bad ``cache_salt``)."""
        return cache_salt(tenant, raw, self.public_prefixes)

    # ------------------------------------------------------------ engine thread only
    def open(self, tenant: str, tokens: Sequence[int], adapter: int | None, salt: CacheSalt,
             max_tokens: int, *, expose: bool) -> Opened:
        """Check the tenant's limits, open the session in ``salt``'s boundary, own it.
        ``expose``: a branch session, reachable by a new public id."""
        self._prune()
        p = self.engine.pool.page_size
        need = len(tokens) + max_tokens
        sid = self.admit(tenant, Demand(1, need, need, -(-need // p)),
                         lambda: self.engine.open(tokens, adapter=adapter, salt=salt).id)
        self._owner[sid] = tenant
        public_id = None
        if expose:
            public_id = secrets.token_urlsafe(PUBLIC_ID_BYTES)
            self._by_public[public_id] = sid
            self._public_of[sid] = public_id
        root = self.engine.node(sid, self.engine.tip(sid))
        return Opened(sid, public_id, root.kv_len)

    def admit(self, tenant: str, demand: Demand, action: Callable[[], T]) -> T:
        """Run ``action`` if ``demand`` fits the tenant's limits (else the 400/429, nothing
        run), and charge it only once the action succeeded: a refused or failed request
        costs nothing."""
        meter = self._meters.get(tenant)
        now = self._clock()
        if meter is None:
            meter = self._meters[tenant] = TenantMeter(self.limits, now)
        live = self._live(tenant)
        meter.check(demand, sessions=len(live), pages=self._pages_held(live), now=now)
        result = action()
        meter.charge(demand.tokens, now)
        return result

    def grow(self, tenant: str, new_tokens: int, action: Callable[[], T]) -> T:
        """Admit a verb that adds ``new_tokens`` (a segment, or a completion budget) to one
        of the tenant's sessions: its pages may grow by their pages plus a partial one."""
        p = self.engine.pool.page_size
        pages = -(-new_tokens // p) + 1 if new_tokens else 0
        return self.admit(tenant, Demand(0, new_tokens, new_tokens, pages), action)

    def resolve(self, tenant: str, public_id: str) -> int:
        """The engine id behind a tenant's public id; 404 alike for unknown and not-yours."""
        sid = self._by_public.get(public_id)
        if sid is None or self._owner.get(sid) != tenant or sid not in self.engine.sessions:
            raise APIError(404, f"session {public_id!r} not found", "NotFoundError", "session_id")
        return sid

    def public_id(self, engine_id: int) -> str:
        return self._public_of[engine_id]

    def sessions_of(self, tenant: str) -> list[Owned]:
        """The tenant's open branch sessions, oldest first."""
        return [Owned(self._public_of[sid], sid) for sid in sorted(self._live(tenant)) if sid in self._public_of]

    def forget(self, engine_id: int) -> None:
        """Drop a session the server is closing (or has closed)."""
        self._owner.pop(engine_id, None)
        public_id = self._public_of.pop(engine_id, None)
        if public_id is not None:
            del self._by_public[public_id]

    # ------------------------------------------------------------ internals
    def _live(self, tenant: str) -> list[int]:
        owned = [sid for sid, t in self._owner.items() if t == tenant]
        for sid in owned:
            if sid not in self.engine.sessions:
                self.forget(sid)
        return [sid for sid in owned if sid in self.engine.sessions]

    def _prune(self) -> None:
        for sid in [s for s in self._owner if s not in self.engine.sessions]:
            self.forget(sid)

    def _pages_held(self, sessions: list[int]) -> int:
        """Distinct base-pool pages the sessions' live tables hold (an aliased page once)."""
        pages: set[int] = set()
        for sid in sessions:
            for node in self.engine.sessions[sid].tree.nodes.values():
                if node.table is not None and node.live:
                    pages.update(node.table.base.pages)
        return len(pages)
