"""A GGUF's Hugging Face copies, each made once and read by every later load that needs it.

``hf_copy``: the float32 model (safetensors, config, tokenizer), for the loads that need a
Hugging Face folder: training
(benchmarks/quality/train.py: transformers dequantizes a GGUF and rebuilds its tokenizer in
Python, which took 101 s in each of train.py's ``--jobs`` workers on the H200
(Qwen2.5-Coder-0.5B), where loading the copy takes seconds) and plain vLLM in
``bench/fanout_scored.py`` (vLLM 0.26 cannot read a GGUF at all). The copy's config has no
``quantization_config``: its weights are dequantized already.

``tokenizer_copy``: the tokenizer alone (3.5 MB for SmolLM2), for every load of a GGUF
(``Tokenizer.load``): transformers builds a GGUF's tokenizer by parsing the whole file's
metadata in Python and converting its vocabulary, 4-7 s for SmolLM2's 49K tokens at each
server start, where the saved copy loads in 0.1 s.

Ownership and lifetime: a copy is a cache that this module alone names, writes and deletes.
It lies beside the GGUF (``m.gguf`` -> ``m.gguf.hf-<key>/``, ``m.gguf.tokenizer-<key>/``)
when that folder is writable, else under ``$XDG_CACHE_HOME/forkserve/gguf-hf/`` (default
``~/.cache``). The key changes with the GGUF's size and modification time and with the
transformers version (which does the converting), so a rewritten GGUF is never served an
old copy; making a new copy deletes the GGUF's stale ones of that kind. A copy appears whole
or not at all: it is written to a temporary folder and renamed into place, so a killed run
leaves no folder that a later one trusts, and a reader never sees one being written.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch


def hf_copy(gguf: Path) -> Path:
    """The folder of ``gguf``'s model copy, made first if there is none for its current
    contents."""
    return _copy(gguf, "hf", _convert)


def tokenizer_copy(gguf: Path) -> Path:
    """The folder of ``gguf``'s tokenizer copy, made first if there is none for its current
    contents."""
    return _copy(gguf, "tokenizer", _convert_tokenizer)


def _copy(gguf: Path, kind: str, convert: Callable[[Path, Path], None]) -> Path:
    """The folder of ``gguf``'s copy of ``kind``, written by ``convert`` if there is none."""
    root, prefix = _location(gguf, kind)
    final = root / f"{prefix}{_key(gguf)}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}tmp{os.getpid()}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp's folder is private; the copy is as readable as the GGUF
    try:
        convert(gguf, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process renamed its copy of the same GGUF first: the same bytes.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale(root, prefix, final)
    return final


def _location(gguf: Path, kind: str) -> tuple[Path, str]:
    """(folder, name prefix) of ``gguf``'s copies of ``kind``."""
    if os.access(gguf.parent, os.W_OK):
        return gguf.parent, f"{gguf.name}.{kind}-"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    # GGUFs of one name in different folders share this one: the path tells them apart.
    where = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:8]
    return cache / "forkserve" / "gguf-hf", f"{gguf.name}-{where}.{kind}-"


def _key(gguf: Path) -> str:
    """What a copy depends on. Size and modification time rather than a content hash: hashing
    Qwen's 491 MB would cost each worker a second or more, and the way a GGUF gets replaced
    (h200_quality.sh's ``setup`` joins its parts into it again) changes the time anyway."""
    import transformers

    st = gguf.stat()
    text = f"{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _convert(gguf: Path, folder: Path) -> None:
    """Writes ``gguf`` dequantized to float32 into ``folder`` as a Hugging Face model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    cfg = loaded.config
    del cfg.quantization_config  # the weights are dequantized already; PEFT rejects the flag
    net = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    net.load_state_dict(loaded.state_dict())
    net.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(folder)


def _convert_tokenizer(gguf: Path, folder: Path) -> None:
    """Writes ``gguf``'s tokenizer into ``folder`` as a Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                  local_files_only=True).save_pretrained(folder)


def _remove_stale(root: Path, prefix: str, keep: Path) -> None:
    """Deletes the GGUF's copies of other keys (a copy takes 4 bytes a parameter: 2 GB for
    Qwen) and the temporary folders of runs killed while converting."""
    for path in root.glob(f"{prefix}*"):
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(f".{prefix}tmp*-*"):
        owner = path.name[len(f".{prefix}tmp"):].partition("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
