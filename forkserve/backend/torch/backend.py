"""TorchBackend: the real execution engine behind the control plane's Backend protocol.

    backend = TorchBackend(config, model_path="...", adapters={"planner": "/path/to/lora"})
    engine = Engine(backend)

Holds the model, the resident LoRA adapters and the paged KV pools of config.kv_layout;
the control plane owns page ids and tells each step where to read and write.
"""
from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from forkserve.adapter_key import AdapterId
from forkserve.backend.capabilities import Capabilities
from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.protocol import (
    HostCopy,
    PageKind,
    SamplingParams,
    SeqWork,
    StepCost,
    StepResult,
)
from forkserve.backend.step_handle import Done, StepHandle, step_items
from forkserve.backend.torch.attention import AttentionBackend, EagerAttention
from forkserve.backend.torch.base_correction import Correction, OffsetCorrection, correction_for
from forkserve.backend.torch.batch import BatchLimits, validate
from forkserve.backend.torch.cascade import rows_agree
from forkserve.backend.torch.decode_rows import DecodeRows, of_batch, of_items
from forkserve.backend.torch.errors import (
    AdapterCapacityError,
    InvalidWorkError,
    UnknownAdapterError,
    UnsupportedModelError,
)
from forkserve.backend.torch.fused import get_fusions
from forkserve.backend.torch.gguf_loader import load_gguf
from forkserve.backend.torch.gpu_timeline import GpuTimeline
from forkserve.backend.torch.host_pool import HostResidualPool
from forkserve.backend.torch.kept_tables import KeptTables
from forkserve.backend.torch.kv_pool import KVPool, kv_bytes_per_token, page_kinds
from forkserve.backend.torch.loader import load_hf_folder
from forkserve.backend.torch.lora import (
    LoraAdapter,
    LoraStack,
    check_fits,
    load_peft_adapter,
)
from forkserve.backend.torch.model import CausalLM
from forkserve.backend.torch.model_config import ModelConfig
from forkserve.backend.torch.offset_table import OffsetTable
from forkserve.backend.torch.pending_step import PendingStep, StepClock, StepOutput
from forkserve.backend.torch.recompute import group_forms
from forkserve.backend.torch.runner import ModelRunner, RunOutput, decode_shaped
from forkserve.backend.torch.sampler import Sampler
from forkserve.backend.torch.tokenizer import Tokenizer
from forkserve.backend.torch.weights import ModelWeights
from forkserve.backend.torch.write_tracker import WriteTracker
from forkserve.config import ForkServeConfig, KVForm, KVLayout
from forkserve.kernels.flash_prefill import cold_lengths, warm_cold_plans

DEFAULT_LORA_TARGETS = ("q", "k", "v", "o")


@dataclass(frozen=True)
class ResidentAdapter:
    adapter_id: int
    name: str
    rank: int
    targets: frozenset[str]
    slot: int
    invocation_tokens: tuple[int, ...] | None


def load_model(model_path: str | Path, device: torch.device,
               dtype: torch.dtype) -> tuple[ModelConfig, ModelWeights]:
    """An HF folder (config.json + safetensors) or a .gguf file."""
    path = Path(model_path)
    if path.suffix == ".gguf":
        return load_gguf(path, device, dtype)
    return load_hf_folder(path, device, dtype)


