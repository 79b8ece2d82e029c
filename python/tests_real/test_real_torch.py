"""Tests of quilt_torch against the real torch package, without a GPU.

Run with the python of the virtual environment that scripts/torch-venv.sh
installs (crates/torch/tests/real_torch.rs does, from `cargo test`)::

    scripts/torch-venv.sh
    ~/.cache/quilt/torch-venv/bin/python -m unittest discover -s python/tests_real -v

Without a GPU torch cannot create a CUDA tensor, so what is checked is what
torch does reach without one: Quilt's allocator class (torch_allocator.cpp)
compiling against this torch and loading; enable() checking the
configuration and installing it as torch's CUDA allocator (or refusing,
installing nothing); torch's own C entry points that need no device
(statistics, peak and accumulated resets, empty_cache, the memory fraction,
snapshots, the private pools' begin/end/release, the graph trees' check,
checkpoint and restore of a pool)
reaching Quilt; the class's allocation path (called as torch's allocate()
would) throwing torch's c10::OutOfMemoryError with torch's message and
Quilt's verdict; and torch's
``python -m torch.cuda._memory_viz`` (stats, trace, segments, memory,
trace_plot, segment_plot) on every kind of snapshot Quilt writes, with the
backward replay of PyTorch's browser viewer (MemoryViz.js) checked on each.

The library reads QUILT_ALLOC_CONF once per process, so every scenario runs
in a subprocess of its own: ``python test_real_torch.py SCENARIO CONF``.
"""

import ctypes
import importlib
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

MiB = 1 << 20
HOST = "backend:host,capacity:256MiB"


def check(cond, message, *args):
    if not cond:
        raise AssertionError(message.format(*args) if args else message)


def quilt():
    import quilt_torch

    return quilt_torch


def lib():
    return quilt()._library()


def malloc(size, stream=0):
    p = lib().quilt_malloc(size, 0, stream)
    check(p, "quilt_malloc({}) failed: {}", size, quilt().last_error())
    return p


def free(p, size, stream=0):
    lib().quilt_free(p, size, 0, stream)
    check(quilt().last_error() == "" or p, "quilt_free failed")


def reserved():
    return quilt().memory_stats(0)["reserved_bytes"]["current"]


# -- scenarios (each in its own process) ------------------------------------


def allocator_lib():
    """The installed allocator class's ctypes handle (enable() first)."""
    return quilt().enable()._lib


def try_malloc(size, device=0, stream=None):
    """Allocate through torch's allocator class as torch would; (kind, ptr,
    message): kind 0 a pointer, 1 c10::OutOfMemoryError, 2 c10::Error."""
    out = ctypes.c_void_p(0)
    buf = ctypes.create_string_buffer(4096)
    kind = allocator_lib().quilt_allocator_try_malloc(size, device, stream, ctypes.byref(out), buf, len(buf))
    return kind, out.value, buf.value.decode()


def torch_stats(torch, device=0):
    """torch's own memory_stats() of `device`, flattened as torch.cuda.memory_stats does."""
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(prefix + "." + k if prefix else k, v)
        else:
            flat[prefix] = value

    walk("", torch._C._cuda_memoryStats(device))
    return flat


def scenario_loads():
    """Quilt's allocator class compiles against this torch and loads, with
    its entry points; torch's CUDAPluggableAllocator still loads the
    library (the mempool() route)."""
    import torch

    qt = quilt()
    lib = qt._bridge.allocator_library(torch)
    version = lib.quilt_allocator_torch_version().decode()
    check(torch.__version__.startswith(version), "compiled against {}, running {}", version, torch.__version__)
    for name in ("quilt_allocator_install", "quilt_allocator_try_malloc", "quilt_allocator_free"):
        check(hasattr(lib, name), "the allocator class lacks {}", name)
    for name in ("quilt_torch_malloc", "quilt_torch_free", "quilt_device_stats", "quilt_segments",
                 "quilt_history_since", "quilt_pool_create_or_incref", "quilt_pool_release"):
        check(qt._install._function_address(name), "the library lacks {}", name)
    check(lib.quilt_allocator_installed() == 0, "installed before enable()")
    torch.cuda.memory.CUDAPluggableAllocator(qt.library_path(), "quilt_malloc", "quilt_free")


