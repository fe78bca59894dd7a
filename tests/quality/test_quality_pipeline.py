"""Tasks and splits on the real BFCL data; train -> evaluate -> report end to end on a tiny
random model (not SmolLM2) in every layout."""
import json

import pytest
from quality_testlib import needs_bfcl

pytestmark = needs_bfcl


def test_tasks_are_disjoint_and_splits_never_share_documentation():
    from benchmarks.quality.data import build_tasks, eval_rounds, training_examples

    tasks = build_tasks(heldout=40, seed=0)
    ids = [item.id for t in tasks for item in t.train + t.heldout]
    assert len(ids) == len(set(ids))
    for t in tasks:
        assert len(t.heldout) >= 40 and {i.category for i in t.train + t.heldout} == {t.name}
        assert not {i.doc_group for i in t.train} & {i.doc_group for i in t.heldout}
    assert build_tasks(heldout=40, seed=0) == tasks  # the seed fixes the split
    assert build_tasks(heldout=40, seed=1) != tasks
    rounds = eval_rounds(tasks, 10, distractors=4, seed=0)
    for r in rounds:
        assert len({e.system for e in r.examples}) == 1  # one shared catalog per round
        for e in r.examples:  # every agent's functions are documented in it
            assert all(f'"name": "{f["name"]}"' in e.system for f in e.item.functions)
    train_docs = {f["name"] for t in tasks for i in t.train for f in i.functions}
    for e in training_examples(tasks, 1, distractors=3, seed=0)[:20]:
        assert e.task == tasks[1].name and e.item in tasks[1].train
        assert e.system.count('"name": ') >= len(e.item.functions)
        assert all(f'"name": "{n}"' not in e.system for n in
                   {f["name"] for t in tasks for i in t.heldout for f in i.functions} - train_docs)


