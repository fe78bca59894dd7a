"""The react/mapreduce multi-LoRA benchmark runs every system on a tiny model (CPU) and
measures what the layouts promise: one shared copy of the context when disaggregated."""
import gc
import json

import pytest
import torch

from forkserve.bench.multilora import (
    SPECS,
    SYSTEMS,
    MultiLoraParams,
    build_backend,
    main,
    run_system,
    run_workload,
)
from forkserve.config import KVForm
from forkserve.control.prefix_index import CacheSalt
from forkserve.engine import Engine
from forkserve.engine.heap import thaw


@pytest.fixture(scope="module")
def tiny():
    from forkserve.backend.torch.weights import random_weights
    from forkserve.bench.multilora import tiny_config

    cfg = tiny_config()
    return cfg, random_weights(cfg, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("workload", ["react", "mapreduce"])
def test_every_system_completes_and_disaggregation_shares_the_context(tiny, workload):
    cfg, weights = tiny
    params = MultiLoraParams(workload, workflows=4, context=128, turns=2, gen=4, observation=8,
                             pause_s=0.0, kv_budget_gib=0.01)
    runs = {s: run_system(s, params, *build_backend(s, params, params.workflows, cfg, weights,
                                                      torch.device("cpu"), torch.float32))
            for s in SYSTEMS}
    turns = params.turns_run
    for r in runs.values():
        # The first token of every turn is sampled by its prefill step, the rest by decode steps.
        assert r.tasks_per_s > 0 and r.decode_tokens >= 4 * turns * (params.gen - 1)
    # Agents 1..3 find agent 0's context published except under unified (one cache per adapter).
    assert runs["unified"].prefix_hit_rate < runs["disaggregated"].prefix_hit_rate
    assert runs["disaggregated"].prefix_hit_rate == pytest.approx(runs["no_lora"].prefix_hit_rate)
    # Disaggregated still computes every agent's own residual: prefill is not skipped...
    assert runs["disaggregated"].prefill_tokens > runs["full_reuse"].prefill_tokens
    # ...but the shared context's K/V is stored once.
    assert runs["disaggregated"].peak_kv_bytes < runs["unified"].peak_kv_bytes
    # The shared context measured per agent: stored once plus rank-r residuals (seed 001's M_R).
    # The tiny model: 1/N + r/n = 1/4 + 16/64 at N = 4.
    assert (runs["disaggregated"].context_kv_per_agent_bytes
            <= runs["unified"].context_kv_per_agent_bytes / 2)
    # base_activations: one base pass over the context instead of one pass per agent.
    assert runs["disaggregated_base"].prefill_tokens < runs["disaggregated"].prefill_tokens / 2
    # That pass runs before any agent opens: timed on its own, inside the makespan, in no
    # tick bucket; where agent 0 writes the context, its ticks hold that time.
    base = runs["disaggregated_base"]
    assert 0 < base.context_write_s < base.makespan_s - base.prefill_tick_s - base.decode_tick_s
    assert runs["disaggregated"].context_write_s == 0


def test_profiled_runs_profile_the_context_write_once_and_their_ticks(tiny):
    """--profile-ticks: base_activations' shared-context pass is profiled whole (its kernels
    and host operators), beside the ticks; a system without that pass has no such entry."""
    cfg, weights = tiny
    params = MultiLoraParams("react", workflows=2, context=64, turns=1, gen=3, observation=4,
                             pause_s=0.0, kv_budget_gib=0.01)
    profiles = {s: run_system(s, params, *build_backend(s, params, params.workflows, cfg, weights,
                                                          torch.device("cpu"), torch.float32),
                              profile_ticks=1, settle_heap=True).step_profile
                for s in ("disaggregated_base", "disaggregated")}
    write = profiles["disaggregated_base"]["context_write"]
    assert write["ticks"] == 1 and write["wall_ms"] > 0
    assert write["by_category_ms"].get("gemm", 0.0) > 0
    assert write["host_top"] and all(k["ms"] > 0 for k in write["host_top"])
    assert any(k["name"] == "forkserve.engine.engine:prefill_shared" for k in write["python_top"])
    assert "context_write" not in profiles["disaggregated"]
    assert {"prefill", "decode"} <= set(profiles["disaggregated"])
    # Each run starts on a settled heap (engine/heap.py): what it started with is frozen.
    assert gc.get_freeze_count() > 0
    thaw()


def test_cli_writes_json_and_png_and_says_where(tmp_path, capsys):
    assert main(["react", "--tiny", "--workflows", "2", "--systems", "unified", "disaggregated",
                 "--context", "64", "--turns", "1", "--gen", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "react_multilora_tiny.json").read_text())
    assert {r["system"] for r in data["results"]} == {"unified", "disaggregated"}
    assert not data["errors"]
    # The card's name (a GPU run's goals are read by it: issue15_goals); none on the CPU.
    assert data["device"] == "cpu" and data["gpu"] is None
    assert (tmp_path / "react_multilora_tiny.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'react_multilora_tiny.png'}" in out and "FAILED" not in out
    # --plot redraws a JSON's PNG and prints its table without running anything.
    (tmp_path / "react_multilora_tiny.png").unlink()
    assert main(["react", "--plot", str(tmp_path / "react_multilora_tiny.json")]) == 0
    assert (tmp_path / "react_multilora_tiny.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "unified" in table and "disaggregated" in table and "tasks/s" in table


def test_the_plot_says_which_card_and_commit_it_shows(tmp_path, monkeypatch):
    """A PNG read apart from its JSON (a report, an issue) still says where it was measured:
    the card and the commit above the axes."""
    import forkserve.bench.multilora.cli as cli

    shown = []
    monkeypatch.setattr(cli, "plot", lambda *a: shown.append(a[-1]))
    doc = {"gpu": "NVIDIA H100 80GB HBM3", "device": "cuda",
           "commit": "241e2143335c020dcc8e84d98b02f1405fa6f634", "results": [], "errors": []}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    assert main(["react", "--plot", str(tmp_path / "r.json")]) == 0
    # A CPU run names its device; a file from before commits were recorded, its card alone.
    (tmp_path / "c.json").write_text(json.dumps(doc | {"gpu": None, "device": "cpu"}))
    (tmp_path / "o.json").write_text(json.dumps(doc | {"commit": None}))
    for name in ("c", "o"):
        assert main(["react", "--plot", str(tmp_path / f"{name}.json")]) == 0
    assert shown == ["NVIDIA H100 80GB HBM3, 241e214", "cpu, 241e214", "NVIDIA H100 80GB HBM3"]


def test_rounds_reverse_the_order_and_rows_carry_each_rounds_figure(tmp_path, capsys):
    """--rounds 2: the second round runs the systems in reverse (a card that warms through a
    run favours neither), and each row is the lower median run with every round's tasks/s,
    which a reader pairs round by round (issue15_goals)."""
    assert main(["react", "--tiny", "--workflows", "2", "--systems", "unified", "disaggregated",
                 "--rounds", "2", "--context", "64", "--turns", "1", "--gen", "2",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "react_multilora_tiny.json").read_text())
    assert data["rounds"] == [["unified", "disaggregated"], ["disaggregated", "unified"]]
    assert [r["system"] for r in data["results"]] == ["unified", "disaggregated"]
    for r in data["results"]:
        first, second = r["round_tasks_per_s"]
        assert r["tasks_per_s"] == min(first, second)
        assert f"median of 2 runs: {min(first, second):.3f}, {max(first, second):.3f}" in \
            r["notes"][-1]
    assert "unified W=2: tasks/s by round" in capsys.readouterr().out
    assert main(["react", "--plot", str(tmp_path / "react_multilora_tiny.json")]) == 0
    assert "disaggregated W=2: tasks/s by round" in capsys.readouterr().out


def test_prefill_ticks_carry_every_prefill_token(tmp_path):
    """The rows count the ticks that prefilled and their tokens: every prefill token rode in
    one of them (the agent-written systems prefill only inside the driver's ticks)."""
    assert main(["react", "--tiny", "--workflows", "3", "--systems", "unified", "disaggregated",
                 "--context", "64", "--turns", "2", "--gen", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "react_multilora_tiny.json").read_text())
    for r in data["results"]:
        assert r["prefill_ticks"] > 0
        assert r["prefill_tokens_per_tick"] * r["prefill_ticks"] == pytest.approx(
            r["prefill_tokens"])
        assert r["prefill_tokens_per_tick"] <= r["prefill_tokens_per_tick_max"] <= 16384


def test_a_failed_run_exits_1_and_is_reported(tmp_path, capsys):
    # 6 pages of KV cannot hold one workflow's 12.
    assert main(["react", "--tiny", "--workflows", "1", "--systems", "unified", "--context", "64",
                 "--turns", "1", "--gen", "2", "--kv-budget-gib", "0.0001",
                 "--out", str(tmp_path)]) == 1
    data = json.loads((tmp_path / "react_multilora_tiny.json").read_text())
    [error] = data["errors"]
    assert (error["system"], error["workflows"]) == ("unified", 1)
    assert "FAILED unified W=1: RuntimeError" in capsys.readouterr().out
    assert main(["react", "--plot", str(tmp_path / "react_multilora_tiny.json")]) == 1
    assert "FAILED unified W=1: RuntimeError" in capsys.readouterr().out


class _Isolated(Engine):
    """Every adapter (agent) opens in its own trust boundary, so no agent can reuse a page
    another wrote: each computes the whole context itself, as if run alone."""

    def open(self, tokens, *, adapter=None, **kw):
        return super().open(tokens, adapter=adapter, salt=CacheSalt(tenant=str(adapter)), **kw)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("workload", ["react", "mapreduce"])
def test_alora_prefills_the_context_once_and_generates_what_unshared_agents_do(tiny, workload,
                                                                               overlap):
    cfg, weights = tiny
    # Adapters strong enough that one agent's adapter over the context changes the others'
    # tokens (at 0.01 it does not, and a context computed under an adapter would pass).
    params = MultiLoraParams(workload, workflows=4, context=128, turns=2, gen=32, observation=8,
                             pause_s=0.0, kv_budget_gib=0.01, adapter_std=0.05)
    cpu = torch.device("cpu")
    backends = {s: build_backend(s, params, params.workflows, cfg, weights, cpu, torch.float32)
                for s in ("alora", "unified", "full_reuse", "no_lora")}
    backend = backends["alora"][0]
    backend.config = backend.config.replace(overlap=overlap)
    # The agents decode in the steady set: their steps reach the backend as columns.
    column_steps = []
    forward_rows = backend.runner.forward_rows
    backend.runner.forward_rows = lambda rows, plan, *rest: (
        column_steps.append(len(rows)), forward_rows(rows, plan, *rest))[1]
    runs = {s: run_system(s, params, *b) for s, b in backends.items()}
    alora = runs["alora"]
    assert sum(column_steps) >= alora.decode_tokens / 2
    # The context is prefilled once for all agents, as when every agent is the base model...
    assert alora.prefill_tokens == runs["no_lora"].prefill_tokens
    assert alora.prefill_tokens < runs["unified"].prefill_tokens / 2
    assert alora.prefix_hit_rate == pytest.approx(runs["no_lora"].prefix_hit_rate)
    assert alora.context_kv_per_agent_bytes == runs["no_lora"].context_kv_per_agent_bytes
    # ...and exactly: the same aLoRA agents, none reusing another's pages, generate the same.
    sizes = backends["alora"][1]
    alone = run_workload("alora", params, _Isolated(backend), sizes,
                         lambda i: backend.adapter_id(f"agent{i}"),
                         invocation=SPECS["alora"].invocation)
    assert alone.prefill_tokens >= params.workflows * params.context  # nothing was shared
    assert alora.outputs_sha256 == alone.outputs_sha256
    # Not vacuous: sharing one agent's adapted context with the others (full_reuse) shows.
    # (So does applying the aLoRAs from position 0 in the backend: checked by hand.)
    assert runs["full_reuse"].outputs_sha256 != runs["unified"].outputs_sha256


class FormsOpened(Engine):
    """Records the form of every session opened, in order."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self.forms: list[KVForm] = []

    def open(self, tokens, **kwargs):
        handle = super().open(tokens, **kwargs)
        node = self.node(handle.id, self.tip(handle.id))
        self.forms.append(self.kv.form_of(node.table, node.adapter))
        return handle


@pytest.mark.parametrize("workload", ["react", "mapreduce"])
def test_adaptive_runs_every_agent_under_contention_and_stays_merged_at_light_load(workload):
    """On the mock at the tiny shape, a base pool of 95 pages (mark 85.5): 8 agents of 38
    pages (3.6 marks merged) and 4 (1.8 marks) run in more waves than ``adaptive_split_waves``
    (1.5) allows but fit split (the context once): every agent splits and adaptive's batch
    reaches disaggregated's (issue 15 item 5: round 3 kept it at unified's). 3 agents (1.3
    marks) run merged in waves as unified does (round 10: no agent splits beside merged ones,
    none deadlocks waiting for its wave); 2 agents fit merged and stay merged."""
    from forkserve.backend.mock import MockBackend
    from forkserve.bench.multilora import tiny_config
    from forkserve.bench.multilora.workload import engine_config, page_bytes

    cfg = tiny_config()
    sizes = page_bytes(cfg, 16, 16, torch.float32)
    results, forms = {}, {}
    for w in (2, 3, 4, 8):
        params = MultiLoraParams(workload, workflows=w, context=512, turns=2, gen=32,
                                 observation=8, pause_s=0.0, residual_share=0.5,
                                 kv_budget_gib=190 * sizes["base"] / 2 ** 30)
        for system in ("unified", "disaggregated", "adaptive"):
            engine = FormsOpened(MockBackend(engine_config(SPECS[system], params, sizes, cfg)))
            results[w, system] = run_workload(system, params, engine, sizes,
                                              lambda i: f"agent{i}")
            forms[w, system] = set(engine.forms[:w])  # the agents' (mapreduce's reducer after)
            engine.check_integrity()
    batch = {key: r.mean_decode_batch for key, r in results.items()}
    assert batch[8, "unified"] < 0.8 * batch[8, "disaggregated"]  # contended: merged waits
    for w in (4, 8):
        assert forms[w, "adaptive"] == {KVForm.SPLIT}
        assert batch[w, "adaptive"] >= 0.95 * batch[w, "disaggregated"]
    # 95 pages hold two merged agents' reservations: the 3 ran in two merged waves.
    assert forms[3, "adaptive"] == {KVForm.MERGED} and batch[3, "adaptive"] <= 2
    assert forms[2, "adaptive"] == {KVForm.MERGED} and batch[2, "adaptive"] == batch[2, "unified"]


def test_every_system_names_the_quality_mode_it_runs_as():
    from forkserve.bench.multilora.systems import UnknownSystem, spec

    assert {s: SPECS[s].quality_mode() for s in SYSTEMS} == {
        "unified": "unified", "disaggregated": "disaggregated",
        "disaggregated_base": "base_activations", "adaptive": "disaggregated",
        "full_reuse": "full_reuse", "no_lora": "no_lora", "alora": "alora", "neutral": "neutral"}
    assert spec("recompute10").quality_mode(range(10)) == "recompute10"
    for bad in ("recompute0", "recompute", "fastest"):
        with pytest.raises(UnknownSystem, match="recompute<N>"):
            spec(bad)


@pytest.mark.parametrize("workload", ["react", "mapreduce"])
def test_recompute_of_every_layer_is_unified_and_neutral_adds_one_base_pass(tiny, workload):
    cfg, weights = tiny
    # Adapters strong enough that a reader of another adapter's base K/V generates otherwise.
    params = MultiLoraParams(workload, workflows=4, context=128, turns=2, gen=8, observation=8,
                             pause_s=0.0, kv_budget_gib=0.01, adapter_std=0.05)
    systems = ("unified", "disaggregated", "neutral", f"recompute{cfg.num_layers}")
    runs = {s: run_system(s, params, *build_backend(s, params, params.workflows, cfg, weights,
                                                      torch.device("cpu"), torch.float32))
            for s in systems}
    every = runs[f"recompute{cfg.num_layers}"]
    assert every.recompute_layers == tuple(range(cfg.num_layers))
    assert "quality_h200_drift.json" in every.notes[0]  # which profile chose the layers
    # Every layer exact per reader: unified's tokens; not vacuous, sharing the base changes them.
    assert every.outputs_sha256 == runs["unified"].outputs_sha256
    assert runs["disaggregated"].outputs_sha256 != runs["unified"].outputs_sha256
    # Every reader still runs its own forward over the context (its residual and own layers),
    # and holds the recomputed layers' K/V beside its residual: more than disaggregated.
    assert every.prefill_tokens == runs["disaggregated"].prefill_tokens
    assert every.context_kv_per_agent_bytes > runs["disaggregated"].context_kv_per_agent_bytes
    # Neutral: one base-model pass over the context, then every agent (agent 0 too) reads it.
    neutral, disaggregated = runs["neutral"], runs["disaggregated"]
    assert neutral.prefill_tokens == disaggregated.prefill_tokens + params.context
    assert neutral.prefix_hit_rate > disaggregated.prefix_hit_rate
    assert neutral.context_kv_per_agent_bytes == disaggregated.context_kv_per_agent_bytes


def test_recompute_layers_come_from_the_drift_profile_named(tiny, tmp_path):
    from forkserve.bench.multilora.recompute_choice import choose

    profile = tmp_path / "drift.json"
    profile.write_text(json.dumps({"adapter_writer": {"k": [0.0, 0.9], "v": [0.0, 0.7]}}))
    choice = choose(1, tiny[0].num_layers, profile)
    assert choice.layers == (1,) and "by drift.json" in choice.note()
    assert "read at this model's depth" not in choice.note()  # its own depth
    with pytest.raises(FileNotFoundError, match="--drift"):
        choose(1, 2, tmp_path / "missing.json")


def test_a_recompute_system_the_model_cannot_take_is_refused_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["react", "--tiny", "--systems", "unified", "recompute3", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "recompute3: recompute count must be an int in [0, 2]" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
