"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Each choice of a request is one engine session: opened on the prompt, decoded on the
EngineWorker, closed when it ends (its committed full pages stay published, so the next
request with the same system prompt hits the prefix index). ``stream=true`` answers with
server-sent events; a client that disconnects mid-stream cancels its generations, which
aborts their sessions and frees their pages.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from forkserve.backend.protocol import SamplingParams
from forkserve.interfaces.server.auth import TenantDep
from forkserve.interfaces.server.disconnect import unless_disconnected
from forkserve.interfaces.server.engine_worker import Chunk, Generation, GenerationSpec
from forkserve.interfaces.server.errors import APIError, stream_error
from forkserve.interfaces.server.merge import merge_tagged
from forkserve.interfaces.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from forkserve.interfaces.server.state import ServerState, StateDep

router = APIRouter()


@router.get("/v1/models")
async def list_models(st: StateDep) -> ModelList:
    m = st.model
    cards = [ModelCard(id=m.name, created=m.created, root=m.name)]
    cards += [ModelCard(id=name, created=m.created, root=name, parent=m.name) for name in sorted(m.adapters)]
    return ModelList(data=cards)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, st: StateDep,
                      tenant: TenantDep) -> CompletionResponse | StreamingResponse:
    adapter = st.model.adapter_for(body.model)
    stops = _stops(body.stop_strings)
    prompts = body.prompts()
    tok = st.model.tokenizer
    encoded = await st.worker.call(lambda: [p if isinstance(p, list) else tok.encode(p, add_special_tokens=True)
                                            for p in prompts])
    budget = body.max_tokens if body.max_tokens is not None else \
        st.model.max_context - max(len(ids) for ids in encoded)
    for ids in encoded:
        st.model.check_vocab(ids)
        st.model.check_length(len(ids), budget)
    # Choice index i*n + j: prompt i, sample j (the OpenAI order for batched prompts).
    per_choice = [ids for ids in encoded for _ in range(body.n)]
    gens, cached = await _start(st, tenant, per_choice, adapter, budget, body, stops)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    prompt_tokens = sum(len(ids) for ids in encoded)
    cached_tokens = sum(cached[::body.n])  # each prompt once, as prompt_tokens counts it

    def chunk(index: int, text: str, reason: str | None, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=rid, created=created, model=body.model, usage=usage,
                                  choices=[CompletionChoice(index=index, text=text, finish_reason=reason)]
                                  if index >= 0 else [])

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[BaseModel]:
            completion_tokens = 0
            async for index, c in _merged(gens):
                completion_tokens += len(c.tokens)
                if c.text or c.finish_reason:
                    yield chunk(index, c.text, c.finish_reason)
            if include_usage:
                yield chunk(-1, "", None, _usage(prompt_tokens, completion_tokens, cached_tokens))
        return _sse(events(), gens)

    results = await _collect(request, gens)
    return CompletionResponse(
        id=rid, created=created, model=body.model,
        choices=[CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason)
                 for i, r in enumerate(results)],
        usage=_usage(prompt_tokens, sum(len(r.tokens) for r in results), cached_tokens))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, st: StateDep,
                           tenant: TenantDep) -> ChatCompletionResponse | StreamingResponse:
    adapter = st.model.adapter_for(body.model)
    stops = _stops(body.stop_strings)
    messages = body.template_messages()
    ids = await st.worker.call(lambda: st.model.tokenizer.apply_chat_template(messages))
    budget = body.token_budget()
    budget = budget if budget is not None else st.model.max_context - len(ids)
    st.model.check_vocab(ids)
    st.model.check_length(len(ids), budget)
    gens, cached = await _start(st, tenant, [ids] * body.n, adapter, budget, body, stops)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, created=created, model=body.model, choices=choices, usage=usage)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[BaseModel]:
            yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                         for i in range(len(gens))])
            completion_tokens = 0
            async for index, c in _merged(gens):
                completion_tokens += len(c.tokens)
                if c.text or c.finish_reason:
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=c.text or None),
                                                 finish_reason=c.finish_reason)])
            if include_usage:
                yield chunk([], _usage(len(ids), completion_tokens, cached[0]))
        return _sse(events(), gens)

    results = await _collect(request, gens)
    return ChatCompletionResponse(
        id=rid, created=created, model=body.model,
        choices=[ChatChoice(index=i, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason)
                 for i, r in enumerate(results)],
        usage=_usage(len(ids), sum(len(r.tokens) for r in results), cached[0]))


# --------------------------------------------------------------------------- helpers
def _stops(stop_strings: Callable[[], tuple[str, ...]]) -> tuple[str, ...]:
    try:
        return stop_strings()
    except ValueError as e:
        raise APIError(400, str(e), param="stop") from None


def _usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _start(st: ServerState, tenant: str, prompts: list[list[int]], adapter: int | None, max_tokens: int,
                 body: CompletionRequest | ChatCompletionRequest,
                 stops: tuple[str, ...]) -> tuple[list[Generation], list[int]]:
    """One session per choice, opened by the tenancy (limits, the request's cache boundary);
    with a seed, choice j samples with seed + j (distinct, reproducible). Returns the
    generations and each choice's prompt tokens served from the prefix cache."""
    salt = st.tenancy.salt(tenant, body.cache_salt)
    gens: list[Generation] = []
    cached: list[int] = []

    def opener(ids: list[int]) -> Callable[[], int]:
        def open_choice() -> int:
            opened = st.tenancy.open(tenant, ids, adapter, salt, max_tokens, expose=False)
            cached.append(opened.cached_tokens)
            return opened.engine_id
        return open_choice
    try:
        for j, ids in enumerate(prompts):
            seed = None if body.seed is None else body.seed + (j % body.n)
            spec = GenerationSpec(max_tokens, SamplingParams(body.temperature, body.top_p, seed),
                                  frozenset(st.model.eos_token_ids), stops, close_when_done=True)
            gens.append(await st.worker.open_and_generate(ids, adapter, spec, opener=opener(ids)))
    except BaseException:
        for g in gens:
            g.cancel()
        raise
    return gens, cached


async def _collect(request: Request, gens: list[Generation]) -> list[Chunk]:
    try:
        return list(await unless_disconnected(request, asyncio.gather(*(g.collect() for g in gens))))
    finally:
        for g in gens:
            g.cancel()  # no-op for finished ones; aborts the rest if the client went away


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Chunk]]:
    """Chunks of several generations as they come, tagged with the choice index."""
    if len(gens) == 1:
        async for c in gens[0]:
            yield 0, c
        return
    async for tagged in merge_tagged(gens):
        yield tagged


def _sse(events: AsyncIterator[BaseModel], gens: list[Generation]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {event.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - the headers are sent: the error goes in-band
            yield f"data: {json.dumps(stream_error(exc))}\n\n"
        finally:
            # A disconnect cancels this generator: abort what is still decoding.
            for g in gens:
                g.cancel()
    return StreamingResponse(body(), media_type="text/event-stream")
