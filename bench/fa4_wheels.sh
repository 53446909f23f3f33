#!/usr/bin/env bash
# FlashAttention-4 for the GPU machine, whose Python has no network: fetch the wheels here and
# pack them into two halves that each fit one device call's 64 MiB carry beside the tree.
#
#   bash bench/fa4_wheels.sh          # here, from the repository root: writes .fa4/a and .fa4/b
#
# The CuTe DSL library for CUDA 13 (the device's torch is cu130) is one 193 MB shared object,
# a 92 MB wheel; as tar.xz -9 it is ~64 MB, so it travels in two parts over two calls on one
# warm machine: suite fa4a keeps .fa4/a's part in the checkout's ignored .fa4keep there, and
# suite fa4b brings .fa4/b (the other part and the small wheels), unpacks everything into
# /tmp/fa4site with bench/fa4_unpack.py, then measures. Each call carries its half only:
#   call 1: mkdir -p .snap/head/.fa4 && cp -r .fa4/a .snap/head/.fa4/   (bench/run.py fa4a)
#   call 2: rm -rf .snap/head/.fa4/a && cp -r .fa4/b .snap/head/.fa4/   (bench/run.py fa4b)
# The second call must reach the same machine: start it as soon as the first returns.
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p .fa4/fetch .fa4/a .fa4/b
fetch() { python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d .fa4/fetch "$@"; }
fetch "flash-attn-4==4.0.0b40" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" \
      "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi==0.1.15.post2" \
      "torch-c-dlpack-ext==0.1.5" "quack-kernels==0.6.5"
# the big library: unpacked, tarred, xz -9, split in two
rm -rf .fa4/unz && mkdir -p .fa4/unz
python3 -m zipfile -e .fa4/fetch/nvidia_cutlass_dsl_libs_cu13-*.whl .fa4/unz
tar -C .fa4/unz -cf - . | xz -9 -T2 > .fa4/cu13.tar.xz
split -n 2 -d .fa4/cu13.tar.xz .fa4/cu13.tar.xz.part
mv .fa4/cu13.tar.xz.part00 .fa4/a/
mv .fa4/cu13.tar.xz.part01 .fa4/b/
find .fa4/fetch -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' -exec cp {} .fa4/b/ \;
rm -rf .fa4/unz .fa4/cu13.tar.xz
du -sh .fa4/a .fa4/b
