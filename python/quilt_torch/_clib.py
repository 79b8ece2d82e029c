"""Quilt's C library (``libquilt_torch.so``), loaded with ctypes: where it
is found, its entry points' types, and the helpers every module uses to
call it."""

import ctypes
import os
import threading

from .errors import QuiltError

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

# Guards the lazily loaded library.
_lock = threading.Lock()


def _after_fork_in_child():
    # Another thread of the parent may have held the lock at the fork: the
    # child starts with a fresh one (the C library refuses to touch the
    # parent's CUDA state there, with torch's "Cannot re-initialize CUDA in
    # forked subprocess").
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_lib = None  # the ctypes.CDLL, once loaded


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


def declare(lib):
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


def library():
    """Load the library with ctypes once and return the cached handle.

    PyTorch's CUDAPluggableAllocator dlopens the same file; the dynamic loader
    hands both the same instance, so the statistics read here include the
    allocations made through torch.
    """
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(library_path())
            declare(lib)
            _lib = lib
        return _lib


def read_string(fn, *args):
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



def last_error():
    """Return the calling thread's last error from Quilt ("" if none).

    Errors are kept per thread: a failed allocation made by PyTorch on this
    thread (for example an out-of-memory) is reported here, with Quilt's
    verdict on whether capacity or fragmentation was the cause.
    """
    return read_string(library().quilt_last_error)


def check(rc, call):
    """Raise QuiltError with the thread's last error unless rc is 0."""
    if rc != 0:
        raise QuiltError("{} failed: {}".format(call, last_error()))
