#!/usr/bin/env bash
# Issue 20 on one H200 (device kind nvidia-h200), one call per step, each under 10 minutes;
# carry .carry/raysite.tar.xz (benchmarks/ray_carry.sh builds it). Every step writes its JSON
# under $OUT as each (router, W) ends, so a cut run loses only the one it interrupts.
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_ray.sh 1   # run 1: 3 routers x W 32, 64
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_ray.sh 3   # run 3: fail-over, W 32
#   FORKSERVE_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200_ray.sh cpu # the same steps, tiny, on a CPU box
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/issue20}
mkdir -p "$OUT"
SITE=/root/raysite
if [ "$1" != cpu ]; then
  if [ ! -d "$SITE/ray" ]; then
    mkdir -p "$SITE" && tar -C "$SITE" -xJf .carry/raysite.tar.xz || { echo "carry missing" | tee "$OUT/error.txt"; exit 2; }
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu_$1.txt"
fi
python3 -c "import ray, fastapi, uvicorn, pydantic, starlette, httpx; print('ray', ray.__version__)" 2>&1 | tee "$OUT/imports_$1.txt"
case "$1" in
1)
  timeout 540 python3 benchmarks/ray_router_bench.py --workflows 32 64 --gpus-per-replica 0.5 \
    --out "$OUT" 2>&1 | grep -v "^\s*$" | tail -40 | tee "$OUT/run1.log"
  ;;
3)
  timeout 540 python3 benchmarks/ray_router_bench.py --failover --failover-workflows 32 --gpus-per-replica 0.5 \
    --out "$OUT" 2>&1 | grep -v "^\s*$" | tail -40 | tee "$OUT/run3.log"
  ;;
cpu)
  timeout 900 python3 benchmarks/ray_router_bench.py --tiny --with-failover --out "$OUT" 2>&1 | tail -30
  ;;
esac
ls -la "$OUT"
# Replica logs (the serve/ folder of Ray's session), tails only: what a failed step needs.
for f in /tmp/ray/session_latest/logs/serve/*.log; do echo "== $f"; tail -n 40 "$f"; done > "$OUT/serve_logs_$1.txt" 2>/dev/null
