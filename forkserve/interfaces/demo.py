"""``forkserve demo``: one ReAct-style agent step through every verb, on the CPU.

The harness fans out after a thought: a known wrapper (p = 1), a guessed error branch,
a repeated loop and an illegal tool call. The cascade keeps what is worth KV, commit binds
the branch that happened, and decode continues on the committed spine.
"""
from __future__ import annotations

import argparse

from tqdm import tqdm

from forkserve.backend.mock import MockBackend
from forkserve.bench.fanout import FanoutParams, format_table, run_system
from forkserve.config import plus_config
from forkserve.engine import Engine


def run_agent_step(verbose: bool = True) -> dict:
    backend = MockBackend(plus_config())
    tok = backend.tokenizer
    eng = Engine(backend)
    prompt = tok.encode("System: you are a shell agent. User: how many log files are in /var/log?\n"
                        "Thought: list the directory.\nAction: run({\"cmd\": \"ls /var/log\"})\n")
    h = eng.open(prompt)
    wrap = tok.encode("Observation: ")
    branches = {
        "bash": (wrap, 1.0),
        "err": (tok.encode("Observation: error: permission denied"), 0.2),
        "loop": (prompt[-24:], 0.3),
        "illegal": (tok.encode('Action: grep({"pattern": oops'), 0.3),
    }
    ids = {name: eng.fork(h.id, h.tip, name, toks) for name, (toks, _) in branches.items()}
    decisions = {name: eng.speculate(h.id, ids[name], priority=p, t_idle_ms=2900)
                 for name, (_, p) in branches.items()}
    eng.drain_slack()
    observation = tok.encode("Observation: syslog auth.log kern.log\n")
    cr = eng.commit(h.id, h.tip, observation)
    out = eng.generate(h.id, 32)
    eng.check_integrity()
    if verbose:
        for name, d in decisions.items():
            print(f"  {name:<8} -> {d.action.value:<12} score={d.score} {d.reason}")
        print(f"  commit bound '{next(n for n, i in ids.items() if i == cr.bound_node)}' "
              f"(matched {cr.matched_tokens} tokens), prefilled only the {cr.prefilled_tokens}-token tail")
        print(f"  generated (mock model, hashed tokens): {tok.decode(out.tokens)!r}")
    eng.close(h.id)
    return {"decisions": {k: v.action.value for k, v in decisions.items()},
            "commit": cr, "metrics": eng.metrics.snapshot()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="forkserve demo", description=__doc__.split("\n")[0])
    ap.parse_args(argv)
    print("== one agent step on the MockBackend (cost model, CPU) ==")
    run_agent_step()
    print("\n== seed 000 fan-out workload, four systems side by side ==")
    params = FanoutParams()
    rows = [run_system(s, params) for s in tqdm(("apc", "alias", "disagg", "cascade"),
                                                 desc="systems", leave=False)]
    print(format_table(rows))
    return 0
