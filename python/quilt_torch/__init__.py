"""Quilt as a PyTorch CUDA allocator.

Quilt maps scattered physical pages behind contiguous virtual ranges, so a
large request fails only when too few pages are free or reclaimable, never
because memory is fragmented. The Rust crate ``quilt-torch`` builds a shared
library, ``target/release/libquilt_torch.so``, with the C entry points that
``torch.cuda.memory.CUDAPluggableAllocator`` expects (``quilt_malloc`` and
``quilt_free``) plus a few of Quilt's own (statistics, last error, history,
snapshot). This package wraps both sides:

* :func:`enable` swaps PyTorch's allocator for Quilt, for the whole process;
  it must run before CUDA allocates anything.
* :func:`mempool` gives a ``torch.cuda.MemPool`` served by Quilt, for use with
  ``torch.cuda.use_mem_pool(...)`` while PyTorch's own allocator stays the
  default.
* :func:`memory_stats`, :func:`memory_summary`, :func:`dump_snapshot`,
  :func:`last_error`, :func:`record_history`, :func:`empty_cache` and
  :func:`set_memory_fraction` talk to the library directly through
  :mod:`ctypes`. They do not need torch.
* :func:`tag` (a context manager), :func:`sleep`, :func:`wake` and
  :func:`is_asleep`: the tensors allocated inside ``with tag("weights"):``
  carry the tag; ``sleep("weights")`` frees their device memory (contents to
  host memory, or dropped) while their addresses stay valid, and
  ``wake("weights")`` brings them back at the same addresses, so captured
  CUDA graphs stay valid. Through :mod:`ctypes` too.

Quilt is configured by the environment variable ``QUILT_ALLOC_CONF``, read
once, when the library is first used: comma-separated ``key:value`` pairs such
as ``backend:host,capacity:256MiB``. Set it before the first allocation.

Only the standard library is imported at module level; torch is imported
inside the functions that need it, so the package imports (and the ctypes
functions work) on machines without torch.

Example::

    import quilt_torch
    quilt_torch.enable()            # before any CUDA tensor exists
    import torch
    x = torch.empty(1 << 20, device="cuda")
    print(quilt_torch.memory_summary())
"""

import contextlib
import ctypes
import json
import os
import textwrap
import threading

__all__ = [
    "library_path",
    "enable",
    "mempool",
    "memory_stats",
    "memory_summary",
    "dump_snapshot",
    "last_error",
    "record_history",
    "empty_cache",
    "set_memory_fraction",
    "QuiltError",
    "tag",
    "current_tag",
    "sleep",
    "wake",
    "is_asleep",
]

# The environment variable that overrides where the library is looked for.
LIBRARY_ENV = "QUILT_TORCH_LIBRARY"

# The repository root: this file is <repo>/python/quilt_torch/__init__.py.
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_DEFAULT_LIBRARY = os.path.join(_REPO, "target", "release", "libquilt_torch.so")

_BUILD_HINT = (
    "build it with `cargo build --release -p quilt-torch` in {repo}, "
    "or point the environment variable {env} at an existing libquilt_torch.so"
)

# Guards the lazily created, process-wide objects below.
_lock = threading.Lock()
_lib = None  # the ctypes.CDLL, once loaded
_pluggable = None  # the torch CUDAPluggableAllocator, once created
_enabled = None  # the allocator passed to change_current_allocator, if any


def library_path():
    """Return the absolute path of ``libquilt_torch.so``.

    The environment variable ``QUILT_TORCH_LIBRARY`` wins when set; otherwise
    the repository's ``target/release/libquilt_torch.so`` is used.

    Raises:
        FileNotFoundError: if the file does not exist, with a message saying
            how to build it.
    """
    override = os.environ.get(LIBRARY_ENV)
    path = os.path.abspath(override) if override else _DEFAULT_LIBRARY
    if not os.path.isfile(path):
        origin = "{} points at".format(LIBRARY_ENV) if override else "expected"
        raise FileNotFoundError(
            "Quilt's PyTorch library not found ({} {}); ".format(origin, path)
            + _BUILD_HINT.format(repo=_REPO, env=LIBRARY_ENV)
        )
    return path


