#!/usr/bin/env bash
# Issue 15's H200 runs, in the calls one lease allows (10 minutes each). Every step writes
# under $OUT as it finishes, so a timeout loses only the step it interrupts.
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 1   # tests, kernels, react no_lora
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 2   # cascade sweep, react no_lora, decode_bench
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 3   # react unified, base, no_lora x3
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 4   # split-form cascade: tests, react
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 5   # split form in kernel_bench, decode_bench
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 6   # react full_reuse, adaptive
# Round 2 (packed prefill routes, q-folded score pass, TorchBackend.launch):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 7   # CUDA tests, prefill routes, decode v4
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 8   # react W=32: unified, disaggregated, no_lora
# Round 3:
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 9   # CUDA tests, msc decode variants
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 10  # step profiles, adaptive W=1,8,32
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 11  # adaptive W=32, cascade on/off
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 12  # mapreduce, every system, W=1,8,32
# Item 5 (mixed merged/split decode batches under CUDA graphs, the policy that splits less):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 11  # adaptive W=32, cascade on/off
# Round 4 (the split-form prefill's extra work):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 13  # CUDA tests, profiled prefill
# Round 5 (msc2s: msc's pass 1 as two kernels on two CUDA streams):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 14  # CUDA msc tests, msc2s decode variants
# Round 6 (the adaptive policy weighs the admission queue: docs/MULTILORA.md "Round 6"):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 15  # react, mapreduce: W=1,8,32
# Round 7 (the adaptive policy splits under contention; a mixed tick's decode rows take the
# decode kernels: docs/MULTILORA.md "Round 7" and "Round 4"):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 16  # react W=1,8,32; mixed-step kernels
# Round 8 (Triton glue kernels, dynamic decode splits, the FRESH prefill route, fed steps):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 17  # CUDA tests, decode-short, prefill routes
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 18  # decode_bench (+ Engine rows), profiles
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 19  # react W=1,8,32 + no_lora, base
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 20  # mapreduce W=1,8,32
# Round 11 (float16 scores and the row-grid value pass as the split cascade's default):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 30  # CUDA tests, react W=32 base + 3 systems
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 31  # CUDA tests, pass 1 tunings, react W=32 base + 3 systems
# Round 12 (the shared-context pass of disaggregated_base, row 7):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 32  # react W=32 base, then profiled
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 33  # the profiled run alone ($TAG)
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 34  # CUDA suite, decode_bench --no-hf
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 35  # react W=32: unified, disaggregated, adaptive
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 36  # decode_bench --step-only (rows 10a-d)
# Round 13 (three-pass decode, rows 1-2 and 10a-b at one commit):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 37  # CUDA tests, three-pass, prefill routes
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 38  # rows 1-2 best forms, decode_bench --step-only
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 39  # rows 1-2 on the new defaults, CUDA suite
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 40  # pass 1 prefetch, q-fold table16 (rows 1-2)
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 41  # q-fold table16 with KV heads per program
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 42  # round 15's defaults, rows 1-2 and the split cascade
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 43  # CUDA suite, pass 2 launched programmatically (pdl)
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 44  # react W=32: unified, disaggregated, adaptive
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 45  # CUDA suite, rows 1-2 with and without pdl
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 46  # rows 1-2 interleaved; batch-1 pass 1 over longer chunks
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 47  # pass 2 following pass 1's keys: CUDA tests, rows 1-2
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 48  # pass 1's first rows before its folds; follow without pdl; CUDA suite
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 49  # react W=32, every LoRA system, median of 3 (rows 8-9)
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 50  # the folded variant (residual score inside the key loop), rows 1-2
# Round 18 (the skinny GEMM for the decode projections, rows 10a-b):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 52  # CUDA tests, linear_bench (the tuning)
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 53  # decode_bench --step-only: items, columns, cuBLAS, folded
# Round 20 (the folded norms):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 54  # CUDA fold tests, linear_bench --fold
# Round 21 (the ws decode's options):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 57  # ws CUDA tests, the launch probe
#   (58, 60: the benches of the options tried at ddcdc5b-458daff, since removed: KERNELS.md "Round 21")
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 59  # react W=32, every LoRA system, ws default
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 61  # the final defaults: ws tests, rows 1-2
# Round 22 (FlashAttention-4 as the prefill's library kernel; its wheels carried in parts made
# by benchmarks/fa4_carry.sh, copied to /root/fa4parts by the calls before):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 62  # FA4 CUDA tests, library bench, prefill routes
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 63  # prefill routes by device time, library bench eager, decode_bench prefill
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 64  # FA4 route tests, react W=32 every LoRA system (FA4, residual 8 warps)
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 65  # react W=32 unified, FA4 on then off (routes, FA4 compiles in the run)
# Round 23 (the warp-specialized residual prefill, residual_prefill_gluon.py; row 3):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 66  # ws prefill CUDA tests, residual_prefill_bench (FA4 where carried)
#   FORKSERVE_COMMIT=<sha> TAG=... bash benchmarks/h200_issue15.sh 67  # react W=32 every LoRA system alone (FA4 carried)
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 68  # ncu on the ws prefill, 8 x 64 over 8K (no carry)
# Round 25 (the ws prefill's launch options: fewer instructions a tile):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 66  # ws prefill CUDA tests alone (no carry)
#   FORKSERVE_COMMIT=<sha> TAG=... bash benchmarks/h200_issue15.sh 69  # residual_prefill_bench (FA4 carried)
# Round 26 (the ws decode: its softmax in one barrier; GQA groups 1-8 and rank 32):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 70  # ws decode tests, rows 1-2 with deferred_sum
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 71  # the ws decode at GQA 8 and rank 32
# Round 27 (the ws decode's one form; the ws prefill at GQA groups 1, 2, 8):
#   FORKSERVE_COMMIT=<sha> TAG=round27 bash benchmarks/h200_issue15.sh 70  # ws decode tests, rows 1-2
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 72  # ws prefill at other groups: tests, bench at GQA 8 (FA4 carried)
# Round 28 (where row 3's time goes against FA4: ncu side by side):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 73  # ncu: FA4 paged, ws, ws without adapter (FA4 carried)
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 74  # the same launches' SASS with executed counts (FA4 carried)
# Round 29 (the 128-key prefill kernel, residual_prefill_wide.py):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 75  # its CUDA tests (K=, SKIP= as 66's)
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 76  # it beside the ws default and FA4 (FA4 carried)
# Round 32 (no machine came; the adopted default's CUDA tests as one short call):
#   FORKSERVE_COMMIT=<sha> bash benchmarks/h200_issue15.sh 77  # the default route's CUDA tests (~150 s, an estimate: not yet run)
# Round 38 (the acceptance's rows at W = 1, 8, 32 from today's code; FA4 carried):
#   FORKSERVE_COMMIT=<sha> W="1 8 32" SYSTEMS="..." TAG=... bash benchmarks/h200_issue15.sh 67  # react
#   FORKSERVE_COMMIT=<sha> SYSTEMS="..." TAG=... bash benchmarks/h200_issue15.sh 78  # mapreduce
# Round 9 (the one-launch residual rebuild timed; kernels built inside timed runs counted):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 21  # rebuild tests, prefill routes, react on a cold Triton cache
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 22  # the same react on the cache 21 left
# Round 9, with each W's timed runs after an untimed rehearsal (kernels_built_in_run ~0):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 23  # react W=1,8,32 on a cold cache; prefill routes by device time
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) W="1 8 32" bash benchmarks/h200_issue15.sh 24  # full-length rehearsals (default W=32); base systems W=32
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 25  # cascade prefill, tiled split-form scores: CUDA tests, benches
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 26  # adaptive W=32: which specializations its rehearsal misses; split cascade breakdown
# Round 10 (the decode kernel's per-step integers unspecialized):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 27  # react W=1,8,32 on a cold cache
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh 28  # the split cascade launch by launch
# Round 10, merged waves before splitting (docs/MULTILORA.md "Round 10, merged waves"):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) W=32 bash benchmarks/h200_issue15.sh 29  # react, then mapreduce, on a cold cache
# The acceptance's CUDA suite (every torch, kernel and cascade test on the GPU, whole log kept):
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_issue15.sh suite [FOLDERS]
set -u
# pytest runs quiet already (pyproject's addopts: -q); another -q would drop the summary line.
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/issue15}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu_$1.txt"

