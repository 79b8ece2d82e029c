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
import sys
import textwrap
import threading

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

# Where library_path() looks for Quilt's C library, in this order:
# 1. the file this environment variable names, when it is set (and nowhere
#    else then: a wrong override is an error, not a silent fallback);
LIBRARY_ENV = "QUILT_TORCH_LIBRARY"
# 2. inside this package, where `pip install` puts it (setup.py: crates/torch's
#    cdylib, named for the stable-ABI wheel it ships in);
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_INSTALLED_LIBRARY = os.path.join(_PACKAGE_DIR, "libquilt_torch.abi3.so")
# 3. the checkout's cargo build, for development in a source checkout (this
#    file is then <repo>/python/quilt_torch/__init__.py).
_REPO = os.path.abspath(os.path.join(_PACKAGE_DIR, "..", ".."))
_DEFAULT_LIBRARY = os.path.join(_REPO, "target", "release", "libquilt_torch.so")

_BUILD_HINT = (
    "install the package with `pip install <checkout>` (it builds the library "
    "into it), or in a checkout build it with `cargo build --release -p "
    "quilt-torch`, or point the environment variable {env} at an existing "
    "libquilt_torch.so"
)

# Guards the lazily created, process-wide objects below.
_lock = threading.Lock()
# Held through the whole of enable(): two threads calling it at once build
# and install the allocator class once, and both get the same one.
_enable_lock = threading.Lock()


def _after_fork_in_child():
    # Another thread of the parent may have held these at the fork: the
    # child starts with fresh ones (the C library refuses to touch the
    # parent's CUDA state there, with torch's "Cannot re-initialize CUDA in
    # forked subprocess").
    global _lock, _enable_lock
    _lock = threading.Lock()
    _enable_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_lib = None  # the ctypes.CDLL, once loaded
_pluggable = None  # the torch CUDAPluggableAllocator, once created
_enabled = None  # the allocator passed to change_current_allocator, if any


def library_path():
    """Return the absolute path of Quilt's C library, ``libquilt_torch.so``.

    The environment variable ``QUILT_TORCH_LIBRARY`` wins when set; otherwise
    the library that ``pip install`` put inside this package
    (``quilt_torch/libquilt_torch.abi3.so``); otherwise, in a source checkout,
    ``target/release/libquilt_torch.so``.

    Raises:
        FileNotFoundError: if ``QUILT_TORCH_LIBRARY`` names no file, or
            neither of the other two exists, with a message saying how to
            install or build it.
    """
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = os.path.abspath(override)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                "Quilt's PyTorch library not found ({} points at {}, which "
                "is not a file)".format(LIBRARY_ENV, path)
            )
        return path
    for path in (_INSTALLED_LIBRARY, _DEFAULT_LIBRARY):
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        "Quilt's PyTorch library not found (looked for {} and {}); ".format(
            _INSTALLED_LIBRARY, _DEFAULT_LIBRARY
        )
        + _BUILD_HINT.format(env=LIBRARY_ENV)
    )


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
        # int quilt_reset_peak_stats(int device)
        "quilt_reset_peak_stats": ([i32], i32),
        # int quilt_forget_stream(void* stream)
        "quilt_forget_stream": ([vp], i32),
        # void quilt_set_memory_fraction(double fraction, int device)
        "quilt_set_memory_fraction": ([ctypes.c_double, i32], None),
        # size_t quilt_stats_json(int device, char* buf, size_t len)
        "quilt_stats_json": ([i32, ctypes.c_char_p, size], size),
        # size_t quilt_check_configuration(char* buf, size_t len)
        "quilt_check_configuration": ([ctypes.c_char_p, size], size),
        # int quilt_in_forked_child(void)
        "quilt_in_forked_child": ([], i32),
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


# -- torch's allocator class (enable()'s route) -----------------------------