def test_train_evaluate_report_end_to_end(tiny, tmp_path):
    from benchmarks.quality import train, units
    from benchmarks.quality.evaluate import LAYOUTS, EvalParams, evaluate
    from benchmarks.quality.report import summaries, write_outputs

    out = tmp_path / "adapters"
    args = ["--model", str(tiny), "--out", str(out), "--device", "cpu", "--max-steps", "2",
            "--batch", "2", "--distractors", "1", "--heldout", "4", "--rank", "4", "--init",
            "random"]
    assert train.main(args) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert [t["task"] for t in log["tasks"]] == ["simple_python", "multiple", "parallel",
                                                 "live_simple"]
    saved = out / "parallel" / "adapter_model.safetensors"
    stamp = saved.stat().st_mtime_ns
    assert train.main(args) == 0 and saved.stat().st_mtime_ns == stamp  # resumed: nothing to train
    with pytest.raises(SystemExit, match="other parameters"):
        train.main(args[:-1] + ["peft"])
    other_split = list(args)
    other_split[other_split.index("--heldout") + 1] = "5"  # other training items, same params
    with pytest.raises(SystemExit, match="heldout 4"):
        train.main(other_split)

    params = EvalParams(rounds=2, distractors=1, max_new=6, heldout=4, block=1)
    folder, cache = tmp_path / "quality_test", tmp_path / "cache"
    # Two runs that add up: layouts split between them, the second also stopped by its deadline.
    first = evaluate(tiny, out, params, folder, cache, ("unified", "full_reuse"),
                     log=lambda m: None)
    # Mode by mode: the second unit of a mode reuses the first's backend (evaluate.ModeRun).
    assert [u.name for u in first] == ["unified.r000-001", "unified.r001-002",
                                       "full_reuse.r000-001", "full_reuse.r001-002"]
    assert evaluate(tiny, out, params, folder, cache, ("unified", "full_reuse")) == []  # resume
    said: list[str] = []
    assert evaluate(tiny, out, params, folder, cache, LAYOUTS, deadline_s=0.0,
                    log=said.append) == []
    assert said == [f"deadline: {2 * (len(LAYOUTS) - 2)} units left for the next run"]
    rest = evaluate(tiny, out, params, folder, cache, LAYOUTS, log=lambda m: None)
    assert len(rest) == 2 * (len(LAYOUTS) - 2)
    by = units.load(folder)
    k = len(params.categories)
    assert all(len(units.agents_of(us)) == params.rounds * k for us in by.values()
               if all(u.available for u in us))
    assert all(u.commit for us in by.values() for u in us)  # each unit names its source
    unified = {a.key: a for a in units.agents_of(by["unified"])}
    assert all(a.reused_tokens == 0 for a in unified.values())  # no sharing across adapters
    for layout in ("disaggregated", "full_reuse"):
        agents = units.agents_of(by[layout])
        readers = [a for a in agents if a.reused_tokens > 0]
        assert len(readers) == params.rounds * (k - 1)  # everyone but the writer reads its catalog
        assert all(len(a.layer_cos) == 3 and a.compared_tokens > 0 for a in readers)
        assert all(-1.0 <= c <= 1.0 + 1e-6 for a in readers for c in a.layer_cos)
        # the writer computes exactly what unified computes
        assert all(a.tokens == unified[a.key].tokens for a in agents if a.writer)
    # Random adapters change the model: another adapter's merged K/V is not this one's.
    assert min(c for a in units.agents_of(by["full_reuse"]) for c in a.layer_cos) < 0.9999
    # Disaggregated recomputes each reader's residual; full reuse skips the catalog entirely.
    prefill = {lay: sum(u.prefill_tokens for u in us) for lay, us in by.items()}
    assert prefill["disaggregated"] > prefill["full_reuse"]
    assert all(a.reused_tokens > 0 for a in units.agents_of(by["base_activations"]))
    # Neutral writer: every agent reads the base pass's pages, and the pass is prefill too.
    assert all(a.reused_tokens > 0 for a in units.agents_of(by["neutral"]))
    assert prefill["neutral"] > prefill["disaggregated"]
    # Offset correction: disaggregated's sharing, its tables fitted and costed beside it.
    for layout in ("offset0", "offset"):
        us = by[layout]
        assert all(u.setting["offset_fit"]["attention"] == "eager" for u in us)
        assert all(u.offset_table_bytes > 0 and u.extra_flops > 0 for u in us)
        agents = units.agents_of(us)
        assert len([a for a in agents if a.reused_tokens > 0]) == params.rounds * (k - 1)
        assert all(a.tokens == unified[a.key].tokens for a in agents if a.writer)
        assert prefill[layout] == prefill["disaggregated"]
    assert by["offset"][0].offset_table_bytes > by["offset0"][0].offset_table_bytes
    # Recompute modes without a drift profile are reported, not guessed.
    assert not by["recompute5"][0].available and "--drift" in by["recompute5"][0].note

    table = write_outputs(folder, "smoke")
    saved = json.loads((tmp_path / "quality_test.json").read_text())
    rows = {s["layout"]: s for s in saved["summaries"]}
    assert list(rows) == list(LAYOUTS)
    assert rows["unified"]["paired"] is None and rows["unified"]["readers"] == 0
    full = rows["full_reuse"]["paired"]
    assert full["delta_f1"]["n"] == params.rounds * (k - 1) and full["delta_f1"]["clusters"] == 2
    assert full["delta_f1"]["low"] <= full["delta_f1"]["mean"] <= full["delta_f1"]["high"]
    assert (tmp_path / "quality_test.png").stat().st_size > 0
    assert "| disaggregated | 2 | 8 |" in table
    assert (tmp_path / "quality_test.md").read_text().strip() == table

    # Recompute: the profile's most drifting layer; every layer recomputed answers as unified.
    from benchmarks.quality import drift
    from forkserve.bench.multilora.recompute_choice import load_drift
    from forkserve.control.recompute_policy import most_drifting

    drift.run(tiny, out, params, tmp_path, "test", rounds=1)
    profile_path = tmp_path / "quality_test_drift.json"
    evaluate(tiny, out, params, folder, cache, ("recompute1", "recompute3"), log=lambda m: None,
             drift=profile_path)
    by = units.load(folder)
    assert by["recompute1"][0].recompute_layers == most_drifting(load_drift(profile_path), 1)
    assert all(a.tokens == unified[a.key].tokens for a in units.agents_of(by["recompute3"]))
    kv = {lay: sum(u.context_kv_bytes for u in us) for lay, us in by.items()}
    assert kv["full_reuse"] < kv["disaggregated"] == kv["neutral"] < kv["recompute1"] \
        < kv["recompute3"]
    assert kv["disaggregated"] < kv["unified"] == k * kv["full_reuse"]
    rows = {s.layout: s for s in summaries(by)}
    assert rows["recompute3"].paired.identical.mean == 1.0
    assert "recompute1" in write_outputs(folder, "smoke")

    # A reused backend answers as a fresh one: round 1 of disaggregated again, built anew.
    from benchmarks.quality import evaluate as ev

    inputs = ev.load_inputs(tiny, out, params)
    config = units.find(folder, "disaggregated", 1, 2, by["disaggregated"][1].setting).setting
    fresh, _ = ev.run_unit("disaggregated", 1, 2, inputs, params, config, None)
    assert [a.tokens for a in fresh.agents] == [a.tokens for a in by["disaggregated"][1].agents]
    assert fresh.prefill_tokens == by["disaggregated"][1].prefill_tokens

    # --jobs: the modes in worker processes, their units in one folder, one report.
    argv = ["--model", str(tiny), "--adapters", str(out), "--device", "cpu", "--results",
            str(tmp_path), "--tag", "jobs", "--rounds", "2", "--block", "1", "--end", "1",
            "--distractors", "1", "--max-new", "6", "--heldout", "4", "--no-hidden", "--layouts",
            "unified,full_reuse,no_lora",
            "--jobs", "2"]
    assert ev.main(argv) == 0
    jobs = units.load(tmp_path / "quality_jobs")
    assert sorted(jobs) == ["full_reuse", "no_lora", "unified"]
    assert [a.tokens for a in jobs["unified"][0].agents] == \
        [a.tokens for a in by["unified"][0].agents]
    assert (tmp_path / "quality_jobs.md").exists()

    # Another setting never lands among these units.
    with pytest.raises(ValueError, match="another setting"):
        evaluate(tiny, out, EvalParams(rounds=2, distractors=1, max_new=7, heldout=4, block=1),
                 folder, cache, ("unified",))
