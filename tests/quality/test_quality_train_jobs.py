"""train.py --jobs on the tiny random model: the tasks trained in worker processes are the
adapters the sequential run trains, only the parent writes train_log.json, and a failed worker
is reported by task without losing the others' adapters."""
import json
from pathlib import Path

import pytest
import torch
from quality_testlib import needs_bfcl

pytestmark = needs_bfcl
TASKS = ["simple_python", "multiple"]  # two tasks: one round of two workers


@pytest.fixture(autouse=True)
def one_thread():
    """The in-process runs on one thread, as each of two workers on a 2-core runner: two
    threads on a busy runner spin against each other (3 steps: 15 s instead of 1.5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(tiny, out, *extra):
    from benchmarks.quality import train

    return train.main(["--model", str(tiny), "--out", str(out), "--device", "cpu",
                       "--categories", ",".join(TASKS), "--max-steps", "3", "--batch", "2",
                       "--distractors", "1", "--heldout", "4", "--rank", "4", *extra])


def _tasks(out):
    return json.loads((out / "train_log.json").read_text())["tasks"]


def test_jobs_2_trains_the_adapters_jobs_1_trains(tiny, tmp_path):
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    assert _train(tiny, one) == 0
    assert _train(tiny, two, "--jobs", "2") == 0
    for task in TASKS:
        a = load_file(one / task / "adapter_model.safetensors")
        b = load_file(two / task / "adapter_model.safetensors")
        assert a.keys() == b.keys()
        for k in a:  # not bitwise: the workers' share of the cores sums in another order
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7)
        assert not all(torch.equal(v, torch.zeros_like(v)) for v in a.values())  # B trained
    logs = [{t["task"]: (t["first_loss"], t["last_loss"]) for t in _tasks(out)}
            for out in (one, two)]
    assert logs[1] == {task: pytest.approx(losses, rel=1e-5) for task, losses in logs[0].items()}
    assert [t["task"] for t in _tasks(two)] == TASKS


def test_a_failed_worker_is_named_and_the_others_are_kept(tiny, tmp_path, capsys):
    out = tmp_path / "adapters"
    out.mkdir()
    (out / "multiple").write_text("a file where the adapter folder goes")  # its save fails
    assert _train(tiny, out, "--jobs", "2") == 1
    err = capsys.readouterr().err
    assert "task multiple: its worker exited with 1" in err and "failed: multiple" in err
    assert "Traceback" in err or "Error" in err  # the worker's own stderr, not just its code
    assert [t["task"] for t in _tasks(out)] == ["simple_python"]
    saved = out / "simple_python" / "adapter_model.safetensors"
    stamp = saved.stat().st_mtime_ns
    (out / "multiple").unlink()
    assert _train(tiny, out, "--jobs", "2") == 0  # resumes: only the failed task trains
    assert saved.stat().st_mtime_ns == stamp and [t["task"] for t in _tasks(out)] == TASKS


def test_a_task_whose_items_do_not_fit_max_len_is_refused_not_drawn_forever(tiny):
    from benchmarks.quality import train
    from benchmarks.quality.data import build_tasks

    tokenizer = train.load_base(tiny, torch.device("cpu"))[1]
    params = train.TrainParams(batch=2, max_len=8, distractors=0)
    tasks = build_tasks(TASKS, 4, 0)
    with pytest.raises(ValueError, match=r"simple_python: 0 of \d+ training items fit in "):
        next(train.batches(tokenizer, tasks, 0, params))


def test_a_worker_ends_with_its_parent(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from benchmarks.quality import train

    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from benchmarks.quality import train\n"
        "child = 'from benchmarks.quality import train; train.die_with_parent(); "
        "import time; time.sleep(120)'\n"
        "p = subprocess.Popen([sys.executable, '-c', child], env=train.worker_env(1))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=train.worker_env(1))  # benchmarks.quality importable
    worker = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)  # killed alone, as a device call's limit would not
    parent.wait()

    def running() -> bool:  # a zombie nobody reaps (no init in a container) has ended too
        try:
            return "\nState:\tZ" not in Path(f"/proc/{worker}/status").read_text()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 90
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(), "the worker outlived its parent"
