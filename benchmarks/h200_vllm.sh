#!/usr/bin/env bash
# Issue 17 on the H200: three device calls made back to back (the machine goes back after
# 30 s idle; files under /root survive while it is held). Each call carries one part of
# vLLM 0.26 (.vllm/, built by ../shared/tools/vllm-carry.sh, git-ignored) and leaves it in
# /root/parts; the last unpacks vLLM and runs everything that needs it in ONE process
# (one engine start, 50-95 s). Every unit writes under $OUT as it finishes; python is
# stopped at 590 s and told to start nothing new after BUDGET_S (default 480 s).
#   call 0  carry .vllm/vllm026.part00                       fan-out rows on TorchBackend
#   call 1  carry .vllm/vllm026.part01                       react-multilora rows on TorchBackend
#   call 2  carry .vllm/vllm026.part02 .vllm/vllm026.sha256  unpack; GPU tests, fan-out and
#                                                            side by side on vLLM
#   command: bash benchmarks/h200_vllm.sh N [LAST]   (DRY_RUN=1: print the commands, run none)
# LAST is the last part's number (2 for the usual three parts; if vllm-carry.sh wrote more,
# call N = 0..LAST carries part N, the middle calls only copy, and call LAST runs call 2's work).
# A call carries the work tree too (14 MB in 2026-12) and at most 64 MiB in all, so
# vllm-carry.sh's 60 MiB parts no longer fit beside it: on the dev box first
#   bash benchmarks/h200_vllm.sh resplit     (rejoin, check the sha256, 45 MiB parts; prints LAST)
# COPY_ONLY=1: calls 0..LAST only gather the parts and unpack vLLM (a hold for the scored run).
#
# The scored fan-out (issue 17, item 3; SmolLM2 in three 34 MiB parts from run_all.sh pack,
# after the calls above in the same hold for its plain-vLLM row, or alone on a fresh machine
# without that row):
#   call smollm2 aa  carry .carry/smollm2/part-aa                   part aa to /root/parts
#   call smollm2 ab  carry .carry/smollm2/part-ab                   part ab
#   call grammar     carry .carry/grammar (h200_grammar.sh prepare) to /root/grammar
#   call scored      carry .carry/smollm2/part-ac,                  join + sha256, wheels to
#                          .whl/gguf-0.19.0-py3-none-any.whl        /tmp/site, then
#                                                                   h200_vllm.py scored-fanout
# (a part, the grammar wheels and the tree together pass 64 MiB: one call each.)
#
# Our rows alone (no vLLM carried, none installed: its runs and decode columns are left out):
#   call cuda-rows  carry nothing   react-multilora disaggregated/unified (warmed up: one
#                                   backend per system, an untimed run and its decode graphs
#                                   first) and the TorchBackend decode rows, merged over the
#                                   committed benchmarks/results/vllm_side_by_side.json (its
#                                   vLLM rows kept, ours replaced); $OUT/cuda_rows.log
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_vllm.sh cuda-rows
# (FORKSERVE_COMMIT: the commit the reports record, the device's copy having no .git.)
set -u
n=${1:?usage: h200_vllm.sh N [LAST] | resplit | smollm2 PART | grammar | scored | cuda-rows}
if [ "$n" = resplit ]; then  # on the dev box: the same bytes in parts that fit beside the tree
  set -e
  joined=$(mktemp) && trap 'rm -f "$joined"' EXIT
  cat .vllm/vllm026.part* > "$joined"
  [ "$(sha256sum "$joined" | cut -d' ' -f1)" = "$(cat .vllm/vllm026.sha256)" ] || {
    echo "the .vllm parts do not match vllm026.sha256: rebuild with vllm-carry.sh" >&2; exit 1; }
  rm -f .vllm/vllm026.part*
  split -b 45M -d "$joined" .vllm/vllm026.part
  ls -l .vllm
  echo "LAST=$(( $(ls .vllm/vllm026.part* | wc -l) - 1 ))"
  exit 0
fi
last=${2:-2}
start=$(date +%s)
stop=$((start + ${BUDGET_S:-480}))
OUT=${OUT:-/tmp/h200_vllm}
PARTS=${PARTS:-/root/parts}   # the vLLM parts, gathered over the three calls
KEEP=${KEEP:-/root/h200_vllm} # rows of calls 0 and 1, merged in call 2
SITE=${SITE:-/root/vllmsite}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
run() { if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi; }
left() { echo $((start + 590 - $(date +%s))); }  # seconds before the call's 600 s limit
react=(--turns 2)                                 # the same workload flags in calls 1 and 2

mkdir -p "$OUT" "$PARTS" "$KEEP"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total \
  --format=csv | tee "$OUT/gpu_$n.txt"
