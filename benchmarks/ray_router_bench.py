"""Issue 20, run 1 (and run 3): ForkServe on Ray Serve, two Engine replicas, three routers
side by side in one run, react-multilora through the Serve HTTP ingress.

    python benchmarks/ray_router_bench.py --tiny --out DIR                 # CPU, tiny model
    python benchmarks/ray_router_bench.py --gpus-per-replica 0.5 --out DIR  # one H200, 8B shape
    python benchmarks/ray_router_bench.py --failover --out DIR              # run 3 only
    python benchmarks/ray_router_bench.py --plot DIR/ray_router_bench.json  # table + PNG again

Routers: ``ours`` (TreeAffinityRouter), ``pow2`` (Serve's default placement, power of two
choices, for new trees: ``TwoChoicesRouter``, which keeps a tree's verbs on its owner, as
Serve's own router cannot run branch trees at all) and ``prefix`` (ours with the
adapter-residual term off). Workload (docs/WORKLOADS.md's
react-multilora, lockstep): W agents over ``--contexts`` distinct shared contexts of C
tokens and ``--adapters`` adapters (agent i: context i mod K, adapter i mod A; with K = 4
and A = 8 each context is worked on by two adapters, and each (context, adapter) residual
is shared by W / 8 agents: where they meet it is computed once); each opens its tree on context +
instruction, then T turns of generate G (EOS ignored), a tool pause, commit a 100-token
observation. Every (router, W) gets contexts of its own, so no run finds another's pages.
The replicas build the model in memory (random weights, random rank-16 adapters) with the
total KV budget split evenly between them.

Figures per (router, W): tasks/s (W / makespan), tokens prefilled, base and residual
prefix hit ratios (hits / (hits + prefilled), as ``/metrics`` defines them), tree moves
(a tree answered by a replica other than its first: must be 0 for ours), trees and
prefilled tokens per replica. Read from each response's ``x-forkserve-replica`` header and
the Frontend's aggregated ``/metrics`` (before/after differences). The JSON is rewritten
after every (router, W); the PNG and the table at the end.

``--failover`` (run 3): ours at W = ``--failover-workflows``; during turn 2's generations
the replica holding most trees is killed by its actor. Reported: 5xx answers (split by
whether the tree lived on the killed replica), trees re-opened on the survivor, and for
every agent whether the committed length the Frontend reports equals what the agent
committed (no committed token lost).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from forkserve.bench.output import legend_below, new_figure, save_figure, titled, write_json  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402
from forkserve.interfaces.client import BranchAPIError, BranchClient  # noqa: E402

ROUTERS = ("ours", "pow2", "prefix")
MODEL = "synthetic"
NAME = "ray_router_bench"


# ---------------------------------------------------------------------- the replicas' model
class TokenIdText:
    """Random weights have no vocabulary text: a token renders as its id. Only the
    replica's EngineWorker decodes (chunks' text); clients here send and read token ids."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{int(t)}>" for t in ids)


def synthetic_model(
    spec, config, *, tiny: bool, adapters: int, rank: int, base_pages: int, residual_pages: int
):
    """The replica's ServedModel: docs/WORKLOADS.md's model shape with random weights and
    ``adapters`` random LoRA adapters (``agent0``..), on the replica's own device."""
    import torch

    from forkserve.backend.torch import TorchBackend
    from forkserve.backend.torch.model_config import llama3_8b_config
    from forkserve.backend.torch.weights import random_weights
    from forkserve.bench.multilora.workload import TARGETS, random_adapter, tiny_config
    from forkserve.engine import Engine
    from forkserve.interfaces.server.served_model import ServedModel

    model_cfg = tiny_config() if tiny else llama3_8b_config()
    device = torch.device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = config.replace(
        num_pages=base_pages,
        num_residual_pages=residual_pages,
        hbm_tokens=base_pages * config.page_size,
        max_batch_tokens=16384,
        node_ttl_s=None,
    )
    loras = {
        f"agent{a}": random_adapter(model_cfg, f"agent{a}", rank, device, seed=a)
        for a in range(adapters)
    }
    backend = TorchBackend.from_weights(
        cfg,
        model_cfg,
        random_weights(model_cfg, device, dtype),
        loras,
        device=device,
        dtype=dtype,
        max_adapters=adapters,
        max_lora_rank=rank,
        lora_targets=TARGETS,
        attention=spec.attention,
        use_cuda_graphs=spec.cuda_graphs,
    )
    engine = Engine(backend)
    return ServedModel(
        name=MODEL,
        engine=engine,
        tokenizer=TokenIdText(),
        adapters=backend.adapters,
        max_context=engine.config.max_context,
        eos_token_ids=(),
        grammars=None,
    )