def _declare(lib):
    """Declare the argument and result types of every C entry point.

    Without them ctypes would pass and return C ``int``s and truncate 64-bit
    pointers and sizes.
    """
    vp, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    prototypes = {
        # void* quilt_malloc(size_t size, int device, void* stream)
        "quilt_malloc": ([size, i32, vp], vp),
        # void quilt_free(void* ptr, size_t size, int device, void* stream)
        "quilt_free": ([vp, size, i32, vp], None),
        # void quilt_empty_cache(void)
        "quilt_empty_cache": ([], None),
        # void quilt_record_stream(void* ptr, void* stream)
        "quilt_record_stream": ([vp, vp], None),
        # void quilt_set_memory_fraction(double fraction, int device)
        "quilt_set_memory_fraction": ([ctypes.c_double, i32], None),
        # size_t quilt_stats_json(int device, char* buf, size_t len)
        "quilt_stats_json": ([i32, ctypes.c_char_p, size], size),
        # size_t quilt_last_error(char* buf, size_t len)
        "quilt_last_error": ([ctypes.c_char_p, size], size),
        # int quilt_record_history(int enabled, size_t max_entries)
        "quilt_record_history": ([i32, size], i32),
        # int quilt_dump_snapshot(const char* path)
        "quilt_dump_snapshot": ([ctypes.c_char_p], i32),
        # int quilt_set_tag(const char* tag)
        "quilt_set_tag": ([ctypes.c_char_p], i32),
        # int quilt_clear_tag(void)
        "quilt_clear_tag": ([], i32),
        # size_t quilt_current_tag(char* buf, size_t len)
        "quilt_current_tag": ([ctypes.c_char_p, size], size),
        # int quilt_sleep(const char* tag, int flags)
        "quilt_sleep": ([ctypes.c_char_p, i32], i32),
        # int quilt_wake(const char* tag)
        "quilt_wake": ([ctypes.c_char_p], i32),
        # int quilt_is_asleep(const char* tag)
        "quilt_is_asleep": ([ctypes.c_char_p], i32),
    }
    for name, (argtypes, restype) in prototypes.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def _library():
    """Load the library with ctypes once and return the cached handle.

    PyTorch's CUDAPluggableAllocator dlopens the same file; the dynamic loader
    hands both the same instance, so the statistics read here include the
    allocations made through torch.
    """
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(library_path())
            _declare(lib)
            _lib = lib
        return _lib


def _read_string(fn, *args):
    """Call an snprintf-style entry point and return its whole text as str.

    ``fn(*args, buf, len)`` returns the length it needs (without the NUL). The
    text can grow between the sizing call and the copy (statistics change
    while other threads allocate), so retry until it fits.
    """
    needed = fn(*args, None, 0)
    while True:
        buf = ctypes.create_string_buffer(needed + 1)
        got = fn(*args, buf, needed + 1)
        if got <= needed:
            return buf.raw[:got].decode("utf-8", "replace")
        needed = got


def _import_torch():
    """Import torch, or raise RuntimeError saying it is needed."""
    try:
        import torch  # lazily: the package must import without torch
    except ImportError as exc:
        raise RuntimeError(
            "quilt_torch: this function needs PyTorch, which is not installed "
            "({})".format(exc)
        ) from exc
    return torch


def _pluggable_allocator(torch):
    """Return the (cached) CUDAPluggableAllocator for Quilt's library."""
    global _pluggable
    with _lock:
        if _pluggable is None:
            try:
                _pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                    library_path(), "quilt_malloc", "quilt_free"
                )
            except FileNotFoundError:
                raise  # library_path()'s message says how to build it
            except Exception as exc:
                raise RuntimeError(
                    "quilt_torch: PyTorch could not load Quilt's allocator "
                    "from {}: {}".format(library_path(), exc)
                ) from exc
        return _pluggable


