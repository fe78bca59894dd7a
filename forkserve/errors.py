"""Typed errors. Every public verb validates before it mutates, so raising one of these
leaves the engine exactly as it was. ``http_status`` lets the server map them to 4xx."""
from __future__ import annotations


class ForkServeError(Exception):
    """``seq_ids``: the work items (``SeqWork.seq_id``) a backend error is attributable to;
    the Stepper fails those items alone and runs the rest of the step (empty: unknown)."""

    http_status = 400

    def __init__(self, *args: object, seq_ids: tuple[int, ...] = ()) -> None:
        super().__init__(*args)
        self.seq_ids = tuple(seq_ids)


class InvalidRequestError(ForkServeError, ValueError):
    """Malformed arguments: empty token list, negative budget, token out of vocabulary."""


class UnknownSessionError(ForkServeError, KeyError):
    http_status = 404

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown session"


class UnknownNodeError(ForkServeError, KeyError):
    http_status = 404

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown node"


class UnknownAdapterError(ForkServeError, KeyError):
    """An adapter id the backend does not hold."""

    http_status = 404

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown adapter"


class InvalidStateError(ForkServeError):
    """The verb is not allowed in the node's state (commit of an aborted node, double commit)."""

    http_status = 409


class BranchCapError(ForkServeError):
    """A fork would exceed ``ForkServeConfig.branch_cap`` live children of one parent."""

    http_status = 409


class OutOfPagesError(ForkServeError):
    """Committed work needs more pages than exist, even after evicting every reclaimable page."""

    http_status = 507


class ContextLengthError(InvalidRequestError):
    """A sequence would grow past the loaded model's context window (``config.max_context``)."""


class CapacityError(InvalidRequestError):
    """A request that can never fit the KV pools, even with every other page free."""


class AdapterInUseError(InvalidStateError):
    """An adapter cannot be removed while live sessions decode or prefill with it."""


class BackendError(ForkServeError):
    """The backend failed on one request's work (an unexpected error, attributed to it by
    running the step's items apart); other requests of the step were not affected."""

    http_status = 500


class ModelLoadError(ForkServeError):
    """A model or adapter on disk that cannot be loaded: a missing file, a truncated
    safetensors or GGUF file, a config.json that is not JSON or lacks a field. The message
    names the file, so the user knows what to fix."""
