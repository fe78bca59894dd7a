"""Capabilities: the optional parts of the Backend protocol a backend implements, as data.

Every backend declares one frozen ``Capabilities`` record (``Backend.capabilities``); the
control plane reads the flags and calls the methods they promise, and never probes a backend
for a method. A flag that is False means the methods are absent or must not be called; the
control plane then keeps the rule written beside the flag. The record is the backend's, fixed
for its life, so it is read once where a decision depends on it. The Engine refuses a
backend that declares a flag without its methods (``missing``), so a flag is a promise.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Capabilities:
    # ``resolve_adapter(name_or_id) -> AdapterId``: a name to the backend's id, an unknown one
    # refused with ``UnknownAdapterError``. Without it the Engine carries what it was given.
    resolve_adapter: bool = False
    # ``knows_adapter(adapter_id) -> bool``: the Engine refuses an unknown adapter at the verb
    # (a clear error, no state change) instead of at the step.
    knows_adapter: bool = False
    # ``remove_adapter(adapter_id)``: unload it (``Engine.remove_adapter``); else refused.
    remove_adapter: bool = False
    # ``adapter_version(adapter_id) -> int``: which load of the adapter is current (a reload
    # bumps it, so pages of the old weights are never matched). Without it: always 0.
    adapter_versions: bool = False
    # ``adapter_invocation(adapter_id) -> tuple[int, ...] | None``: an activated LoRA's
    # invocation tokens (None for a plain adapter). Without it every adapter is plain.
    activated_lora: bool = False
    # ``HostOffload`` (``offload_pages`` / ``restore_pages``): a host tier for residual pages.
    # Without it eviction drops the page.
    host_offload: bool = False
    # ``first_unwritten(kind, pages, length) -> int | None``: which positions a step wrote
    # (``Engine.check_integrity`` checks every table against it). Without it: not checked.
    written_positions: bool = False
    # ``step_batched(work, batch) -> StepResult``: reads the steady-decode rows as columns
    # (``decode_batch.py``). Without it the rows arrive as ``SeqWork`` items of ``step``.
    columns: bool = False
    # ``launch(work, batch) -> StepHandle``: starts a step and returns at once
    # (``step_handle.py``). Without it the step runs synchronously inside ``launch_step``.
    launch: bool = False
    # ``launch`` honours ``DecodeBatch.fed``: a batch's rows write the tokens an earlier
    # step (launched, maybe not read back) sampled, row for row (``decode_batch.py``).
    # Without it the overlap reads the earlier step back and hands the tokens.
    fed_tokens: bool = False

    def missing(self, backend: object) -> tuple[str, ...]:
        """The methods the flags set here promise that ``backend`` lacks (empty: it keeps
        its word)."""
        return tuple(method for flag in fields(self) if getattr(self, flag.name)
                     for method in METHODS[flag.name]
                     if not callable(getattr(backend, method, None)))


# The methods each flag promises (one entry per field of ``Capabilities``).
METHODS: dict[str, tuple[str, ...]] = {
    "resolve_adapter": ("resolve_adapter",),
    "knows_adapter": ("knows_adapter",),
    "remove_adapter": ("remove_adapter",),
    "adapter_versions": ("adapter_version",),
    "activated_lora": ("adapter_invocation",),
    "host_offload": ("offload_pages", "restore_pages"),
    "written_positions": ("first_unwritten",),
    "columns": ("step_batched",),
    "launch": ("launch",),
    "fed_tokens": ("launch",),
}