# The environment variable naming the folder where the allocator class is
# compiled and cached (default: ~/.cache/quilt/torch-bridge).
BRIDGE_CACHE_ENV = "QUILT_TORCH_BRIDGE_CACHE"
_ALLOCATOR_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_allocator.cpp")
_allocator = None  # the compiled allocator class's ctypes handle, once built


class BridgeError(RuntimeError):
    """Quilt's allocator class for torch cannot be built or installed (the
    message says why, and names the torch version)."""


def _bridge_cache_dir():
    override = os.environ.get(BRIDGE_CACHE_ENV)
    if override:
        return os.path.abspath(override)
    return os.path.join(os.path.expanduser("~"), ".cache", "quilt", "torch-bridge")


def _compiler():
    """The C++ compiler to build the allocator class with: $CXX, else c++,
    g++ or clang++."""
    import shutil

    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _has(folder, *parts):
    return bool(folder) and os.path.isfile(os.path.join(folder, *parts))


def _cuda_include_dirs(torch_dir):
    """The folders with the CUDA runtime's headers that torch's headers
    include: ``cuda_runtime_api.h`` (from ``$CUDA_HOME``, or the NVIDIA
    wheels torch was installed with) and the compiler's ``crt/`` headers it
    needs (from the same place, or the copy in the triton wheel that comes
    with torch). Returns (folders, what is missing)."""
    site = os.path.dirname(torch_dir)
    candidates = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "include"))
    nvidia = os.path.join(site, "nvidia")
    if os.path.isdir(nvidia):
        for name in sorted(os.listdir(nvidia)):
            candidates.append(os.path.join(nvidia, name, "include"))
    candidates.append("/usr/local/cuda/include")
    crt_candidates = candidates + [os.path.join(site, "triton", "backends", "nvidia", "include")]
    runtime = next((c for c in candidates if _has(c, "cuda_runtime_api.h")), None)
    crt = next((c for c in crt_candidates if _has(c, "crt", "host_defines.h")), None)
    missing = []
    if runtime is None:
        missing.append("cuda_runtime_api.h (set CUDA_HOME, or install torch's nvidia-cuda-runtime wheel)")
    if crt is None:
        missing.append("crt/host_defines.h (set CUDA_HOME to a CUDA toolkit, or pip install nvidia-cuda-crt)")
    folders = [f for f in (runtime, crt) if f]
    return list(dict.fromkeys(folders)), missing