def scenario_enable():
    """enable() installs the allocator class as torch's CUDA allocator;
    torch's own C entry points for statistics, resets, empty_cache, the
    memory fraction and snapshots reach Quilt and agree with what is
    allocated; it is idempotent, also after a reload."""
    import torch

    qt = quilt()
    allocator = qt.enable()
    check(allocator.installed(), "Quilt is not torch's CUDA allocator")
    check(qt.registered_hooks() == {}, "hooks registered")
    before = torch_stats(torch)
    check(before["allocated_bytes.all.current"] == 0, "allocated before: {}", before)
    kind, p, msg = try_malloc(10 * MiB)
    check(kind == 0 and p, "10 MiB: kind {} ({})", kind, msg)
    stats = torch_stats(torch)
    check(stats["allocated_bytes.all.current"] == 10 * MiB, "torch's allocated {}", stats["allocated_bytes.all.current"])
    check(stats["allocated_bytes.large_pool.current"] == 10 * MiB, "large pool {}", stats)
    check(stats["reserved_bytes.all.current"] >= 10 * MiB, "reserved {}", stats["reserved_bytes.all.current"])
    check(stats["allocation.all.current"] == 1 and stats["segment.all.current"] >= 1, "counts {}", stats)
    check(stats["allocated_bytes.all.current"] == qt.memory_allocated(), "torch's and Quilt's figures differ")
    ctypes.memset(p, 0x5A, MiB)
    check(ctypes.string_at(p, MiB) == b"\x5a" * MiB, "the bytes did not stay")
    allocator_lib().quilt_allocator_free(p)
    stats = torch_stats(torch)
    check(stats["allocated_bytes.all.current"] == 0, "allocated after the free {}", stats["allocated_bytes.all.current"])
    check(stats["allocated_bytes.all.peak"] == 10 * MiB, "peak {}", stats["allocated_bytes.all.peak"])
    torch._C._cuda_resetPeakMemoryStats(0)
    check(torch_stats(torch)["allocated_bytes.all.peak"] == 0, "the peak after a reset")
    check(torch_stats(torch)["allocated_bytes.all.allocated"] == 10 * MiB, "allocated total")
    torch._C._cuda_resetAccumulatedMemoryStats(0)
    check(torch_stats(torch)["allocated_bytes.all.allocated"] == 0, "the total after a reset")
    # A snapshot through torch: segments tile Quilt's reserved memory.
    kind, p, msg = try_malloc(3 * MiB)
    snap = torch._C._cuda_memorySnapshot(None)
    segments = snap["segments"]
    check(sum(x["total_size"] for x in segments) == torch_stats(torch)["reserved_bytes.all.current"], "segments {}", segments)
    live = [b for x in segments for b in x["blocks"] if b["state"] == "active_allocated"]
    check([b["size"] for b in live] == [3 * MiB], "live blocks {}", live)
    allocator_lib().quilt_allocator_free(p)
    # torch.cuda.empty_cache() -> torch._C._cuda_emptyCache.
    check(reserved() > 0, "nothing cached to empty")
    torch._C._cuda_emptyCache()
    check(reserved() == 0, "empty_cache did not reach Quilt: {} reserved", reserved())
    # set/get_per_process_memory_fraction -> torch._C._cuda_set/getMemoryFraction.
    torch._C._cuda_setMemoryFraction(0.25, 0)
    check(qt.memory_stats(0)["capacity_bytes"] == 64 * MiB, "the fraction did not reach Quilt")
    check(torch._C._cuda_getMemoryFraction(0) == 0.25, "get fraction {}", torch._C._cuda_getMemoryFraction(0))
    kind, _, msg = try_malloc(100 * MiB)
    check(kind == 1, "100 MiB served under a 64 MiB cap: {} {}", kind, msg)
    kind, p, msg = try_malloc(40 * MiB)
    # Below what is live: taken, as torch takes it; nothing more is mapped
    # until empty_cache gives memory back.
    torch._C._cuda_setMemoryFraction(0.05, 0)
    check(torch._C._cuda_getMemoryFraction(0) == 0.05, "get fraction {}", torch._C._cuda_getMemoryFraction(0))
    kind, _, msg = try_malloc(8 * MiB)
    check(kind == 1, "8 MiB served past a fraction below what is live: {} {}", kind, msg)
    check(qt.memory_stats(0)["capacity_bytes"] >= 40 * MiB, "the live block's memory is held")
    allocator_lib().quilt_allocator_free(p)
    torch._C._cuda_emptyCache()
    check(qt.memory_stats(0)["capacity_bytes"] == 12 * MiB, "the fraction did not take hold after empty_cache: {}", qt.memory_stats(0)["capacity_bytes"])
    torch._C._cuda_setMemoryFraction(1.0, 0)
    # Idempotent, also across a reload.
    check(qt.enable() is allocator, "a second enable() made another allocator")
    reloaded = importlib.reload(qt)
    check(reloaded.enable() is allocator, "enable() after a reload made another allocator")


