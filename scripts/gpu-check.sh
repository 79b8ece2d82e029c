#!/usr/bin/env bash
# gpu-check.sh: the GPU checks of Quilt's driver layer (quilt-vmm), on a machine
# with an NVIDIA GPU and its driver (libcuda). Under 5 minutes on one GPU.
#
# The default route is prebuilt: build here, carry one folder, run there with
# no compilation (the GPU machine needs no network, cargo or Rust):
#
#   scripts/gpu-check.sh --build [BIN]        1. here (cargo; no GPU needed): build every
#                                                binary the checks run, in release mode,
#                                                stripped, into BIN (default
#                                                target/gpu-check-bin, under 64 MiB) with
#                                                BIN/MANIFEST (sha256) and BIN/BUILD_INFO
#                                                (commit, rustc, glibc needed)
#   scripts/gpu-check.sh [OUT] [--bin BIN]    2. on the GPU machine, from this checkout
#                                                at the same commit, with BIN copied to
#                                                the same place: run the checks from BIN
#                                                (default target/gpu-check-bin); never
#                                                compiles; findings in OUT/gpu-check.json
#                                                (OUT default $GPU_CHECK_OUT, else
#                                                target/gpu-check)
#   scripts/gpu-check.sh OUT --prebuilt BIN   the same as OUT --bin BIN
#   scripts/gpu-check.sh --prebuilt BIN       the same with OUT = $GPU_CHECK_OUT
#   scripts/gpu-check.sh OUT --build-first    a GPU machine with cargo and network:
#                                                build into OUT/bin, then run from it
#
# The steps, in order; each runs under `timeout` (20 to 75 s), the whole run
# stays under TOTAL_BUDGET_S (280 s: a step that would pass it is cut short or
# skipped), and a failed step does not stop the ones after it (but no CUDA
# driver or device stops the run after step 1). Each step's output is printed
# as it goes and kept in OUT/<step>.log:
#   1. map_probe (crates/vmm/examples/map_probe.rs): asks the real driver,
#      bypassing Quilt's ledger, whether it accepts cuMemMap at an offset of one
#      granule into a two-granule handle, cuMemMap of a one-granule prefix of a
#      two-granule handle, cuMemSetAccess on one granule of a two-granule
#      mapping and across two adjacent reservations, and one cuMemUnmap over
#      two adjacent mappings; whether CU_STREAM_PER_THREAD (0x2) is per
#      thread; what create/map/set-access/event calls return under relaxed
#      stream capture; and, last and each in a child process of its own,
#      whether cuMemUnmap waits for work queued over the mapping (timed). It
#      reports case by case: OUT/map_probe.json is rewritten after every case
#      (so a crash midway keeps the earlier answers) and copied into the
#      findings as "probe";
#   2. driver_latency: the driver-call latency micro-benchmark on CUDA (every
#      VMM call, one thread, 1000 calls of 2 MiB, 200 of 64 MiB; then 1000
#      rounds of the stream calls: event record, query, stream wait,
#      cuStreamIsCapturing, event destroy, which the cost model prices at
#      2 us each until measured); the Markdown
#      table goes to OUT/driver_latency.md, which docs/benchmarks.md can take;
#   3. conformance (crates/vmm/tests/conformance.rs): its two CUDA tests
#      (every shared check, and the differential check against the
#      simulated backend, on the CUDA backend), with PROPTEST_CASES and
#      PROPTEST_MAX_SHRINK_ITERS bounded;
#   4. cuda_data (crates/vmm/tests/cuda_data.rs): bytes through stitched
#      mappings with cuMemcpy, streams, events, contexts, out-of-memory
#      figures;
#   (The test steps 3, 4, 7, 8 and 9 run with QUILT_CUDA_TESTS=real: the tests
#   that `cargo test` runs over the CUDA double run on the real driver instead;
#   a test binary that runs no test at all is a failure, not a pass.)
#   5. torch_check (scripts/torch_check.py, with libquilt_torch.so): PyTorch
#      on the GPU under a memory fraction, a fragmenting pattern with the
#      native allocator and with quilt_torch.enable(), tensor contents, the
#      mempool() route, a snapshot of the real run; skipped with the reason
#      where python3, torch or a CUDA device is missing;
#   6. cudarc_kernel (crates/alloc/examples/cudarc_kernel.rs): a cudarc kernel
#      reading and writing Quilt buffers through cudarc's traits, on a second
#      stream, checked element by element;
#   7. cuda_buffer (crates/alloc/tests/cuda_buffer.rs): cudarc's
#      copies through Quilt buffers across two streams, typed errors, frees;
#   8. cuda_share (crates/vmm/tests/cuda_share.rs): the sharing
#      flags the device reports (POSIX fd, FABRIC, GPUDirect RDMA with VMM,
#      recommended granularity: one "cuda_share: caps {...}" line), peer
#      access for every device in one cuMemSetAccess (left out, with the
#      reason, where nvidia-smi lists fewer than two devices: the test fails
#      on one device rather than pass unrun), and export / import of a handle between
#      two processes on device 0 (the test re-runs itself as the child; the
#      fd crosses a Unix socket), bytes both ways;
#   9. sleep_wake (crates/alloc/tests/sleep_wake.rs), its CUDA test: a tagged
#      block and a growable buffer keep every byte through growth, sleep
#      (offload), reuse of their pages by another block, and wake, on the GPU.
#
# Findings: OUT/gpu-check.json, one object, rewritten (whole, through a
# rename) when the run starts, before each step and after each step, so a run
# that is killed leaves what it had: "finished" (false until the end),
# "current_step", whether CUDA was available, the GPU, the binaries used (their
# build commit and whether their checksums matched), the limits, each step
# (name, status, exit_status, seconds, log file, reason) and the probe's JSON.
# Step status: passed, failed, timed_out, unavailable (the probe found no CUDA
# driver or device), skipped (with the reason), or passed_with_skips (the
# test binary passed, but some of its tests were left out, e.g. peer
# access on a machine with one device: the reason lists each). Exit status: 0 when every step
# passed or was skipped for a reason other than CUDA; 1 when a step failed or
# timed out, or the binaries are missing, do not match their MANIFEST or need
# a newer glibc than this machine has; 2 on
# bad usage; 3 when there is no usable CUDA driver or device (the run stops
# after the probe, and the findings say why; GPU_CHECK_ALLOW_NO_GPU=1 makes
# that 0).
#
# Step by step, prebuilt (the default):
#     scripts/gpu-check.sh --build                  # here: target/gpu-check-bin/
#     # carry target/gpu-check-bin/ (x86-64 Linux, glibc) to the same path in a
#     # checkout of the same commit on the GPU machine, then there:
#     scripts/gpu-check.sh "$OUT"                   # findings: $OUT/gpu-check.json

