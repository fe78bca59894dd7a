#!/usr/bin/env bash
# Packs FlashAttention-4 (flash-attn-4 and the CuTe DSL it compiles with, the CUDA 13 build:
# the H200 image's torch is cu130) for the GPU machine, which reaches no package index: one
# site tree, xz-compressed, cut in parts each in its own folder, a part as large as fits a
# device call beside the checkout (64 MiB together: benchmarks/carry_budget.py --part-bytes).
#   usage: benchmarks/fa4_carry.sh OUTDIR            (OUTDIR git-ignored, e.g. .fa4; ~4 min)
#          benchmarks/fa4_carry.sh --resplit OUTDIR  (OUTDIR's parts cut again to today's
#                                                     tree: it grows as results land)
# Then, in back-to-back device calls (the machine goes back after 30 s idle), carry
# OUTDIR/p0, OUTDIR/p1, ... in turn, each call starting with
#   mkdir -p /root/fa4parts && cp OUTDIR/pN/* /root/fa4parts/
# and, in the last, a step of benchmarks/h200_issue15.sh that calls fa4_site: it unpacks
# the parts once into /root/fa4site and puts that on PYTHONPATH.
set -euo pipefail
resplit=
if [ "${1:-}" = --resplit ]; then resplit=1; shift; fi
out=${1:?usage: fa4_carry.sh [--resplit] OUTDIR}
here=$(cd "$(dirname "$0")/.." && pwd)
part=$(python3 "$here/benchmarks/carry_budget.py" --repo "$here" --part-bytes)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "$resplit" ]; then
  # In the parts' order (fa4.part00, 01, ...), not the folders' (p10 sorts before p2).
  (cd "$out" && ls p*/fa4.part* | sort -t/ -k2 | xargs cat) > "$work/fa4.tar.xz"
  [ "$(sha256sum "$work/fa4.tar.xz" | cut -d' ' -f1)" = "$(cat "$out/fa4.sha256")" ] \
    || { echo "fa4_carry: $out's parts do not add up to its fa4.sha256" >&2; exit 1; }
else
  pins=(flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1
        nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
        nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/wheels" "${pins[@]}"
  mkdir -p "$work/site"
  # Unzipped, not pip-installed: `pip install --target` replaces a top-level folder that two
  # wheels share (nvidia_cutlass_dsl/ comes in four), keeping only the last wheel's files.
  for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
  tar -C "$work/site" -cf - . | xz -T2 -9 > "$work/fa4.tar.xz"
fi
split -b "$part" -d "$work/fa4.tar.xz" "$work/fa4.part"
sha=$(sha256sum "$work/fa4.tar.xz" | cut -d' ' -f1)
rm -rf "$out"
for p in "$work"/fa4.part*; do
  n=$((10#${p##*.part}))
  mkdir -p "$out/p$n"
  mv "$p" "$out/p$n/"
done
echo "$sha" > "$out/fa4.sha256"
du -sh "$out"/p*