def scenario_pools():
    """torch's private pools (CUDA graphs, MemPool) through torch's own
    entry points: memory allocated while a pool's route is on is the pool's;
    freed, it is reserved, not allocated, and serves only that pool; given
    back when the pool is released."""
    import torch

    qt = quilt()
    qt.enable()
    lib = allocator_lib()
    pool = (0, 77)
    torch._C._cuda_beginAllocateToPool(0, pool)
    check(lib.quilt_allocator_route_count() == 1, "no route")
    check(qt._library().quilt_pool_use_count(0, 0, 77) == 1, "use count")
    kind, a, msg = try_malloc(4 * MiB)
    check(kind == 0, "in the pool: {}", msg)
    allocator_lib().quilt_allocator_free(a)
    stats = torch_stats(torch)
    check(stats["allocated_bytes.all.current"] == 0, "a pool's freed block counts as allocated: {}", stats["allocated_bytes.all.current"])
    check(stats["reserved_bytes.all.current"] >= 4 * MiB, "a pool's freed block is not reserved")
    kind, b, msg = try_malloc(4 * MiB)
    check(b == a, "the pool did not reuse its block ({:#x} then {:#x})", a, b or 0)
    torch._C._cuda_endAllocateToPool(0, pool)
    check(lib.quilt_allocator_route_count() == 0, "the route stayed")
    allocator_lib().quilt_allocator_free(b)
    kind, c, msg = try_malloc(4 * MiB)
    check(c != a, "a block kept by a pool in use was handed out outside it")
    allocator_lib().quilt_allocator_free(c)
    # The CUDA graph trees' calls (torch.compile(mode="reduce-overhead")):
    # the pool's live blocks checked, its state checkpointed and restored.
    torch._C._cuda_beginAllocateToPool(0, pool)
    _, d, msg = try_malloc(4 * MiB)
    check(d == a, "the pool did not reuse its block: {}", msg)
    _, e, msg = try_malloc(2 * MiB)
    check(e not in (None, 0, a), "a second block of the pool: {}", msg)
    torch._C._cuda_endAllocateToPool(0, pool)
    torch._C._cuda_releasePool(0, pool)  # the use of this begin
    check(torch._C._cuda_checkPoolLiveAllocations(0, pool, {d, e}), "live blocks not {d, e}")
    check(not torch._C._cuda_checkPoolLiveAllocations(0, pool, {d}), "a live block missed")
    check(not torch._C._cuda_checkPoolLiveAllocations(0, pool, {d, e, 0x1000}), "a pointer not live counted")
    state = torch._C._cuda_getCheckpointState(0, pool)
    allocator_lib().quilt_allocator_free(e)
    check(torch._C._cuda_checkPoolLiveAllocations(0, pool, {d}), "e still live after its free")
    allocated = torch_stats(torch)["allocated_bytes.all.current"]
    # No stale storages, no storages to give deleters to: the restored
    # blocks stay allocated until freed by their pointers.
    torch._C._cuda_setCheckpointPoolState(0, state, [], [])
    check(torch._C._cuda_checkPoolLiveAllocations(0, pool, {d, e}), "the restore did not hand e out again")
    stats = torch_stats(torch)
    check(stats["allocated_bytes.all.current"] == allocated + 2 * MiB, "allocated after the restore: {}", stats["allocated_bytes.all.current"])
    allocator_lib().quilt_allocator_free(d)
    allocator_lib().quilt_allocator_free(e)
    check(torch._C._cuda_checkPoolLiveAllocations(0, pool, set()), "live blocks after their frees")
    torch._C._cuda_releasePool(0, pool)
    check(qt._library().quilt_pool_use_count(0, 0, 77) == 0, "use count after release")
    torch._C._cuda_emptyCache()
    check(reserved() == 0, "the pool's memory did not come back: {} reserved", reserved())
    try:
        torch._C._cuda_getCheckpointState(0, pool)
        raise AssertionError("getCheckpointState of a pool that is gone answered")
    except RuntimeError as exc:
        check("could not find pool" in str(exc), "{}", exc)


