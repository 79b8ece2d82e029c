"""Tests of libquilt_torch.so's C interface through ctypes, without torch or a GPU.

The library reads its configuration (``QUILT_ALLOC_CONF``) once per process,
so every scenario runs in its own subprocess: this file re-invokes itself as
``python3 test_ctypes.py SCENARIO BACKEND [ARGS...]`` with the configuration
in the environment. Each scenario runs on the ``host`` backend (real host
memory: the test writes and verifies byte patterns through the pointers) and
on the ``sim`` backend (simulated device: pointers are never dereferenced).

Run from the repository root::

    python3 -m unittest discover -s python/tests -v

The library is ``$QUILT_TORCH_LIBRARY`` if set, else
``<repo>/target/release/libquilt_torch.so``, which is built once with
``cargo build --release -p quilt-torch`` when missing.
"""

import bisect
import ctypes
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import threading
import traceback
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
DEFAULT_LIBRARY = os.path.join(REPO, "target", "release", "libquilt_torch.so")
LIBRARY_ENV = "QUILT_TORCH_LIBRARY"
CONF_ENV = "QUILT_ALLOC_CONF"

KiB = 1 << 10
MiB = 1 << 20
CAPACITY = 256 * MiB
CAPACITY_CONF = "256MiB"
DEVICE = 0

# The statistics quilt_stats_json must report, by kind.
COUNTER_STATS = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "requested_bytes",
    "allocation",
    "segment",
    "active",
)
INTEGER_STATS = ("num_ooms", "num_alloc_retries", "num_stream_waits")
DESCRIPTION_KEYS = ("device", "allocator", "backend", "capacity_bytes")

SEGMENT_KEYS = (
    "device",
    "address",
    "total_size",
    "allocated_size",
    "active_size",
    "requested_size",
    "stream",
    "segment_type",
    "blocks",
)
BLOCK_KEYS = ("address", "size", "requested_size", "state", "frames")
BLOCK_STATES = ("active_allocated", "inactive")
TRACE_KEYS = ("action", "addr", "size", "stream", "time_us", "frames")


# ---------------------------------------------------------------------------
# Finding (and if need be building) the library
# ---------------------------------------------------------------------------

_build_lock = threading.Lock()


def library_path():
    """Path of libquilt_torch.so, building the default one once if missing."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = os.path.abspath(override)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                "{}={} does not exist".format(LIBRARY_ENV, override)
            )
        return path
    with _build_lock:
        if not os.path.isfile(DEFAULT_LIBRARY):
            command = ["cargo", "build", "--release", "-p", "quilt-torch"]
            print(
                "\n{} missing; running {} ...".format(
                    DEFAULT_LIBRARY, " ".join(command)
                ),
                file=sys.stderr,
                flush=True,
            )
            done = subprocess.run(
                command,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                universal_newlines=True,
            )
            if done.returncode != 0 or not os.path.isfile(DEFAULT_LIBRARY):
                raise RuntimeError(
                    "`{}` failed (exit {}):\n{}".format(
                        " ".join(command), done.returncode, done.stdout
                    )
                )
    return DEFAULT_LIBRARY


def load_library(path):
    """Load the library and declare every entry point's prototype."""
    lib = ctypes.CDLL(path)
    vp, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    prototypes = {
        "quilt_malloc": ([size, i32, vp], vp),
        "quilt_free": ([vp, size, i32, vp], None),
        "quilt_empty_cache": ([], None),
        "quilt_record_stream": ([vp, vp], None),
        "quilt_set_memory_fraction": ([ctypes.c_double, i32], None),
        "quilt_stats_json": ([i32, ctypes.c_char_p, size], size),
        "quilt_last_error": ([ctypes.c_char_p, size], size),
        "quilt_record_history": ([i32, size], i32),
        "quilt_dump_snapshot": ([ctypes.c_char_p], i32),
        "quilt_set_tag": ([ctypes.c_char_p], i32),
        "quilt_clear_tag": ([], i32),
        "quilt_current_tag": ([ctypes.c_char_p, size], size),
        "quilt_sleep": ([ctypes.c_char_p, i32], i32),
        "quilt_wake": ([ctypes.c_char_p], i32),
        "quilt_is_asleep": ([ctypes.c_char_p], i32),
    }
    for name, (argtypes, restype) in prototypes.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib


# ---------------------------------------------------------------------------
# Worker side: helpers
# ---------------------------------------------------------------------------


def check(condition, message, *args):
    """assert that survives python -O; the message is formatted lazily."""
    if not condition:
        raise AssertionError(message.format(*args) if args else message)


def read_string(fn, *args):
    """Whole text of an snprintf-style entry point (retrying if it grew)."""
    needed = fn(*args, None, 0)
    while True:
        buf = ctypes.create_string_buffer(needed + 1)
        got = fn(*args, buf, needed + 1)
        if got <= needed:
            check(buf.raw[got] == 0, "no NUL after {} bytes", got)
            return buf.raw[:got].decode("utf-8")
        needed = got


def last_error(lib):
    """The calling thread's last error ("" if none)."""
    return read_string(lib.quilt_last_error)


def stats(lib, device=DEVICE):
    """quilt_stats_json(device) parsed."""
    text = read_string(lib.quilt_stats_json, device)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise AssertionError("stats JSON does not parse ({}): {!r}".format(exc, text))


