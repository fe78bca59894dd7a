"""``from forkserve.engine.vllm_backend import VllmBackend`` (the seed's import path).

Importing this module does not import vLLM; building a ``VllmBackend`` with a model does
(``pip install -e ".[vllm]"``, CUDA GPU). Implementation: forkserve/backend/vllm/.
"""
from forkserve.backend.vllm.backend import VllmBackend

__all__ = ["VllmBackend"]
