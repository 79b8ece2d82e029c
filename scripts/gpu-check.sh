#!/usr/bin/env bash
# gpu-check.sh: the GPU checks of Quilt's driver layer (quilt-vmm), on a machine
# with an NVIDIA GPU and its driver (libcuda). Under 5 minutes on one GPU.
#
#   scripts/gpu-check.sh OUT                   build with cargo, then run the checks;
#                                              findings in OUT/gpu-check.json
#   scripts/gpu-check.sh                       the same with OUT = $GPU_CHECK_OUT
#                                              (default target/gpu-check)
#   scripts/gpu-check.sh OUT --prebuilt BIN    run the checks from binaries made by
#                                              --build (a GPU machine without Rust)
#   scripts/gpu-check.sh --build BIN           only build the binaries into BIN
#                                              (on a machine with cargo; no GPU needed)
#   scripts/gpu-check.sh --prebuilt BIN        as before: findings in $GPU_CHECK_OUT
#                                              (default target/gpu-check)
#
# The steps, in order; each runs under `timeout` (30 to 75 s), the whole run
# stays under TOTAL_BUDGET_S (285 s), and a failed step
# does not stop the ones after it:
#   1. map_probe (crates/vmm/examples/map_probe.rs): asks the real driver,
#      bypassing Quilt's ledger, whether it accepts cuMemMap at an offset of one
#      granule into a two-granule handle, cuMemMap of a one-granule prefix of a
#      two-granule handle, cuMemSetAccess on one granule of a two-granule
#      mapping, and cuMemSetAccess across two adjacent reservations; its JSON
#      answer is copied into the findings as "probe";
#   2. driver_latency: the driver-call latency micro-benchmark on CUDA (every
#      VMM call, one thread, 1000 calls of 2 MiB, 200 of 64 MiB); the Markdown
#      table goes to OUT/driver_latency.md, which docs/benchmarks.md can take;
#   3. conformance (crates/vmm/tests/conformance.rs) with --ignored: its CUDA
#      tests, ignored by `cargo test` (every shared check, and the
#      differential check against the simulated backend, on the CUDA
#      backend), with PROPTEST_CASES and PROPTEST_MAX_SHRINK_ITERS bounded;
#   4. cuda_data (crates/vmm/tests/cuda_data.rs) with --include-ignored:
#      bytes through stitched mappings with cuMemcpy, streams, events,
#      contexts, out-of-memory figures;
#      (3 and 4 are skipped when the probe found no CUDA: without a device
#      their GPU tests fail, as they should);
#   5. torch_check (scripts/torch_check.py, with libquilt_torch.so): PyTorch
#      on the GPU under a memory fraction, a fragmenting pattern with the
#      native allocator and with quilt_torch.enable(), tensor contents, the
#      mempool() route, a snapshot of the real run; skipped with the reason
#      where python3, torch or a CUDA device is missing;
#   6. cudarc_kernel (crates/alloc/examples/cudarc_kernel.rs): a cudarc kernel
#      reading and writing Quilt buffers through cudarc's traits, on a second
#      stream, checked element by element;
#   7. cuda_buffer (crates/alloc/tests/cuda_buffer.rs) with --ignored: cudarc's
#      copies through Quilt buffers across two streams, typed errors, frees;
#   8. cuda_share (crates/vmm/tests/cuda_share.rs) with --ignored: the sharing
#      flags the device reports (POSIX fd, FABRIC, GPUDirect RDMA with VMM,
#      recommended granularity: one "cuda_share: caps {...}" line), peer
#      access for every device in one cuMemSetAccess (skipped with a message
#      on a machine with one device), and export / import of a handle between
#      two processes on device 0 (the test re-runs itself as the child; the
#      fd crosses a Unix socket), bytes both ways;
#   9. sleep_wake (crates/alloc/tests/sleep_wake.rs) with --ignored: a tagged
#      block and a growable buffer keep every byte through growth, sleep
#      (offload), reuse of their pages by another block, and wake, on the GPU.
#
# Findings: OUT/gpu-check.json, one object: whether CUDA was available, the GPU,
# the limits used, each step (name, status, exit_status, seconds, log file), and
# the probe's JSON. Step status: passed, failed, timed_out, unavailable (the
# probe found no CUDA driver or device), skipped (with the reason), or
# passed_without_cuda (the test binary passed but ran no CUDA check). Each
# step's output is also in OUT/<step>.log. The script exits 0 when no step
# failed or timed out (also where there is no GPU: the findings say so; set
# GPU_CHECK_REQUIRE_GPU=1 to make that a failure), 1 otherwise, 2 on bad usage.
#
# On a GPU machine without network or Rust, build here and carry the binaries
# (a few MB once stripped, x86-64 Linux builds):
#     echo /gpu-bin/ >> .git/info/exclude; scripts/gpu-check.sh --build gpu-bin
# then there:
#     scripts/gpu-check.sh "$OUT" --prebuilt gpu-bin