def scenario_oom():
    """An out of memory, and a request larger than Quilt could ever map,
    are c10::OutOfMemoryError (torch.OutOfMemoryError) whose message begins
    as torch's and ends with Quilt's verdict; num_ooms counts both; the next
    allocation works and keeps its bytes; other failures are c10::Error;
    size 0 is no error."""
    import torch

    quilt().enable()
    kind, _, msg = try_malloc(300 * MiB)
    check(kind == 1, "300 MiB of 256: kind {} ({})", kind, msg)
    check(msg.startswith("CUDA out of memory. Tried to allocate 300.00 MiB. GPU 0 has a total capacity of 256.00 MiB"), "the message: {}", msg)
    for word in ("Quilt:", "verdict"):
        check(word in msg, "the OutOfMemoryError lacks {!r}: {}", word, msg)
    kind, _, msg = try_malloc(4 << 40)
    check(kind == 1 and msg.startswith("CUDA out of memory. Tried to allocate 4096.00 GiB"), "4 TiB: kind {} ({})", kind, msg)
    kind, p, msg = try_malloc(1 * MiB)
    check(kind == 0 and p, "allocation after the OOM: kind {} ({})", kind, msg)
    ctypes.memset(p, 0x5A, MiB)
    check(ctypes.string_at(p, MiB) == b"\x5a" * MiB, "the bytes did not stay")
    kind, _, msg = try_malloc(MiB, device=-1)
    check(kind == 2 and "device -1" in msg, "a bad device: kind {} ({})", kind, msg)
    kind, p0, msg = try_malloc(0)
    check(kind == 0 and not p0, "size 0: kind {} ptr {} ({})", kind, p0, msg)
    check(torch_stats(torch)["num_ooms"] == 2, "num_ooms {}", torch_stats(torch)["num_ooms"])


def scenario_broken_source():
    """Where the allocator class does not compile against this torch (a
    torch it is not written for), enable() raises BridgeError naming the
    torch version and the compiler's error, and installs nothing."""
    import torch

    qt = quilt()
    broken = os.path.join(tempfile.mkdtemp(prefix="quilt-broken-"), "torch_allocator.cpp")
    with open(qt._bridge._ALLOCATOR_SOURCE) as f, open(broken, "w") as g:
        g.write(f.read().replace("void init(int /*device_count*/) override", "void init(int, int) override"))
    qt._bridge._ALLOCATOR_SOURCE = broken
    try:
        qt.enable()
        raise AssertionError("enable() installed a class that does not compile")
    except qt.BridgeError as exc:
        message = str(exc)
    for word in ("torch " + torch.__version__, "failed", "nothing was installed", "error"):
        check(word in message, "the message lacks {!r}: {}", word, message[:600])
    check(getattr(torch.cuda.memory, qt._install._ENABLED_ATTR, None) is None, "marked as enabled")