set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

DEFAULT_BIN=target/gpu-check-bin
MAX_BIN_BYTES=$((64 * 1024 * 1024))
TOTAL_BUDGET_S=${GPU_CHECK_BUDGET_S:-280}
STEP_TIMEOUT_S=75
LATENCY_TIMEOUT_S=60
PROBE_TIMEOUT_S=60
DATA_TIMEOUT_S=55
TORCH_TIMEOUT_S=60
KERNEL_TIMEOUT_S=20
SHARE_TIMEOUT_S=30
SLEEP_TIMEOUT_S=30
export PROPTEST_CASES=${PROPTEST_CASES:-32}
export PROPTEST_MAX_SHRINK_ITERS=${PROPTEST_MAX_SHRINK_ITERS:-64}
# The CUDA tests run on the real driver, not over the double (crates/cuda-double).
export QUILT_CUDA_TESTS=real
BENCH_ARGS=(--backend cuda --iters 1000 --large-iters 200)
BINARIES=(map_probe driver_latency conformance cuda_data cudarc_kernel cuda_buffer cuda_share sleep_wake)
LIBRARIES=(libquilt_torch.so)

die() {
    echo "gpu-check: $*" >&2
    exit 2
}

# Prints the usage; exits with $1 (default 2).
usage() {
    sed -n '4,24p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit "${1:-2}"
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
gpu-check: cargo is not installed here. Build the binaries on a machine that
has cargo (same CPU architecture, x86-64 Linux):
    scripts/gpu-check.sh --build
carry target/gpu-check-bin/ to the same path in this checkout, and run:
    scripts/gpu-check.sh OUT
EOF
        return 1
    fi
}

