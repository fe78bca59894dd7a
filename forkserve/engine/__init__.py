"""L3: the Engine and its verbs. ``MockBackend`` is re-exported for the seed's quickstart."""
from forkserve.backend.mock import MockBackend
from forkserve.control.prefix_index import UNSALTED, CacheSalt
from forkserve.engine.cache_stats import CacheStats, PoolStats, PublishedPage, SessionPages
from forkserve.engine.engine import Engine
from forkserve.engine.results import (
                                      AbortResult,
                                      CommitResult,
                                      DrainReport,
                                      GenerateResult,
                                      SessionHandle,
                                      SharedPrefill,
)

__all__ = ["Engine", "MockBackend", "SessionHandle", "CommitResult", "GenerateResult",
           "DrainReport", "AbortResult", "SharedPrefill", "CacheStats", "PoolStats",
           "PublishedPage", "SessionPages", "CacheSalt", "UNSALTED"]
