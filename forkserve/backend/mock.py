"""MockBackend: the Backend protocol with no GPU and no model.

Its "KV cache" stores, per slot, a value derived from the token id and from whose
activations produced it (the adapter, where the layout makes K/V adapter-specific), and
the token it samples is a hash of the context it *reads back through the page tables*.
So every aliasing, copy-on-write, index or cross-adapter mistake of the control plane
changes the sampled tokens or trips a check, and "committed output equals a run that
prefilled only committed tokens" is a real test. Reading a slot nobody wrote raises.
Costs come from ``CostModel`` (modeled ms, not a GPU trace).

Forms (``SeqWork.form``, the control plane's decision, never re-derived here): merged K/V
pages (UNIFIED, or BASE in the adaptive layout) hold (token, adapter); a split item's BASE
pages hold the token and its RESIDUAL pages (token, adapter). The layout decides only the
page kinds and one exception: full_reuse's merged pages hold the token alone (shared across
adapters by design).

Activated LoRA (``invocations``): positions before an item's ``adapter_start`` are stored
as the base model's (adapter code 0, in residual pages too: a zero residual; in merged
pages too), and a token sampled there hashes as the base model's, so KV left over from
another activation point changes the output.

Adapter versions (``adapter_versions``, ``reload_adapter``): a reloaded adapter is new
weights under the same id, so its K/V and its samples differ from the old version's; the
control plane keys residual (and merged) pages by ``adapter_version``, and a page of the old
version read by the new one trips the same checks as another adapter's.

Host tier (``HostOffload``, disaggregated layout): ``config.host_residual_pages`` host slots
for residual pages. Offloading blanks the device page (the control plane frees it), so a
page used after it was parked, or brought back into the wrong page, reads as never written.
"""
from __future__ import annotations

import zlib
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from forkserve.adapter_key import AdapterId
from forkserve.backend.byte_tokenizer import ByteTokenizer
from forkserve.backend.capabilities import Capabilities
from forkserve.backend.cost_model import CostModel
from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.protocol import (
    HostCopy,
    KVSlots,
    PageId,
    PageKind,
    SeqWork,
    StepCost,
    StepResult,
    form_conflict,
)
from forkserve.backend.step_handle import Deferred
from forkserve.config import ForkServeConfig, KVForm, KVLayout
from forkserve.errors import UnknownAdapterError

_UNWRITTEN = -1
_HASH_MOD = (1 << 61) - 1
_ADAPTER_SPACE = 1 << 20


def _adapter_code(adapter: AdapterId | None, version: int = 0) -> int:
    if adapter is None:
        return 0
    # Version 0 keeps the plain name, so values written before versions existed are unchanged.
    name = str(adapter) if version == 0 else f"{adapter}\x00v{version}"
    return 1 + zlib.crc32(name.encode()) % (_ADAPTER_SPACE - 1)