def scenario_refuse(expect_type, *words):
    """enable() refuses this configuration with a message, installing nothing."""
    import torch

    qt = quilt()
    try:
        qt.enable()
    except getattr(qt, expect_type) as exc:
        message = str(exc)
    else:
        raise AssertionError("enable() accepted QUILT_ALLOC_CONF={}".format(os.environ["QUILT_ALLOC_CONF"]))
    for word in words:
        check(word in message, "the message lacks {!r}: {}", word, message)
    lib = qt._bridge._allocator
    check(lib is None or lib.quilt_allocator_installed() == 0, "a refused enable() installed the allocator")
    check(getattr(torch.cuda.memory, qt._install._ENABLED_ATTR, None) is None, "marked as enabled")


# -- snapshots and torch's viewer -------------------------------------------


def viewer_replay(snap, device=0):
    """PyTorch's viewer's "Allocator State History" (simulate_memory in
    torch/utils/viz/MemoryViz.js), ported with its quirks: annotate (stream
    names: where every event of every device is on stream 0 the events'
    streams become null while the segments' stay 0, so that a range an
    undone segment_unmap puts back never merges with a snapshot segment;
    free_requested then free_completed is one 'free'), then for every event
    index replay the history backwards from the snapshot (map_segment and
    unmap_segment as written, JavaScript's splice(-1, ...) included) and find
    each live block's segment, which the viewer dereferences. Returns the
    number of states checked. scripts/viewer-check runs the viewer itself."""
    null_streams = all(t["stream"] == 0 for trace in snap["device_traces"] for t in trace)
    events = []
    for t in snap["device_traces"][device]:
        if t["action"] == "free_completed" and events:
            prev = events[-1]
            if prev["action"] == "free_requested" and prev["addr"] == t["addr"]:
                prev["action"] = "free"
                continue
        events.append(dict(t, stream=None if null_streams else t["stream"]))
    segments = []
    blocks = {}
    for seg in snap["segments"]:
        if seg["device"] != device:
            continue
        segments.append([seg["address"], seg["total_size"], seg["stream"]])
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[addr] = (addr, b["size"])
            addr += b["size"]
    segments.sort(key=lambda s: s[0])

    def map_segment(segs, merge, seg):
        idx = next((k for k, s in enumerate(segs) if s[0] > seg[0]), -1)
        if not merge:
            segs.insert(idx, seg)  # -1: before the last, as splice(-1, 0, seg)
            return
        if idx == -1:
            idx = len(segs)
        segs.insert(idx, seg)
        if idx + 1 < len(segs):
            n = segs[idx + 1]
            if seg[0] + seg[1] == n[0] and seg[2] == n[2]:
                seg[1] += n[1]
                del segs[idx + 1]
        if idx > 0:
            p = segs[idx - 1]
            if p[0] + p[1] == seg[0] and p[2] == seg[2]:
                p[1] += seg[1]
                del segs[idx]

    def unmap_segment(segs, merge, seg, i):
        if not merge:
            j = next((k for k, s in enumerate(segs) if s[0] == seg[0]), -1)
            if segs:
                del segs[j]  # -1: the last, as splice(-1, 1)
            return
        end = seg[0] + seg[1]
        j = next((k for k, s in enumerate(segs) if s[0] <= seg[0] and end <= s[0] + s[1]), None)
        check(
            j is not None,
            "event {}: {} {:#x}+{}: no segment holds it (the viewer fails: "
            "'Cannot read properties of undefined (reading 'addr')')",
            i,
            events[i]["action"],
            seg[0],
            seg[1],
        )
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

    def find_segment(by_addr, addr):
        left, right = 0, len(by_addr) - 1
        while left <= right:
            mid = (left + right) // 2
            if addr < by_addr[mid][0]:
                right = mid - 1
            elif addr >= by_addr[mid][0] + by_addr[mid][1]:
                left = mid + 1
            else:
                return by_addr[mid]
        return None

    def simulate(idx):
        segs = [list(s) for s in segments]
        live = dict(blocks)
        for i in range(len(events) - 1, idx, -1):
            e = events[i]
            a = e["action"]
            seg = [e["addr"], e["size"], e["stream"]] if a.startswith("segment_") else None
            if a in ("free", "free_completed"):
                live[e["addr"]] = (e["addr"], e["size"])
            elif a == "free_requested":
                check(e["addr"] in live, "event {}: free_requested of {:#x}, no such block", i, e["addr"])
            elif a == "alloc":
                live.pop(e["addr"], None)
            elif a in ("segment_free", "segment_unmap"):
                map_segment(segs, a == "segment_unmap", seg)
            elif a in ("segment_alloc", "segment_map"):
                unmap_segment(segs, a == "segment_map", seg, i)
        by_addr = sorted(sorted(segs, key=lambda s: (s[1], s[0])), key=lambda s: s[0])
        for addr, size in live.values():
            check(
                find_segment(by_addr, addr) is not None,
                "viewer state at event {} of {}: block {:#x}+{} is in no segment "
                "(the viewer fails: 'Cannot read properties of null')",
                idx,
                len(events),
                addr,
                size,
            )

    for idx in range(-1, len(events)):
        simulate(idx)
    return len(events) + 1


