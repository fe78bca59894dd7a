"""EngineReplica: the ``Engine`` deployment. One replica is one engine (one GPU, or one
process on CPU) behind the server's EngineWorker thread.

A replica knows trees, not sessions: the Frontend names each tree by a cluster-wide id,
and the replica maps it to its local engine session. Node ids stay the engine's own.
Every verb runs on the EngineWorker thread (the engine is single-threaded), validates
before it mutates, and answers ``Ok(value)`` or a ``Failure`` with the HTTP status the
client should see (protocol.py says why values, not exceptions). Verbs that move the
committed spine also answer the tree's ``TreeView`` (its committed tokens), which the
Frontend keeps so the tree survives this replica.

``record_routing_stats`` is the hook Serve polls: it publishes the compact
``ReplicaSummary`` the TreeAffinityRouter scores new trees with. ``metrics`` renders the
engine's Prometheus families (the one-process server's collector), which the Frontend's
``/metrics`` gathers from every replica under a ``replica`` label.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, generate_latest

from forkserve.adapter_key import adapter_key
from forkserve.config import ForkServeConfig, ShareBase
from forkserve.engine.heap import settle
from forkserve.errors import ForkServeError
from forkserve.interfaces.ray_serve.protocol import (
    NOT_RESIDENT,
    Failure,
    ModelInfo,
    Ok,
    Reply,
    RouteHint,
    TreeView,
)
from forkserve.interfaces.ray_serve.stats import (
    ReplicaSummary,
    index_hashes,
    pages_per_adapter,
)
from forkserve.interfaces.server.app import SYSTEMS
from forkserve.interfaces.server.engine_worker import (
    Chunk,
    EngineWorker,
    Generation,
    GenerationSpec,
)
from forkserve.interfaces.server.errors import APIError, backend_error_status
from forkserve.interfaces.server.metrics import EngineCollector, take_snapshot
from forkserve.interfaces.server.schemas import (
    AbortResponse,
    CommitResponse,
    DecisionResponse,
    DrainResponse,
    ForkResponse,
    GenerateResponse,
    SessionInfo,
    SharingCostCard,
)
from forkserve.interfaces.server.served_model import ServedModel, load_served_model

log = logging.getLogger("forkserve.ray_serve")
T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaSpec:
    """How every replica loads its engine (the options of ``forkserve serve``)."""

    model_path: str
    loras: tuple[tuple[str, str], ...] = ()
    served_model_name: str | None = None
    layout: str = "unified"
    share_base: str = ShareBase.CROSS_ADAPTER.value
    system: str = "app"
    num_pages: int = 1024
    page_size: int = 16
    device: str | None = None
    dtype: str | None = None
    attention: str = "auto"
    cuda_graphs: bool = True
    session_ttl_s: float = 600.0
    # CPU replicas share the host's cores: each replica's torch gets this many threads
    # (None: torch's default, every core, which oversubscribes with two replicas).
    torch_threads: int | None = None
    # Builds the served model in place of ``load_served_model(model_path, ...)`` (benchmarks
    # with in-memory random weights). Such a model has no tokenizer files: the Frontend then
    # serves token ids only. Must pickle (a module-level function).
    loader: Callable[[ReplicaSpec, ForkServeConfig], ServedModel] | None = None
    # The measured cost of ``share_base`` (``--quality-report``), read by the launcher before
    # Ray starts; every replica's /v1/models card carries it.
    sharing_cost: SharingCostCard | None = None

    def config(self) -> ForkServeConfig:
        return SYSTEMS[self.system](page_size=self.page_size, num_pages=self.num_pages,
                                    num_residual_pages=self.num_pages, kv_layout=self.layout,
                                    share_base=self.share_base)

    def load(self) -> ServedModel:
        config = self.config()
        if self.loader is not None:
            return self.loader(self, config)
        return load_served_model(self.model_path, config=config, loras=dict(self.loras),
                                 name=self.served_model_name, device=self.device, dtype=self.dtype,
                                 attention=self.attention, use_cuda_graphs=self.cuda_graphs,
                                 sharing_cost=self.sharing_cost)


class _NotResident(Exception):
    """Raised on the engine thread, answered as ``Failure(410, ..., NOT_RESIDENT)``."""


class EngineReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        from ray import serve

        if spec.torch_threads is not None:
            import torch
            torch.set_num_threads(spec.torch_threads)
        self._model = spec.load()
        settle()  # as the server does: the loaded model out of the collector's passes
        self._spec = spec
        self._worker = EngineWorker(self._model.engine, self._model.tokenizer.decode,
                                    session_ttl_s=spec.session_ttl_s)
        self._worker.start()
        self._trees: dict[int, int] = {}  # tree id -> engine session id (engine thread only)
        self._collector = EngineCollector()
        self._registry = CollectorRegistry()
        self._registry.register(self._collector)
        # The replica's actor name: what logs, the x-forkserve-replica header and ray.get_actor use.
        self.replica = serve.get_replica_context().replica_id.to_full_id_str()
        log.info("replica %s: %s, %d pages", self.replica, self._model.name,
                 self._model.engine.cache_stats().base.free)

    def __del__(self) -> None:
        # absent when __init__ failed (Serve still calls this)
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.stop()

    # ------------------------------------------------------------------ helpers
    async def _reply(self, fn: Callable[[], Awaitable[T]]) -> Reply[T]:
        try:
            return Ok(await fn())
        except _NotResident as e:
            return Failure(410, str(e), NOT_RESIDENT)
        except APIError as e:
            return Failure(e.status, e.message, e.type, e.param)
        except ForkServeError as e:
            return Failure(e.http_status, str(e), type(e).__name__)
        except Exception as e:
            status = backend_error_status(e)
            if status is None:
                raise
            return Failure(status, str(e), type(e).__name__)

    async def _on_tree(self, tree_id: int, verb: Callable[[int], T]) -> T:
        """Run ``verb(session_id)`` on the engine thread on an idle, resident tree."""
        def run() -> T:
            sid = self._sid(tree_id)
            self._worker.ensure_idle(sid)
            self._worker.lease(sid)
            return verb(sid)
        return await self._worker.call(run)

    def _sid(self, tree_id: int) -> int:
        sid = self._trees.get(tree_id)
        if sid is None or not self._model.engine.has_session(sid):
            self._trees.pop(tree_id, None)
            raise _NotResident(f"tree {tree_id} is not resident on replica {self.replica}")
        return sid

    def _view(self, tree_id: int, sid: int) -> TreeView:
        eng = self._model.engine
        return TreeView(tree_id, eng.tip(sid), tuple(eng.committed_tokens(sid)), self.replica)

    def _info(self, tree_id: int, sid: int) -> SessionInfo:
        eng = self._model.engine
        adapter = eng.session_summary(sid).adapter
        name = (self._model.name if adapter is None
                else self._model.adapter_names[adapter_key(adapter)])
        # The tree id; the Frontend shows the caller its public id instead.
        return SessionInfo(session_id=str(tree_id), tip=eng.tip(sid), model=name,
                           committed_tokens=len(eng.committed_tokens(sid)))

    def _commit_response(self, tree_id: int, r) -> CommitResponse:
        return CommitResponse(session_id=str(tree_id), tip=r.tip, bound_node=r.bound_node,
                              matched_tokens=r.matched_tokens, prefilled_tokens=r.prefilled_tokens,
                              aborted=list(r.aborted))

    # ------------------------------------------------------------------ verbs
    async def describe(self) -> ModelInfo:
        m = self._model
        path = self._spec.model_path if self._spec.loader is None else None
        return ModelInfo(name=m.name, model_path=path, adapters=tuple(sorted(m.adapters)),
                         max_context=m.max_context, eos_token_ids=m.eos_token_ids,
                         vocab_size=m.engine.config.vocab_size, page_size=m.engine.config.page_size,
                         sampling_defaults=m.sampling_defaults,
                         share_base=m.engine.config.share_base, sharing_cost=m.sharing_cost)

    async def open(self, hint: RouteHint, tokens: list[int]) -> Reply[tuple[SessionInfo, TreeView]]:
        """Open a tree on ``tokens`` (a new prompt, or a dead replica's committed tokens)."""
        def run() -> tuple[SessionInfo, TreeView]:
            adapter = self._model.adapter_for(hint.adapter or self._model.name)
            self._model.check_vocab(tokens)
            self._model.check_length(len(tokens), 0)
            old = self._trees.pop(hint.tree_id, None)
            if old is not None and self._model.engine.has_session(old):
                # A re-open of a tree this replica still holds (its Frontend saw the reply
                # lost): the ledger's tokens are the truth, the old session goes.
                self._worker.release(old)
                self._model.engine.close(old)
            sid = self._model.engine.open(tokens, adapter=adapter, salt=hint.salt).id
            self._trees[hint.tree_id] = sid
            self._worker.lease(sid)
            return self._info(hint.tree_id, sid), self._view(hint.tree_id, sid)
        return await self._reply(lambda: self._worker.call(run))

    async def info(self, hint: RouteHint) -> Reply[tuple[SessionInfo, TreeView]]:
        return await self._reply(lambda: self._on_tree(
            hint.tree_id,
            lambda sid: (self._info(hint.tree_id, sid), self._view(hint.tree_id, sid))))

    async def fork(self, hint: RouteHint, parent: int, label: str,
                   tokens: list[int]) -> Reply[ForkResponse]:
        def verb(sid: int) -> ForkResponse:
            self._model.check_vocab(tokens)
            return ForkResponse(node=self._model.engine.fork(sid, parent, label, tokens),
                                tokens=len(tokens))
        return await self._reply(lambda: self._on_tree(hint.tree_id, verb))

    async def speculate(self, hint: RouteHint, node: int, priority: float,
                        t_idle_ms: float | None) -> Reply[DecisionResponse]:
        def verb(sid: int) -> DecisionResponse:
            d = self._model.engine.speculate(sid, node, priority=priority, t_idle_ms=t_idle_ms)
            return DecisionResponse(action=d.action.value, score=d.score, hit_tokens=d.hit_tokens,
                                    miss_tokens=d.miss_tokens, reason=d.reason)
        return await self._reply(lambda: self._on_tree(hint.tree_id, verb))

    async def commit(self, hint: RouteHint, tip: int,
                     tokens: list[int]) -> Reply[tuple[CommitResponse, TreeView]]:
        def verb(sid: int) -> tuple[CommitResponse, TreeView]:
            self._model.check_vocab(tokens)
            r = self._model.engine.commit(sid, tip, tokens)
            return self._commit_response(hint.tree_id, r), self._view(hint.tree_id, sid)
        return await self._reply(lambda: self._on_tree(hint.tree_id, verb))

    async def join(self, hint: RouteHint, nodes: list[int],
                   separator: list[int]) -> Reply[tuple[CommitResponse, TreeView]]:
        def verb(sid: int) -> tuple[CommitResponse, TreeView]:
            self._model.check_vocab(separator)
            r = self._model.engine.join(sid, nodes, separator=separator)
            return self._commit_response(hint.tree_id, r), self._view(hint.tree_id, sid)
        return await self._reply(lambda: self._on_tree(hint.tree_id, verb))

    async def abort(self, hint: RouteHint, node: int) -> Reply[AbortResponse]:
        def verb(sid: int) -> AbortResponse:
            r = self._model.engine.abort(sid, node)
            return AbortResponse(released_nodes=list(r.released_nodes), freed_pages=r.freed_pages)
        return await self._reply(lambda: self._on_tree(hint.tree_id, verb))

    async def _start_generation(self, hint: RouteHint,
                                spec: GenerationSpec) -> tuple[Generation, int]:
        """A generation queued on the tree's committed tip (and that tip's id)."""
        def check(sid: int) -> tuple[int, int]:
            tip = self._model.engine.node(sid, self._model.engine.tip(sid))
            self._model.check_length(tip.end, spec.max_tokens)
            return sid, tip.id
        sid, tip = await self._on_tree(hint.tree_id, check)
        return await self._worker.generate(sid, spec), tip

    async def generate(self, hint: RouteHint,
                       spec: GenerationSpec) -> Reply[tuple[GenerateResponse, TreeView]]:
        """Decode on the committed tip; the generated tokens join the committed spine."""
        async def run() -> tuple[GenerateResponse, TreeView]:
            gen, tip = await self._start_generation(hint, spec)
            try:
                out = await gen.collect()
            finally:
                gen.cancel()  # a cancelled call (client gone) aborts the decode
            view = await self._worker.call(
                lambda: self._view(hint.tree_id, self._sid(hint.tree_id)))
            return GenerateResponse(text=out.text, tokens=list(out.tokens),
                                    finish_reason=out.finish_reason or "length", tip=tip), view
        return await self._reply(run)

    async def generate_stream(self, hint: RouteHint,
                              spec: GenerationSpec) -> AsyncIterator[Chunk | TreeView | Failure]:
        """``generate`` as a stream (called with ``handle.options(stream=True)``): a ``Failure``
        alone, or the chunks as they are decoded and then the tree's ``TreeView``. A cancelled
        stream (its client went away) aborts the decode and the session, as in the server."""
        started = await self._reply(lambda: self._start_generation(hint, spec))
        if isinstance(started, Failure):
            yield started
            return
        gen, _ = started.value
        try:
            async for chunk in gen:
                yield chunk
        finally:
            gen.cancel()
        yield await self._worker.call(lambda: self._view(hint.tree_id, self._sid(hint.tree_id)))

    async def close(self, hint: RouteHint) -> Reply[SessionInfo]:
        def verb(sid: int) -> SessionInfo:
            info = self._info(hint.tree_id, sid)
            self._worker.release(sid)
            self._model.engine.close(sid)
            del self._trees[hint.tree_id]
            return info
        return await self._reply(lambda: self._on_tree(hint.tree_id, verb))

    async def drain(self, hint: RouteHint) -> Reply[DrainResponse]:
        """Run this replica's speculative slack work to the end. The hint names one of the
        replica's trees only so the router brings the call here."""
        def run() -> DrainResponse:
            r = self._model.engine.drain_slack()
            return DrainResponse(ticks=r.ticks, prefill_tokens=r.prefill_tokens,
                                 decode_tokens=r.decode_tokens,
                                 slack_filled_tokens=r.slack_filled_tokens)
        return await self._reply(lambda: self._worker.call(run))

    async def metrics(self, hint: RouteHint) -> str | None:
        """The engine's figures in Prometheus text format; None when the hint names another
        replica (it left the replica set, and the router sent its scrape here)."""
        if hint.replica != self.replica:
            return None
        self._collector.snapshot = await self._worker.call(
            lambda: take_snapshot(self._model.engine, self._worker))
        return generate_latest(self._registry).decode()

    # ------------------------------------------------------------------ Serve hooks
    async def record_routing_stats(self) -> dict[str, Any]:
        def summarize() -> ReplicaSummary:
            eng = self._model.engine
            pages = eng.published_pages()
            w = self._worker.stats()
            cache = eng.cache_stats()
            return ReplicaSummary(index_hashes(pages, eng.config.page_size,
                                               self._model.adapter_names),
                                  pages_per_adapter(pages, self._model.adapter_names),
                                  cache.base.free, w.active_generations, w.queue_depth,
                                  live_pages=cache.base.live, page_size=cache.page_size,
                                  token_rate=w.decode_tokens_per_s + w.prefill_tokens_per_s)
        return (await self._worker.call(summarize)).to_dict()