# The path of the test executable that `cargo test --no-run` ($@) reports
# last, or nothing; cargo's output is appended to $LOG.
test_executable() {
    cargo test --release "$@" --no-run 2>&1 |
        tee -a "$LOG" |
        sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -n 1
}

# Builds every binary the checks run (release mode) into $1, stripped, with
# $1/MANIFEST (sha256sum's format) and $1/BUILD_INFO; logs to $2. Returns
# non-zero (with the reason on stderr) when something did not build or the
# folder would pass 64 MiB.
build_into() {
    local dir=$1
    LOG=$2
    need_cargo || return 1
    mkdir -p "$dir" || return 1
    local f
    for f in "${BINARIES[@]}" "${LIBRARIES[@]}" MANIFEST BUILD_INFO; do
        rm -f "${dir:?}/$f"
    done
    local target_dir
    target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    target_dir=${target_dir:-target}
    local exe t
    for t in conformance cuda_data cuda_share; do
        echo "gpu-check: building test $t (quilt-vmm)"
        exe=$(test_executable -p quilt-vmm --test "$t")
        if [ -z "$exe" ] || [ ! -x "$exe" ]; then
            echo "gpu-check: could not build test $t (see $LOG)" >&2
            return 1
        fi
        cp "$exe" "$dir/$t" || return 1
    done
    for t in cuda_buffer sleep_wake; do
        echo "gpu-check: building test $t (quilt-alloc)"
        exe=$(test_executable -p quilt-alloc --test "$t")
        if [ -z "$exe" ] || [ ! -x "$exe" ]; then
            echo "gpu-check: could not build test $t (see $LOG)" >&2
            return 1
        fi
        cp "$exe" "$dir/$t" || return 1
    done
    echo "gpu-check: building the examples map_probe, driver_latency, cudarc_kernel"
    if ! cargo build --release -p quilt-vmm --example map_probe >>"$LOG" 2>&1; then
        echo "gpu-check: could not build the map_probe example (see $LOG)" >&2
        return 1
    fi
    if ! cargo build --release -p quilt-bench --example driver_latency >>"$LOG" 2>&1; then
        echo "gpu-check: could not build the driver_latency example (see $LOG)" >&2
        return 1
    fi
    if ! cargo build --release -p quilt-alloc --example cudarc_kernel >>"$LOG" 2>&1; then
        echo "gpu-check: could not build the cudarc_kernel example (see $LOG)" >&2
        return 1
    fi
    for t in driver_latency map_probe cudarc_kernel; do
        cp "$target_dir/release/examples/$t" "$dir/$t" || return 1
    done
    echo "gpu-check: building libquilt_torch.so"
    if ! cargo build --release -p quilt-torch >>"$LOG" 2>&1; then
        echo "gpu-check: could not build quilt-torch (see $LOG)" >&2
        return 1
    fi
    cp "$target_dir/release/libquilt_torch.so" "$dir/" || return 1
    # Debug info is not needed to run them; stripping keeps the folder small.
    if command -v strip >/dev/null 2>&1; then
        for t in "${BINARIES[@]}"; do
            strip "$dir/$t" || return 1
        done
        for t in "${LIBRARIES[@]}"; do
            strip --strip-debug "$dir/$t" || return 1
        done
    else
        echo "gpu-check: strip not found; the binaries keep their debug info" >&2
    fi
    (cd "$dir" && sha256sum "${BINARIES[@]}" "${LIBRARIES[@]}" >MANIFEST) || return 1
    {
        echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
        if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
            echo "dirty yes (tracked files differed from the commit)"
        else
            echo "dirty no"
        fi
        echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "rustc $(rustc -V 2>/dev/null || echo unknown)"
        echo "host $(uname -sm)"
        # The newest glibc symbol version any of them needs (the GPU
        # machine's glibc must be at least this).
        if command -v objdump >/dev/null 2>&1; then
            echo "glibc_needed $(cd "$dir" && objdump -T "${BINARIES[@]}" "${LIBRARIES[@]}" 2>/dev/null |
                grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -n 1 | sed 's/GLIBC_//')"
        fi
    } >"$dir/BUILD_INFO"
    local bytes
    bytes=$(du -cb "$dir"/* | tail -n 1 | cut -f 1)
    if [ "$bytes" -gt "$MAX_BIN_BYTES" ]; then
        echo "gpu-check: $dir holds $bytes bytes, over the 64 MiB that can be carried" >&2
        return 1
    fi
    echo "gpu-check: built ${BINARIES[*]} ${LIBRARIES[*]} into $dir ($((bytes / 1024)) KiB)"
    echo "gpu-check: next, on the GPU machine (same commit, $dir at the same path):"
    if [ "$dir" = "$DEFAULT_BIN" ]; then
        echo "    scripts/gpu-check.sh OUT"
    else
        echo "    scripts/gpu-check.sh OUT --bin $dir"
    fi
}

# ---------------------------------------------------------------- the run

STARTED=$SECONDS
STEPS_JSON=()
ANY_FAILED=0
CUDA_AVAILABLE=unknown
CUDA_REASON=""
GPU_LINE=""
PROBE_JSON=null
CURRENT_STEP=""
FINISHED=false
BIN_COMMIT=""
BIN_CHECKED=null
BIN_GLIBC=""
HOST_GLIBC=""

# Records one step: name, status, exit status ("null" when not run), seconds,
# log file (relative to the output folder), reason (may be empty); then
# rewrites the findings.
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
    CURRENT_STEP=""
    echo "== gpu-check: $name: $status${reason:+ ($reason)} in ${secs} s"
    write_findings
}

# Runs one step: $1 = name, $2 = timeout in seconds, rest = command. Its
# stdout and stderr are printed as they come and kept in OUT/<name>.log; with
# STDOUT_TO set, its stdout alone also goes to that file. Sets STEP_RC and
# STEP_SECS. Never exits the script.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL_BUDGET_S - (SECONDS - STARTED)))
    if [ "$left" -lt 10 ]; then
        STEP_RC=skip
        STEP_SECS=0
        return
    fi
    # `timeout --kill-after=5` may take 5 s more.
    [ "$limit" -gt $((left - 5)) ] && limit=$((left - 5))
    echo "== gpu-check: $name (limit ${limit} s)"
    CURRENT_STEP=$name
    write_findings
    local cmd=("$@")
    if command -v timeout >/dev/null 2>&1; then
        cmd=(timeout --kill-after=5 "$limit" "$@")
    fi
    local started=$SECONDS
    if [ -n "${STDOUT_TO:-}" ]; then
        # stdout to the terminal and $STDOUT_TO, stderr to the terminal and
        # a side file; both then make the log.
        { "${cmd[@]}" 2>&1 1>&3 3>&- | tee "$OUT_DIR/$name.stderr" >&2; } 3>&1 |
            tee "$STDOUT_TO"
        STEP_RC=${PIPESTATUS[0]}
        cat "$STDOUT_TO" "$OUT_DIR/$name.stderr" >"$OUT_DIR/$name.log" 2>/dev/null
        rm -f "$OUT_DIR/$name.stderr"
    else
        "${cmd[@]}" 2>&1 | tee "$OUT_DIR/$name.log"
        STEP_RC=${PIPESTATUS[0]}
    fi
    STEP_SECS=$((SECONDS - started))
}

# The status of a finished step from its exit status ($1).
status_of() {
    local rc=$1
    case $rc in
        0) echo passed ;;
        124 | 137) echo timed_out ;;
        *) echo failed ;;
    esac
}

# Runs the test binary or example $2 as step $1 with timeout $3 and arguments
# $4..; $LEFT_OUT, when set, names the tests the arguments leave out and
# why (a pass is then passed_with_skips, with that reason).
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
    status=$(status_of "$STEP_RC")
    if [ "$status" = passed ] && [ -n "${LEFT_OUT:-}" ]; then
        status=passed_with_skips reason=$LEFT_OUT
    fi
    # A test binary whose filter or ignore attributes left nothing to run
    # passes without checking anything.
    if [ "$status" != failed ] && [ "$status" != timed_out ] &&
        grep -q '^test result: ok\. 0 passed' "$OUT_DIR/$NAME.log"; then
        status=failed reason="no test ran (0 passed)"
    fi
    record "$NAME" "$status" "$STEP_RC" "$STEP_SECS" "$NAME.log" "$reason"
}

# Checks the prebuilt folder $1 before anything runs from it: every binary
# there, and, where sha256sum exists, every checksum of its MANIFEST. Records
# step "binaries"; returns non-zero when the folder cannot be used.
check_binaries() {
    local bin=$1 missing="" t
    for t in "${BINARIES[@]}" "${LIBRARIES[@]}" MANIFEST; do
        [ -f "$bin/$t" ] || missing+=" $t"
    done
    if [ -f "$bin/BUILD_INFO" ]; then
        BIN_COMMIT=$(sed -n 's/^commit //p' "$bin/BUILD_INFO")
        BIN_GLIBC=$(sed -n 's/^glibc_needed //p' "$bin/BUILD_INFO")
    fi
    HOST_GLIBC=$(ldd --version 2>/dev/null | head -n 1 | grep -o '[0-9][0-9.]*$')
    if [ -n "$missing" ]; then
        echo "gpu-check: no prebuilt binaries: missing in $bin:$missing" >&2
        echo "gpu-check: build them with \`scripts/gpu-check.sh --build\` on a machine with cargo, and carry $bin here" >&2
        record binaries failed null 0 "" "missing in $bin:$missing; build them with \`scripts/gpu-check.sh --build\` on a machine with cargo and carry $bin here"
        return 1
    fi
    if [ -n "$BIN_GLIBC" ] && [ -n "$HOST_GLIBC" ] &&
        [ "$(printf '%s\n%s\n' "$BIN_GLIBC" "$HOST_GLIBC" | sort -V | head -n 1)" != "$BIN_GLIBC" ]; then
        record binaries failed null 0 "" "the binaries need glibc $BIN_GLIBC, this machine has $HOST_GLIBC: build them on an older system"
        return 1
    fi
    if command -v sha256sum >/dev/null 2>&1; then
        if (cd "$bin" && sha256sum --quiet -c MANIFEST) >"$OUT_DIR/binaries.log" 2>&1; then
            BIN_CHECKED=true
        else
            BIN_CHECKED=false
            cat "$OUT_DIR/binaries.log"
            record binaries failed 1 0 binaries.log "checksums differ from $bin/MANIFEST (a partial copy?)"
            return 1
        fi
    fi
    local head reason=""
    head=$(git rev-parse HEAD 2>/dev/null)
    if [ -n "$head" ] && [ -n "$BIN_COMMIT" ] && [ "$head" != "$BIN_COMMIT" ]; then
        reason="built at $BIN_COMMIT, this checkout is at $head"
        echo "gpu-check: warning: binaries $reason"
    fi
    record binaries passed 0 0 "" "$reason"
}

# The number of CUDA devices visible to the tests (nvidia-smi's list, cut
# to CUDA_VISIBLE_DEVICES where set), or nothing where nvidia-smi is absent.
gpu_count() {
    command -v nvidia-smi >/dev/null 2>&1 || return 0
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
        local visible
        visible=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
        [ "$visible" -lt "$n" ] && n=$visible
    fi
    echo "$n"
}

# The remaining steps when the run stops early: each skipped with reason $1.
skip_rest() {
    local t
    for t in driver_latency conformance cuda_data torch_check cudarc_kernel cuda_buffer cuda_share sleep_wake; do
        record "$t" skipped null 0 "" "$1"
    done
}

run_checks() {
    local bin=$1
    write_findings
    if ! check_binaries "$bin"; then
        record map_probe skipped null 0 "" "no usable binaries (see step binaries)"
        skip_rest "no usable binaries (see step binaries)"
        return
    fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        GPU_LINE=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 4)
        echo "gpu-check: $GPU_LINE"
    else
        echo "gpu-check: nvidia-smi not found; the probe will say whether CUDA is usable"
    fi

    # 1. The probe: what the driver answers, before anything else runs.
    NAME=map_probe
    local probe_file="$OUT_DIR/map_probe.json"
    rm -f "$probe_file"
    run_step map_probe "$PROBE_TIMEOUT_S" "$bin/map_probe" --out "$probe_file"
    local status reason=""
    case $STEP_RC in
        skip) status=skipped reason="out of time" ;;
        0) status=passed CUDA_AVAILABLE=true ;;
        77)
            status=unavailable CUDA_AVAILABLE=false
            reason=$(sed -n 's/.*"reason": "\([^"]*\)".*/\1/p' "$probe_file" 2>/dev/null | head -n 1)
            CUDA_REASON=${reason:-the probe found no CUDA driver or device}
            ;;
        *) status=$(status_of "$STEP_RC") ;;
    esac
    # Its JSON (one object on one line), whole or as far as it got.
    local line=""
    [ -f "$probe_file" ] && line=$(head -n 1 "$probe_file")
    if [ -n "$line" ] && [ "$(wc -l <"$probe_file")" = 1 ] &&
        [ "${line:0:1}" = "{" ] && [ "${line: -1}" = "}" ]; then
        PROBE_JSON=$line
        if [ "$status" = passed ] && ! grep -q '"complete": true' "$probe_file"; then
            status=failed reason="the probe's report is incomplete"
        fi
    elif [ "$status" = passed ]; then
        status=failed reason="no JSON object in $probe_file"
    fi
    if [ "$STEP_RC" = skip ]; then
        record map_probe "$status" null 0 "" "$reason"
    else
        record map_probe "$status" "$STEP_RC" "$STEP_SECS" map_probe.log "$reason"
    fi
    if [ "$CUDA_AVAILABLE" = false ]; then
        echo "gpu-check: stopping after the probe: $CUDA_REASON"
        skip_rest "no CUDA (see map_probe)"
        return
    fi

    # 2. The latency benchmark.
    test_step driver_latency "$bin/driver_latency" "$LATENCY_TIMEOUT_S" \
        "${BENCH_ARGS[@]}" --out "$OUT_DIR/driver_latency.md"

    # 3, 4. The tests that need a GPU (ignored by `cargo test`).
    test_step conformance "$bin/conformance" "$STEP_TIMEOUT_S" \
        cuda_backend_passes_the_shared_checks cuda_agrees_with_the_simulated_one --exact \
        --include-ignored --test-threads 2 --nocapture
    test_step cuda_data "$bin/cuda_data" \
        "$DATA_TIMEOUT_S" --include-ignored --test-threads 1 --nocapture

    # 5. PyTorch with Quilt (exit 77: no python3, torch or CUDA device).
    NAME=torch_check
    if ! command -v python3 >/dev/null 2>&1; then
        record torch_check skipped null 0 "" "python3 not found"
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
    test_step cudarc_kernel "$bin/cudarc_kernel" "$KERNEL_TIMEOUT_S"

    # 7. CudaBuffer's tests (ignored by `cargo test`).
    test_step cuda_buffer "$bin/cuda_buffer" "$KERNEL_TIMEOUT_S" \
        --include-ignored --test-threads 1 --nocapture

    # 8. Sharing: device flags, peer access (two or more devices), two-process IPC.
    local share_args=(--include-ignored --test-threads 1 --nocapture) devices left_out=""
    devices=$(gpu_count)
    if [ -n "$devices" ] && [ "$devices" -lt 2 ]; then
        share_args+=(--skip cuda_share_peer_access_for_every_device)
        left_out="cuda_share_peer_access_for_every_device left out: it needs two or more devices, this machine has $devices"
    fi
    LEFT_OUT=$left_out test_step cuda_share "$bin/cuda_share" "$SHARE_TIMEOUT_S" "${share_args[@]}"

    # 9. Sleep and wake on the GPU (ignored by `cargo test`).
    test_step sleep_wake "$bin/sleep_wake" "$SLEEP_TIMEOUT_S" \
        sleep_wake_on_cuda_keeps_every_byte --exact --include-ignored --test-threads 1 --nocapture
}

