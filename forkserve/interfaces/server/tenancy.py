"""Tenancy: which tenant owns which engine session, under which public id, within which limits.

The Engine knows nothing of tenants: its session ids are small sequential integers. The
server never shows them: a branch session is exposed under a public id bound to the tenant
that opened it (``session_ids.py``: random, 404 for anyone else). OpenAI choices are
sessions too (never exposed), owned for as long as their generation runs, so they count
against the tenant's limits.

Every session is opened with its request's ``CacheSalt`` (``cache_salt.py``), so its pages
are matched and published only within its tenant's boundary.

Lifetime: an entry is made by ``open`` and dropped by ``close``; a session the engine
worker closed on its own (an OpenAI choice that finished, a branch session whose lease
expired) is pruned the next time its tenant is looked at, or at any ``open`` — engine ids
are never reused, so a stale entry can never name another session. Engine thread only, like
the engine it describes: no locks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AbstractSet, Callable, Sequence, TypeVar

from forkserve.adapter_key import AdapterId
from forkserve.control.layout_policy import NOTHING_QUEUED, Queued
from forkserve.control.prefix_index import CacheSalt
from forkserve.engine import Engine
from forkserve.interfaces.server.cache_salt import cache_salt
from forkserve.interfaces.server.errors import APIError
from forkserve.interfaces.server.limits import (
    UNLIMITED,
    Demand,
    TenantLimits,
    TenantMeter,
)
from forkserve.interfaces.server.session_ids import PublicSessionIds

T = TypeVar("T")


@dataclass(frozen=True)
class Opened:
    engine_id: int
    cached_tokens: int  # prompt tokens served from the prefix cache at open


@dataclass(frozen=True)
class Owned:
    public_id: str
    engine_id: int


class Tenancy:
    def __init__(self, engine: Engine, limits: TenantLimits = UNLIMITED,
                 public_prefixes: AbstractSet[str] = frozenset(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.limits = limits
        self.public_prefixes = frozenset(public_prefixes)
        self._clock = clock
        self._owner: dict[int, str] = {}  # engine id -> tenant, every session opened here
        self._public = PublicSessionIds()   # branch sessions only
        self._meters: dict[str, TenantMeter] = {}

    # ------------------------------------------------------------ any thread (pure)
    def salt(self, tenant: str, raw: str | None) -> CacheSalt:
        """The request's validated trust boundary (400 for a bad ``cache_salt``)."""
        return cache_salt(tenant, raw, self.public_prefixes)

    # ------------------------------------------------------------ engine thread only
    def open(self, tenant: str, tokens: Sequence[int], adapter: AdapterId | None, salt: CacheSalt,
             max_tokens: int, *, expose: bool, reuse_prefix: bool = True,
             queued: Queued = NOTHING_QUEUED) -> Opened:
        """Check the tenant's limits, open the session in ``salt``'s boundary, own it.
        ``expose``: a branch session, reachable by a new public id; ``reuse_prefix`` and
        ``queued`` (the opens waiting behind it): as ``Engine.open``'s."""
        self._prune()
        p = self.engine.config.page_size
        need = len(tokens) + max_tokens
        sid = self.admit(tenant, Demand(1, need, need, -(-need // p)),
                         lambda: self.engine.open(tokens, adapter=adapter, salt=salt,
                                                   reuse_prefix=reuse_prefix, queued=queued).id)
        self._owner[sid] = tenant
        if expose:
            self._public.bind(sid, tenant)
        return Opened(sid, self.engine.node(sid, self.engine.tip(sid)).kv_len)

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
        p = self.engine.config.page_size
        pages = -(-new_tokens // p) + 1 if new_tokens else 0
        return self.admit(tenant, Demand(0, new_tokens, new_tokens, pages), action)

    def resolve(self, tenant: str, public_id: str) -> int:
        """The engine id behind a tenant's public id; 404 alike for unknown and not-yours."""
        sid = self._public.resolve(tenant, public_id)
        if not self.engine.has_session(sid):  # its lease expired: the worker closed it
            self.forget(sid)
            raise APIError(404, f"session {public_id!r} not found", "NotFoundError", "session_id")
        return sid

    def public_id(self, engine_id: int) -> str:
        return self._public.public_id(engine_id)

    def sessions_of(self, tenant: str) -> list[Owned]:
        """The tenant's open branch sessions, oldest first."""
        self._live(tenant)
        return [Owned(public, sid) for public, sid in self._public.of_tenant(tenant)]

    def forget(self, engine_id: int) -> None:
        """Drop a session the server is closing (or has closed)."""
        self._owner.pop(engine_id, None)
        self._public.forget(engine_id)

    # ------------------------------------------------------------ internals
    def _live(self, tenant: str) -> list[int]:
        owned = [sid for sid, t in self._owner.items() if t == tenant]
        for sid in owned:
            if not self.engine.has_session(sid):
                self.forget(sid)
        return [sid for sid in owned if self.engine.has_session(sid)]

    def _prune(self) -> None:
        for sid in [s for s in self._owner if not self.engine.has_session(s)]:
            self.forget(sid)

    def _pages_held(self, sessions: list[int]) -> int:
        """Distinct base-pool pages the sessions' live tables hold (an aliased page once)."""
        held = (self.engine.session_pages(sid).base_held for sid in sessions)
        return len(frozenset().union(*held))
