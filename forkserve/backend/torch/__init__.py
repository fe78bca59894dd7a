"""L1 execution on PyTorch: model loading, multi-LoRA, paged KV in three layouts, CUDA graphs."""
from forkserve.backend.torch.backend import ResidentAdapter, StepOutput, TorchBackend, load_model
from forkserve.backend.torch.errors import (
    AdapterCapacityError,
    AdapterFormatError,
    AdapterShapeError,
    CheckpointError,
    ContextLengthError,
    InvalidWorkError,
    TokenOutOfVocabError,
    TorchBackendError,
    UnknownAdapterError,
    UnsupportedModelError,
)
from forkserve.backend.torch.gguf_loader import find_smollm2_gguf
from forkserve.backend.torch.kv_pool import kv_bytes_per_token, shared_context_kv_bytes
from forkserve.backend.torch.model_config import ModelConfig

__all__ = [
    "TorchBackend", "StepOutput", "ResidentAdapter", "load_model", "ModelConfig",
    "find_smollm2_gguf", "kv_bytes_per_token", "shared_context_kv_bytes", "TorchBackendError",
    "UnsupportedModelError", "CheckpointError", "UnknownAdapterError", "AdapterFormatError",
    "AdapterShapeError", "AdapterCapacityError", "TokenOutOfVocabError", "ContextLengthError",
    "InvalidWorkError",
]
