#!/usr/bin/env bash
# The A/B comparison on the seven real PyTorch traces (../shared/traces/converted)
# and the traces recorded from the live A/B's programs (benches/traces/live:
# `quilt-bench live PROGRAM.py --record DIR`, torch's classic allocator on the
# simulated GPU), every allocator, three iterations each, at 80 GiB on the
# simulated device.
# Writes out/ab-traces.json and charts under out/svg-traces/.
# Usage: scripts/ab-traces.sh [extra quilt-bench ab options]
set -euo pipefail
cd "$(dirname "$0")/.."
traces=../shared/traces/converted
if [ ! -d "$traces" ]; then
    echo "ab-traces: $traces is absent: nothing to replay" >&2
    exit 1
fi
mkdir -p out
cargo run --release -p quilt-bench -- ab \
    --trace "$traces"/*.trace benches/traces/live/*.trace \
    --iterations 3 \
    --json out/ab-traces.json \
    --svg out/svg-traces \
    "$@"
