"""What travels between the Frontend, the router and the Engine replicas.

Every engine call carries a ``RouteHint`` as its first argument: the router reads it
(``PendingRequest.args[0]``) before the call reaches a replica, so it can keep a tree on
its owner and score a new tree's prompt against each replica's published pages. The tree
id also travels as Serve's ``session_id`` and the adapter as its ``multiplexed_model_id``,
so Serve's own logs and metrics name them; the hint is what the router decides on.

A replica answers a refused verb with a ``Failure`` value instead of raising: an
exception crossing Ray comes back wrapped in ``RayTaskError`` with the remote traceback in
its message, while a value keeps the HTTP status and message the client should see.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from forkserve.config import ShareBase
from forkserve.control.prefix_index import UNSALTED, CacheSalt
from forkserve.interfaces.server.generation_defaults import SamplingDefaults
from forkserve.interfaces.server.schemas import SharingCostCard

T = TypeVar("T")


@dataclass(frozen=True)
class RouteHint:
    tree_id: int
    adapter: str | None                  # adapter name (None: the base model)
    # Chained hashes of the prompt's full pages (stats.page_hashes), only on ``open``: a
    # known tree is routed by owner and needs none. Base-scope hashes match the shared base
    # cache (disaggregated layout, or base-model trees); adapter-scope hashes match pages
    # that unified layout publishes under the adapter's namespace.
    base_hashes: tuple[int, ...] = ()
    adapter_hashes: tuple[int, ...] = ()
    # The tree's prefix-cache trust boundary (its tenant and cache_salt): the replica opens
    # it under this salt, and the hashes above are chained from it (stats.page_hashes).
    salt: CacheSalt = UNSALTED
    # A call for one given replica, whatever tree (the Frontend's metrics scrape): its
    # Serve actor name, ``ReplicaID.to_full_id_str()``.
    replica: str | None = None


@dataclass(frozen=True)
class TreeView:
    """A tree's committed state after a verb: what the Frontend's ledger keeps, so a tree
    whose replica dies can be re-opened elsewhere from exactly these tokens."""

    tree_id: int
    tip: int
    committed: tuple[int, ...]
    replica: str                         # the replica that holds it (for logs and tests)


@dataclass(frozen=True)
class Ok(Generic[T]):
    value: T


@dataclass(frozen=True)
class Failure:
    status: int
    message: str
    type: str
    param: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the Frontend must know of the served model without loading its weights."""

    name: str
    model_path: str | None               # the Frontend's tokenizer (None: token ids only)
    adapters: tuple[str, ...]
    max_context: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    page_size: int
    # What a request that omits temperature / top_p samples with (the replicas' model's
    # generation config), and the replicas' cache-sharing policy: both shown in /v1/models.
    sampling_defaults: SamplingDefaults
    share_base: ShareBase
    sharing_cost: SharingCostCard | None = None  # its measured cost (server/sharing_cost.py)


# Failure.type of a verb on a tree the replica does not hold (it restarted, or closed the
# tree's idle session): the Frontend re-opens the tree from its ledger and retries.
NOT_RESIDENT = "TreeNotResident"

Reply = Ok[T] | Failure