set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

TOTAL_BUDGET_S=${GPU_CHECK_BUDGET_S:-285}
STEP_TIMEOUT_S=75
LATENCY_TIMEOUT_S=60
PROBE_TIMEOUT_S=30
DATA_TIMEOUT_S=55
TORCH_TIMEOUT_S=60
KERNEL_TIMEOUT_S=20
SHARE_TIMEOUT_S=30
SLEEP_TIMEOUT_S=30
export PROPTEST_CASES=${PROPTEST_CASES:-32}
export PROPTEST_MAX_SHRINK_ITERS=${PROPTEST_MAX_SHRINK_ITERS:-64}
BENCH_ARGS=(--backend cuda --iters 1000 --large-iters 200)
BINARIES=(map_probe driver_latency conformance cuda_data cudarc_kernel cuda_buffer cuda_share sleep_wake)  # and libquilt_torch.so

die() {
    echo "gpu-check: $*" >&2
    exit 2
}

usage() {
    sed -n '4,14p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# $1 as a JSON number when it is a non-negative integer, else as a string.
json_num() {
    case $1 in
        '' | *[!0-9]*) json_str "$1" ;;
        *) printf '%s' "$1" ;;
    esac
}

# A JSON string literal of $1.
json_str() {
    local s=$1
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\n'/\\n}
    s=${s//$'\r'/}
    s=${s//$'\t'/\\t}
    printf '"%s"' "$s"
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
    scripts/gpu-check.sh OUT --prebuilt gpu-bin
EOF
        return 1
    fi
}

# Builds the test binaries (conformance, cuda_data, cuda_share, cuda_buffer,
# sleep_wake), the three examples and libquilt_torch.so into
# $1; logs to $2.
# Returns non-zero (with the reason on stderr) when something did not build.
build_into() {
    local dir=$1 log=$2
    need_cargo || return 1
    mkdir -p "$dir" || return 1
    local exe t
    for t in conformance cuda_data cuda_share; do
        exe=$(cargo test --release -p quilt-vmm --test "$t" --no-run 2>&1 |
            tee -a "$log" |
            sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -n 1)
        if [ -z "$exe" ] || [ ! -x "$exe" ]; then
            echo "gpu-check: could not build test $t (see $log)" >&2
            return 1
        fi
        cp "$exe" "$dir/$t" || return 1
    done
    if ! cargo build --release -p quilt-vmm --example driver_latency --example map_probe \
        >>"$log" 2>&1; then
        echo "gpu-check: could not build the examples (see $log)" >&2
        return 1
    fi
    local target_dir
    target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    for t in cuda_buffer sleep_wake; do
        exe=$(cargo test --release -p quilt-alloc --test "$t" --no-run 2>&1 |
            tee -a "$log" |
            sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -n 1)
        if [ -z "$exe" ] || [ ! -x "$exe" ]; then
            echo "gpu-check: could not build test $t (see $log)" >&2
            return 1
        fi
        cp "$exe" "$dir/$t" || return 1
    done
    if ! cargo build --release -p quilt-alloc --example cudarc_kernel >>"$log" 2>&1; then
        echo "gpu-check: could not build the cudarc_kernel example (see $log)" >&2
        return 1
    fi
    for t in driver_latency map_probe cudarc_kernel; do
        cp "${target_dir:-target}/release/examples/$t" "$dir/$t" || return 1
    done
    if ! cargo build --release -p quilt-torch >>"$log" 2>&1; then
        echo "gpu-check: could not build quilt-torch (see $log)" >&2
        return 1
    fi
    cp "${target_dir:-target}/release/libquilt_torch.so" "$dir/" || return 1
    # Debug info is not needed to run them; stripping keeps them small to copy.
    if command -v strip >/dev/null 2>&1; then
        for t in "${BINARIES[@]}"; do
            strip "$dir/$t" 2>/dev/null || true
        done
    fi
    echo "gpu-check: built ${BINARIES[*]} into $dir"
}

# ---------------------------------------------------------------- the run

STARTED=$SECONDS
STEPS_JSON=()
ANY_FAILED=0
CUDA_AVAILABLE=unknown

# Records one step: name, status, exit status ("null" when not run), seconds,
# log file (relative to the output folder), reason (may be empty).
record() {
    local name=$1 status=$2 rc=$3 secs=$4 log=$5 reason=$6
    local entry
    entry="{\"name\": $(json_str "$name"), \"status\": $(json_str "$status"), \"exit_status\": $rc, \"seconds\": $secs"
    [ -n "$log" ] && entry+=", \"log\": $(json_str "$log")"
    [ -n "$reason" ] && entry+=", \"reason\": $(json_str "$reason")"
    entry+="}"
    STEPS_JSON+=("$entry")
    case $status in
        failed | timed_out) ANY_FAILED=1 ;;
    esac
    echo "== gpu-check: $name: $status${reason:+ ($reason)} in ${secs} s"
}

# Runs one step: $1 = name, $2 = timeout in seconds, rest = command; stdout and
# stderr go to the terminal and OUT/<name>.log (stdout alone to $STDOUT_TO when
# set). Sets STEP_RC and STEP_SECS. Never exits the script.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL_BUDGET_S - (SECONDS - STARTED)))
    if [ "$left" -lt 5 ]; then
        STEP_RC=skip
        STEP_SECS=0
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== gpu-check: $name (limit ${limit} s)"
    local cmd=("$@")
    if command -v timeout >/dev/null 2>&1; then
        cmd=(timeout --kill-after=5 "$limit" "$@")
    fi
    local started=$SECONDS
    if [ -n "${STDOUT_TO:-}" ]; then
        "${cmd[@]}" >"$STDOUT_TO" 2>"$OUT_DIR/$name.log"
        STEP_RC=$?
        cat "$STDOUT_TO" "$OUT_DIR/$name.log"
    else
        "${cmd[@]}" 2>&1 | tee "$OUT_DIR/$name.log"
        STEP_RC=${PIPESTATUS[0]}
    fi
    STEP_SECS=$((SECONDS - started))
}

