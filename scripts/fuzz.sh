#!/usr/bin/env bash
# Run each cargo-fuzz target of fuzz/ for a given number of seconds, one after
# the other (not part of CI; needs nightly and `cargo install cargo-fuzz`).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     default: 180 s, every target
#
# libFuzzer runs in fork mode with -ignore_crashes=1, so a run goes on for its
# whole time after a finding; every crash is kept in fuzz/artifacts/<target>/
# and the final line gives executions and crash counts.
#
# Targets: trace_parser, snapshot_import, alloc_ops. Seeds are written to
# fuzz/corpus/<target>/ when the corpus is empty; findings land in
# fuzz/artifacts/<target>/. Built without a sanitizer (`-s none`): the code under
# test is safe Rust (`#![forbid(unsafe_code)]` crates and the simulated backend),
# so AddressSanitizer adds cost and no checks. The last lines of each run
# (executions, corpus size) are printed; see docs/reliability.md for the figures.
set -euo pipefail

seconds="${1:-180}"
shift || true
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
    targets=(trace_parser snapshot_import alloc_ops)
fi

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/fuzz"

seed() {
    local target="$1" dir="corpus/$1"
    mkdir -p "$dir"
    if [ -n "$(ls -A "$dir")" ]; then
        return
    fi
    case "$target" in
        trace_parser)
            printf 'a 0 100 0\na 1 2097152 1\nf 0\na 2 512 0\nf 1\nf 2\n' > "$dir/small"
            local real="$root/../shared/traces/converted/cnn_counterfactual_eor.trace"
            if [ -f "$real" ]; then head -c 3000 "$real" > "$dir/real-head"; fi
            ;;
        snapshot_import)
            python3 - "$dir" <<'PY'
import pickle, sys, os
d = sys.argv[1]
def entry(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0}
seg = 0x40000000
snap = {
    "segments": [{"device": 0, "address": seg, "total_size": 2 << 20, "stream": 0,
                  "blocks": [{"address": seg, "size": 4096, "requested_size": 4000,
                              "state": "active_allocated"},
                             {"address": seg + 4096, "size": 4096, "state": "inactive"}]}],
    "device_traces": [[entry("alloc", seg + 8192, 100), entry("free_requested", seg + 8192, 100),
                       entry("free_completed", seg + 8192, 100), entry("alloc", seg + 8192, 200, 7),
                       entry("segment_alloc", 1 << 33, 1 << 21), entry("free_completed", seg, 4000)]],
    "allocator_settings": {},
}
for proto in (2, 4):
    with open(os.path.join(d, f"snap-p{proto}"), "wb") as f:
        pickle.dump(snap, f, protocol=proto)
PY
            ;;
        alloc_ops)
            head -c 512 /dev/urandom > "$dir/random"
            ;;
    esac
}

for target in "${targets[@]}"; do
    seed "$target"
    echo "== $target for ${seconds}s"
    mkdir -p artifacts
    log="artifacts/$target.log"
    cargo +nightly fuzz run -s none -O "$target" -- \
        -max_total_time="$seconds" -max_len=4096 -fork=1 -ignore_crashes=1 \
        -artifact_prefix="artifacts/$target/" > "$log" 2>&1 || true
    grep -E 'panicked at' "$log" | sort | uniq -c | sort -rn | head -n 8 || true
    grep -E '^#[0-9]+: ' "$log" | tail -n 1
    echo "crashes kept: $(ls "artifacts/$target" 2>/dev/null | grep -c '^crash-' || true)"
    echo "full log: fuzz/$log"
done