# The CUDA tests over JOBS xdist workers (default 8; the suite runs under two on CI, so its
# tests keep to their own files): the 16 cores build the kernels at once, which one process
# does one after another. PER_TEST: pytest-timeout's limit a test, by its thread method, so
# a hung kernel ends its worker (the log names the test; xdist starts another), not the call.
par_tests() { echo "-n ${JOBS:-8} --timeout ${PER_TEST:-240} --timeout-method=thread"; }

# Round 10's runs on a cold Triton cache: $1 the workload. Every row's kernels_built_in_run
# should be 0 (its rehearsal built them). Adaptive's form shows in its context KV per agent
# and mean decode batch (unified's where it ran merged).
round10() {  # $1: react or mapreduce, $2: the tag; every row's kernels built in its run
  # ($SYSTEMS: another order; $ROUNDS: the systems run that many times over, the order
  # reversed every other round, so a card that heats through the run favours none)
  export TRITON_CACHE_DIR=/root/triton_$2_$1 && rm -rf "$TRITON_CACHE_DIR"
  timeout "${3:-450}" python3 -m forkserve.interfaces.cli bench "$1" --workflows ${W:-1 8 32} \
    --systems ${SYSTEMS:-unified disaggregated adaptive} --repeat "${REPEAT:-1}" \
    --rounds "${ROUNDS:-1}" --tag "$2" --out "$OUT" \
    2>&1 | tail -24
  python3 -c "import json, sys; [print(r['system'], r['workflows'], r['kernels_built_in_run'], \
    *r['kernels_built_specs'][:2]) for r in json.load(open(sys.argv[1]))['results']]" \
    "$OUT/$1_multilora_$2.json"
}
fa4_site() {  # FlashAttention-4 on PYTHONPATH, unpacked once from the carried parts
  if [ ! -d /root/fa4site/flash_attn ]; then
    mkdir -p /root/fa4site && cat /root/fa4parts/fa4.part* | xz -d | tar -x -C /root/fa4site || return 1
  fi
  export PYTHONPATH=/root/fa4site:/root/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import flash_attn.cute" || return 1
}
decode_tests() {  # $1: the log's tag, $2: pytest -k; tests/kernels/test_decode.py on CUDA
  FORKSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -p no:cacheprovider -p no:warnings \
    tests/kernels/test_decode.py -k "$2" 2>&1 | tee "$OUT/pytest_cuda_$1.log" | tail -3
}
variants() {  # $1: seconds, $2: the JSON's tag, the rest: VARIANTS at every point of rows 1-2
  # (options after the names, e.g. --group 8 --contexts 4096, replace these defaults: last)
  local limit=$1 tag=$2
  shift 2
  timeout "$limit" python3 benchmarks/kernel_bench.py --skip shared \
    --contexts 4096 8192 32768 --batches 1 8 32 64 --tag "$tag" --out "$OUT" --variants "$@" \
    2>&1 | tail -14
}
ncu_prefill_runs() {  # $1: the files' prefix, the rest: ncu's options; steps 73-74
  # One profiled launch (the third) each of FA4's paged read, the ws prefill's default
  # launch (or $LAUNCH, a bench launch name: a wide_m... one runs the 128-key kernel) and
  # the same with no row's adapter, at 8 x 64 over 8K, as ncu's CSV.
  local prefix=$1 run name kernel opts ws="_residual_prefill_(ws|wide)_kernel"
  shift
  export TRITON_CACHE_DIR=/root/tc23
  for run in "fa4:[Ff]lash|[Ff]wd:--route fa4" "ws:$ws:--route ws${LAUNCH:+ --launch $LAUNCH}" \
             "ws_no_adapter:$ws:--route ws --no-adapter${LAUNCH:+ --launch $LAUNCH}"; do
    IFS=: read -r name kernel opts <<< "$run"
    # shellcheck disable=SC2086  # the options are words
    timeout 150 ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 2 \
      --launch-count 1 "$@" --csv python3 benchmarks/ws_prefill_profile.py $opts \
      > "$OUT/${prefix}_$name.csv" 2>&1
    grep -E "graph replay|rror" "$OUT/${prefix}_$name.csv" | head -3
  done
}
case "$1" in
1)
  FORKSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -p no:warnings -x tests/kernels/test_shared_prefix.py \
    tests/torch/test_cascade.py tests/torch/test_attention_backends.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda_cascade.log"
  timeout 180 python3 benchmarks/kernel_bench.py --variants two_pass_bn64 two_pass_bn64_keysm64 \
    --contexts 4096 8192 32768 --batches 1 8 32 64 --tag issue15 --out "$OUT" 2>&1 | tail -20
  timeout 240 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems no_lora \
    --cascade on off --tag issue15_no_lora --out "$OUT" 2>&1 | tail -6
  ;;
2)
  timeout 180 python3 benchmarks/kernel_bench.py --cascade-sweep --contexts 8192 32768 --out "$OUT" 2>&1 | tail -4
  timeout 120 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems no_lora \
    --cascade on off --tag issue15_no_lora_v2 --out "$OUT" 2>&1 | tail -4
  timeout 330 python3 benchmarks/decode_bench.py --no-hf --out "$OUT" 2>&1 | tail -16
  ;;
3)
  timeout 300 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems unified \
    --cascade on off --tag issue15_unified --out "$OUT" 2>&1 | tail -5
  timeout 240 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems disaggregated_base \
    --tag issue15_disaggregated_base --out "$OUT" 2>&1 | tail -4
  timeout 150 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems no_lora \
    --cascade on off --repeat 3 --tag issue15_no_lora_v3 --out "$OUT" 2>&1 | tail -4
  ;;
4)
  FORKSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -p no:warnings tests/kernels/test_shared_prefix.py \
    tests/kernels/test_decode.py tests/torch/test_cascade.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda_split_cascade.log"
  timeout 200 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems disaggregated_base \
    --cascade on off --tag issue15_disaggregated_base_split --out "$OUT" 2>&1 | tail -4
  timeout 200 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems disaggregated \
    --cascade on off --tag issue15_disaggregated_split --out "$OUT" 2>&1 | tail -4
  ;;
5)
  timeout 150 python3 benchmarks/kernel_bench.py --variants two_pass_bn64_keysm64 --contexts 8192 32768 \
    --batches 8 32 --tag issue15_split --out "$OUT" 2>&1 | tail -8
  timeout 300 python3 benchmarks/decode_bench.py --no-hf --out "$OUT" 2>&1 | tail -16
  ;;
6)
  timeout 150 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems full_reuse \
    --cascade on off --tag issue15_full_reuse --out "$OUT" 2>&1 | tail -4
  timeout 240 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems adaptive \
    --cascade on off --tag issue15_adaptive --out "$OUT" 2>&1 | tail -4
  ;;
