#!/usr/bin/env bash
# Issue 21's H200 runs in one GPU call (<= 9 minutes): react at W = 64, 128, 256 with a
# 100 GiB KV budget and the device's idle time between decode steps (--gpu-timeline), the
# aLoRA system at the same W (stage alora, issue 16 item 5), then the memory-pressure run
# (24 GiB, W = 128, disaggregated, stateless turns) with the residual host tier and pause
# pins (D1) on vs off. Every run rewrites its JSON under $OUT as it ends,
# and each stage starts only if the call's deadline leaves it time, so a cut loses one run.
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue21.sh [all|sweep|lora|alora|pressure][,...]
# Llama-3-8B shape, random bf16 weights (forkserve bench react builds them; no files carried).
# A CPU check of the script's logic: REACT_ARGS (appended last, so they win) shrinks each run:
#   REACT_ARGS="--tiny --workflows 2 4 --context 128 --kv-budget-gib 0.004" bash benchmarks/h200_issue21.sh
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/issue21}
STAGES=${1:-all}   # one stage, "all", or several joined by commas (alora,pressure)
stage() { [[ $STAGES == all || ,$STAGES, == *,$1,* ]]; }
BUDGET_S=${BUDGET_S:-530}   # the call's 600 s less start-up and the copy back
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + BUDGET_S ))
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"

# react TAG CAP_S ARGS...: one `forkserve bench react` call, cut at CAP_S or at the deadline.
react() {
  local tag=$1 cap=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) - 5 ))
  if (( left < 45 )); then echo "skipped $tag: ${left}s left" | tee -a "$OUT/skipped.txt"; return; fi
  (( cap > left )) && cap=$left
  echo "== $tag (up to ${cap}s)"
  timeout "$cap" python3 -m forkserve.interfaces.cli bench react --turns 2 --gen 32 \
    --gpu-timeline --tag "issue21_$tag" --out "$OUT" "$@" ${REACT_ARGS:-} 2>&1 | grep -v "agent turns" | tail -8
}

if stage sweep; then
  # no_lora first: the shared context is prefilled once, so its decode steps dominate and
  # its GPU idle at W = 256 with overlap is the issue's goal (<= 5%); overlap off beside it.
  react no_lora 200 --systems no_lora --workflows 64 128 256 --kv-budget-gib 100 --overlap off on
fi
if stage lora; then
  # Every agent its own adapter, the shared context's residuals written by one base pass
  # (base_activations): the LoRA system whose prefill does not grow with W, against vLLM
  # 0.26 with LoRA (1.85 tasks/s at W = 32, 1.74 at W = 64; the goal is 2x at every W).
  react disaggregated_base 200 --systems disaggregated_base --workflows 64 128 256 \
    --kv-budget-gib 100 --overlap on
fi
if stage alora; then
  # Every agent its own activated LoRA, invoked by its instruction: the context is the base
  # model's for every agent, prefilled once and shared exactly (issue 16 item 5), against
  # disaggregated_base's approximate sharing above.
  react alora 200 --systems alora --workflows 64 128 256 --kv-budget-gib 100 --overlap on
fi
if stage pressure; then
  # 24 GiB with 5% for residuals: 128 agents' 8K-context residuals do not all fit, so paused
  # agents' residual pages are evicted while others run; the host tier parks them (on) or
  # they are recomputed (off); pins keep a paused agent's base pages.
  # D1=off (or on) runs one of the two: a call cut at its limit reruns only what is owed.
  for d1 in ${D1:-on off}; do
    extra=(); [[ $d1 == on ]] && extra=(--host-residual-gib 4 --pause-pin)
    # PROFILE=1: three decode ticks and the prefill ticks under the torch profiler
    # (`step_profile` in the JSON): where D1-on's 1.5x longer decode step goes.
    [[ ${PROFILE:-0} == 1 ]] && extra+=(--profile-ticks 3)
    # D1 off recomputes evicted residuals: it ran past 150 s on 2026-12-02 and saved nothing.
    react "pressure_d1_$d1" 280 --systems disaggregated --workflows 128 --kv-budget-gib 24 \
      --residual-share 0.05 --reopen "${extra[@]}"
  done
fi
if stage sweep; then
  # Each agent's own adapter: the residuals of the 8K context are computed per agent
  # (disaggregated) or the whole K/V is (unified) — prefill-bound, so the biggest W go last.
  react disaggregated 200 --systems disaggregated --workflows 64 128 256 --kv-budget-gib 100 --overlap on
  react unified 200 --systems unified --workflows 64 128 256 --kv-budget-gib 100 --overlap on
fi
ls -la "$OUT"
