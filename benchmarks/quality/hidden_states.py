"""Record the residual stream after every decoder layer, per token, from a live TorchBackend.

The backend exposes logits only, and forkserve/backend stays untouched, so this wraps three
attributes of one backend instance from the outside: ``runner.forward`` (to know which
work item, adapter and position each flattened row is), ``model.forward`` (asking for every
row's final hidden state: all rows go through the final norm, the logits are sliced back
to what the runner asked for) and ``model.fx`` (the glue functions every layer calls: the
second ``add_rms_norm`` of layer n returns the stream after layer n; the final ``rms_norm``
receives the stream after the last layer). If model.py's call pattern changes, the counts
checked after every forward stop the run rather than record the wrong tensors. CUDA graphs
must be off (a replayed graph calls no Python).

What an engine hook would need instead: ``TorchBackend.forward(work, hidden_states=True)``
returning per-item [tokens, layers, hidden] beside the logits.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import torch


class _RecordingFusions:
    """model.fx with the two norms recorded; the other glue functions pass through."""

    def __init__(self, inner: Any, recorder: "HiddenRecorder") -> None:
        self._inner, self._rec = inner, recorder
        self.compiled = inner.compiled
        self.rope_qk = inner.rope_qk
        self.silu_mul = inner.silu_mul

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self._rec._norm_calls += 1
        if self._rec._norm_calls == 2:  # the final norm (the first normalises the embeddings)
            self._rec._layers.append(x)
        return self._inner.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._inner.add_rms_norm(x, delta, weight, eps)
        self._rec._add_calls += 1
        if self._rec._add_calls % 2 == 0:  # after the MLP: the stream leaving a layer
            self._rec._layers.append(out[0])
        return out


class HiddenRecorder:
    """Attach to a backend; ``watch`` chooses what to keep; ``take`` hands it over.

    Kept: the rows of work items whose adapter id is watched, at positions >= the watched
    start, as float32 CPU tensors [num_layers, hidden] keyed by (adapter id, position)."""

    def __init__(self, backend: Any) -> None:
        self.num_layers = backend.model_config.num_layers
        self._watch: dict[int, int] = {}
        self._kept: dict[tuple[int, int], torch.Tensor] = {}
        self._work: Sequence[Any] = ()
        self._layers: list[torch.Tensor] = []
        self._norm_calls = self._add_calls = 0
        model, runner = backend.model, backend.runner
        model.fx = _RecordingFusions(model.fx, self)
        model_forward, runner_forward = model.forward, runner.forward
        signature = inspect.signature(model_forward)

        def forward_all_rows(*args: Any, **kwargs: Any) -> torch.Tensor:
            bound = signature.bind(*args, **kwargs)
            wanted = bound.arguments["logits_indices"]
            rows = bound.arguments["input_ids"].shape[0]
            bound.arguments["logits_indices"] = torch.arange(rows, device=wanted.device)
            self._layers, self._norm_calls, self._add_calls = [], 0, 0
            logits = model_forward(*bound.args, **bound.kwargs)
            self._keep(rows)
            return logits[wanted]

        def runner_with_work(work: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
            self._work = work
            return runner_forward(work, *args, **kwargs)

        model.forward = forward_all_rows
        runner.forward = runner_with_work

    def watch(self, starts: Mapping[int, int]) -> None:
        """Keep adapter id -> positions from this one on; forgets what was kept before."""
        self._watch, self._kept = dict(starts), {}

    def take(self) -> dict[tuple[int, int], torch.Tensor]:
        kept, self._kept = self._kept, {}
        return kept

    def _keep(self, rows: int) -> None:
        if self._add_calls != 2 * self.num_layers - 1 or self._norm_calls != 2 or len(self._layers) != self.num_layers:
            raise RuntimeError(f"CausalLM.forward called add_rms_norm {self._add_calls}x and rms_norm "
                               f"{self._norm_calls}x for {self.num_layers} layers: the recorder no longer "
                               "matches model.py")
        if sum(len(s.tokens) for s in self._work) != rows:
            raise RuntimeError("the batch has rows that belong to no work item; the recorder cannot place them")
        rows_kept, keys = [], []
        row = 0
        for item in self._work:
            start = self._watch.get(item.adapter_id) if item.adapter_id is not None else None
            if start is not None:
                for j in range(max(0, start - item.start_pos), len(item.tokens)):
                    rows_kept.append(row + j)
                    keys.append((item.adapter_id, item.start_pos + j))
            row += len(item.tokens)
        if not rows_kept:
            return
        index = torch.tensor(rows_kept, device=self._layers[0].device)
        # Only the kept rows leave the device: [kept, layers, hidden], one tensor per row.
        kept = torch.stack([layer.index_select(0, index) for layer in self._layers], dim=1).float().cpu()
        self._kept.update(zip(keys, kept.unbind(0), strict=True))
