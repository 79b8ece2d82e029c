"""A human-readable table of Quilt's statistics."""

import textwrap

from ._clib import last_error
from .stats import memory_stats

_MIB = float(1 << 20)


def _counter(stats, key):
    """(current, peak) of a statistic, 0 for a missing one."""
    value = stats.get(key) or {}
    if not isinstance(value, dict):
        return value, value
    return value.get("current", 0), value.get("peak", 0)


def memory_summary(device=None):
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
