"""The quality benchmark lives under benchmarks/ (not an installed package): put the repo root
on sys.path so `benchmarks.quality` imports however pytest is started. The tiny model that
the pipeline and drift tests share is built once per session."""
import sys
from pathlib import Path

import pytest

# tests/lib: test libraries several test folders share (gguf_testlib). Not tests/ itself:
# its folders named like packages (torch, ray, vllm) would import as namespace packages.
SHARED_LIB = str(Path(__file__).resolve().parents[1] / "lib")
if SHARED_LIB not in sys.path:
    sys.path.insert(0, SHARED_LIB)

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    from quality_testlib import tiny_model

    from benchmarks.quality.data import (
        DEFAULT_CATEGORIES,
        load_category,
        system_message,
        target_text,
    )

    items = [i for c in DEFAULT_CATEGORIES for i in load_category(c)[:60]]
    texts = [system_message(i.functions) + i.question + target_text(i) for i in items]
    return tiny_model(tmp_path_factory.mktemp("tiny_quality"), texts)
