"""Frontend: the CPU ingress deployment. The OpenAI-compatible routes and the branch routes
of the one-process server (same request/response schemas, same error bodies, same
streaming formats), calling the Engine replicas through a TreeClient (tree_client.py:
routing hints and fail-over).

The branch API's session id *is* the tree id. An OpenAI request opens one tree per choice,
generates and closes it, so its prompt pages stay published on the replica that served it
and the next request with that prefix is routed there. Each response of a tree verb names
the serving replica in ``x-forkserve-replica``.

A client that leaves mid-generation cancels the replica's stream, which aborts the
replica's session, as in the one-process server; the tree itself survives in the ledger
and is re-opened from its committed tokens at its next verb.

``/metrics`` gathers every Engine replica's figures under a ``replica`` label
(cluster_metrics.py). A model a replica builds in code (``ReplicaSpec.loader``: random
weights) has no tokenizer files: such a Frontend takes token ids and refuses text (400).

Access is the one-process server's (SECURITY.md): every route but ``/health`` authenticates
its caller (``auth.authenticate``: Serve copies the FastAPI app at decoration time, so no
middleware can be added per deployment); a session's public id is random and its tenant's
only (``PublicSessionIds`` over tree ids); each tree is opened in its request's trust
boundary (tenant + ``cache_salt``), which the routing hashes carry too.

No ``from __future__ import annotations`` here: ``serve.ingress`` rebuilds the routes of
a class and FastAPI then cannot resolve string annotations, so bodies became query params.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from forkserve.backend.protocol import SamplingParams
from forkserve.control.prefix_index import CacheSalt
from forkserve.interfaces.client import REPLICA_HEADER
from forkserve.interfaces.ray_serve import cluster_metrics
from forkserve.interfaces.ray_serve.ledger import TreeLedger, TreeRecord
from forkserve.interfaces.ray_serve.protocol import ModelInfo, RouteHint
from forkserve.interfaces.ray_serve.tree_client import (
    REPLICA_GONE,
    GenerationStream,
    TreeClient,
)
from forkserve.interfaces.server import openai_wire, schemas
from forkserve.interfaces.server.access import DEFAULT_ACCESS, AccessConfig
from forkserve.interfaces.server.auth import authenticate
from forkserve.interfaces.server.cache_salt import cache_salt
from forkserve.interfaces.server.engine_worker import Chunk, GenerationSpec
from forkserve.interfaces.server.errors import APIError, install_error_handlers
from forkserve.interfaces.server.merge import merge_tagged
from forkserve.interfaces.server.session_ids import PublicSessionIds

app = FastAPI(title="ForkServe (Ray Serve)")
install_error_handlers(app)


def _error_payload(exc: Exception) -> dict:
    """What a stream sends when it breaks after its first byte: a replica lost mid-stream
    reads as 503 (retry: the tree is re-opened from its committed tokens at its next verb)."""
    status = (exc.status if isinstance(exc, APIError)
              else 503 if isinstance(exc, REPLICA_GONE) else 500)
    return {"error": {"message": str(exc), "type": type(exc).__name__, "code": status}}


# How long /metrics waits for a replica before it reports it down.
_SCRAPE_TIMEOUT_S = 5.0


@serve.ingress(app)
class Frontend:
    def __init__(self, engine: DeploymentHandle, access: AccessConfig = DEFAULT_ACCESS) -> None:
        self._engine = engine
        self._access = access
        self._ids = PublicSessionIds()  # public session id -> tree id, per tenant (event loop only)
        self._trees = TreeClient(engine, TreeLedger())
        self._info: ModelInfo | None = None
        self._tokenizer = None
        self._init_lock = asyncio.Lock()

    # ------------------------------------------------------------------ plumbing
    async def _model(self) -> ModelInfo:
        """The served model, asked of a replica on first use (a constructor may not await).
        The tokenizer is loaded from the replica's model path: same node or shared storage."""
        if self._info is not None:
            return self._info
        async with self._init_lock:
            if self._info is None:
                from forkserve.backend.torch.tokenizer import Tokenizer

                info = await self._engine.describe.remote()
                if info.model_path is not None:
                    self._tokenizer = Tokenizer.load(info.model_path)
                self._info = info
        return self._info

    async def _text(self):
        """The tokenizer, for a request that sends text (400 when the model has none)."""
        await self._model()
        if self._tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="tokens")
        return self._tokenizer

    def _adapter(self, info: ModelInfo, model: str) -> str | None:
        if model == info.name:
            return None
        if model in info.adapters:
            return model
        raise APIError(404,
                       f"The model `{model}` does not exist; served: {[info.name, *info.adapters]}",
                       "NotFoundError", "model")

    async def _tokens(self, text: str | None, tokens: list[int] | None) -> list[int]:
        if tokens is not None:
            return tokens
        return (await self._text()).encode(text or "", add_special_tokens=False)

    async def _open(self, info: ModelInfo, adapter: str | None, ids: list[int],
                    salt: CacheSalt) -> tuple[schemas.SessionInfo, int, str]:
        tree = self._trees.ledger.new_id()
        session, view = await self._trees.open(info, tree, adapter, ids, salt)
        self._trees.ledger.record(adapter, view, salt)
        return session, tree, view.replica

    async def _settled(self, tree: int, verb: str, args: Callable[[TreeRecord], tuple],
                       response: Response) -> Any:
        """A verb whose reply carries the tree's committed state after it: the ledger keeps
        that state (what a fail-over re-opens from) and the header names the replica."""
        (out, view), _ = await self._trees.call(await self._model(), tree, verb, args)
        self._trees.ledger.update(view)
        response.headers[REPLICA_HEADER] = view.replica
        return out

    async def _caller(self, request: Request,
                      body: schemas.CompletionRequest | schemas.ChatCompletionRequest
                      ) -> tuple[CacheSalt, ModelInfo, str | None]:
        """An OpenAI request's trust boundary (401 first), the model and the adapter it names."""
        salt = self._salt(self._tenant(request), body.cache_salt)
        info = await self._model()
        return salt, info, self._adapter(info, body.model)

    def _tenant(self, request: Request) -> str:
        return authenticate(self._access.keys, request.headers.get("authorization"))

    def _salt(self, tenant: str, raw: str | None) -> CacheSalt:
        return cache_salt(tenant, raw, self._access.public_prefixes)

    def _tree(self, request: Request, sid: str) -> int:
        """The tree behind the caller's public session id (401 / 404 before anything runs)."""
        return self._ids.resolve(self._tenant(request), sid)

    # ------------------------------------------------------------------ branch API
    @app.post("/v1/sessions")
    async def open_session(self, body: schemas.OpenSessionRequest, request: Request,
                           response: Response) -> schemas.SessionInfo:
        tenant = self._tenant(request)
        salt = self._salt(tenant, body.cache_salt)
        info = await self._model()
        adapter = self._adapter(info, body.model)
        if body.messages is not None:
            ids = (await self._text()).apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages],
                add_generation_prompt=body.add_generation_prompt)
        elif body.text is not None:
            ids = (await self._text()).encode(body.text, add_special_tokens=True)
        else:
            ids = list(body.tokens or [])
        session, tree, replica = await self._open(info, adapter, ids, salt)
        response.headers[REPLICA_HEADER] = replica
        return session.model_copy(update={"session_id": self._ids.bind(tree, tenant)})

    @app.get("/v1/sessions")
    async def list_sessions(self, request: Request) -> schemas.SessionList:
        tenant = self._tenant(request)
        info = await self._model()
        records = [(sid, self._trees.ledger.get(tree)) for sid, tree in self._ids.of_tenant(tenant)]
        return schemas.SessionList(data=[schemas.SessionInfo(session_id=sid, tip=rec.tip,
                                                             model=rec.adapter or info.name,
                                                             committed_tokens=len(rec.committed))
                                         for sid, rec in records])

    @app.get("/v1/sessions/{sid}")
    async def session_info(self, sid: str, request: Request,
                           response: Response) -> schemas.SessionInfo:
        session = await self._settled(self._tree(request, sid), "info", lambda rec: (), response)
        return session.model_copy(update={"session_id": sid})

    @app.post("/v1/sessions/{sid}/fork")
    async def fork(self, sid: str, body: schemas.ForkRequest, request: Request,
                   response: Response) -> schemas.ForkResponse:
        tree = self._tree(request, sid)
        ids = await self._tokens(body.text, body.tokens)
        out, rec = await self._trees.call(await self._model(), tree, "fork",
                                          lambda rec: (rec.node(body.parent), body.label, ids))
        response.headers[REPLICA_HEADER] = rec.replica
        return out

    @app.post("/v1/sessions/{sid}/speculate")
    async def speculate(self, sid: str, body: schemas.SpeculateRequest, request: Request,
                        response: Response) -> schemas.DecisionResponse:
        out, rec = await self._trees.call(await self._model(), self._tree(request, sid),
                                          "speculate",
                                          lambda rec: (rec.node(body.node), body.priority,
                                                       body.t_idle_ms))
        response.headers[REPLICA_HEADER] = rec.replica
        return out

    @app.post("/v1/sessions/{sid}/commit")
    async def commit(self, sid: str, body: schemas.CommitRequest, request: Request,
                     response: Response) -> schemas.CommitResponse:
        tree = self._tree(request, sid)
        ids = await self._tokens(body.text, body.tokens)
        out = await self._settled(tree, "commit", lambda rec: (rec.node(body.tip), ids), response)
        return out.model_copy(update={"session_id": sid})

    @app.post("/v1/sessions/{sid}/join")
    async def join(self, sid: str, body: schemas.JoinRequest, request: Request,
                   response: Response) -> schemas.CommitResponse:
        tree = self._tree(request, sid)
        if body.separator_text is not None and body.separator_tokens is not None:
            raise APIError(400, "give at most one of 'separator_text' or 'separator_tokens'")
        sep = body.separator_tokens if body.separator_tokens is not None else (
            await self._tokens(body.separator_text, None) if body.separator_text else [])
        out = await self._settled(tree, "join", lambda rec: (rec.nodes(body.nodes), sep), response)
        return out.model_copy(update={"session_id": sid})

    @app.post("/v1/sessions/{sid}/abort")
    async def abort(self, sid: str, body: schemas.AbortRequest, request: Request,
                    response: Response) -> schemas.AbortResponse:
        out, rec = await self._trees.call(await self._model(), self._tree(request, sid), "abort",
                                          lambda rec: (rec.node(body.node),))
        response.headers[REPLICA_HEADER] = rec.replica
        return out

    @app.post("/v1/sessions/{sid}/generate", response_model=None)
    async def generate(self, sid: str, body: schemas.GenerateRequest, request: Request,
                       response: Response) -> schemas.GenerateResponse | StreamingResponse:
        tree = self._tree(request, sid)
        if any(not s for s in body.stop):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        info = await self._model()
        eos = () if body.ignore_eos else info.eos_token_ids
        spec = GenerationSpec(body.max_tokens,
                              SamplingParams(body.temperature, body.top_p, body.seed),
                              frozenset(eos), tuple(body.stop), keep_stop_text=True)
        if body.stream:
            stream = await self._trees.stream(info, tree, spec)

            async def lines() -> AsyncIterator[str]:
                try:
                    async for c in stream:
                        yield schemas.GenerateChunk(
                            text=c.text, tokens=list(c.tokens),
                            finish_reason=c.finish_reason).model_dump_json() + "\n"
                except Exception as exc:  # noqa: BLE001 - the client hears of it in the stream
                    yield json.dumps(_error_payload(exc)) + "\n"
            return StreamingResponse(lines(), media_type="application/x-ndjson",
                                     headers={REPLICA_HEADER: stream.replica})
        return await self._settled(tree, "generate", lambda rec: (spec,), response)

    @app.delete("/v1/sessions/{sid}")
    async def close(self, sid: str, request: Request, response: Response) -> schemas.SessionInfo:
        tree = self._tree(request, sid)
        out, replica = await self._trees.close(await self._model(), tree)
        self._ids.forget(tree)
        response.headers[REPLICA_HEADER] = replica
        return out.model_copy(update={"session_id": sid})

    @app.post("/v1/drain")
    async def drain(self, request: Request) -> schemas.DrainResponse:
        """drain_slack on every replica holding a tree of this Frontend, summed."""
        self._tenant(request)
        reports = await self._trees.drain()
        return schemas.DrainResponse(ticks=sum(r.ticks for r in reports),
                             prefill_tokens=sum(r.prefill_tokens for r in reports),
                             decode_tokens=sum(r.decode_tokens for r in reports),
                             slack_filled_tokens=sum(r.slack_filled_tokens for r in reports))

    # ------------------------------------------------------------------ OpenAI API
    @app.get("/v1/models")
    async def list_models(self, request: Request) -> schemas.ModelList:
        self._tenant(request)
        info = await self._model()
        return openai_wire.model_list(info.name, info.adapters, int(time.time()),
                                      info.sampling_defaults, info.share_base,
                                      info.sharing_cost)

    def _specs(self, info: ModelInfo, prompts: list[list[int]],
               body: schemas.CompletionRequest | schemas.ChatCompletionRequest,
               budget: int | None) -> list[tuple[list[int], GenerationSpec]]:
        """One (prompt, spec) per choice, in OpenAI's order; with a seed, sample j of a prompt
        uses seed + j (distinct, reproducible), as in the one-process server."""
        if body.extended_fields():  # tools, schemas, logprobs, penalties: one-process server only
            raise APIError(400,
                           f"not supported with --replicas: {', '.join(body.extended_fields())}",
                           param=body.extended_fields()[0])
        try:
            stops = body.stop_strings()
        except ValueError as e:
            raise APIError(400, str(e), param="stop") from None
        temperature, top_p = info.sampling_defaults.resolve(body)
        out = []
        for ids in prompts:
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + j
                max_tokens = budget if budget is not None else info.max_context - len(ids)
                out.append((ids,
                            GenerationSpec(max_tokens, SamplingParams(temperature, top_p, seed),
                                                frozenset(info.eos_token_ids), stops)))
        return out

    async def _complete(self, info: ModelInfo, adapter: str | None, ids: list[int],
                        spec: GenerationSpec,
                        salt: CacheSalt) -> tuple[schemas.GenerateResponse, str]:
        """One choice: a tree opened on the prompt, generated, closed (its pages stay published)."""
        _, tree, _ = await self._open(info, adapter, ids, salt)
        try:
            (out, view), _ = await self._trees.call(info, tree, "generate", lambda rec: (spec,))
        finally:
            # Closed whether or not the generation succeeded: a choice's tree never outlives it.
            with contextlib.suppress(APIError):
                await self._trees.close(info, tree)
        return out, view.replica

    async def _start_streams(self, info: ModelInfo, adapter: str | None,
                             specs: list[tuple[list[int], GenerationSpec]],
                             salt: CacheSalt) -> list[tuple[int, GenerationStream]]:
        """Every choice's tree opened and its generation started before the response is:
        a refusal is still an HTTP error, not an event."""
        started: list[tuple[int, GenerationStream]] = []
        try:
            for ids, spec in specs:
                _, tree, _ = await self._open(info, adapter, ids, salt)
                try:
                    started.append((tree, await self._trees.stream(info, tree, spec)))
                except BaseException:
                    await self._close_quietly(info, tree)
                    raise
        except BaseException:
            for tree, stream in started:
                stream.cancel()
                await self._close_quietly(info, tree)
            raise
        return started

    async def _close_quietly(self, info: ModelInfo, tree: int) -> None:
        with contextlib.suppress(APIError):
            await self._trees.close(info, tree)

    async def _merged(self, info: ModelInfo,
                      started: list[tuple[int, GenerationStream]]
                      ) -> AsyncIterator[tuple[int, object]]:
        """(choice index, chunk) as chunks come from every choice; each tree is closed when
        its stream ends, and every one when the client leaves."""
        async def close(i: int) -> None:
            await self._close_quietly(info, started[i][0])

        async for tagged in merge_tagged([stream for _, stream in started], on_end=close):
            yield tagged

    @staticmethod
    def _sse(events: AsyncIterator[BaseModel],
             started: list[tuple[int, GenerationStream]]) -> StreamingResponse:
        """The events as SSE; the header names the first choice's replica."""
        return openai_wire.sse(events, _error_payload,
                               headers={REPLICA_HEADER: started[0][1].replica})

    @app.post("/v1/completions", response_model=None)
    async def completions(self, body: schemas.CompletionRequest, request: Request,
                          response: Response) -> schemas.CompletionResponse | StreamingResponse:
        salt, info, adapter = await self._caller(request, body)
        prompts = [p if isinstance(p, list)
                   else (await self._text()).encode(p, add_special_tokens=True)
                   for p in body.prompts()]
        specs = self._specs(info, prompts, body, body.max_tokens)
        wire = openai_wire.CompletionWire.start(body.model)
        prompt_tokens = sum(len(p) for p in prompts)

        if body.stream:
            started = await self._start_streams(info, adapter, specs, salt)

            def render(index: int, c: Chunk) -> Iterator[schemas.CompletionResponse]:
                if c.text or c.finish_reason:
                    yield wire.chunk(index, c.text, c.finish_reason)

            def usage_chunk(completion_tokens: int) -> schemas.CompletionResponse:
                return wire.usage_chunk(openai_wire.usage(prompt_tokens, completion_tokens))
            events = openai_wire.stream_events(self._merged(info, started), render,
                                               usage_chunk
                                               if openai_wire.include_usage(body.stream_options)
                                               else None)
            return self._sse(events, started)

        results = await asyncio.gather(*(self._complete(info, adapter, ids, s, salt)
                                         for ids, s in specs))
        response.headers[REPLICA_HEADER] = results[0][1]
        return wire.body([schemas.CompletionChoice(index=i, text=r.text,
                                                   finish_reason=r.finish_reason)
                          for i, (r, _) in enumerate(results)],
                         openai_wire.usage(prompt_tokens, sum(len(r.tokens) for r, _ in results)))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, body: schemas.ChatCompletionRequest, request: Request,
                               response: Response
                               ) -> schemas.ChatCompletionResponse | StreamingResponse:
        salt, info, adapter = await self._caller(request, body)
        ids = (await self._text()).apply_chat_template(body.template_messages())
        specs = self._specs(info, [ids], body, body.token_budget())
        wire = openai_wire.ChatWire.start(body.model)

        if body.stream:
            started = await self._start_streams(info, adapter, specs, salt)

            def render(index: int, c: Chunk) -> Iterator[schemas.ChatCompletionChunk]:
                if c.text:
                    yield wire.delta(index, schemas.ChatDelta(content=c.text))
                if c.finish_reason:
                    yield wire.finish(index, c.finish_reason)

            def usage_chunk(completion_tokens: int) -> schemas.ChatCompletionChunk:
                return wire.usage_chunk(openai_wire.usage(len(ids), completion_tokens))
            events = openai_wire.stream_events(self._merged(info, started), render,
                                               usage_chunk
                                               if openai_wire.include_usage(body.stream_options)
                                               else None,
                                               opening=wire.roles(len(started)))
            return self._sse(events, started)

        results = await asyncio.gather(*(self._complete(info, adapter, p, s, salt)
                                         for p, s in specs))
        response.headers[REPLICA_HEADER] = results[0][1]
        return wire.body([schemas.ChatChoice(index=i,
                                             message=schemas.AssistantMessage(content=r.text),
                                             finish_reason=r.finish_reason)
                          for i, (r, _) in enumerate(results)],
                         openai_wire.usage(len(ids), sum(len(r.tokens) for r, _ in results)))

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Every Engine replica's figures, labelled by replica, and the cluster's hit ratios."""
        self._tenant(request)
        ctx = serve.get_replica_context()
        names = cluster_metrics.replica_names(ctx.app_name, self._engine.deployment_name)

        async def scrape(name: str) -> str | None:
            hint = RouteHint(0, None, replica=name)
            try:
                return await asyncio.wait_for(self._engine.metrics.remote(hint), _SCRAPE_TIMEOUT_S)
            except (asyncio.TimeoutError, *REPLICA_GONE):
                return None

        texts = await asyncio.gather(*(scrape(n) for n in names))
        counts = cluster_metrics.FrontendCounts(len(self._trees.ledger.trees),
                                                self._trees.ledger.moves)
        body = cluster_metrics.render(dict(zip(names, texts, strict=True)), counts)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}
