"""A task's training state mid-run, so that a task cut by a device call's timeout continues.

Owned by ``train.train_task``, one file per task: ``<out>/<task>/checkpoint.pt``, written every
``--checkpoint-every`` optimizer steps (a temp file renamed over the old one: a kill while
writing leaves the previous checkpoint whole), read once when the task starts again, removed
once the task's adapter is saved. It lives on the machine that trains (/root on the H200
survives back-to-back calls) and is not shipped with the adapters.

Resuming is exact: the trainable LoRA weights, AdamW's moments and step counts, the LR
schedule's position and the torch RNG states are restored as they were, and the data stream
(``train.batches``: a deterministic generator) is fast-forwarded by the batches already drawn
(one per step), so the adapter is bit for bit the one an uninterrupted run saves. Python's
global ``random`` is not saved: the stream draws from ``random.Random`` instances of its own.
A checkpoint records the ``key`` of the run that wrote it (``train.run_key``: model, recipe and
split, as JSON reads them back); one written under another key is refused, never mixed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FILE = "checkpoint.pt"


@dataclass
class Progress:
    """How far a task's training got, beyond what the model, optimizer and schedule hold."""
    step: int  # optimizer steps done, the skipped ones included: also the batches drawn
    skipped: list[int]  # steps whose gradients were not finite (no update)
    losses: torch.Tensor  # [params.steps] on the training device; the first ``step`` are set


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def save(folder: Path, key: dict[str, Any], model: torch.nn.Module,
         opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
         progress: Progress, device: torch.device) -> None:
    """Writes the task's state to ``folder/checkpoint.pt`` atomically."""
    state = {
        "key": key,
        "step": progress.step,
        "skipped": list(progress.skipped),
        "losses": progress.losses[:progress.step].cpu(),
        "lora": {name: p.detach().cpu() for name, p in _trainable(model).items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, folder / FILE)


def restore(folder: Path, key: dict[str, Any], model: torch.nn.Module,
            opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
            losses: torch.Tensor, device: torch.device) -> Progress | None:
    """Loads ``folder``'s checkpoint into the freshly built ``model``, ``opt`` and ``sched``
    (and the RNG) and returns its progress, its losses copied into ``losses``; None when there
    is none. Raises SystemExit, naming the folder, when it was written under another key."""
    path = folder / FILE
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["key"] != key:
        raise SystemExit(f"{folder} holds a checkpoint of training with other parameters "
                         f"({state['key']}); delete {path} or use another --out")
    with torch.no_grad():
        for name, p in _trainable(model).items():
            p.copy_(state["lora"][name])
    opt.load_state_dict(state["optimizer"])  # casts the moments to each weight's device
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng_cpu"])
    if device.type == "cuda" and state["rng_cuda"] is not None:
        torch.cuda.set_rng_state(state["rng_cuda"], device)
    step = state["step"]
    losses[:step] = state["losses"].to(losses.device)
    return Progress(step, list(state["skipped"]), losses)


def remove(folder: Path) -> None:
    """Drops ``folder``'s checkpoint (its task's adapter is saved)."""
    (folder / FILE).unlink(missing_ok=True)
