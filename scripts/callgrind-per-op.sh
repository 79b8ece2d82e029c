#!/usr/bin/env bash
# Instructions and cache misses per operation of Quilt's own calls, by
# callgrind (valgrind) with its cache simulation: deterministic, unlike wall
# time on a shared machine. Four rows by default:
#   ms10, bert   `quilt-bench ab` on many-streams-10 and bert_large_infer:
#                Quilt's allocate/free calls (the simulated driver's calls
#                inside them included), steady state: the run of 4
#                iterations less the run of 2, per trace event;
#   scale1, 64   `quilt-bench scale --live 1000` at 1 and 64 streams: the
#                timed churn (20,000 steps, 40,000 operations; the
#                simulated driver's calls included).
# With --trace FILE..., two `ab` rows per trace instead (steady state, as
# ms10 and bert): Quilt's calls and classic's (the caching allocator's
# allocate/free, the simulated driver's calls inside them included), and
# their ratio. With --sizes, one row per allocator (quilt, classic),
# block size (2 MiB to 1 GiB) and stream count (1, 4) instead: the timed
# churn of `quilt-bench sizes` (16 live blocks, 2,000 steps).
# Usage: scripts/callgrind-per-op.sh [BIN] [OUTDIR] [--trace FILE... | --sizes]
#   BIN     a quilt-bench binary (default: target/release/quilt-bench)
#   OUTDIR  where the callgrind files go (default: a new temporary folder)
# Needs valgrind and, by default, ../shared/traces/converted/bert_large_infer.trace.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/quilt-bench
out=
mode=rows
traces=()
positional=0
while [ $# -gt 0 ]; do
    case $1 in
    --sizes) mode=sizes ;;
    --trace)
        mode=traces
        shift
        while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do
            traces+=("$1")
            shift
        done
        continue
        ;;
    *)
        case $positional in
        0) bin=$1 ;;
        1) out=$1 ;;
        *) echo "callgrind-per-op: unexpected argument $1" >&2; exit 2 ;;
        esac
        positional=$((positional + 1))
        ;;
    esac
    shift
done
out=${out:-$(mktemp -d)}
mkdir -p "$out"
bert=../shared/traces/converted/bert_large_infer.trace
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 2; }
[ -x "$bin" ] || { echo "no binary at $bin (cargo build --release -p quilt-bench)" >&2; exit 2; }
if [ "$mode" = traces ] && [ ${#traces[@]} -eq 0 ]; then
    echo "callgrind-per-op: --trace needs at least one file" >&2
    exit 2
fi
for t in "${traces[@]}"; do
    [ -f "$t" ] || { echo "no trace at $t" >&2; exit 2; }
done
ab() { # name, then the workload arguments
    ab_of quilt QuiltAllocator "$@"
}
ab_of() { # allocator, its type, name, then the workload arguments
    local allocator=$1 type=$2 name=$3 it
    shift 3
    for it in 2 4; do
        valgrind --tool=callgrind --cache-sim=yes --collect-atstart=no \
            --toggle-collect="<*$type as quilt_alloc::api::DeviceAllocator>::*" \
            --callgrind-out-file="$out/$name.$it.cg" "$bin" ab "$@" --allocators "$allocator" \
            --iterations "$it" --jobs 1 --no-bisect >/dev/null 2>"$out/$name.$it.log"
    done
}
scale() {
    valgrind --tool=callgrind --cache-sim=yes --collect-atstart=no \
        --toggle-collect='*scale::churn*' --callgrind-out-file="$out/scale$1.cg" \
        "$bin" scale --allocators quilt --live 1000 --streams "$1" --repeat 1 \
        >/dev/null 2>"$out/scale$1.log"
}
sizes() { # allocator, size, streams
    valgrind --tool=callgrind --cache-sim=yes --collect-atstart=no \
        --toggle-collect='*scale::churn*' --callgrind-out-file="$out/size-$1-$2-$3.cg" \
        "$bin" sizes --allocators "$1" --sizes "$2" --streams "$3" --steps 2000 --repeat 1 \
        >/dev/null 2>"$out/size-$1-$2-$3.log"
}
size_list="2MiB 4MiB 8MiB 16MiB 32MiB 64MiB 128MiB 256MiB 512MiB 1GiB"
case $mode in
rows)
    [ -f "$bert" ] || { echo "no trace at $bert" >&2; exit 2; }
    ab ms10 --workload many-streams-10 &
    ab bert --trace "$bert" &
    wait
    scale 1 &
    scale 64 &
    wait
    ;;
traces)
    for t in "${traces[@]}"; do
        ab "$(basename "$t" .trace)" --trace "$t" &
        ab_of classic CachingAllocator "classic-$(basename "$t" .trace)" --trace "$t" &
        wait
    done
    ;;
sizes)
    for a in quilt classic; do
        for s in $size_list; do
            sizes "$a" "$s" 1 &
            sizes "$a" "$s" 4 &
            wait
        done
    done
    ;;
esac
python3 - "$out" "$mode" "$bert" "$size_list" "${traces[@]}" <<'PY'
import os
import sys

out, mode, bert, size_list, traces = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]

def collected(path):
    # valgrind's summary: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
    for line in open(path):
        if "Collected :" in line:
            return [int(x) for x in line.split("Collected :")[1].split()]
    sys.exit(f"{path}: no callgrind summary")

def row(name, per_op):
    ir, _, _, i1, d1r, d1w = per_op[:6]
    print(f"{name:24s} {ir:9.0f} {i1:7.1f} {d1r:7.1f} {d1w:7.1f}")

def steady(name, n, label=None):
    four, two = collected(f"{out}/{name}.4.log"), collected(f"{out}/{name}.2.log")
    per_op = [(a - b) / (2 * n) for a, b in zip(four, two)]
    row(label or name, per_op)
    return per_op[0]

def events(path):
    return sum(1 for _ in open(path))

print(f"{'row':24s} {'instr/op':>9s} {'I1/op':>7s} {'D1r/op':>7s} {'D1w/op':>7s}")
if mode == "rows":
    steady("ms10", 16250)
    steady("bert", events(bert))
    for s in (1, 64):
        row(f"scale{s}", [x / 40000 for x in collected(f"{out}/scale{s}.log")])
elif mode == "traces":
    ratios = []
    for t in traces:
        name = os.path.basename(t)[: -len(".trace")] if t.endswith(".trace") else os.path.basename(t)
        quilt = steady(name, events(t))
        classic = steady(f"classic-{name}", events(t), f"  classic")
        ratios.append(quilt / classic)
        print(f"  {'quilt/classic':22s} {quilt / classic:9.2f}")
    ratios.sort()
    print(f"quilt/classic instr/op: median {ratios[len(ratios) // 2]:.2f} (upper), max {ratios[-1]:.2f}")
else:
    for a in ("quilt", "classic"):
        for streams in (1, 4):
            for s in size_list.split():
                name = f"size-{a}-{s}-{streams}"
                row(f"{a} {s} {streams} streams", [x / 4000 for x in collected(f"{out}/{name}.log")])
print(f"callgrind files: {out}")
PY
