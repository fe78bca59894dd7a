"""ServedModel: what the server serves — one engine, its tokenizer and its adapters by name.

Adapters follow vLLM's ``--lora-modules`` convention: each LoRA is exposed as a model of
its own, and the ``model`` field of a request picks the base model or one adapter.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from forkserve.adapter_key import AdapterId, AdapterKey, adapter_key
from forkserve.config import ForkServeConfig
from forkserve.control.call_loop import CallLoopScorer
from forkserve.control.scorers import CompositeScorer, LegalityScorer, LoopScorer
from forkserve.engine import Engine
from forkserve.interfaces.server.errors import APIError
from forkserve.interfaces.server.generation_defaults import (
    OPENAI_DEFAULTS,
    GenerationConfigMode,
    SamplingDefaults,
    load_sampling_defaults,
)
from forkserve.interfaces.server.grammar import GrammarCompiler
from forkserve.interfaces.server.schemas import SharingCostCard
from forkserve.interfaces.server.tools.call_reader import ToolCallReader
from forkserve.interfaces.server.tools.chat_prompt import TemplateCaps
from forkserve.interfaces.server.tools.formats import ToolFormat, choose_format
from forkserve.interfaces.server.tools.legality import CallLegality

# Cold prompts up to this many tokens find their prefill plans built at start-up
# (``TorchBackend.warm_cold_prefill``); longer ones build theirs on first sight.
WARM_PREFILL_TOKENS = 8192


class TextTokenizer(Protocol):
    hf: Any              # the transformers tokenizer (the grammar engine's token table)
    chat_template: str

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]: ...

    def render_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None) -> str: ...


@dataclass(frozen=True)
class ServedModel:
    name: str
    engine: Engine
    tokenizer: TextTokenizer
    adapters: Mapping[str, AdapterId]  # adapter name -> the backend's id for it
    max_context: int                   # prompt + completion, tokens
    eos_token_ids: tuple[int, ...]
    # Structured outputs, required calls, the legality check; None for a model built in code
    # with no text tokenizer (token ids only), which refuses them.
    grammars: GrammarCompiler | None
    created: int = field(default_factory=lambda: int(time.time()))
    # A chat reply that ends in tool calls pins its KV through the tool pause (docs/SERVER.md).
    pin_tool_pauses: bool = True
    # What a request that omits temperature / top_p samples with (generation_defaults.py).
    sampling_defaults: SamplingDefaults = OPENAI_DEFAULTS
    # The measured cost of the engine's cross-adapter sharing (sharing_cost.py); /v1/models.
    sharing_cost: SharingCostCard | None = None

    def grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            raise APIError(400, f"model {self.name!r} has no text tokenizer: structured outputs "
                                "and required tool calls are not available",
                           param="response_format")
        return self.grammars

    def adapter_for(self, model: str) -> AdapterId | None:
        """The adapter id a request's ``model`` names (None: the base model)."""
        if model == self.name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        raise APIError(404, f"The model `{model}` does not exist; served: "
                            f"{[self.name, *sorted(self.adapters)]}", "NotFoundError", "model")

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if prompt_tokens + max_tokens > self.max_context:
            raise APIError(400, f"This model's maximum context length is {self.max_context} "
                                f"tokens; the request has {prompt_tokens} prompt tokens and "
                                f"asks for {max_tokens} completion tokens", param="max_tokens")

    @cached_property
    def adapter_names(self) -> Mapping[AdapterKey, str]:
        """The name clients send for each adapter, by the key its cache pages are filed under
        (``PublishedPage.adapter``)."""
        return {adapter_key(aid): name for name, aid in self.adapters.items()}

    @cached_property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls, by its chat template's markup."""
        return choose_format(self.tokenizer.chat_template)

    @cached_property
    def template_caps(self) -> TemplateCaps:
        """What the chat template renders of tools (probed once; uses the tokenizer, so the
        first call runs on the engine thread like every tokenizer call)."""
        return TemplateCaps.probe(self.tokenizer.render_chat)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def check_vocab(self, tokens: Sequence[int]) -> None:
        vocab = self.engine.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of vocabulary [0, {vocab}): {bad[:5]}",
                           param="prompt")


def served_name(model_path: str | Path, name: str | None = None) -> str:
    """The id clients send as ``model``: ``name``, else the folder or .gguf file's name."""
    path = Path(model_path)
    return name or (path.stem if path.suffix == ".gguf" else path.name)


def load_served_model(model_path: str | Path, *, config: ForkServeConfig,
                      loras: Mapping[str, str | Path] | None = None, name: str | None = None,
                      device: str | None = None, dtype: str | None = None,
                      attention: str = "auto", use_cuda_graphs: bool = True,
                      generation_config: GenerationConfigMode = "auto",
                      sharing_cost: SharingCostCard | None = None) -> ServedModel:
    """A TorchBackend over an HF folder or a .gguf file, wrapped in an Engine;
    ``generation_config``: whose sampling defaults requests get (generation_defaults.py);
    ``sharing_cost``: what ``config``'s sharing measured (``load_sharing_cost``)."""
    import torch

    from forkserve.backend.torch import TorchBackend

    torch_dtype = getattr(torch, dtype) if dtype else None
    backend = TorchBackend(config, model_path, dict(loras or {}), device=device, dtype=torch_dtype,
                           attention=attention, use_cuda_graphs=use_cuda_graphs)
    # The prefill's kernels and plans are built now rather than inside the first requests:
    # FlashAttention-4 compiles ~3 s per configuration, cuDNN plans ~42 ms per cold length
    # (off CUDA nothing is built).
    backend.warm_cold_prefill(min(WARM_PREFILL_TOKENS, backend.max_context))
    tokenizer = backend.tokenizer
    eos = tuple(dict.fromkeys((*backend.eos_token_ids, *tokenizer.eos_token_ids)))
    grammars = GrammarCompiler(tokenizer.hf, backend.config.vocab_size, eos)

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)
    # The branch cascade rejects a residual that cannot parse as a call in the model's format,
    # and judges a residual of calls as a loop only when it repeats a recent call (not markup).
    fmt = choose_format(tokenizer.chat_template)
    loops = CallLoopScorer(ToolCallReader(fmt, decode), LoopScorer())
    calls = CallLegality(fmt, grammars, decode)
    engine = Engine(backend, scorer=CompositeScorer([loops, LegalityScorer(decode, calls=calls)]))
    return ServedModel(name=served_name(model_path, name), engine=engine,
                       tokenizer=tokenizer, adapters=backend.adapters,
                       max_context=min(engine.config.max_context, backend.max_context),
                       eos_token_ids=eos,
                       sampling_defaults=load_sampling_defaults(model_path, generation_config),
                       grammars=grammars, sharing_cost=sharing_cost)