SMOL=${SMOL:-/root/parts/smollm2}  # SmolLM2's parts, where h200_quality.sh keeps them
case "$n" in
cuda-rows)  # no vLLM: vllm_side_by_side.py leaves its parts out (exit 0), ours are rerun
  echo "commit: ${FORKSERVE_COMMIT:-unset, so the report records git rev-parse HEAD or unknown}"
  export PYTHONPATH=$PWD
  run timeout "$(left)" python3 benchmarks/vllm_side_by_side.py --systems disaggregated unified \
    "${react[@]}" --rows-from benchmarks/results/vllm_side_by_side.json --out "$OUT" \
    --stop-at "$stop" 2>&1 | tee "$OUT/cuda_rows.log"
  status=${PIPESTATUS[0]}
  ls -la "$OUT"
  exit "$status" ;;
smollm2)
  part=${2:-aa}
  mkdir -p "$SMOL" && run cp ".carry/smollm2/part-$part" "$SMOL/" && ls -l "$SMOL"
  exit $? ;;
grammar)
  run cp -r .carry/grammar /root/ && ls /root/grammar/wheels
  exit $? ;;
scored)
  mkdir -p "$SMOL"
  # the last part travels with this call; the earlier ones came in calls smollm2 aa, ab
  run cp .carry/smollm2/part-* "$SMOL/" || { echo "carry .carry/smollm2/part-ac"; exit 1; }
  if [ -z "${DRY_RUN:-}" ]; then
    cat "$SMOL"/part-* > "$SMOL/m.gguf"
    want=$(awk '$2 == "smollm2" {print $1}' benchmarks/quality/models.sha256)
    [ "$(sha256sum "$SMOL/m.gguf" | cut -d' ' -f1)" = "$want" ] || {
      echo "SmolLM2 GGUF does not match models.sha256 (parts: $(ls "$SMOL")): run calls smollm2 aa and ab first"
      rm -f "$SMOL/m.gguf"; exit 1; }
  fi
  # gguf (our loader, transformers' tokenizer) and the grammar engine with the server package
  # it lives in (the exact tool-call check); after vLLM's own packages on the path.
  run python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/gguf-*.whl /root/grammar/wheels/*.whl
  export PYTHONPATH=$PWD:$SITE:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
  [ -d "$SITE/vllm" ] || echo "no vLLM in $SITE (calls 0..LAST not run in this hold): its row is skipped"
  run timeout "$(left)" python3 benchmarks/h200_vllm.py scored-fanout --out "$OUT" \
    --model "$SMOL/m.gguf" --stop-at "$stop" 2>&1 | tee "$OUT/scored.log"
  ls -la "$OUT"
  exit 0 ;;
esac
part=$(printf 'vllm026.part%02d' "$n")
run cp ".vllm/$part" "$PARTS/" || { echo "part $n missing: carry .vllm/$part"; exit 1; }
parts=$(for i in $(seq 0 "$last"); do printf "$PARTS/vllm026.part%02d " "$i"; done)
stage=$n
[ "$n" = "$last" ] && stage=last
[ "$n" != "$last" ] && [ "$n" -ge 2 ] && stage=copy
[ -n "${COPY_ONLY:-}" ] && [ "$stage" != last ] && stage=copy
case "$stage" in
copy) ;;
0)
  run timeout "$(left)" python3 benchmarks/h200_vllm.py cuda-fanout --out "$KEEP" \
    --stop-at "$stop" 2>&1 | tee "$OUT/cuda_fanout.log"
  run cp "$KEEP/fanout_cuda.json" "$KEEP/fanout_cuda.png" "$OUT/"
  ;;
1)
  run timeout "$(left)" python3 benchmarks/vllm_side_by_side.py --systems disaggregated unified \
    --skip-decode --out "$KEEP/react" --stop-at "$stop" "${react[@]}" 2>&1 | tee "$OUT/cuda_react.log"
  run cp "$KEEP/react/vllm_side_by_side.json" "$OUT/vllm_side_by_side_cuda.json"
  ;;
last)
  # shellcheck disable=SC2086  # $parts: one path per part, no spaces
  have=$(cat $parts | sha256sum | cut -d' ' -f1)
  [ -n "${DRY_RUN:-}" ] || [ "$have" = "$(cat .vllm/vllm026.sha256)" ] || {
    echo "vLLM parts do not match vllm026.sha256 (got $have): calls 0 and 1 must run on this machine"
    ls -la "$PARTS"; exit 1; }
  run mkdir -p "$SITE"
  # shellcheck disable=SC2086
  if [ -z "${DRY_RUN:-}" ]; then cat $parts | xz -d | tar -x -C "$SITE" || exit 1; fi
  echo "unpacked vLLM in $(( $(date +%s) - start )) s"
  [ -n "${COPY_ONLY:-}" ] && exit 0
  export PYTHONPATH=$SITE:$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
  run timeout "$(left)" python3 benchmarks/h200_vllm.py vllm --out "$OUT" --stop-at "$stop" \
    --cuda-rows "$KEEP/fanout_cuda.json" --side-by-side --systems vllm_native vllm \
    --rows-from "$KEEP/react/vllm_side_by_side.json" "${react[@]}" 2>&1 | tee "$OUT/vllm.log"
  ;;
esac
ls -la "$OUT"
