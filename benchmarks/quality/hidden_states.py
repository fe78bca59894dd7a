"""A TorchBackend that keeps the residual stream after every layer for the agents it watches.

Built on ``TorchBackend.forward(work, hidden_states=True)``: while something is watched,
every engine step runs through it (eagerly: a replayed CUDA graph keeps no per-layer
tensors), and the rows of watched adapters at watched positions leave the device as
float32 [layers, hidden]. When nothing is watched, steps take the backend's fast path.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.protocol import SeqWork, StepResult
from forkserve.backend.step_handle import Done, StepHandle, run_step
from forkserve.backend.torch import TorchBackend

# (adapter id, position) -> [layers, hidden]
Kept = dict[tuple[int, int], torch.Tensor]


class RecordingBackend(TorchBackend):
    _watch: Mapping[int, int] = {}

    def watch(self, starts: Mapping[int, int]) -> None:
        """Keep adapter id -> positions from this one on; forgets what was kept before."""
        self._watch, self._kept = dict(starts), {}

    def take(self) -> Kept:
        kept, self._kept = self._kept, {}
        return kept

    def launch(self, work: Sequence[SeqWork], batch: DecodeBatch | None = None) -> StepHandle:
        """While something is watched a step runs here, through ``step`` (the engine launches
        every step; the queued fast path would keep no hidden states)."""
        if not self._watch:
            return super().launch(work, batch)
        try:
            return Done(run_step(self, work, batch))
        except Exception as exc:  # noqa: BLE001 - raised by the handle, as a launched step's
            return Done(error=exc)

    def step(self, work: Sequence[SeqWork]) -> StepResult:
        if not self._watch:
            return super().step(work)
        out = self.forward(work, hidden_states=True)
        for item, hidden in zip(work, out.hidden, strict=True):
            start = self._watch.get(item.adapter_id) if item.adapter_id is not None else None
            if start is None or item.start_pos + len(item.tokens) <= start:
                continue
            skip = max(0, start - item.start_pos)
            rows = hidden[skip:].float().cpu()
            self._kept.update(((item.adapter_id, item.start_pos + skip + j), row)
                              for j, row in enumerate(rows.unbind(0)))
        return out.result


def stack(kept: Kept, adapter_id: int, start: int) -> torch.Tensor:
    """The adapter's contiguous rows from ``start`` on: [positions, layers, hidden]."""
    rows = []
    while (adapter_id, start + len(rows)) in kept:
        rows.append(kept[(adapter_id, start + len(rows))])
    return torch.stack(rows) if rows else torch.empty(0)


def layer_cosines(mine: torch.Tensor, ref: torch.Tensor,
                  count: int) -> tuple[tuple[float, ...], int]:
    """Mean over the first ``count`` positions (both [positions, layers, hidden], same start)
    of cos(mine, ref), per layer; what both sides hold if fewer."""
    n = min(count, mine.shape[0], ref.shape[0])
    if n <= 0:
        return (), 0
    return tuple(F.cosine_similarity(mine[:n], ref[:n], dim=-1).mean(dim=0).tolist()), n
