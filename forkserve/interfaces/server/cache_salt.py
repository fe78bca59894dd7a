"""A request's prefix-cache trust boundary: its tenant plus an optional ``cache_salt``.

Pages are shared only between requests of one ``CacheSalt`` (control/prefix_index.py):

* no ``cache_salt``: the tenant's own boundary — its requests share pages with each other,
  never with another tenant's;
* ``cache_salt: "S"``: a narrower boundary inside the tenant (vLLM's and TensorRT-LLM's
  per-request salt: e.g. one per end user of an application behind one key);
* ``cache_salt: "public:NAME"``: the named public prefix NAME, shared across tenants — only
  for names the operator declared (``--public-prefix NAME``); the explicit opt-in for a
  system prompt that is not secret.

The salt is validated before anything reaches the engine (vLLM learned that an unchecked
salt can take the engine down): non-empty, at most ``MAX_SALT_CHARS`` characters, printable.
A bad one is a 400 that changes no state.
"""
from __future__ import annotations

from typing import AbstractSet

from forkserve.control.prefix_index import CacheSalt
from forkserve.interfaces.server.errors import APIError

MAX_SALT_CHARS = 256
PUBLIC_PREFIX = "public:"


def cache_salt(tenant: str, raw: str | None, public_names: AbstractSet[str]) -> CacheSalt:
    """The boundary of a request of ``tenant`` whose body carried ``cache_salt = raw``."""
    if raw is None:
        return CacheSalt(tenant)
    if not raw:
        raise APIError(400, "cache_salt must be non-empty (omit it for the tenant's own cache)",
                       param="cache_salt")
    if len(raw) > MAX_SALT_CHARS:
        raise APIError(400, f"cache_salt is {len(raw)} characters; at most {MAX_SALT_CHARS}",
                       param="cache_salt")
    if not raw.isprintable():
        raise APIError(400, "cache_salt must be printable text (no control characters)",
                       param="cache_salt")
    if raw.startswith(PUBLIC_PREFIX):
        name = raw[len(PUBLIC_PREFIX):]
        if name not in public_names:
            raise APIError(400, f"cache_salt names the public prefix {name!r}, which this server "
                                f"does not declare (--public-prefix)", param="cache_salt")
        return CacheSalt.public(name)
    return CacheSalt(tenant, raw)