7)
  FORKSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:warnings tests/kernels/test_flash_prefill.py \
    tests/kernels/test_prefill.py tests/kernels/test_decode.py tests/torch/test_attention_backends.py \
    tests/torch/test_launch.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda_round2.log"
  timeout 150 python3 benchmarks/kernel_bench.py --prefill --out "$OUT" 2>&1 | tail -24
  timeout 150 python3 benchmarks/kernel_bench.py --variants two_pass_bn64_keysm64 two_pass_bn64_keysm128_w8 \
    two_pass_qfold_t32 two_pass_qfold_t64 two_pass_qfold_t128_w8 two_pass_qfold_a64 two_pass_qfold_a128_w8 \
    --skip shared --contexts 4096 8192 32768 --batches 1 8 32 64 --tag decode_v4 --out "$OUT" 2>&1 | tail -20
  timeout 100 python3 benchmarks/decode_bench.py --prefill-only --no-hf --out "$OUT" 2>&1 | tail -8
  ;;
8)
  # The prefill routes move disaggregated vs unified (goal >= 1.3x); overlap on vs off in no_lora.
  timeout 200 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems unified disaggregated \
    --tag issue15_round2 --out "$OUT" 2>&1 | tail -5
  timeout 150 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems no_lora \
    --overlap off on --gpu-timeline --tag issue15_round2_no_lora --out "$OUT" 2>&1 | tail -5
  timeout 150 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems disaggregated_base \
    --tag issue15_round2_base --out "$OUT" 2>&1 | tail -4
  ;;
9)
  # Round 3, first call: the CUDA tests of what round 3 built (materialized-scores decode,
  # steady rows read from columns, mixed-form batches under graphs), then the msc variants
  # beside the best two-pass forms of round 2.
  FORKSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:warnings tests/kernels/test_decode.py \
    tests/kernels/test_shared_prefix.py \
    tests/torch/test_batch.py tests/torch/test_launch.py tests/torch/test_cascade.py tests/torch/test_layouts.py \
    tests/torch/test_mixed_forms.py tests/torch/test_host_pool.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda_round3.log"
  timeout 300 python3 benchmarks/kernel_bench.py --variants two_pass_bn64_keysm64 two_pass_qfold_t64 msc_bn64 \
    msc_bn64_w8 msc_bn32 msc_bn128_w8 msc_bn64_p32 msc_bn64_p128_w8 msc_bn64_a64 msc_bn64_a128_w8 msc_bn64_f16 \
    --skip shared --contexts 4096 8192 32768 --batches 1 8 32 64 --tag decode_msc --out "$OUT" 2>&1 | tail -20
  ;;
10)
  # Round 3, second call: where the step time goes (--profile-ticks: kernel time by category,
  # top kernels, device idle per tick kind) and adaptive at W = 1, 8, 32 (mixed batches now
  # under CUDA graphs) beside unified and disaggregated.
  timeout 260 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems disaggregated_base \
    no_lora disaggregated --profile-ticks 3 --gpu-timeline --tag issue15_round3_profile --out "$OUT" 2>&1 \
    | grep -v "^USDT" | tail -60
  timeout 280 python3 -m forkserve.interfaces.cli bench react --workflows 1 8 32 --systems unified \
    disaggregated adaptive --tag issue15_round3_adaptive --out "$OUT" 2>&1 | tail -14
  ;;
11)
  # Whether the cascade now helps adaptive's mixed batches (under graphs) as it helps the
  # single-form layouts; the goal's comparison is call 10's.
  timeout 300 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems adaptive \
    --cascade on off --tag issue15_item5_adaptive --out "$OUT" 2>&1 | tail -8
  # The msc cascade (32 agents over an 8K / 32K shared prefix): split_msc_over_two_pass.
  timeout 200 python3 benchmarks/kernel_bench.py --variants msc_bn64 --contexts 8192 32768 --batches 1 \
    --tag cascade_msc --out "$OUT" 2>&1 | tail -12
  ;;
12)
  # The acceptance's mapreduce rows: every system at W = 1, 8, 32 (the JSON is rewritten after
  # each run, so a cut keeps the systems done).
  timeout 560 python3 -m forkserve.interfaces.cli bench mapreduce --workflows 1 8 32 --systems no_lora \
    full_reuse disaggregated_base unified disaggregated adaptive --tag issue15_round3 --out "$OUT" 2>&1 | tail -24
  ;;
13)
  # Round 4: the split-form prefill leaves the rows that read a present side out of that
  # side's scatter (no contended writes to the scratch page) and projects K/V only for the
  # rows that write them, collapses k/v residual rows in one reduction and works out a
  # step's prefill route once. CUDA tests of what it touched,
  # then unified beside disaggregated at W = 32 with per-kernel step profiles of both (the
  # unified prefill profile round 3 lacked): is disaggregated prefill <= 1.3x unified?
  FORKSERVE_TEST_DEVICE=cuda timeout 230 python3 -m pytest -p no:warnings tests/torch/test_prefill_writes.py \
    tests/torch/test_layouts.py tests/torch/test_batch.py tests/torch/test_mixed_forms.py \
    tests/torch/test_mixed_tick.py tests/torch/test_launch.py tests/torch/test_attention_backends.py \
    tests/torch/test_lora.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda_round4.log"
  timeout 330 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems unified disaggregated \
    --profile-ticks 3 --tag issue15_round4_prefill --out "$OUT" 2>&1 | grep -v "^USDT" | tail -60
  ;;
14)
  # Round 5: msc2s (residual_msc2s.py; docs/KERNELS.md "Issue 15, round 5"): the base logits
  # (K_base) and the q-folded residual score as two kernels on two streams inside the graph,
  # pass 2 summing logits and bias. Its CUDA tests (one captures it in a CUDA graph) with
  # msc's, then the decode variants beside two-pass and msc: <name>_scores_ms is pass 1 on
  # both streams, <name>_base_ms / <name>_res_ms each half alone (overlap: scores ~ the
  # longer half). The JSON is rewritten after every case, so a cut keeps the cases done.
  FORKSERVE_TEST_DEVICE=cuda timeout 140 python3 -m pytest -p no:warnings tests/kernels/test_decode_msc2s.py \
    tests/kernels/test_decode.py -k msc 2>&1 | tail -15 | tee "$OUT/pytest_cuda_round5.log"
  timeout 380 python3 benchmarks/kernel_bench.py --variants two_pass_bn64_keysm64 two_pass_qfold_t64 msc_bn64 \
    msc2s_bn64 msc2s_bn64_r2 msc2s_bn64_r4 --skip shared --contexts 4096 8192 32768 --batches 1 8 32 64 \
    --tag decode_msc2s --out "$OUT" 2>&1 | tail -24
  ;;
15)
  # Round 6: adaptive against unified and disaggregated at every W, both workloads (call 10's
  # react rows and call 12's mapreduce rows without the profiles and the other systems).
  timeout 280 python3 -m forkserve.interfaces.cli bench react --workflows 1 8 32 --systems unified \
    disaggregated adaptive --tag issue15_round6 --out "$OUT" 2>&1 | tail -14
  timeout 280 python3 -m forkserve.interfaces.cli bench mapreduce --workflows 1 8 32 --systems unified \
    disaggregated adaptive --tag issue15_round6 --out "$OUT" 2>&1 | tail -14
  ;;
