"""Quilt's allocator class for torch (``torch_allocator.cpp``): compiled
once against the installed torch, cached, and loaded."""

import ctypes
import os

from ._clib import HEADER
from .errors import BridgeError

# The environment variable naming the folder where the allocator class is
# compiled and cached (default: ~/.cache/quilt/torch-bridge).
BRIDGE_CACHE_ENV = "QUILT_TORCH_BRIDGE_CACHE"
_ALLOCATOR_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_allocator.cpp")
_allocator = None  # the compiled allocator class's ctypes handle, once built


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


def allocator_library(torch):
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
    with open(_ALLOCATOR_SOURCE, "rb") as f, open(HEADER, "rb") as h:
        source = f.read() + b"\0" + h.read()  # the class and the ABI it includes
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
                   "-D_GLIBCXX_USE_CXX11_ABI={}".format(abi), "-I", os.path.dirname(HEADER), "-I", include]
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
def bridge_library(torch):
    return allocator_library(torch).path


