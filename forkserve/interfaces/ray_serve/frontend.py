"""Frontend: the CPU ingress deployment. The OpenAI-compatible routes and the branch routes
of the one-process server (same request/response schemas, same error bodies), calling the
Engine replicas through a ``DeploymentHandle``.

Every engine call names its tree: the tree id is Serve's ``session_id`` and the first
argument's ``RouteHint`` (what the TreeAffinityRouter routes on), the adapter is Serve's
``multiplexed_model_id``. The branch API's session id *is* the tree id. An OpenAI request
opens one tree per choice, generates and closes it, so its prompt pages stay published on
the replica that served it and the next request with that prefix is routed there.

Fail-over: when a call finds its replica dead (``RayActorError``) or finds the tree gone
(a restarted replica answers NOT_RESIDENT), the tree is re-opened from the ledger's
committed tokens on the replica the router scores best and the call is retried once; node
ids the client held for the old committed tip are aliased to the new root. What cannot be
recovered (a second failure in a row, no live replica) is a 503: retryable.
Each response of a tree verb names the serving replica in ``x-forkserve-replica``.

Streaming (``stream=true``) is not offered through this frontend: it answers 400.

No ``from __future__ import annotations`` here: ``serve.ingress`` rebuilds the routes of
a class and FastAPI then cannot resolve string annotations, so bodies became query params.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Response
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from forkserve.backend.protocol import SamplingParams
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
from forkserve.interfaces.server.engine_worker import GenerationSpec
from forkserve.interfaces.server.errors import APIError, install_error_handlers
from forkserve.interfaces.server.schemas import (
    AbortRequest,
    AbortResponse,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CommitRequest,
    CommitResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DecisionResponse,
    ForkRequest,
    ForkResponse,
    GenerateRequest,
    GenerateResponse,
    JoinRequest,
    ModelCard,
    ModelList,
    OpenSessionRequest,
    SessionInfo,
    SpeculateRequest,
    Usage,
)

log = logging.getLogger("forkserve.ray_serve")

REPLICA_HEADER = "x-forkserve-replica"
# Attempts at one engine call: the first, then one after each re-open (or, for an open,
# after the router dropped the dead replica).
_ATTEMPTS = 3
_REPLICA_GONE = (RayActorError, ActorUnavailableError)

app = FastAPI(title="ForkServe (Ray Serve)")
install_error_handlers(app)


def _raise(f: Failure) -> None:
    raise APIError(f.status, f.message, f.type, f.param)


def _unavailable(tree_id: int | None, cause: BaseException | None) -> APIError:
    what = f"tree {tree_id}" if tree_id is not None else "the request"
    return APIError(503, f"no engine replica could serve {what} ({type(cause).__name__}); retry",
                    "ServiceUnavailableError")


@serve.ingress(app)
class Frontend:
    def __init__(self, engine: DeploymentHandle) -> None:
        self._engine = engine
        self._ledger = TreeLedger()
        self._info: ModelInfo | None = None
        self._tokenizer = None
        self._init_lock = asyncio.Lock()

    # ------------------------------------------------------------------ plumbing
    async def _model(self) -> ModelInfo:
        """The served model, asked of a replica on first use (a constructor may not await)."""
        async with self._init_lock:
            if self._info is None:
                from forkserve.backend.torch.tokenizer import Tokenizer

                info = await self._engine.describe.remote()
                self._tokenizer = Tokenizer.load(info.model_path)
                self._info = info
        return self._info

    def _adapter(self, info: ModelInfo, model: str) -> str | None:
        if model == info.name:
            return None
        if model in info.adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist; served: {[info.name, *info.adapters]}",
                       "NotFoundError", "model")

    def _handle(self, method: str, hint: RouteHint) -> Any:
        return getattr(self._engine, method).options(
            multiplexed_model_id=hint.adapter or "", session_id=str(hint.tree_id))

    async def _open_on_engine(self, tree_id: int, adapter: str | None,
                              tokens: list[int]) -> tuple[SessionInfo, TreeView]:
        info = await self._model()
        hint = RouteHint(tree_id, adapter, page_hashes(BASE_SCOPE, tokens, info.page_size),
                         page_hashes(adapter, tokens, info.page_size) if adapter is not None else ())
        cause: BaseException | None = None
        for _ in range(_ATTEMPTS):
            try:
                reply = await self._handle("open", hint).remote(hint, tokens)
            except _REPLICA_GONE as e:  # the router drops the dead replica; the next try goes elsewhere
                cause = e
                continue
            if isinstance(reply, Failure):
                _raise(reply)
            return reply.value
        raise _unavailable(tree_id, cause)

    async def _reopen(self, seen: TreeRecord) -> None:
        async with self._ledger.lock(seen.tree_id):
            rec = self._ledger.get(seen.tree_id)
            if rec.epoch != seen.epoch:
                return  # another call already re-opened it
            _, view = await self._open_on_engine(rec.tree_id, rec.adapter, list(rec.committed))
            log.warning("tree %d re-opened on %s from %d committed tokens (was on %s)",
                        rec.tree_id, view.replica, len(view.committed), rec.replica)
            self._ledger.reopened(rec, view)

    async def _on_tree(self, tree_id: int, method: str,
                       args: Callable[[TreeRecord], tuple]) -> tuple[Any, TreeRecord]:
        """Call ``method(hint, *args(record))`` on the tree's replica, re-opening the tree
        elsewhere if that replica is gone. Returns the value and the record it ran under."""
        cause: BaseException | None = None
        for _ in range(_ATTEMPTS):
            rec = self._ledger.get(tree_id)
            try:
                reply = await self._handle(method, rec.hint()).remote(rec.hint(), *args(rec))
            except _REPLICA_GONE as e:
                cause = e
            else:
                if isinstance(reply, Ok):
                    return reply.value, rec
                if reply.type != NOT_RESIDENT:
                    _raise(reply)
            await self._reopen(rec)
        raise _unavailable(tree_id, cause)

    def _tag(self, response: Response, replica: str) -> None:
        response.headers[REPLICA_HEADER] = replica

    async def _tokens(self, text: str | None, tokens: list[int] | None) -> list[int]:
        await self._model()
        return tokens if tokens is not None else self._tokenizer.encode(text or "", add_special_tokens=False)

    # ------------------------------------------------------------------ branch API
    @app.post("/v1/sessions")
    async def open_session(self, body: OpenSessionRequest, response: Response) -> SessionInfo:
        info = await self._model()
        adapter = self._adapter(info, body.model)
        if body.messages is not None:
            ids = self._tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                                      add_generation_prompt=body.add_generation_prompt)
        elif body.text is not None:
            ids = self._tokenizer.encode(body.text, add_special_tokens=True)
        else:
            ids = list(body.tokens or [])
        session, view = await self._open_on_engine(self._ledger.new_id(), adapter, ids)
        self._ledger.record(adapter, view)
        self._tag(response, view.replica)
        return session

    @app.get("/v1/sessions/{sid}")
    async def session_info(self, sid: int, response: Response) -> SessionInfo:
        (session, view), _ = await self._on_tree(sid, "info", lambda rec: ())
        self._ledger.update(view)
        self._tag(response, view.replica)
        return session

    @app.post("/v1/sessions/{sid}/fork")
    async def fork(self, sid: int, body: ForkRequest, response: Response) -> ForkResponse:
        ids = await self._tokens(body.text, body.tokens)
        out, rec = await self._on_tree(sid, "fork", lambda rec: (rec.node(body.parent), body.label, ids))
        self._tag(response, rec.replica)
        return out

    @app.post("/v1/sessions/{sid}/speculate")
    async def speculate(self, sid: int, body: SpeculateRequest, response: Response) -> DecisionResponse:
        out, rec = await self._on_tree(sid, "speculate",
                                       lambda rec: (rec.node(body.node), body.priority, body.t_idle_ms))
        self._tag(response, rec.replica)
        return out

    @app.post("/v1/sessions/{sid}/commit")
    async def commit(self, sid: int, body: CommitRequest, response: Response) -> CommitResponse:
        ids = await self._tokens(body.text, body.tokens)
        (out, view), _ = await self._on_tree(sid, "commit", lambda rec: (rec.node(body.tip), ids))
        self._ledger.update(view)
        self._tag(response, view.replica)
        return out

    @app.post("/v1/sessions/{sid}/join")
    async def join(self, sid: int, body: JoinRequest, response: Response) -> CommitResponse:
        if body.separator_text is not None and body.separator_tokens is not None:
            raise APIError(400, "give at most one of 'separator_text' or 'separator_tokens'")
        sep = body.separator_tokens if body.separator_tokens is not None else (
            await self._tokens(body.separator_text, None) if body.separator_text else [])
        (out, view), _ = await self._on_tree(sid, "join", lambda rec: (rec.nodes(body.nodes), sep))
        self._ledger.update(view)
        self._tag(response, view.replica)
        return out

    @app.post("/v1/sessions/{sid}/abort")
    async def abort(self, sid: int, body: AbortRequest, response: Response) -> AbortResponse:
        out, rec = await self._on_tree(sid, "abort", lambda rec: (rec.node(body.node),))
        self._tag(response, rec.replica)
        return out

    @app.post("/v1/sessions/{sid}/generate")
    async def generate(self, sid: int, body: GenerateRequest, response: Response) -> GenerateResponse:
        if body.stream:
            raise APIError(400, "stream=true is not supported by the Ray Serve frontend", param="stream")
        if any(not s for s in body.stop):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        info = await self._model()
        eos = () if body.ignore_eos else info.eos_token_ids
        spec = GenerationSpec(body.max_tokens, SamplingParams(body.temperature, body.top_p, body.seed),
                              frozenset(eos), tuple(body.stop), keep_stop_text=True)
        (out, view), _ = await self._on_tree(sid, "generate", lambda rec: (spec,))
        self._ledger.update(view)
        self._tag(response, view.replica)
        return out

    @app.delete("/v1/sessions/{sid}")
    async def close(self, sid: int, response: Response) -> SessionInfo:
        out, rec = await self._on_tree(sid, "close", lambda rec: ())
        self._ledger.drop(sid)
        self._tag(response, rec.replica)
        return out

    # ------------------------------------------------------------------ OpenAI API
    @app.get("/v1/models")
    async def list_models(self) -> ModelList:
        info = await self._model()
        created = int(time.time())
        cards = [ModelCard(id=info.name, created=created, root=info.name)]
        cards += [ModelCard(id=a, created=created, root=a, parent=info.name) for a in info.adapters]
        return ModelList(data=cards)

    async def _complete(self, ids: list[int], adapter: str | None, spec: GenerationSpec) -> tuple[GenerateResponse, str]:
        """One choice: a tree opened on the prompt, generated, closed (its pages stay published)."""
        tree = self._ledger.new_id()
        _, view = await self._open_on_engine(tree, adapter, ids)
        self._ledger.record(adapter, view)
        try:
            (out, view), _ = await self._on_tree(tree, "generate", lambda rec: (spec,))
        finally:
            # Closed whether or not the generation succeeded: a choice's tree never outlives it.
            with contextlib.suppress(APIError):
                await self._on_tree(tree, "close", lambda rec: ())
            self._ledger.drop(tree)
        return out, view.replica

    async def _choices(self, prompts: list[list[int]], adapter: str | None, body: CompletionRequest |
                       ChatCompletionRequest, budget: int | None) -> list[tuple[GenerateResponse, str]]:
        if body.stream:
            raise APIError(400, "stream=true is not supported by the Ray Serve frontend", param="stream")
        info = await self._model()
        try:
            stops = body.stop_strings()
        except ValueError as e:
            raise APIError(400, str(e), param="stop") from None
        specs = []
        for ids in prompts:
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + j
                max_tokens = budget if budget is not None else info.max_context - len(ids)
                specs.append((ids, GenerationSpec(max_tokens, SamplingParams(body.temperature, body.top_p, seed),
                                                  frozenset(info.eos_token_ids), stops)))
        return list(await asyncio.gather(*(self._complete(ids, adapter, s) for ids, s in specs)))

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, response: Response) -> CompletionResponse:
        info = await self._model()
        adapter = self._adapter(info, body.model)
        prompts = [p if isinstance(p, list) else self._tokenizer.encode(p, add_special_tokens=True)
                   for p in body.prompts()]
        results = await self._choices(prompts, adapter, body, body.max_tokens)
        self._tag(response, results[0][1])
        completion = sum(len(r.tokens) for r, _ in results)
        prompt = sum(len(p) for p in prompts)
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
            choices=[CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason)
                     for i, (r, _) in enumerate(results)],
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, response: Response) -> ChatCompletionResponse:
        info = await self._model()
        adapter = self._adapter(info, body.model)
        ids = self._tokenizer.apply_chat_template(body.template_messages())
        results = await self._choices([ids], adapter, body, body.token_budget())
        self._tag(response, results[0][1])
        completion = sum(len(r.tokens) for r, _ in results)
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
            choices=[ChatChoice(index=i, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason)
                     for i, (r, _) in enumerate(results)],
            usage=Usage(prompt_tokens=len(ids), completion_tokens=completion, total_tokens=len(ids) + completion))

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}