def make_snapshot(kind, path):
    """Write one kind of snapshot with history; returns what it must show."""
    qt = quilt()
    qt.record_history(True, 100000)
    if kind == "empty":
        pass
    elif kind == "oom":
        a = malloc(100 * MiB)
        check(not lib().quilt_malloc(300 * MiB, 0, 0), "300 MiB of 256 served")
        b = malloc(8 * MiB)
        free(a, 100 * MiB)
        free(b, 8 * MiB)
    elif kind in ("empty_cache", "reclaim_always"):
        live = [malloc(s * MiB) for s in (3, 30, 5, 64, 1)]
        for p, s in list(zip(live, (3, 30, 5, 64, 1)))[::2]:
            free(p, s * MiB)
        qt.empty_cache()
        c = malloc(20 * MiB)
        for p, s in list(zip(live, (3, 30, 5, 64, 1)))[1::2]:
            free(p, s * MiB)
        free(c, 20 * MiB)
        keep = malloc(2 * MiB)  # something live in the snapshot
        check(keep, "no block")
        qt.empty_cache()
    elif kind == "streams":
        held = []
        for i, stream in enumerate((0, 0x1111, 0x2222, 0x3333) * 4):
            held.append((malloc((i % 5 + 1) * MiB, stream), (i % 5 + 1) * MiB, stream))
        for p, size, stream in held[::3]:
            free(p, size, stream)
        qt.empty_cache()
    else:
        raise AssertionError("no snapshot kind " + kind)
    qt.dump_snapshot(path)
    with open(path, "rb") as f:
        return pickle.load(f)


FLAMEGRAPH_STUB = """#!{python}
# Stands in for flamegraph.pl (which _memory_viz downloads from GitHub, not
# reachable here): checks each input line is 'frame;frame;... bytes'.
import re, sys
lines = sys.stdin.read().splitlines()
bad = [l for l in lines if not re.fullmatch(r".+ [0-9]+", l)]
if bad:
    sys.stderr.write("malformed flamegraph input: %r\\n" % bad[:3])
    sys.exit(1)
print("<svg><!-- %d stacks --></svg>" % len(lines))
"""