# The status of a finished step from its exit status ($1) and, for test
# binaries, whether its log says CUDA was skipped ($2: a grep pattern).
status_of() {
    local rc=$1 skipped_pattern=${2:-}
    case $rc in
        0)
            if [ -n "$skipped_pattern" ] && grep -q "$skipped_pattern" "$OUT_DIR/$NAME.log"; then
                echo passed_without_cuda
            else
                echo passed
            fi
            ;;
        124 | 137) echo timed_out ;;
        *) echo failed ;;
    esac
}

# Runs the test binary or example $2 as step $1 with timeout $3 and arguments
# $4..; $SKIP_PATTERN marks a pass without CUDA.
test_step() {
    NAME=$1
    local bin=$2 limit=$3
    shift 3
    if [ ! -x "$bin" ]; then
        record "$NAME" failed null 0 "" "binary $bin missing"
        return
    fi
    run_step "$NAME" "$limit" "$bin" "$@"
    if [ "$STEP_RC" = skip ]; then
        record "$NAME" skipped null 0 "" "out of time (budget ${TOTAL_BUDGET_S} s)"
        return
    fi
    local reason=""
    local status
    status=$(status_of "$STEP_RC" "${SKIP_PATTERN:-}")
    if [ "$status" = passed_without_cuda ]; then
        reason=$(grep -o -m1 "$SKIP_PATTERN.*" "$OUT_DIR/$NAME.log")
    fi
    record "$NAME" "$status" "$STEP_RC" "$STEP_SECS" "$NAME.log" "$reason"
}

