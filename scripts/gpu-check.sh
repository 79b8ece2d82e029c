#!/usr/bin/env bash
# gpu-check.sh: the GPU checks of Quilt's driver layer (quilt-vmm), on a machine
# with an NVIDIA GPU and its driver (libcuda). Under 5 minutes on one GPU.
#
#   scripts/gpu-check.sh                  build with cargo, then run the checks
#   scripts/gpu-check.sh --build DIR      only build the three binaries into DIR
#                                         (on a machine with cargo; no GPU needed)
#   scripts/gpu-check.sh --prebuilt DIR   run the checks from binaries made by
#                                         --build (for a GPU machine without Rust)
#
# The checks, in order (each fails the script if CUDA did not construct, so a
# run that silently skipped the GPU never passes):
#   1. the conformance suite (crates/vmm/tests/conformance.rs): simulated, host
#      and CUDA backends under the same rules;
#   2. the CUDA data tests (crates/vmm/tests/cuda_data.rs): bytes through
#      stitched mappings with cuMemcpy, streams, events, out-of-memory figures;
#   3. the driver-call latency micro-benchmark on CUDA (every VMM call, one
#      thread, 1000 calls of 2 MiB, 200 of 64 MiB): a Markdown table printed
#      and written to $GPU_CHECK_OUT/driver_latency.md.
#
# Outputs go to $GPU_CHECK_OUT (default target/gpu-check): the logs of each
# step and driver_latency.md, which docs/benchmarks.md can take as is.
#
# On a GPU machine without network or Rust, build here and carry the binaries
# (about 3 MB once stripped, x86-64 Linux builds):
#     echo /gpu-bin/ >> .git/info/exclude; scripts/gpu-check.sh --build gpu-bin
# then there:
#     GPU_CHECK_OUT=$OUT scripts/gpu-check.sh --prebuilt gpu-bin

set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${GPU_CHECK_OUT:-target/gpu-check}"
mkdir -p "$OUT_DIR"
BENCH_ARGS=(--backend cuda --iters 1000 --large-iters 200)

die() {
    echo "gpu-check: $*" >&2
    exit 1
}

need_cargo() {
    if ! command -v cargo >/dev/null 2>&1; then
        cat >&2 <<'EOF'
gpu-check: cargo is not installed here. Either install Rust:
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
    . "$HOME/.cargo/env"
or build the binaries on a machine that has cargo (same CPU architecture):
    scripts/gpu-check.sh --build gpu-bin
copy gpu-bin/ here, and run:
    scripts/gpu-check.sh --prebuilt gpu-bin
EOF
        exit 2
    fi
}

# Builds the two test binaries and the benchmark into $1.
build_into() {
    local dir="$1"
    need_cargo
    mkdir -p "$dir"
    local exe
    for t in conformance cuda_data; do
        exe=$(cargo test --release -p quilt-vmm --test "$t" --no-run 2>&1 |
            tee -a "$OUT_DIR/build.log" |
            sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -n 1)
        [ -n "$exe" ] && [ -x "$exe" ] || die "could not build test $t (see $OUT_DIR/build.log)"
        cp "$exe" "$dir/$t"
    done
    cargo build --release -p quilt-vmm --example driver_latency 2>&1 | tee -a "$OUT_DIR/build.log" >/dev/null
    local target_dir
    target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    cp "${target_dir:-target}/release/examples/driver_latency" "$dir/driver_latency" ||
        die "could not build the driver_latency example"
    # Debug info is not needed to run them; stripping keeps the three small to copy.
    if command -v strip >/dev/null 2>&1; then
        strip "$dir/conformance" "$dir/cuda_data" "$dir/driver_latency" || true
    fi
    echo "gpu-check: built conformance, cuda_data and driver_latency into $dir"
}

# Runs one step: $1 = name, rest = command. Output to the terminal and a log.
step() {
    local name="$1"
    shift
    echo "== gpu-check: $name"
    local started=$SECONDS
    if command -v timeout >/dev/null 2>&1; then
        set -- timeout 200 "$@"
    fi
    if ! "$@" 2>&1 | tee "$OUT_DIR/$name.log"; then
        die "$name failed (log: $OUT_DIR/$name.log)"
    fi
    echo "== gpu-check: $name done in $((SECONDS - started)) s"
}

run_checks() {
    local bin="$1"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    else
        echo "gpu-check: nvidia-smi not found; the checks will say whether CUDA constructs"
    fi
    step conformance "$bin/conformance" --nocapture --test-threads 4
    if grep -q "CUDA backend skipped" "$OUT_DIR/conformance.log"; then
        grep -m1 "CUDA backend skipped" "$OUT_DIR/conformance.log" >&2
        die "the conformance suite ran without CUDA"
    fi
    step cuda_data "$bin/cuda_data" --nocapture
    if grep -q "cuda_data: skipped" "$OUT_DIR/cuda_data.log"; then
        die "the CUDA data tests ran without CUDA"
    fi
    step driver_latency "$bin/driver_latency" "${BENCH_ARGS[@]}" --out "$OUT_DIR/driver_latency.md"
    echo "gpu-check: all passed; the latency table is in $OUT_DIR/driver_latency.md"
}

case "${1:-}" in
    --build)
        [ -n "${2:-}" ] || die "usage: $0 --build DIR"
        build_into "$2"
        ;;
    --prebuilt)
        [ -n "${2:-}" ] || die "usage: $0 --prebuilt DIR"
        run_checks "$2"
        ;;
    "")
        build_into "$OUT_DIR/bin"
        run_checks "$OUT_DIR/bin"
        ;;
    *)
        die "unknown option $1 (none, --build DIR or --prebuilt DIR)"
        ;;
esac
