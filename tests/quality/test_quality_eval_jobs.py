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


def test_jobs_with_hidden_states_or_an_unknown_mode_are_refused(capsys):
    with pytest.raises(SystemExit):
        evaluate.main(["--jobs", "2", "--model", "m.gguf"])
    assert "--jobs needs --no-hidden" in capsys.readouterr().err
    with pytest.raises(ValueError):
        evaluate.main(["--jobs", "2", "--no-hidden", "--model", "m.gguf", "--layouts", "nope"])
