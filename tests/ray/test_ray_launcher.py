"""``forkserve serve --replicas 1`` as a user runs it: up on loopback, then Ctrl-C."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from server_testlib import save_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ctrl_c_ends_a_replicas_server_cleanly(tmp_path: Path) -> None:
    path, _ = save_model(tmp_path)
    port = _free_port()
    cmd = [sys.executable, "-m", "forkserve.interfaces.cli", "serve", "--replicas", "1",
           "--model", str(path), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--dtype", "float32",
           "--attention", "eager", "--no-cuda-graphs", "--num-pages", "64", "--page-size", "4",
           "--cpus-per-replica", "0.5", "--torch-threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_the_sharing_flags_reach_the_replicas_and_a_bad_report_is_one_line(
        tmp_path: Path, capsys) -> None:
    from forkserve.config import ShareBase
    from forkserve.interfaces.cli import main
    from forkserve.interfaces.ray_serve.engine_replica import ReplicaSpec

    assert ReplicaSpec(model_path="m", share_base="exact").config().share_base is ShareBase.EXACT
    path, _ = save_model(tmp_path)
    capsys.readouterr()  # the model writer's progress bar
    argv = ["serve", "--replicas", "1", "--model", str(path), "--layout", "disaggregated",
            "--quality-report", str(tmp_path / "missing.json")]
    assert main(argv) == 2  # before Ray starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--quality-report" in err and "does not exist" in err, err
