"""Typed errors of the torch backend.

Every check that can reject a request runs before any tensor is written, so each of
these errors leaves the backend (KV pools, adapter slots, counters) unchanged.
They subclass ValueError / KeyError so callers that only know the builtin types still
catch them.
"""
from __future__ import annotations

from forkserve import errors


class TorchBackendError(errors.ForkServeError):
    """Base class of every error raised by forkserve.backend.torch."""


class UnsupportedModelError(TorchBackendError, ValueError):
    """The checkpoint's architecture or a config option is not implemented."""


class CheckpointError(TorchBackendError, errors.ModelLoadError, ValueError):
    """A checkpoint folder or file that cannot be read: missing files or tensors, tensors of
    the wrong shape, a truncated file, a config.json that is not JSON. Names the file."""


class UnknownAdapterError(TorchBackendError, errors.UnknownAdapterError):
    """An adapter id or name that is not resident."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class AdapterFormatError(TorchBackendError, errors.ModelLoadError, ValueError):
    """A PEFT adapter folder that cannot be read (missing or truncated files, unsupported
    options)."""


class AdapterShapeError(TorchBackendError, ValueError):
    """An adapter whose shapes, rank or target modules do not fit the model or the stacks."""


class AdapterCapacityError(TorchBackendError, ValueError):
    """Every adapter slot is taken, or the name is already resident."""


class TokenOutOfVocabError(TorchBackendError, ValueError):
    """A token id outside [0, vocab_size)."""


class ContextLengthError(TorchBackendError, errors.ContextLengthError):
    """A sequence would grow past the model's context window."""


class InvalidWorkError(TorchBackendError, ValueError):
    """A work item whose pages do not cover its positions, or that names bad page ids."""