16)
  # The react rows carry `pf ticks`: does disaggregated's prefill (12.99 s in round 6) drop
  # toward unified's (10.51 s) now that its small mixed ticks' decode rows skip the prefill
  # kernels? Then one layer call of such a tick, whole against split (KERNELS.md "Mixed step").
  timeout 300 python3 -m forkserve.interfaces.cli bench react --workflows 1 8 32 --systems unified \
    disaggregated adaptive --tag issue15_round7 --out "$OUT" 2>&1 | tail -14
  timeout 150 python3 benchmarks/kernel_bench.py --mixed --mixed-contexts 8192 32768 \
    --mixed-rows 8 28 --chunk 202 --out "$OUT" 2>&1 | tail -12
  ;;
17)
  FORKSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -v -p no:warnings -p no:cacheprovider -rfE \
    tests/kernels/test_glue.py tests/kernels/test_decode_short.py tests/kernels/test_decode.py \
    tests/torch/test_fresh_prefill.py tests/torch/test_attention_backends.py tests/torch/test_launch.py \
    2>&1 | tee "$OUT/pytest_cuda_round8.log" | tail -12
  timeout 150 python3 benchmarks/kernel_bench.py --decode-short --out "$OUT" 2>&1 | tail -40
  timeout 200 python3 benchmarks/kernel_bench.py --prefill --out "$OUT" 2>&1 | tail -20
  ;;
18)
  timeout 330 python3 benchmarks/decode_bench.py --no-hf --out "$OUT" 2>&1 | tail -22
  timeout 150 python3 benchmarks/decode_bench.py --profile --no-hf --out "$OUT" 2>&1 | tail -3
  ;;
19)
  timeout 300 python3 -m forkserve.interfaces.cli bench react --workflows 1 8 32 --systems unified \
    disaggregated adaptive --tag issue15_round8 --out "$OUT" 2>&1 | tail -14
  timeout 240 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems no_lora \
    disaggregated_base --overlap on --tag issue15_round8_base --out "$OUT" 2>&1 | tail -6
  ;;
20)
  timeout 280 python3 -m forkserve.interfaces.cli bench mapreduce --workflows 1 8 32 --systems unified \
    disaggregated adaptive --tag issue15_round8 --out "$OUT" 2>&1 | tail -14
  ;;
21)
  FORKSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -v -p no:warnings -p no:cacheprovider -rfE \
    tests/kernels/test_residual_rebuild.py tests/torch/test_fresh_prefill.py \
    tests/kernels/test_flash_prefill.py 2>&1 | tee "$OUT/pytest_cuda_round9.log" | tail -8
  timeout 170 python3 benchmarks/kernel_bench.py --prefill --out "$OUT" 2>&1 | tail -20
  # Rows count the Triton kernels first built inside each timed run (kernels_built_in_run):
  # on an empty on-disk cache they compile there, on 22's warm one they only load.
  export TRITON_CACHE_DIR=/root/triton_round9 && rm -rf "$TRITON_CACHE_DIR"
  timeout 240 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems \
    disaggregated unified --tag issue15_round9_cold --out "$OUT" 2>&1 | tail -5
  ;;
22)
  export TRITON_CACHE_DIR=/root/triton_round9
  timeout 240 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems \
    disaggregated unified --tag issue15_round9_warm --out "$OUT" 2>&1 | tail -5
  ;;
23)
  export TRITON_CACHE_DIR=/root/triton_round9_23 && rm -rf "$TRITON_CACHE_DIR"
  timeout 400 python3 -m forkserve.interfaces.cli bench react --workflows 1 8 32 --systems unified \
    disaggregated adaptive --tag issue15_round9 --out "$OUT" 2>&1 | tail -14
  timeout 170 python3 benchmarks/kernel_bench.py --prefill --out "$OUT" 2>&1 | tail -8
  ;;
24)
  export TRITON_CACHE_DIR=/root/triton_round9_24 && rm -rf "$TRITON_CACHE_DIR"
  timeout 240 python3 -m forkserve.interfaces.cli bench react --workflows ${W:-32} --systems \
    unified disaggregated adaptive --tag issue15_round9_full --out "$OUT" 2>&1 | tail -8
  timeout 150 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems no_lora \
    disaggregated_base --overlap on --tag issue15_round9_base --out "$OUT" 2>&1 | tail -4
  ;;
25)
  FORKSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -v -p no:warnings -p no:cacheprovider -rfE \
    tests/kernels/test_shared_prefix_prefill.py tests/torch/test_cascade_prefill.py \
    tests/kernels/test_shared_prefix.py 2>&1 | tee "$OUT/pytest_cuda_round9_cascade.log" | tail -8
  timeout 170 python3 benchmarks/kernel_bench.py --cascade-prefill --out "$OUT" 2>&1 | tail -16
  timeout 200 python3 benchmarks/kernel_bench.py --cascade-split --out "$OUT" 2>&1 | tail -16
  ;;
26)
  export TRITON_CACHE_DIR=/root/triton_round10 && rm -rf "$TRITON_CACHE_DIR"
  timeout 160 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems adaptive \
    --tag issue15_round10_specs --out "$OUT" 2>&1 | tail -3
  python3 -c "import json, sys; [print(r['kernels_built_in_run'], *r['kernels_built_specs'], \
    sep='\n') for r in json.load(open(sys.argv[1]))['results']]" \
    "$OUT/react_multilora_issue15_round10_specs.json"
  timeout 200 python3 benchmarks/kernel_bench.py --cascade-split --out "$OUT" 2>&1 | tail -16
  ;;
27)
  # Round 10: adaptive's step integers unspecialized. Every row's kernels_built_in_run should be 0.
  round10 react issue15_round10
  ;;
29)
  # Round 10, merged waves: adaptive W = 32 should run merged, as unified (react, mapreduce).
  round10 react issue15_round10_waves 280
  round10 mapreduce issue15_round10_waves 280
  ;;
28)
  # Round 10: the split cascade launch by launch (and its float16 score buffer).
  FORKSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -p no:warnings -p no:cacheprovider -rfE \
    tests/kernels/test_shared_prefix.py tests/kernels/test_sm90_compile.py tests/torch/test_cascade.py \
    2>&1 | tee "$OUT/pytest_cuda_round10_csplit.log" | tail -6
  timeout 300 python3 benchmarks/kernel_bench.py --cascade-split --out "$OUT" 2>&1 | tail -40
  ;;
30)
  # Round 11: the split cascade's float16 scores and row-grid value pass as the default.
  FORKSERVE_TEST_DEVICE=cuda timeout 100 python3 -m pytest -p no:warnings -p no:cacheprovider -rfE \
    tests/kernels/test_shared_prefix.py tests/torch/test_cascade.py \
    2>&1 | tee "$OUT/pytest_cuda_round11_defaults.log" | tail -4
  export TRITON_CACHE_DIR=/root/triton_round11 && rm -rf "$TRITON_CACHE_DIR"
  timeout 150 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems \
    disaggregated_base --overlap on --tag issue15_round11_base --out "$OUT" 2>&1 | tail -4
  W=32 round10 react issue15_round11 280
  ;;
