"""TreeAffinityRouter: Serve's request router for Engine replicas.

* A verb on a known tree goes to the tree's owner and nowhere else: the tree's KV and
  its speculative branches live only there. When the owner is at ``max_ongoing_requests``
  Serve backs off and retries the owner; a verb never spills to a replica that does not
  hold the tree (it would only answer NOT_RESIDENT).
* ``open`` (a new tree, or a tree re-opened after its owner died) is scored on every live
  replica: pages of the prompt's prefix the replica has published, plus affinity for the
  replica holding the adapter's residual pages, minus its queue. Replicas of equal score
  form one rank, where Serve takes the shortest queue; lower ranks are spill-over when the
  best replicas are full.
* The owner map is the router's own: ``record_routing_stats`` lags by up to one polling
  period, and a tree's next verb usually arrives well within it. It is updated when a
  call is routed (``open`` sets the owner, ``close`` drops it) and loses a replica's
  trees when the replica dies or leaves the replica set.

Stats are read from ``RunningReplica.routing_stats``, which Serve refreshes from each
replica's ``record_routing_stats()`` every ``request_routing_stats_period_s``.
"""
from __future__ import annotations

import math
import random
from itertools import groupby

from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from forkserve.interfaces.ray_serve.protocol import RouteHint
from forkserve.interfaces.ray_serve.stats import ReplicaSummary, matched_pages


def _hint(request: PendingRequest | None) -> RouteHint | None:
    if request is None or not request.args or not isinstance(request.args[0], RouteHint):
        return None
    return request.args[0]


class TreeAffinityRouter(RequestRouter):
    def initialize_state(self, prefix_page_weight: float = 1.0, residual_weight: float = 1.0,
                         queue_weight: float = 2.0) -> None:
        # Weights are per matched prefix page, per doubling of the adapter's resident
        # residual pages (log: a few warm pages already say the adapter lives here), and per
        # queued request (a queued request delays this tree's prefill by about one request).
        self._prefix_w = prefix_page_weight
        self._residual_w = residual_weight
        self._queue_w = queue_weight
        self._owners: dict[int, ReplicaID] = {}
        # Parsed summaries, kept until Serve hands a replica a new stats dict: parsing is
        # O(published pages), a routing decision should not be.
        self._summaries: dict[ReplicaID, tuple[dict, ReplicaSummary]] = {}

    def _summary(self, replica: RunningReplica) -> ReplicaSummary:
        raw = replica.routing_stats or {}
        cached = self._summaries.get(replica.replica_id)
        if cached is None or cached[0] is not raw:
            cached = (raw, ReplicaSummary.from_dict(raw))
            self._summaries[replica.replica_id] = cached
        return cached[1]

    def score(self, replica: RunningReplica, hint: RouteHint) -> float:
        s = self._summary(replica)
        prefix = max(matched_pages(hint.base_hashes, s.prefix_pages),
                     matched_pages(hint.adapter_hashes, s.prefix_pages))
        residual = s.residual_pages.get(hint.adapter, 0) if hint.adapter is not None else 0
        queue = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return self._prefix_w * prefix + self._residual_w * math.log2(1 + residual) - self._queue_w * queue

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hint = _hint(pending_request)
        if hint is None:  # not a tree verb (describe): any replica, shortest queue
            return [candidate_replicas]
        if pending_request.metadata.call_method != "open":
            owner = self._owners.get(hint.tree_id)
            for r in candidate_replicas:
                if r.replica_id == owner:
                    return [[r]]
            # The owner is gone: whichever replica gets the verb answers NOT_RESIDENT and
            # the Frontend re-opens the tree, which is scored below.
            return [candidate_replicas]
        scored = sorted(((self.score(r, hint), r) for r in candidate_replicas), key=lambda x: -x[0])
        ranks = [[r for _, r in group] for _, group in groupby(scored, key=lambda x: x[0])]
        for rank in ranks:
            # Serve takes the shortest queue of a rank and the first on a tie: shuffled, so
            # equally good replicas share new trees instead of the first taking them all.
            random.shuffle(rank)
        return ranks

    def _get_pending_request_matching_internal_request_id(
            self, request_metadata: RequestMetadata | None = None) -> PendingRequest | None:
        """The pending request this routing task chose a replica for, matched by identity.

        Serve 2.60 matches by ``internal_request_id``, but every call a replica makes while
        serving one request inherits that request's id: two concurrent engine calls of one
        HTTP request (the n choices of a completion, their closes) collide. The second is
        then never indexed and stalls, or takes the replica chosen for the first, so a verb
        could land on a replica that does not hold its tree."""
        if request_metadata is None:
            return None
        for pr in self._pending_requests_to_fulfill:
            if pr.metadata is request_metadata and not pr.future.done():
                return pr
        return None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hint = _hint(pending_request)
        if hint is None:
            return
        method = pending_request.metadata.call_method
        if method == "open":
            self._owners[hint.tree_id] = replica_id
        elif method == "close":
            self._owners.pop(hint.tree_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(lambda owner: owner == replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        self._forget(lambda owner: owner not in live)

    def _forget(self, gone) -> None:
        for tree in [t for t, owner in self._owners.items() if gone(owner)]:
            del self._owners[tree]
        for replica in [r for r in self._summaries if gone(r)]:
            del self._summaries[replica]
