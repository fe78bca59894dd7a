"""Evaluate trained adapters through forkserve's Engine + TorchBackend in every KV layout.

    python -m benchmarks.quality.evaluate --adapters benchmarks/results/quality_adapters --tag h200

Round r: the held-out item r of each of the K tasks; the K agents (agent i = task i's
adapter) share one system message, the function catalog of all K items plus distractors,
and each asks its own question. One agent, the writer (round r: agent r mod K), opens
first and generates; then the other K - 1 open, finding the writer's published pages where
the layout shares them, and decode together. Layouts:

* unified: merged K/V per adapter, no sharing across adapters (the lossless reference)
* disaggregated (ForkKV, residual_source = own_forward): the writer's base K/V is shared,
  each reader adds its own rank-r residual from its own forward pass over the context
* full_reuse: the writer's merged K/V is shared as is (the lossy baseline)
* base_activations (residual_source = base_activations): one base-model pass writes the base
  and every adapter's residual (Engine.prefill_shared), then all K agents open; recorded as
  not available when the engine has no prefill_shared
* no_lora: no adapter at all (what the adapters add)

Per layout: accuracy (ast_check), token F1 of the call text, greedy-token agreement with
unified, and for the agents that read a context cached by another (the readers) the cosine
similarity of the residual stream after each layer to unified's, over the agent's own
tokens (question and answer) up to the first token where its answer leaves unified's.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from benchmarks.quality.ast_check import check, token_f1
from benchmarks.quality.data import DEFAULT_CATEGORIES, Round, build_tasks, eval_rounds
from benchmarks.quality.hidden_states import HiddenRecorder
from forkserve.bench.output import DEFAULT_OUT

LAYOUTS = ("unified", "disaggregated", "full_reuse", "base_activations", "no_lora")
REFERENCE = "unified"


@dataclass(frozen=True)
class EvalParams:
    rounds: int = 40
    distractors: int = 4
    max_new: int = 128
    page_size: int = 16
    heldout: int = 40
    seed: int = 0
    categories: tuple[str, ...] = DEFAULT_CATEGORIES
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "eager"


@dataclass(frozen=True)
class AgentResult:
    round: int
    task: str
    item_id: str
    writer: bool
    prompt_tokens: int
    shared_tokens: int   # common prefix of the round's prompts (the catalog)
    reused_tokens: int   # base (or unified) KV found in the cache at open: written by another
    tokens: tuple[int, ...]
    text: str
    valid: bool
    error: str
    f1: float
    agreement: float     # greedy tokens equal to unified's, position by position
    layer_cos: tuple[float, ...]  # per layer, mean over compared tokens; () when not compared
    compared_tokens: int


@dataclass(frozen=True)
class LayoutResult:
    layout: str
    available: bool
    note: str
    agents: tuple[AgentResult, ...] = ()
    prefill_tokens: int = 0
    seconds: float = 0.0
    # The reference keeps its hidden states: (round, task) -> {position: [layers, hidden]}.
    hidden: Mapping[tuple[int, str], Mapping[int, torch.Tensor]] = field(default_factory=dict, repr=False)


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    if not a and not b:
        return 1.0
    return sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b))  # unequal lengths


def layer_cosines(mine: Mapping[int, torch.Tensor], ref: Mapping[int, torch.Tensor],
                  positions: Sequence[int]) -> tuple[tuple[float, ...], int]:
    """Mean over positions of cos(mine, ref), per layer; positions missing on either side skip."""
    both = [p for p in positions if p in mine and p in ref]
    if not both:
        return (), 0
    a = torch.stack([mine[p] for p in both])
    b = torch.stack([ref[p] for p in both])
    return tuple(F.cosine_similarity(a, b, dim=-1).mean(dim=0).tolist()), len(both)


def _config(layout: str, params: EvalParams, pages: int) -> Any:
    from forkserve.config import ForkServeConfig, KVLayout

    kv = {"unified": KVLayout.UNIFIED, "no_lora": KVLayout.UNIFIED, "full_reuse": KVLayout.FULL_REUSE,
          "disaggregated": KVLayout.DISAGGREGATED, "base_activations": KVLayout.DISAGGREGATED}[layout]
    return ForkServeConfig(page_size=params.page_size, num_pages=pages, num_residual_pages=pages, kv_layout=kv,
                           max_batch_tokens=4096, node_ttl_s=None)


def run_layout(layout: str, rounds: Sequence[Round], prompts: Sequence[Sequence[list[int]]], model_cfg: Any,
               weights: Any, adapters: Mapping[str, Any], tokenizer: Any, params: EvalParams,
               reference: LayoutResult | None) -> LayoutResult:
    from forkserve.backend.torch import TorchBackend
    from forkserve.engine import Engine

    if layout == "base_activations" and not hasattr(Engine, "prefill_shared"):
        return LayoutResult(layout, False, "this engine has no Engine.prefill_shared (residual_source = "
                                           "base_activations); not run")
    k = len(rounds[0].examples)
    longest = max(len(p) for ps in prompts for p in ps)
    pages = 2 * k * (-(-(longest + params.max_new) // params.page_size)) + 64
    backend = TorchBackend.from_weights(_config(layout, params, pages), model_cfg, weights, adapters,
                                        device=params.device, dtype=getattr(torch, params.dtype),
                                        attention=params.attention, use_cuda_graphs=False,
                                        compile_fusions=False)
    engine = Engine(backend)
    recorder = HiddenRecorder(backend)
    lora = layout != "no_lora"
    stop = tokenizer.eos_token_ids
    agents: list[AgentResult] = []
    hidden: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    start = time.perf_counter()
    for rnd, round_prompts in zip(rounds, prompts, strict=True):
        names = [e.task for e in rnd.examples]
        ids = [backend.adapter_id(n) if lora else None for n in names]
        shared = common_prefix(round_prompts)
        recorder.watch({aid: shared for aid in ids if aid is not None})
        if layout == "base_activations":
            engine.prefill_shared(round_prompts[0][:shared], ids)
        writer = rnd.index % k
        sessions, reused = {}, {}
        for i in [writer] + [j for j in range(k) if j != writer]:
            before = engine.metrics.base_hit_tokens
            sessions[i] = engine.open(round_prompts[i], adapter=ids[i]).id
            reused[i] = engine.metrics.base_hit_tokens - before
            if i == writer:  # the writer's pages are published before anyone else opens
                engine.generate(sessions[i], params.max_new, stop=stop)
            else:
                engine.start_generate(sessions[i], params.max_new, stop=stop)
        while any(engine.generation(s) is None for s in sessions.values()):
            if not engine.tick():
                raise RuntimeError(f"{layout}: generation stalled in round {rnd.index}")
        kept = recorder.take()
        for i, example in enumerate(rnd.examples):
            out = list(engine.generation(sessions[i]).tokens)
            text = tokenizer.decode([t for t in out if t not in stop])
            verdict = check(text, example.item.ground_truth, example.item.functions)
            mine = {p: h for (aid, p), h in kept.items() if aid == ids[i]} if lora else {}
            cos: tuple[float, ...] = ()
            compared = 0
            agree = 1.0
            if reference is not None:
                ref = next(a for a in reference.agents if a.round == rnd.index and a.task == example.task)
                agree = agreement(out, ref.tokens)
                same = common_prefix([out, list(ref.tokens)])
                if lora:
                    prompt_len = len(round_prompts[i])
                    cos, compared = layer_cosines(mine, reference.hidden[(rnd.index, example.task)],
                                                  range(shared, prompt_len + same))
            else:
                hidden[(rnd.index, example.task)] = mine
            agents.append(AgentResult(rnd.index, example.task, example.item.id, i == writer,
                                      len(round_prompts[i]), shared, reused[i], tuple(out), text,
                                      verdict.valid, verdict.error, token_f1(text, example.target), agree,
                                      cos, compared))
        for s in sessions.values():
            engine.close(s)
        engine.evict_all()  # the next round has another catalog: nothing left to hit
    return LayoutResult(layout, True, "", tuple(agents), engine.metrics.prefill_tokens,
                        time.perf_counter() - start, hidden)


def evaluate(model: Path, adapter_dir: Path, params: EvalParams, layouts: Sequence[str] = LAYOUTS,
             progress: bool = True) -> list[LayoutResult]:
    from tqdm import tqdm

    from forkserve.backend.torch import load_model
    from forkserve.backend.torch.lora import load_peft_adapter
    from forkserve.backend.torch.tokenizer import Tokenizer

    if layouts[0] != REFERENCE:
        raise ValueError(f"the first layout must be {REFERENCE!r}: the others are compared with it")
    tasks = build_tasks(params.categories, params.heldout, params.seed)
    rounds = eval_rounds(tasks, params.rounds, params.distractors, params.seed)
    tokenizer = Tokenizer.load(model)
    prompts = [[tokenizer.apply_chat_template(e.messages(False)) for e in r.examples] for r in rounds]
    model_cfg, weights = load_model(model, torch.device(params.device), getattr(torch, params.dtype))
    adapters = {t.name: load_peft_adapter(adapter_dir / t.name, t.name) for t in tasks}
    results: list[LayoutResult] = []
    for layout in tqdm(layouts, desc="layouts", disable=not progress):
        reference = results[0] if results else None
        results.append(run_layout(layout, rounds, prompts, model_cfg, weights, adapters, tokenizer, params,
                                  reference))
    return results


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.report import write_outputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help=".gguf or HF folder (default: SmolLM2 GGUF)")
    ap.add_argument("--adapters", type=Path, default=Path("benchmarks/results/quality_adapters"),
                    help="folder with one PEFT folder per task (train.py --out)")
    ap.add_argument("--tag", default="h200", help="outputs: RESULTS/quality_<tag>.{json,md,png}")
    ap.add_argument("--results", type=Path, default=DEFAULT_OUT,
                    help="output folder; benchmarks/results holds the committed runs")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--rounds", type=int, default=EvalParams.rounds)
    ap.add_argument("--distractors", type=int, default=EvalParams.distractors)
    ap.add_argument("--max-new", type=int, default=EvalParams.max_new)
    ap.add_argument("--heldout", type=int, default=EvalParams.heldout)
    ap.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=EvalParams.dtype, choices=("float32", "bfloat16"))
    ap.add_argument("--attention", default=EvalParams.attention, choices=("eager", "triton"))
    ap.add_argument("--label", default="", help="what the adapters are (printed with the table)")
    args = ap.parse_args(argv)
    if args.model is None:
        from forkserve.backend.torch import find_smollm2_gguf
        args.model = find_smollm2_gguf()
    params = EvalParams(args.rounds, args.distractors, args.max_new, 16, args.heldout, args.seed,
                        tuple(args.categories.split(",")), args.device, args.dtype, args.attention)
    results = evaluate(args.model, args.adapters, params, tuple(args.layouts.split(",")))
    table = write_outputs(results, params, args.model.name, args.adapters, args.label,
                          args.results / f"quality_{args.tag}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
