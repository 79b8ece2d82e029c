#!/usr/bin/env python3
"""Check Quilt's promises on the JSON of a `quilt-bench ab` run, row by row.

The promises (issue 25's list, at 80 GiB, 3 iterations), for the Quilt row of
each workload against the baselines of the same run:

- sync:         no stream synchronisation beyond the fewest any baseline
                made (a workload that puts a model to sleep synchronises
                for every allocator);
- waits:        at most 0.05 cross-stream waits per allocation on every real
                trace (issue 38). On synthetic workloads (the built-in
                generators and the traces of scripts/multistream-traces.py:
                SYNTHETIC below) the waits are printed, not judged: a
                producer-consumer pipeline at the live peak must order each
                reused layer after two streams' work (offload-pipeline-4's
                floor is 0.095). Whether each wait is needed (by the race
                finder) is checked per allocation by the bench tests of
                benches/tests/waits.rs (strict with `quilt:events=at_free`,
                bounded for the default), which the JSON rows cannot tell;
- calls-after:  driver calls after the first iteration at most 0.2 % of the
                events (not checked on rows with growable buffers, which Quilt
                serves natively by mapping pages as they grow);
- min-ideal:    minimum capacity at most 1.005 x ideal + 8 MiB;
- min-baseline: minimum capacity at most every baseline's + max(2 MiB, 0.1 %);
- dominated:    no baseline as small in minimum capacity, with no more calls
                after the first iteration and an efficiency higher by more
                than 0.005;
- driver:       modelled driver time at most 1.05 x expandable's;
- races:        no allocation given memory another stream's work may still
                use, unordered (the row's `races`, from the replay's race
                finder). A baseline row with races is no comparison (an
                allocator a GPU would corrupt memory with): it is left out
                of every promise above and listed as not compared.

Run `ab` with bisection (the default) and the baselines wanted, e.g.

    quilt-bench ab --iterations 3 --jobs 2 --trace DIR/*.trace --json run.json
    python3 scripts/promise-check.py run.json [--quilt NAME]

Prints each broken promise with its rows and a count per promise; exit status
0 when every checked row keeps every promise, 1 when one is broken, 2 on bad
input. Rows the run could not measure (a failed replay, no minimum capacity)
are listed as such, not counted as kept.
"""

import argparse
import json
import re
import sys

MIB = 1 << 20

# Workloads that are not real traces: the built-in generators of quilt-bench
# and the traces scripts/multistream-traces.py writes (with their -idle,
# -side and -one variants).
SYNTHETIC = re.compile(
    r"^(train-varlen|llm-serving(-growable(-switch)?)?|model-switch|mixed-vision-language"
    r"|offload-pipeline-\d+|many-streams(-handoff)?-\d+"
    r"|(pipeline|staging)(-wide)?-\d+|small-streams-\d+|family-\d+(-one)?)(-idle|-side)?$"
)


def bad_input(message):
    """Say what is wrong with the input and exit with status 2."""
    print(f"promise-check: {message}", file=sys.stderr)
    sys.exit(2)


def calls_after(row):
    return sum(row["vmm_calls_after_first_iteration"].values())


