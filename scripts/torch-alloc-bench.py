#!/usr/bin/env python3
"""torch.empty/del pairs per second: Quilt against torch's own allocators.

A benchmark, not a test: it measures how many ``t = torch.empty(n,
dtype=torch.uint8, device="cuda"); del t`` pairs one Python thread completes
per second, for sizes from 512 B to 256 MiB, under

* ``classic``: torch's caching allocator;
* ``expandable``: torch's expandable segments
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``);
* ``quilt``: ``quilt_torch.enable()`` (``QUILT_ALLOC_CONF``, by default
  ``backend:cuda``),

each in a process of its own, all on the same device: by default the
project's simulated GPU (``scripts/simulated-gpu.sh``, after ``cargo build
--release``), or a real one with ``--device real``. A pair allocates and
frees on the current stream, so after the first pair every allocator serves
it from its cache: this is the host cost of the allocator's fast path as
torch calls it (Python, the dispatcher and the tensor's creation included,
the same for all three), not driver time. Each size runs ``--repeats``
rounds of ``--pairs`` pairs after a warm-up round; the median round is
reported, and the ratio to classic's median within the same run.

    scripts/torch-alloc-bench.py                  # table on stdout
    scripts/torch-alloc-bench.py --json out.json  # and the figures as JSON

The python is ``$QUILT_TORCH_PYTHON`` or the venv of scripts/torch-venv.sh.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZES = [512, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
ALLOCATORS = ["classic", "expandable", "quilt"]


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return "{:g} {}".format(n / (1 << shift), unit)
    return "{} B".format(n)


def child(allocator, pairs, repeats):
    """Measure in this process; print one JSON line."""
    if allocator == "quilt":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import quilt_torch

        quilt_torch.enable()
    import torch

    torch.cuda.init()
    out = {}
    for size in SIZES:
        torch.empty(size, dtype=torch.uint8, device="cuda")  # warm-up
        rounds = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for _ in range(pairs):
                t = torch.empty(size, dtype=torch.uint8, device="cuda")
                del t
            rounds.append(pairs / (time.perf_counter() - start))
        rounds = rounds[1:]  # the first round warms the cache up
        out[str(size)] = {
            "median_pairs_per_s": statistics.median(rounds),
            "rounds": rounds,
        }
    assert torch.cuda.memory_allocated() == 0, "a tensor was left allocated"
    print(json.dumps({"allocator": allocator, "sizes": out}))


def python():
    env = os.environ.get("QUILT_TORCH_PYTHON")
    if env:
        return env
    venv = os.environ.get(
        "QUILT_TORCH_VENV", os.path.expanduser("~/.cache/quilt/torch-venv")
    )
    return os.path.join(venv, "bin", "python")


def run(allocator, args):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if allocator == "quilt":
        env.setdefault("QUILT_ALLOC_CONF", "backend:cuda")
    cmd = [python(), os.path.abspath(__file__), "--child", allocator]
    cmd += ["--pairs", str(args.pairs), "--repeats", str(args.repeats)]
    if args.device == "simulated":
        cmd = [os.path.join(HERE, "simulated-gpu.sh")] + cmd
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(
            "torch-alloc-bench: {} failed (exit {}):\n{}{}".format(
                allocator, done.returncode, done.stdout, done.stderr
            )
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=ALLOCATORS, help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["simulated", "real"], default="simulated")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.pairs, args.repeats)
        return
    results = {a: run(a, args) for a in ALLOCATORS}
    print(
        "torch.empty/del pairs per second ({} device, median of {} rounds of {} pairs)".format(
            args.device, args.repeats, args.pairs
        )
    )
    header = "{:>9} " + " ".join("{:>12}" for _ in ALLOCATORS) + "  {:>14}"
    print(header.format("size", *ALLOCATORS, "quilt/classic"))
    rows = []
    for size in SIZES:
        medians = [results[a]["sizes"][str(size)]["median_pairs_per_s"] for a in ALLOCATORS]
        ratio = medians[2] / medians[0]
        rows.append({"size": size, **dict(zip(ALLOCATORS, medians)), "quilt_over_classic": ratio})
        print(
            header.format(
                human(size), *("{:,.0f}".format(m) for m in medians), "{:.2f}".format(ratio)
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "pairs": args.pairs, "repeats": args.repeats,
                       "rows": rows, "raw": results}, f, indent=1)


if __name__ == "__main__":
    main()
