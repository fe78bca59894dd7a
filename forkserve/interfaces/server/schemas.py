"""Request and response bodies of the HTTP API (pydantic, frozen).

The OpenAI half mirrors the fields of the public OpenAI API that the server implements;
any other field is refused with a 400 that names it (``extra="forbid"``), and the few
that are ignored by design (``user``, ``metadata``, ``store``, ``service_tier``) are declared
as such, so nothing a client asks for is silently dropped. The branch half is ForkServe's own:
one body per verb of ``forkserve.engine.Engine``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class _Strict(_Frozen):
    """An OpenAI request body: a field the server does not implement is a 400 naming it,
    never silently dropped (docs/SERVER.md lists supported, refused and ignored fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class _Sampling(_Strict):
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    cache_salt: str | None = None  # prefix-cache boundary inside the tenant (cache_salt.py)
    # Ignored by design: they describe the caller or the provider's bookkeeping, not the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _check_bias(self) -> "_Sampling":
        if any(not -100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return self

    def extended_fields(self) -> list[str]:
        """The fields set here that need more than temperature / top-p sampling (a front end
        that cannot honour them refuses them by name)."""
        return [f for f in ("presence_penalty", "frequency_penalty", "logit_bias")
                if getattr(self, f)]

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return tuple(stops)


class StreamOptions(_Strict):
    include_usage: bool = False


# ----------------------------------------------------------------------------- OpenAI
class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is empty")
        return self

    @property
    def prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's log-probabilities too (top ``logprobs`` each)."""
        return self.logprobs if self.echo else None

    def extended_fields(self) -> list[str]:
        return super().extended_fields() + [f for f in ("echo",) if self.echo] + \
            (["logprobs"] if self.logprobs is not None else [])

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) request: text or token ids each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (content flattened to text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # every call is enforced by the grammar; strict or not


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # enforced by the grammar either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format json_schema needs (only) a json_schema object")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema every reply must match (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_ or {"type": "object"}
        return None


class ChatCompletionRequest(_Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice required or named needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names():
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if len(set(self.tool_names())) != len(self.tool_names()):
            raise ValueError("tools have duplicate names")
        return self

    def extended_fields(self) -> list[str]:
        fields = super().extended_fields() + [f for f in ("logprobs", "tools") if getattr(self, f)]
        if self.response_format is not None and self.response_format.type != "text":
            fields.append("response_format")
        if any(m.tool_calls or m.role == "tool" for m in self.messages):
            fields.append("messages (tool calls)")
        return fields

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def token_budget(self) -> int | None:
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


class PromptTokensDetails(_Frozen):
    cached_tokens: int  # prompt tokens served from the prefix cache (the caller's boundary only)


class Usage(_Frozen):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Frozen):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(_Frozen):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Frozen):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Frozen):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Frozen):
    content: list[TokenLogprob]
    refusal: None = None


class FunctionCallOut(_Frozen):
    name: str
    arguments: str


class ToolCallOut(_Frozen):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Frozen):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Frozen):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Frozen):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(_Frozen):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatDelta(_Frozen):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Frozen):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Frozen):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class SamplingDefaultsCard(_Frozen):
    """What a request that omits ``temperature`` / ``top_p`` samples with, and where that
    came from (``openai``, or the model's file: generation_defaults.py)."""

    temperature: float
    top_p: float
    source: str


class SharingCostCard(_Frozen):
    """The measured answer-quality cost of the deployment's cross-adapter sharing: its
    readers' paired F1 change against a reference that shares nothing, from the quality
    report the server was started with (sharing_cost.py; docs/QUALITY.md)."""

    mode: str                     # the report's row (``disaggregated``, ``neutral``, ...)
    model: str                    # the model the report measured
    delta_f1: float               # F1 points (x100), readers only; negative: a loss
    ci95: tuple[float, float]     # bootstrap 95% interval of ``delta_f1``
    readers: int
    rounds: int
    reference: str                # the mode the readers are paired with
    kv_vs_unified: float | None   # the shared context's KV against unified's
    source: str                   # the report's file name


class ModelCard(_Frozen):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "forkserve"
    root: str
    parent: str | None = None
    # ForkServe's own (docs/SERVER.md): the sampling defaults, and who may read base-side
    # K/V an adapter wrote (config.ShareBase: "cross_adapter", "exact" or "neutral").
    sampling_defaults: SamplingDefaultsCard
    share_base: str
    # Its measured cost (``--quality-report``); null without a report or where no adapter
    # reads another forward's base K/V.
    share_base_cost: SharingCostCard | None = None


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