class MockBackend:
    # Every optional part but names: the ids it is given are its ids.
    capabilities = Capabilities(knows_adapter=True, remove_adapter=True, adapter_versions=True,
                                activated_lora=True, host_offload=True, written_positions=True,
                                columns=True, launch=True, fed_tokens=True)

    def __init__(self, config: ForkServeConfig | None = None, cost_model: CostModel | None = None,
                 invocations: Mapping[AdapterId, Sequence[int]] | None = None,
                 adapters: Iterable[AdapterId] | None = None,
                 adapter_versions: Mapping[AdapterId, int] | None = None) -> None:
        """``adapters``: the resident adapters (``remove_adapter`` / ``add_adapter`` change
        them); None accepts any adapter id. ``adapter_versions``: each adapter's current
        version (default 0; ``reload_adapter`` bumps it). ``fault``: tests set it to a
        function of one item that returns an exception to raise in the middle of a step
        (items before it in the batch are already written, as a real backend failing
        mid-batch would leave them)."""
        self.config = config or ForkServeConfig()
        self._invocations = {a: tuple(tokens) for a, tokens in (invocations or {}).items()}
        self._adapters = set(adapters) if adapters is not None else None
        self._versions = dict(adapter_versions or {})
        self.fault: Callable[[SeqWork], Exception | None] | None = None
        self.cost_model = cost_model or CostModel()
        self.tokenizer = ByteTokenizer()
        # full_reuse shares merged K/V across adapters by design: stored as the base model's,
        # so another adapter reads what it would have written (the loss is the quality
        # benchmark's to measure, not the mock's).
        self._merged_is_shared = self.config.kv_layout is KVLayout.FULL_REUSE
        p = self.config.page_size
        self._kv = {kind: np.full((self._num_pages(kind), p), _UNWRITTEN, dtype=np.int64)
                    for kind in self.page_kinds()}
        self._host = np.full((self.config.host_residual_pages, p), _UNWRITTEN, dtype=np.int64)

    def page_kinds(self) -> tuple[PageKind, ...]:
        if self.config.kv_layout.has_residual_pool:
            return (PageKind.BASE, PageKind.RESIDUAL)
        return (PageKind.UNIFIED,)

    def _num_pages(self, kind: PageKind) -> int:
        return (self.config.num_residual_pages if kind is PageKind.RESIDUAL
                else self.config.num_pages)

    def copy_pages(self, kind: PageKind, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        kv = self._kv[kind]
        for src, dst in pairs:
            kv[dst] = kv[src]

    def knows_adapter(self, adapter: AdapterId) -> bool:
        return self._adapters is None or adapter in self._adapters

    def add_adapter(self, adapter: AdapterId) -> None:
        if self._adapters is not None:
            self._adapters.add(adapter)

    def remove_adapter(self, adapter: AdapterId) -> None:
        if self._adapters is None or adapter not in self._adapters:
            raise UnknownAdapterError(f"adapter {adapter!r} is not resident")
        self._adapters.remove(adapter)

    def first_unwritten(self, kind: PageKind, pages: Sequence[PageId], length: int) -> int | None:
        """The first of positions [0, length) behind ``pages`` no step wrote (None: all were)."""
        unwritten = np.flatnonzero(self.kv_values(kind, pages, length) == _UNWRITTEN)
        return int(unwritten[0]) if len(unwritten) else None

    def adapter_invocation(self, adapter: AdapterId) -> tuple[int, ...] | None:
        """An activated LoRA's invocation tokens (None for a plain adapter)."""
        return self._invocations.get(adapter)

    def adapter_version(self, adapter: AdapterId) -> int:
        """Which load of ``adapter`` is current: 0 until ``reload_adapter`` moves it."""
        return self._versions.get(adapter, 0)

    def reload_adapter(self, adapter: AdapterId) -> int:
        """New weights under the same id (a hot-swapped adapter); returns the new version.
        Only meaningful while no session holds the old version's K/V."""
        self._versions[adapter] = self.adapter_version(adapter) + 1
        return self._versions[adapter]

    def _code(self, adapter, version: int | None = None) -> int:
        """An adapter's value code at ``version`` (None: the current one)."""
        return _adapter_code(adapter, self.adapter_version(adapter) if version is None else version)

    def offload_pages(self, kind: PageKind, copies: Sequence[HostCopy]) -> None:
        pages, slots = self._host_copies(kind, copies)
        self._host[slots] = self._kv[kind][pages]
        self._kv[kind][pages] = _UNWRITTEN

    def restore_pages(self, kind: PageKind, copies: Sequence[HostCopy]) -> None:
        pages, slots = self._host_copies(kind, copies)
        self._kv[kind][pages] = self._host[slots]

    def _host_copies(self, kind: PageKind,
                     copies: Sequence[HostCopy]) -> tuple[np.ndarray, np.ndarray]:
        if kind is not PageKind.RESIDUAL or kind not in self._kv:
            raise ValueError(f"the host tier stores residual pages of the disaggregated layout, "
                             f"not {kind.value!r} pages")
        pages = np.asarray([c.page for c in copies], dtype=np.int64)
        slots = np.asarray([c.slot for c in copies], dtype=np.int64)
        if ((pages < 0) | (pages >= self._num_pages(kind))).any() or \
                ((slots < 0) | (slots >= len(self._host))).any():
            raise ValueError(f"host copies {list(copies)[:5]} outside {self._num_pages(kind)} "
                             f"pages / {len(self._host)} host slots")
        return pages, slots

    def transfer_cost(self, tokens: int) -> StepCost:
        return StepCost(ms=self.cost_model.transfer_ms(tokens))

    def kv_values(self, kind: PageKind, pages: Sequence[PageId], length: int) -> np.ndarray:
        """What the first ``length`` slots behind ``pages`` hold (tests read this)."""
        return self._kv[kind][np.asarray(pages, dtype=np.int64)].reshape(-1)[:length]

    def host_values(self, slot: int) -> np.ndarray:
        """What host slot ``slot`` holds (tests read this)."""
        return self._host[slot]

    def expected_values(self, kind: PageKind, tokens: Sequence[int], adapter,
                        form: KVForm = KVForm.MERGED, adapter_start: int = 0, start_pos: int = 0,
                        version: int | None = None) -> np.ndarray:
        """What ``tokens`` at positions ``start_pos..`` store in ``kind`` pages of K/V in
        ``form``; base-model values before ``adapter_start``. ``version``: the adapter's
        (None: its current one)."""
        code = 0
        if kind is PageKind.RESIDUAL or (form is KVForm.MERGED and not self._merged_is_shared):
            code = self._code(adapter, version)
        positions = np.arange(start_pos, start_pos + len(tokens))
        return (np.asarray(tokens, dtype=np.int64) * _ADAPTER_SPACE
                + np.where(positions >= adapter_start, code, 0))

    def step(self, work: Sequence[SeqWork]) -> StepResult:
        return self.step_batched(work, None)

    def launch(self, work: Sequence[SeqWork], batch: DecodeBatch | None) -> Deferred:
        """The step, run when its result is asked for (``step_handle``): a page the control
        plane changed before that would show in the sampled tokens. A fed batch
        (``DecodeBatch.fed``) takes its tokens from the earlier step's handle when it runs."""
        if batch is not None and batch.fed is not None:
            return Deferred(lambda: self.step_batched(work, batch.resolved()))
        return Deferred(lambda: self.step_batched(work, batch))

    def step_batched(self, work: Sequence[SeqWork], batch: DecodeBatch | None) -> StepResult:
        """``work``'s items, then ``batch``'s rows, each through the same checks (an injected
        ``fault`` sees every row as its ``SeqWork``)."""
        if batch is not None and self.fault is not None:
            work, batch = [*work, *batch.items()], None
        next_tokens: list[int | None] = []
        calls = prefill_tokens = split_prefill = decode_tokens = context_read = split_read = 0
        split_base: set[PageId] = set()  # base pages the split rows read (each read once)
        for item in work:
            if item.adapter_id is not None and not self.knows_adapter(item.adapter_id):
                raise UnknownAdapterError(f"seq {item.seq_id}: adapter {item.adapter_id!r} is not "
                                          "resident",
                                          seq_ids=(item.seq_id,))
            self._check_form(item.seq_id, item.form, item.adapter_id, item.slots.residual_pages)
            injected = self.fault(item) if self.fault is not None else None
            if injected is not None:
                raise injected
            # Extra residuals (base_activations) are plain adapters: they start at 0.
            for target in item.extra_residuals:
                start = item.adapter_start if target.adapter_id == item.adapter_id else 0
                self._write(PageKind.RESIDUAL, item.seq_id, item.tokens, item.start_pos, start,
                            target.residual_pages, target.adapter_id, KVForm.SPLIT)
            split = item.slots.residual_pages is not None
            if item.decode:
                decode_tokens += len(item.tokens)
            else:
                calls += 1
                prefill_tokens += len(item.tokens)
                split_prefill += len(item.tokens) if split else 0
            next_tokens.append(self._run(item.seq_id, item.tokens, item.start_pos, item.slots,
                                         item.form, item.adapter_id, item.adapter_start,
                                         item.sampling, item.write_base, item.write_residual))
            if item.sampling is not None and split:
                split_read += item.start_pos + len(item.tokens)
                split_base.update(item.slots.pages)
            elif item.sampling is not None:
                context_read += item.start_pos + len(item.tokens)
        rows = () if batch is None else zip(batch.seq_ids, batch.tokens, batch.positions.tolist(),
                                            batch.pages, batch.residual_pages, batch.forms,
                                            batch.adapter_ids, batch.adapter_starts.tolist(),
                                            batch.sampling, strict=True)
        for seq, token, pos, pages, residual, form, adapter, start, sampling in rows:
            if adapter is not None and not self.knows_adapter(adapter):
                raise UnknownAdapterError(f"seq {seq}: adapter {adapter!r} is not resident",
                                          seq_ids=(seq,))
            self._check_form(seq, form, adapter, residual)
            next_tokens.append(self._run(seq, (token,), pos, KVSlots(pages, residual), form,
                                         adapter, start, sampling, True, True))
            decode_tokens += 1
            if residual is not None:
                split_read += pos + 1
                split_base.update(pages)
            else:
                context_read += pos + 1
        cost = self.cost_model
        prefill_ms = cost.prefill_ms(calls, prefill_tokens, split_prefill)
        ms = prefill_ms + (cost.decode_ms(context_read, split_read,
                                          len(split_base) * self.config.page_size)
                           if decode_tokens else 0.0)
        return StepResult(tuple(next_tokens),
                          StepCost(ms, prefill_tokens, decode_tokens, calls, prefill_ms))

    def _check_form(self, seq: int, form: KVForm, adapter,
                    residual: Sequence[PageId] | None) -> None:
        """An item whose pages contradict its form is a control-plane bug: it trips a check."""
        conflict = form_conflict(seq, form, adapter, residual is not None)
        if conflict is None and residual is not None and PageKind.RESIDUAL not in self._kv:
            conflict = f"seq {seq}: the split form needs a residual pool; this layout has none"
        if conflict is not None:
            raise AssertionError(conflict)

    def _run(self, seq: int, tokens: Sequence[int], start_pos: int, slots: KVSlots, form: KVForm,
             adapter, adapter_start: int, sampling, write_base: bool,
             write_residual: bool) -> int | None:
        """Write one item's K/V and sample its next token (None when it does not sample)."""
        base_kind = self.page_kinds()[0]
        sides = [(base_kind, slots.pages, write_base)]
        if slots.residual_pages is not None:
            sides.append((PageKind.RESIDUAL, slots.residual_pages, write_residual))
        for kind, pages, write in sides:
            if write:
                self._write(kind, seq, tokens, start_pos, adapter_start, pages, adapter, form)
        if sampling is None:
            return None
        length = start_pos + len(tokens)
        # Split K/V is read back as merged: a zero residual (before the activation point)
        # adds nothing, so a split aLoRA reads what a merged one or the base model would.
        context = self._read(base_kind, seq, adapter, adapter_start, slots.pages, length)
        if slots.residual_pages is not None:
            context = self._reconstruct(seq, context, self._read(
                PageKind.RESIDUAL, seq, adapter, adapter_start, slots.residual_pages, length))
        adapted = length - 1 >= adapter_start
        return self._next_token(context, adapter if adapted else None)

    def _write(self, kind: PageKind, seq: int, tokens: Sequence[int], start_pos: int,
               adapter_start: int, pages: Sequence[PageId], adapter, form: KVForm) -> None:
        p = self.config.page_size
        pages = np.asarray(pages, dtype=np.int64)
        positions = np.arange(start_pos, start_pos + len(tokens))
        if len(positions) and positions[-1] // p >= len(pages):
            raise ValueError(f"seq {seq}: {kind.value} pages cover {len(pages) * p} "
                             f"tokens, write reaches position {positions[-1]}")
        values = self.expected_values(kind, tokens, adapter, form, adapter_start, start_pos)
        self._kv[kind][pages[positions // p], positions % p] = values

    def _read(self, kind: PageKind, seq: int, adapter, adapter_start: int, pages: Sequence[PageId],
              length: int) -> np.ndarray:
        values = self.kv_values(kind, pages, length)
        if (values == _UNWRITTEN).any():
            raise AssertionError(f"seq {seq}: reads {kind.value} slot "
                                 f"{int(np.argmax(values == _UNWRITTEN))} that was never written")
        if kind is PageKind.RESIDUAL:
            codes = np.where(np.arange(length) >= adapter_start, self._code(adapter), 0)
            foreign = values % _ADAPTER_SPACE != codes
            if foreign.any():
                raise AssertionError(f"seq {seq}: residual slot {int(np.argmax(foreign))} "
                                     f"holds another adapter's residual")
        return values

    @staticmethod
    def _reconstruct(seq: int, base: np.ndarray, residual: np.ndarray) -> np.ndarray:
        """Base + residual read as merged K/V, so a split item samples what a merged one would."""
        if (base // _ADAPTER_SPACE != residual // _ADAPTER_SPACE).any():
            raise AssertionError(
                f"seq {seq}: base slot "
                f"{int(np.argmax(base // _ADAPTER_SPACE != residual // _ADAPTER_SPACE))} "
                f"and its residual hold different tokens")
        if (base % _ADAPTER_SPACE != 0).any():
            raise AssertionError(f"seq {seq}: base slot "
                                 f"{int(np.argmax(base % _ADAPTER_SPACE != 0))} holds merged K/V, "
                                 "read as a base under a residual")
        return base + residual % _ADAPTER_SPACE

    def _next_token(self, context: np.ndarray, adapter) -> int:
        """A deterministic function of the whole context read back (a polynomial hash)."""
        h = 1469598103934665603 + self._code(adapter)
        for t in context.tolist():
            h = (h * 1099511628211 + t + 1) % _HASH_MOD
        # Stay inside the printable byte range so generated text can be scored and shown.
        return ByteTokenizer.OFFSET + 32 + h % 95
