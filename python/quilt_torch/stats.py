"""Quilt's statistics and its allocator's controls, straight from the
library (no torch needed): ``memory_stats`` and the functions torch has by
the same names, peaks, history and snapshots, the cache, the memory
fraction, forgotten streams."""

import ctypes
import json
import os
import sys

from ._clib import check, last_error, library, read_string
from .errors import QuiltError


def _device_index(device):
    """torch's device arguments as an index: None (torch's current device,
    or 0 without torch or CUDA), an int, a ``torch.device`` or "cuda:N"."""
    if device is None:
        torch = sys.modules.get("torch")  # not imported here: it is slow
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        return 0
    if isinstance(device, str):
        text = device.split(":", 1)[1] if ":" in device else "0"
        try:
            index = int(text)
        except ValueError:
            raise ValueError("not a device: {!r}".format(device)) from None
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        index = 0 if device.index is None else int(device.index)
    else:
        raise TypeError("not a device: {!r}".format(device))
    if index < 0:
        raise ValueError("not a device index: {}".format(index))
    return index


# Quilt's statistics that torch's flat memory_stats() keys name.
_FLAT_STATS = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "requested_bytes",
    "inactive_split_bytes",
    "allocation",
    "segment",
    "active",
    "inactive_split",
)


def memory_stats(device=None):
    """Return Quilt's statistics for ``device`` as a dict.

    Under :func:`enable` ``torch.cuda.memory_stats()`` answers with Quilt's
    figures in torch's terms (a private pool's free blocks reserved, not
    allocated); this dict is Quilt's own view (those blocks allocated, as
    Quilt sees them) with its extra figures. The dict has torch's flat keys (``"allocated_bytes.all.current"``,
    ``"reserved_bytes.all.peak"``, ``"segment.all.current"``, ``"num_ooms"``,
    ...; Quilt has no small and large pools, so only ``all``), and Quilt's
    own: ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``,
    ``requested_bytes``, ``allocation``, ``segment`` (the segments a snapshot
    shows) and ``active`` are dicts with ``current`` and ``peak``;
    ``physical_chunk`` counts Quilt's physical allocations; ``num_ooms``,
    ``num_alloc_retries``, ``num_stream_waits`` and
    ``num_recorded_frees_forced`` (frees of blocks recorded on other streams
    with ``record_stream``, released before that work was done because memory
    ran out: reused behind a wait; otherwise such a free is held until the
    work is done, as PyTorch's allocator does) are counts;
    ``driver_calls`` maps driver calls to counts; ``device``, ``allocator``,
    ``backend`` and ``capacity_bytes`` describe the allocator. For a device
    never used the dict may instead be ``{"device": N, "error": "..."}``.
    """
    lib = library()
    stats = json.loads(read_string(lib.quilt_stats_json, _device_index(device)))
    if "error" in stats:
        if lib.quilt_in_forked_child():
            raise QuiltError(stats["error"])
        return stats
    for key in _FLAT_STATS:
        value = stats.get(key)
        if isinstance(value, dict):
            for field in ("current", "peak", "allocated", "freed"):
                if field in value:
                    stats["{}.all.{}".format(key, field)] = value[field]
    calls = stats.get("driver_calls") or {}
    stats["num_device_alloc"] = calls.get("create", 0)
    stats["num_device_free"] = calls.get("release", 0)
    return stats


def _stat(device, key, field):
    stats = memory_stats(device)
    if "error" in stats:
        raise QuiltError("Quilt has no statistics for device {}: {}".format(device, stats["error"]))
    return int(stats[key][field])


def memory_allocated(device=None):
    """Bytes in live blocks now: ``torch.cuda.memory_allocated()`` for Quilt."""
    return _stat(device, "allocated_bytes", "current")


def max_memory_allocated(device=None):
    """The most bytes in live blocks since the allocator was created."""
    return _stat(device, "allocated_bytes", "peak")


def memory_reserved(device=None):
    """Bytes of physical memory Quilt holds now (mapped or cached):
    ``torch.cuda.memory_reserved()`` for Quilt."""
    return _stat(device, "reserved_bytes", "current")


def max_memory_reserved(device=None):
    """The most bytes Quilt held since the allocator was created."""
    return _stat(device, "reserved_bytes", "peak")


def reset_peak_memory_stats(device=None):
    """Set every peak of ``device``'s statistics to its current value, as
    ``torch.cuda.reset_peak_memory_stats()`` does for torch's own allocator.

    Raises:
        QuiltError: where Quilt refuses (a bad configuration).
    """
    check(
        library().quilt_reset_peak_stats(_device_index(device)),
        "quilt_reset_peak_stats",
    )


def forget_stream(stream):
    """Make Quilt forget ``stream`` (a ``torch.cuda.Stream`` or a raw
    ``CUstream`` as an int) before it is destroyed: work pending on it is
    waited for once, and its handle is never passed to the driver again.

    Raises:
        QuiltError: for the default stream, or a stream capturing now.
    """
    raw = getattr(stream, "cuda_stream", stream)
    check(library().quilt_forget_stream(ctypes.c_void_p(int(raw))), "quilt_forget_stream")


def record_history(enabled=True, max_entries=100000):
    """Start (or stop) recording allocation history for snapshots.

    With history on, :func:`dump_snapshot` includes ``device_traces``: the last
    ``max_entries`` alloc / free / oom events per device, like
    ``torch.cuda.memory._record_memory_history()``.

    Raises:
        RuntimeError: if the library refuses, with its last error.
    """
    rc = library().quilt_record_history(1 if enabled else 0, int(max_entries))
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
    rc = library().quilt_dump_snapshot(os.fsencode(os.fspath(path)))
    if rc != 0:
        raise RuntimeError(
            "quilt_dump_snapshot({!r}) failed ({}): {}".format(
                os.fspath(path), rc, last_error()
            )
        )


def empty_cache():
    """Return Quilt's cached, unused physical memory to the device."""
    library().quilt_empty_cache()


def set_memory_fraction(fraction, device=0):
    """Limit Quilt on ``device`` to ``fraction`` (0 < f <= 1) of its memory.

    Like ``torch.cuda.set_per_process_memory_fraction()``; check
    :func:`last_error` if the fraction is refused.
    """
    library().quilt_set_memory_fraction(float(fraction), int(device))