# Rewrites OUT/gpu-check.json with everything known so far (whole, through a
# rename: a reader never sees half of it).
write_findings() {
    local file="$OUT_DIR/gpu-check.json"
    local cuda=null
    [ "$CUDA_AVAILABLE" = true ] && cuda=true
    [ "$CUDA_AVAILABLE" = false ] && cuda=false
    local passed=true
    [ "$ANY_FAILED" = 1 ] && passed=false
    [ "$CUDA_AVAILABLE" = false ] && passed=false
    local gpu_json=null
    [ -n "$GPU_LINE" ] && gpu_json=$(json_str "$GPU_LINE")
    local reason=null
    [ -n "$CUDA_REASON" ] && reason=$(json_str "$CUDA_REASON")
    local current=null
    [ -n "$CURRENT_STEP" ] && current=$(json_str "$CURRENT_STEP")
    local bin_commit=null
    [ -n "$BIN_COMMIT" ] && bin_commit=$(json_str "$BIN_COMMIT")
    local bin_glibc=null host_glibc=null
    [ -n "$BIN_GLIBC" ] && bin_glibc=$(json_str "$BIN_GLIBC")
    [ -n "$HOST_GLIBC" ] && host_glibc=$(json_str "$HOST_GLIBC")
    local commit=null
    if command -v git >/dev/null 2>&1 && git rev-parse --verify -q HEAD >/dev/null 2>&1; then
        commit=$(json_str "$(git rev-parse HEAD)")
    fi
    {
        echo "{"
        echo "  \"script\": \"scripts/gpu-check.sh\","
        echo "  \"commit\": $commit,"
        echo "  \"date\": $(json_str "$(date -u +%Y-%m-%dT%H:%M:%SZ)"),"
        echo "  \"finished\": $FINISHED,"
        echo "  \"current_step\": $current,"
        echo "  \"cuda_available\": $cuda,"
        echo "  \"no_cuda_reason\": $reason,"
        echo "  \"gpu\": $gpu_json,"
        echo "  \"binaries\": {\"dir\": $(json_str "$BIN_DIR"), \"build_commit\": $bin_commit, \"checksums_match\": $BIN_CHECKED, \"glibc_needed\": $bin_glibc, \"host_glibc\": $host_glibc},"
        echo "  \"passed\": $passed,"
        echo "  \"total_seconds\": $((SECONDS - STARTED)),"
        echo "  \"limits\": {\"step_timeout_s\": $STEP_TIMEOUT_S, \"probe_timeout_s\": $PROBE_TIMEOUT_S, \"cuda_data_timeout_s\": $DATA_TIMEOUT_S, \"latency_timeout_s\": $LATENCY_TIMEOUT_S, \"torch_timeout_s\": $TORCH_TIMEOUT_S, \"kernel_timeout_s\": $KERNEL_TIMEOUT_S, \"share_timeout_s\": $SHARE_TIMEOUT_S, \"sleep_wake_timeout_s\": $SLEEP_TIMEOUT_S, \"total_budget_s\": $TOTAL_BUDGET_S, \"proptest_cases\": $(json_num "$PROPTEST_CASES"), \"proptest_max_shrink_iters\": $(json_num "$PROPTEST_MAX_SHRINK_ITERS")},"
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
        echo "  \"probe\": $PROBE_JSON"
        echo "}"
    } >"$file.tmp" && mv -f "$file.tmp" "$file"
}

