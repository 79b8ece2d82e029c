#!/usr/bin/env bash
# GMLake-style stitching experiments on the real traces (docs/experiments.md):
# one `quilt-bench sweep` per trace and knob, three iterations, bisection
# included. Writes out/experiments/<knob>/<trace>.json and .svg charts.
# Usage: scripts/experiments.sh [trace ...]   (default: every converted trace)
set -euo pipefail
cd "$(dirname "$0")/.."
traces=("$@")
if [ ${#traces[@]} -eq 0 ]; then
    traces=(../shared/traces/converted/*.trace)
fi
cargo build --release -p quilt-bench >/dev/null
bin=target/release/quilt-bench
run() { # knob-folder spec vary trace
    local dir=out/experiments/$1 name
    name=$(basename "$4" .trace)
    mkdir -p "$dir/$name"
    "$bin" sweep --trace "$4" --allocator "$2" --vary "$3" --iterations 3 \
        --json "$dir/$name.json" --svg "$dir/$name" >"$dir/$name.txt"
    echo "$dir/$name.json"
}
for t in "${traces[@]}"; do
    run frag_limit gmlake frag_limit=0,32MiB,128MiB,512MiB "$t"
    run reuse_limit gmlake:frag_limit=32MiB reuse_limit=1,2,10,1000 "$t"
    run page_size quilt page_size=2MiB,4MiB,8MiB,20MiB "$t"
    run stitching quilt frag_limit=0,1TiB "$t"
done
