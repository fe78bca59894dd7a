"""Reading checkpoint files so that every failure names the file.

The libraries underneath raise their own types with messages that omit the path
(``SafetensorError: incomplete metadata, file not fully covered``, ``JSONDecodeError``);
a user with several model and adapter folders cannot tell which one is broken. These
helpers turn each failure into the caller's ``ModelLoadError`` subtype, path first.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, TypeVar

from forkserve.errors import ForkServeError, ModelLoadError

T = TypeVar("T")


def read_json_object(path: Path, error: type[ModelLoadError]) -> dict[str, Any]:
    """A JSON file that must hold one object (config.json, adapter_config.json, index.json)."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise error(f"{path} does not exist") from e
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path} cannot be read: {e}") from e
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def reading(path: Path, error: type[ModelLoadError], fn: Callable[[], T]) -> T:
    """Run ``fn`` (which reads ``path``: safetensors, GGUF); a read failure names the file.

    Errors that are already typed pass through unchanged (they carry their own message)."""
    from safetensors import SafetensorError

    try:
        return fn()
    except ForkServeError:
        raise
    except FileNotFoundError as e:
        raise error(f"{path} does not exist") from e
    except (SafetensorError, OSError, ValueError, IndexError, EOFError) as e:
        # A SafetensorError or GGUF ValueError here means a short or corrupt file: the
        # usual cause is an interrupted download or copy.
        raise error(f"{path} cannot be read; it may be truncated or corrupt ({e})") from e
