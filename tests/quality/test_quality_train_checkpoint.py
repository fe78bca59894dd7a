"""train.py --checkpoint-every on the tiny random model: a task cut after some steps continues
from its last checkpoint to the adapter and losses of an uninterrupted run, bit for bit (plain
LoRA and aLoRA), in a worker of --jobs too; a checkpoint of other parameters is refused; a
finished task leaves none."""
import json

import pytest
import torch
from quality_testlib import needs_bfcl

pytestmark = needs_bfcl
TASK = "simple_python"
STEPS = 6


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, so that both runs of a comparison sum in the same order (and fast)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Killed(Exception):
    """Stands for the device call's timeout: the run ends in the middle of a step."""


def _train(tiny, out, *extra):
    from benchmarks.quality import train

    return train.main(["--model", str(tiny), "--out", str(out), "--device", "cpu",
                       "--categories", TASK, "--max-steps", str(STEPS), "--batch", "2",
                       "--distractors", "1", "--heldout", "4", "--rank", "4",
                       "--checkpoint-every", "2", *extra])


def _killed_in_step(tiny, out, monkeypatch, step, *extra):
    """Runs until ``step`` (1-based) is in its forward, then ends as a killed run would."""
    from benchmarks.quality import train

    real = train.backward_answer_loss
    calls = []

    def dies(*args, **kw):
        calls.append(1)
        if len(calls) == step:
            raise Killed
        return real(*args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(train, "backward_answer_loss", dies)
        with pytest.raises(Killed):
            _train(tiny, out, *extra)


def _log(out):
    (task,) = json.loads((out / "train_log.json").read_text())["tasks"]
    return task


def _adapter(out):
    from safetensors.torch import load_file

    return load_file(out / TASK / "adapter_model.safetensors")


@pytest.mark.parametrize("alora", [False, True], ids=["lora", "alora"])
def test_a_run_cut_midway_continues_to_the_uninterrupted_adapter(tiny, tmp_path, monkeypatch,
                                                                 alora):
    flags = ["--alora"] if alora else []
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert _train(tiny, whole, *flags) == 0
    # Killed in step 4: step 3 is lost with it, the checkpoint after step 2 is kept.
    _killed_in_step(tiny, cut, monkeypatch, 4, *flags)
    assert (cut / TASK / "checkpoint.pt").exists() and not (cut / "train_log.json").exists()
    assert _train(tiny, cut, *flags) == 0
    a, b = _adapter(whole), _adapter(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(v, torch.zeros_like(v)) for v in a.values())  # B trained
    first, second = _log(whole), _log(cut)
    assert first["resumed_from_step"] == 0 and second["resumed_from_step"] == 2
    for field in ("losses", "first_loss", "last_loss", "skipped_steps"):
        assert second[field] == first[field], field
    assert len(second["losses"]) == STEPS
    assert not (cut / TASK / "checkpoint.pt").exists()  # a finished task drops its checkpoint


def test_a_checkpoint_of_other_parameters_is_refused(tiny, tmp_path, monkeypatch):
    _killed_in_step(tiny, tmp_path, monkeypatch, 3)
    with pytest.raises(SystemExit, match=rf"{tmp_path / TASK} holds a checkpoint of training "
                                         rf"with other parameters"):
        _train(tiny, tmp_path, "--lr", "1e-3")
    assert (tmp_path / TASK / "checkpoint.pt").exists()  # kept: the right run can still use it


def test_a_worker_of_jobs_continues_its_task(tiny, tmp_path, monkeypatch):
    other = "multiple"
    _killed_in_step(tiny, tmp_path, monkeypatch, 4, "--categories", f"{TASK},{other}")
    assert _train(tiny, tmp_path, "--categories", f"{TASK},{other}", "--jobs", "2") == 0
    tasks = json.loads((tmp_path / "train_log.json").read_text())["tasks"]
    assert {t["task"]: t["resumed_from_step"] for t in tasks} == {TASK: 2, other: 0}
    assert not list(tmp_path.glob("*/checkpoint.pt*"))


def test_checkpoint_every_0_writes_none(tiny, tmp_path, monkeypatch):
    _killed_in_step(tiny, tmp_path, monkeypatch, 5, "--checkpoint-every", "0")
    assert not (tmp_path / TASK / "checkpoint.pt").exists()
