"""Installing Quilt in torch: :func:`enable` (Quilt's allocator class as
torch's CUDA allocator) and :func:`mempool` (a ``torch.cuda.MemPool`` served
by Quilt's library through torch's pluggable-allocator interface)."""

import ctypes
import json
import os
import threading

from . import _bridge
from ._clib import library, library_path, read_string
from .errors import BridgeError, ConfigurationError, QuiltError

# Guards the objects below.
_lock = threading.Lock()
# Held through the whole of enable(): two threads calling it at once build
# and install the allocator class once, and both get the same one.
_enable_lock = threading.Lock()


def _after_fork_in_child():
    # Another thread of the parent may have held these at the fork.
    global _lock, _enable_lock
    _lock = threading.Lock()
    _enable_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_pluggable = None  # the torch CUDAPluggableAllocator, once created
_enabled = None  # the allocator enable() installed, if any


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
    """Return the (cached) CUDAPluggableAllocator on Quilt's own library.

    This is the ``mempool()`` route: torch's caching allocator owns the pool
    and checks what ``quilt_malloc`` returns, so the library's functions are
    handed to torch as they are.
    """
    global _pluggable
    with _lock:
        if _pluggable is None:
            _pluggable = _load_pluggable(torch, library_path(), "quilt_malloc", "quilt_free")
        return _pluggable


def _load_pluggable(torch, path, malloc_name, free_name):
    """A CUDAPluggableAllocator on ``path``'s two functions, or RuntimeError."""
    try:
        return torch.cuda.memory.CUDAPluggableAllocator(path, malloc_name, free_name)
    except FileNotFoundError:
        raise  # library_path()'s message says how to build it
    except Exception as exc:
        raise RuntimeError(
            "quilt_torch: PyTorch could not load Quilt's allocator "
            "from {}: {}".format(path, exc)
        ) from exc


class TorchAllocator(object):
    """What :func:`enable` installed: Quilt's allocator class in torch.

    Attributes:
        library: the path of the compiled allocator class.
        torch_version: the torch it was compiled against.
    """

    def __init__(self, lib, torch_version):
        self._lib = lib
        self.library = lib.path
        self.torch_version = torch_version

    def installed(self):
        """Whether Quilt is torch's CUDA allocator now."""
        return self._lib.quilt_allocator_installed() == 1

    def __repr__(self):
        return "<quilt_torch.TorchAllocator {} (torch {})>".format(self.library, self.torch_version)


def registered_hooks():
    """Empty: :func:`enable` installs an allocator class that torch calls for
    every allocator function (no pluggable-allocator hooks). Kept for
    programs written against earlier versions."""
    return {}


def _function_address(name):
    return ctypes.cast(getattr(library(), name), ctypes.c_void_p).value


def check_configuration():
    """Check ``QUILT_ALLOC_CONF`` and the backend the way :func:`enable` does.

    Returns ``{"backend": NAME}``. No device's allocator is created: on
    CUDA the driver and device 0 are asked, without making a context, so a
    process that only ever uses ``cuda:1`` has no context on device 0.

    Raises:
        ConfigurationError: a bad key or value, or ``backend:sim`` (whose
            pointers address no memory: the first copy would crash).
        QuiltError: the backend is unavailable (no CUDA driver, for one).
    """
    stats = json.loads(read_string(library().quilt_check_configuration))
    error = stats.get("error")
    if error:
        if "QUILT_ALLOC_CONF=" in error:
            raise ConfigurationError(error)
        raise QuiltError("Quilt cannot serve device 0: {}".format(error))
    if stats.get("backend") == "sim":
        raise ConfigurationError(
            "QUILT_ALLOC_CONF selects backend:sim, the simulated device: its "
            "pointers address no memory, so PyTorch would crash on the first "
            "copy; use backend:cuda (the default) on a GPU, or backend:host "
            "(host memory) for a simulated CUDA device"
        )
    return stats


def enable():
    """Make Quilt PyTorch's CUDA allocator for the whole process.

    In order, before anything is installed:

    1. ``QUILT_ALLOC_CONF`` and the backend are checked
       (:func:`check_configuration`): a bad key or value, ``backend:sim`` or
       an unavailable driver raises, and PyTorch keeps its own allocator.
    2. Quilt's allocator class for torch (``torch_allocator.cpp``, a
       ``c10::cuda::CUDACachingAllocator::CUDAAllocator``) is built once
       against the installed torch and cached (a C++ compiler is needed the
       first time; see :func:`_allocator_library`).
    3. It is installed as torch's CUDA allocator, as torch's own
       ``changeCurrentAllocator`` does; refused if torch's allocator is
       already initialized (CUDA used before).

    From then on torch's own APIs answer with Quilt's figures
    (``torch.cuda.memory_stats``, ``memory_allocated``, ``memory_summary``,
    ``_record_memory_history``/``_snapshot``, ...), out of memory is
    ``torch.OutOfMemoryError`` (torch's observers called first), and CUDA
    graphs and ``torch.cuda.MemPool`` get private pools.

    Call this first thing, before any CUDA tensor is created. Calling it
    again (also after ``importlib.reload(quilt_torch)``, or from several
    threads at once: one builds and installs, the others wait for it)
    returns the same :class:`TorchAllocator`.

    Raises:
        ConfigurationError: a bad ``QUILT_ALLOC_CONF``, or ``backend:sim``.
        QuiltError: the backend is unavailable.
        BridgeError: the allocator class cannot be built (no compiler,
            another torch) or installed (torch's allocator already
            initialized).
        RuntimeError: if torch is missing.
        FileNotFoundError: if the library does not exist.
    """
    torch = _import_torch()
    with _enable_lock:
        return _enable(torch)


def _enable(torch):
    """:func:`enable`, with ``_enable_lock`` held."""
    global _enabled
    with _lock:
        if _enabled is None:
            # A reloaded module finds what its earlier self installed.
            _enabled = getattr(torch.cuda.memory, _ENABLED_ATTR, None)
        if _enabled is not None:
            return _enabled
    check_configuration()
    lib = _bridge.allocator_library(torch)
    buf = ctypes.create_string_buffer(4096)
    rc = lib.quilt_allocator_install(os.fsencode(library_path()), buf, len(buf))
    if rc != 0:
        raise BridgeError(
            "quilt_torch.enable(): Quilt's allocator class was not installed in torch {} "
            "({}): {}; call enable() first thing, before any CUDA tensor exists".format(
                torch.__version__, rc, buf.value.decode("utf-8", "replace")
            )
        )
    allocator = TorchAllocator(lib, torch.__version__)
    with _lock:
        _enabled = allocator
        setattr(torch.cuda.memory, _ENABLED_ATTR, allocator)
    return allocator


# Where enable() leaves its allocator on torch, so that a reloaded
# quilt_torch finds it.
_ENABLED_ATTR = "_quilt_torch_enabled"


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


