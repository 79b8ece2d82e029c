#!/usr/bin/env python3
"""PyTorch with Quilt on a real GPU (step `torch_check` of scripts/gpu-check.sh).

Under ``torch.cuda.set_per_process_memory_fraction``, a fragmenting pattern:
6 MiB tensors fill 90 % of the budget (PyTorch carves them from 20 MiB
segments, three to a segment), two of every three are freed, so every
segment keeps one live tensor and none can be released, then one tensor of
40 % of the budget is asked for. PyTorch's native allocator (expandable
segments off) should raise ``OutOfMemoryError`` there; with
``quilt_torch.enable()`` the same pattern should complete, because the freed
tensors' pages are free whatever segment they were in. The surviving tensors'
contents are checked, the ``mempool()`` route is run, and a snapshot of the
Quilt run is written.

Each case runs in a child process of its own (the allocator is chosen once per
process). Prints one JSON object; exits 0 when the Quilt cases passed, 1 when
one failed, 77 when torch or a CUDA device is missing (the step is skipped).

    python3 scripts/torch_check.py --library PATH/libquilt_torch.so --out DIR
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGET_BYTES = 8 << 30
SMALL = 6 << 20


def child(mode, out_dir):
    """Run the pattern in this process with allocator `mode`; print JSON."""
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    result = {"mode": mode}
    if mode in ("quilt", "mempool"):
        import quilt_torch

        if mode == "quilt":
            quilt_torch.enable()
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, BUDGET_BYTES / total)
    try:
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    except RuntimeError as e:  # some versions refuse it for a pluggable allocator
        result["torch_fraction_error"] = str(e)[:200]
    if mode == "quilt":
        quilt_torch.set_memory_fraction(fraction, 0)
    result["budget_bytes"] = int(fraction * total)
    budget = result["budget_bytes"]

    def pattern():
        kept = []
        n = int(0.9 * budget) // SMALL
        tensors = [torch.full((SMALL // 4,), float(i), device="cuda") for i in range(n)]
        for i, t in enumerate(tensors):
            if i % 3 == 0:
                kept.append((i, t))
        del tensors, t
        torch.cuda.synchronize()
        big = torch.ones((int(0.4 * budget) // 4,), device="cuda")
        big.mul_(2.0)
        torch.cuda.synchronize()
        ok = all(bool((t == float(i)).all()) for i, t in kept) and bool((big == 2.0).all())
        return len(kept), ok

    try:
        if mode == "mempool":
            pool = quilt_torch.mempool()
            with torch.cuda.use_mem_pool(pool):
                kept, ok = pattern()
        else:
            kept, ok = pattern()
        result.update(completed=True, kept=kept, contents_ok=ok)
    except torch.cuda.OutOfMemoryError as e:
        result.update(completed=False, out_of_memory=True, error=str(e)[:400])
    except RuntimeError as e:
        result.update(completed=False, out_of_memory="out of memory" in str(e).lower(), error=str(e)[:400])
    if mode == "quilt":
        path = os.path.join(out_dir, "torch_quilt_snapshot.pickle")
        try:
            quilt_torch.dump_snapshot(path)
            result["snapshot"] = path
        except RuntimeError as e:
            result["snapshot_error"] = str(e)
        result["quilt_stats"] = quilt_torch.memory_stats(0)
    print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--child", choices=["native", "quilt", "mempool"])
    args = parser.parse_args()
    if args.child:
        child(args.child, args.out)
        return 0
    try:
        import torch
    except ImportError:
        print(json.dumps({"skipped": "torch is not installed"}))
        return 77
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "torch sees no CUDA device"}))
        return 77
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, QUILT_TORCH_LIBRARY=os.path.abspath(args.library), PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    env.pop("QUILT_ALLOC_CONF", None)
    results = {}
    for mode in ("native", "quilt", "mempool"):
        try:
            p = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--library", args.library, "--out", args.out, "--child", mode],
                env=env, capture_output=True, text=True, timeout=40,
            )
            line = (p.stdout.strip().splitlines() or [""])[-1]
            results[mode] = json.loads(line) if line.startswith("{") else {"exit_status": p.returncode, "stderr": p.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            results[mode] = {"timed_out": True}
    passed = all(results[m].get("completed") and results[m].get("contents_ok") for m in ("quilt", "mempool"))
    results["native_ran_out_of_memory"] = bool(results["native"].get("out_of_memory"))
    results["passed"] = passed
    print(json.dumps(results))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
