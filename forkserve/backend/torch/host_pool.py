"""HostResidualPool: host (CPU) copies of residual pages, the backend side of the host tier.

Holds k_res / v_res rows [layers, slots, P, r_max] for ``config.host_residual_pages`` slots
whose ids the control plane owns (``HostOffload``). Pinned on CUDA so the copies run at
full PCIe bandwidth. Both directions copy synchronously: the control plane reuses the
device page right after an offload and the host slot right after a restore, so neither
copy may still be in flight when the call returns.
"""
from __future__ import annotations

from typing import Sequence

import torch

from forkserve.backend.protocol import HostCopy, PageKind
from forkserve.backend.torch.kv_pool import KVPool


class HostResidualPool:
    def __init__(self, pool: KVPool, slots: int) -> None:
        self.pool, self.num_slots = pool, slots
        k, _ = pool.tensors_of(PageKind.RESIDUAL)
        shape = (k.shape[0], slots, *k.shape[2:])
        pin = k.device.type == "cuda"
        self.k = torch.zeros(shape, dtype=k.dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=k.dtype, pin_memory=pin)

    def offload(self, copies: Sequence[HostCopy]) -> None:
        pages, slots = self._indices(copies)
        for host, device in zip((self.k, self.v), self.pool.tensors_of(PageKind.RESIDUAL), strict=True):
            host[:, slots] = device[:, pages.to(device.device)].cpu()

    def restore(self, copies: Sequence[HostCopy]) -> None:
        pages, slots = self._indices(copies)
        for host, device in zip((self.k, self.v), self.pool.tensors_of(PageKind.RESIDUAL), strict=True):
            device[:, pages.to(device.device)] = host[:, slots].to(device.device)

    @staticmethod
    def _indices(copies: Sequence[HostCopy]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([c.page for c in copies], dtype=torch.long),
                torch.tensor([c.slot for c in copies], dtype=torch.long))
