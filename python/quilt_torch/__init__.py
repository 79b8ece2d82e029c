"""Quilt as a PyTorch CUDA allocator.

Quilt maps scattered physical pages behind contiguous virtual ranges, so a
large request fails only when too few pages are free or reclaimable, never
because memory is fragmented. The Rust crate ``quilt-torch`` builds a shared
library, ``target/release/libquilt_torch.so``, with the C entry points that
``torch.cuda.memory.CUDAPluggableAllocator`` expects (``quilt_malloc`` and
``quilt_free``) plus a few of Quilt's own (statistics, last error, history,
snapshot). This package wraps both sides:

* :func:`enable` makes Quilt PyTorch's CUDA allocator, for the whole process;
  it must run before CUDA allocates anything. It checks ``QUILT_ALLOC_CONF``
  first, builds (once, cached) Quilt's allocator class for torch
  (``torch_allocator.cpp``, a ``c10::cuda::CUDACachingAllocator::CUDAAllocator``)
  and installs it as torch's allocator: torch's own statistics, snapshots
  and history, out-of-memory observers, ``empty_cache``, the memory fraction,
  ``record_stream``, CUDA graphs and ``MemPool`` reach Quilt.
* :func:`mempool` gives a ``torch.cuda.MemPool`` served by Quilt, for use with
  ``torch.cuda.use_mem_pool(...)`` while PyTorch's own allocator stays the
  default.
* :func:`memory_stats`, :func:`memory_allocated`, :func:`memory_reserved`,
  :func:`max_memory_allocated`, :func:`max_memory_reserved`,
  :func:`memory_summary`, :func:`dump_snapshot`, :func:`last_error`,
  :func:`record_history`, :func:`empty_cache` and :func:`set_memory_fraction`
  talk to the library directly through :mod:`ctypes`. They do not need torch;
  under :func:`enable` torch's own functions answer too, and these add
  Quilt's own figures (driver calls, stream waits, capacity).
* :func:`tag` (a context manager), :func:`sleep`, :func:`wake` and
  :func:`is_asleep`: the tensors allocated inside ``with tag("weights"):``
  carry the tag; ``sleep("weights")`` frees their device memory (contents to
  host memory, or dropped) while their addresses stay valid, and
  ``wake("weights")`` brings them back at the same addresses, so captured
  CUDA graphs stay valid. Through :mod:`ctypes` too.

Quilt is configured by the environment variable ``QUILT_ALLOC_CONF``, read
once, when the library is first used: comma-separated ``key:value`` pairs such
as ``backend:host,capacity:256MiB`` or ``memory_limit:8GiB`` (the keys of
``quilt_alloc::settings``: ``backend``, ``capacity``, ``memory_fraction`` or
``memory_limit``, and Quilt's policy keys). Set it before the first
allocation.

Only the standard library is imported at module level; torch is imported
inside the functions that need it, so the package imports (and the ctypes
functions work) on machines without torch.

The modules: ``_clib`` (the C library: where it is found, its entry points'
types), ``_bridge`` (the allocator class, built against the installed
torch), ``_install`` (:func:`enable`, :func:`mempool`), ``stats`` (statistics
and controls), ``tags`` (tags, sleep and wake), ``summary``
(:func:`memory_summary`), ``errors``.

Example::

    import quilt_torch
    quilt_torch.enable()            # before any CUDA tensor exists
    import torch
    x = torch.empty(1 << 20, device="cuda")
    print(quilt_torch.memory_summary())
"""

from . import _bridge, _clib, _install
from ._clib import LIBRARY_ENV, last_error, library_path
from ._clib import library as _library
from ._bridge import BRIDGE_CACHE_ENV
from ._install import (
    TorchAllocator,
    check_configuration,
    enable,
    mempool,
    registered_hooks,
)
from .errors import BridgeError, ConfigurationError, QuiltError
from .stats import (
    dump_snapshot,
    empty_cache,
    forget_stream,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    record_history,
    reset_peak_memory_stats,
    set_memory_fraction,
)
from .summary import memory_summary
from .tags import current_tag, is_asleep, sleep, tag, wake

__all__ = [
    "library_path",
    "enable",
    "mempool",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "forget_stream",
    "memory_summary",
    "dump_snapshot",
    "last_error",
    "record_history",
    "empty_cache",
    "set_memory_fraction",
    "QuiltError",
    "ConfigurationError",
    "BridgeError",
    "check_configuration",
    "registered_hooks",
    "TorchAllocator",
    "tag",
    "current_tag",
    "sleep",
    "wake",
    "is_asleep",
]