def scenario_viz(kind):
    """`python -m torch.cuda._memory_viz` runs on this kind of snapshot, and
    PyTorch's viewer can replay its history."""
    tmp = tempfile.mkdtemp(prefix="quilt-viz-")
    path = os.path.join(tmp, "snap.pickle")
    snap = make_snapshot(kind, path)
    stats = quilt().memory_stats(0)
    trace = snap["device_traces"][0] if snap["device_traces"] else []
    actions = [t["action"] for t in trace]
    for key in ("allocator_settings", "external_annotations", "host_segments", "host_traces"):
        check(key in snap, "the snapshot lacks {!r}", key)
    check(
        stats["segment"]["current"] == len(snap["segments"]),
        "stats count {} segments, the snapshot shows {}",
        stats["segment"]["current"],
        len(snap["segments"]),
    )
    if kind == "oom":
        ooms = [t for t in trace if t["action"] == "oom"]
        check(len(ooms) == 1 and "device_free" in ooms[0] and "addr" not in ooms[0], "oom entries: {}", ooms)
        check(ooms[0]["size"] == 300 * MiB, "the oom entry's size {}", ooms[0]["size"])
    if kind in ("empty_cache", "reclaim_always", "streams", "oom"):
        check("segment_map" in actions, "no segment_map in {}", sorted(set(actions)))
    # PyTorch pairs segment_free with a segment_alloc of the same range only;
    # Quilt's runs change between the two, so it writes map and unmap only.
    check(
        not {"segment_alloc", "segment_free"} & set(actions),
        "segment_alloc or segment_free in {}",
        sorted(set(actions)),
    )
    if kind in ("empty_cache", "reclaim_always"):
        check(
            "segment_unmap" in actions,
            "memory was unmapped but the history says nothing: {}",
            sorted(set(actions)),
        )
    if kind == "streams":
        streams = {t["stream"] for t in trace if t["action"] == "alloc"}
        check(streams == {0, 0x1111, 0x2222, 0x3333}, "alloc streams {}", streams)
    for t in trace:
        check(t["frames"] and t["frames"][0]["name"].startswith("quilt_"), "frames of {}", t)
    states = viewer_replay(snap)
    # torch's own tools, as a user runs them.
    home = os.path.join(tmp, "home")
    os.makedirs(os.path.join(home, ".cache"))
    stub = os.path.join(home, ".cache", "flamegraph.pl")
    with open(stub, "w") as f:
        f.write(FLAMEGRAPH_STUB.format(python=sys.executable))
    os.chmod(stub, 0o755)
    env = dict(os.environ, HOME=home)
    outputs = {}
    for command in ("stats", "trace", "segments", "memory", "trace_plot", "segment_plot"):
        out = os.path.join(tmp, command + (".svg" if command in ("segments", "memory") else ".html"))
        argv = [sys.executable, "-m", "torch.cuda._memory_viz", command, path]
        if command not in ("stats", "trace"):
            argv += ["-o", out]
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
        check(
            done.returncode == 0,
            "_memory_viz {} failed on the {} snapshot ({}):\n{}{}",
            command,
            kind,
            done.returncode,
            done.stdout,
            done.stderr,
        )
        if command in ("stats", "trace"):
            outputs[command] = done.stdout
        else:
            with open(out) as f:
                outputs[command] = f.read()
    total = sum(s["total_size"] for s in snap["segments"])
    check(total == stats["reserved_bytes"]["current"], "segments {} != reserved {}", total, stats["reserved_bytes"])
    check("segments: {}".format(len(snap["segments"])) in outputs["stats"], "stats: {}", outputs["stats"])
    if kind == "oom":
        check("raise OutOfMemoryError # 300.0MiB requested" in outputs["trace"], "trace: {}", outputs["trace"])
    if "segment_map" in actions:
        check("'segment_map'" in outputs["trace"], "trace shows no segment: {}", outputs["trace"])
    for command in ("trace_plot", "segment_plot"):
        check("snapshot.pickle" in outputs[command], "{} holds no snapshot", command)
    for command in ("segments", "memory"):
        check(outputs[command].startswith("<svg>"), "{}: {}", command, outputs[command][:200])
    print("{} events, {} viewer states checked, actions {}".format(len(trace), states, sorted(set(actions))))


def scenario_enable_from_threads():
    """enable() called from four threads at once checks, builds and
    installs the allocator class once; every thread gets the same
    TorchAllocator."""
    import threading
    import time

    qt = quilt()
    calls = {"check": 0, "build": 0}
    check_configuration, allocator_library = qt._install.check_configuration, qt._bridge.allocator_library

    def slow_check():
        calls["check"] += 1
        time.sleep(0.5)  # the others arrive meanwhile
        return check_configuration()

    def counted_build(torch):
        calls["build"] += 1
        return allocator_library(torch)

    qt._install.check_configuration, qt._bridge.allocator_library = slow_check, counted_build
    start = threading.Barrier(4)
    got = []

    def call():
        start.wait()
        got.append(qt.enable())

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(len(got) == 4 and all(a is got[0] for a in got), "different allocators: {}", got)
    check(calls == {"check": 1, "build": 1}, "enable() ran its steps {}", calls)
    check(got[0].installed(), "not installed")
    check(qt.enable() is got[0], "a later enable() gave another")


