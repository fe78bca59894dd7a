"""The Backend protocol: the only door between the control plane (L2-L3) and execution (L1).

Ownership rules
---------------
* Page ids are integers owned by the control plane's ``PagePool``s. A backend never
  allocates or frees a page; it holds storage for ``config.num_pages`` pages of each kind
  it uses and reads/writes the rows it is told to.
* A ``SeqWork`` names, through ``KVSlots``, every page that covers positions
  ``[0, start_pos + len(tokens))`` of the sequence. The backend writes K/V (or, in the
  mock, token ids) of ``tokens`` at positions ``start_pos...`` into those pages and reads
  the rest. The control plane guarantees the pages it writes are not shared (it copies a
  shared partial page first through ``copy_pages``).
* Tensors never cross this boundary: only ints, tuples and the frozen results below.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

from forkserve.adapter_key import AdapterId
from forkserve.backend.capabilities import Capabilities
from forkserve.config import ForkServeConfig, KVForm

PageId = int
HostSlotId = int  # a slot of the host (CPU) tier; owned by the control plane's ``HostTier``


class PageKind(str, enum.Enum):
    UNIFIED = "unified"    # merged K/V of one adapter (or of the base model)
    BASE = "base"          # disaggregated: xW with RoPE applied (K) and xW (V)
    RESIDUAL = "residual"  # disaggregated: per-adapter xA_k, xA_v (rank r, no RoPE)


class HostCopy(NamedTuple):
    """One page's trip between the device and the host tier: device ``page`` <-> host ``slot``."""

    page: PageId
    slot: HostSlotId


@runtime_checkable
class TokenConstraint(Protocol):
    """A request's grammar state (structured outputs, required tool calls): an opaque handle
    the control plane carries in ``SamplingParams`` and the backend's sampler consults.

    It lives from the request's start to the end (or abort) of its generation and is owned
    by the requester. Positions make it exact when a position is sampled again (a resampled
    last position): a handle asked about a position it has already passed rolls back to it.
    Its ``filler`` writes the allowed tokens of every constraint of its kind in a step."""

    @property
    def filler(self) -> "BitmaskFiller":
        """The strategy that fills this constraint's bitmask row (shared by its kind)."""

    def accept(self, token: int, position: int) -> None:
        """``token`` was sampled for ``position``: advance the grammar past it."""


@runtime_checkable
class BitmaskFiller(Protocol):
    """Fills a step's grammar masks in one call, so a grammar engine can fill the rows of a
    batch in parallel (xgrammar's batch fill runs on its own threads, off the GIL). Supplied
    with the constraints by whoever made them; it holds no request's state.

    The bitmask is the backend's buffer, never a value crossing the protocol: int32 words
    ``[rows, ceil(vocab / 32)]`` on the host, bit ``j`` of word ``i`` allowing token
    ``32 * i + j`` (xgrammar's and llguidance's layout)."""

    def fill(self, bitmask: object, rows: Sequence[tuple[TokenConstraint, int, int]]) -> None:
        """For each ``(constraint, row, position)``: write the tokens ``constraint`` allows at
        ``position`` into row ``row`` of ``bitmask``."""


