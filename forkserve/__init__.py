"""ForkServe: a branch-aware, multi-LoRA serving engine for LLM agent workflows."""
from forkserve.config import (
    AdmitMode,
    ForkServeConfig,
    KVLayout,
    ShareBase,
    app_config,
    plus_config,
)
from forkserve.engine import Engine

__all__ = ["Engine", "ForkServeConfig", "AdmitMode", "KVLayout", "ShareBase", "plus_config",
           "app_config"]
__version__ = "0.1.0"
