// quilt_torch's out-of-memory bridge: the allocator functions that
// quilt_torch.enable() hands to torch.cuda.memory.CUDAPluggableAllocator.
//
// torch does not check what a pluggable allocator's malloc returns: a null
// pointer becomes a tensor at address 0. So this small library, compiled by
// quilt_torch against the installed torch's headers and cached (see
// _bridge_library in __init__.py), calls libquilt_torch.so's quilt_malloc and
// turns its failure into the exception torch raises for its own allocator:
// c10::OutOfMemoryError (Python: torch.OutOfMemoryError) for an out of
// memory, c10::Error (RuntimeError) for any other failure, each with Quilt's
// message (the request, the figures and the verdict). Quilt's state is
// unchanged by the failure, so the next allocation works.
//
// quilt_bridge_bind(path) must be called once, before torch allocates: it
// opens libquilt_torch.so (the instance ctypes and torch already loaded) and
// resolves the functions called here.

#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <string>

namespace {

using MallocFn = void* (*)(size_t, int, void*);
using FreeFn = void (*)(void*, size_t, int, void*);
using LastErrorFn = size_t (*)(char*, size_t);

MallocFn quilt_malloc_fn = nullptr;
FreeFn quilt_free_fn = nullptr;
LastErrorFn quilt_last_error_fn = nullptr;

std::string last_error() {
  if (quilt_last_error_fn == nullptr) {
    return "(quilt_last_error unavailable)";
  }
  size_t needed = quilt_last_error_fn(nullptr, 0);
  std::string text(needed + 1, '\0');
  size_t got = quilt_last_error_fn(&text[0], text.size());
  text.resize(got < needed ? got : needed);
  return text;
}

std::string mib(size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

}  // namespace

extern "C" {

// 0 once bound; 1 if the library cannot be opened, 2 if a function is missing.
int quilt_bridge_bind(const char* path) {
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    return 1;
  }
  auto m = reinterpret_cast<MallocFn>(dlsym(handle, "quilt_malloc"));
  auto f = reinterpret_cast<FreeFn>(dlsym(handle, "quilt_free"));
  auto e = reinterpret_cast<LastErrorFn>(dlsym(handle, "quilt_last_error"));
  if (m == nullptr || f == nullptr || e == nullptr) {
    return 2;
  }
  quilt_malloc_fn = m;
  quilt_free_fn = f;
  quilt_last_error_fn = e;
  return 0;
}

void* quilt_bridge_malloc(size_t size, int device, void* stream) {
  if (size == 0) {
    return nullptr;  // torch's empty tensors: no memory, no error
  }
  if (quilt_malloc_fn == nullptr) {
    TORCH_CHECK(false, "quilt_torch: the out-of-memory bridge is not bound to libquilt_torch.so");
  }
  void* p = quilt_malloc_fn(size, device, stream);
  if (p != nullptr) {
    return p;
  }
  std::string why = last_error();
  std::string msg = "CUDA out of memory (Quilt). Tried to allocate " + mib(size) + " (" +
      std::to_string(size) + " bytes) on device " + std::to_string(device) + ": " + why;
  if (why.find("out of memory allocating") != std::string::npos) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  TORCH_CHECK(false, "Quilt could not allocate " + mib(size) + " (" + std::to_string(size) +
      " bytes) on device " + std::to_string(device) + ": " + why);
}

void quilt_bridge_free(void* ptr, size_t size, int device, void* stream) {
  if (ptr == nullptr || quilt_free_fn == nullptr) {
    return;  // the null pointer of an empty tensor
  }
  quilt_free_fn(ptr, size, device, stream);
}

// For tests without a GPU (torch cannot reach a pluggable allocator's malloc
// there): runs quilt_bridge_malloc as torch would and says what came of it:
// 0 a pointer (in *out), 1 c10::OutOfMemoryError, 2 another c10::Error, 3
// another exception; the exception's message (without C++ backtrace) goes
// into buf, snprintf style.
int quilt_bridge_try_malloc(size_t size, int device, void** out, char* buf, size_t len) {
  std::string what;
  int kind = 0;
  try {
    *out = quilt_bridge_malloc(size, device, nullptr);
  } catch (const c10::OutOfMemoryError& e) {
    kind = 1;
    what = e.what_without_backtrace();
  } catch (const c10::Error& e) {
    kind = 2;
    what = e.what_without_backtrace();
  } catch (...) {
    kind = 3;
  }
  if (buf != nullptr && len > 0) {
    std::snprintf(buf, len, "%s", what.c_str());
  }
  return kind;
}

}  // extern "C"