@runtime_checkable
class SampleLog(Protocol):
    """A request's record of what was sampled (penalties read it, logprobs land in it);
    same lifetime and ownership as a ``TokenConstraint``. Plain numbers only."""

    def history(self, position: int) -> Sequence[int]:
        """The tokens this request's generation sampled before ``position``."""

    def record(self, position: int, token: int, logprob: float,
               top: tuple[tuple[int, float], ...]) -> None:
        """``token`` (log-probability ``logprob``) was sampled for ``position``; ``top``:
        the most likely tokens there with theirs, most likely first (empty if not asked)."""

    def record_prompt(self, position: int, token: int, logprob: float,
                      top: tuple[tuple[int, float], ...]) -> None:
        """The prompt's ``token`` at ``position`` had log-probability ``logprob`` given the
        tokens before it; ``top`` as in ``record``. Called again for a recomputed position."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI semantics over the tokens this generation sampled so far (``log.history``).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # None: no log-probabilities; k >= 0: the sampled token's and the k most likely, to ``log``.
    logprobs: int | None = None
    # None: none; k >= 0: each prompt token's log-probability and the k most likely there, to
    # ``log`` (``record_prompt``). The prompt is then prefilled whole (its logits are needed):
    # the opener bypasses the prefix cache (``Engine.open(reuse_prefix=False)``).
    prompt_logprobs: int | None = None
    constraint: TokenConstraint | None = None
    log: SampleLog | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        needs_log = (self.presence_penalty or self.frequency_penalty or self.logprobs is not None
                     or self.prompt_logprobs is not None)
        if needs_log and self.log is None:
            raise ValueError("penalties and logprobs need a SampleLog (the tokens sampled so far)")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def plain(self) -> bool:
        """Nothing but temperature / top-p / seed: the logits are sampled as the model gave them."""
        return not (self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.logprobs is not None or self.constraint is not None)


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class KVSlots:
    """Where one sequence's KV lives: page ids, in position order.

    ``pages`` are UNIFIED pages, or BASE pages in a layout with a residual pool.
    ``residual_pages`` are the adapter's RESIDUAL pages of an item in the split form;
    ``None`` otherwise (merged K/V, or the base model).
    """

    pages: tuple[PageId, ...]
    residual_pages: tuple[PageId, ...] | None = None


@dataclass(frozen=True)
class ResidualTarget:
    """Another adapter whose residual (x A_k, x A_v) an item writes from the item's own
    activations: one base-model pass fills every agent's residual (``base_activations``)."""

    adapter_id: AdapterId
    residual_pages: tuple[PageId, ...]


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Cascade attention: the item's first ``pages`` page ids are the same physical pages as
    those of every other item of ``group`` in this step (groups numbered from 0 per step),
    and every position they cover is one the item reads. A backend may read them once for
    the whole group; ignoring it is always correct (``control/sharing.py`` decides it)."""

    group: int
    pages: int


@dataclass(frozen=True)
class PromptLogprobs:
    """A prefill chunk of a prompt whose log-probabilities were asked for: the backend
    computes the logits of every token of the chunk and reports, through ``log``, each next
    prompt token's log-probability and the ``top`` most likely there. ``following``: the
    prompt token after the chunk (None when the chunk ends the prompt: its last row samples)."""

    top: int
    following: int | None
    log: SampleLog


@dataclass(frozen=True, slots=True)
class SeqWork:
    """Write KV for ``tokens`` at positions ``start_pos..``; sample one token if asked."""

    seq_id: int
    tokens: tuple[int, ...]
    start_pos: int
    slots: KVSlots
    adapter_id: AdapterId | None = None
    sampling: SamplingParams | None = None  # None: write KV only (no logits needed)
    speculative: bool = False
    # True for a decode step (the token was sampled by the model), False for prefill of
    # tokens that came from a request; backends cost and batch the two differently.
    decode: bool = False
    # Disaggregated layout: which side of the KV this item writes. A side that is already
    # present (aliased base pages of a cross-adapter fork, a partial prefix hit) is read,
    # never rewritten: those pages may be shared.
    write_base: bool = True
    write_residual: bool = True
    # How this session's K/V is stored, decided once by the control plane (``KVForm``):
    # MERGED, the adapter's K/V delta is in ``slots.pages``; SPLIT, ``slots.pages`` hold the
    # base model's K/V and ``slots.residual_pages`` the adapter's residual, rebuilt on read.
    # A backend takes it as given (the form is never re-derived from the pages or the
    # layout) and refuses an item whose pages contradict it. The base model's K/V (no
    # adapter) is the same in both forms.
    form: KVForm = KVForm.MERGED
    # Disaggregated layout, prefill only: residuals of other adapters to write from this
    # item's activations at the same positions.
    extra_residuals: tuple[ResidualTarget, ...] = ()
    # Activated LoRA: absolute position from which ``adapter_id`` applies. Tokens before it
    # run as the base model (no LoRA delta on any target; in the disaggregated layout their
    # residual rows are zero). 0 for a plain adapter; a value >= ``start_pos + len(tokens)``
    # runs the whole item as the base model (the invocation has not occurred yet). The
    # control plane computes it from the whole path (``control/activation.py``).
    adapter_start: int = 0
    # Cascade attention: set by the control plane when other items of the step share this
    # item's leading pages (None: read alone).
    shared_prefix: SharedPrefix | None = None
    # Prompt log-probabilities (a prefill chunk of a prompt that asked for them; None: none).
    prompt_logprobs: PromptLogprobs | None = None


def form_conflict(seq_id: int, form: KVForm, adapter_id: AdapterId | None,
                  has_residual: bool) -> str | None:
    """Why an item's pages (``has_residual``: it names residual pages) contradict its
    ``form`` (None when they agree). Every backend refuses such an item (or steady-decode
    row) with this reason before it writes anything; past that check, residual pages are
    named exactly by an adapter's items in the split form."""
    if form is KVForm.SPLIT and adapter_id is not None and not has_residual:
        return f"seq {seq_id}: the split form of adapter {adapter_id!r} needs residual pages"
    if has_residual and (form is KVForm.MERGED or adapter_id is None):
        return (f"seq {seq_id}: residual pages belong to an adapter's item in the split form, "
                f"not to {form.value} K/V of adapter {adapter_id!r}")
    return None


