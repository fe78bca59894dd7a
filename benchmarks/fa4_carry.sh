#!/usr/bin/env bash
# Packs FlashAttention-4 (flash-attn-4 and the CuTe DSL it compiles with, the CUDA 13 build:
# the H200 image's torch is cu130) for the GPU machine, which reaches no package index: one
# site tree, xz-compressed, cut in parts of 30 MB, each part in its own folder, since the
# device tool carries 64 MiB a call, the checkout (~30 MB) included.
#   usage: benchmarks/fa4_carry.sh OUTDIR   (OUTDIR git-ignored, e.g. .fa4; ~4 min on 2 cores)
# Then, in back-to-back device calls (the machine goes back after 30 s idle), carry
# OUTDIR/p0, OUTDIR/p1, ... in turn, each call starting with
#   mkdir -p /root/fa4parts && cp OUTDIR/pN/* /root/fa4parts/
# and, in the last, a step of benchmarks/h200_issue15.sh that calls fa4_site: it unpacks
# the parts once into /root/fa4site and puts that on PYTHONPATH.
set -euo pipefail
out=${1:?usage: fa4_carry.sh OUTDIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
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
split -b 30M -d "$work/fa4.tar.xz" "$work/fa4.part"
rm -rf "$out"
for part in "$work"/fa4.part*; do
  n=$((10#${part##*.part}))
  mkdir -p "$out/p$n"
  mv "$part" "$out/p$n/"
done
sha256sum "$work/fa4.tar.xz" | cut -d' ' -f1 > "$out/fa4.sha256"
du -sh "$out"/p*
