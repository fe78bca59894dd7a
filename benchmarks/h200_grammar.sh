#!/usr/bin/env bash
# Issue 18's H200 figure: grammar mask cost per decode step (xgrammar vs llguidance, batch 1
# and 64) with the logits on the GPU. The GPU image has neither grammar engine nor pydantic:
# their cp312 wheels (with fastapi: the grammar compiler lives in the server package, whose
# errors answer HTTP) and the demo model's tokenizer travel in the git-ignored .carry/grammar
# (14 MiB), made once on the dev box by
#   bash benchmarks/h200_grammar.sh prepare
# then, on the GPU (carry .carry/grammar):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_grammar.sh
# The JSON is rewritten after every case, so a cut run keeps what it measured.
set -u
CARRY=.carry/grammar
if [ "${1:-}" = prepare ]; then
  mkdir -p $CARRY/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform any -d $CARRY/wheels \
    xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.13.4 pydantic-core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2 llguidance==1.9.1 \
    fastapi==0.165.0 starlette==1.10.0 anyio==4.16.0 annotated-doc==0.0.7 idna==3.20 \
    opentelemetry-api==1.45.2 || exit 1
  python3 -c "
import sys; sys.path[:0] = ['benchmarks', '.']
from grammar_bench import load_tokenizer
load_tokenizer(None).save_pretrained('$CARRY/tokenizer')" || exit 1
  du -sh $CARRY
  exit 0
fi
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/grammar}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $CARRY/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import xgrammar, llguidance, torch; print('grammar engines ok, cuda', torch.cuda.is_available())" || exit 1
timeout 540 python3 benchmarks/grammar_bench.py --device cuda --tokenizer $CARRY/tokenizer \
  --out "$OUT/grammar_bench_h200.json" 2>&1 | tee "$OUT/grammar_bench_h200.log"
ls -la "$OUT"
