"""A tiny random Llama and two PEFT adapters (q, k, v, o) saved to disk, shared by the
integration tests so they go through the real loaders."""
import pytest
from tiny_llama import VOCAB, save_tiny_llama  # noqa: F401 - VOCAB: the tests' token range


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))
