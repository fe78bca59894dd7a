"""evaluate.py --jobs: how the modes are shared among worker processes."""
import pytest

from benchmarks.quality import evaluate, modes


def test_every_mode_runs_once_and_the_offset_modes_go_to_different_workers():
    layouts = list(modes.DEFAULT) + list(modes.ALORA)
    groups = evaluate.partition(layouts, 4)
    assert len(groups) == 4
    assert sorted(x for g in groups for x in g) == sorted(layouts)
    heavy = [g for g in groups if any(modes.mode(x).corrects for x in g)]
    assert len(heavy) == 2 and all(sum(modes.mode(x).corrects for x in g) == 1 for g in heavy)
    for g in groups:  # in the order evaluate runs them: the reference first
        assert g == sorted(g, key=modes.order_key)


def test_more_jobs_than_modes_start_one_worker_per_mode():
    assert evaluate.partition(["unified", "disaggregated"], 8) == [["unified"],
                                                                   ["disaggregated"]]


def test_with_hidden_states_the_references_run_before_the_modes_that_read_them(monkeypatch):
    started: list[list[str]] = []
    waited: list[int] = []

    class Worker:
        def __init__(self, command, env):
            assert env["OMP_NUM_THREADS"]
            started.append(command)

        def wait(self):
            waited.append(len(started))
            return 0

    monkeypatch.setattr(evaluate.subprocess, "Popen", Worker)
    layouts = ["unified", "disaggregated", "alora_unified", "alora", "full_reuse"]
    assert evaluate.run_jobs(["--tag", "t"], layouts, 4, True, 300.0) == 0
    groups = [c[c.index("--layouts") + 1] for c in started]
    assert sorted(groups[:2]) == ["alora_unified", "unified"]  # the first phase
    assert waited[:2] == [2, 2]  # both waited for before the second phase starts
    assert sorted(",".join(groups[2:]).split(",")) == ["alora", "disaggregated", "full_reuse"]
    # The second phase gets what is left of the deadline (argparse keeps the last one).
    assert all(c[c.index("--deadline-s") + 1] in ("300", "299") for c in started)
    started.clear()
    assert evaluate.run_jobs(["--tag", "t"], layouts, 4, False, None) == 0
    assert len(started) == 4 and all("--deadline-s" not in c for c in started)


def test_an_unknown_mode_or_nothing_to_run_is_refused(capsys):
    with pytest.raises(ValueError):
        evaluate.main(["--jobs", "2", "--no-hidden", "--model", "m.gguf", "--layouts", "nope"])
    with pytest.raises(SystemExit):
        evaluate.main(["--model", "m.gguf"])
    assert "nothing to run" in capsys.readouterr().err