@dataclass(frozen=True, slots=True)
class StepCost:
    """What a step cost. ``ms`` is modeled (MockBackend) or measured (real backends)."""

    ms: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_calls: int = 0
    prefill_ms: float = 0.0  # the share of ``ms`` spent on prefill

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.ms + other.ms, self.prefill_tokens + other.prefill_tokens,
                        self.decode_tokens + other.decode_tokens,
                        self.prefill_calls + other.prefill_calls,
                        self.prefill_ms + other.prefill_ms)


@dataclass(frozen=True, slots=True)
class StepResult:
    """One sampled token per ``SeqWork`` (None where ``sampling`` was None)."""

    next_tokens: tuple[int | None, ...]
    cost: StepCost = field(default_factory=StepCost)


@runtime_checkable
class Backend(Protocol):
    config: ForkServeConfig
    # Which optional methods (adapter names and versions, aLoRA, host tier, written
    # positions, columns, launch) it has; read instead of probing (``capabilities.py``).
    capabilities: Capabilities

    def page_kinds(self) -> tuple[PageKind, ...]:
        """The page kinds this backend stores (one ``PagePool`` each on the control side)."""

    def step(self, work: Sequence[SeqWork]) -> StepResult:
        """Run one batched forward: prefill chunks and decode steps mixed."""

    def copy_pages(self, kind: PageKind, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        """Copy page ``src`` into page ``dst`` for each pair (copy-on-write of a partial page)."""

    def transfer_cost(self, tokens: int) -> StepCost:
        """Cost of moving ``tokens`` worth of KV over the prefill->decode connector."""


@runtime_checkable
class HostOffload(Protocol):
    """Optional capability (``Capabilities.host_offload``): a host (CPU) store of
    ``config.host_residual_pages`` slots for RESIDUAL pages, so the control plane can park an
    evicted page there and bring it back instead of recomputing it.

    Slot ids, like page ids, belong to the control plane (``control/host_tier.HostTier``):
    the backend stores what it is told and never allocates or frees a slot. After
    ``offload_pages`` the device page is free (the control plane reuses it at once); after
    ``restore_pages`` the slot is free. Both copy synchronously with respect to later steps
    and later calls. Other kinds, or ids out of range, raise before anything is copied.
    A backend without this capability keeps the old rule: eviction drops the page.
    """

    def offload_pages(self, kind: PageKind, copies: Sequence[HostCopy]) -> None:
        """Copy each device ``page`` into host ``slot``."""

    def restore_pages(self, kind: PageKind, copies: Sequence[HostCopy]) -> None:
        """Copy each host ``slot`` into device ``page``."""
