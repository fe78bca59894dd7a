"""Tasks and splits on the real BFCL data; train -> evaluate -> report end to end on a tiny
random model (not SmolLM2) in every layout."""
import json

import pytest

from quality_testlib import needs_bfcl, tiny_model

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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from benchmarks.quality.data import DEFAULT_CATEGORIES, load_category, system_message, target_text

    items = [i for c in DEFAULT_CATEGORIES for i in load_category(c)[:60]]
    texts = [system_message(i.functions) + i.question + target_text(i) for i in items]
    return tiny_model(tmp_path_factory.mktemp("tiny_quality"), texts)


def test_train_evaluate_report_end_to_end(tiny, tmp_path):
    from benchmarks.quality import train
    from benchmarks.quality.evaluate import LAYOUTS, EvalParams, evaluate
    from benchmarks.quality.report import write_outputs

    out = tmp_path / "adapters"
    assert train.main(["--model", str(tiny), "--out", str(out), "--device", "cpu", "--max-steps", "2",
                       "--batch", "2", "--distractors", "1", "--heldout", "4", "--rank", "4", "--init", "random"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert [t["task"] for t in log["tasks"]] == ["simple_python", "multiple", "parallel", "live_simple"]

    params = EvalParams(rounds=2, distractors=1, max_new=6, heldout=4)
    results = evaluate(tiny, out, params, LAYOUTS, progress=False)
    by = {r.layout: r for r in results}
    k = len(params.categories)
    for r in results:
        if r.available:
            assert len(r.agents) == params.rounds * k
    unified = by["unified"]
    assert all(a.reused_tokens == 0 for a in unified.agents)  # no sharing across adapters
    for layout in ("disaggregated", "full_reuse"):
        readers = [a for a in by[layout].agents if a.reused_tokens > 0]
        assert len(readers) == params.rounds * (k - 1)  # everyone but the writer reads its catalog
        assert all(len(a.layer_cos) == 3 and a.compared_tokens > 0 for a in readers)
        assert all(-1.0 <= c <= 1.0 + 1e-6 for a in readers for c in a.layer_cos)
        writers = [a for a in by[layout].agents if a.writer]
        assert all(a.tokens == next(u.tokens for u in unified.agents if (u.round, u.task) == (a.round, a.task))
                   for a in writers)  # the writer computes exactly what unified computes
    # Random adapters change the model: another adapter's merged K/V is not this one's.
    assert min(c for a in by["full_reuse"].agents for c in a.layer_cos) < 0.9999
    # Disaggregated recomputes each reader's residual; full reuse skips the catalog entirely.
    assert by["disaggregated"].prefill_tokens > by["full_reuse"].prefill_tokens
    if by["base_activations"].available:
        assert all(a.reused_tokens > 0 for a in by["base_activations"].agents)
    else:
        assert "prefill_shared" in by["base_activations"].note

    table = write_outputs(results, params, "tiny", out, "smoke", tmp_path / "quality_test")
    saved = json.loads((tmp_path / "quality_test.json").read_text())
    assert [s["layout"] for s in saved["summaries"]] == list(LAYOUTS)
    assert saved["summaries"][0]["agreement"] == 1.0
    assert (tmp_path / "quality_test.png").stat().st_size > 0
    assert "| disaggregated |" in table and (tmp_path / "quality_test.md").read_text().strip() == table
