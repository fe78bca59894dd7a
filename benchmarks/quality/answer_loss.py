"""One training step's loss over the answer tokens, a few rows at a time.

``model(labels=...)`` builds logits at every position, [rows, width, vocab] in bf16 and again
in float32 for the loss: with Qwen2.5's 151,936-entry vocabulary at 8 rows x 2048 that is
~30 GiB per process, nearly all of it for prompt positions whose labels are -100, and four
training processes did not fit one H200 (2026-12-02). Here the final norm's output is taken
by a hook, the model is asked for one position's logits, and the LM head runs on the answer
positions alone.

Rows go through the model in micro-batches, each padded only to its own longest row: with
one row a micro-batch there is no padding and no attention mask (the causal kernel), and the
activations held for backward are one row's. The loss is the batch's: the sum of every answer
token's cross-entropy over the batch's answer-token count, as HF's mean over the whole batch.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

IGNORE = -100  # HF's label for a position that is not trained

Row = tuple[list[int], int]  # (prompt + answer ids, prompt length): train.encode's


@contextmanager
def captured_output(module: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """While open, ``box["out"]`` is ``module``'s last forward output."""
    box: dict[str, torch.Tensor] = {}
    handle = module.register_forward_hook(lambda _m, _i, out: box.__setitem__("out", out))
    try:
        yield box
    finally:
        handle.remove()


def final_norm_and_head(model: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder's final norm and the LM head of a transformers causal LM (under PEFT too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(base.get_decoder(), "norm", None)
    if norm is None:
        raise TypeError(f"{type(base).__name__}: no final norm at get_decoder().norm to take the "
                        f"hidden states from")
    return norm, base.get_output_embeddings()


def answer_tokens(rows: Sequence[Row]) -> int:
    """The batch's trained tokens: every answer token (each is the target of the position
    before it)."""
    return sum(len(ids) - prompt_len for ids, prompt_len in rows)


def micro_batch(rows: Sequence[Row], pad: int, device: torch.device) -> dict[str, torch.Tensor]:
    """ids, labels and mask of ``rows``, right-padded to their longest; one copy to the device
    (from pinned memory on CUDA, so it is queued rather than waited for)."""
    width = max(len(ids) for ids, _ in rows)
    packed = torch.zeros((3, len(rows), width), dtype=torch.long)
    packed[0].fill_(pad)
    packed[1].fill_(IGNORE)
    for row, (ids, prompt_len) in enumerate(rows):
        packed[0, row, :len(ids)] = torch.tensor(ids)
        packed[1, row, prompt_len:len(ids)] = torch.tensor(ids[prompt_len:])
        packed[2, row, :len(ids)] = 1
    if device.type == "cuda":
        packed = packed.pin_memory()
    input_ids, labels, mask = packed.to(device, non_blocking=True)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def backward_answer_loss(model: Any, rows: Sequence[Row], micro: int, pad: int,
                         device: torch.device,
                         extra: Callable[[Sequence[Row], int], dict[str, Any]] | None = None
                         ) -> torch.Tensor:
    """Runs forward and backward over ``rows`` in micro-batches of ``micro`` and returns the
    batch's mean answer-token loss (detached, on the device). ``extra(rows, width)``: more
    model arguments for a micro-batch (an aLoRA's offsets)."""
    norm, head = final_norm_and_head(model)
    total = answer_tokens(rows)
    loss = torch.zeros((), device=device)
    for start in range(0, len(rows), micro):
        part = rows[start:start + micro]
        inputs = micro_batch(part, pad, device)
        labels = inputs.pop("labels")
        if len(part) == 1:  # no padding: no mask, so the causal attention kernel runs
            del inputs["attention_mask"]
        more = extra(part, labels.shape[1]) if extra is not None else {}
        with captured_output(norm) as box, \
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            model(**inputs, logits_to_keep=1, **more)
            targets = labels[:, 1:]
            trained = targets != IGNORE
            logits = head(box["out"][:, :-1][trained]).float()
            summed = F.cross_entropy(logits, targets[trained], reduction="sum")
        (summed / total).backward()
        loss += summed.detach()
    return loss / total
