"""TreeClient: the Frontend's side of every engine call, fail-over included.

Every call names its tree: the tree id is Serve's ``session_id`` and the first argument's
``RouteHint`` (what the TreeAffinityRouter routes on), the adapter is Serve's
``multiplexed_model_id``.

Fail-over: when a call finds its replica dead (``RayActorError``) or finds the tree gone
(a restarted replica, or a session aborted or expired there, answers NOT_RESIDENT), the
tree is re-opened from the ledger's committed tokens on the replica the router scores
best, and the call is retried; node ids the client held for the old committed tip are
aliased to the new root (ledger.py). A stream fails over only before its first item:
after that the client has text it cannot take back, and a replica lost mid-stream ends
the stream with a retryable error. What cannot be recovered (no live replica after the
retries) is a 503: retryable.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from forkserve.control.prefix_index import UNSALTED, CacheSalt
from forkserve.interfaces.ray_serve.ledger import TreeLedger, TreeRecord
from forkserve.interfaces.ray_serve.protocol import (
    NOT_RESIDENT,
    Failure,
    ModelInfo,
    Ok,
    RouteHint,
    TreeView,
)
from forkserve.interfaces.ray_serve.stats import BASE_SCOPE, page_hashes
from forkserve.interfaces.server.engine_worker import Chunk, GenerationSpec
from forkserve.interfaces.server.errors import APIError
from forkserve.interfaces.server.schemas import DrainResponse, SessionInfo

log = logging.getLogger("forkserve.ray_serve")

# Attempts at one engine call: the first, then one after each re-open (or, for an open,
# after the router dropped the dead replica).
_ATTEMPTS = 3
REPLICA_GONE = (RayActorError, ActorUnavailableError)


def raise_failure(f: Failure) -> None:
    raise APIError(f.status, f.message, f.type, f.param)


def unavailable(tree_id: int, cause: BaseException | None) -> APIError:
    return APIError(503,
                    f"no engine replica could serve tree {tree_id} ({type(cause).__name__}); retry",
                    "ServiceUnavailableError")


class GenerationStream:
    """A started generation: its first item is in hand, the rest come from the replica.
    The ledger learns the tree's committed state from the stream's final ``TreeView``."""

    def __init__(self, ledger: TreeLedger, first: Chunk | TreeView, stream: Any,
                 replica: str) -> None:
        self._ledger, self._first, self._stream = ledger, first, stream
        self.replica = replica

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        item = self._first
        try:
            while not isinstance(item, TreeView):
                yield item
                try:
                    item = await self._stream.__anext__()
                except StopAsyncIteration:
                    return
            self._ledger.update(item)
        finally:
            self._stream.cancel()  # no-op once finished; a client that left aborts the decode

    def cancel(self) -> None:
        self._stream.cancel()


class TreeClient:
    def __init__(self, engine: DeploymentHandle, ledger: TreeLedger) -> None:
        self._engine = engine
        self.ledger = ledger

    def _handle(self, method: str, hint: RouteHint, stream: bool = False) -> Any:
        return getattr(self._engine, method).options(
            multiplexed_model_id=hint.adapter or "", session_id=str(hint.tree_id), stream=stream)

    async def open(self, info: ModelInfo, tree_id: int, adapter: str | None, tokens: list[int],
                   salt: CacheSalt = UNSALTED) -> tuple[SessionInfo, TreeView]:
        """Open ``tokens`` as tree ``tree_id`` in the trust boundary ``salt`` wherever the
        router scores best."""
        hint = RouteHint(tree_id, adapter, page_hashes(BASE_SCOPE, tokens, info.page_size, salt),
                         page_hashes(adapter, tokens, info.page_size, salt) if adapter is not None
                         else (), salt)
        cause: BaseException | None = None
        for _ in range(_ATTEMPTS):
            try:
                reply = await self._handle("open", hint).remote(hint, tokens)
            # the router drops the dead replica; the next try goes elsewhere
            except REPLICA_GONE as e:
                cause = e
                continue
            if isinstance(reply, Failure):
                raise_failure(reply)
            return reply.value
        raise unavailable(tree_id, cause)

    async def _reopen(self, info: ModelInfo, seen: TreeRecord) -> None:
        async with self.ledger.lock(seen.tree_id):
            rec = self.ledger.get(seen.tree_id)
            if rec.epoch != seen.epoch:
                return  # another call already re-opened it
            _, view = await self.open(info, rec.tree_id, rec.adapter, list(rec.committed), rec.salt)
            log.warning("tree %d re-opened on %s from %d committed tokens (was on %s)",
                        rec.tree_id, view.replica, len(view.committed), rec.replica)
            self.ledger.reopened(rec, view)

    async def call(self, info: ModelInfo, tree_id: int, method: str,
                   args: Callable[[TreeRecord], tuple]) -> tuple[Any, TreeRecord]:
        """``method(hint, *args(record))`` on the tree's replica, re-opening the tree elsewhere
        if that replica is gone. Returns the value and the record it ran under."""
        cause: BaseException | None = None
        for _ in range(_ATTEMPTS):
            rec = self.ledger.get(tree_id)
            try:
                reply = await self._handle(method, rec.hint()).remote(rec.hint(), *args(rec))
            except REPLICA_GONE as e:
                cause = e
            else:
                if isinstance(reply, Ok):
                    return reply.value, rec
                if reply.type != NOT_RESIDENT:
                    raise_failure(reply)
            await self._reopen(info, rec)
        raise unavailable(tree_id, cause)

    async def stream(self, info: ModelInfo, tree_id: int, spec: GenerationSpec) -> GenerationStream:
        """Start a generation and wait for its first item, failing over like ``call``."""
        cause: BaseException | None = None
        for _ in range(_ATTEMPTS):
            rec = self.ledger.get(tree_id)
            stream = self._handle("generate_stream", rec.hint(),
                                  stream=True).remote(rec.hint(), spec)
            try:
                first = await stream.__anext__()
            except REPLICA_GONE as e:
                cause = e
            else:
                if not isinstance(first, Failure):
                    return GenerationStream(self.ledger, first, stream, rec.replica)
                if first.type != NOT_RESIDENT:
                    raise_failure(first)
            await self._reopen(info, rec)
        raise unavailable(tree_id, cause)

    async def drain(self) -> list[DrainResponse]:
        """Drain every replica that holds one of this Frontend's trees (slack work lives only
        where trees do), each reached through one of its trees. A replica that is gone has
        nothing left to drain."""
        by_replica = {rec.replica: rec for rec in self.ledger.trees.values()}
        replies = await asyncio.gather(*(self._handle("drain", rec.hint()).remote(rec.hint())
                                         for rec in by_replica.values()), return_exceptions=True)
        out = []
        for reply in replies:
            if isinstance(reply, REPLICA_GONE):
                continue
            if isinstance(reply, BaseException):
                raise reply
            if isinstance(reply, Failure):
                raise_failure(reply)
            out.append(reply.value)
        return out

    async def close(self, info: ModelInfo, tree_id: int) -> tuple[SessionInfo, str]:
        """Close a tree. A tree whose replica is gone is only forgotten: re-opening it just to
        close it would recompute its whole context for nothing."""
        rec = self.ledger.get(tree_id)
        try:
            reply = await self._handle("close", rec.hint()).remote(rec.hint())
        except REPLICA_GONE:
            reply = None
        if isinstance(reply, Failure) and reply.type != NOT_RESIDENT:
            raise_failure(reply)
        self.ledger.drop(tree_id)
        if isinstance(reply, Ok):
            return reply.value, rec.replica
        return SessionInfo(session_id=str(tree_id), tip=rec.tip, model=rec.adapter or info.name,
                           committed_tokens=len(rec.committed)), rec.replica
