"""The compact summary an Engine replica publishes through ``record_routing_stats()``.

Serve polls each replica every ``request_routing_stats_period_s`` and hands the dict to
every router (``RunningReplica.routing_stats``). It says what a new tree would find there:

* ``prefix_pages``: one 64-bit hash per published page of the prefix index, chained over
  the page's whole prefix (``page_hashes``), so a prompt's matched prefix on a replica is
  the run of its own chained hashes found in the set: no tokens cross the wire.
* ``residual_pages``: pages per adapter name (``adapter_names`` maps each ``AdapterKey``,
  as ``PublishedPage.adapter`` holds it, to the name clients send),
  resident in the residual cache (the disaggregated layout) or under the adapter's
  namespace of the unified cache.
* live pages (held by sessions: the cache alone is an asset, not load), free pages, the page
  size, recent tokens per second (prefill + decode), running generations and queued
  commands: load beyond Serve's queue length (placement.py).

Hashes are blake2b, not ``hash()``: the Frontend and every replica must agree across
processes whatever their PYTHONHASHSEED. A page published under a ``CacheSalt`` other than
``UNSALTED`` is chained from a root that includes the salt, so a prompt of another trust
boundary never matches it: routing cannot tell one tenant where another's prompts are.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from forkserve.adapter_key import AdapterKey
from forkserve.engine import UNSALTED, CacheSalt, PublishedPage

BASE_SCOPE = ""  # the namespace key of base-model pages; an adapter's is its name


def _digest(parent: bytes, page: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=8)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in page))
    return h.digest()


def _root(scope: str, salt: CacheSalt) -> bytes:
    seed = scope if salt == UNSALTED else json.dumps([scope, salt.tenant, salt.name])
    return hashlib.blake2b(seed.encode(), digest_size=8).digest()


def page_hashes(scope: str, tokens: Sequence[int], page_size: int,
                salt: CacheSalt = UNSALTED) -> tuple[int, ...]:
    """Chained hashes of the full pages of ``tokens`` under ``scope`` (BASE_SCOPE or an
    adapter name) and ``salt``: hash i covers tokens[: (i + 1) * page_size]."""
    out, h = [], _root(scope, salt)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = _digest(h, tokens[start:start + page_size])
        out.append(int.from_bytes(h, "little"))
    return tuple(out)


def matched_pages(prompt: Sequence[int], published: frozenset[int]) -> int:
    """How many leading pages of a prompt (its chained hashes) a replica has published."""
    n = 0
    for h in prompt:
        if h not in published:
            break
        n += 1
    return n


@dataclass(frozen=True)
class ReplicaSummary:
    prefix_pages: frozenset[int]
    residual_pages: Mapping[str, int]
    free_pages: int
    running: int
    waiting: int
    live_pages: int = 0            # pages some session holds (cache-only pages excluded)
    page_size: int = 16
    token_rate: float = 0.0        # prefill + decode tokens per second, the engine worker's window

    def to_dict(self) -> dict[str, Any]:
        return {"prefix_pages": sorted(self.prefix_pages),
                "residual_pages": dict(self.residual_pages),
                "free_pages": self.free_pages, "running": self.running, "waiting": self.waiting,
                "live_pages": self.live_pages, "page_size": self.page_size,
                "token_rate": self.token_rate}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicaSummary:
        """A replica not polled yet publishes ``{}``: it reads as empty and idle."""
        return cls(frozenset(d.get("prefix_pages", ())), dict(d.get("residual_pages", {})),
                   int(d.get("free_pages", 0)), int(d.get("running", 0)), int(d.get("waiting", 0)),
                   int(d.get("live_pages", 0)), int(d.get("page_size", 16)),
                   float(d.get("token_rate", 0.0)))


def _scope(page: PublishedPage, adapter_names: Mapping[AdapterKey, str]) -> str:
    if page.adapter is None:
        return BASE_SCOPE
    return adapter_names.get(page.adapter, page.adapter)


def index_hashes(pages: Sequence[PublishedPage], page_size: int,
                 adapter_names: Mapping[AdapterKey, str]) -> frozenset[int]:
    """The chained hash of every published page of the base tree (``Engine.published_pages``
    lists parents before children, so each page's hash extends its parent's, memoised by
    prefix)."""
    p = page_size
    chain: dict[tuple[str, CacheSalt, tuple[int, ...]], bytes] = {}
    for entry in pages:
        if entry.residual:
            continue
        scope = _scope(entry, adapter_names)
        parent = chain.get((scope, entry.salt, entry.prefix[:-p])) or _root(scope, entry.salt)
        chain[(scope, entry.salt, entry.prefix)] = _digest(parent, entry.prefix[-p:])
    return frozenset(int.from_bytes(h, "little") for h in chain.values())


def pages_per_adapter(pages: Sequence[PublishedPage],
                      adapter_names: Mapping[AdapterKey, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for page in pages:
        if page.adapter is not None:
            name = _scope(page, adapter_names)
            counts[name] = counts.get(name, 0) + 1
    return counts