def enable():
    """Make Quilt PyTorch's CUDA allocator for the whole process.

    Equivalent to::

        alloc = torch.cuda.memory.CUDAPluggableAllocator(
            library_path(), "quilt_malloc", "quilt_free")
        torch.cuda.memory.change_current_allocator(alloc)

    PyTorch can swap its allocator only before it has allocated, so call this
    first thing, before any CUDA tensor is created. Calling it again after a
    successful call does nothing. Returns the CUDAPluggableAllocator.

    Raises:
        RuntimeError: if torch is missing, if CUDA has already allocated
            memory through another allocator, or if PyTorch refuses the swap.
        FileNotFoundError: if the library does not exist.
    """
    global _enabled
    torch = _import_torch()
    if _enabled is not None:
        return _enabled
    if torch.cuda.is_initialized() and torch.cuda.memory_allocated() > 0:
        raise RuntimeError(
            "quilt_torch.enable() must run before CUDA allocates: PyTorch's "
            "allocator already holds {} bytes; call it at the start of the "
            "program, before any CUDA tensor exists".format(
                torch.cuda.memory_allocated()
            )
        )
    allocator = _pluggable_allocator(torch)
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except Exception as exc:
        raise RuntimeError(
            "quilt_torch.enable(): PyTorch refused to swap its CUDA allocator "
            "for Quilt ({}); the allocator can only be changed before CUDA "
            "is first used".format(exc)
        ) from exc
    _enabled = allocator
    return allocator


def mempool():
    """Return a new ``torch.cuda.MemPool`` whose memory comes from Quilt.

    Use it to route only some allocations to Quilt while PyTorch's caching
    allocator stays the default::

        pool = quilt_torch.mempool()
        with torch.cuda.use_mem_pool(pool):
            y = torch.empty(n, device="cuda")   # served by Quilt

    Raises:
        RuntimeError: if torch is missing or too old to have ``MemPool``.
        FileNotFoundError: if the library does not exist.
    """
    torch = _import_torch()
    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError(
            "quilt_torch.mempool() needs torch.cuda.MemPool, which this "
            "PyTorch ({}) lacks; upgrade PyTorch or use quilt_torch.enable()".format(
                getattr(torch, "__version__", "unknown version")
            )
        )
    allocator = _pluggable_allocator(torch)
    return torch.cuda.MemPool(allocator.allocator())


def memory_stats(device=0):
    """Return Quilt's statistics for ``device`` as a dict.

    The keys follow ``torch.cuda.memory_stats()`` in spirit: ``allocated_bytes``,
    ``reserved_bytes``, ``active_bytes``, ``requested_bytes``, ``allocation``,
    ``segment`` and ``active`` are dicts with ``current`` and ``peak``;
    ``num_ooms``, ``num_alloc_retries`` and ``num_stream_waits`` are counts;
    ``driver_calls`` maps driver calls to counts; ``device``, ``allocator``,
    ``backend`` and ``capacity_bytes`` describe the allocator. For a device
    never used the dict may instead be ``{"device": N, "error": "..."}``.
    """
    lib = _library()
    return json.loads(_read_string(lib.quilt_stats_json, int(device)))


def last_error():
    """Return the calling thread's last error from Quilt ("" if none).

    Errors are kept per thread: a failed allocation made by PyTorch on this
    thread (for example an out-of-memory) is reported here, with Quilt's
    verdict on whether capacity or fragmentation was the cause.
    """
    return _read_string(_library().quilt_last_error)


def record_history(enabled=True, max_entries=100000):
    """Start (or stop) recording allocation history for snapshots.

    With history on, :func:`dump_snapshot` includes ``device_traces``: the last
    ``max_entries`` alloc / free / oom events per device, like
    ``torch.cuda.memory._record_memory_history()``.

    Raises:
        RuntimeError: if the library refuses, with its last error.
    """
    rc = _library().quilt_record_history(1 if enabled else 0, int(max_entries))
    if rc != 0:
        raise RuntimeError(
            "quilt_record_history({}, {}) failed ({}): {}".format(
                bool(enabled), max_entries, rc, last_error()
            )
        )


