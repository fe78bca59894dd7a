"""TreeAffinityRouter: Serve's request router for Engine replicas.

* A verb on a known tree goes to the tree's owner and nowhere else: the tree's KV and
  its speculative branches live only there. When the owner is at ``max_ongoing_requests``
  Serve backs off and retries the owner; a verb never spills to a replica that does not
  hold the tree (it would only answer NOT_RESIDENT).
* ``open`` (a new tree, or a tree re-opened after its owner died) is scored on every live
  replica by ``AffinityPlacement`` (placement.py): pages of the prompt's prefix the replica
  holds, affinity for the replica holding the adapter's residual pages, minus its queue and
  its load (KV pages in use, recent token rate, what this router just sent it). Each
  replica is a rank of its own, best first; Serve takes the first with room, so lower
  ranks are spill-over when the best replica is full.
* A call whose hint names a replica (``RouteHint.replica``: the Frontend's metrics scrape)
  goes to that replica only, or, when it is not in the set, to any (which refuses it).
* The owner map is the router's own: ``record_routing_stats`` lags by up to one polling
  period, and a tree's next verb usually arrives well within it. It is updated when a
  call is routed (``open`` sets the owner, ``close`` drops it) and loses a replica's
  trees when the replica dies or leaves the replica set.

Stats are read from ``RunningReplica.routing_stats``, which Serve refreshes from each
replica's ``record_routing_stats()`` every ``request_routing_stats_period_s``.
"""
from __future__ import annotations

import random

from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from forkserve.interfaces.ray_serve.placement import AffinityPlacement, RecentRoutes, ReplicaState
from forkserve.interfaces.ray_serve.protocol import RouteHint
from forkserve.interfaces.ray_serve.stats import ReplicaSummary

_EMPTY = ReplicaSummary.from_dict({})


def _hint(request: PendingRequest | None) -> RouteHint | None:
    if request is None or not request.args or not isinstance(request.args[0], RouteHint):
        return None
    return request.args[0]


class TreeAffinityRouter(RequestRouter):
    def initialize_state(self, prefix_page_weight: float = 1.0, residual_weight: float = 1.0,
                         queue_weight: float = 2.0, load_weight: float = 0.5,
                         rate_horizon_s: float = 1.0, recent_ttl_s: float = 4.0) -> None:
        """Weights: ``AffinityPlacement``'s. ``recent_ttl_s``: how long the router counts an
        open it sent toward its replica's pages and load (the summary shows it by then)."""
        self.placement = AffinityPlacement(prefix_page_weight, residual_weight, queue_weight,
                                           load_weight, rate_horizon_s)
        self._recent_ttl_s = recent_ttl_s
        self._owners: dict[int, ReplicaID] = {}
        # Parsed summaries, kept until Serve hands a replica a new stats dict: parsing is
        # O(published pages), a routing decision should not be.
        self._summaries: dict[ReplicaID, tuple[dict, ReplicaSummary]] = {}
        self._recent: dict[ReplicaID, RecentRoutes] = {}

    def _summary(self, replica: RunningReplica) -> ReplicaSummary:
        raw = replica.routing_stats or {}
        cached = self._summaries.get(replica.replica_id)
        if cached is None or cached[0] is not raw:
            cached = (raw, ReplicaSummary.from_dict(raw))
            self._summaries[replica.replica_id] = cached
        return cached[1]

    def _recent_of(self, replica_id: ReplicaID) -> RecentRoutes:
        if replica_id not in self._recent:
            self._recent[replica_id] = RecentRoutes(self._recent_ttl_s)
        return self._recent[replica_id]

    def state(self, replica: RunningReplica) -> ReplicaState:
        self._summary(replica)
        return self._state_of(replica.replica_id)

    def _state_of(self, replica_id: ReplicaID) -> ReplicaState:
        """From the summary last parsed (``state`` parses a new one first)."""
        cached = self._summaries.get(replica_id)
        return ReplicaState(cached[1] if cached else _EMPTY, self._recent_of(replica_id),
                            self.replica_queue_len_cache.get(replica_id) or 0)

    def score(self, replica: RunningReplica, hint: RouteHint) -> float:
        return self.placement.score(self.state(replica), hint)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        hint = _hint(pending_request)
        if hint is None:  # not a tree verb (describe): any replica, shortest queue
            return [candidate_replicas]
        if hint.replica is not None:
            # A replica Ray still names may have left the set: the call then goes anywhere
            # and the replica refuses it (never an empty rank: Serve would hold it pending).
            target = [r for r in candidate_replicas
                      if r.replica_id.to_full_id_str() == hint.replica]
            return [target or candidate_replicas]
        if pending_request.metadata.call_method != "open":
            owner = self._owners.get(hint.tree_id)
            for r in candidate_replicas:
                if r.replica_id == owner:
                    return [[r]]
            # The owner is gone: whichever replica gets the verb answers NOT_RESIDENT and
            # the Frontend re-opens the tree, which is scored below.
            return [candidate_replicas]
        # One replica per rank, best first; equal scores in random order, so equally good
        # replicas share new trees instead of the first taking them all.
        scored = sorted(((self.score(r, hint), random.random(), r) for r in candidate_replicas),
                        key=lambda x: (-x[0], x[1]))
        # Counted toward the best replica now, not when Serve reports the call routed: the
        # opens of a burst are scored one after another, each seeing those before it.
        self._place(hint, scored[0][2].replica_id)
        return [[r] for _, _, r in scored]

    def _place(self, hint: RouteHint, replica_id: ReplicaID) -> None:
        """Record an open on ``replica_id`` (moving it there if recorded elsewhere)."""
        for recent in self._recent.values():
            recent.remove(hint.tree_id)
        matched = self.placement.matched(self._state_of(replica_id), hint)
        self._recent_of(replica_id).add(hint, max(len(hint.base_hashes),
                                                  len(hint.adapter_hashes)) - matched)

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

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        hint = _hint(pending_request)
        if hint is None:
            return
        method = pending_request.metadata.call_method
        if method == "open":
            self._owners[hint.tree_id] = replica_id
            if not self._recent_of(replica_id).has(hint.tree_id):  # Serve took a lower rank
                self._place(hint, replica_id)
        elif method == "close":
            owner = self._owners.pop(hint.tree_id, None)
            if owner is not None:
                self._recent_of(owner).closed(hint.tree_id)

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
        for table in (self._summaries, self._recent):
            for replica in [r for r in table if gone(r)]:
                del table[replica]


class TwoChoicesRouter(TreeAffinityRouter):
    """The baseline ``benchmarks/ray_router_bench.py`` compares against: a new tree goes
    where Serve's default router would send a request (two random replicas, the shorter
    queue), blind to prefixes and adapters. Known trees still go to their owner: Serve's
    own router sends a tree's next verb anywhere, where it meets no session or a stale one
    (a lockstep run under it fails in its first turn), so it cannot serve branch trees at all."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        hint = _hint(pending_request)
        if (hint is not None and hint.replica is None
                and pending_request.metadata.call_method == "open"):
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        return await super().choose_replicas(candidate_replicas, pending_request)