SCENARIOS = {
    "loads": scenario_loads,
    "enable_from_threads": scenario_enable_from_threads,
    "enable": scenario_enable,
    "pools": scenario_pools,
    "oom": scenario_oom,
    "broken_source": scenario_broken_source,
    "refuse": scenario_refuse,
    "viz": scenario_viz,
}


def run(test, scenario, conf, *args, env=None):
    env = dict(os.environ, QUILT_ALLOC_CONF=conf, **(env or {}))
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), scenario] + list(args),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
        timeout=600,
    )
    if done.returncode != 0 or "WORKER OK" not in done.stdout:
        test.fail(
            "{} {} (QUILT_ALLOC_CONF={}) failed ({}):\n{}\n{}".format(
                scenario, " ".join(args), conf, done.returncode, done.stdout, done.stderr
            )
        )
    return done.stdout


class RealTorchTest(unittest.TestCase):
    def test_the_allocator_class_builds_and_loads(self):
        run(self, "loads", HOST)

    def test_enable_installs_quilt_as_torchs_allocator_and_torchs_apis_reach_it(self):
        run(self, "enable", HOST)

    def test_enable_from_four_threads_at_once_installs_once(self):
        run(self, "enable_from_threads", HOST)

    def test_private_pools_keep_their_memory_until_released(self):
        run(self, "pools", HOST)

    def test_a_torch_the_class_does_not_compile_against_is_a_bridge_error(self):
        run(self, "broken_source", HOST, env={"QUILT_TORCH_BRIDGE_CACHE": tempfile.mkdtemp(prefix="quilt-broken-cache-")})

    def test_out_of_memory_is_torchs_out_of_memory_error(self):
        run(self, "oom", HOST)

    def test_enable_refuses_a_bad_capacity(self):
        run(self, "refuse", "backend:host,capacity:lots", "ConfigurationError", "capacity", "lots")

    def test_enable_refuses_an_unknown_key(self):
        run(self, "refuse", "backend:host,colour:blue", "ConfigurationError", "colour")

    def test_enable_refuses_the_simulated_backend(self):
        run(self, "refuse", "backend:sim", "ConfigurationError", "backend:sim")

    def test_enable_without_a_compiler_says_so(self):
        """No C++ compiler and no cached bridge: BridgeError, nothing installed."""
        env = {
            "CXX": "",
            "PATH": os.path.dirname(sys.executable),
            "QUILT_TORCH_BRIDGE_CACHE": tempfile.mkdtemp(prefix="quilt-no-bridge-"),
        }
        run(self, "refuse", HOST, "BridgeError", "needs a C++ compiler", "2.", env=env)

    def test_enable_refuses_cuda_without_a_driver(self):
        import torch

        if torch.cuda.is_available():
            self.skipTest("a CUDA driver is present: the cuda backend is available")
        run(self, "refuse", "", "QuiltError", "CUDA backend is unavailable")


class MemoryVizTest(unittest.TestCase):
    """torch.cuda._memory_viz on every kind of snapshot Quilt exports."""

    def test_empty(self):
        run(self, "viz", HOST, "empty")

    def test_after_an_out_of_memory(self):
        run(self, "viz", HOST, "oom")

    def test_after_empty_cache(self):
        run(self, "viz", HOST, "empty_cache")

    def test_reclaim_always(self):
        run(self, "viz", HOST + ",reclaim:always", "reclaim_always")

    def test_several_streams(self):
        run(self, "viz", HOST, "streams")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in SCENARIOS:
        SCENARIOS[sys.argv[1]](*sys.argv[2:])
        print("WORKER OK", flush=True)
        sys.exit(0)
    unittest.main()
