"""The hook of `quilt-bench live` in every Python process of a measured run.

`quilt-bench live` runs `python PROGRAM.py ARGS...` itself (so `__main__` is
the program, and the children `torch.multiprocessing.spawn` starts import it
as they would without the bench) with this folder first on `PYTHONPATH`;
Python imports this file at start-up in that process and in every Python
process it starts. Nothing happens unless `QUILT_LIVE_REPORT_DIR` is set.
Standard library and torch only.

Set by the bench:

- `QUILT_LIVE_REPORT_DIR`: each process writes `<pid>.json` there at exit;
- `QUILT_LIVE_ALLOCATOR`: `classic`, `expandable` (the bench also sets
  `PYTORCH_CUDA_ALLOC_CONF`) or `quilt` (`quilt_torch.enable()` here, before
  the program runs, with the bench's `QUILT_ALLOC_CONF`);
- `QUILT_LIVE_RECORD_ENTRIES`: record torch's memory history
  (`torch.cuda.memory._record_memory_history(context=None, max_entries=N)`:
  no tracebacks) from the start,
  and write `torch.cuda.memory._snapshot()` pickled as `<pid>.pickle` beside
  the report at exit, each history entry cut to the fields the importer
  reads (action, address, size, stream).

The report (JSON): `pid`, `error` (null, or the uncaught exception:
`type`, `message`, `oom` true for `torch.OutOfMemoryError`, or an error
whose text names it, as a child's does in `torch.multiprocessing`'s
`ProcessRaisedException`), `cuda` (whether the process used CUDA),
`devices` (per device: torch's `memory_stats()` figures the bench reads),
`driver_calls` (the simulated GPU's double's counts by entry point, through
its `quiltDoubleCounts`). A process that dies without running its exit
handlers (a signal, `os._exit`, a fork child) writes none.
"""

import atexit
import ctypes
import json
import os
import sys

_DIR = os.environ.get("QUILT_LIVE_REPORT_DIR")
_error = None

# The figures of torch.cuda.memory_stats() the bench reads.
_STATS = [
    "allocated_bytes.all.peak",
    "reserved_bytes.all.peak",
    "active_bytes.all.peak",
    "requested_bytes.all.peak",
    "num_ooms",
    "num_alloc_retries",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
]


def _is_oom(exc):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return "OutOfMemoryError" in text or "CUDA out of memory" in text


def _note(exc):
    global _error
    if _error is None and exc is not None:
        _error = {
            "type": type(exc).__name__,
            "message": str(exc).strip().splitlines()[0] if str(exc).strip() else "",
            "oom": _is_oom(exc),
        }


def _excepthook(kind, value, tb):
    _note(value)
    _previous_hook(kind, value, tb)


def _driver_calls():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.quiltDoubleCounts
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    need = fn(None, 0)
    buf = ctypes.create_string_buffer(need + 1)
    fn(buf, need + 1)
    calls = {}
    for line in buf.value.decode().splitlines():
        name, _, n = line.rpartition(" ")
        calls[name] = int(n)
    return calls


def _devices(torch):
    out = []
    for d in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(d)
        out.append({k: int(stats.get(k, 0)) for k in _STATS})
    return out


def _write_report():
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_initialized()
    report = {
        "pid": os.getpid(),
        "error": _error,
        "cuda": cuda,
        "devices": [],
        "driver_calls": _driver_calls(),
    }
    if cuda:
        try:
            report["devices"] = _devices(torch)
        except Exception as exc:  # the report says why the figures are missing
            report["stats_error"] = "{}: {}".format(type(exc).__name__, exc)
        if os.environ.get("QUILT_LIVE_RECORD_ENTRIES"):
            import pickle

            path = os.path.join(_DIR, "{}.pickle".format(os.getpid()))
            with open(path, "wb") as f:
                pickle.dump(_compact(torch.cuda.memory._snapshot()), f)
    path = os.path.join(_DIR, "{}.json".format(os.getpid()))
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


# The fields of a history entry the bench's importer reads
# (benches/src/snapshot_import.rs).
_ENTRY_FIELDS = ("action", "addr", "size", "stream")


def _compact(snapshot):
    """The snapshot with each history entry cut to the fields the importer
    reads: a million entries of a generation loop, whole, took the importer
    57 KB each (a 200,000-entry cut: 11.5 GB; cut to these fields: 0.2 GB,
    the same trace)."""
    snapshot["device_traces"] = [
        [{k: e[k] for k in _ENTRY_FIELDS if k in e} for e in trace]
        for trace in snapshot.get("device_traces", [])
    ]
    return snapshot


def _setup():
    allocator = os.environ.get("QUILT_LIVE_ALLOCATOR", "")
    entries = os.environ.get("QUILT_LIVE_RECORD_ENTRIES")
    if allocator == "quilt":
        try:
            import quilt_torch

            quilt_torch.enable()
        except Exception as exc:
            _note(exc)
            _error["message"] = "quilt_torch.enable(): " + _error["message"]
            _write_report()
            sys.stderr.write("quilt-bench live: quilt_torch.enable() failed: {}\n".format(exc))
            sys.stderr.flush()
            os._exit(3)
    if entries:
        import torch

        # No tracebacks (context=None): the trace needs each event's action,
        # address, size and stream only, and the frames torch records by
        # default made a 365 MB snapshot of a generation loop that the
        # importer then held in memory many times over.
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, max_entries=int(entries)
        )


def _chain():
    """Run the `sitecustomize` this file shadows on `sys.path`, if any (some
    distributions' Pythons have one)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_chain()
if _DIR:
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook
    _setup()
    # Registered after the set-up's imports: atexit runs last-registered
    # first, so the figures are read before torch's own exit handlers run.
    atexit.register(_write_report)