def check(quilt, baselines, real=True):
    """The promises `quilt` breaks against `baselines` (name -> row), as
    (promise, detail) pairs, and what could not be checked (`real`: the
    row is a real trace's, whose waits are judged)."""
    broken, unchecked = [], []
    if not quilt["completed"]:
        return broken, ["did not complete at the run's capacity"]
    if quilt.get("races", 0) > 0:
        broken.append(("races", f"{quilt['races']} allocations reuse memory another stream's work may still use, unordered (first: {quilt.get('first_race')})"))
    for name, b in sorted(baselines.items()):
        if b.get("races", 0) > 0:
            unchecked.append(f"{name} not compared: it reused memory unordered {b['races']} times")
    baselines = {n: b for n, b in baselines.items() if b.get("races", 0) == 0}
    allocations = max(1.0, quilt["events"] / 2)
    syncs = quilt["stream_calls"]["synchronize"]
    fewest = min((b["stream_calls"]["synchronize"] for b in baselines.values()), default=0)
    if syncs > fewest:
        broken.append(("sync", f"{syncs} synchronisations (fewest of the baselines: {fewest})"))
    waits = quilt["stream_calls"]["wait_event"] / allocations
    if waits > 0.05:
        if real:
            broken.append(("waits", f"{waits:.3f} waits per allocation"))
        else:
            unchecked.append(f"waits {waits:.3f} per allocation (a synthetic workload: not judged)")
    if not quilt.get("grows"):
        share = calls_after(quilt) / max(1, quilt["events"])
        if share > 0.002:
            broken.append(("calls-after", f"{calls_after(quilt)} calls after the first iteration ({share:.2%} of events)"))
    cap, ideal = quilt["min_capacity_bytes"], quilt["ideal_bytes"]
    if cap is None:
        unchecked.append("no minimum capacity (run without --no-bisect)")
    else:
        if cap > 1.005 * ideal + 8 * MIB:
            broken.append(("min-ideal", f"{cap / MIB:.0f} MiB against ideal {ideal / MIB:.0f} MiB"))
        for name, b in sorted(baselines.items()):
            other = b["min_capacity_bytes"]
            if other is None:
                continue
            if cap > other + max(2 * MIB, other // 1000):
                broken.append(("min-baseline", f"{cap / MIB:.0f} MiB against {name}'s {other / MIB:.0f} MiB"))
            if (
                other <= cap
                and calls_after(b) <= calls_after(quilt)
                and b["efficiency"] > quilt["efficiency"] + 0.005
            ):
                broken.append(("dominated", f"by {name}: efficiency {b['efficiency']:.3f} against {quilt['efficiency']:.3f}, minimum capacity {other / MIB:.0f} against {cap / MIB:.0f} MiB"))
    expandable = baselines.get("expandable")
    if expandable is None:
        unchecked.append("no expandable row (driver time)")
    elif quilt["modelled_driver_us"] > 1.05 * expandable["modelled_driver_us"]:
        ratio = quilt["modelled_driver_us"] / expandable["modelled_driver_us"]
        broken.append(("driver", f"{ratio:.3f} x expandable's modelled driver time"))
    return broken, unchecked


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="the JSON of a `quilt-bench ab` run (--json)")
    parser.add_argument("--quilt", default="quilt", help="the allocator checked, as the run names it (default: quilt)")
    args = parser.parse_args()
    try:
        with open(args.json) as f:
            rows = json.load(f)["rows"]
        workloads = {}
        for r in rows:
            workloads.setdefault(r["workload"], {})[r["allocator"]] = r
    except (OSError, ValueError, KeyError, TypeError) as e:
        bad_input(f"reading {args.json}: {e}")
    baseline_names = {"classic", "expandable", "gmlake", "offset"}
    counts, checked = {}, 0
    for workload, by_allocator in workloads.items():
        quilt = by_allocator.get(args.quilt)
        if quilt is None:
            continue
        baselines = {n: r for n, r in by_allocator.items() if n in baseline_names and r["completed"]}
        try:
            broken, unchecked = check(quilt, baselines, real=not SYNTHETIC.match(workload))
        except (KeyError, TypeError) as e:
            bad_input(f"{workload}: a field is missing or malformed: {e}")
        checked += 1
        for why in unchecked:
            print(f"{workload}: not checked: {why}")
        for promise, detail in broken:
            print(f"{workload}: {promise}: {detail}")
            counts.setdefault(promise, set()).add(workload)
    if checked == 0:
        bad_input(f"no `{args.quilt}` row in {args.json}")
    kept = ", ".join(f"{p} broken on {len(w)}" for p, w in sorted(counts.items())) or "every promise kept"
    print(f"{checked} workloads checked: {kept}")
    sys.exit(1 if counts else 0)


if __name__ == "__main__":
    main()