run_checks() {
    local bin=$1
    local gpu=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 4)
        echo "gpu-check: $gpu"
    else
        echo "gpu-check: nvidia-smi not found; the probe will say whether CUDA is usable"
    fi

    # 1. The probe: what the driver answers, before anything else runs.
    NAME=map_probe
    local probe_json=null
    if [ -x "$bin/map_probe" ]; then
        STDOUT_TO="$OUT_DIR/map_probe.json" run_step map_probe "$PROBE_TIMEOUT_S" "$bin/map_probe"
        local status reason=""
        case $STEP_RC in
            skip) status=skipped reason="out of time" ;;
            0) status=passed CUDA_AVAILABLE=true ;;
            77)
                status=unavailable CUDA_AVAILABLE=false
                reason=$(sed -n 's/.*"reason": "\([^"]*\)".*/\1/p' "$OUT_DIR/map_probe.json")
                ;;
            *) status=$(status_of "$STEP_RC") ;;
        esac
        # Its JSON, when it printed one object on one line.
        local line
        line=$(head -n 1 "$OUT_DIR/map_probe.json" 2>/dev/null)
        if [ "$(wc -l <"$OUT_DIR/map_probe.json" 2>/dev/null)" = 1 ] &&
            [ "${line:0:1}" = "{" ] && [ "${line: -1}" = "}" ]; then
            probe_json=$line
        elif [ "$status" = passed ]; then
            status=failed reason="no JSON object on its stdout"
        fi
        if [ "$STEP_RC" = skip ]; then
            record map_probe "$status" null 0 "" "$reason"
        else
            record map_probe "$status" "$STEP_RC" "$STEP_SECS" map_probe.log "$reason"
        fi
    else
        record map_probe failed null 0 "" "binary $bin/map_probe missing"
    fi

    # 2. The latency benchmark, on CUDA only.
    if [ "$CUDA_AVAILABLE" = false ]; then
        record driver_latency skipped null 0 "" "no CUDA (see map_probe)"
    else
        SKIP_PATTERN="" test_step driver_latency "$bin/driver_latency" "$LATENCY_TIMEOUT_S" \
            "${BENCH_ARGS[@]}" --out "$OUT_DIR/driver_latency.md"
    fi

    # 3, 4. The tests that need a GPU (ignored by `cargo test`), on CUDA only.
    if [ "$CUDA_AVAILABLE" = false ]; then
        record conformance skipped null 0 "" "no CUDA (see map_probe)"
        record cuda_data skipped null 0 "" "no CUDA (see map_probe)"
    else
        SKIP_PATTERN="" test_step conformance "$bin/conformance" \
            "$STEP_TIMEOUT_S" --ignored --test-threads 4 --nocapture
        SKIP_PATTERN="" test_step cuda_data "$bin/cuda_data" \
            "$DATA_TIMEOUT_S" --include-ignored --test-threads 1 --nocapture
    fi

    # 5. PyTorch with Quilt (exit 77: no python3, torch or CUDA device).
    NAME=torch_check
    if ! command -v python3 >/dev/null 2>&1; then
        record torch_check skipped null 0 "" "python3 not found"
    elif [ ! -f "$bin/libquilt_torch.so" ]; then
        record torch_check failed null 0 "" "library $bin/libquilt_torch.so missing"
    else
        STDOUT_TO="$OUT_DIR/torch_check.json" run_step torch_check "$TORCH_TIMEOUT_S" \
            python3 scripts/torch_check.py --library "$bin/libquilt_torch.so" --out "$OUT_DIR"
        case $STEP_RC in
            skip) record torch_check skipped null 0 "" "out of time (budget ${TOTAL_BUDGET_S} s)" ;;
            77) record torch_check skipped 77 "$STEP_SECS" torch_check.log "$(head -c 200 "$OUT_DIR/torch_check.json")" ;;
            *) record torch_check "$(status_of "$STEP_RC")" "$STEP_RC" "$STEP_SECS" torch_check.log "" ;;
        esac
    fi

    # 6. A cudarc kernel on Quilt buffers.
    if [ "$CUDA_AVAILABLE" = false ]; then
        record cudarc_kernel skipped null 0 "" "no CUDA (see map_probe)"
    else
        SKIP_PATTERN="" test_step cudarc_kernel "$bin/cudarc_kernel" "$KERNEL_TIMEOUT_S"
    fi

    # 7. CudaBuffer's tests (ignored by `cargo test`).
    if [ "$CUDA_AVAILABLE" = false ]; then
        record cuda_buffer skipped null 0 "" "no CUDA (see map_probe)"
    else
        SKIP_PATTERN="" test_step cuda_buffer "$bin/cuda_buffer" "$KERNEL_TIMEOUT_S" \
            --ignored --test-threads 1 --nocapture
    fi

    # 8. Sharing: device flags, peer access (two or more devices), two-process IPC.
    if [ "$CUDA_AVAILABLE" = false ]; then
        record cuda_share skipped null 0 "" "no CUDA (see map_probe)"
    else
        SKIP_PATTERN="cuda_share: SKIPPED" test_step cuda_share "$bin/cuda_share" \
            "$SHARE_TIMEOUT_S" --ignored --test-threads 1 --nocapture
    fi

    # 9. Sleep and wake on the GPU (ignored by `cargo test`).
    if [ "$CUDA_AVAILABLE" = false ]; then
        record sleep_wake skipped null 0 "" "no CUDA (see map_probe)"
    else
        SKIP_PATTERN="" test_step sleep_wake "$bin/sleep_wake" "$SLEEP_TIMEOUT_S" \
            --ignored --test-threads 1 --nocapture
    fi

    write_findings "$gpu" "$probe_json"
}

