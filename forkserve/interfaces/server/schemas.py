"""Request and response bodies of the HTTP API (pydantic, frozen).

The OpenAI half mirrors the fields of the public OpenAI API that the server implements;
a field the server cannot honour (logprobs, tools, penalties) is declared so that asking
for it gets a 400 instead of being silently ignored. The branch half is ForkServe's own:
one body per verb of ``forkserve.engine.Engine``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class _Sampling(_Frozen):
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None  # prefix-cache boundary inside the tenant (cache_salt.py)

    @model_validator(mode="after")
    def _reject_unsupported(self) -> "_Sampling":
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence/frequency penalties and logit_bias are not supported")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return tuple(stops)


class StreamOptions(_Frozen):
    include_usage: bool = False


# ----------------------------------------------------------------------------- OpenAI
class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) request: text or token ids each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(_Frozen):
    type: Literal["text"]
    text: str


class ChatMessage(_Frozen):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class PromptTokensDetails(_Frozen):
    cached_tokens: int  # prompt tokens served from the prefix cache (the caller's boundary only)


class Usage(_Frozen):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(_Frozen):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(_Frozen):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Frozen):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Frozen):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(_Frozen):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Frozen):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Frozen):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_Frozen):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Frozen):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "forkserve"
    root: str
    parent: str | None = None


class ModelList(_Frozen):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Frozen):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(_Frozen):
    error: ErrorDetail


# ----------------------------------------------------------------------------- branches
class _Tokens(_Frozen):
    """Exactly one of ``text`` (encoded by the server's tokenizer) or ``tokens``."""

    text: str | None = None
    tokens: list[int] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "_Tokens":
        if (self.text is None) == (self.tokens is None):
            raise ValueError("give exactly one of 'text' or 'tokens'")
        return self


class OpenSessionRequest(_Frozen):
    model: str
    text: str | None = None
    tokens: list[int] | None = None
    messages: list[ChatMessage] | None = None
    # With messages: end the prompt with the assistant header (what generate continues).
    add_generation_prompt: bool = True
    cache_salt: str | None = None  # prefix-cache boundary inside the tenant (cache_salt.py)

    @model_validator(mode="after")
    def _one_of(self) -> "OpenSessionRequest":
        if sum(x is not None for x in (self.text, self.tokens, self.messages)) != 1:
            raise ValueError("give exactly one of 'text', 'tokens' or 'messages'")
        return self


class SessionInfo(_Frozen):
    session_id: str  # opaque, unguessable, the opening tenant's only (tenancy.py)
    tip: int
    model: str
    committed_tokens: int


class SessionList(_Frozen):
    object: Literal["list"] = "list"
    data: list[SessionInfo]


class ForkRequest(_Tokens):
    parent: int
    label: str = "branch"


class ForkResponse(_Frozen):
    node: int
    tokens: int


class SpeculateRequest(_Frozen):
    node: int
    priority: float = 1.0
    t_idle_ms: float | None = None


class DecisionResponse(_Frozen):
    action: str
    score: float | None
    hit_tokens: int
    miss_tokens: int
    reason: str


class CommitRequest(_Tokens):
    tip: int


class JoinRequest(_Frozen):
    nodes: list[int] = Field(min_length=1)
    separator_text: str | None = None
    separator_tokens: list[int] | None = None


class CommitResponse(_Frozen):
    session_id: str
    tip: int
    bound_node: int | None
    matched_tokens: int
    prefilled_tokens: int
    aborted: list[int]


class AbortRequest(_Frozen):
    node: int


class AbortResponse(_Frozen):
    released_nodes: list[int]
    freed_pages: int


class GenerateRequest(_Frozen):
    max_tokens: int = Field(ge=0)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False


class GenerateResponse(_Frozen):
    text: str
    tokens: list[int]
    finish_reason: str
    tip: int


class GenerateChunk(_Frozen):
    text: str
    tokens: list[int]
    finish_reason: str | None = None


class DrainResponse(_Frozen):
    ticks: int
    prefill_tokens: int
    decode_tokens: int
    slack_filled_tokens: int


_Sampling.model_rebuild()