def make_attention(choice: str | AttentionBackend, device: torch.device, page_size: int,
                   scaled_residual_rope: bool, correction: Correction) -> AttentionBackend:
    """"eager" (pure PyTorch), "triton" (forkserve.kernels), "auto": triton on CUDA when importable
    and the pages are at least the kernels' 16-token key block, else eager.

    scaled_residual_rope: the disaggregated layout with yarn's cos/sin factor, which the
    ResidualAttention kernels do not apply (checked here, before any KV is written).
    correction: what split items do to another writer's base K/V (``config.base_correction``);
    only eager attention applies one, so "auto" picks eager and "triton" is refused with it."""
    corrects = correction.tags_writers
    if not isinstance(choice, str):
        if corrects:
            raise UnsupportedModelError("base_correction runs in EagerAttention only: pass "
                                        "attention='eager'")
        return choice
    if choice == "auto":
        usable = (device.type == "cuda" and page_size >= 16 and not scaled_residual_rope
                  and not corrects and importlib.util.find_spec("triton"))
        choice = "triton" if usable else "eager"
    if choice == "eager":
        return EagerAttention(correction)
    if choice == "triton":
        if corrects:
            raise UnsupportedModelError("the Triton kernels do not apply base_correction (offset "
                                        "correction): use attention='eager' or 'auto'")
        if scaled_residual_rope:
            raise UnsupportedModelError("the ResidualAttention kernels do not apply yarn's cos/sin "
                                        "factor; use attention='eager' for this model in the "
                                        "disaggregated layout")
        from forkserve.backend.torch.kernel_attention import KernelAttention
        return KernelAttention()
    raise ValueError("attention must be 'auto', 'eager', 'triton' or an AttentionBackend, got "
                     f"{choice!r}")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchBackend:
    def __init__(self, config: ForkServeConfig, model_path: str | Path,
                 adapters: Mapping[str, str | Path] | None = None, *,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 max_adapters: int | None = None, max_lora_rank: int | None = None,
                 lora_targets: Sequence[str] | None = None,
                 attention: str | AttentionBackend = "auto", use_cuda_graphs: bool = True,
                 compile_fusions: bool | None = None, connector_gb_per_s: float = 25.0,
                 seed: int = 0, skinny_linear: bool | None = None,
                 fold_norms: bool = True) -> None:
        dev = torch.device(device) if device is not None else default_device()
        dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        model_cfg, weights = load_model(model_path, dev, dt)
        loaded = {name: load_peft_adapter(path, name) for name, path in (adapters or {}).items()}
        self._setup(config, model_cfg, weights, loaded, dev, dt, max_adapters, max_lora_rank,
                    lora_targets, attention, use_cuda_graphs, compile_fusions, connector_gb_per_s,
                    seed, skinny_linear, fold_norms)
        self.model_path: Path | None = Path(model_path)

    @classmethod
    def from_weights(cls, config: ForkServeConfig, model_config: ModelConfig, weights: ModelWeights,
                     adapters: Mapping[str, LoraAdapter] | None = None, *,
                     device: str | torch.device, dtype: torch.dtype,
                     max_adapters: int | None = None, max_lora_rank: int | None = None,
                     lora_targets: Sequence[str] | None = None,
                     attention: str | AttentionBackend = "auto", use_cuda_graphs: bool = True,
                     compile_fusions: bool | None = None, connector_gb_per_s: float = 25.0,
                     seed: int = 0, tokenizer: Tokenizer | None = None,
                     skinny_linear: bool | None = None,
                     fold_norms: bool = True) -> "TorchBackend":
        """A backend over weights already in memory (benchmarks with random weights, models
        read by another loader); ``tokenizer``: the model's, when the caller has one (there is
        no folder to read one from)."""
        self = cls.__new__(cls)
        self._setup(config, model_config, weights, dict(adapters or {}), torch.device(device),
                    dtype, max_adapters, max_lora_rank, lora_targets, attention, use_cuda_graphs,
                    compile_fusions, connector_gb_per_s, seed, skinny_linear, fold_norms)
        self.model_path = None
        self._tokenizer = tokenizer
        return self

    def _setup(self, config: ForkServeConfig, model_cfg: ModelConfig, weights: ModelWeights,
               adapters: Mapping[str, LoraAdapter], device: torch.device, dtype: torch.dtype,
               max_adapters: int | None, max_lora_rank: int | None,
               lora_targets: Sequence[str] | None, attention: str | AttentionBackend,
               use_cuda_graphs: bool, compile_fusions: bool | None, connector_gb_per_s: float,
               seed: int, skinny_linear: bool | None = None, fold_norms: bool = True) -> None:
        # The model decides the vocabulary and the context window; the control plane reads
        # both from backend.config, so the verbs admit against the loaded model.
        self.config = config.replace(vocab_size=model_cfg.vocab_size,
                                     max_context=min(config.max_context, model_cfg.max_context))
        self.model_config, self.device, self.dtype = model_cfg, device, dtype
        self.layout: KVLayout = config.kv_layout
        ranks = [a.rank for a in adapters.values()]
        self.max_lora_rank = max_lora_rank or max([16, *ranks])
        targets = set(lora_targets or DEFAULT_LORA_TARGETS)
        if lora_targets is None:
            for a in adapters.values():
                targets |= a.targets
        disaggregated = self.layout.has_residual_pool
        rope_scale = model_cfg.rope.inv_freq_and_scale(model_cfg.head_dim)[1]
        self.max_adapters = max_adapters or max(8, len(adapters))
        self.correction = correction_for(config.base_correction, model_cfg, self.max_adapters,
                                         device, dtype)
        if self.correction.tags_writers and rope_scale != 1.0:
            # De-rotating the stored K needs a rotation (cos^2 + sin^2 = 1); yarn scales both.
            raise UnsupportedModelError("base_correction needs unscaled RoPE cos/sin; this model "
                                        "uses yarn's factor")
        self.attention = make_attention(attention, device, config.page_size,
                                        disaggregated and rope_scale != 1.0, self.correction)
        self.lora = LoraStack(model_cfg, tuple(targets), self.max_adapters, self.max_lora_rank,
                              device, dtype)
        self.pool = KVPool(model_cfg, self.layout, config.page_size, config.num_pages,
                           config.num_residual_pages, self.max_lora_rank, device, dtype,
                           config.recompute_layers, self.correction.tags_writers)
        self.host = (HostResidualPool(self.pool, config.host_residual_pages) if disaggregated
                     else None)
        # Adapter ids are never reused, so no versions; written positions once ``track_writes``.
        self.capabilities = Capabilities(resolve_adapter=True, knows_adapter=True,
                                         remove_adapter=True, activated_lora=True,
                                         host_offload=self.host is not None, written_positions=True,
                                         launch=True, fed_tokens=True)
        self.limits = BatchLimits(
            vocab_size=model_cfg.vocab_size, max_context=model_cfg.max_context,
            page_size=config.page_size, num_pages=config.num_pages,
            num_residual_pages=config.num_residual_pages, disaggregated=disaggregated,
            recompute=bool(config.recompute_layers), merged_form=KVForm.MERGED in self.layout.forms)
        # Inductor and Triton fusions pay off on CUDA; on CPU they would only add compile time
        # to tests (and Triton has no CPU target).
        fused = device.type == "cuda" if compile_fusions is None else compile_fusions
        # The projections of a decode batch through the skinny GEMM where this device's
        # tuning names their shapes (``kernels/skinny_gemm.py``); ``skinny_linear=False``:
        # cuBLAS everywhere (the benchmarks' baseline). ``fold_norms``: a no-LoRA step of
        # decode size also runs its RMSNorms and residual adds inside those GEMMs
        # (``Fusions.folds``; the H200's round 20: batch 1 0.15 ms a step faster, batch 64
        # even, so on by default; ``fold_norms=False`` is the A/B's "unfolded").
        skinny = fused and device.type == "cuda" if skinny_linear is None else skinny_linear
        fusions = get_fusions(fused, fused and device.type == "cuda", skinny,
                              fold_norms and bool(skinny))
        self.model = CausalLM(model_cfg, weights, self.lora, self.attention, device, fusions)
        self.runner = ModelRunner(self.model, self.pool, self.limits, device, use_cuda_graphs)
        # The last steady launch's page tables and cascade groups, reused while rows repeat;
        # the last decode items' tables, reused while items repeat their page tuples.
        self._kept = KeptTables(self.limits.page_size, self.runner.cascade_agents)
        self._kept_items = KeptTables(self.limits.page_size, self.runner.cascade_agents)
        self.sampler = Sampler(device, seed)
        self.connector_gb_per_s = connector_gb_per_s
        self._resident: dict[int, ResidentAdapter] = {}
        self._names: dict[str, int] = {}
        self._next_id = 0
        self._tokenizer: Tokenizer | None = None
        self._writes: WriteTracker | None = None
        # Measurement hook, off by default (``record_gpu_timeline``).
        self.gpu_timeline: GpuTimeline | None = None
        for name, adapter in adapters.items():
            self._install(name, adapter)

    # ---- Backend protocol -------------------------------------------------------------------

    def page_kinds(self) -> tuple[PageKind, ...]:
        return page_kinds(self.layout)

    def step(self, work: Sequence[SeqWork]) -> StepResult:
        # Not forward(work).result: a step's result never needs each item's logits rows,
        # whose slices cost a batch of 64 ~0.09 ms of host time.
        return self.launch(work).result() if work else StepResult(())

    def copy_pages(self, kind: PageKind, pairs: Sequence[tuple[int, int]]) -> None:
        if kind not in self.page_kinds():
            raise InvalidWorkError(f"page kind {kind.value!r} is not stored by the "
                                   f"{self.layout.value} layout")
        limit = self.pool.pages_of(kind)
        bad = [pair for pair in pairs if not all(0 <= p < limit for p in pair)]
        if bad:
            raise InvalidWorkError(f"copy_pages: page ids {bad[:5]} outside [0, {limit})")
        self.pool.copy(kind, pairs)
        if self._writes is not None:
            self._writes.copied(kind, pairs)

    def offload_pages(self, kind: PageKind, copies: Sequence[HostCopy]) -> None:
        self._check_host_copies(kind, copies)
        self.host.offload(copies)
        if self._writes is not None:
            self._writes.offloaded(copies)

    def restore_pages(self, kind: PageKind, copies: Sequence[HostCopy]) -> None:
        self._check_host_copies(kind, copies)
        self.host.restore(copies)
        if self._writes is not None:
            self._writes.restored(copies)

    def _check_host_copies(self, kind: PageKind, copies: Sequence[HostCopy]) -> None:
        if kind is not PageKind.RESIDUAL or self.host is None:
            raise InvalidWorkError("the host tier stores residual pages of the disaggregated "
                                   f"layout, not {kind.value!r} pages of the {self.layout.value} "
                                   "layout")
        pages, slots = self.pool.pages_of(kind), self.host.num_slots
        bad = [c for c in copies if not (0 <= c.page < pages and 0 <= c.slot < slots)]
        if bad:
            raise InvalidWorkError(f"host copies {bad[:5]} outside {pages} pages / {slots} host "
                                   "slots")

    def transfer_cost(self, tokens: int) -> StepCost:
        """Modeled: KV bytes of `tokens` tokens over a connector of connector_gb_per_s."""
        per_token = sum(self.kv_bytes_per_token().values())
        return StepCost(ms=tokens * per_token / (self.connector_gb_per_s * 1e9) * 1e3)

    # ---- Beyond the protocol ----------------------------------------------------------------

    def track_writes(self) -> None:
        """Debug mode: follow which KV slots steps wrote, so ``first_unwritten`` can answer
        (``Engine.check_integrity`` then proves no table claims an unwritten position)."""
        kinds = {kind: self.pool.pages_of(kind) for kind in self.page_kinds()}
        self._writes = WriteTracker(kinds, self.config.page_size,
                                    self.host.num_slots if self.host is not None else 0)

    def record_gpu_timeline(self) -> GpuTimeline:
        """Measurement mode: mark each step's start and end on the device (``gpu_timeline.py``),
        so a benchmark can read how long the device idled between decode steps."""
        self.gpu_timeline = GpuTimeline(self.device)
        return self.gpu_timeline

    def first_unwritten(self, kind: PageKind, pages: Sequence[int], length: int) -> int | None:
        """The first of positions [0, length) behind ``pages`` no step wrote; None when all
        were, or when writes are not tracked (``track_writes``)."""
        return (self._writes.first_unwritten(kind, pages, length) if self._writes is not None
                else None)

    def launch(self, work: Sequence[SeqWork], batch: DecodeBatch | None = None) -> StepHandle:
        """Start a step over ``work`` then ``batch``'s rows and return at once: the forward,
        the sampling and the tokens' copy to the host are queued on the device stream
        (``pending_step.py``); the handle's ``result()`` waits for them. A step the backend
        refuses (``validate``) returns a handle that raises the refusal. A fed batch
        (``DecodeBatch.fed``, ``Capabilities.fed_tokens``) whose rows run from their columns
        reads its input ids from the earlier step's sampled-token tensor on the device, queued
        behind that step; any other fed batch waits for the earlier step's tokens first."""
        try:
            if batch is not None and batch.fed is not None:
                fed = self._fed(batch) if not work else None
                if fed is not None:
                    pending = self._start_rows(batch, fed)
                    if pending is not None:
                        return pending
                # Not from the device: the earlier step's tokens, waited for, on the host.
                earlier = batch.fed
                batch = batch.resolved(earlier.sampled() if isinstance(earlier, PendingStep)
                                       else None)
            if batch is not None and len(batch):
                pending = self._start_mixed(work, batch) if work else self._start_rows(batch)
                if pending is not None:
                    return pending
            items = step_items(work, batch)
            if len(self._form_groups(items)) > 1:  # its parts run one after the other, here
                return Done(self.forward(items).result)
            return self._start(items, all_logits=False, hidden_states=False)
        except Exception as exc:  # noqa: BLE001 - handed to whoever asks for the result
            return Done(error=exc)

    def forward(self, work: Sequence[SeqWork], all_logits: bool = False,
                hidden_states: bool = False) -> StepOutput:
        """step() plus logits: for each item, the last token's (if it samples) or every token's;
        hidden_states: plus each item's residual stream after every layer, before the final
        norm (what the quality benchmark compares across layouts). That step runs without
        CUDA graphs."""
        if not work:
            return StepOutput(StepResult(()), ())
        groups = self._form_groups(work)
        if len(groups) > 1:
            return _merged(work, groups,
                           [self.forward([work[i] for i in g], all_logits, hidden_states)
                            for g in groups])
        return self._start(work, all_logits, hidden_states).output()

    def _form_groups(self, work: Sequence[SeqWork]) -> list[list[int]]:
        """With recompute layers a step of adapter items and other items runs as its parts
        (``recompute.group_forms``); one group otherwise."""
        if not self.limits.recompute:
            return [list(range(len(work)))]
        return group_forms([s.form is KVForm.SPLIT and s.adapter_id is not None for s in work])

    def _start(self, work: Sequence[SeqWork], all_logits: bool, hidden_states: bool) -> PendingStep:
        """Validate and queue one step; nothing here waits for the device."""
        slots = self._slots()
        rows = (self._item_rows(work, slots)
                if self.runner.replays(work, all_logits, hidden_states) else None)
        if rows is None:
            validate(work, self.limits, slots)
        clock = self._clock()
        run = self.runner.forward(work, slots, all_logits, hidden_states, rows, clock.stream)
        return self._sample(work, run, all_logits, clock)

    def _item_rows(self, work: Sequence[SeqWork], slots: dict[int, int]) -> DecodeRows | None:
        """Decode items as the rows a graph replays, their page ids checked on the rows'
        tables (``decode_rows.of_items``), not id by id; None where the tables refuse one
        (the caller's ``validate`` of the items then names it)."""
        validate(work, self.limits, slots, page_ids=False)
        return of_items(work, self.limits, slots, self.pool.scratch_page,
                        self.pool.scratch_residual_page, self._kept_items)

    def _sample(self, work: Sequence[SeqWork], run: RunOutput, all_logits: bool, clock: StepClock,
                batch: DecodeBatch | None = None, rows: DecodeRows | None = None) -> PendingStep:
        """Queue the sampling of a forward over ``work`` and then, where given, ``batch``'s
        ``rows`` (one logits row each, every row sampling)."""
        # before sampling: the tokens' read-back is the host's wait
        if self.gpu_timeline is not None:
            self.gpu_timeline.stop(all(s.decode for s in work))
        if self._writes is not None:
            self._writes.wrote(work, self.page_kinds()[0])
        logits = run.logits
        n = len(batch) if batch is not None else 0
        sampling = [s for s in work if s.sampling is not None]
        params = [s.sampling for s in sampling] + list(batch.sampling if n else ())
        positions = ([s.start_pos + len(s.tokens) for s in sampling]
                     + (rows.seq_lens.tolist() if n else []))
        samples = [s.sampling is not None for s in work] + [True] * n
        token_ends = itertools.accumulate(len(s.tokens) for s in work)
        hidden = (tuple(run.hidden[e - len(s.tokens):e]
                        for s, e in zip(work, token_ends, strict=True))
                  if run.hidden is not None else ())
        counts = [len(s.tokens) if all_logits or s.prompt_logprobs is not None
                  else int(s.sampling is not None)
                  for s in work] + [1] * n
        greedy = None
        if sum(counts) == len(params):
            # one row per sampling item, in order (a graph's argmax matches it)
            last, greedy = logits, run.greedy
        else:
            ends = itertools.accumulate(counts)
            last = torch.stack([logits[e - 1] for e, s in zip(ends, samples, strict=True)
                                if s]) if params else logits[:0]
        prefill = [s for s in work if not s.decode]
        cost = StepCost(prefill_tokens=sum(len(s.tokens) for s in prefill),
                        decode_tokens=len(work) - len(prefill) + n, prefill_calls=len(prefill))
        return self._draw(logits, counts, hidden, params, positions, samples,
                          [(i, s) for i, s in enumerate(work) if s.prompt_logprobs is not None],
                          cost, last, greedy, clock)

    def _start_mixed(self, work: Sequence[SeqWork], batch: DecodeBatch) -> PendingStep | None:
        """Queue a step of general items and steady rows as one eager forward whose rows'
        part comes from their columns and the kept tables (``runner.forward_mixed``), so a
        tick that prefills or commits a tail beside the steady set neither walks the rows
        as items nor drops the kept tables. None where that does not fit (the caller runs
        every row as an item, as before): recompute layers, tracked writes, items that are
        all decode-shaped (their step may take cascade tiles or a graph), rows the columns
        refuse or that disagree with an item of their cascade group."""
        if not self._columns_fit or decode_shaped(work):
            return None
        slots = self._slots()
        validate(work, self.limits, slots)
        rows = self._rows(batch, slots)
        if rows is None or not rows_agree(work, batch.shared_prefix, rows.block_tables):
            return None
        clock = self._clock()
        run = self.runner.forward_mixed(work, rows, slots, batch.shared_prefix)
        return self._sample(work, run, False, clock, batch, rows)

    def _fed(self, batch: DecodeBatch) -> torch.Tensor | None:
        """The device tensor of sampled tokens a fed batch's rows read (the earlier step's,
        row for row), or None where it has none to give or the rows will not run from
        their columns."""
        earlier = batch.fed
        if not self._columns_fit or not isinstance(earlier, PendingStep):
            return None
        return earlier.feeds(len(batch))

    def _start_rows(self, batch: DecodeBatch,
                    fed: torch.Tensor | None = None) -> PendingStep | None:
        """Queue a step of steady-decode rows from their columns (``decode_rows.of_batch``):
        no per-row item, table tuple or validation pass. None where the columns do not fit
        that path (recompute layers, tracked writes) or a row would be refused: the caller runs
        the rows as items, whose validation names the row. ``fed``: the rows' input ids on the
        device (``batch.tokens`` are placeholders; a sampler's tokens are in the vocabulary)."""
        rows = self._rows(batch, self._slots()) if self._columns_fit else None
        if rows is None:
            return None
        clock = self._clock()
        plan = self._kept.groups.plan(batch.shared_prefix) if self.runner.cascade else None
        run = self.runner.forward_rows(rows, plan, fed, clock.stream)
        if self.gpu_timeline is not None:
            self.gpu_timeline.stop(True)
        n = len(batch)
        return self._draw(run.logits, (1,) * n, (), batch.sampling, rows.seq_lens.tolist(), None,
                          (), StepCost(decode_tokens=n), run.logits, run.greedy, clock)

    @property
    def _columns_fit(self) -> bool:
        """Whether steady rows may run from their columns: not with recompute layers, whose
        steps run as their parts, nor while writes are tracked per item."""
        return self._writes is None and not self.limits.recompute

    def _rows(self, batch: DecodeBatch, slots: dict[int, int]) -> DecodeRows | None:
        """``batch``'s rows from their columns and the kept tables, or None where the columns
        refuse a row (``decode_rows.of_batch``)."""
        return of_batch(batch, self.limits, slots, self.pool.scratch_page,
                        self.pool.scratch_residual_page, self._kept)

    def _slots(self) -> dict[int, int]:
        return {aid: r.slot for aid, r in self._resident.items()}

    def _clock(self) -> StepClock:
        """The step's clock, started with the device timeline's mark (when one is recorded)."""
        clock = StepClock(self.device)
        if self.gpu_timeline is not None:
            self.gpu_timeline.start()
        return clock

    def _draw(self, logits: torch.Tensor, counts: Sequence[int], hidden: tuple[torch.Tensor, ...],
              params: Sequence[SamplingParams], positions: Sequence[int],
              samples: Sequence[bool] | None, prompts: Sequence[tuple[int, SeqWork]],
              cost: StepCost, last: torch.Tensor, greedy: torch.Tensor | None,
              clock: StepClock) -> PendingStep:
        """Queue the sampling and the tokens' copy to the host behind the forward."""
        tokens = drawn = None
        if params:
            drawn = self.sampler.draw(last, params, positions, greedy)
            tokens = drawn.to("cpu", non_blocking=True) if drawn.is_cuda else drawn
        clock.stop()
        return PendingStep(logits, counts, hidden, params, positions, samples, prompts, cost, last,
                           tokens, self.sampler, clock, drawn if params else None)

    @property
    def cascade_attention(self) -> bool:
        """Whether decode batches read a shared page prefix once per group
        (``SeqWork.shared_prefix``); off, every item reads its whole table (benchmarks compare)."""
        return self.runner.cascade

    @cascade_attention.setter
    def cascade_attention(self, on: bool) -> None:
        self.runner.cascade = on

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            if self.model_path is None:
                raise RuntimeError("this backend was built from in-memory weights and has no "
                                   "tokenizer")
            self._tokenizer = Tokenizer.load(self.model_path)
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self.model_config.max_context

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    @property
    def adapters(self) -> Mapping[str, int]:
        """Resident adapters: name -> adapter id (the id SeqWork.adapter_id carries)."""
        return dict(self._names)

    def knows_adapter(self, adapter_id: AdapterId) -> bool:
        """Whether ``adapter_id`` is resident (the Engine checks before queueing work)."""
        return adapter_id in self._resident

    def adapter_invocation(self, adapter_id: AdapterId) -> tuple[int, ...] | None:
        """An activated LoRA's invocation tokens (None for a plain adapter): the control plane
        serves every token before their last occurrence as the base model."""
        return self._resident[adapter_id].invocation_tokens

    def resolve_adapter(self, ref: AdapterId) -> int:
        """The id of a resident adapter given by name or by id (what the Engine carries)."""
        if isinstance(ref, str):
            return self.adapter_id(ref)
        if isinstance(ref, int) and not isinstance(ref, bool) and ref in self._resident:
            return ref
        raise UnknownAdapterError(f"adapter {ref!r} is not resident (resident: "
                                  f"{sorted(self._names)})")

    def adapter_id(self, name: str) -> int:
        if name not in self._names:
            raise UnknownAdapterError(f"adapter {name!r} is not resident (resident: "
                                      f"{sorted(self._names)})")
        return self._names[name]

    def add_adapter(self, name: str, path: str | Path | LoraAdapter) -> int:
        """Load a PEFT folder (or an adapter already loaded) into a free slot; returns its new id.

        Ids are never reused, so a residual cache keyed by an old id cannot match a new adapter."""
        adapter = path if isinstance(path, LoraAdapter) else load_peft_adapter(path, name)
        return self._install(name, adapter)

    def remove_adapter(self, name_or_id: AdapterId) -> None:
        aid = self.adapter_id(name_or_id) if isinstance(name_or_id, str) else name_or_id
        if aid not in self._resident:
            raise UnknownAdapterError(f"adapter id {aid} is not resident")
        resident = self._resident.pop(aid)
        del self._names[resident.name]
        self.lora.clear(resident.slot)
        self.pool.forget_writer(resident.slot)
        self.correction.bind(self._slots_by_name())

    def capture_decode_graphs(self, max_batch: int, context_tokens: int) -> int:
        """Capture ahead the CUDA graphs decode batches of up to ``max_batch`` sequences of up
        to ``context_tokens`` tokens will use, in each form the layout serves (merged, split);
        returns how many were new (0 off CUDA or with graphs off)."""
        splits = [form is KVForm.SPLIT for form in self.layout.forms]
        return self.runner.capture_decode_graphs(max_batch, context_tokens, bool(self._resident),
                                                 splits)

    def warm_cold_prefill(self, max_tokens: int, min_tokens: int = 1024) -> int:
        """Build what cold prefills of ``min_tokens`` .. ``max_tokens`` tokens will run,
        ahead (``flash_prefill.warm_cold_plans``): FlashAttention-4's kernels where it serves
        them, else one SDPA call per ``flash_prefill.cold_length``: on CUDA, torch's SDPA
        builds a plan the first time it meets a length (~42 ms on the H200). Returns the calls
        made (0 off CUDA, where nothing is planned)."""
        if self.device.type != "cuda" or max_tokens < min_tokens:
            return 0
        cfg = self.model_config
        return warm_cold_plans(cold_lengths(min_tokens, max_tokens), cfg.num_heads,
                               cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
                               self.config.page_size)

    def kv_bytes_per_token(self) -> dict[PageKind, int]:
        return kv_bytes_per_token(self.model_config, self.layout, self.max_lora_rank, self.dtype,
                                  len(self.config.recompute_layers), self.correction.tags_writers)

    def install_offsets(self, table: OffsetTable) -> None:
        """The offset tables split items correct another writer's base K/V with
        (``config.base_correction = "offset"``); pairs name adapters, resident now or later.
        Before any decode graph is captured: a graph holds the tables it was captured with."""
        if not isinstance(self.correction, OffsetCorrection):
            raise InvalidWorkError(f"offset tables need config.base_correction = 'offset', not "
                                   f"{self.config.base_correction.value!r}")
        if self.runner.captured_graphs:
            raise InvalidWorkError("install offset tables before the first decode graph is "
                                   "captured")
        self.correction.install(table)

    def _slots_by_name(self) -> dict[str, int]:
        return {r.name: r.slot for r in self._resident.values()}

    def _install(self, name: str, adapter: LoraAdapter) -> int:
        if name in self._names:
            raise AdapterCapacityError(f"adapter {name!r} is already resident (id "
                                       f"{self._names[name]})")
        check_fits(adapter, self.model_config, self.max_lora_rank, self.lora.targets)
        used = {r.slot for r in self._resident.values()}
        free = [s for s in range(self.max_adapters) if s not in used]
        if not free:
            raise AdapterCapacityError(f"all {self.max_adapters} adapter slots are taken; remove "
                                       "one first")
        self.lora.write(free[0], adapter)
        aid = self._next_id
        self._next_id += 1
        self._resident[aid] = ResidentAdapter(aid, name, adapter.rank, adapter.targets, free[0],
                                             adapter.invocation_tokens)
        self._names[name] = aid
        self.correction.bind(self._slots_by_name())
        return aid


def _merged(work: Sequence[SeqWork], groups: Sequence[Sequence[int]],
            outs: Sequence[StepOutput]) -> StepOutput:
    """The outputs of ``work`` run as ``groups`` (``recompute.group_forms``), back in item order."""
    at = {i: (out, j) for g, out in zip(groups, outs, strict=True) for j, i in enumerate(g)}
    order = [at[i] for i in range(len(work))]
    cost = sum((out.result.cost for out in outs), StepCost())
    hidden = tuple(out.hidden[j] for out, j in order) if all(out.hidden for out in outs) else ()
    return StepOutput(StepResult(tuple(out.result.next_tokens[j] for out, j in order), cost),
                      tuple(out.logits[j] for out, j in order), hidden)
