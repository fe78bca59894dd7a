"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Each choice of a request is one engine session: opened on the prompt, decoded on the
EngineWorker, closed when it ends (its committed full pages stay published, so the next
request with the same system prompt hits the prefix index). ``stream=true`` answers with
server-sent events; a client that disconnects mid-stream cancels its generations, which
aborts their sessions and frees their pages.

Tools and structured outputs (``tools/``, ``grammar/``): the prompt is rendered with the
model's template and tool format, the grammar (a required call, a JSON schema) is compiled
off the event loop and travels with each choice's ``SamplingParams`` as an opaque
constraint the sampler applies token by token; replies are parsed into ``tool_calls``.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import SamplingParams
from forkserve.control.layout_policy import Queued
from forkserve.interfaces.server.auth import TenantDep
from forkserve.interfaces.server.disconnect import unless_disconnected
from forkserve.interfaces.server.engine_worker import Chunk, Generation, GenerationSpec
from forkserve.interfaces.server.errors import APIError, stream_error
from forkserve.interfaces.server.grammar import GrammarConstraint
from forkserve.interfaces.server.logprobs import chat_logprobs, completion_logprobs
from forkserve.interfaces.server.merge import merge_tagged
from forkserve.interfaces.server.openai_wire import (
    ChatWire,
    CompletionWire,
    include_usage,
    model_list,
    sse,
    stream_events,
    usage,
)
from forkserve.interfaces.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FunctionCallOut,
    ModelList,
    ToolCallDelta,
    ToolCallOut,
)
from forkserve.interfaces.server.served_model import ServedModel
from forkserve.interfaces.server.state import ServerState, StateDep
from forkserve.interfaces.server.token_log import SampledToken, TokenLog
from forkserve.interfaces.server.tools.formats import ParsedReply
from forkserve.interfaces.server.tools.plan import plan_chat
from forkserve.interfaces.server.tools.stream import ToolCallStream

router = APIRouter()


@router.get("/v1/models")
async def list_models(st: StateDep) -> ModelList:
    m = st.model
    return model_list(m.name, m.adapters, m.created, m.sampling_defaults,
                      m.engine.config.share_base, m.sharing_cost)


