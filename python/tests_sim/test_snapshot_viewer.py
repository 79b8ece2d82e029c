"""What PyTorch's memory viewer (``torch/utils/viz/MemoryViz.js``, the page
at pytorch.org/memory_viz) needs of a snapshot's segments and history, on
the simulated GPU under the allocator named by ``QUILT_SIM_ALLOCATOR`` (see
``test_simulated_gpu.py``). The snapshot is torch's own
(``_record_memory_history``, then ``_snapshot``) after tensors of varied
sizes churn on two streams with ``empty_cache`` calls, written by a process
of its own (under Quilt with ``reclaim:always``, which unmaps most often).

* "Active Cached Segment Timeline" (the viewer's ``process_alloc_data`` with
  ``plot_segments``) reads only ``segment_alloc`` and ``segment_free``,
  paired by address, and takes the snapshot's segments that no open
  ``segment_alloc`` names as there from the start. The memory it stacks
  must be the memory the history says was reserved at every event, or the
  plot is wrong; where the history has segment events it never sees, the
  whole history is one time step, and moving the detail slider leaves a band
  of no area and dragging the minimap divides by zero. Each ``segment_free``
  must close the open ``segment_alloc`` of its address and size, and no
  ``segment_alloc`` may reuse an open address.
* "Allocator State History" (``simulate_memory``) undoes the history from
  the snapshot's segments back to each event: an undone ``segment_map``
  must find a segment holding its range, an undone ``segment_alloc`` the
  segment at its address, of its size, and every live block must lie in a
  segment at every event; the history ends with the snapshot's segments.
* The events of a device are in time order.
"""

import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Churn on two streams with empty_cache, history recorded; the snapshot
# pickled to argv[1].
CHURN = textwrap.dedent(
    """
    import os, pickle, random, sys
    sys.path.insert(0, {python!r})
    if os.environ.get("QUILT_SIM_ALLOCATOR") == "quilt":
        import quilt_torch
        quilt_torch.enable()
    import torch
    MiB = 1 << 20
    rng = random.Random(48)
    side = torch.cuda.Stream()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    live = []
    for step in range(150):
        size = rng.choice((1, 2, 3, 5, 8, 13, 30)) * MiB + rng.randrange(4) * 512 + rng.choice((0, 1000, 70000))
        if live and (rng.random() < 0.45 or len(live) > 12):
            del live[rng.randrange(len(live))]
        else:
            stream = torch.cuda.current_stream() if rng.random() < 0.5 else side
            with torch.cuda.stream(stream):
                live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        if step % 30 == 29:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    del live[::2]
    live.append(torch.empty(3 * MiB, dtype=torch.uint8, device="cuda"))
    with torch.cuda.stream(side):
        live.append(torch.empty(5 * MiB + 100, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with open(sys.argv[1], "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
    """
).format(python=os.path.join(REPO, "python"))

SEGMENT_GROWS = ("segment_alloc", "segment_map")
SEGMENT_SHRINKS = ("segment_free", "segment_unmap")


def churn_snapshot():
    """The snapshot CHURN writes in a process of its own, on the same
    simulated GPU and allocator (Quilt with ``reclaim:always``)."""
    env = dict(os.environ)
    if ALLOCATOR == "quilt":
        env["QUILT_ALLOC_CONF"] = "backend:cuda,reclaim:always"
    with tempfile.TemporaryDirectory(prefix="quilt-viewer-") as tmp:
        path = os.path.join(tmp, "snapshot.pickle")
        done = subprocess.run(
            [sys.executable, "-c", CHURN, path],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            universal_newlines=True,
            timeout=300,
            cwd=REPO,
            env=env,
        )
        if done.returncode != 0:
            raise AssertionError("the churn failed ({}):\n{}".format(done.returncode, done.stdout[-4000:]))
        with open(path, "rb") as f:
            return pickle.load(f)


def segments_of(snap, device):
    return [s for s in snap["segments"] if s["device"] == device]


def devices_of(snap):
    """The devices the viewer offers: a history or a segment."""
    with_segments = {s["device"] for s in snap["segments"]}
    return [d for d, t in enumerate(snap["device_traces"]) if t or d in with_segments]


