#!/usr/bin/env bash
# Runs COMMAND on the project's simulated GPU: the CUDA runtime face
# (crates/cuda-runtime, libcudart.so.13) over the strict driver double
# (crates/cuda-double, libcuda.so.1), both from the workspace's release build
# (`cargo build --release`). See docs/simulated-gpu.md.
#
#   scripts/simulated-gpu.sh python train.py
#   QUILT_CUDA_DOUBLE_DEVICES=1 QUILT_CUDA_DOUBLE_MEMORY=8GiB scripts/simulated-gpu.sh python -c '...'
#
# Only COMMAND's environment changes: a private folder beside the face
# (target/release/simulated-gpu) holding libcudart.so.13 and libnvidia-ml.so.1
# (the face, which also answers the few NVML calls torch's expandable segments
# make) and libcuda.so.1 / libcuda.so (the double) goes first on its
# LD_LIBRARY_PATH; the face is preloaded (LD_PRELOAD), so a program's own copy
# of NVIDIA's libcudart.so.13 (torch's wheel loads one) never answers; the
# double's QUILT_CUDA_DOUBLE_* settings pass through, with 2 devices and
# driver version 13020 (CUDA 13.2, the face's runtime version) unless set.
# QUILT_SIMULATED_GPU_FACE and QUILT_SIMULATED_GPU_DOUBLE name other builds of
# the two libraries. Nothing outside COMMAND is shadowed.
set -euo pipefail
if [ $# -eq 0 ]; then
    echo "usage: scripts/simulated-gpu.sh COMMAND [ARGS...]" >&2
    exit 2
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$repo/target}/release"
face="${QUILT_SIMULATED_GPU_FACE:-$target/libquilt_cuda_runtime.so}"
double="${QUILT_SIMULATED_GPU_DOUBLE:-$target/libquilt_cuda_double.so}"
blas="${QUILT_SIMULATED_GPU_CUBLAS:-$(dirname "$face")/libquilt_cublas.so}"
blaslt="${QUILT_SIMULATED_GPU_CUBLASLT:-$(dirname "$face")/libquilt_cublas_lt.so}"
for lib in "$face" "$double" "$blas" "$blaslt"; do
    if [ ! -f "$lib" ]; then
        echo "simulated-gpu: $lib is not built; run \`cargo build --release\` in $repo first" >&2
        exit 2
    fi
done
face="$(cd "$(dirname "$face")" && pwd)/$(basename "$face")"
double="$(cd "$(dirname "$double")" && pwd)/$(basename "$double")"
blas="$(cd "$(dirname "$blas")" && pwd)/$(basename "$blas")"
blaslt="$(cd "$(dirname "$blaslt")" && pwd)/$(basename "$blaslt")"
dir="$(dirname "$face")/simulated-gpu"
mkdir -p "$dir"
link() { # link TARGET NAME: made under a temporary name and renamed over
    local tmp="$dir/.$2.$$"
    ln -sf "$1" "$tmp"
    mv -f "$tmp" "$dir/$2"
}
link "$face" libcudart.so.13
link "$face" libnvidia-ml.so.1
link "$double" libcuda.so.1
link "$double" libcuda.so
link "$blas" libcublas.so.13
link "$blaslt" libcublasLt.so.13
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_PRELOAD="$dir/libcudart.so.13:$dir/libcublasLt.so.13:$dir/libcublas.so.13${LD_PRELOAD:+:$LD_PRELOAD}"
export QUILT_CUDA_DOUBLE_DEVICES="${QUILT_CUDA_DOUBLE_DEVICES:-2}"
export QUILT_CUDA_DOUBLE_DRIVER_VERSION="${QUILT_CUDA_DOUBLE_DRIVER_VERSION:-13020}"
exec "$@"
