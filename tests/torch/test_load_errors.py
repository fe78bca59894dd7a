"""Broken checkpoints on disk raise a typed ModelLoadError that names the file at fault
(truncated safetensors / GGUF, config.json that is not JSON or lacks a field, missing files)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from forkserve.backend.torch import load_model
from forkserve.backend.torch.lora import load_peft_adapter
from forkserve.errors import ModelLoadError


def load(path: Path) -> None:
    load_model(path, torch.device("cpu"), torch.float32)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.5, 0.001])  # in the tensor data; inside the header
def test_truncated_safetensors_names_the_file(models, tmp_path, keep):
    folder = copy(models["llama"], tmp_path / "m")
    truncate(folder / "model.safetensors", keep)
    with pytest.raises(ModelLoadError, match="model.safetensors.*truncated"):
        load(folder)


@pytest.mark.parametrize("text,match", [("{\"model_type\": \"llama\",", "not valid JSON"),
                                        ("[1, 2]", "JSON object"),
                                        ("{\"model_type\": \"llama\"}", "lacks the field"),
                                        ("{\"model_type\": \"llama\", \"num_attention_heads\": "
                                         "\"four\"}",
                                         "invalid value")])
def test_broken_config_json_names_the_file(models, tmp_path, text, match):
    folder = copy(models["llama"], tmp_path / "m")
    (folder / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=match) as e:
        load(folder)
    assert str(folder / "config.json") in str(e.value)


def test_missing_paths_say_so(models, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(tmp_path)
    folder = copy(models["llama_sharded_tied"], tmp_path / "sharded")
    shard = max(folder.glob("model-*.safetensors"))
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"do not exist: {shard}"):
        load(folder)


def test_broken_adapters_name_the_file(adapters, tmp_path):
    truncated = copy(adapters["qkvo"], tmp_path / "truncated")
    truncate(truncated / "adapter_model.safetensors", 0.5)
    with pytest.raises(ModelLoadError,
                       match=f"{truncated / 'adapter_model.safetensors'}.*truncated"):
        load_peft_adapter(truncated)
    not_json = copy(adapters["qkvo"], tmp_path / "not_json")
    (not_json / "adapter_config.json").write_text("{")
    with pytest.raises(ModelLoadError,
                       match=f"{not_json / 'adapter_config.json'} is not valid JSON"):
        load_peft_adapter(not_json)
    no_rank = copy(adapters["qkvo"], tmp_path / "no_rank")
    cfg = json.loads((no_rank / "adapter_config.json").read_text())
    del cfg["r"]
    (no_rank / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="adapter_config.json"):
        load_peft_adapter(no_rank)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_peft_adapter(tmp_path / "nowhere")


def test_corrupt_gguf_names_the_file(tmp_path):
    pytest.importorskip("gguf")
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ModelLoadError, match=f"{path}.*truncated"):
        load(path)


def test_loading_shows_a_bar_on_a_terminal_only(models, capsys, monkeypatch):
    """A layer-by-layer bar while the weights load, where stderr is a terminal; none in a
    log (what a server under a process manager, or this test's capture, writes to)."""
    import sys

    load(models["llama"])
    assert "loading weights" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    load(models["llama"])
    assert "loading weights" in capsys.readouterr().err
