"""Per-tenant limits: a small policy (``TenantLimits``) and its per-tenant state (``TenantMeter``).

A tenant at a limit that clears with time or with its own requests ending gets 429 with
``Retry-After``; a request that could never fit (more tokens than one request, or than a
minute, may hold) is a 400, so a client's retry loop does not spin on it. Checks run before
the engine is touched, so a refused request changes nothing.

What each limit protects:

* ``max_sessions`` — engine sessions open at once (branch sessions and OpenAI choices):
  bounds scheduler and bookkeeping work;
* ``max_pages`` — KV pages of the base (or unified) pool the tenant's live sessions hold,
  plus what a new request can grow to (prompt + ``max_tokens``): with every tenant's
  ``max_pages`` summing to at most the pool, one tenant can never take the pages another's
  committed work needs (published pages nobody holds are evictable and not counted);
* ``max_tokens_per_request`` — prompt plus completion budget of one request;
* ``tokens_per_minute`` — a token bucket of that capacity refilled at that rate per minute,
  charged the new prompt tokens plus the completion budget when a request is admitted.

Lifetime: one ``TenantMeter`` per tenant, made on its first request, living as long as the
server; touched on the engine thread only (like the rest of the tenancy state).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from forkserve.interfaces.server.errors import APIError


@dataclass(frozen=True)
class TenantLimits:
    """None: unlimited. The same policy applies to every tenant."""

    max_sessions: int | None = None
    max_pages: int | None = None
    max_tokens_per_request: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_pages", "max_tokens_per_request", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


UNLIMITED = TenantLimits()


@dataclass(frozen=True)
class Demand:
    """What admitting one request would add for its tenant."""

    sessions: int        # sessions it opens
    tokens: int          # new prompt tokens + completion budget (charged per minute)
    request_tokens: int  # prompt + completion budget of the request (the per-request cap)
    pages: int           # base pages it can grow to


def rate_limited(message: str, retry_after_s: float) -> APIError:
    return APIError(429, message, "RateLimitError",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class TenantMeter:
    """One tenant's token bucket; sessions and pages are counted live from the engine."""

    def __init__(self, limits: TenantLimits, now: float) -> None:
        self.limits = limits
        self._tokens = float(limits.tokens_per_minute or 0)
        self._at = now

    def check(self, demand: Demand, *, sessions: int, pages: int, now: float) -> None:
        """Raise the 400/429 for a demand that does not fit now; change nothing."""
        lim = self.limits
        if (lim.max_tokens_per_request is not None
                and demand.request_tokens > lim.max_tokens_per_request):
            raise APIError(400, f"the request needs {demand.request_tokens} tokens (prompt + "
                                f"max_tokens); this key may use at most "
                                f"{lim.max_tokens_per_request} per request",
                           param="max_tokens")
        if lim.tokens_per_minute is not None and demand.tokens > lim.tokens_per_minute:
            raise APIError(400, f"the request needs {demand.tokens} tokens; this key may use at "
                                f"most {lim.tokens_per_minute} per minute", param="max_tokens")
        if lim.max_sessions is not None and sessions + demand.sessions > lim.max_sessions:
            raise rate_limited(f"this key has {sessions} sessions open; at most {lim.max_sessions} "
                               f"(close one, or wait for its generation to end)", 1.0)
        if lim.max_pages is not None and pages + demand.pages > lim.max_pages:
            raise rate_limited(f"this key's sessions hold {pages} KV pages and the request may "
                               f"grow by {demand.pages}; at most {lim.max_pages}", 1.0)
        if lim.tokens_per_minute is not None:
            available = self._available(now)
            if demand.tokens > available:
                rate = lim.tokens_per_minute / 60.0
                raise rate_limited(f"this key's budget of {lim.tokens_per_minute} tokens per "
                                   f"minute is spent", (demand.tokens - available) / rate)

    def charge(self, tokens: int, now: float) -> None:
        """Take an admitted request's tokens from the bucket (after ``check`` passed)."""
        if self.limits.tokens_per_minute is not None:
            self._tokens = self._available(now) - tokens
            self._at = now

    def _available(self, now: float) -> float:
        cap = float(self.limits.tokens_per_minute)
        return min(cap, self._tokens + (now - self._at) * cap / 60.0)
