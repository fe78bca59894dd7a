#!/usr/bin/env bash
# Issue 18's H200 figure: grammar mask cost per decode step (xgrammar vs llguidance, batch 1
# and 64) with the logits on the GPU. The GPU image has neither grammar engine nor pydantic,
# so their wheels travel in the git-ignored .carry/grammar/wheels, and the demo model's
# tokenizer in .carry/grammar/tokenizer (both made here once, as docs/SERVER.md says):
#   run(carry=[".carry/grammar"],
#       command="FORKSERVE_COMMIT=<sha> bash benchmarks/h200_grammar.sh")
# The JSON is rewritten after every case, so a cut run keeps what it measured.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/grammar}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .carry/grammar/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import xgrammar, llguidance, torch; print('grammar engines ok, cuda', torch.cuda.is_available())" || exit 1
timeout 540 python3 benchmarks/grammar_bench.py --device cuda --tokenizer .carry/grammar/tokenizer \
  --out "$OUT/grammar_bench_h200.json" 2>&1 | tee "$OUT/grammar_bench_h200.log"
ls -la "$OUT"