def check_stats_schema(s, backend):
    """The keys and types quilt_stats_json promises, for a used device."""
    check("error" not in s, "stats report an error: {}", s)
    for key in DESCRIPTION_KEYS:
        check(key in s, "stats lack {!r}: {}", key, s)
    check(s["device"] == DEVICE, "stats device {} != {}", s["device"], DEVICE)
    check(
        backend in str(s["backend"]).lower(),
        "stats backend {!r} is not {!r}",
        s["backend"],
        backend,
    )
    check(
        s["capacity_bytes"] == CAPACITY,
        "capacity_bytes {} != configured {}",
        s["capacity_bytes"],
        CAPACITY,
    )
    for key in COUNTER_STATS:
        value = s.get(key)
        check(isinstance(value, dict), "stats {!r} is not an object: {!r}", key, value)
        for field in ("current", "peak"):
            check(
                isinstance(value.get(field), int) and value[field] >= 0,
                "stats {}.{} is not a non-negative integer: {!r}",
                key,
                field,
                value.get(field),
            )
        check(
            value["current"] <= value["peak"],
            "stats {}: current {} > peak {}",
            key,
            value["current"],
            value["peak"],
        )
    for key in INTEGER_STATS:
        check(isinstance(s.get(key), int), "stats {!r} not an integer: {!r}", key, s.get(key))
    calls = s.get("driver_calls")
    check(isinstance(calls, dict), "driver_calls is not an object: {!r}", calls)
    for name, count in calls.items():
        check(isinstance(count, int), "driver_calls[{!r}] = {!r}", name, count)


def in_fresh_thread(lib, fn):
    """Run fn() in a new thread; return (error before, fn's result, error after).

    Errors are kept per thread, so a new thread starts with none and whatever
    it reports afterwards was set by fn.
    """
    out = {}

    def body():
        try:
            out["before"] = last_error(lib)
            out["result"] = fn()
            out["after"] = last_error(lib)
        except BaseException:  # re-raised in the caller's thread
            out["exc"] = traceback.format_exc()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "exc" in out:
        raise AssertionError("in a fresh thread:\n" + out["exc"])
    return out["before"], out["result"], out["after"]