# ---------------------------------------------------------------------- parameters, results
@dataclass(frozen=True)
class Params:
    tiny: bool
    contexts: int
    adapters: int
    context: int
    instruction: int
    turns: int
    gen: int
    observation: int
    pause_s: float
    rank: int
    kv_budget_gib: float  # both replicas together; each gets half
    residual_share: float
    page_size: int
    replicas: int
    gpus_per_replica: float
    stats_period_s: float


@dataclass(frozen=True)
class RouterRun:
    router: str
    workflows: int
    tasks_per_s: float
    makespan_s: float
    prefill_tokens: int
    base_hit_ratio: float
    residual_hit_ratio: float
    base_hit_tokens: int
    residual_hit_tokens: int
    tree_moves: int  # verbs answered by a replica other than the tree's first
    moved_trees: int
    frontend_tree_moves: int  # the Frontend's own count (forkserve_tree_moves)
    trees_per_replica: dict[str, int]
    prefill_per_replica: dict[str, int]
    errors: int
    failed_tasks: int  # agents a 507 (no KV for the tree on its replica) ended; not in tasks_per_s
    commit: str = ""


def _pages(p: Params, device: str) -> tuple[int, int]:
    """(base pages, residual pages) one replica's half of the KV budget buys."""
    import torch

    from forkserve.backend.torch.model_config import llama3_8b_config
    from forkserve.bench.multilora.workload import page_bytes, tiny_config

    cfg = tiny_config() if p.tiny else llama3_8b_config()
    sizes = page_bytes(
        cfg, p.rank, p.page_size, torch.float32 if device == "cpu" else torch.bfloat16
    )
    budget = p.kv_budget_gib * 2**30 / p.replicas
    return (
        int(budget * (1 - p.residual_share) // sizes["base"]),
        max(1, int(budget * p.residual_share // sizes["residual"])),
    )


# ---------------------------------------------------------------------- the cluster
class Cluster:
    """One local Ray, Serve's HTTP proxy on loopback; one application at a time."""

    def __init__(self, p: Params, port: int, device: str) -> None:
        import ray
        import torch
        from ray import serve

        # The replicas unpickle the loader: by value, whether this file runs as a script or
        # is imported (the CPU smoke test); and they import this checkout's forkserve.
        if __name__ != "__main__":
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        os.environ["PYTHONPATH"] = _pythonpath()
        ray.init(
            address="local",
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            # Counted by torch, not left to Ray's detection: a replica asking for a GPU Ray
            # did not find would wait for it forever.
            num_gpus=torch.cuda.device_count() if device == "cuda" else 0,
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.p, self.url, self.device = p, f"http://127.0.0.1:{port}", device

    def deploy(self, router: str) -> None:
        from ray import serve

        from forkserve.interfaces.ray_serve.deployments import build_application
        from forkserve.interfaces.ray_serve.engine_replica import ReplicaSpec
        from forkserve.interfaces.ray_serve.router import TwoChoicesRouter

        p = self.p
        base, residual = _pages(p, self.device)
        loader = functools.partial(
            synthetic_model,
            tiny=p.tiny,
            adapters=p.adapters,
            rank=p.rank,
            base_pages=base,
            residual_pages=residual,
        )
        spec = ReplicaSpec(
            model_path="",
            layout="disaggregated",
            page_size=p.page_size,
            num_pages=base,
            device=self.device,
            cuda_graphs=self.device != "cpu",
            attention="eager" if self.device == "cpu" else "auto",
            torch_threads=1 if self.device == "cpu" else None,
            loader=loader,
        )
        kwargs = {"residual_weight": 0.0} if router == "prefix" else {}
        app = build_application(
            spec,
            replicas=p.replicas,
            stats_period_s=p.stats_period_s,
            num_cpus=0.5 if self.device == "cpu" else 1.0,
            num_gpus=p.gpus_per_replica,
            router_kwargs=kwargs,
            health_check_period_s=2.0,
            router_class=TwoChoicesRouter if router == "pow2" else None,
        )
        serve.run(app, name="forkserve", route_prefix="/")

    def delete(self) -> None:
        from ray import serve

        serve.delete("forkserve")

    def shutdown(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def _pythonpath() -> str:
    """The replicas import this checkout's forkserve (not an installed copy) and the carry."""
    return os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )


def scrape(
    url: str, every_replica: bool = True, attempts: int = 5
) -> dict[str, dict[tuple, float]]:
    """``/metrics`` as {sample name: {sorted labels: value}}. A replica that did not answer
    the Frontend in time is ``forkserve_replica_up 0`` and missing from every counter, which
    would read as zero hits and zero prefill: with ``every_replica`` the scrape is retried
    until all replicas answer, and a run whose counters cannot be read fails loudly."""
    import httpx

    for attempt in range(attempts):
        text = httpx.get(f"{url}/metrics", timeout=60).text
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        up = out.get("forkserve_replica_up", {})
        if not every_replica or (up and all(v == 1.0 for v in up.values())):
            return out
        time.sleep(1.0 + attempt)
    down = sorted(dict(k)["replica"] for k, v in up.items() if v != 1.0)
    raise RuntimeError(
        f"/metrics: replicas {down or 'none listed'} did not answer {attempts} scrapes"
    )


def _by_replica(m: dict, name: str, **labels: str) -> dict[str, float]:
    out = {}
    for key, v in m.get(name, {}).items():
        d = dict(key)
        if all(d.get(k) == w for k, w in labels.items()):
            out[d["replica"]] = v
    return out


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    # A replica Serve restarted has counters from zero: its figures are its own since then.
    return {r: v - before.get(r, 0.0) if v >= before.get(r, 0.0) else v for r, v in after.items()}


# ---------------------------------------------------------------------- the agents
@dataclass
class Agent:
    index: int
    adapter: str
    prompt: list[int]
    client: BranchClient
    sid: str = ""
    tip: int = 0
    committed: int = 0
    replicas: list[str] = field(default_factory=list)
    errors: list[tuple[str, int, str]] = field(default_factory=list)  # (verb, status, replica then)
    failed: str | None = None  # the verb a 507 refused: the task is lost

    def _seen(self) -> None:
        self.replicas.append(self.client.last_replica or "")

    def call(self, verb: str, fn):
        """One verb, retried once on a 5xx (a fail-over's in-flight loss); every 5xx noted.
        A 507 (the replica's KV cannot hold the tree: the placement put too many distinct
        contexts there) ends this agent's task, as a client would give up: the run counts it
        as failed, closes the tree so its pages go back, and the agent sits out its turns."""
        for attempt in range(2):
            try:
                out = fn()
                self._seen()
                return out
            except BranchAPIError as e:
                self.errors.append((verb, e.status, self.replicas[-1] if self.replicas else ""))
                if e.status == 507:
                    self.failed = verb
                    if self.sid:
                        self.client.close(self.sid)
                    return None
                if e.status < 500 or attempt:
                    raise
        raise AssertionError("unreachable")

    def open(self) -> None:
        s = self.call("open", lambda: self.client.open(self.adapter, tokens=self.prompt))
        if s is not None:
            self.sid, self.tip, self.committed = s.session_id, s.tip, s.committed_tokens

    def generate(self, p: Params) -> None:
        if self.failed:
            return
        g = self.call("generate", lambda: self.client.generate(self.sid, p.gen, ignore_eos=True))
        if g is not None:
            self.committed += len(g.tokens)

    def observe(self, tokens: list[int]) -> None:
        if self.failed:
            return
        c = self.call(
            "commit", lambda: self.client.commit(self.sid, self.client_tip(), tokens=tokens)
        )
        if c is not None:
            self.tip, self.committed = c.tip, self.committed + len(tokens)

    def client_tip(self) -> int:
        return self.client.info(self.sid).tip

    def close(self) -> None:
        if not self.failed:
            self.call("close", lambda: self.client.close(self.sid))


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + j * 104729) % (vocab - 3) + 3 for j in range(n)]


def make_agents(p: Params, w: int, run: int, url: str, vocab: int) -> list[Agent]:
    contexts = [_tokens(1000 * run + k + 1, p.context, vocab) for k in range(p.contexts)]
    agents = []
    for i in range(w):
        prompt = contexts[i % p.contexts] + _tokens(10_000 * run + 7 * i + 5, p.instruction, vocab)
        agents.append(Agent(i, f"agent{i % p.adapters}", prompt, BranchClient(url, timeout=600)))
    return agents


def lockstep(agents: list[Agent], p: Params, vocab: int, during_turn=None) -> float:
    """Open every tree, then T turns: all generate, a pause, all commit an observation.
    ``during_turn(t)`` runs beside turn t's generations (the fail-over's kill)."""
    with ThreadPoolExecutor(len(agents)) as pool:
        start = time.perf_counter()
        list(pool.map(Agent.open, agents))
        for t in range(p.turns):
            side = threading.Thread(target=during_turn, args=(t,)) if during_turn else None
            if side:
                side.start()
            list(pool.map(lambda a: a.generate(p), agents))
            if side:
                side.join()
            time.sleep(p.pause_s)
            list(
                pool.map(
                    lambda a, t=t: a.observe(_tokens(a.index * 31 + t, p.observation, vocab)),
                    agents,
                )
            )
        makespan = time.perf_counter() - start
    return makespan


def moves(agents: list[Agent]) -> tuple[int, int]:
    """(verbs answered away from the tree's first replica, trees that moved at least once)."""
    away = [sum(r != a.replicas[0] for r in a.replicas) for a in agents if a.replicas]
    return sum(away), sum(1 for n in away if n)


def run_one(cluster: Cluster, router: str, w: int, run: int, vocab: int) -> RouterRun:
    p = cluster.p
    before = scrape(cluster.url)
    agents = make_agents(p, w, run, cluster.url, vocab)
    makespan = lockstep(agents, p, vocab)
    after = scrape(cluster.url)
    for a in agents:
        a.close()
    prefill = _diff(
        _by_replica(after, "forkserve_prefill_tokens_total"),
        _by_replica(before, "forkserve_prefill_tokens_total"),
    )
    hits = {
        tree: sum(
            _diff(
                _by_replica(after, "forkserve_prefix_hit_tokens_total", tree=tree),
                _by_replica(before, "forkserve_prefix_hit_tokens_total", tree=tree),
            ).values()
        )
        for tree in ("base", "residual")
    }
    total = sum(prefill.values())
    away, moved = moves(agents)
    fe = after.get("forkserve_tree_moves_total", {}).get((), 0.0) - before.get(
        "forkserve_tree_moves_total", {}
    ).get((), 0.0)
    short = {r: r.rsplit("#", 1)[-1] for r in prefill}
    return RouterRun(
        router,
        w,
        sum(1 for a in agents if not a.failed) / makespan,
        makespan,
        int(total),
        hits["base"] / max(1.0, hits["base"] + total),
        hits["residual"] / max(1.0, hits["residual"] + total),
        int(hits["base"]),
        int(hits["residual"]),
        away,
        moved,
        int(fe),
        dict(Counter(a.replicas[0].rsplit("#", 1)[-1] for a in agents if a.replicas)),
        {short[r]: int(v) for r, v in prefill.items()},
        sum(len(a.errors) for a in agents),
        sum(1 for a in agents if a.failed),
        source_commit(),
    )


# ---------------------------------------------------------------------- run 3: fail-over
def failover(cluster: Cluster, w: int, run: int, vocab: int) -> dict[str, Any]:
    import ray

    p = cluster.p
    agents = make_agents(p, w, run, cluster.url, vocab)
    killed: dict[str, Any] = {}

    def kill(turn: int) -> None:
        if turn != 1:
            return
        time.sleep(0.2)  # the generations are under way
        owners = Counter(a.replicas[-1] for a in agents)
        victim = owners.most_common(1)[0][0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed.update(replica=victim, trees=owners[victim], at_s=time.perf_counter())

    before = scrape(cluster.url)
    makespan = lockstep(agents, p, vocab, during_turn=kill)
    after = scrape(cluster.url, every_replica=False)
    # A tree the survivor cannot hold (507) is a lost task, not lost tokens: it is reported apart.
    reported = {a.index: a.client.info(a.sid).committed_tokens for a in agents if not a.failed}
    lost = {
        a.index: a.committed - reported[a.index] for a in agents
        if a.index in reported and reported[a.index] != a.committed
    }
    victim = killed.get("replica")
    on_victim = [e for a in agents for e in a.errors if e[1] >= 500 and e[2] == victim]
    elsewhere = [e for a in agents for e in a.errors if e[1] >= 500 and e[2] != victim]
    for a in agents:
        a.close()
    moved = sum(1 for a in agents if victim in a.replicas and a.replicas[-1] != victim)
    fe = after.get("forkserve_tree_moves_total", {}).get((), 0.0) - before.get(
        "forkserve_tree_moves_total", {}
    ).get((), 0.0)
    return {
        "workflows": w,
        "makespan_s": makespan,
        "killed_replica": victim,
        "trees_on_killed_replica": killed.get("trees", 0),
        "trees_moved_to_survivor": moved,
        "frontend_tree_moves": int(fe),
        "agents_with_lost_committed_tokens": len(lost),
        "lost_committed_tokens": sum(lost.values()),
        "5xx_on_killed_replica": len(on_victim),
        "5xx_elsewhere": len(elsewhere),
        "failed_tasks": sum(1 for a in agents if a.failed),
        "errors": [list(e) for a in agents for e in a.errors],
        "commit": source_commit(),
        "ok": not lost and not elsewhere and killed.get("trees", 0) == moved,
    }


# ---------------------------------------------------------------------- report
COLUMNS = (
    "router",
    "workflows",
    "tasks_per_s",
    "prefill_tokens",
    "base_hit_ratio",
    "residual_hit_ratio",
    "tree_moves",
    "trees_per_replica",
    "errors",
    "failed_tasks",
    "prefill_per_task",
)


def prefill_per_task(run: dict) -> float:
    """Tokens prefilled per completed task: a router whose placement loses tasks (507)
    prefills fewer tokens in all, for less work done."""
    return run["prefill_tokens"] / max(1, run["workflows"] - run.get("failed_tasks", 0))


def table(runs: list[dict]) -> str:
    # A run older than failed_tasks aborted on its first 507: it completed every task.
    runs = [{"failed_tasks": 0, **r} for r in runs]
    runs = [{**r, "prefill_per_task": prefill_per_task(r)} for r in runs]
    rows = [COLUMNS] + [tuple(_fmt(r[c]) for c in COLUMNS) for r in runs]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(str(v).rjust(wd) for v, wd in zip(row, widths, strict=True)) for row in rows]
    for w in sorted({r["workflows"] for r in runs}):
        by = {r["router"]: r for r in runs if r["workflows"] == w}
        if "ours" in by and "pow2" in by:
            o, d = by["ours"], by["pow2"]
            prefilled = o["prefill_tokens"] / max(1, d["prefill_tokens"])
            per_task = o["prefill_per_task"] / d["prefill_per_task"]
            speed = o["tasks_per_s"] / d["tasks_per_s"]
            lines.append(f"W={w}: ours / pow2: prefilled {prefilled:.2f}x in all, {per_task:.2f}x "
                         f"per completed task; tasks/s {speed:.2f}x")
    return "\n".join(lines)


def _fmt(v: Any) -> Any:
    return f"{v:.3f}" if isinstance(v, float) else v


def plot(doc: dict, path: Path) -> None:
    runs = doc["runs"]
    fig, axes = new_figure(3, width=13, height=4.2)
    for ax, key, label in zip(
        axes,
        ("tasks_per_s", "prefill_tokens", "base_hit_ratio"),
        ("tasks/s", "tokens prefilled", "base prefix hit ratio"),
        strict=True,
    ):
        ws = sorted({r["workflows"] for r in runs})
        for i, router in enumerate(ROUTERS):
            rows = {r["workflows"]: r for r in runs if r["router"] == router}
            xs = [j + (i - 1) * 0.27 for j, w in enumerate(ws) if w in rows]
            ax.bar(xs, [rows[w][key] for w in ws if w in rows], width=0.27, label=router)
        ax.set_xticks(range(len(ws)), [f"W={w}" for w in ws])
        ax.set_title(label)
    legend_below(fig, axes[0])
    fig.suptitle(
        titled(
            "react-multilora on Ray Serve, 2 replicas: routers side by side", doc["params"]["tiny"]
        )
    )
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="2-layer model on the CPU, toy sizes")
    ap.add_argument("--workflows", type=int, nargs="+")
    ap.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    ap.add_argument("--contexts", type=int, default=4)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--context", type=int, help="shared context tokens C")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--gen", type=int)
    ap.add_argument("--kv-budget-gib", type=float, help="both replicas together")
    ap.add_argument("--gpus-per-replica", type=float)
    ap.add_argument("--stats-period", type=float, default=1.0)
    ap.add_argument("--failover", action="store_true", help="run 3 only")
    ap.add_argument("--with-failover", action="store_true", help="run 3 after the routers")
    ap.add_argument("--failover-workflows", type=int)
    ap.add_argument("--port", type=int, default=8711)
    ap.add_argument("--out", type=Path, default=Path("forkserve-bench-results"))
    ap.add_argument("--plot", type=Path, help="only print the table and draw the PNG of this JSON")
    a = ap.parse_args(argv)
    if a.plot:
        doc = json.loads(a.plot.read_text())
        print(table(doc["runs"]))
        plot(doc, a.plot.with_suffix(".png"))
        return 0
    import torch

    device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    p = Params(
        tiny=a.tiny,
        contexts=a.contexts,
        adapters=a.adapters,
        context=a.context or (64 if a.tiny else 8192),
        instruction=16,
        turns=a.turns,
        gen=a.gen or (4 if a.tiny else 64),
        observation=8 if a.tiny else 100,
        pause_s=0.02 if a.tiny else 0.1,
        rank=16,
        kv_budget_gib=a.kv_budget_gib or (0.02 if a.tiny else 24.0),
        residual_share=0.5 if a.tiny else 0.1,
        page_size=16,
        replicas=2,
        gpus_per_replica=a.gpus_per_replica
        if a.gpus_per_replica is not None
        else (0.0 if device == "cpu" else 0.5),
        stats_period_s=a.stats_period,
    )
    workflows = a.workflows or ([4, 8] if a.tiny else [32, 64])
    vocab = 512 if a.tiny else 128256
    out = a.out / f"{NAME}{'_tiny' if a.tiny else ''}.json"
    doc: dict[str, Any] = {
        "params": asdict(p),
        "workflows": workflows,
        "runs": [],
        "failover": None,
        "commit": source_commit(),
    }
    cluster = Cluster(p, a.port, device)
    try:
        run, deployed = 0, None
        for router in [] if a.failover else a.routers:
            if deployed:
                cluster.delete()
            t0 = time.perf_counter()
            cluster.deploy(router)
            deployed = router
            print(f"{router}: deployed in {time.perf_counter() - t0:.0f} s", flush=True)
            for w in workflows:
                run += 1
                r = run_one(cluster, router, w, run, vocab)
                doc["runs"].append(asdict(r))
                print(json.dumps(asdict(r)), flush=True)
                write_json(out, doc)
        if a.failover or a.with_failover:
            if deployed != "ours":  # the fail-over runs on ours: reuse it when it is up
                if deployed:
                    cluster.delete()
                cluster.deploy("ours")
            w = a.failover_workflows or (8 if a.tiny else 32)
            doc["failover"] = failover(cluster, w, run + 1, vocab)
            print(json.dumps(doc["failover"]), flush=True)
            write_json(out, doc)
    finally:
        cluster.shutdown()
    if doc["runs"]:
        print(table(doc["runs"]))
        try:
            plot(doc, out.with_suffix(".png"))
        except ImportError as e:  # no matplotlib on the machine: draw it later with --plot
            print(f"no PNG: {e}")
    return 0 if doc["failover"] is None or doc["failover"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