finish() {
    FINISHED=true
    write_findings
    echo "gpu-check: findings in $OUT_DIR/gpu-check.json"
    if [ "$ANY_FAILED" = 1 ]; then
        echo "gpu-check: some steps failed (see $OUT_DIR/gpu-check.json)"
        exit 1
    fi
    if [ "$CUDA_AVAILABLE" = false ]; then
        echo "gpu-check: no CUDA driver or device ($CUDA_REASON)"
        [ "${GPU_CHECK_ALLOW_NO_GPU:-0}" = 1 ] && exit 0
        exit 3
    fi
    echo "gpu-check: done (CUDA available: $CUDA_AVAILABLE) in $((SECONDS - STARTED)) s"
    exit 0
}

# Runs the checks from $BIN_DIR into $OUT_DIR; never compiles.
run_prebuilt() {
    mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
    echo "gpu-check: running from $BIN_DIR (no compilation); findings in $OUT_DIR/gpu-check.json"
    run_checks "$BIN_DIR"
    finish
}

# ---------------------------------------------------------------- arguments

OUT_DIR=${GPU_CHECK_OUT:-target/gpu-check}
BIN_DIR=$DEFAULT_BIN
case "${1:-}" in
    --build)
        [ $# -le 2 ] || usage
        BIN_DIR=${2:-$DEFAULT_BIN}
        mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
        build_into "$BIN_DIR" "$OUT_DIR/build.log" || exit 1
        ;;
    --prebuilt | --bin)
        { [ -n "${2:-}" ] && [ $# -eq 2 ]; } || usage
        BIN_DIR=$2
        run_prebuilt
        ;;
    -h | --help)
        usage 0
        ;;
    -*)
        die "unknown option $1 (see --help)"
        ;;
    *)
        [ -n "${1:-}" ] && OUT_DIR=$1
        case "${2:-}" in
            --prebuilt | --bin)
                { [ -n "${3:-}" ] && [ $# -eq 3 ]; } || usage
                BIN_DIR=$3
                run_prebuilt
                ;;
            --build-first)
                [ $# -eq 2 ] || usage
                mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
                BIN_DIR=$OUT_DIR/bin
                started=$SECONDS
                if build_into "$BIN_DIR" "$OUT_DIR/build.log"; then
                    record build passed 0 $((SECONDS - started)) build.log ""
                    # The budget is for the checks, not the build.
                    STARTED=$SECONDS
                    run_checks "$BIN_DIR"
                else
                    record build failed 1 $((SECONDS - started)) build.log "see build.log"
                fi
                finish
                ;;
            "")
                [ $# -le 1 ] || usage
                run_prebuilt
                ;;
            *)
                die "unknown option $2 after $1 (--bin BIN, --prebuilt BIN or --build-first)"
                ;;
        esac
        ;;
esac
