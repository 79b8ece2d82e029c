#!/usr/bin/env python3
"""Compare two `quilt-bench ab --json` reports field by field, host time aside.

Rows are matched by (workload, allocator); every field of every row is
compared, nested ones (vmm_calls, stream_calls, oom, ...) key by key, except
the host-time fields (`cpu_ns_per_op`). The parameters are compared too,
except `version` (the commit). Prints each difference as
`workload / allocator / field: before -> after` and a summary line.

Usage: python3 scripts/ab-diff.py BEFORE.json AFTER.json [--ignore FIELD ...]
Exit status: 0 when nothing differs, 1 when something does, 2 on bad input.
"""

import argparse
import json
import sys

HOST_TIME = {"cpu_ns_per_op"}


def flatten(value, prefix=""):
    """Leaves of a JSON value as {dotted.path: leaf}."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(value, list):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): value}


def load(path):
    try:
        with open(path) as f:
            report = json.load(f)
        rows = report["rows"]
        params = report.get("parameters", {})
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"ab-diff: {path}: not an `ab --json` report ({e})")
    keyed = {}
    for row in rows:
        key = (row.get("workload"), row.get("allocator"))
        if key in keyed:
            sys.exit(f"ab-diff: {path}: row {key} appears twice")
        keyed[key] = row
    return params, keyed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument(
        "--ignore",
        action="append",
        default=[],
        help="a further top-level row field to leave out (repeatable)",
    )
    args = ap.parse_args()
    skip = HOST_TIME | set(args.ignore)
    p_before, before = load(args.before)
    p_after, after = load(args.after)
    diffs = []
    for k in sorted(set(flatten(p_before)) | set(flatten(p_after))):
        if k == "version":
            continue
        a, b = flatten(p_before).get(k), flatten(p_after).get(k)
        if a != b:
            diffs.append(f"parameters / {k}: {a!r} -> {b!r}")
    for key in sorted(set(before) | set(after), key=str):
        name = f"{key[0]} / {key[1]}"
        if key not in after:
            diffs.append(f"{name}: only before")
            continue
        if key not in before:
            diffs.append(f"{name}: only after")
            continue
        fa = {k: v for k, v in flatten(before[key]).items() if k.split(".")[0] not in skip}
        fb = {k: v for k, v in flatten(after[key]).items() if k.split(".")[0] not in skip}
        for k in sorted(set(fa) | set(fb)):
            if fa.get(k) != fb.get(k):
                diffs.append(f"{name} / {k}: {fa.get(k)!r} -> {fb.get(k)!r}")
    for d in diffs:
        print(d)
    rows = len(set(before) & set(after))
    fields = "every field but " + ", ".join(sorted(skip))
    if diffs:
        print(f"ab-diff: {len(diffs)} differences over {rows} rows ({fields})")
        return 1
    print(f"ab-diff: {rows} rows identical in {fields}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
