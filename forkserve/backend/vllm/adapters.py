"""AdapterTable: the control plane's adapter ids -> vLLM LoRA requests.

The Engine passes whatever adapter the session was opened with: a name (``"agent3"``) or
the int that ``VllmBackend.adapter_id(name)`` returned (what forkserve/bench/multilora/
does). vLLM needs a ``LoRARequest(name, int_id > 0, path)``; its prefix cache keys blocks by
that LoRA, so one name must always map to one int id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from forkserve.adapter_key import AdapterId
from forkserve.errors import InvalidRequestError


@dataclass(frozen=True)
class LoraRef:
    name: str
    int_id: int  # >= 1: vLLM reserves 0 for "no LoRA"
    path: str


class AdapterTable:
    def __init__(self, lora_modules: Mapping[str, str] | None = None) -> None:
        self._by_name: dict[str, LoraRef] = {}
        for i, (name, path) in enumerate(sorted((lora_modules or {}).items()), start=1):
            self._by_name[name] = LoraRef(name, i, str(path))
        self._by_id = {ref.int_id: ref for ref in self._by_name.values()}

    def __len__(self) -> int:
        return len(self._by_name)

    def adapter_id(self, name: str) -> int:
        return self._ref_by_name(name).int_id

    def resolve(self, adapter: AdapterId | None) -> LoraRef | None:
        """``None`` is the base model; a name or an id from ``adapter_id`` is a LoRA."""
        if adapter is None:
            return None
        if isinstance(adapter, str):
            return self._ref_by_name(adapter)
        if isinstance(adapter, int) and adapter in self._by_id:
            return self._by_id[adapter]
        raise InvalidRequestError(f"unknown adapter {adapter!r}; loaded: {sorted(self._by_name)}")

    def _ref_by_name(self, name: str) -> LoraRef:
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidRequestError(f"unknown adapter {name!r}; loaded: "
                                      f"{sorted(self._by_name)}") from None