31)
  # Round 11b: the merge's fixed split tiles, float16 scores relative to the running max
  # (no second reduction in the prefix launch): CUDA tests, pass 1's tunings in the split
  # cascade at 8K x 32, then react W = 32 (base, then the three systems).
  FORKSERVE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -p no:warnings -p no:cacheprovider -rfE \
    tests/kernels/test_decode.py tests/kernels/test_shared_prefix.py tests/torch/test_cascade.py \
    2>&1 | tee "$OUT/pytest_cuda_round11b.log" | tail -3
  timeout 150 python3 benchmarks/kernel_bench.py --cascade-split --split-prefixes 8192 \
    --split-agents 32 --split-variants two_pass_fp16 two_pass_fp16_rowvalues two_pass_fp16_rowvalues_pbn16 p1_qfold_bn128_w8 \
    p1_qfold_bn64_w8 p1_qfold_bn32_w4 p1_qfold_angleadd_bn64 p1_qfold_bn64_s3 p1_keysm_bn64 \
    --out "$OUT" 2>&1 | tail -22
  export TRITON_CACHE_DIR=/root/triton_round11b && rm -rf "$TRITON_CACHE_DIR"
  timeout 120 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems \
    disaggregated_base --overlap on --tag issue15_round11b_base --out "$OUT" 2>&1 | tail -3
  W=32 round10 react issue15_round11b "${REACT_S:-200}"
  ;;
32)
  # Round 12: disaggregated_base at W = 32 (row 7) as measured, then again with its
  # shared-context pass (context_write) and a tick of each kind under torch.profiler.
  export TRITON_CACHE_DIR=/root/triton_round12 && rm -rf "$TRITON_CACHE_DIR"
  timeout 170 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems \
    disaggregated_base --overlap on --tag issue15_round12_base --out "$OUT" 2>&1 | tail -4
  TAG=issue15_round12_base_profile bash "$0" 33
  ;;
33)
  timeout 170 python3 -m forkserve.interfaces.cli bench react --workflows 32 --systems \
    disaggregated_base --overlap on --profile-ticks 1 --tag "${TAG:-issue15_round12_profile}" \
    --out "$OUT" 2>&1 | grep -v "^USDT" | tr '\r' '\n' | grep -v "agent turns:" | tail -110
  ;;
34)
  # Round 12: the acceptance's CUDA suite, then rows 10a-d (decode_bench, no HF rows).
  bash "$0" suite
  timeout 330 python3 benchmarks/decode_bench.py --no-hf --out "$OUT" 2>&1 | tail -22
  ;;
35)
  W=32 round10 react issue15_round12 280
  ;;
36)
  timeout 300 python3 benchmarks/decode_bench.py --step-only --out "$OUT" 2>&1 | tail -16
  ;;
37)
  # Round 13: three-pass decode on CUDA (tests, then beside the engine's two-pass), and the
  # prefill routes with every point's device time interleaved (row 4).
  export TRITON_CACHE_DIR=/root/tc13
  decode_tests round13_decode "three_pass or two_pass"
  variants 220 decode_three_pass two_pass_default three_pass_bn64 three_pass_bn64_w8 \
    three_pass_bn32
  timeout 200 python3 benchmarks/kernel_bench.py --prefill --out "$OUT" 2>&1 | tail -25
  ;;
38)
  # Round 13: rows 1-2 at this commit, the engine's default beside every form that led a
  # column in an earlier run (msc2s, the batch-1 q-fold, keys as M), three-pass and two-pass
  # on the dynamic split plan (pass 2 alone timed for the static ones); then rows 10a-d (36).
  export TRITON_CACHE_DIR=/root/tc13
  variants 300 decode_round13 two_pass_default two_pass_dyn three_pass_bn64 msc2s_bn64_r2 \
    msc2s_bn64_r4 two_pass_qfold_t128_w8 two_pass_bn64_keysm64
  bash "$0" 36
  ;;
39)
  # Round 13's defaults (two-pass on the dynamic plan with prefetch) at every point of rows
  # 1-2, beside each half of the change and with pass 1 beside pass 2 over row slices
  # (overlap_slices, off by default); the split cascade with prefetch (off by default); then
  # the CUDA suite on them.
  export TRITON_CACHE_DIR=/root/tc13
  variants 240 decode_round13_defaults two_pass_default two_pass_static two_pass_dyn \
    two_pass_pf two_pass_ov2 two_pass_ov4
  timeout 150 python3 benchmarks/kernel_bench.py --cascade-split --split-variants \
    two_pass_fp16_rowvalues two_pass_fp16_rowvalues_pf --out "$OUT" 2>&1 | tail -8
  bash "$0" suite
  ;;
40)
  # Round 15: pass 1 with its residual rows loaded a tile ahead, and the q-folded pass from
  # a table in the queries' dtype, beside the defaults and the forms they change, at every
  # point of rows 1-2; their CUDA tests first.
  export TRITON_CACHE_DIR=/root/tc15
  decode_tests round15_pass1 "prefetch_and_table16 or two_pass or score_options"
  variants 400 decode_round15_pass1 two_pass_default two_pass_qfold_t64 two_pass_qfold_t64_pf \
    two_pass_qfold_t64_pf16 two_pass_qfold_t128_pf16 two_pass_qfold_t128_w8 \
    two_pass_qfold_t128_w8_pf two_pass_qfold_t128_w8_pf16 two_pass_bn64_keysm64 \
    two_pass_bn64_keysm64_pf
  ;;
41)
  # Round 15, second step: the q-folded pass from the bf16 table with 2 or 4 KV heads per
  # program (one product over their folds; each tile's residual and table rows read once),
  # and with 3 pipeline stages.
  export TRITON_CACHE_DIR=/root/tc15
  decode_tests round15_kv_heads "prefetch_and_table16 or score_options"
  variants 400 decode_round15_kv_heads two_pass_default two_pass_qfold_t64_pf16 \
    two_pass_qfold_t128_pf16 two_pass_qfold_t64_pf16_h2 two_pass_qfold_t64_w8_pf16_h2 \
    two_pass_qfold_t128_w8_pf16_h2 two_pass_qfold_t64_w8_pf16_h4 two_pass_qfold_t64_pf16_s3
  ;;
42)
  # Round 15's pass-1 defaults (bf16 table, two KV heads per program) at every point of rows
  # 1-2 beside round 14's per-batch forms, and in the split cascade beside round 14's pass 1.
  export TRITON_CACHE_DIR=/root/tc15
  variants 300 decode_round15_defaults two_pass_default two_pass_qfold_t64 \
    two_pass_bn64_keysm64 two_pass_qfold_t128_w8
  timeout 200 python3 benchmarks/kernel_bench.py --cascade-split --split-variants \
    two_pass_fp16_rowvalues_pf p1_round14 --out "$OUT" 2>&1 | tail -8
  ;;
43)
  # Round 15: the CUDA suite on the new pass-1 defaults (with the pdl tests), then pass 2
  # launched programmatically beside the default at every point of rows 1-2.
  bash "$0" suite
  export TRITON_CACHE_DIR=/root/tc15
  variants 200 decode_round15_pdl two_pass_default two_pass_pdl
  ;;
44)
  # Round 15: react W = 32, every LoRA system, on the new pass-1 defaults (rows 8-9).
  W=32 round10 react issue15_round15 330
  ;;
45)
  # Round 15, after the fixes: the CUDA suite (the bf16 table copy under inference mode; pdl
  # on by default), then the default beside it without pdl at every point of rows 1-2.
  bash "$0" suite
  export TRITON_CACHE_DIR=/root/tc15
  variants 150 decode_round15_final two_pass_default two_pass_nopdl
  ;;
46)
  # Round 16 (prepared in round 15): rows 1-2 with whole calls interleaved (kernel_bench's
  # default since a9f0615), the batch-1 pass 1 over longer chunks, and the split cascade
  # with the tiled score pass from the bf16 table.
  export TRITON_CACHE_DIR=/root/tc15
  variants 300 decode_round16 two_pass_default two_pass_nopdl two_pass_b1_c256 \
    two_pass_b1_c512 two_pass_b1_c1024
  timeout 200 python3 benchmarks/kernel_bench.py --cascade-split --split-variants \
    two_pass_fp16_rowvalues_pf tiled16_a2h1_bn64_w8 tiled16_a4h1_bn64_w8 --out "$OUT" \
    2>&1 | tail -8
  ;;