def dump_snapshot(path):
    """Write a pickle in the layout of ``torch.cuda.memory._snapshot()``.

    The file has ``segments`` (with their blocks) and, when history is
    recorded, ``device_traces``; PyTorch's memory visualizer
    (https://pytorch.org/memory_viz) reads it.

    Raises:
        RuntimeError: if the snapshot cannot be written, with the reason.
    """
    rc = _library().quilt_dump_snapshot(os.fsencode(os.fspath(path)))
    if rc != 0:
        raise RuntimeError(
            "quilt_dump_snapshot({!r}) failed ({}): {}".format(
                os.fspath(path), rc, last_error()
            )
        )


def empty_cache():
    """Return Quilt's cached, unused physical memory to the device."""
    _library().quilt_empty_cache()


def set_memory_fraction(fraction, device=0):
    """Limit Quilt on ``device`` to ``fraction`` (0 < f <= 1) of its memory.

    Like ``torch.cuda.set_per_process_memory_fraction()``; check
    :func:`last_error` if the fraction is refused.
    """
    _library().quilt_set_memory_fraction(float(fraction), int(device))


# -- tags, sleep and wake ----------------------------------------------------

# quilt_sleep's flags.
_SLEEP_DISCARD = 1
_SLEEP_RELEASE = 2


class QuiltError(RuntimeError):
    """An operation the library refused; the message is its last error."""


def _tag_bytes(name):
    """The tag as the C functions take it: a non-empty str without NUL."""
    if not isinstance(name, str):
        raise TypeError("a tag is a str, not {}".format(type(name).__name__))
    if not name:
        raise ValueError("a tag is not empty")
    if "\0" in name:
        raise ValueError("a tag holds no NUL character: {!r}".format(name))
    return name.encode("utf-8")


def _check(rc, call):
    """Raise QuiltError with the thread's last error unless rc is 0."""
    if rc != 0:
        raise QuiltError("{} failed: {}".format(call, last_error()))


def current_tag():
    """Return the tag this thread's allocations carry now (None if none)."""
    return _read_string(_library().quilt_current_tag) or None


@contextlib.contextmanager
def tag(name):
    """Make this thread's allocations inside the block carry the tag ``name``.

    Like torch_memory_saver's ``region(tag)`` and vLLM's
    ``use_memory_pool(tag)``::

        with quilt_torch.tag("weights"):
            model = load_model().cuda()      # every block carries "weights"
        quilt_torch.sleep("weights")         # device memory freed
        quilt_torch.wake("weights")          # back, same addresses

    Tagged blocks live in pages of their own (never shared with other tags or
    untagged blocks). The tag belongs to the calling thread: allocations
    PyTorch makes on other threads (autograd's backward threads, for one) do
    not carry it. Blocks nest: the tag in force before the block is restored
    after it, even when it raises.

    Raises:
        TypeError, ValueError: for a tag that is not a non-empty str
            without NUL characters.
        QuiltError: if the library refuses the tag.
    """
    encoded = _tag_bytes(name)
    lib = _library()
    previous = current_tag()
    _check(lib.quilt_set_tag(encoded), "quilt_set_tag({!r})".format(name))
    try:
        yield name
    finally:
        if previous is None:
            lib.quilt_clear_tag()
        else:
            lib.quilt_set_tag(previous.encode("utf-8"))


def sleep(name, offload=True, release=False):
    """Put every block carrying the tag ``name`` to sleep, on every device.

    The work queued on them completes; their contents are copied to host
    memory (``offload=True``) or dropped (``offload=False``: after
    :func:`wake` their bytes are undefined, e.g. for a KV cache rebuilt
    anyway); their pages are unmapped and go back to Quilt's pool, where
    other allocations use them, or with ``release=True`` to the device
    (``cuMemRelease``), where other programs can use them. Their addresses
    stay reserved: pointers held elsewhere (a captured CUDA graph) are valid
    again after :func:`wake`. While asleep, the tensors must not be used,
    freed or given new members.

    Raises:
        QuiltError: for an unknown tag, one already asleep, or a failure;
            the message says which.
    """
    encoded = _tag_bytes(name)
    flags = (0 if offload else _SLEEP_DISCARD) | (_SLEEP_RELEASE if release else 0)
    _check(_library().quilt_sleep(encoded, flags), "quilt_sleep({!r})".format(name))