def pattern(tag, length):
    """A byte pattern distinct for each tag, `length` bytes long."""
    unit = ((tag * 0x9E3779B97F4A7C15) ^ 0xA5A5A5A5A5A5A5A5) & (2 ** 64 - 1)
    unit = unit.to_bytes(8, "little")
    return (unit * (length // 8 + 1))[:length]


SMALL_FULL_CHECK = 4 * KiB  # blocks up to this size are filled entirely
PROBE = 64  # bytes written at the start, middle and end of larger blocks


def probes(size):
    """Offsets and lengths written into a block of `size` bytes."""
    if size <= SMALL_FULL_CHECK:
        return [(0, size)]
    return [(0, PROBE), (size // 2 - PROBE // 2, PROBE), (size - PROBE, PROBE)]


def write_pattern(ptr, size, tag):
    """Write tag's pattern into the block (host backend only)."""
    for index, (offset, length) in enumerate(probes(size)):
        data = pattern(tag * 4 + index, length)
        ctypes.memmove(ptr + offset, data, length)
    # The very last byte through memset as well, a second write path.
    ctypes.memset(ptr + size - 1, pattern(tag, 1)[0] ^ 0x5A, 1)


def verify_pattern(ptr, size, tag):
    """Check tag's pattern is still in the block (host backend only)."""
    for index, (offset, length) in enumerate(probes(size)):
        expected = bytearray(pattern(tag * 4 + index, length))
        if offset + length == size:
            expected[-1] = pattern(tag, 1)[0] ^ 0x5A
        got = ctypes.string_at(ptr + offset, length)
        check(
            got == bytes(expected),
            "block {:#x} ({} bytes): bytes {}..{} were overwritten",
            ptr,
            size,
            offset,
            offset + length,
        )


def malloc_ok(lib, size, stream=None):
    """quilt_malloc that must succeed."""
    ptr = lib.quilt_malloc(size, DEVICE, stream)
    check(ptr, "quilt_malloc({}) returned NULL: {}", size, last_error(lib))
    return ptr


# ---------------------------------------------------------------------------
# Worker side: scenarios
# ---------------------------------------------------------------------------

THREADS = 8
OPS_PER_THREAD = 2000
STREAMS = (None, 1, 2)
MAX_LIVE_PER_THREAD = 24
LIVE_LIMIT = CAPACITY * 3 // 8  # live requested bytes, all threads together
EDGE_SIZES = (1, 511, 512, 513, 4 * KiB, MiB - 1, MiB, 2 * MiB - 1, 2 * MiB, 2 * MiB + 1)


def random_size(rng):
    """Mixed sizes: mostly small, some MiB, a few of 20-40 MiB."""
    roll = rng.random()
    if roll < 0.05:
        return rng.choice(EDGE_SIZES)
    if roll < 0.55:
        return rng.randint(1, 4 * KiB)
    if roll < 0.82:
        return rng.randint(4 * KiB, MiB)
    if roll < 0.97:
        return rng.randint(MiB, 4 * MiB)
    return rng.randint(20 * MiB, 40 * MiB)


class LiveSet:
    """Every live block of all threads: checks none overlaps another."""

    def __init__(self):
        self.lock = threading.Lock()
        self.starts = []  # sorted block addresses
        self.sizes = {}  # address -> requested size
        self.total = 0  # requested bytes live or reserved for a coming malloc

    def reserve(self, size):
        """Count `size` bytes against LIVE_LIMIT; False if they do not fit."""
        with self.lock:
            if self.total + size > LIVE_LIMIT:
                return False
            self.total += size
            return True

    def unreserve(self, size):
        with self.lock:
            self.total -= size

    def add(self, ptr, size):
        with self.lock:
            i = bisect.bisect_right(self.starts, ptr)
            if i > 0:
                prev = self.starts[i - 1]
                check(
                    prev + self.sizes[prev] <= ptr,
                    "new block {:#x}+{} overlaps live block {:#x}+{}",
                    ptr,
                    size,
                    prev,
                    self.sizes[prev],
                )
            if i < len(self.starts):
                nxt = self.starts[i]
                check(
                    ptr + size <= nxt,
                    "new block {:#x}+{} overlaps live block {:#x}+{}",
                    ptr,
                    size,
                    nxt,
                    self.sizes[nxt],
                )
            self.starts.insert(i, ptr)
            self.sizes[ptr] = size

    def remove(self, ptr):
        with self.lock:
            i = bisect.bisect_left(self.starts, ptr)
            check(i < len(self.starts) and self.starts[i] == ptr, "lost block {:#x}", ptr)
            del self.starts[i]
            del self.sizes[ptr]


def scenario_stress(lib, backend):
    """8 threads allocate and free thousands of mixed blocks on 3 streams."""
    host = backend == "host"
    live_set = LiveSet()
    errors = []
    counts = [0] * THREADS
    barrier = threading.Barrier(THREADS)

    def worker(tid):
        rng = random.Random(1000 + tid)
        live = []  # (ptr, size, stream, tag)
        seq = 0

        def free_one():
            ptr, size, stream, tag = live.pop(rng.randrange(len(live)))
            if host:
                verify_pattern(ptr, size, tag)
            live_set.remove(ptr)
            lib.quilt_free(ptr, size, DEVICE, stream)
            live_set.unreserve(size)

        try:
            barrier.wait()
            for _ in range(OPS_PER_THREAD):
                if live and (len(live) >= MAX_LIVE_PER_THREAD or rng.random() < 0.45):
                    free_one()
                    continue
                size = random_size(rng)
                if not live_set.reserve(size):
                    if live:
                        free_one()  # make room; try again next op
                    continue
                stream = rng.choice(STREAMS)
                ptr = lib.quilt_malloc(size, DEVICE, stream)
                if not ptr:
                    live_set.unreserve(size)
                    raise AssertionError(
                        "thread {}: quilt_malloc({}, stream {}) returned NULL "
                        "with {} bytes live: {}".format(
                            tid, size, stream, live_set.total, last_error(lib)
                        )
                    )
                live_set.add(ptr, size)
                seq += 1
                tag = tid << 32 | seq
                if host:
                    write_pattern(ptr, size, tag)
                live.append((ptr, size, stream, tag))
                counts[tid] += 1
            while live:
                free_one()
        except BaseException:
            errors.append("thread {}:\n{}".format(tid, traceback.format_exc()))
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    check(not errors, "worker threads failed:\n{}", "\n".join(errors))
    check(live_set.total == 0 and not live_set.starts, "blocks left live")

    s = stats(lib)
    check_stats_schema(s, backend)
    for key in ("allocated_bytes", "requested_bytes", "active_bytes", "allocation", "active"):
        check(s[key]["current"] == 0, "{}.current is {} after all frees", key, s[key]["current"])
    check(s["allocation"]["peak"] > 0, "allocation.peak is 0")
    check(s["allocated_bytes"]["peak"] > 0, "allocated_bytes.peak is 0")
    check(
        s["reserved_bytes"]["current"] <= CAPACITY and s["reserved_bytes"]["peak"] <= CAPACITY,
        "reserved_bytes {} exceeds the capacity {}",
        s["reserved_bytes"],
        CAPACITY,
    )
    check(
        s["allocated_bytes"]["peak"] <= s["reserved_bytes"]["peak"],
        "allocated peak {} > reserved peak {}",
        s["allocated_bytes"]["peak"],
        s["reserved_bytes"]["peak"],
    )
    check(s["num_ooms"] == 0, "num_ooms is {} although no allocation failed", s["num_ooms"])

    # Returning the cache never grows the reservation.
    lib.quilt_empty_cache()
    after = stats(lib)
    check(
        after["reserved_bytes"]["current"] <= s["reserved_bytes"]["current"],
        "empty_cache grew reserved_bytes from {} to {}",
        s["reserved_bytes"]["current"],
        after["reserved_bytes"]["current"],
    )

    # A device never used: a fresh allocator's JSON or an error object.
    other = stats(lib, 1)
    check(
        "error" in other or other.get("allocated_bytes", {}).get("current") == 0,
        "stats of unused device 1: {}",
        other,
    )
    print("allocations per thread:", counts)
    print("stats:", json.dumps(s, sort_keys=True))


def check_oom_error(err, what):
    low = err.lower()
    check("out of memory" in low, "{}: error lacks 'out of memory': {!r}", what, err)
    check(
        "capacity" in low or "fragmentation" in low,
        "{}: error has no verdict (capacity / fragmentation): {!r}",
        what,
        err,
    )


def scenario_oom(lib, backend):
    """Requests beyond the capacity fail cleanly and the library goes on."""
    host = backend == "host"
    # Warm up so the device is in use, then the oversize requests.
    warm = malloc_ok(lib, 4 * KiB)
    for size, stream in ((CAPACITY + 64 * MiB, None), (2 * CAPACITY, 1)):
        before, ptr, err = in_fresh_thread(lib, lambda: lib.quilt_malloc(size, DEVICE, stream))
        check(before == "", "a fresh thread starts with error {!r}", before)
        check(ptr is None, "quilt_malloc({}) beyond capacity returned {:#x}", size, ptr or 0)
        check_oom_error(err, "malloc({})".format(size))
    check(stats(lib)["num_ooms"] >= 1, "num_ooms not counted: {}", stats(lib))

    # Errors stay with their thread.
    check(lib.quilt_malloc(2 * CAPACITY, DEVICE, None) is None, "oversize malloc succeeded")
    check_oom_error(last_error(lib), "main thread")
    before, _, after = in_fresh_thread(lib, lambda: None)
    check(before == "" and after == "", "another thread's error leaked: {!r}", after)

    # An absurd size: NULL and an error, no crash.
    before, ptr, err = in_fresh_thread(lib, lambda: lib.quilt_malloc(1 << 62, DEVICE, None))
    check(ptr is None and err, "malloc(1 << 62) gave {!r}, error {!r}", ptr, err)

    # Fill three quarters, then ask for more than what is left.
    blocks = [malloc_ok(lib, 48 * MiB, s) for s in (None, 1, None, 2)]
    before, ptr, err = in_fresh_thread(lib, lambda: lib.quilt_malloc(96 * MiB, DEVICE, None))
    check(ptr is None, "96 MiB with 192 MiB of 256 live returned {:#x}", ptr or 0)
    check_oom_error(err, "malloc(96MiB) with 192MiB live")
    for ptr, s in zip(blocks, (None, 1, None, 2)):
        lib.quilt_free(ptr, 48 * MiB, DEVICE, s)

    # The library still works, small and large.
    for size in (4 * KiB, 96 * MiB, CAPACITY // 2):
        ptr = malloc_ok(lib, size)
        if host:
            write_pattern(ptr, size, size)
            verify_pattern(ptr, size, size)
        lib.quilt_free(ptr, size, DEVICE, None)
    lib.quilt_free(warm, 4 * KiB, DEVICE, None)
    s = stats(lib)
    check_stats_schema(s, backend)
    check(s["allocated_bytes"]["current"] == 0, "allocated_bytes after: {}", s["allocated_bytes"])
    check(s["reserved_bytes"]["peak"] <= CAPACITY, "reserved beyond capacity: {}", s["reserved_bytes"])


def scenario_bad_frees(lib, backend):
    """Freeing NULL, an unknown or an already freed pointer is an error, not a crash."""
    host = backend == "host"

    def expect_error(what, fn):
        before, _, after = in_fresh_thread(lib, fn)
        check(before == "", "{}: fresh thread starts with {!r}", what, before)
        check(after != "", "{}: no error recorded", what)
        print("{}: {}".format(what, after))

    def expect_clean(what, fn):
        before, result, after = in_fresh_thread(lib, fn)
        check(after == "", "{}: unexpected error {!r}", what, after)
        return result

    expect_error("free(NULL)", lambda: lib.quilt_free(None, 0, DEVICE, None))
    expect_error("free(NULL, 64, stream 1)", lambda: lib.quilt_free(None, 64, DEVICE, 1))
    expect_error("free(0x1234)", lambda: lib.quilt_free(0x1234, 64, DEVICE, None))

    # A valid pair leaves no error; freeing the same pointer again does.
    ptr = expect_clean("malloc(1000)", lambda: malloc_ok(lib, 1000))
    expect_clean("free(ptr)", lambda: lib.quilt_free(ptr, 1000, DEVICE, None))
    expect_error("double free", lambda: lib.quilt_free(ptr, 1000, DEVICE, None))

    # Same with a large block on a side stream.
    big = malloc_ok(lib, 8 * MiB, 2)
    lib.quilt_free(big, 8 * MiB, DEVICE, 2)
    expect_error("double free (8 MiB, stream 2)", lambda: lib.quilt_free(big, 8 * MiB, DEVICE, 2))

    # A pointer inside a live block is unknown too, and leaves the block alone.
    ptr = malloc_ok(lib, 4 * KiB)
    if host:
        write_pattern(ptr, 4 * KiB, 7)
    expect_error("free(interior pointer)", lambda: lib.quilt_free(ptr + 16, 4 * KiB - 16, DEVICE, None))
    s = stats(lib)
    check(s["allocation"]["current"] == 1, "allocation.current {} != 1", s["allocation"]["current"])
    if host:
        verify_pattern(ptr, 4 * KiB, 7)
    expect_clean("free(live block)", lambda: lib.quilt_free(ptr, 4 * KiB, DEVICE, None))

    s = stats(lib)
    check_stats_schema(s, backend)
    check(s["allocated_bytes"]["current"] == 0, "allocated_bytes {}", s["allocated_bytes"])
    check(s["allocation"]["current"] == 0, "allocation {}", s["allocation"])
    lib.quilt_free(malloc_ok(lib, 256), 256, DEVICE, None)


def scenario_snprintf(lib, backend):
    """quilt_last_error and quilt_stats_json follow snprintf's convention."""
    del backend

    def no_error():
        buf = ctypes.create_string_buffer(b"#" * 8, 8)
        n = lib.quilt_last_error(None, 0)
        m = lib.quilt_last_error(buf, 8)
        return n, m, buf.raw

    _, (n, m, raw), _ = in_fresh_thread(lib, no_error)
    check(n == 0 and m == 0, "no error yet, but lengths {} and {}", n, m)
    check(raw == b"\0" + b"#" * 7, "empty error written as {!r}", raw)

    lib.quilt_free(0x1234, 64, DEVICE, None)  # sets an error
    n = lib.quilt_last_error(None, 0)
    check(n > 4, "error length {} after a bad free", n)
    full = last_error(lib).encode("utf-8")
    check(len(full) == n, "error is {} bytes, {} announced", len(full), n)
    check(last_error(lib).encode() == full, "reading the error changed it")

    for length in (1, 5, n, n + 1, n + 10):
        buf = ctypes.create_string_buffer(b"#" * (n + 16), n + 16)
        got = lib.quilt_last_error(buf, length)
        check(got == n, "len {}: returned {} instead of {}", length, got, n)
        written = min(length - 1, n)
        check(
            buf.raw[:written] == full[:written] and buf.raw[written] == 0,
            "len {}: wrote {!r}",
            length,
            buf.raw[: written + 1],
        )
        check(
            buf.raw[written + 1 :] == b"#" * (n + 15 - written),
            "len {}: wrote past the terminating NUL: {!r}",
            length,
            buf.raw,
        )

    # Nothing changes between these calls, so the JSON's length is stable.
    n = lib.quilt_stats_json(DEVICE, None, 0)
    check(n > 2, "stats length {}", n)
    full = read_string(lib.quilt_stats_json, DEVICE).encode("utf-8")
    check(len(full) == n and full.startswith(b"{"), "stats {!r}, {} announced", full, n)
    buf = ctypes.create_string_buffer(b"#" * 8, 8)
    got = lib.quilt_stats_json(DEVICE, buf, 5)
    check(got == n, "stats with len 5 returned {} instead of {}", got, n)
    check(buf.raw == full[:4] + b"\0###", "stats with len 5 wrote {!r}", buf.raw)
    json.loads(full.decode("utf-8"))


def check_snapshot(snap, reserved, what):
    """Layout and accounting of a snapshot; returns {address: block}."""
    check(isinstance(snap, dict), "{}: snapshot is a {}", what, type(snap).__name__)
    check("segments" in snap and "device_traces" in snap, "{}: keys {}", what, sorted(snap))
    blocks = {}
    total = 0
    for seg in snap["segments"]:
        for key in SEGMENT_KEYS:
            check(key in seg, "{}: segment lacks {!r}: {}", what, key, sorted(seg))
        sizes = 0
        allocated = 0
        start, end = seg["address"], seg["address"] + seg["total_size"]
        for block in seg["blocks"]:
            for key in BLOCK_KEYS:
                check(key in block, "{}: block lacks {!r}: {}", what, key, block)
            check(block["state"] in BLOCK_STATES, "{}: block state {!r}", what, block["state"])
            check(isinstance(block["frames"], list), "{}: frames {!r}", what, block["frames"])
            check(
                start <= block["address"] and block["address"] + block["size"] <= end,
                "{}: block {:#x}+{} outside its segment {:#x}+{}",
                what,
                block["address"],
                block["size"],
                start,
                seg["total_size"],
            )
            sizes += block["size"]
            if block["state"] == "active_allocated":
                allocated += block["size"]
            if seg["device"] == DEVICE:
                blocks[block["address"]] = block
        check(
            sizes == seg["total_size"],
            "{}: segment {:#x}: blocks add up to {} of {}",
            what,
            start,
            sizes,
            seg["total_size"],
        )
        check(
            allocated == seg["allocated_size"],
            "{}: segment {:#x}: active_allocated blocks {} != allocated_size {}",
            what,
            start,
            allocated,
            seg["allocated_size"],
        )
        if seg["device"] == DEVICE:
            total += seg["total_size"]
    check(
        total == reserved,
        "{}: segments of device {} total {} != reserved_bytes.current {}",
        what,
        DEVICE,
        total,
        reserved,
    )
    traces = snap["device_traces"]
    check(isinstance(traces, list), "{}: device_traces is a {}", what, type(traces).__name__)
    for trace in traces:
        check(isinstance(trace, list), "{}: a device trace is a {}", what, type(trace).__name__)
        for entry in trace:
            # PyTorch's oom entries carry device_free instead of addr.
            where = "device_free" if entry.get("action") == "oom" else "addr"
            for key in TRACE_KEYS:
                key = where if key == "addr" else key
                check(key in entry, "{}: trace entry lacks {!r}: {}", what, key, entry)
            check(
                len(entry["frames"]) == 1 and entry["frames"][0]["name"].startswith("quilt_"),
                "{}: trace entry's frames do not name the C function: {}",
                what,
                entry,
            )
    return blocks


def dump(lib, path):
    rc = lib.quilt_dump_snapshot(path.encode())
    check(rc == 0, "quilt_dump_snapshot({}) returned {}: {}", path, rc, last_error(lib))
    with open(path, "rb") as f:
        return pickle.load(f)


def scenario_snapshot(lib, backend):
    """quilt_dump_snapshot writes torch.cuda.memory._snapshot()'s layout."""
    host = backend == "host"
    check(lib.quilt_record_history(1, 10000) == 0, "record_history: {}", last_error(lib))
    requests = [(512, None), (4 * KiB, 1), (MiB + 3, None), (3 * MiB, 2), (25 * MiB, None)]
    live = []
    for tag, (size, stream) in enumerate(requests):
        ptr = malloc_ok(lib, size, stream)
        if host:
            write_pattern(ptr, size, tag)
        live.append((ptr, size, stream))

    with tempfile.TemporaryDirectory() as tmp:
        s = stats(lib)
        check_stats_schema(s, backend)
        snap = dump(lib, os.path.join(tmp, "live.pickle"))
        blocks = check_snapshot(snap, s["reserved_bytes"]["current"], "live")
        check(len(snap["device_traces"]) > DEVICE, "no trace for device {}", DEVICE)
        trace = snap["device_traces"][DEVICE]
        allocs = {e["addr"] for e in trace if e["action"] == "alloc"}
        for ptr, size, _ in live:
            block = blocks.get(ptr)
            check(block is not None, "live pointer {:#x} is no block's address", ptr)
            check(block["state"] == "active_allocated", "live {:#x} is {}", ptr, block["state"])
            check(block["size"] >= size, "block {:#x} of {} < request {}", ptr, block["size"], size)
            check(
                block["requested_size"] == size,
                "block {:#x}: requested_size {} != {}",
                ptr,
                block["requested_size"],
                size,
            )
            check(ptr in allocs, "no 'alloc' trace entry at {:#x}", ptr)
        if host:
            for tag, (ptr, size, _) in enumerate(live):
                verify_pattern(ptr, size, tag)

        for ptr, size, stream in live:
            lib.quilt_free(ptr, size, DEVICE, stream)
        check(lib.quilt_malloc(2 * CAPACITY, DEVICE, None) is None, "oversize malloc succeeded")

        s = stats(lib)
        snap = dump(lib, os.path.join(tmp, "freed.pickle"))
        blocks = check_snapshot(snap, s["reserved_bytes"]["current"], "freed")
        busy = [hex(a) for a, b in blocks.items() if b["state"] == "active_allocated"]
        check(not busy, "blocks still active_allocated after all frees: {}", busy)
        trace = snap["device_traces"][DEVICE]
        frees = {e["addr"] for e in trace if e["action"] in ("free_requested", "free_completed")}
        for ptr, _, _ in live:
            check(ptr in frees, "no free trace entry at {:#x}", ptr)
        check(
            any(e["action"] == "oom" for e in trace),
            "no 'oom' trace entry; actions: {}",
            sorted({e["action"] for e in trace}),
        )

        # History off: a snapshot still works.
        check(lib.quilt_record_history(0, 0) == 0, "record_history(0): {}", last_error(lib))
        s = stats(lib)
        check_snapshot(dump(lib, os.path.join(tmp, "off.pickle")), s["reserved_bytes"]["current"], "off")

    bad = "/nonexistent-dir/x.pickle"
    before, rc, err = in_fresh_thread(lib, lambda: lib.quilt_dump_snapshot(bad.encode()))
    check(rc != 0, "dump to {} returned 0", bad)
    check(err != "", "dump to {} failed without an error", bad)
    print("unwritable path:", err)


def scenario_fraction(lib, backend):
    """quilt_set_memory_fraction caps what can be allocated."""
    del backend
    lib.quilt_set_memory_fraction(0.25, DEVICE)
    small = malloc_ok(lib, 16 * MiB)
    before, ptr, err = in_fresh_thread(lib, lambda: lib.quilt_malloc(CAPACITY // 2, DEVICE, None))
    check(ptr is None, "half the capacity under fraction 0.25 returned {:#x}", ptr or 0)
    check_oom_error(err, "fraction 0.25")
    lib.quilt_free(small, 16 * MiB, DEVICE, None)
    lib.quilt_set_memory_fraction(1.0, DEVICE)
    big = malloc_ok(lib, CAPACITY // 2)
    lib.quilt_free(big, CAPACITY // 2, DEVICE, None)


def scenario_bad_config(lib, backend, *words):
    """Under a bad QUILT_ALLOC_CONF every malloc fails and says why."""
    del backend
    for attempt in range(2):
        before, ptr, err = in_fresh_thread(lib, lambda: lib.quilt_malloc(1024, DEVICE, None))
        check(ptr is None, "attempt {}: malloc under a bad configuration returned {:#x}", attempt, ptr or 0)
        for word in words:
            check(word in err, "error lacks {!r}: {!r}", word, err)
    print("error:", err)
    # Nothing else crashes either.
    lib.quilt_free(None, 0, DEVICE, None)
    lib.quilt_empty_cache()
    json.loads(read_string(lib.quilt_stats_json, DEVICE))


def import_package():
    """The quilt_torch package of this repository (it loads the same library
    file as `lib`, so both talk to one instance)."""
    sys.path.insert(0, os.path.join(REPO, "python"))
    import quilt_torch

    return quilt_torch


def expect_raises(kind, words, fn, *args, **kwargs):
    """fn(*args, **kwargs) must raise `kind` whose message holds every word."""
    try:
        fn(*args, **kwargs)
    except kind as exc:
        for word in words:
            check(word in str(exc), "{!r} lacks {!r}", str(exc), word)
        return str(exc)
    raise AssertionError("{} did not raise {}".format(fn.__name__, kind.__name__))


def scenario_sleep_wake(lib, backend):
    """Tagged allocations sleep (their pages serve others) and wake at the
    same addresses with their bytes; the C functions refuse bad tags."""
    host = backend == "host"
    qt = import_package()
    check(qt.current_tag() is None, "a tag before any: {!r}", qt.current_tag())

    # Tags through the package's context manager, nested and restored.
    sizes = [40 * MiB, 30 * MiB + 7, 50 * MiB]
    with qt.tag("weights"):
        check(qt.current_tag() == "weights", "inside: {!r}", qt.current_tag())
        with qt.tag("cache"):
            cache = malloc_ok(lib, 10 * MiB)
        check(qt.current_tag() == "weights", "restored: {!r}", qt.current_tag())
        weights = [malloc_ok(lib, size) for size in sizes]
    check(qt.current_tag() is None, "after: {!r}", qt.current_tag())
    try:
        with qt.tag("raised"):
            raise KeyError("inside")
    except KeyError:
        pass
    check(qt.current_tag() is None, "after a raise: {!r}", qt.current_tag())
    other = malloc_ok(lib, 60 * MiB)
    if host:
        for k, (ptr, size) in enumerate(zip(weights, sizes)):
            write_pattern(ptr, size, k)
        write_pattern(other, 60 * MiB, 9)

    # 120 MiB more do not fit beside 190 MiB in 256 MiB, until the weights sleep.
    big = 120 * MiB
    before, ptr, err = in_fresh_thread(lib, lambda: lib.quilt_malloc(big, DEVICE, None))
    check(ptr is None, "120 MiB fit beside the weights")
    check(qt.is_asleep("weights") is False, "asleep before sleep")
    qt.sleep("weights")
    check(qt.is_asleep("weights") is True, "awake after sleep")
    check(qt.is_asleep("cache") is False, "the nested tag slept too")
    spare = malloc_ok(lib, big)
    if host:
        write_pattern(spare, big, 5)
        verify_pattern(spare, big, 5)
        verify_pattern(other, 60 * MiB, 9)
    lib.quilt_free(spare, big, DEVICE, None)
    qt.wake("weights")
    check(qt.is_asleep("weights") is False, "asleep after wake")
    if host:
        for k, (ptr, size) in enumerate(zip(weights, sizes)):
            verify_pattern(ptr, size, k)

    # Discard, pages released to the device: reserved memory drops.
    reserved = stats(lib)["reserved_bytes"]["current"]
    qt.sleep("cache", offload=False, release=True)
    dropped = reserved - stats(lib)["reserved_bytes"]["current"]
    check(dropped >= 10 * MiB, "released only {} bytes", dropped)
    qt.wake("cache")
    if host:
        write_pattern(cache, 10 * MiB, 3)
        verify_pattern(cache, 10 * MiB, 3)

    # A tag set on another thread is that thread's only.
    def tagged_elsewhere():
        check(lib.quilt_set_tag(b"elsewhere") == 0, "set_tag: {}", last_error(lib))
        return read_string(lib.quilt_current_tag)

    _, theirs, _ = in_fresh_thread(lib, tagged_elsewhere)
    check(theirs == "elsewhere", "their tag: {!r}", theirs)
    check(qt.current_tag() is None, "their tag leaked here: {!r}", qt.current_tag())

    # Errors from the package: typed, with the library's message.
    expect_raises(qt.QuiltError, ["unknown tag"], qt.sleep, "nobody")
    expect_raises(qt.QuiltError, ["awake"], qt.wake, "weights")
    expect_raises(qt.QuiltError, ["unknown tag"], qt.is_asleep, "nobody")
    expect_raises(TypeError, ["str"], qt.sleep, b"weights")
    expect_raises(ValueError, ["NUL"], qt.wake, "wei\0ghts")
    expect_raises(ValueError, ["empty"], lambda: qt.tag("").__enter__())
    qt.sleep("weights", offload=True)
    expect_raises(qt.QuiltError, ["already asleep"], qt.sleep, "weights")
    with qt.tag("weights"):
        check(lib.quilt_malloc(MiB, DEVICE, None) is None, "a new member of a sleeping tag")
        check("asleep" in last_error(lib), "error: {!r}", last_error(lib))
    qt.wake("weights")
    if host:
        for k, (ptr, size) in enumerate(zip(weights, sizes)):
            verify_pattern(ptr, size, k)

    # Errors from the C functions: a status and a message, never a crash.
    for call, args in (
        (lib.quilt_set_tag, (None,)),
        (lib.quilt_sleep, (None, 0)),
        (lib.quilt_wake, (None,)),
    ):
        _, rc, err = in_fresh_thread(lib, lambda: call(*args))
        check(rc != 0 and "null" in err, "{} of NULL: {} {!r}", call.__name__, rc, err)
    _, rc, err = in_fresh_thread(lib, lambda: lib.quilt_set_tag(b"\xff\xfe"))
    check(rc != 0 and "UTF-8" in err, "non-UTF-8 tag: {} {!r}", rc, err)
    _, rc, err = in_fresh_thread(lib, lambda: lib.quilt_sleep(b"weights", 8))
    check(rc != 0 and "flags" in err, "bad flags: {} {!r}", rc, err)
    check(lib.quilt_is_asleep(None) == -1, "is_asleep(NULL) is not -1")

    for ptr, size in zip(weights, sizes):
        lib.quilt_free(ptr, size, DEVICE, None)
    lib.quilt_free(cache, 10 * MiB, DEVICE, None)
    lib.quilt_free(other, 60 * MiB, DEVICE, None)
    left = stats(lib)["allocated_bytes"]["current"]
    check(left == 0, "{} bytes still allocated: {}", left, last_error(lib))


SCENARIOS = {
    "sleep_wake": scenario_sleep_wake,
    "stress": scenario_stress,
    "oom": scenario_oom,
    "bad_frees": scenario_bad_frees,
    "snprintf": scenario_snprintf,
    "snapshot": scenario_snapshot,
    "fraction": scenario_fraction,
    "bad_config": scenario_bad_config,
}


def worker_main(argv):
    """Run one scenario in this process: argv = SCENARIO BACKEND [ARGS...]."""
    scenario, backend, args = argv[0], argv[1], argv[2:]
    print("scenario {} on {} with {}={!r}".format(scenario, backend, CONF_ENV, os.environ.get(CONF_ENV)))
    lib = load_library(library_path())
    SCENARIOS[scenario](lib, backend, *args)
    print("WORKER OK", scenario)
    return 0


# ---------------------------------------------------------------------------
# unittest side: one subprocess per scenario and configuration
# ---------------------------------------------------------------------------


def run_worker(test, scenario, backend, conf, *args, timeout=300):
    """Run a scenario in a subprocess; fail `test` (printing its output) if it fails."""
    env = dict(os.environ)
    env[CONF_ENV] = conf
    env[LIBRARY_ENV] = library_path()
    command = [sys.executable, os.path.abspath(__file__), scenario, backend] + list(args)
    try:
        done = subprocess.run(
            command,
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,
            timeout=timeout,
        )
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = "timeout after {}s".format(timeout), exc.stdout, exc.stderr
        out = out.decode("utf-8", "replace") if isinstance(out, bytes) else out or ""
        err = err.decode("utf-8", "replace") if isinstance(err, bytes) else err or ""
    if rc != 0 or "WORKER OK" not in out:
        report = "\n--- {} ({}={}) failed: {}\n--- stdout:\n{}\n--- stderr:\n{}".format(
            " ".join(command[1:]), CONF_ENV, conf, rc, out, err
        )
        print(report, file=sys.stderr, flush=True)
        test.fail("scenario {} on {} failed ({}); output printed above".format(scenario, backend, rc))
    return out


class _BackendScenarios:
    """Every scenario on one backend; subclasses set BACKEND."""

    BACKEND = None

    def run_scenario(self, scenario, timeout=300):
        conf = "backend:{},capacity:{}".format(self.BACKEND, CAPACITY_CONF)
        return run_worker(self, scenario, self.BACKEND, conf, timeout=timeout)

    def test_threads_stress(self):
        """8 threads x 2000 mixed allocations on 3 streams, no NULL, stats add up."""
        self.run_scenario("stress", timeout=600)

    def test_out_of_memory(self):
        """Beyond the capacity: NULL, an explained error, and the library goes on."""
        self.run_scenario("oom")

    def test_bad_frees(self):
        """free(NULL), an unknown pointer and a double free are errors, not crashes."""
        self.run_scenario("bad_frees")

    def test_snprintf_convention(self):
        """quilt_last_error / quilt_stats_json return the needed length and truncate."""
        self.run_scenario("snprintf")

    def test_snapshot(self):
        """quilt_dump_snapshot's pickle: layout, accounting, traces, bad path."""
        self.run_scenario("snapshot")

    def test_memory_fraction(self):
        """quilt_set_memory_fraction caps allocations."""
        self.run_scenario("fraction")

    def test_sleep_wake(self):
        """quilt_torch.tag / sleep / wake: pages freed and back, bytes kept."""
        self.run_scenario("sleep_wake")


class HostBackendTest(_BackendScenarios, unittest.TestCase):
    """Real host memory: the test writes and checks bytes through the pointers."""

    BACKEND = "host"


class SimBackendTest(_BackendScenarios, unittest.TestCase):
    """Simulated device: pointers are never dereferenced."""

    BACKEND = "sim"


class BadConfigurationTest(unittest.TestCase):
    """A bad QUILT_ALLOC_CONF makes every quilt_malloc fail with an explanation."""

    def run_bad(self, conf, *words):
        run_worker(self, "bad_config", "host", conf, *words, timeout=120)

    def test_unknown_key(self):
        self.run_bad("backend:host,colour:blue", "colour", "backend")

    def test_bad_capacity(self):
        self.run_bad("backend:host,capacity:lots", "capacity")

    def test_bad_backend(self):
        self.run_bad("backend:floppy,capacity:256MiB", "backend")

    def test_bad_memory_fraction(self):
        self.run_bad("backend:sim,capacity:256MiB,memory_fraction:1.5", "memory_fraction")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in SCENARIOS:
        sys.exit(worker_main(sys.argv[1:]))
    unittest.main()