47)
  # Round 16: pass 2 following pass 1's published keys (follow, score_progress.py): its CUDA
  # tests (bit-equal to the whole-pass wait, eager and under a graph), then every follow
  # tuning beside the default at every point of rows 1-2.
  export TRITON_CACHE_DIR=/root/tc15
  decode_tests round16_follow "follow or pdl or score_options or two_pass"
  variants 400 decode_round16_follow two_pass_default two_pass_follow_w1_s256 \
    two_pass_follow_w1_s512 two_pass_follow_w1_s2048 two_pass_follow_w2_s256 \
    two_pass_follow_w2_s512 two_pass_follow_w2_s2048
  ;;
48)
  # Round 16: pass 1 issuing its first residual rows before the folds (batch 1's chain),
  # beside the default without pdl and follow with and without it, at every point of rows
  # 1-2; then the CUDA suite on it.
  export TRITON_CACHE_DIR=/root/tc15
  variants 200 decode_round16_chain two_pass_default two_pass_nopdl two_pass_follow_w2_s2048 \
    two_pass_follow_nopdl
  bash "$0" suite
  ;;
49)
  # Round 16: react W = 32, every LoRA system, the median of 3 runs each, after the bench
  # driver stopped probing the adaptive layout for a queue head that fits in neither form
  # (rows 8-9; adaptive's time outside ticks was 0.74-1.05 s against unified's 0.4).
  W=32 REPEAT=3 round10 react issue15_round16 540
  ;;
50)
  # Round 16: the folded variant (one launch, the q-folded residual score inside the key
  # loop) beside the default at every point of rows 1-2; its CUDA tests first.
  export TRITON_CACHE_DIR=/root/tc15
  decode_tests round16_folded "folded"
  variants 200 decode_round16_folded two_pass_default folded_bn64 folded_bn64_w8 \
    folded_bn64_nopf folded_bn32
  ;;
51)
  # Round 17: the folded variant at 32 residual columns (no spills) beside the default; its
  # CUDA tests first. (The run in kernel_bench_decode_round17_folded.json also had two
  # loop changes that lost, at tag exp-round17-folded.)
  export TRITON_CACHE_DIR=/root/tc15
  decode_tests round17_folded "folded"
  variants 200 decode_round17_folded two_pass_default folded_bn64 folded_bn32
  ;;
52)
  # Round 18: the skinny GEMM for the decode step's projections (rows 10a-b): its CUDA tests,
  # then linear_bench (every Llama-3-8B projection at 1, 32 and 64 rows against cuBLAS; writes
  # the tuning to adopt, skinny_tuning.json).
  export TRITON_CACHE_DIR=/root/tc18
  FORKSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -p no:cacheprovider -p no:warnings \
    tests/kernels/test_skinny_gemm.py tests/kernels/test_sm90_compile.py \
    tests/torch/test_model.py -k "skinny or test_triton_glue" 2>&1 \
    | tee "$OUT/pytest_cuda_round18_skinny.log" | tail -3
  timeout 420 python3 benchmarks/linear_bench.py --out "$OUT" 2>&1 | tail -20
  ;;
53)
  # Rows 10a-d: the no-LoRA decode rows as items, as DecodeBatch columns and on a cuBLAS
  # backend over the same weights, timed in turn (--ab-rounds, one process); the graph's
  # launch rows; last the step traces (step_trace.py), gzipped beside the JSON.
  export TRITON_CACHE_DIR=/root/tc18
  timeout 400 python3 benchmarks/decode_bench.py --step-only --out "$OUT" 2>&1 | tail -16
  ;;
54)
  # Round 20: the folded norms (TorchBackend(fold_norms)): their CUDA tests, then linear_bench
  # --fold at 1 and 64 rows (the /norm and /add keys of the tuning to merge).
  export TRITON_CACHE_DIR=/root/tc20
  FORKSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -p no:cacheprovider -p no:warnings \
    tests/kernels/test_skinny_gemm.py tests/torch/test_model.py -k "norm or residual or folded" \
    2>&1 | tee "$OUT/pytest_cuda_round20_fold.log" | tail -3
  mkdir -p "$OUT/fold"
  timeout 400 python3 benchmarks/linear_bench.py --fold --rows 1 64 --out "$OUT/fold" 2>&1 | tail -12
  ;;
55)
  # Round 20b: the folded model test held to the fp32 reference, gate_up's /silu/norm keys
  # (the bench's tolerance now two ulps at the output's largest magnitude) merged into the
  # packaged tuning here, then 53's A/B with the folded backend on the merged tuning.
  export TRITON_CACHE_DIR=/root/tc20
  FORKSERVE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -p no:cacheprovider -p no:warnings \
    tests/torch/test_model.py -k "folded" 2>&1 | tee "$OUT/pytest_cuda_round20b_fold.log" | tail -3
  mkdir -p "$OUT/fold"
  timeout 150 python3 benchmarks/linear_bench.py --fold --rows 1 64 --projections gate_up \
    --out "$OUT/fold" 2>&1 | tail -3
  python3 - "$OUT/fold/skinny_tuning.json" forkserve/kernels/skinny_tuning.json <<'PY'
import json, sys
new, packaged = (json.load(open(p)) for p in sys.argv[1:])
for device, keys in new.items():
    packaged.setdefault(device, {}).update(keys)
open(sys.argv[2], "w").write(json.dumps(packaged, indent=1) + "\n")
PY
  cp forkserve/kernels/skinny_tuning.json "$OUT/skinny_tuning_merged.json"
  export TRITON_CACHE_DIR=/root/tc18
  timeout 330 python3 benchmarks/decode_bench.py --step-only --out "$OUT" 2>&1 | tail -16
  ;;
56)
  # Round 20c: the warp-specialized Gluon decode (variant "ws"): its CUDA tests, then beside
  # the default at every point of rows 1-2 (only if the tests pass: a hang stops at 90 s).
  export TRITON_CACHE_DIR=/root/tc20
  FORKSERVE_TEST_DEVICE=cuda timeout 90 python3 -m pytest -x -p no:cacheprovider -p no:warnings \
    -rA tests/kernels/test_residual_decode_ws.py 2>&1 | tee "$OUT/pytest_cuda_round20_ws.log" | tail -15
  if [ "${PIPESTATUS[0]}" = 0 ]; then
    variants 230 "decode_round20_ws${2:-}" two_pass_default ws
  fi
  ;;
57)
  # Round 21: the ws tests, then every launch case of the probe in a process of its own (a
  # hang costs its 30 s, not the call). Two consumer warp groups faulted here in 6 of 8 cases
  # and are gone (docs/KERNELS.md "Round 21").
  export TRITON_CACHE_DIR=/root/tc20
  FORKSERVE_TEST_DEVICE=cuda timeout 90 python3 -m pytest -x -p no:cacheprovider -p no:warnings \
    -rA tests/kernels/test_residual_decode_ws.py 2>&1 | tee "$OUT/pytest_cuda_round21_ws.log" | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  timeout 240 python3 benchmarks/ws_launch_probe.py --batches 8 32 --splits 0 --repeats 30 \
    --out "$OUT" 2>&1 | tail -10
  ;;
61)
  # Round 21's final kernel: the ws tests, rows 1-2 beside two-pass.
  export TRITON_CACHE_DIR=/root/tc20
  FORKSERVE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -x -p no:cacheprovider -p no:warnings \
    tests/kernels/test_residual_decode_ws.py 2>&1 | tee "$OUT/pytest_cuda_round21_final.log" | tail -2
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  variants 150 decode_round21_default default two_pass_default
  ;;
