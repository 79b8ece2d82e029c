#!/usr/bin/env bash
# Instructions and cache misses per operation of Quilt's own calls, by
# callgrind (valgrind) with its cache simulation: deterministic, unlike wall
# time on a shared machine. Four rows:
#   ms10, bert   `quilt-bench ab` on many-streams-10 and bert_large_infer:
#                Quilt's allocate/free calls (the simulated driver's calls
#                inside them included), steady state: the run of 4
#                iterations less the run of 2, per trace event;
#   scale1, 64   `quilt-bench scale --live 1000` at 1 and 64 streams: the
#                timed churn (20,000 steps, 40,000 operations; the
#                simulated driver's calls included).
# Usage: scripts/callgrind-per-op.sh [BIN] [OUTDIR]
#   BIN     a quilt-bench binary (default: target/release/quilt-bench)
#   OUTDIR  where the callgrind files go (default: a new temporary folder)
# Needs valgrind and ../shared/traces/converted/bert_large_infer.trace.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/quilt-bench}
out=${2:-$(mktemp -d)}
mkdir -p "$out"
bert=../shared/traces/converted/bert_large_infer.trace
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 2; }
[ -x "$bin" ] || { echo "no binary at $bin (cargo build --release -p quilt-bench)" >&2; exit 2; }
[ -f "$bert" ] || { echo "no trace at $bert" >&2; exit 2; }
ab() { # name, then the workload arguments
    local name=$1 it
    shift
    for it in 2 4; do
        valgrind --tool=callgrind --cache-sim=yes --collect-atstart=no \
            --toggle-collect='<*QuiltAllocator as quilt_alloc::api::DeviceAllocator>::*' \
            --callgrind-out-file="$out/$name.$it.cg" "$bin" ab "$@" --allocators quilt \
            --iterations "$it" --jobs 1 --no-bisect >/dev/null 2>"$out/$name.$it.log"
    done
}
scale() {
    valgrind --tool=callgrind --cache-sim=yes --collect-atstart=no \
        --toggle-collect='*scale::churn*' --callgrind-out-file="$out/scale$1.cg" \
        "$bin" scale --allocators quilt --live 1000 --streams "$1" --repeat 1 \
        >/dev/null 2>"$out/scale$1.log"
}
ab ms10 --workload many-streams-10 &
ab bert --trace "$bert" &
wait
scale 1 &
scale 64 &
wait
python3 - "$out" "$bert" <<'PY'
import sys
out, bert = sys.argv[1], sys.argv[2]

def collected(path):
    # valgrind's summary: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
    for line in open(path):
        if "Collected :" in line:
            return [int(x) for x in line.split("Collected :")[1].split()]
    sys.exit(f"{path}: no callgrind summary")

def row(name, per_op):
    ir, _, _, i1, d1r, d1w = per_op[:6]
    print(f"{name:8s} {ir:9.0f} {i1:7.1f} {d1r:7.1f} {d1w:7.1f}")

print(f"{'row':8s} {'instr/op':>9s} {'I1/op':>7s} {'D1r/op':>7s} {'D1w/op':>7s}")
events = {"ms10": 16250, "bert": sum(1 for _ in open(bert))}
for name, n in events.items():
    four, two = collected(f"{out}/{name}.4.log"), collected(f"{out}/{name}.2.log")
    row(name, [(a - b) / (2 * n) for a, b in zip(four, two)])
for s in (1, 64):
    row(f"scale{s}", [x / 40000 for x in collected(f"{out}/scale{s}.log")])
print(f"callgrind files: {out}")
PY
