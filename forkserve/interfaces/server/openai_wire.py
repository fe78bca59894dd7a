"""The OpenAI wire format, in one place: model cards, response ids, stream chunks, usage
blocks and server-sent-event framing.

Both OpenAI front ends use it: the one-process routes (``openai_api.py``) and the Ray Serve
Frontend (``ray_serve/frontend.py``, which may import from ``server/``, never the reverse).
Each decides *what* a request's choices say from its own engine calls; how that reads on
the wire is decided here, so the two cannot drift apart.

A ``CompletionWire`` / ``ChatWire`` lives for one request: every chunk and the final body
carry its id, creation time and model name.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from forkserve.config import ShareBase
from forkserve.interfaces.server.generation_defaults import SamplingDefaults
from forkserve.interfaces.server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingDefaultsCard,
    SharingCostCard,
    StreamOptions,
    Usage,
)


def model_list(name: str, adapters: Iterable[str], created: int, defaults: SamplingDefaults,
               share_base: ShareBase, sharing_cost: SharingCostCard | None = None) -> ModelList:
    """``/v1/models``: the base model, then each adapter as a model of its own (vLLM's
    ``--lora-modules`` convention), each card with the server's sampling defaults, its
    cache-sharing policy and that policy's measured cost (docs/SERVER.md)."""
    sampling = SamplingDefaultsCard(temperature=defaults.temperature, top_p=defaults.top_p,
                                    source=defaults.source)

    def card(model: str, parent: str | None) -> ModelCard:
        return ModelCard(id=model, created=created, root=model, parent=parent,
                         sampling_defaults=sampling, share_base=share_base.value,
                         share_base_cost=sharing_cost)
    return ModelList(data=[card(name, None), *(card(a, name) for a in sorted(adapters))])


def usage(prompt: int, completion: int, cached: int | None = None) -> Usage:
    """``cached``: prompt tokens served from the prefix cache; None where the front end
    does not know (the block then has no ``prompt_tokens_details``)."""
    details = PromptTokensDetails(cached_tokens=cached) if cached is not None else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion, prompt_tokens_details=details)


def include_usage(options: StreamOptions | None) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(options and options.include_usage)


@dataclass(frozen=True)
class _Reply:
    """What every chunk and the final body of one response carry."""

    id: str
    created: int
    model: str
    ID_PREFIX: ClassVar[str]

    @classmethod
    def start(cls, model: str) -> Self:
        """A new response: a fresh id, created now."""
        return cls(f"{cls.ID_PREFIX}-{uuid.uuid4().hex}", int(time.time()), model)


class CompletionWire(_Reply):
    """One ``/v1/completions`` response's chunks and body."""

    ID_PREFIX = "cmpl"

    def chunk(self, index: int, text: str, finish_reason: str | None,
              logprobs: CompletionLogprobs | None = None) -> CompletionResponse:
        return self.body([CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                           logprobs=logprobs)])

    def usage_chunk(self, block: Usage) -> CompletionResponse:
        """A stream's last chunk: usage only, no choice."""
        return self.body([], block)

    def body(self, choices: list[CompletionChoice], block: Usage | None = None
             ) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=choices, usage=block)


class ChatWire(_Reply):
    """One ``/v1/chat/completions`` response's chunks and body."""

    ID_PREFIX = "chatcmpl"

    def roles(self, n: int) -> ChatCompletionChunk:
        """A stream's first chunk: every choice's role, no content yet."""
        return self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                            for i in range(n)])

    def delta(self, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None = None
              ) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])

    def finish(self, index: int, finish_reason: str) -> ChatCompletionChunk:
        """A choice's last chunk: an empty delta and why it ended (as OpenAI streams it)."""
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(),
                                            finish_reason=finish_reason)])

    def usage_chunk(self, block: Usage) -> ChatCompletionChunk:
        """A stream's last chunk: usage only, no choice."""
        return self._chunk([], block)

    def body(self, choices: list[ChatChoice], block: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=choices, usage=block)

    def _chunk(self, choices: list[ChatChunkChoice], block: Usage | None = None
               ) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=choices, usage=block)


class Tokens(Protocol):
    """A piece of a generation as both front ends stream it (engine_worker.Chunk)."""

    tokens: tuple[int, ...]


async def stream_events(tagged: AsyncIterator[tuple[int, Tokens]],
                        render: Callable[[int, Any], Iterable[BaseModel]],
                        usage_chunk: Callable[[int], BaseModel] | None = None,
                        opening: BaseModel | None = None) -> AsyncIterator[BaseModel]:
    """A stream's events: ``opening`` if any, then what ``render(choice index, piece)``
    makes of each generated piece as it comes, then, when the client asked for usage,
    ``usage_chunk(completion tokens)`` (every choice's generated tokens counted)."""
    if opening is not None:
        yield opening
    completion = 0
    async for index, piece in tagged:
        completion += len(piece.tokens)
        for event in render(index, piece):
            yield event
    if usage_chunk is not None:
        yield usage_chunk(completion)


def sse(events: AsyncIterator[BaseModel], error: Callable[[Exception], Mapping[str, Any]],
        on_close: Callable[[], None] | None = None,
        headers: Mapping[str, str] | None = None) -> StreamingResponse:
    """Events as server-sent events ending in ``[DONE]``. The headers (200) go out before
    the first event, so a failure after them is told in-band: ``error(exc)`` is the body a
    plain response would have had. ``on_close`` runs however the stream ends, a client
    that left included (it cancels this generator)."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {event.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - the headers are sent: the error goes in-band
            yield f"data: {json.dumps(error(exc))}\n\n"
        finally:
            if on_close is not None:
                on_close()
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