59)
  # Round 21: react W = 32, every LoRA system, with ws the decode default at every batch
  # (rows 7-9; the engine's decode attention of the split form).
  W=32 round10 react issue15_round21 "${2:-300}"
  ;;
62)
  # Round 22: FlashAttention-4 serves FRESH (one varlen call) and PAGED_FLASH (the pages read
  # through the block tables); the CUDA tests of what it serves, the library bench, then the
  # prefill routes (rows 3-4, device time).
  fa4_site || exit 1
  export TRITON_CACHE_DIR=/root/tc22
  FORKSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:cacheprovider -p no:warnings -rs \
    tests/kernels/test_fa4_prefill.py tests/kernels/test_flash_prefill.py tests/torch/test_fresh_prefill.py \
    tests/torch/test_attention_backends.py 2>&1 | tee "$OUT/pytest_cuda_round22_fa4.log" | tail -4
  timeout 100 python3 benchmarks/fa4_prefill_bench.py --out "$OUT" 2>&1 | tail -10
  timeout 240 python3 benchmarks/kernel_bench.py --prefill --out "$OUT" 2>&1 | tail -12
  ;;
63)
  # Round 22: the prefill routes with their device times (rows 3-4), the library bench with
  # eager columns (FA4's host cost), the 8K LoRA prefill through the model (row 5).
  fa4_site || exit 1
  export TRITON_CACHE_DIR=/root/tc22
  timeout 100 python3 benchmarks/fa4_prefill_bench.py --out "$OUT" 2>&1 | tail -10
  timeout 240 python3 benchmarks/kernel_bench.py --prefill --out "$OUT" 2>&1 | tail -12
  timeout 150 python3 benchmarks/decode_bench.py --prefill-only --no-hf --out "$OUT" 2>&1 | tail -8
  ;;
64)
  # Round 22: the engine on FA4 with the fused residual prefill at 8 warps (prefill_tiles.json):
  # the route tests the suite failed once, then react W = 32, every LoRA system (rows 8-9).
  fa4_site || exit 1
  FORKSERVE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -p no:cacheprovider -p no:warnings \
    tests/torch/test_cascade_prefill.py tests/kernels/test_fa4_prefill.py tests/kernels/test_prefill.py \
    2>&1 | tee "$OUT/pytest_cuda_round22_routes.log" | tail -3
  W=32 round10 react "${TAG:-issue15_round22}" "${2:-330}"  # TAG: a rerun's own file name
  ;;
65)
  # Round 22: why unified react lost 3 s of prefill on FA4 (step 64): the same run with
  # FA4 on and off, each row naming its prefill routes and the FA4 kernels compiled in it.
  fa4_site || exit 1
  export TRITON_CACHE_DIR=/root/tc22
  for fa4 in on off; do
    FORKSERVE_FA4=$fa4 timeout 150 python3 -m forkserve.interfaces.cli bench react --workflows 32 \
      --systems unified --tag "issue15_round22_unified_fa4_$fa4" --out "$OUT" 2>&1 | tail -3
  done
  ;;
66)
  # Round 23: the ws residual prefill against the formulas, every launch and option (round
  # 27: seven launches, each compiled whole and split, so the tests have a call of their own;
  # the compiled kernels stay in TRITON_CACHE_DIR for step 69 while the machine is held).
  # K: a pytest -k expression, for the rest of a run cut at its timeout.
  export TRITON_CACHE_DIR=/root/tc23
  FORKSERVE_TEST_DEVICE=cuda timeout 420 python3 -m pytest -v -p no:cacheprovider -p no:warnings \
    ${K:+-k "$K"} tests/kernels/test_residual_prefill_ws.py 2>&1 \
    | tee "$OUT/pytest_cuda_ws_prefill_${TAG:-residual_prefill}${K:+_rest}.log" | tail -4
  ;;
69)
  # Round 25: every residual route and ws launch against the best unified one per case
  # (FA4's paged route where its parts came), after step 66 in the same held machine.
  [ -d /root/fa4parts ] && { fa4_site || exit 1; }
  export TRITON_CACHE_DIR=/root/tc23
  # SKIP: ws launches to leave out (one whose step-66 tests failed or hung).
  # shellcheck disable=SC2086  # one launch name per word
  timeout 540 python3 benchmarks/residual_prefill_bench.py --tag "${TAG:-residual_prefill}" \
    ${SKIP:+--skip-launches $SKIP} --out "$OUT" 2>&1 | tail -16
  ;;
67)
  # Round 23: react W = 32 (or $W), every LoRA system (rows 8-9), with no tests before it.
  # Since round 36 in two rounds, the second in reverse order (rows 8-9 pair them round by
  # round: issue15_goals), ~400 s on the H200.
  fa4_site || exit 1
  W=${W:-32} ROUNDS=${ROUNDS:-2} round10 react "${TAG:-issue15_round23}" "${2:-560}"
  ;;
78)
  # Round 38: the acceptance's mapreduce rows from today's code: W = 1, 8, 32 (or $W), the
  # systems of $SYSTEMS (step 67's three by default; the bench's every system by name), one
  # round unless $ROUNDS.
  fa4_site || exit 1
  W=${W:-1 8 32} ROUNDS=${ROUNDS:-1} round10 mapreduce "${TAG:-issue15_round38}" "${2:-560}"
  ;;
68)
  # Round 24: where the ws prefill's time goes (8 x 64 over 8K, 2x FA4's paged read): Nsight
  # Compute's stall reasons and throughputs for one launch of each default (128 and 64 rows),
  # clocks left alone (METHOD.md). ncu reads the counters on Firecracker machines only
  # (KINDS.md): a machine where it cannot says so in the log, and the graph-replay times
  # still come back.
  export TRITON_CACHE_DIR=/root/tc23
  ncu --version 2>&1 | tail -1
  for rows in 128 64; do
    timeout 200 ncu --clock-control none --kernel-name regex:_residual_prefill_ws_kernel \
      --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy \
      python3 benchmarks/ws_prefill_profile.py --rows "$rows" 2>&1 \
      | tee "$OUT/ncu_ws_prefill_rows$rows.txt" | tail -40
  done
  ;;
70)
  # Round 26-27: the ws decode's CUDA tests (its one form since round 27, the deferred-sum
  # softmax, and the shapes built beside Llama-3-8B's: GQA groups 1-8, rank 32), then rows
  # 1-2 (no carry). Round 26 ran it with the forms since removed
  # (kernel_bench_decode_round26_deferred_sum.json).
  export TRITON_CACHE_DIR=/root/tc20
  FORKSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -x -p no:cacheprovider -p no:warnings \
    tests/kernels/test_residual_decode_ws.py 2>&1 | tee "$OUT/pytest_cuda_round27_decode.log" | tail -2
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  variants 240 "decode_${TAG:-round27}" default
  ;;
71)
  # Round 26-27: the ws decode at the shapes built beside Llama-3-8B's, GQA 8 (Llama-3-70B's)
  # and rank 32, beside two-pass (the policy's pick before round 27 measured them:
  # kernel_bench_decode_round26_gqa8.json, _rank32.json) and unified, interleaved (no carry).
  export TRITON_CACHE_DIR=/root/tc20
  variants 150 "decode_${TAG:-round27}_gqa8" two_pass ws --group 8 \
    --contexts 4096 32768 --batches 1 8 64
  variants 150 "decode_${TAG:-round27}_rank32" two_pass ws --rank 32 \
    --contexts 4096 32768 --batches 1 8 64
  ;;