def _allocator_library(torch):
    """Build (once, cached) and load Quilt's allocator class for torch;
    return its ctypes handle.

    ``torch_allocator.cpp`` is compiled against the installed torch's
    headers (C++20) and the CUDA runtime's headers, linked with torch's
    ``libc10`` and ``libc10_cuda``, into a folder named after a hash of the
    source and the torch version, location and C++ ABI, so one build (about
    15 s with g++) serves every later process with the same torch (a
    compiler is needed only to build it).

    Raises:
        BridgeError: no C++ compiler, torch without its headers or the CUDA
            headers, or the compiler failed (its output is in the message,
            with the torch version: another torch than the ones the file is
            written for fails here).
    """
    global _allocator
    if _allocator is not None:
        return _allocator
    import hashlib
    import subprocess
    import tempfile

    version = getattr(torch, "__version__", "unknown version")
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    include = os.path.join(torch_dir, "include")
    lib_dir = os.path.join(torch_dir, "lib")
    if not _has(include, "c10", "cuda", "CUDACachingAllocator.h"):
        raise BridgeError(
            "quilt_torch.enable(): this torch ({}, {}) has no C++ headers for its CUDA "
            "allocator (c10/cuda/CUDACachingAllocator.h), which Quilt's allocator class "
            "is compiled against; a CUDA build of torch has them".format(version, torch_dir)
        )
    with open(_ALLOCATOR_SOURCE, "rb") as f:
        source = f.read()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    key = hashlib.sha256(
        b"\0".join([source, version.encode(), torch_dir.encode(), str(abi).encode()])
    ).hexdigest()[:16]
    folder = os.path.join(_bridge_cache_dir(), key)
    target = os.path.join(folder, "libquilt_torch_allocator.so")
    if not os.path.isfile(target):
        cxx = _compiler()
        if cxx is None:
            raise BridgeError(
                "quilt_torch.enable() needs a C++ compiler (g++ or clang++, or $CXX) "
                "once, to build Quilt's allocator class against this torch ({}); it is "
                "cached in {} afterwards; install one, e.g. `apt-get install g++`".format(
                    version, folder
                )
            )
        cuda_dirs, missing = _cuda_include_dirs(torch_dir)
        if missing:
            raise BridgeError(
                "quilt_torch.enable(): building Quilt's allocator class against torch {} "
                "needs the CUDA runtime's headers, not found: {}".format(version, "; ".join(missing))
            )
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        command = [cxx, "-std=c++20", "-O2", "-shared", "-fPIC",
                   "-D_GLIBCXX_USE_CXX11_ABI={}".format(abi), "-I", include]
        for d in cuda_dirs:
            command += ["-idirafter", d]
        command += [
            _ALLOCATOR_SOURCE,
            "-L", lib_dir, "-lc10", "-lc10_cuda", "-Wl,-rpath," + lib_dir, "-ldl",
            "-o", tmp,
        ]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            os.unlink(tmp)
            raise BridgeError(
                "quilt_torch.enable(): building Quilt's allocator class against torch {} "
                "failed (it is written for torch 2.15's allocator interface; nothing "
                "was installed) ({}):\n{}".format(
                    version, " ".join(command), done.stdout.decode("utf-8", "replace")[-8000:]
                )
            )
        os.replace(tmp, target)  # atomic: a concurrent build wins or loses whole
    try:
        lib = ctypes.PyDLL(target)  # holds the GIL: torch's context recorder runs Python
    except OSError as exc:
        raise BridgeError(
            "quilt_torch.enable(): Quilt's allocator class {} (torch {}) cannot be "
            "loaded: {}".format(target, version, exc)
        ) from exc
    lib.quilt_allocator_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.quilt_allocator_install.restype = ctypes.c_int
    lib.quilt_allocator_installed.argtypes = []
    lib.quilt_allocator_installed.restype = ctypes.c_int
    lib.quilt_allocator_try_malloc.argtypes = [
        ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t,
    ]
    lib.quilt_allocator_try_malloc.restype = ctypes.c_int
    lib.quilt_allocator_free.argtypes = [ctypes.c_void_p]
    lib.quilt_allocator_free.restype = None
    lib.quilt_allocator_route_count.argtypes = []
    lib.quilt_allocator_route_count.restype = ctypes.c_int
    lib.quilt_allocator_record_history.argtypes = [ctypes.c_int, ctypes.c_size_t]
    lib.quilt_allocator_record_history.restype = ctypes.c_int
    lib.quilt_allocator_torch_version.argtypes = []
    lib.quilt_allocator_torch_version.restype = ctypes.c_char_p
    lib.path = target
    _allocator = lib
    return lib


# Kept for scripts written against the bridge: the allocator class's path.
def _bridge_library(torch):
    return _allocator_library(torch).path


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
    return ctypes.cast(getattr(_library(), name), ctypes.c_void_p).value


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
    stats = json.loads(_read_string(_library().quilt_check_configuration))
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
    lib = _allocator_library(torch)
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
    lib = _library()
    stats = json.loads(_read_string(lib.quilt_stats_json, _device_index(device)))
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
    _check(
        _library().quilt_reset_peak_stats(_device_index(device)),
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
    _check(_library().quilt_forget_stream(ctypes.c_void_p(int(raw))), "quilt_forget_stream")


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


class ConfigurationError(QuiltError, ValueError):
    """``QUILT_ALLOC_CONF`` is invalid, or names a backend torch cannot use."""


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
