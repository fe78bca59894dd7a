"""Request checks: every verb's arguments refused with a typed ``ForkServeError`` before the
Engine touches any state, so a bad request changes nothing and affects no other session.

``RequestChecks`` holds what the checks read (the config, the backend's adapter lookups, the
pools' sizes); it owns nothing and lives as long as its Engine. ``token_ids`` and ``count``
are the argument parsers the verbs share.
"""
from __future__ import annotations

import operator
from typing import Sequence

from forkserve.adapter_key import AdapterId
from forkserve.backend.capabilities import Capabilities
from forkserve.backend.protocol import Backend
from forkserve.config import ForkServeConfig
from forkserve.control.page_pool import PagePool
from forkserve.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    UnknownAdapterError,
)


class RequestChecks:
    def __init__(self, config: ForkServeConfig, backend: Backend, capabilities: Capabilities,
                 pool: PagePool, residual_pool: PagePool | None) -> None:
        self.config, self.backend, self.capabilities = config, backend, capabilities
        self.pool, self.residual_pool = pool, residual_pool

    def tokens(self, tokens: Sequence[int]) -> list[int]:
        tokens = token_ids(tokens, "tokens")
        vocab = self.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids out of vocabulary [0, {vocab}): {bad[:5]}")
        return tokens

    def adapter(self, adapter: AdapterId | None) -> AdapterId | None:
        """The backend's id for ``adapter`` (a name where the backend has names); None stays
        None. Unknown adapters are refused here, before any state changes."""
        if adapter is None:
            return None
        if isinstance(adapter, bool):
            raise InvalidRequestError(f"adapter must be a name or an id, got {adapter!r}")
        if self.capabilities.resolve_adapter:
            return self.backend.resolve_adapter(adapter)
        if self.capabilities.knows_adapter and not self.backend.knows_adapter(adapter):
            raise UnknownAdapterError(f"adapter {adapter!r} is not loaded in the backend")
        return adapter

    def context(self, length: int) -> None:
        if length > self.config.max_context:
            raise ContextLengthError(f"sequence of {length} tokens exceeds the context window of "
                                     f"{self.config.max_context} tokens")

    def fits(self, length: int, split: bool) -> None:
        """A sequence longer than a whole pool can never be written, whatever is evicted:
        refuse it now (one that only has to wait for pages is admitted)."""
        pools = [self.pool] + ([self.residual_pool] if split and self.residual_pool is not None
                               else [])
        for pool in pools:
            need = -(-length // pool.page_size)
            if need > pool.num_pages:
                raise CapacityError(f"a sequence of {length} tokens needs {need} {pool.kind.value} "
                                    f"pages; the pool has {pool.num_pages} "
                                    f"({pool.num_pages * pool.page_size} tokens)")


def token_ids(tokens, what: str, allow_empty: bool = False) -> list[int]:
    """Token ids as plain ints: any integral type (numpy ints too); bools, floats, None refused."""
    if tokens is None or isinstance(tokens, (str, bytes)):
        raise InvalidRequestError(f"{what} must be a sequence of token ids, got "
                                  f"{type(tokens).__name__}")
    try:
        items = list(tokens)
    except TypeError:
        raise InvalidRequestError(f"{what} must be a sequence of token ids, "
                                  f"got {type(tokens).__name__}") from None
    if not items and not allow_empty:
        raise InvalidRequestError(f"{what}: token list is empty")
    if set(map(type, items)) <= {int}:  # the common case: map and set iterate in C
        return items
    out = []
    for t in items:
        if isinstance(t, bool) or type(t).__name__ == "bool_":
            raise InvalidRequestError(f"{what}: {t!r} is not a token id")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise InvalidRequestError(f"{what}: {t!r} is not a token id") from None
    return out


def count(what: str, n) -> int:
    """A non-negative integer argument (any integral type; bools, floats, None refused)."""
    if isinstance(n, bool):
        raise InvalidRequestError(f"{what} must be an integer >= 0, got {n!r}")
    try:
        n = operator.index(n)
    except TypeError:
        raise InvalidRequestError(f"{what} must be an integer >= 0, got {n!r}") from None
    if n < 0:
        raise InvalidRequestError(f"{what} must be >= 0, got {n}")
    return n
