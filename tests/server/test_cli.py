"""`forkserve serve` with bad flags and paths: one line on stderr and exit status 2, before the
model loads; a checkpoint the loaders refuse is one line too; Ctrl-C exits without a traceback."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from forkserve.interfaces.cli import main

REPO = Path(__file__).resolve().parents[2]


def run_cli(capsys, *argv: str) -> str:
    """main(argv) must return 2 with exactly one line on stderr, which is returned."""
    assert main(["serve", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("forkserve serve: error: "), err
    return err


@pytest.fixture
def model_path(tiny_model_dir) -> Path:
    return tiny_model_dir[0]


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent/model"], "--model /nonexistent/model does not exist"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--lora", "no-equals-sign"], "takes NAME=PATH"),
    (["--port", "99999"], "TCP port"),
    (["--num-pages", "0"], "positive integer"),
])
def test_bad_flags_are_one_line(capsys, argv, message):
    assert message in run_cli(capsys, *argv)


def test_bad_model_paths_are_one_line(capsys, tmp_path):
    assert "has no config.json" in run_cli(capsys, "--model", tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "neither an HF model folder nor a .gguf" in run_cli(capsys, "--model",
                                                              tmp_path / "weights.bin")


def test_bad_adapters_are_one_line(capsys, model_path, tiny_model_dir, tmp_path):
    planner = tiny_model_dir[1]["planner"]
    assert "/nonexistent does not exist" in run_cli(capsys, "--model", model_path, "--lora",
                                                    "a=/nonexistent")
    assert "not a PEFT LoRA adapter folder (no adapter_config.json" in \
        run_cli(capsys, "--model", model_path, "--lora", f"a={tmp_path}")
    assert "given twice" in run_cli(capsys, "--model", model_path, "--lora", f"a={planner}",
                                    "--lora", f"a={planner}")


def test_port_in_use_is_found_before_the_model_loads(capsys, model_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"port {port} on 127.0.0.1 is already in use" in run_cli(capsys, "--model",
                                                                        model_path, "--port", port)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_machine_is_one_line(capsys, model_path):
    assert "--device cuda:" in run_cli(capsys, "--model", model_path, "--port", 0, "--device",
                                       "cuda")


def test_a_truncated_checkpoint_is_one_line_naming_the_file(capsys, model_path, tmp_path):
    broken = Path(shutil.copytree(model_path, tmp_path / "broken"))
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["serve", "--model", str(broken), "--port", "0", "--device", "cpu", "--log-level",
                 "warning"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{weights} cannot be read" in err, err


def cli_process(*argv: str) -> subprocess.Popen:
    # Ctrl-C raises KeyboardInterrupt in the child whatever the test runner's disposition of
    # SIGINT is (a child inherits an ignored SIGINT, and Python then installs no handler).
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"from forkserve.interfaces.cli import main; sys.exit(main({list(argv)!r}))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_usage_errors_load_nothing_heavy():
    code = ("import sys; from forkserve.interfaces.cli import main; "
            "rc = main(['serve', '--model', '/nonexistent']); "
            "sys.exit(rc if 'torch' not in sys.modules else 99)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


def test_ctrl_c_stops_the_server_without_a_traceback(model_path):
    proc = cli_process("serve", "--model", str(model_path), "--port", "0", "--device", "cpu",
                       "--dtype", "float32", "--attention", "eager")
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:  # the server logs when it is up: wait on that line, not on a sleep
        for line in proc.stderr:
            lines.append(line)
            if "Application startup complete" in line:
                started.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "".join(lines)
        port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json() == {"status": "ok"}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    reader.join(timeout=10)
    err = "".join(lines)
    assert "Traceback" not in err and err.rstrip().endswith("forkserve serve: interrupted"), err
