#!/usr/bin/env bash
# The quality acceptance run on the lent H200, cut into device calls of at most 9.5 minutes.
#
#   bash benchmarks/quality/h200_quality.sh CALL
#
# Calls, made back to back (the machine is given back after 30 s idle; /root and /tmp stay
# only while it is held). docs/QUALITY.md has each call's carry list and timeout.
#   part1  copy the first half of SmolLM2's GGUF to /root/parts            carry .carry/smollm2/part-aa
#   setup  join the GGUF, install the gguf and bfcl-eval wheels, test the  carry .carry/smollm2/part-ab, .whl
#          hidden-state API on CUDA
#   train  train the 4 adapters (~7 min; tasks already saved are skipped), carry .carry/quality_adapters
#          copy them to $OUT/quality_adapters (~30 MB)                     when a session brought them back
#   drift  per-layer drift over 8 catalogs (drift.py): the profile the recompute modes take their
#          layers from; returns quality_h200_drift.{json,png} (~1 min)
#   eval   the layouts and modes (modes.DEFAULT: 5 layouts, neutral, recompute5/10/15) x 40
#          rounds, fp32, Triton attention, CUDA graphs, no hidden states; saves every unit (mode x
#          10 rounds) and stops before 480 s; run it again until it says done (needs drift first,
#          or the recompute units are saved as not available)
#   diag   the hidden-state cosines (fp32 eager, 8 rounds)
# Every call that evaluates seeds /root/quality from the units committed under
# benchmarks/results/ (a later session resumes there) and copies its units and tables to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
call=${1:?usage: $0 part1|setup|train|drift|eval|diag}
PARTS=/root/parts
MODEL=$PARTS/m.gguf
ADAPTERS=/root/adapters/qkvo
RESULTS=/root/quality
OUT=${OUT:?the device tool sets OUT}
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
mkdir -p "$PARTS" "$RESULTS" "$(dirname "$ADAPTERS")"

need_model() {
  [[ -f $MODEL ]] && python3 -c 'import gguf, bfcl_eval' 2>/dev/null && return
  echo "no model or wheels on this machine (a fresh one?): run part1 and setup first" >&2
  exit 3
}
need_adapters() {
  [[ -f $ADAPTERS/train_log.json ]] && return
  echo "no adapters in $ADAPTERS: run train first" >&2
  exit 3
}
# $1: tag. Units committed by an earlier session join this machine's before the run.
seed_results() {
  if [[ -d benchmarks/results/quality_$1 ]]; then
    mkdir -p "$RESULTS/quality_$1"
    cp -n benchmarks/results/quality_$1/*.json "$RESULTS/quality_$1/" 2>/dev/null || true
  fi
  cp -n benchmarks/results/quality_h200_drift.json "$RESULTS/" 2>/dev/null || true
}
DRIFT=$RESULTS/quality_h200_drift.json
publish() { cp -r "$RESULTS"/. "$OUT"/; ls -R "$OUT" | head -50 || true; }

case "$call" in
  part1)
    cp .carry/smollm2/part-aa "$PARTS"/ && ls -l "$PARTS" ;;
  setup)
    cat "$PARTS"/part-aa .carry/smollm2/part-ab > "$MODEL"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    need_model
    ls -l "$MODEL"
    # The hidden-state API on CUDA in bf16 (its CPU test runs in CI), before anything relies on it.
    FORKSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/torch/test_hidden_states.py ;;
  train)
    need_model
    if [[ -d .carry/quality_adapters/qkvo && ! -d $ADAPTERS ]]; then
      cp -r .carry/quality_adapters/qkvo "$ADAPTERS"
    fi
    time python3 -m benchmarks.quality.train --model "$MODEL" --out "$ADAPTERS" --device cuda \
        --targets q,k,v,o
    mkdir -p "$OUT/quality_adapters" && cp -r "$ADAPTERS" "$OUT/quality_adapters/"
    cp "$ADAPTERS/train_log.json" "$OUT/quality_h200_train.json"
    du -sh "$OUT/quality_adapters" ;;
  drift)
    need_model; need_adapters
    python3 -m benchmarks.quality.drift --model "$MODEL" --adapters "$ADAPTERS" --device cuda \
        --rounds 8 --out "$RESULTS" --tag h200
    publish ;;
  eval)
    need_model; need_adapters; seed_results h200
    drift=(); [[ -f $DRIFT ]] && drift=(--drift "$DRIFT")
    python3 -m benchmarks.quality.evaluate --model "$MODEL" --adapters "$ADAPTERS" --device cuda \
        --results "$RESULTS" --tag h200 --rounds 40 --no-hidden --attention triton --cuda-graphs \
        --deadline-s 480 --label "(LoRA rank 16 on q,k,v,o, 300 steps)" ${drift[@]+"${drift[@]}"}
    publish ;;
  diag)
    need_model; need_adapters; seed_results h200_hidden
    drift=(); [[ -f $DRIFT ]] && drift=(--drift "$DRIFT")
    python3 -m benchmarks.quality.evaluate --model "$MODEL" --adapters "$ADAPTERS" --device cuda \
        --results "$RESULTS" --tag h200_hidden --rounds 40 --block 4 --end 8 --deadline-s 420 \
        --label "(hidden-state pass: 8 of the 40 rounds, fp32 eager)" ${drift[@]+"${drift[@]}"}
    publish ;;
  *) echo "usage: $0 part1|setup|train|drift|eval|diag" >&2; exit 2 ;;
esac
