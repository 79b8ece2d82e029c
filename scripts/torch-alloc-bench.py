#!/usr/bin/env python3
"""torch.empty/del pairs per second and torch's statistics calls: Quilt against torch's own allocators.

A benchmark, not a test. Two figures, each measured through torch:

* **pairs**: how many ``t = torch.empty(n, dtype=torch.uint8, device="cuda");
  del t`` pairs one Python thread completes per second, for sizes from
  512 B to 256 MiB. A pair allocates and frees on the current stream, so
  after the first pair every allocator serves it from its cache: this is the
  host cost of the allocator's fast path as torch calls it (Python, the
  dispatcher and the tensor's creation included, the same for all), not
  driver time.
* **statistics**: microseconds per ``torch.cuda.memory_allocated()``,
  ``memory_reserved()`` and ``memory_stats()`` call with ``--live`` (20,000)
  tensors alive: 1.5 times as many allocated (512 B to 64 KiB, cycling),
  every third freed, so the live ones lie among holes.

under

* ``classic``: torch's caching allocator;
* ``expandable``: torch's expandable segments
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``);
* ``quilt``: ``quilt_torch.enable()`` (``QUILT_ALLOC_CONF``, by default
  ``backend:cuda``),

each in a process of its own, all on the same device: by default the
project's simulated GPU (``scripts/simulated-gpu.sh``, after ``cargo build
--release``), or a real one with ``--device real``. Time is the measuring
thread's CPU time by default (``--clock thread``: what the allocator's path
costs the calling thread, robust against other work on a shared machine;
the work is all on that thread), or wall time (``--clock wall``). ``--rounds`` rounds
alternate the allocators (the order reversed every other round), so that a
change in the machine's load falls on all of them; within a process each
size runs ``--repeats`` batches of ``--pairs`` pairs after a warm-up batch
and gives its median batch. The ratio to classic is taken within each round
and its median over the rounds is reported.

    scripts/torch-alloc-bench.py                  # table on stdout
    scripts/torch-alloc-bench.py --json out.json  # and the figures as JSON
    scripts/torch-alloc-bench.py --allocators classic,quilt --rounds 5

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
STATS_CALLS = ["memory_allocated", "memory_reserved", "memory_stats"]


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return "{:g} {}".format(n / (1 << shift), unit)
    return "{} B".format(n)


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def pairs_per_second(torch, pairs, repeats, clock):
    out = {}
    for size in SIZES:
        torch.empty(size, dtype=torch.uint8, device="cuda")  # warm-up
        batches = []
        for _ in range(repeats + 1):
            start = clock()
            for _ in range(pairs):
                t = torch.empty(size, dtype=torch.uint8, device="cuda")
                del t
            batches.append(pairs / (clock() - start))
        batches = batches[1:]  # the first batch warms the cache up
        out[str(size)] = {
            "median_pairs_per_s": statistics.median(batches),
            "batches": batches,
        }
    return out


def statistics_calls(torch, live, calls, repeats, clock):
    """Microseconds per statistics call with `live` tensors alive."""
    made = [
        torch.empty(512 << (i % 8), dtype=torch.uint8, device="cuda")
        for i in range(live * 3 // 2)
    ]
    kept = [t for i, t in enumerate(made) if i % 3 != 2]
    del made
    assert len(kept) >= live
    kept = kept[:live]
    functions = {
        "memory_allocated": torch.cuda.memory_allocated,
        "memory_reserved": torch.cuda.memory_reserved,
        "memory_stats": torch.cuda.memory_stats,
    }
    out = {"live_tensors": len(kept), "allocated_bytes": torch.cuda.memory_allocated()}
    for name in STATS_CALLS:
        f = functions[name]
        f()  # warm-up
        batches = []
        for _ in range(repeats):
            start = clock()
            for _ in range(calls):
                f()
            batches.append((clock() - start) / calls * 1e6)
        out[name] = {"median_us": statistics.median(batches), "batches": batches}
    del kept
    return out


def child(allocator, args):
    """Measure in this process; print one JSON line."""
    if allocator == "quilt":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import quilt_torch

        quilt_torch.enable()
    import torch

    torch.cuda.init()
    out = {"allocator": allocator}
    clock = CLOCKS[args.clock]
    if not args.skip_pairs:
        out["sizes"] = pairs_per_second(torch, args.pairs, args.repeats, clock)
        assert torch.cuda.memory_allocated() == 0, "a tensor was left allocated"
    if not args.skip_stats:
        out["stats"] = statistics_calls(torch, args.live, args.calls, args.repeats, clock)
    print(json.dumps(out))


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
    for flag in ("pairs", "repeats", "live", "calls", "clock"):
        cmd += ["--" + flag, str(getattr(args, flag))]
    if args.skip_pairs:
        cmd.append("--skip-pairs")
    if args.skip_stats:
        cmd.append("--skip-stats")
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


def git_commit():
    done = subprocess.run(
        ["git", "-C", REPO, "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "unknown"


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def table_row(row, per_round, allocators, others, cell_format):
    """One row of a summary table: each allocator's median over the rounds
    (into ``row`` and as a cell in ``cell_format``), and each other
    allocator's ratio to classic within each round, with its median and
    range. Returns (row, cells, ratio texts)."""
    cells = []
    for a in allocators:
        row[a] = median(per_round[a])
        cells.append(cell_format.format(row[a]))
    ratios = []
    for a in others:
        rs = [x / c for x, c in zip(per_round[a], per_round["classic"])]
        row[a + "_over_classic"] = {"median": median(rs), "rounds": rs}
        ratios.append("{:.3f} ({:.3f}-{:.3f})".format(median(rs), min(rs), max(rs)))
    return row, cells, ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=ALLOCATORS, help=argparse.SUPPRESS)
    parser.add_argument("--allocators", default=",".join(ALLOCATORS),
                        help="comma-separated, classic first (default: all three)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds, one process per allocator each")
    parser.add_argument("--pairs", type=int, default=20000, help="pairs per batch")
    parser.add_argument("--repeats", type=int, default=5, help="batches per size (and per statistics call)")
    parser.add_argument("--live", type=int, default=20000, help="live tensors for the statistics calls")
    parser.add_argument("--calls", type=int, default=500, help="statistics calls per batch")
    parser.add_argument("--skip-pairs", action="store_true", help="statistics calls only")
    parser.add_argument("--skip-stats", action="store_true", help="pairs only")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                        help="the measuring thread's CPU time (default) or wall time")
    parser.add_argument("--device", choices=["simulated", "real"], default="simulated")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.child:
        child(args.child, args)
        return
    allocators = args.allocators.split(",")
    if allocators[0] != "classic" or any(a not in ALLOCATORS for a in allocators):
        parser.error("--allocators: classic first, then any of expandable, quilt")
    results = {a: [] for a in allocators}
    for r in range(args.rounds):
        order = allocators if r % 2 == 0 else allocators[::-1]
        for a in order:
            results[a].append(run(a, args))
    commit = git_commit()
    others = allocators[1:]
    summary = {"device": args.device, "commit": commit, "rounds": args.rounds,
               "pairs": args.pairs, "repeats": args.repeats, "clock": args.clock,
               "allocators": allocators}
    if not args.skip_pairs:
        print("torch.empty/del pairs per second of {} time ({} device, commit {}, {} alternating "
              "rounds, each the median of {} batches of {} pairs)".format(
                  args.clock, args.device, commit, args.rounds, args.repeats, args.pairs))
        header = "{:>9} " + " ".join("{:>12}" for _ in allocators) + "".join(
            "  {:>26}" for _ in others)
        print(header.format("size", *allocators,
                            *("{}/classic (median, min-max)".format(a) for a in others)))
        rows = []
        for size in SIZES:
            key = str(size)
            per_round = {a: [x["sizes"][key]["median_pairs_per_s"] for x in results[a]]
                         for a in allocators}
            row, cells, ratios = table_row({"size": size}, per_round, allocators, others,
                                           "{:,.0f}")
            rows.append(row)
            print(header.format(human(size), *cells, *ratios))
        summary["pairs_rows"] = rows
    if not args.skip_stats:
        live = results["classic"][0]["stats"]["live_tensors"]
        print()
        print("microseconds of {} time per statistics call with {:,} live tensors ({} device, "
              "commit {}, {} alternating rounds, each the median of {} batches of {} calls)".format(
                  args.clock, live, args.device, commit, args.rounds, args.repeats, args.calls))
        header = "{:>17} " + " ".join("{:>12}" for _ in allocators) + "".join(
            "  {:>26}" for _ in others)
        print(header.format("call", *allocators,
                            *("{}/classic (median, min-max)".format(a) for a in others)))
        rows = []
        for name in STATS_CALLS:
            per_round = {a: [x["stats"][name]["median_us"] for x in results[a]]
                         for a in allocators}
            row, cells, ratios = table_row({"call": name}, per_round, allocators, others,
                                           "{:.1f}")
            rows.append(row)
            print(header.format(name + "()", *cells, *ratios))
        summary["stats_rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "raw": results}, f, indent=1)


if __name__ == "__main__":
    main()