72)
  # Round 27: the ws prefill at GQA groups beside 4 (built for 1, 2, 4, 8; routed only at the
  # measured 4): its CUDA tests at 8, 2, 1, then the launches bench at GQA 8 beside FA4's
  # paged read (carry FA4's parts first, as for 69). Where ws beats the Triton routes the
  # policy takes there, (8, 16) joins prefill_policy.MEASURED_WS_PREFILL_SHAPES.
  [ -d /root/fa4parts ] && { fa4_site || exit 1; }
  export TRITON_CACHE_DIR=/root/tc23
  FORKSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:cacheprovider -p no:warnings \
    -k "other_groups" tests/kernels/test_residual_prefill_ws.py 2>&1 \
    | tee "$OUT/pytest_cuda_ws_prefill_groups.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  timeout 360 python3 benchmarks/residual_prefill_bench.py --group 8 \
    --tag "${TAG:-residual_prefill_gqa8}" --out "$OUT" 2>&1 | tail -10
  ;;
73)
  # Round 28: where row 3's time goes against its baseline. One launch each of FA4's paged
  # read, the ws kernel's default launch and the same with no row's adapter, at 8 x 64 over
  # 8K, profiled with the same sections (raw pages, CSV), then side by side
  # (ncu_compare.py: instructions, pipes, issue, stall reasons). FA4 carried as for 69.
  # LAUNCH: a bench launch name in place of the default (round 29: a wide_m... one).
  fa4_site || exit 1
  ncu_prefill_runs ncu_prefill --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --page raw
  python3 benchmarks/ncu_compare.py fa4="$OUT/ncu_prefill_fa4.csv" ws="$OUT/ncu_prefill_ws.csv" \
    ws_no_adapter="$OUT/ncu_prefill_ws_no_adapter.csv" --out "$OUT/ncu_prefill_${TAG:-round28}.json"
  ;;
74)
  # Round 28: step 73's launches again, their SASS with each instruction's executed count
  # (ncu's source page), summed by instruction class over the launch's 16,512 tiles of 128
  # rows x 64 keys (128 programs x 129 tiles at 8 x 64 over 8K). FA4 carried as for 69.
  fa4_site || exit 1
  ncu_prefill_runs ncu_source --section SourceCounters --page source --print-source sass
  python3 benchmarks/ncu_compare.py --source --per 16512 fa4="$OUT/ncu_source_fa4.csv" \
    ws="$OUT/ncu_source_ws.csv" ws_no_adapter="$OUT/ncu_source_ws_no_adapter.csv" \
    --out "$OUT/ncu_source_${TAG:-round28}.json"
  ;;
75)
  # Round 29-30: the 128-key kernel against the formulas, every launch the bench measures
  # (compiled kernels kept in TRITON_CACHE_DIR for 76). First one small case alone under a
  # short timeout, at the default launch and each thread_arrive protocol (a hang in a new
  # protocol then costs 240 s, not the call; -v names the launch it hung at), then the
  # rest over xdist's workers (par_tests), every case run: which launches, cases and splits
  # fail, each failure saying where its rows are off (kernel_testlib.where_wrong), is the
  # diagnosis. K: a pytest -k expression for the rest.
  export TRITON_CACHE_DIR=/root/tc23
  FORKSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -v -x -p no:cacheprovider \
    -p no:warnings -k under_a_cuda_graph tests/kernels/test_residual_prefill_wide.py 2>&1 \
    | tee "$OUT/pytest_cuda_wide_prefill_first.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  # shellcheck disable=SC2046  # par_tests' words are options
  FORKSERVE_TEST_DEVICE=cuda timeout 480 python3 -m pytest -v -rfE -p no:cacheprovider \
    -p no:warnings $(par_tests) ${K:+-k "$K"} tests/kernels/test_residual_prefill_wide.py \
    2>&1 | tee "$OUT/pytest_cuda_wide_prefill${K:+_rest}.log" | tail -4
  ;;
76)
  # Round 29: the 128-key kernel's launches beside the ws kernel's default launch (the ws
  # column) and FA4's paged read, every case; the ws kernel's other launches, measured in
  # round 27, left out. SKIP: more launches to leave out (one whose tests failed). GROUP: the
  # GQA group (default 4; the 128-key launches are adopted at 4 only, the others unmeasured).
  [ -d /root/fa4parts ] && { fa4_site || exit 1; }
  export TRITON_CACHE_DIR=/root/tc23
  # shellcheck disable=SC2086  # one launch name per word
  # The kernels built by 8 processes first (--warm-jobs), not one by one inside the timing.
  timeout 540 python3 benchmarks/residual_prefill_bench.py --tag "${TAG:-residual_prefill_wide}" \
    --warm-jobs "${JOBS:-8}" ${GROUP:+--group "$GROUP"} \
    --skip-launches ws_m64_s3 ws_m64_s3_edge_base_bf16 ws_m128_s3 ws_m128_s3_edge \
    ws_m128_s3_base ws_m128_s3_edge_base ws_m128_s3_edge_base_bf16 $SKIP --out "$OUT" 2>&1 \
    | tail -16
  ;;
77)
  # Round 32: the CUDA tests that run the default prefill launch (the 128-key kernel at GQA
  # 4 since round 31's adoption) with no launch named: the kernel entry point whole and
  # split, at GQA 8, 2 and 1, under a CUDA graph, the kernels package's route, and the
  # engine's attention over it (prefill, cascade prefill, FRESH prefill). A short call: a
  # machine taken back mid-call returns nothing, and the suite's ~330 s were lost so once.
  export TRITON_CACHE_DIR=/root/tc23
  ws=tests/kernels/test_residual_prefill_ws.py
  # shellcheck disable=SC2046  # par_tests' words are options
  FORKSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -v -rfE -p no:cacheprovider \
    -p no:warnings $(par_tests) tests/torch/test_attention_backends.py \
    tests/torch/test_fresh_prefill.py tests/torch/test_cascade_prefill.py \
    "$ws::test_ws_prefill_matches_the_formula" "$ws::test_ws_prefill_at_other_groups" \
    "$ws::test_ws_prefill_under_a_cuda_graph" "$ws::test_the_default_route_is_ws_on_hopper" \
    2>&1 | tee "$OUT/pytest_cuda_default_route.log" | tail -8
  ;;
suite)
  [ -d /root/fa4parts ] && { fa4_site || exit 1; }  # the suite with FA4 where its parts came
  # tee writes as it goes: a run cut at the timeout keeps the tests it finished. $2: the
  # folders (default all three; if one call cannot hold them, "tests/torch" in one and
  # "tests/kernels tests/cascade" in the next), named in the log's file name.
  # The kernels steps 75-76 built are reused (the machine held since); IGNORE: a test file
  # already run at this commit (step 75's), left out so the rest fits the call.
  folders=${2:-tests/torch tests/kernels tests/cascade}
  export TRITON_CACHE_DIR=/root/tc23
  # shellcheck disable=SC2086,SC2046  # one folder per word; par_tests' words are options
  FORKSERVE_TEST_DEVICE=cuda timeout 500 python3 -m pytest -v -p no:warnings -p no:cacheprovider -rfE \
    --durations=10 $(par_tests) ${IGNORE:+--ignore="$IGNORE"} $folders 2>&1 \
    | tee "$OUT/pytest_cuda_suite_$(echo "$folders" | tr -c 'a-z\n' _).log" | tail -30
  ;;
esac
ls -la "$OUT"
