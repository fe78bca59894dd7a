"""Checks of ``forkserve serve``'s flags that run before the model loads.

Loading a model takes seconds to minutes; a mistyped path, an adapter folder that is not
a PEFT adapter, a port already in use or a CUDA device on a CPU-only build must be
reported before that, in one line (``UsageError``), not after it as a traceback. The
content of the files (truncated tensors, broken JSON) is the loaders' to judge: they raise
a ``ModelLoadError`` that names the file.
"""
from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Sequence

from forkserve.interfaces.usage import UsageError

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what the LoRA loader reads


def check_model_path(path: str | Path) -> None:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--model {path} does not exist")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UsageError(f"--model {path} has no config.json (an HF model folder holds "
                             "config.json, *.safetensors and the tokenizer files)")
    elif p.suffix != ".gguf":
        raise UsageError(f"--model {path} is neither an HF model folder nor a .gguf file")


def check_adapters(loras: Sequence[tuple[str, str]], model_name: str) -> None:
    seen: set[str] = set()
    for name, path in loras:
        if name in seen:
            raise UsageError(f"--lora {name}=... is given twice")
        if name == model_name:
            raise UsageError(f"--lora {name}=...: {name!r} is the base model's name; name the "
                             "adapter otherwise")
        seen.add(name)
        p = Path(path)
        if not p.exists():
            raise UsageError(f"--lora {name}={path}: {path} does not exist")
        missing = [f for f in PEFT_FILES if not (p / f).is_file()]
        if missing:
            raise UsageError(f"--lora {name}={path} is not a PEFT LoRA adapter folder (no "
                             f"{', '.join(missing)})")


def bind_port(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: a port in use is reported before the model
    loads, and the server then serves on this very socket, so no other process can take
    the port in between. It listens at once: a client that connects during the load
    waits in the backlog instead of being refused."""
    # The address family as uvicorn picks it: IPv6 only for an IPv6 literal.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    # as uvicorn: a port in TIME_WAIT is free
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        reason = ("is already in use" if e.errno == errno.EADDRINUSE
                  else f"cannot be bound ({e.strerror})")
        raise UsageError(f"port {port} on {host} {reason}; choose another with --port") from None
    sock.listen()
    return sock


def check_device(device: str | None) -> None:
    """A device torch knows, and CUDA only where this build and machine have it."""
    if device is None:
        return  # the backend picks cuda when available, else cpu
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise UsageError(f"--device {device}: {why} (torch {torch.__version__}); use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are "
                         "visible")