@dataclass(frozen=True)
class _Choice:
    gen: Generation
    log: TokenLog | None  # the sampled tokens' records (penalties, logprobs)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, st: StateDep,
                      tenant: TenantDep) -> CompletionResponse | StreamingResponse:
    adapter = st.model.adapter_for(body.model)
    stops = _stops(body.stop_strings)
    prompts = body.prompts()
    tok = st.model.tokenizer
    encoded = await st.worker.call(lambda: [p if isinstance(p, list)
                                            else tok.encode(p, add_special_tokens=True)
                                            for p in prompts])
    budget = body.max_tokens if body.max_tokens is not None else \
        st.model.max_context - max(len(ids) for ids in encoded)
    for ids in encoded:
        st.model.check_vocab(ids)
        st.model.check_length(len(ids), budget)
    echoes = [""] * len(prompts)
    if body.echo:
        echoes = await st.worker.call(lambda: [p if isinstance(p, str) else tok.decode(p)
                                               for p in prompts])
    # Choice index i*n + j: prompt i, sample j (the OpenAI order for batched prompts).
    per_choice = [ids for ids in encoded for _ in range(body.n)]
    choices, cached = await _start(st, request, tenant, per_choice, adapter, budget, body, stops,
                                   body.logprobs, None, None, prompt_logprobs=body.prompt_logprobs)
    wire = CompletionWire.start(body.model)
    prompt_tokens = sum(len(ids) for ids in encoded)
    cached_tokens = sum(cached[::body.n])  # each prompt once, as prompt_tokens counts it
    k = body.logprobs or 0

    def prompt_records(index: int) -> list[SampledToken] | None:
        """The echoed prompt's logprobs (read once its prefill delivered a first chunk)."""
        log = choices[index].log
        return (log.prompt_entries(per_choice[index])
                if body.prompt_logprobs is not None and log else None)

    def chunk(index: int, text: str, reason: str | None,
              records: list[SampledToken] | None = None) -> CompletionResponse:
        lp = (completion_logprobs(records, st.model.token_text, k, 0) if records is not None
              else None)
        return wire.chunk(index, text, reason, lp)

    if body.stream:
        cursors = _Cursors(choices, st.model)
        echoed: set[int] = set()

        def render(index: int, c: Chunk) -> Iterator[CompletionResponse]:
            if body.echo and index not in echoed:
                # A choice's first chunk comes after its prompt's prefill: its logprobs are in.
                echoed.add(index)
                yield chunk(index, echoes[index // body.n], None, prompt_records(index))
            records = cursors.take(index, c)
            if c.text or c.finish_reason or records:
                yield chunk(index, c.text, c.finish_reason, records)

        def usage_chunk(completion_tokens: int) -> CompletionResponse:
            return wire.usage_chunk(usage(prompt_tokens, completion_tokens, cached_tokens))
        events = stream_events(_merged([ch.gen for ch in choices]), render,
                               usage_chunk if include_usage(body.stream_options) else None)
        return _sse(events, choices)

    results = await _collect(request, choices)
    cursors = _Cursors(choices, st.model)
    out = []
    for i, r in enumerate(results):
        echo = echoes[i // body.n]
        records, prompt = cursors.take(i, r), prompt_records(i)
        if prompt is not None and records is not None:
            records, echo_offset = prompt + records, 0  # offsets run over the echoed tokens
        else:
            echo_offset = len(echo)
        lp = (completion_logprobs(records, st.model.token_text, k, echo_offset)
              if records is not None else None)
        out.append(CompletionChoice(index=i, text=echo + r.text, finish_reason=r.finish_reason,
                                    logprobs=lp))
    return wire.body(out, usage(prompt_tokens, sum(len(r.tokens) for r in results), cached_tokens))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, st: StateDep,
                           tenant: TenantDep) -> ChatCompletionResponse | StreamingResponse:
    model = st.model
    adapter = model.adapter_for(body.model)
    stops = _stops(body.stop_strings)
    caps = await st.worker.call(lambda: model.template_caps)
    plan = plan_chat(body, model.tool_format, caps)
    ids = await st.worker.call(lambda: model.tokenizer.apply_chat_template(plan.prompt.messages,
                                                                           tools=plan.prompt.tools))
    budget = body.token_budget()
    budget = budget if budget is not None else model.max_context - len(ids)
    model.check_vocab(ids)
    model.check_length(len(ids), budget)
    # Compiling a schema can take a while: off the event loop, and off the engine thread.
    grammar = (await asyncio.to_thread(plan.grammar.compile, model.grammar_compiler())
               if plan.grammar else None)
    top = body.top_logprobs or 0
    fmt = plan.fmt
    # A reply that ends in tool calls begins a tool pause: its KV stays pinned for the follow-up.
    pin_if = ((lambda text: bool(fmt.parse(text).calls))
              if fmt is not None and model.pin_tool_pauses else None)
    choices, cached = await _start(st, request, tenant, [ids] * body.n, adapter, budget, body,
                                   stops, top if body.logprobs else None, grammar, pin_if)
    wire = ChatWire.start(body.model)

    def logprobs(records: list[SampledToken] | None) -> ChatLogprobs | None:
        return chat_logprobs(records, model.token_text, top) if records is not None else None

    if body.stream:
        cursors = _Cursors(choices, model)
        calls = [ToolCallStream(plan.fmt) if plan.fmt else None for _ in choices]

        def render(index: int, c: Chunk) -> Iterator[ChatCompletionChunk]:
            records = cursors.take(index, c)
            parser = calls[index]
            text = parser.push(c.text) if parser else c.text
            reply = None
            if parser and c.finish_reason:
                rest, reply = parser.finish()
                text += rest
            if text or records:
                yield wire.delta(index, ChatDelta(content=text or None), logprobs(records))
            if reply is not None and reply.calls:
                yield wire.delta(index, ChatDelta(tool_calls=[
                    ToolCallDelta(index=j, id=call.id,
                                  function=FunctionCallOut(name=call.name,
                                                           arguments=call.arguments))
                    for j, call in enumerate(reply.calls)]))
            if c.finish_reason:
                yield wire.finish(index, _finish(c.finish_reason, reply))

        def usage_chunk(completion_tokens: int) -> ChatCompletionChunk:
            return wire.usage_chunk(usage(len(ids), completion_tokens, cached[0]))
        events = stream_events(_merged([ch.gen for ch in choices]), render,
                               usage_chunk if include_usage(body.stream_options) else None,
                               opening=wire.roles(len(choices)))
        return _sse(events, choices)

    results = await _collect(request, choices)
    cursors = _Cursors(choices, model)
    out = []
    for i, r in enumerate(results):
        reply = plan.fmt.parse(r.text) if plan.fmt else ParsedReply(r.text, ())
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in reply.calls] or None
        out.append(ChatChoice(index=i,
                              message=AssistantMessage(content=reply.content, tool_calls=calls),
                              finish_reason=_finish(r.finish_reason, reply),
                              logprobs=logprobs(cursors.take(i, r))))
    return wire.body(out, usage(len(ids), sum(len(r.tokens) for r in results), cached[0]))


# --------------------------------------------------------------------------- helpers
def _stops(stop_strings: Callable[[], tuple[str, ...]]) -> tuple[str, ...]:
    try:
        return stop_strings()
    except ValueError as e:
        raise APIError(400, str(e), param="stop") from None


def _finish(reason: str | None, reply: ParsedReply | None) -> str | None:
    """A reply that ended on its own and holds calls ends in ``tool_calls``."""
    return "tool_calls" if reason == "stop" and reply is not None and reply.calls else reason


class _Cursors:
    """Per choice, how many of its generated tokens already had their logprobs reported."""

    def __init__(self, choices: list[_Choice], model: ServedModel) -> None:
        self._choices, self._sent = choices, [0] * len(choices)
        self._eos = frozenset(model.eos_token_ids)

    def take(self, index: int, c: Chunk) -> list[SampledToken] | None:
        log = self._choices[index].log
        if log is None or self._choices[index].gen.spec.sampling.logprobs is None:
            return None
        begin = self._sent[index]
        self._sent[index] += len(c.tokens)
        # The stop token ends the text; OpenAI reports no logprob for it.
        return [r for r in log.entries(begin, begin + len(c.tokens)) if r.token not in self._eos]


def _bias(body: CompletionRequest | ChatCompletionRequest,
          model: ServedModel) -> tuple[tuple[int, float], ...]:
    bias = body.logit_bias or {}
    vocab = model.engine.config.vocab_size
    bad = [t for t in bias if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"logit_bias token ids out of vocabulary [0, {vocab}): {bad[:5]}",
                       param="logit_bias")
    return tuple(sorted(bias.items()))


async def _start(st: ServerState, request: Request, tenant: str, prompts: list[list[int]],
                 adapter: AdapterId | None, max_tokens: int,
                 body: CompletionRequest | ChatCompletionRequest, stops: tuple[str, ...],
                 logprobs: int | None, grammar: object | None,
                 pin_if: Callable[[str], bool] | None,
                 prompt_logprobs: int | None = None) -> tuple[list[_Choice], list[int]]:
    """One session per choice, opened by the tenancy (limits, the request's cache boundary);
    with a seed, choice j samples with seed + j (distinct, reproducible). Each choice gets its
    own grammar state and token log: they live as long as its generation. Returns the choices
    and each choice's prompt tokens served from the prefix cache. ``prompt_logprobs``: the
    whole prompt is prefilled (no prefix-cache hit: a cached page has no logits), as vLLM does
    for ``prompt_logprobs``; what it writes is still published for later requests."""
    bias = _bias(body, st.model)
    needs_log = (logprobs is not None or prompt_logprobs is not None
                 or bool(body.presence_penalty or body.frequency_penalty))
    salt = st.tenancy.salt(tenant, body.cache_salt)
    temperature, top_p = st.model.sampling_defaults.resolve(body)
    choices: list[_Choice] = []
    cached: list[int] = []

    def opener(ids: list[int]) -> Callable[[Queued], int]:
        def open_choice(queued: Queued) -> int:
            opened = st.tenancy.open(tenant, ids, adapter, salt, max_tokens, expose=False,
                                     reuse_prefix=prompt_logprobs is None, queued=queued)
            cached.append(opened.cached_tokens)
            return opened.engine_id
        return open_choice
    try:
        for j, ids in enumerate(prompts):
            seed = None if body.seed is None else body.seed + (j % body.n)
            log = TokenLog(len(ids)) if needs_log else None
            sampling = SamplingParams(
                temperature, top_p, seed, body.presence_penalty, body.frequency_penalty, bias,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, log=log,
                constraint=GrammarConstraint(grammar, len(ids)) if grammar is not None else None)
            spec = GenerationSpec(max_tokens, sampling, frozenset(st.model.eos_token_ids), stops,
                                  close_when_done=True, pin_if=pin_if)
            # A client that leaves while its opens wait is noticed there, not at _collect.
            choices.append(_Choice(await unless_disconnected(request, st.worker.open_and_generate(
                ids, adapter, spec, salt=salt, opener=opener(ids))), log))
    except BaseException:
        for c in choices:
            c.gen.cancel()
        raise
    return choices, cached


async def _collect(request: Request, choices: list[_Choice]) -> list[Chunk]:
    gens = [c.gen for c in choices]
    try:
        return list(await unless_disconnected(request,
                                              asyncio.gather(*(g.collect() for g in gens))))
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


def _sse(events: AsyncIterator[BaseModel], choices: list[_Choice]) -> StreamingResponse:
    def cancel() -> None:
        # However the stream ends (a client gone included): abort what is still decoding.
        for c in choices:
            c.gen.cancel()
    return sse(events, stream_error, on_close=cancel)