# Writes OUT/gpu-check.json; $1 = GPU line(s), $2 = the probe's JSON or null.
write_findings() {
    local gpu=$1 probe=$2
    local file="$OUT_DIR/gpu-check.json"
    local cuda=null
    [ "$CUDA_AVAILABLE" = true ] && cuda=true
    [ "$CUDA_AVAILABLE" = false ] && cuda=false
    local passed=true
    [ "$ANY_FAILED" = 1 ] && passed=false
    local gpu_json=null
    [ -n "$gpu" ] && gpu_json=$(json_str "$gpu")
    local commit=null
    if command -v git >/dev/null 2>&1 && git rev-parse --verify -q HEAD >/dev/null 2>&1; then
        commit=$(json_str "$(git rev-parse HEAD)")
    fi
    {
        echo "{"
        echo "  \"script\": \"scripts/gpu-check.sh\","
        echo "  \"commit\": $commit,"
        echo "  \"date\": $(json_str "$(date -u +%Y-%m-%dT%H:%M:%SZ)"),"
        echo "  \"cuda_available\": $cuda,"
        echo "  \"gpu\": $gpu_json,"
        echo "  \"passed\": $passed,"
        echo "  \"total_seconds\": $((SECONDS - STARTED)),"
        echo "  \"limits\": {\"step_timeout_s\": $STEP_TIMEOUT_S, \"probe_timeout_s\": $PROBE_TIMEOUT_S, \"cuda_data_timeout_s\": $DATA_TIMEOUT_S, \"latency_timeout_s\": $LATENCY_TIMEOUT_S, \"torch_timeout_s\": $TORCH_TIMEOUT_S, \"kernel_timeout_s\": $KERNEL_TIMEOUT_S, \"sleep_wake_timeout_s\": $SLEEP_TIMEOUT_S, \"total_budget_s\": $TOTAL_BUDGET_S, \"proptest_cases\": $(json_num "$PROPTEST_CASES"), \"proptest_max_shrink_iters\": $(json_num "$PROPTEST_MAX_SHRINK_ITERS")},"
        echo "  \"steps\": ["
        local i n=${#STEPS_JSON[@]}
        for ((i = 0; i < n; i++)); do
            if [ $((i + 1)) -lt "$n" ]; then
                echo "    ${STEPS_JSON[$i]},"
            else
                echo "    ${STEPS_JSON[$i]}"
            fi
        done
        echo "  ],"
        echo "  \"probe\": $probe"
        echo "}"
    } >"$file"
    echo "gpu-check: findings in $file"
}

finish() {
    if [ "$ANY_FAILED" = 1 ]; then
        echo "gpu-check: some steps failed (see $OUT_DIR/gpu-check.json)"
        exit 1
    fi
    if [ "$CUDA_AVAILABLE" != true ] && [ "${GPU_CHECK_REQUIRE_GPU:-0}" = 1 ]; then
        echo "gpu-check: CUDA was not available and GPU_CHECK_REQUIRE_GPU=1"
        exit 1
    fi
    echo "gpu-check: done (CUDA available: $CUDA_AVAILABLE)"
    exit 0
}

# ---------------------------------------------------------------- arguments

case "${1:-}" in
    --build)
        [ -n "${2:-}" ] || usage
        OUT_DIR="${GPU_CHECK_OUT:-target/gpu-check}"
        mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
        build_into "$2" "$OUT_DIR/build.log" || exit 1
        ;;
    --prebuilt)
        [ -n "${2:-}" ] || usage
        OUT_DIR="${GPU_CHECK_OUT:-target/gpu-check}"
        mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
        run_checks "$2"
        finish
        ;;
    -h | --help)
        usage
        ;;
    -*)
        die "unknown option $1 (OUT [--prebuilt BIN], --build BIN or --prebuilt BIN)"
        ;;
    *)
        OUT_DIR=${1:-${GPU_CHECK_OUT:-target/gpu-check}}
        mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
        case "${2:-}" in
            --prebuilt)
                [ -n "${3:-}" ] || usage
                run_checks "$3"
                ;;
            "")
                started=$SECONDS
                if build_into "$OUT_DIR/bin" "$OUT_DIR/build.log"; then
                    record build passed 0 $((SECONDS - started)) build.log ""
                    # The budget is for the checks, not the build.
                    STARTED=$SECONDS
                    run_checks "$OUT_DIR/bin"
                else
                    record build failed 1 $((SECONDS - started)) build.log "see build.log"
                    write_findings "" null
                fi
                ;;
            *)
                die "unknown option $2 after $1 (--prebuilt BIN)"
                ;;
        esac
        finish
        ;;
esac