def wake(name):
    """Wake the tag ``name``: its blocks are backed again at the same
    addresses and their contents copied back (if they were offloaded).

    Raises:
        QuiltError: for an unknown tag, one that is awake, or a failure (out
            of memory leaves the tag asleep with its host copy intact).
    """
    _check(_library().quilt_wake(_tag_bytes(name)), "quilt_wake({!r})".format(name))


def is_asleep(name):
    """Return True while the tag ``name`` sleeps.

    Raises:
        QuiltError: for a tag no allocation carried.
    """
    rc = _library().quilt_is_asleep(_tag_bytes(name))
    if rc < 0:
        raise QuiltError("quilt_is_asleep({!r}) failed: {}".format(name, last_error()))
    return rc == 1


# -- the summary -------------------------------------------------------------

_MIB = float(1 << 20)


def _counter(stats, key):
    """(current, peak) of a statistic, 0 for a missing one."""
    value = stats.get(key) or {}
    if not isinstance(value, dict):
        return value, value
    return value.get("current", 0), value.get("peak", 0)


def memory_summary(device=0):
    """Return a short human-readable table of Quilt's statistics.

    In the spirit of ``torch.cuda.memory_summary()``: allocated, reserved,
    active and requested memory (current and peak, MiB), allocation, segment
    and active-block counts, out-of-memory errors, driver calls and the
    calling thread's last error.
    """
    stats = memory_stats(device)
    width = 64
    rule = "|" + "-" * (width - 2) + "|"
    lines = ["|" + "=" * (width - 2) + "|"]

    def row(text):
        # Long texts (an error message) wrap onto further rows.
        for part in textwrap.wrap(text, width - 4, subsequent_indent="  ") or [""]:
            lines.append("| " + part.ljust(width - 4) + " |")

    row("Quilt memory summary, device {}".format(stats.get("device", device)))
    if "error" in stats:
        row("error: {}".format(stats["error"]))
    else:
        capacity = stats.get("capacity_bytes", 0)
        row(
            "allocator: {}  backend: {}  capacity: {:.2f} MiB".format(
                stats.get("allocator", "?"),
                stats.get("backend", "?"),
                capacity / _MIB,
            )
        )
        lines.append(rule)
        row("{:<22}{:>17}{:>19}".format("Metric", "Current", "Peak"))
        lines.append(rule)
        for label, key in (
            ("Allocated memory", "allocated_bytes"),
            ("Reserved memory", "reserved_bytes"),
            ("Active memory", "active_bytes"),
            ("Requested memory", "requested_bytes"),
        ):
            cur, peak = _counter(stats, key)
            row("{:<22}{:>13.2f} MiB{:>15.2f} MiB".format(label, cur / _MIB, peak / _MIB))
        for label, key in (
            ("Allocations", "allocation"),
            ("Segments", "segment"),
            ("Active blocks", "active"),
        ):
            cur, peak = _counter(stats, key)
            row("{:<22}{:>17}{:>19}".format(label, cur, peak))
        lines.append(rule)
        row(
            "OOMs: {}  alloc retries: {}  stream waits: {}".format(
                stats.get("num_ooms", 0),
                stats.get("num_alloc_retries", 0),
                stats.get("num_stream_waits", 0),
            )
        )
        calls = stats.get("driver_calls") or {}
        row("Driver calls:" + ("" if calls else " none"))
        for name in sorted(calls):
            row("  {:<30}{:>28}".format(name, calls[name]))
    lines.append(rule)
    row("Last error: {}".format(last_error() or "none"))
    lines.append("|" + "=" * (width - 2) + "|")
    return "\n".join(lines)
