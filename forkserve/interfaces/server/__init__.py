"""L4: the OpenAI-compatible HTTP server with branch endpoints (``forkserve serve``)."""
from forkserve.interfaces.server.app import create_app, main
from forkserve.interfaces.server.served_model import ServedModel, load_served_model

__all__ = ["ServedModel", "create_app", "load_served_model", "main"]