def reserved_after_each(snap, device):
    """The bytes reserved after each event, as every segment event says,
    counted back from the snapshot's segments."""
    trace = snap["device_traces"][device]
    reserved = sum(s["total_size"] for s in segments_of(snap, device))
    after = [0] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        after[i] = reserved
        e = trace[i]
        if e["action"] in SEGMENT_GROWS:
            reserved -= e["size"]
        elif e["action"] in SEGMENT_SHRINKS:
            reserved += e["size"]
    return after


def timeline_problems(snap, device):
    """What the segment timeline (process_alloc_data with plot_segments)
    gets wrong: a pairing it cannot make, or stacked memory that differs
    from the memory reserved after an event."""
    trace = snap["device_traces"][device]
    problems = []
    open_allocs = {}  # address: size
    unmatched_frees = 0
    for i, e in enumerate(trace):
        if e["action"] == "segment_alloc":
            if e["addr"] in open_allocs:
                problems.append("event {}: segment_alloc {:#x} while one is open there".format(i, e["addr"]))
            open_allocs[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            size = open_allocs.pop(e["addr"], None)
            if size is None:
                unmatched_frees += e["size"]
            elif size != e["size"]:
                problems.append(
                    "event {}: segment_free {:#x} of {} closes a segment_alloc of {}".format(i, e["addr"], e["size"], size)
                )
    # The snapshot's segments no open alloc names are there from the start.
    from_snapshot = sum(s["total_size"] for s in segments_of(snap, device) if s["address"] not in open_allocs)
    stacked = unmatched_frees + from_snapshot
    open_now = {}
    reserved = reserved_after_each(snap, device)
    for i, e in enumerate(trace):
        if e["action"] == "segment_alloc":
            open_now[e["addr"]] = e["size"]
            stacked += e["size"]
        elif e["action"] == "segment_free":
            stacked -= open_now.pop(e["addr"], e["size"])
        if stacked != reserved[i]:
            problems.append(
                "after event {} ({} {:#x} +{}): the segment timeline stacks {} bytes, {} are reserved".format(
                    i, e["action"], e["addr"], e["size"], stacked, reserved[i]
                )
            )
            break
    ends = {s["address"]: s["total_size"] for s in segments_of(snap, device)}
    for addr, size in open_allocs.items():
        if ends.get(addr) != size:
            problems.append(
                "segment_alloc {:#x} of {} still open at the end: the snapshot's segment there is {}".format(
                    addr, size, ends.get(addr)
                )
            )
    return problems


def state_history_problems(snap, device):
    """Where the state history (simulate_memory, streams as the newest
    viewer names them: equal stays equal) fails or would draw a block in no
    segment; every event index, back to the first."""
    events = []
    for t in snap["device_traces"][device]:
        if t["action"] == "free_completed" and events:
            prev = events[-1]
            if prev["action"] == "free_requested" and prev["addr"] == t["addr"]:
                prev["action"] = "free"
                continue
        events.append(dict(t))
    start = []
    blocks = {}
    for seg in segments_of(snap, device):
        start.append([seg["address"], seg["total_size"], seg["stream"]])
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[addr] = b["size"]
            addr += b["size"]
    start.sort()

    def put_back(segs, merge, seg):  # map_segment
        idx = next((k for k, s in enumerate(segs) if s[0] > seg[0]), -1)
        if not merge:
            segs.insert(idx if idx >= 0 else max(len(segs) - 1, 0), seg)  # splice(-1, 0, seg)
            return
        if idx == -1:
            idx = len(segs)
        segs.insert(idx, seg)
        if idx + 1 < len(segs) and seg[0] + seg[1] == segs[idx + 1][0] and seg[2] == segs[idx + 1][2]:
            seg[1] += segs[idx + 1][1]
            del segs[idx + 1]
        if idx > 0 and segs[idx - 1][0] + segs[idx - 1][1] == seg[0] and segs[idx - 1][2] == seg[2]:
            segs[idx - 1][1] += seg[1]
            del segs[idx]

    def take_out(segs, merge, seg):  # unmap_segment; a problem or None
        if not merge:
            j = next((k for k, s in enumerate(segs) if s[0] == seg[0]), None)
            if j is None:
                return "no segment at its address (the viewer removes its last one)"
            if segs[j][1] != seg[1]:
                return "the segment at its address has {} bytes".format(segs[j][1])
            del segs[j]
            return None
        end = seg[0] + seg[1]
        j = next((k for k, s in enumerate(segs) if s[0] <= seg[0] and end <= s[0] + s[1]), None)
        if j is None:
            return "no segment holds it (the viewer fails reading 'addr')"
        s = segs[j]
        s_end = s[0] + s[1]
        if s[0] == seg[0]:
            s[0] += seg[1]
            s[1] -= seg[1]
            if s[1] == 0:
                del segs[j]
        elif s_end == end:
            s[1] -= seg[1]
        else:
            s[1] = seg[0] - s[0]
            segs.insert(j + 1, [end, s_end - end, seg[2]])
        return None

    problems = []
    segs = [list(s) for s in start]
    live = dict(blocks)
    # One backward walk: the state before event i is the state at index i - 1.
    for i in range(len(events) - 1, -2, -1):
        for addr in live:
            if not any(s[0] <= addr < s[0] + s[1] for s in segs):
                problems.append(
                    "at event {} of {}: block {:#x} in no segment (the viewer fails reading 'occupied')".format(
                        i, len(events), addr
                    )
                )
        if i < 0 or problems:
            break
        e = events[i]
        a = e["action"]
        seg = [e["addr"], e["size"], e["stream"]]
        if a in ("free", "free_completed"):
            live[e["addr"]] = e["size"]
        elif a == "alloc":
            live.pop(e["addr"], None)
        elif a in SEGMENT_SHRINKS:
            put_back(segs, a == "segment_unmap", seg)
        elif a in SEGMENT_GROWS:
            wrong = take_out(segs, a == "segment_map", seg)
            if wrong:
                problems.append("event {}: {} {:#x} +{}: {}".format(i, a, e["addr"], e["size"], wrong))
    return problems


class SnapshotInTheViewer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.snap = churn_snapshot()

    def test_the_history_has_segment_events_and_live_blocks_in_segments(self):
        trace = self.snap["device_traces"][0]
        actions = {t["action"] for t in trace}
        self.assertTrue(actions & set(SEGMENT_GROWS), sorted(actions))
        self.assertTrue(actions & set(SEGMENT_SHRINKS), "empty_cache gave nothing back: {}".format(sorted(actions)))
        streams = {t["stream"] for t in trace if t["action"] == "alloc"}
        self.assertEqual(len(streams), 2, streams)
        for seg in self.snap["segments"]:
            self.assertGreater(seg["total_size"], 0, seg)
            self.assertEqual(sum(b["size"] for b in seg["blocks"]), seg["total_size"], seg)

    def test_the_events_of_a_device_are_in_time_order(self):
        for device in devices_of(self.snap):
            times = [t["time_us"] for t in self.snap["device_traces"][device]]
            self.assertEqual(times, sorted(times), "device {}".format(device))

    # Under Quilt this fails (issue 48, open): its history writes mapped
    # memory as segment_map/segment_unmap only, so the timeline stacks the
    # snapshot's segments over a single step. Rewriting each change as a
    # segment_free of the old extent and a segment_alloc of the new one
    # fixes the timeline but breaks the state history where a segment keeps
    # its address (between the two entries its live blocks lie in no
    # segment). An unexpected success fails the run: drop this mark then.
    @(unittest.expectedFailure if ALLOCATOR == "quilt" else (lambda f: f))
    @unittest.skipIf(
        ALLOCATOR == "expandable",
        "torch's expandable segments write only segment_map and segment_unmap, which the viewer's segment "
        "timeline never reads: it draws their whole history as one time step (PyTorch's own limitation)",
    )
    def test_the_segment_timeline_stacks_the_reserved_memory_at_every_event(self):
        for device in devices_of(self.snap):
            self.assertEqual(timeline_problems(self.snap, device), [], "device {}".format(device))

    def test_the_state_history_replays_back_to_the_first_event(self):
        for device in devices_of(self.snap):
            self.assertEqual(state_history_problems(self.snap, device), [], "device {}".format(device))


if __name__ == "__main__":
    unittest.main()
