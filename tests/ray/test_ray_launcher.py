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
