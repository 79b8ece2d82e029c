// quilt_torch's allocator class: Quilt as torch's CUDA allocator.
//
// quilt_torch.enable() compiles this file against the installed torch's
// headers (c10/cuda/CUDACachingAllocator.h) and CUDA runtime headers, links
// it with libc10, libc10_cuda and libcudart, caches the result (see
// _allocator_library in __init__.py), and calls quilt_allocator_install(),
// which installs one QuiltCudaAllocator the way torch's own
// changeCurrentAllocator does (the exported global
// c10::cuda::CUDACachingAllocator::allocator, and c10::SetAllocator for
// DeviceType::CUDA), refusing when torch's allocator is already initialized.
// From then on torch's own APIs reach Quilt: memory_stats and its kin,
// memory_summary, reset_peak/accumulated_memory_stats,
// _record_memory_history with _snapshot and memory_snapshot (torch's
// contexts with Python stacks on alloc/free entries and on blocks),
// caching_allocator_alloc/delete, empty_cache, the memory fraction,
// record_stream, MemPool/use_mem_pool and CUDA graphs (private pools, kept
// by libquilt_torch.so), and the out-of-memory observers, called before
// torch.OutOfMemoryError is thrown.
//
// Every allocator function is a call into libquilt_torch.so's C functions
// (resolved once with dlsym from the instance ctypes loaded). Quilt keeps
// the one map of live blocks: torch's deleter passes only the pointer, and
// quilt_torch_free finds its device and gives back its size and stream.
// This file keeps only what needs C++: torch's contexts (GatheredContext,
// while history records them), the allocation routing filters of
// beginAllocateToPool, the observers and trace trackers, and the streams a
// block was recorded on (record_stream), each in a table that a counter
// says is empty, so that an allocation or a free takes no lock of this
// class while nothing is registered. CUDA's relaxed capture mode is set by
// Quilt's CUDA backend around the driver calls that need it (none when the
// allocation is served from mapped memory).
//
// Written for the CUDAAllocator interface of torch 2.15 (the only torch it
// was built and tested against). That interface changes between releases
// (snapshot()'s and recordHistory()'s parameters, the pool functions, the
// observers): an older torch is refused below with a message naming its
// version; a newer one is tried, and a compile error is reported by
// quilt_torch.enable() as a BridgeError naming the torch version, with
// nothing installed.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <torch/headeronly/version.h>

#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 15)
#error "Quilt's allocator class is written for torch 2.15's CUDAAllocator interface; this torch is older (see TORCH_VERSION)"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;

// The C structs of libquilt_torch.so (crates/torch/src/device_stats.rs,
// listing.rs, ffi.rs): keep field for field in step.
struct QuiltStat {
  int64_t current, peak, allocated, freed;
};
struct QuiltDeviceStats {
  QuiltStat allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes,
      active_bytes, inactive_split_bytes, requested_bytes;
  int64_t num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free;
  int64_t device_total, device_free, pool_kept_bytes;
};
struct QuiltAllocation {
  void* ptr;
  uint64_t seq;
};
struct QuiltFreed {
  uint64_t size, stream, seq;
  int32_t device, kept_by_pool;
};
struct QuiltSegment {
  int32_t device;
  uint32_t first_block, block_count;
  uint64_t address, total_size, stream;
};
struct QuiltBlock {
  uint64_t address, size, requested;
  int32_t state;  // 0 allocated, 1 pending free, 2 free
};
struct QuiltTraceEntry {
  uint64_t seq;
  int32_t device, action;
  uint64_t addr, size, stream, time_us;
};
struct QuiltPoolBlock {  // crates/torch/src/private_pools.rs, CheckpointBlock
  uint64_t ptr, size, requested, stream;
  int32_t live;
};

// libquilt_torch.so's functions.
struct Api {
  int (*torch_malloc)(size_t, int, void*, int, uint64_t, uint64_t, QuiltAllocation*);
  int (*torch_free)(void*, QuiltFreed*);
  int (*block_size)(void*, uint64_t*);
  int (*device_stats)(int, QuiltDeviceStats*);
  int (*reset_accumulated)(int);
  int (*reset_peak)(int);
  int (*pool_incref)(int, uint64_t, uint64_t);
  int (*pool_release)(int, uint64_t, uint64_t);
  int (*pool_use_count)(int, uint64_t, uint64_t);
  double (*get_fraction)(int);
  int (*try_set_fraction)(double, int);
  size_t (*segments)(int, QuiltSegment*, size_t, QuiltBlock*, size_t, size_t*);
  size_t (*history_since)(uint64_t, QuiltTraceEntry*, size_t);
  uint64_t (*history_last_seq)();
  int (*clear_history)();
  int (*record_history)(int, size_t);
  void (*empty_cache)();
  void (*record_stream)(void*, void*);
  size_t (*last_error)(char*, size_t);
  int (*pool_checkpoint)(int, uint64_t, uint64_t, QuiltPoolBlock*, size_t, size_t*);
  int (*pool_restore)(int, uint64_t, uint64_t, const QuiltPoolBlock*, size_t, QuiltPoolBlock*,
                      size_t, size_t*);
  int (*pool_live_blocks)(int, uint64_t, uint64_t, uint64_t*, size_t, size_t*);
  int (*in_forked_child)();
  int (*enable_peer_access)(int, int);
};
Api api{};
bool bound = false;

std::string last_error() {
  if (api.last_error == nullptr) {
    return "(quilt_last_error unavailable)";
  }
  size_t needed = api.last_error(nullptr, 0);
  std::string text(needed + 1, '\0');
  size_t got = api.last_error(&text[0], text.size());
  text.resize(std::min(got, needed));
  return text;
}

// torch's own size format ("300.00 MiB").
std::string format_size(uint64_t size) {
  char buf[64];
  if (size <= 1024) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", size / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", size / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", size / 1073741824.0);
  }
  return buf;
}

void fill(c10::CachingAllocator::StatArray& out, const QuiltStat& s) {
  // Quilt has no small and large pools: all is large.
  for (auto type : {c10::CachingAllocator::StatType::AGGREGATE,
                    c10::CachingAllocator::StatType::LARGE_POOL}) {
    auto& d = out[static_cast<size_t>(type)];
    d.current = s.current;
    d.peak = s.peak;
    d.allocated = s.allocated;
    d.freed = s.freed;
  }
}

// A private pool's state for torch.compile's CUDA graph trees
// (getCheckpointState): its blocks, as libquilt_torch.so listed them.
struct QuiltPoolState final : cca::AllocatorState {
  c10::DeviceIndex device;
  c10::MempoolId_t id;
  std::vector<QuiltPoolBlock> blocks;
  QuiltPoolState(c10::DeviceIndex d, c10::MempoolId_t i, std::vector<QuiltPoolBlock> b)
      : device(d), id(i), blocks(std::move(b)) {}
};

void quilt_raw_delete(void* ptr);

// torch.cuda.memory._set_memory_metadata's value on this thread.
thread_local std::string thread_metadata;

// The deleter of a tensor allocated while the caching allocator was
// disabled (torch.cuda.caching_allocator_enable(False)): cudaFree, as
// torch's own allocator's uncached_delete. A deleter must not throw.
void quilt_uncached_delete(void* ptr) {
  cudaError_t e = cudaFree(ptr);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_WARN("quilt_torch: cudaFree of uncached memory ", ptr, " failed: ",
               cudaGetErrorString(e));
  }
}

class QuiltCudaAllocator final : public cca::CUDAAllocator {
 public:
  // -- allocation -----------------------------------------------------------

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    if (!enabled_.load(std::memory_order_relaxed) && size != 0) {
      // The caching allocator disabled: straight from the runtime, as
      // torch's own allocator does, freed by cudaFree.
      void* p = nullptr;
      C10_CUDA_CHECK(cudaMalloc(&p, size));
      return {p, p, &quilt_uncached_delete, c10::Device(c10::DeviceType::CUDA, device)};
    }
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
    void* p = malloc_on(size, device, stream);
    return {p, p, &quilt_raw_delete, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &quilt_raw_delete;
  }

  void* raw_alloc(size_t nbytes) override {
    if (!enabled_.load(std::memory_order_relaxed)) {
      return uncached_alloc(nbytes);
    }
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device));
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (!enabled_.load(std::memory_order_relaxed)) {
      return uncached_alloc(nbytes);
    }
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc_on(nbytes, device, stream);
  }

  // raw_alloc while the caching allocator is disabled: cudaMalloc, as
  // torch's own allocator does (no statistics, no history); raw_delete
  // gives it back with cudaFree, whether or not the allocator was enabled
  // again meanwhile.
  void* uncached_alloc(size_t nbytes) {
    if (nbytes == 0) {
      return nullptr;
    }
    void* p = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&p, nbytes));
    std::lock_guard<std::mutex> lock(mutex_);
    uncached_.insert(p);
    uncached_count_.store(uncached_.size(), std::memory_order_release);
    return p;
  }

  // A block of `size` bytes on `device` ordered on `stream`, into the
  // private pool whose filter accepts the stream if one does; throws
  // c10::OutOfMemoryError (after calling the observers) or c10::Error.
  void* malloc_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    if (size == 0) {
      return nullptr;  // an empty tensor: no memory
    }
    TORCH_CHECK(bound, "quilt_torch: the allocator is not bound to libquilt_torch.so");
    bool use_pool = false;
    c10::MempoolId_t pool{0, 0};
    if (route_count_.load(std::memory_order_acquire) != 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& c : routes_) {
        if (c.device == device && c.filter(stream)) {
          use_pool = true;
          pool = c.id;
          break;
        }
      }
    }
    std::shared_ptr<c10::GatheredContext> context;
    auto recorder = recorder_.load();
    if (history_on_.load() && recorder != nullptr && when_.load() != cda::RecordContext::NEVER) {
      context = recorder();
    }
    QuiltAllocation a{nullptr, 0};
    int rc = labelled([&] {
      return api.torch_malloc(size, device, stream, use_pool ? 1 : 0, pool.first, pool.second, &a);
    });
    if (rc == 1) {
      out_of_memory(size, device, last_error());
    }
    TORCH_CHECK(rc == 0 && a.ptr != nullptr, "Quilt could not allocate ", format_size(size), " (",
                size, " bytes) on device ", static_cast<int>(device), ": ", last_error());
    if (context) {
      std::lock_guard<std::mutex> lock(mutex_);
      block_context_[a.ptr] = context;
      context_count_.store(block_context_.size(), std::memory_order_release);
      if (a.seq != 0 && when_.load() >= cda::RecordContext::ALLOC) {
        remember(a.seq, context);
      }
    }
    track(cda::TraceEntry::ALLOC, device, a.ptr, size, stream, pool, context);
    return a.ptr;
  }

  [[noreturn]] void out_of_memory(size_t size, c10::DeviceIndex device, const std::string& why) {
    QuiltDeviceStats s{};
    api.device_stats(device, &s);
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      observers = observers_;
    }
    for (auto& o : observers) {
      o(device, static_cast<size_t>(s.allocated_bytes.current),
        static_cast<size_t>(s.device_total), static_cast<size_t>(s.device_free));
    }
    int64_t unallocated = std::max<int64_t>(0, s.reserved_bytes.current - s.allocated_bytes.current);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                     format_size(size), ". GPU ", static_cast<int>(device),
                     " has a total capacity of ", format_size(s.device_total), " of which ",
                     format_size(s.device_free), " is free. Of the allocated memory ",
                     format_size(s.allocated_bytes.current),
                     " is allocated by PyTorch (Quilt), and ", format_size(unallocated),
                     " is reserved by PyTorch (Quilt) but unallocated. Quilt: ", why);
  }

  void raw_delete(void* ptr) override {
    if (ptr == nullptr) {
      return;
    }
    if (uncached_count_.load(std::memory_order_acquire) != 0) {
      bool uncached = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (uncached_.erase(ptr) != 0) {
          uncached = true;
          uncached_count_.store(uncached_.size(), std::memory_order_release);
        }
      }
      if (uncached) {
        quilt_uncached_delete(ptr);
        return;
      }
    }
    std::shared_ptr<c10::GatheredContext> context;
    auto recorder = recorder_.load();
    if (history_on_.load() && recorder != nullptr && when_.load() == cda::RecordContext::ALL) {
      context = recorder();
    }
    QuiltFreed f{};
    int rc = labelled([&] { return api.torch_free(ptr, &f); });
    if (rc == 1 && api.in_forked_child() != 0) {
      // A tensor of the parent dying in a forked child: its memory is the
      // parent's, nothing here frees it.
      return;
    }
    if (rc == 1) {
      // A deleter must not throw (it runs in destructors).
      TORCH_WARN("quilt_torch: freeing ", ptr, " failed: ", last_error());
      return;
    }
    auto stream = reinterpret_cast<cudaStream_t>(f.stream);
    std::vector<cudaStream_t> used_on;
    if (recorded_count_.load(std::memory_order_acquire) != 0 ||
        context_count_.load(std::memory_order_acquire) != 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = recorded_.find(ptr);
      if (it != recorded_.end()) {
        used_on = std::move(it->second);
        recorded_.erase(it);
        recorded_count_.store(recorded_.size(), std::memory_order_release);
      }
      if (block_context_.erase(ptr) != 0) {
        context_count_.store(block_context_.size(), std::memory_order_release);
      }
    }
    if (rc == 3) {
      // A private pool kept the block, to hand it out again on its own
      // stream: order that stream after the work queued on the streams it
      // was recorded on (Quilt does this for the blocks it gets back).
      for (cudaStream_t other : used_on) {
        if (other == stream) {
          continue;
        }
        cudaEvent_t done = nullptr;
        if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess) {
          if (cudaEventRecord(done, other) != cudaSuccess ||
              cudaStreamWaitEvent(stream, done, 0) != cudaSuccess) {
            TORCH_WARN("quilt_torch: ordering the reuse of ", ptr, " after stream ", other,
                       " failed: ", cudaGetErrorString(cudaGetLastError()));
          }
          (void)cudaEventDestroy(done);
        }
      }
    }
    if (context && f.seq != 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      remember(f.seq, context);
    }
    auto device = static_cast<c10::DeviceIndex>(f.device);
    track(cda::TraceEntry::FREE_REQUESTED, device, ptr, f.size, stream, {0, 0}, context);
    track(cda::TraceEntry::FREE_COMPLETED, device, ptr, f.size, stream, {0, 0}, context);
  }

  // -- lifecycle and settings -----------------------------------------------

  void init(int /*device_count*/) override {
    initialized_ = true;
  }
  bool initialized() override {
    return initialized_;
  }
  void enable(bool value) override {
    enabled_.store(value, std::memory_order_relaxed);
  }
  bool isEnabled() const override {
    return enabled_.load(std::memory_order_relaxed);
  }

  // -- user metadata (torch.cuda.memory._set_memory_metadata) ----------------

  bool supportsUserMetadata() override {
    return true;
  }
  // Thread-local, as torch's: the history entries that this thread's
  // calls record (allocations, frees, the segment changes they make,
  // empty_cache's) carry it.
  void setUserMetadata(const std::string& metadata) override {
    thread_metadata = metadata;
  }
  std::string getUserMetadata() override {
    return thread_metadata;
  }

  // Runs `call` (which may record history entries); while this thread has
  // user metadata and history is on, the entries it recorded (the sequence
  // numbers after the last one before it, up to the last one after it) are
  // labelled with the metadata.
  template <typename F>
  auto labelled(F&& call) -> decltype(call()) {
    if (thread_metadata.empty() || !history_on_.load(std::memory_order_acquire)) {
      return call();
    }
    uint64_t before = api.history_last_seq();
    struct Label {
      QuiltCudaAllocator* self;
      uint64_t before;
      ~Label() {
        uint64_t after = api.history_last_seq();
        if (after > before) {
          std::lock_guard<std::mutex> lock(self->mutex_);
          self->labels_[after] = {before, thread_metadata};
          while (self->labels_.size() > std::max<size_t>(self->max_entries_, 1024)) {
            self->labels_.erase(self->labels_.begin());
          }
        }
      }
    } label{this, before};
    return call();
  }

  // The user metadata of history entry `seq` (mutex_ held).
  std::string metadata_at(uint64_t seq) const {
    auto it = labels_.lower_bound(seq);
    if (it != labels_.end() && it->second.first < seq) {
      return it->second.second;
    }
    return std::string();
  }
  std::string name() override {
    return "quilt";
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    double f = api.get_fraction(device);
    TORCH_CHECK(f >= 0, "Quilt: ", last_error());
    return f;
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(api.try_set_fraction(fraction, device) == 0, "Quilt refused the memory fraction ",
                fraction, " on device ", static_cast<int>(device), ": ", last_error());
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    // A private pool's memory goes back when the pool is released
    // (releasePool); Quilt's cache is one for every pool.
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      labelled([&] { api.empty_cache(); });
    }
  }
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    // Quilt can serve any request up to what is not allocated (pages need
    // not be contiguous).
    QuiltDeviceStats s{};
    if (api.device_stats(device, &s) == 0 && largest != nullptr) {
      *largest = static_cast<size_t>(std::max<int64_t>(0, s.device_total - s.allocated_bytes.current));
    }
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    uint64_t n = 0;
    if (api.block_size(ptr, &n) == 0 && size != nullptr) {
      *size = static_cast<size_t>(n);
    }
    return ptr;
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr) {
      return;
    }
    api.record_stream(ptr.get(), stream.stream());
    // Kept for a private pool's reuse of the block (raw_delete).
    std::lock_guard<std::mutex> lock(mutex_);
    auto& used_on = recorded_[ptr.get()];
    if (std::find(used_on.begin(), used_on.end(), stream.stream()) == used_on.end()) {
      used_on.push_back(stream.stream());
    }
    recorded_count_.store(recorded_.size(), std::memory_order_release);
  }

  // -- statistics -----------------------------------------------------------

  cda::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    QuiltDeviceStats s{};
    TORCH_CHECK(api.device_stats(device, &s) == 0, "Quilt has no statistics for device ",
                static_cast<int>(device), ": ", last_error());
    cda::DeviceStats d;
    fill(d.allocation, s.allocation);
    fill(d.segment, s.segment);
    fill(d.active, s.active);
    fill(d.inactive_split, s.inactive_split);
    fill(d.allocated_bytes, s.allocated_bytes);
    fill(d.reserved_bytes, s.reserved_bytes);
    fill(d.active_bytes, s.active_bytes);
    fill(d.inactive_split_bytes, s.inactive_split_bytes);
    fill(d.requested_bytes, s.requested_bytes);
    d.num_alloc_retries = s.num_alloc_retries;
    d.num_ooms = s.num_ooms;
    d.num_sync_all_streams = s.num_sync_all_streams;
    d.num_device_alloc = s.num_device_alloc;
    d.num_device_free = s.num_device_free;
    return d;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    TORCH_CHECK(api.reset_accumulated(device) == 0, "Quilt: ", last_error());
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(api.reset_peak(device) == 0, "Quilt: ", last_error());
  }

  // -- history and snapshots ------------------------------------------------

  bool isHistoryEnabled() override {
    return history_on_.load();
  }
  void recordHistory(bool enabled, cda::CreateContextFn context_recorder, size_t max_entries,
                     cda::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    TORCH_CHECK(when == cda::RecordContext::NEVER || context_recorder,
                "recordHistory: a context recorder is needed");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      skip_.clear();
      for (const auto& a : skip_actions) {
        skip_.insert(static_cast<int>(cda::parseTraceEntryAction(a)));
      }
      when_.store(when);
      max_entries_ = max_entries;
      // As torch's own: stopping (torch's _record_memory_history(None))
      // forgets the history and the annotations, as clear_history does.
      if (clear_history || !enabled) {
        trace_context_.clear();
        annotations_.clear();
      }
      trim_annotations();
    }
    recorder_.store(context_recorder);
    if (clear_history || !enabled) {
      api.clear_history();
    }
    TORCH_CHECK(api.record_history(enabled ? 1 : 0, max_entries) == 0, "Quilt: ", last_error());
    history_on_.store(enabled);
  }
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = block_context_.find(const_cast<void*>(ptr));
    return it == block_context_.end() ? nullptr : it->second;
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!history_on_.load()) {
      return;
    }
    c10::DeviceIndex device = 0;
    (void)c10::cuda::GetDevice(&device);
    cda::AnnotationEntry a(device, 0);
    a.time_.t_ = static_cast<time_t>(now_us());
    for (const auto& [k, v] : md) {
      a.recordUserMetadata(k, v);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    annotations_.push_back(std::move(a));
    trim_annotations();
  }

  cca::SnapshotInfo snapshot(c10::MempoolId_t /*mempool_id*/, bool include_traces) override {
    cca::SnapshotInfo info;
    std::vector<QuiltSegment> segs(64);
    std::vector<QuiltBlock> blocks(256);
    for (;;) {
      size_t need_blocks = 0;
      size_t n = api.segments(-1, segs.data(), segs.size(), blocks.data(), blocks.size(),
                              &need_blocks);
      if (n <= segs.size() && need_blocks <= blocks.size()) {
        segs.resize(n);
        blocks.resize(need_blocks);
        break;
      }
      segs.resize(n * 2 + 1);
      blocks.resize(need_blocks * 2 + 1);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& s : segs) {
      cda::SegmentInfo si;
      si.device = static_cast<c10::DeviceIndex>(s.device);
      si.address = s.address;
      si.total_size = s.total_size;
      si.stream = reinterpret_cast<void*>(s.stream);
      si.is_large = true;
      si.is_expandable = true;
      for (uint32_t k = 0; k < s.block_count; ++k) {
        const auto& b = blocks[s.first_block + k];
        cda::BlockInfo bi;
        bi.size = b.size;
        bi.requested_size = b.requested;
        bi.allocated = b.state == 0;
        bi.active = b.state != 2;
        if (bi.allocated) {
          si.allocated_size += b.size;
          si.requested_size += b.requested;
          auto c = block_context_.find(reinterpret_cast<void*>(b.address));
          if (c != block_context_.end()) {
            bi.context_when_allocated = c->second;
          }
        }
        if (bi.active) {
          si.active_size += b.size;
        }
        si.blocks.push_back(std::move(bi));
      }
      info.segments.push_back(std::move(si));
    }
    int top = 0;
    for (const auto& s : segs) top = std::max(top, s.device);
    // As torch's own: no history once recording is off, one (empty) trace
    // per device.
    if (include_traces && !history_on_.load()) {
      info.device_traces.resize(static_cast<size_t>(std::max<int>(top + 1, c10::cuda::device_count())));
    }
    if (include_traces && history_on_.load()) {
      std::vector<QuiltTraceEntry> entries(1024);
      for (;;) {
        size_t n = api.history_since(0, entries.data(), entries.size());
        if (n <= entries.size()) {
          entries.resize(n);
          break;
        }
        entries.resize(n + 1024);
      }
      for (const auto& e : entries) top = std::max(top, e.device);
      int count = std::max<int>(top + 1, c10::cuda::device_count());
      info.device_traces.resize(static_cast<size_t>(count));
      std::unordered_map<uint64_t, std::shared_ptr<c10::GatheredContext>> freeing;
      for (const auto& e : entries) {
        if (e.action < 0 || e.device < 0 || skip_.count(e.action) != 0) {
          continue;
        }
        auto action = static_cast<cda::TraceEntry::Action>(e.action);
        std::shared_ptr<c10::GatheredContext> context;
        auto c = trace_context_.find(e.seq);
        if (c != trace_context_.end()) {
          context = c->second;
        }
        if (action == cda::TraceEntry::FREE_REQUESTED) {
          freeing[e.addr] = context;
        } else if (action == cda::TraceEntry::FREE_COMPLETED) {
          context = freeing[e.addr];
        }
        cda::TraceEntry te(action, static_cast<c10::DeviceIndex>(e.device), e.addr, e.size,
                           reinterpret_cast<void*>(e.stream), {0, 0}, 0, context, "",
                           metadata_at(e.seq));
        te.time_.t_ = static_cast<time_t>(e.time_us);
        info.device_traces[static_cast<size_t>(e.device)].push_back(std::move(te));
      }
      info.external_annotations.assign(annotations_.begin(), annotations_.end());
    }
    const char* conf = std::getenv("QUILT_ALLOC_CONF");
    info.config_metadata.last_allocator_settings =
        std::string("QUILT_ALLOC_CONF=") + (conf != nullptr ? conf : "");
    info.config_metadata.expandable_segments = true;
    return info;
  }

  // -- private pools (CUDA graphs, MemPool) ---------------------------------

  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& r : routes_) {
        TORCH_CHECK(!(r.device == device && r.id == id),
                    "beginAllocateToPool: already allocating to pool (", id.first, ", ",
                    id.second, ")");
      }
    }
    TORCH_CHECK(api.pool_incref(device, id.first, id.second) == 0, "Quilt: ", last_error());
    std::lock_guard<std::mutex> lock(mutex_);
    routes_.push_back(Route{device, id, std::move(filter)});
    route_count_.store(routes_.size(), std::memory_order_release);
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    routes_.erase(std::remove_if(routes_.begin(), routes_.end(),
                                 [&](const Route& r) { return r.device == device && r.id == id; }),
                  routes_.end());
    route_count_.store(routes_.size(), std::memory_order_release);
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    // Called from destructors (CUDAGraph::reset, ~MemPool): never throws.
    if (api.pool_release(device, id.first, id.second) != 0) {
      TORCH_WARN("quilt_torch: releasePool(", id.first, ", ", id.second, "): ", last_error());
    }
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    int n = api.pool_use_count(device, id.first, id.second);
    TORCH_CHECK(n >= 0, "Quilt: ", last_error());
    return n;
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "Quilt (quilt_torch.enable()) does not support a MemPool with an allocator of "
                "its own (",
                allocator ? allocator->name() : "", "): its pools are Quilt's");
    TORCH_CHECK(api.pool_incref(device, id.first, id.second) == 0, "Quilt: ", last_error());
  }
  void setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool) override {
    // Quilt serves an out of memory from its own pages only: a pool's free
    // blocks stay the pool's. (Called from ~MemPool: never throws.)
  }
  void setNoSplit(c10::DeviceIndex, c10::MempoolId_t) override {
    // Quilt hands a pool's blocks out whole: none is ever split.
  }
  // torch.compile's CUDA graph trees (mode="reduce-overhead",
  // backend="cudagraphs") check a private pool's live blocks, checkpoint its
  // state and restore it; the pool's books are libquilt_torch.so's
  // (private_pools.rs).

  // Whether the blocks of the pool handed out now are exactly `expected`.
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<uint64_t> live(expected.size() + 16);
    for (;;) {
      size_t n = 0;
      TORCH_CHECK(api.pool_live_blocks(device, id.first, id.second, live.data(), live.size(),
                                       &n) == 0,
                  "Quilt: ", last_error());
      if (n <= live.size()) {
        live.resize(n);
        break;
      }
      live.resize(n * 2);
    }
    if (live.size() != expected.size()) {
      return false;
    }
    return std::all_of(live.begin(), live.end(), [&](uint64_t p) {
      return expected.count(reinterpret_cast<void*>(p)) != 0;
    });
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::MempoolId_t id) override {
    std::vector<QuiltPoolBlock> blocks(64);
    for (;;) {
      size_t n = 0;
      TORCH_CHECK(api.pool_checkpoint(device, id.first, id.second, blocks.data(), blocks.size(),
                                      &n) == 0,
                  "Quilt: ", last_error());
      if (n <= blocks.size()) {
        blocks.resize(n);
        break;
      }
      blocks.resize(n * 2);
    }
    return std::make_shared<QuiltPoolState>(device, id, std::move(blocks));
  }

  // The pool put back in `state`: the blocks handed out now are freed (torch
  // has taken their deleters away), the state's handed-out blocks handed out
  // again at their addresses, each as a DataPtr with Quilt's deleter.
  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> state) override {
    auto pps = std::dynamic_pointer_cast<QuiltPoolState>(state);
    TORCH_CHECK(pps != nullptr, "setCheckpointPoolState: not a state of Quilt's pools");
    TORCH_CHECK(pps->device == device, "setCheckpointPoolState: a state of device ",
                static_cast<int>(pps->device), " restored on device ", static_cast<int>(device));
    std::vector<QuiltPoolBlock> freed(64);
    for (;;) {
      size_t n = 0;
      int rc = api.pool_restore(device, pps->id.first, pps->id.second, pps->blocks.data(),
                                pps->blocks.size(), freed.data(), freed.size(), &n);
      if (rc == 2) {
        freed.resize(n * 2);
        continue;
      }
      TORCH_CHECK(rc == 0, "Quilt: ", last_error());
      freed.resize(n);
      break;
    }
    cca::CheckpointDelta delta;
    {
      // Freed without their deleters: forget their contexts and streams.
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& b : freed) {
        void* ptr = reinterpret_cast<void*>(b.ptr);
        recorded_.erase(ptr);
        block_context_.erase(ptr);
        delta.ptrs_freed.push_back(ptr);
      }
      recorded_count_.store(recorded_.size(), std::memory_order_release);
      context_count_.store(block_context_.size(), std::memory_order_release);
    }
    for (const auto& b : freed) {
      void* ptr = reinterpret_cast<void*>(b.ptr);
      auto stream = reinterpret_cast<cudaStream_t>(b.stream);
      track(cda::TraceEntry::FREE_REQUESTED, device, ptr, b.requested, stream, pps->id, nullptr);
      track(cda::TraceEntry::FREE_COMPLETED, device, ptr, b.requested, stream, pps->id, nullptr);
    }
    for (const auto& b : pps->blocks) {
      if (b.live == 0) {
        continue;
      }
      void* ptr = reinterpret_cast<void*>(b.ptr);
      track(cda::TraceEntry::ALLOC, device, ptr, b.requested, reinterpret_cast<cudaStream_t>(b.stream),
            pps->id, nullptr);
      delta.dataptrs_allocd.emplace_back(ptr, ptr, &quilt_raw_delete,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // -- observers, IPC, copies -----------------------------------------------

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    observers_.push_back(std::move(observer));
  }
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    // Quilt rejects nothing pre-emptively: never called.
    std::lock_guard<std::mutex> lock(mutex_);
    rejection_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> lock(mutex_);
    trackers_.push_back(std::move(tracker));
    tracker_count_.store(trackers_.size(), std::memory_order_release);
  }
  cca::ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false,
                "Quilt (quilt_torch.enable()) does not support sharing CUDA tensors between "
                "processes (IPC handles)");
  }
  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false,
                "Quilt (quilt_torch.enable()) does not support opening CUDA IPC handles");
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
    // cudaDeviceEnablePeerAccess does not reach memory mapped with
    // cuMemMap: Quilt maps every page of dev_to_access for dev as well, now
    // and from now on (torch's expandable segments do the same).
    TORCH_CHECK(api.enable_peer_access(dev_to_access, dev) == 0, "Quilt: ", last_error());
  }
  // Between devices, a peer copy: Quilt maps its memory with cuMemMap for its
  // own device (and the peers QUILT_ALLOC_CONF's peer_access names, and
  // those enablePeerAccess added), which cudaMemcpyAsync reaches only where
  // the copying device has access; cudaMemcpyPeerAsync names both devices,
  // with access or without (torch's own allocator does the same for its
  // expandable segments when peer access is off).
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          size_t count, cudaStream_t stream, bool) override {
    if (dst_device != src_device) {
      return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
    }
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // For tests: the routes in force.
  size_t route_count() {
    std::lock_guard<std::mutex> lock(mutex_);
    return routes_.size();
  }

 private:
  struct Route {
    c10::DeviceIndex device;
    c10::MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };

  static uint64_t now_us() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
  }

  // The last max_entries_ annotations are kept, as torch's ring buffer
  // keeps them (mutex_ held).
  void trim_annotations() {
    while (annotations_.size() > max_entries_) {
      annotations_.pop_front();
    }
  }

  // Keep `context` for history entry `seq` (mutex_ held); the oldest go
  // when there are more than the history keeps.
  void remember(uint64_t seq, std::shared_ptr<c10::GatheredContext> context) {
    trace_context_[seq] = std::move(context);
    size_t keep = max_entries_ > SIZE_MAX / 2 ? SIZE_MAX : std::max<size_t>(max_entries_, 1) * 2;
    while (trace_context_.size() > keep) {
      trace_context_.erase(trace_context_.begin());
    }
  }

  // Call torch's trace trackers, if any.
  void track(cda::TraceEntry::Action action, c10::DeviceIndex device, void* ptr, size_t size,
             cudaStream_t stream, c10::MempoolId_t pool,
             const std::shared_ptr<c10::GatheredContext>& context) {
    if (tracker_count_.load(std::memory_order_acquire) == 0) {
      return;
    }
    std::vector<cca::AllocatorTraceTracker> trackers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (trackers_.empty()) {
        return;
      }
      trackers = trackers_;
    }
    cda::TraceEntry te(action, device, reinterpret_cast<size_t>(ptr), size, stream, pool,
                       c10::getApproximateTime(), context, "", getUserMetadata());
    for (auto& t : trackers) {
      t(te);
    }
  }

  // Guards the tables below; each table's size is also in its counter
  // (written under the lock), read without it to skip an empty table.
  std::mutex mutex_;
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> block_context_;
  std::atomic<size_t> context_count_{0};
  // The streams each block was recorded on (record_stream), until its free.
  std::unordered_map<void*, std::vector<cudaStream_t>> recorded_;
  std::atomic<size_t> recorded_count_{0};
  // Memory raw_alloc took from cudaMalloc while the allocator was disabled.
  std::unordered_set<void*> uncached_;
  std::atomic<size_t> uncached_count_{0};
  // The user metadata of history entries, by runs of sequence numbers:
  // the last of a run -> (the one before its first, the metadata).
  std::map<uint64_t, std::pair<uint64_t, std::string>> labels_;
  std::atomic<size_t> route_count_{0};
  std::atomic<size_t> tracker_count_{0};
  std::map<uint64_t, std::shared_ptr<c10::GatheredContext>> trace_context_;
  std::vector<Route> routes_;
  std::vector<cca::OutOfMemoryObserver> observers_;
  std::vector<cca::OomRejectionObserver> rejection_observers_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::deque<cda::AnnotationEntry> annotations_;
  std::set<int> skip_;
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::atomic<bool> history_on_{false};
  std::atomic<cda::CreateContextFn> recorder_{nullptr};
  std::atomic<cda::RecordContext> when_{cda::RecordContext::NEVER};
  size_t max_entries_ = 0;
};

QuiltCudaAllocator* instance = nullptr;

void quilt_raw_delete(void* ptr) {
  if (instance != nullptr) {
    instance->raw_delete(ptr);
  }
}

template <typename F>
bool resolve(void* handle, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  return out != nullptr;
}

void write(char* buf, size_t len, const std::string& text) {
  if (buf != nullptr && len > 0) {
    std::snprintf(buf, len, "%s", text.c_str());
  }
}

}  // namespace

extern "C" {

// Bind to libquilt_torch.so at `path` and install Quilt as torch's CUDA
// allocator. 0 on success (also when it is installed already); 1 the
// library cannot be opened, 2 a function is missing, 3 torch's allocator is
// already initialized (nothing installed), 4 torch did not take it. The
// reason goes into buf (snprintf style).
int quilt_allocator_install(const char* path, char* buf, size_t len) {
  if (instance != nullptr && cca::allocator.load() == instance) {
    return 0;
  }
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    write(buf, len, std::string("dlopen failed: ") + dlerror());
    return 1;
  }
  Api a{};
  bool ok = resolve(h, "quilt_torch_malloc", a.torch_malloc) &&
            resolve(h, "quilt_torch_free", a.torch_free) &&
            resolve(h, "quilt_torch_block_size", a.block_size) &&
            resolve(h, "quilt_device_stats", a.device_stats) &&
            resolve(h, "quilt_reset_accumulated_stats", a.reset_accumulated) &&
            resolve(h, "quilt_reset_peak_stats", a.reset_peak) &&
            resolve(h, "quilt_pool_create_or_incref", a.pool_incref) &&
            resolve(h, "quilt_pool_release", a.pool_release) &&
            resolve(h, "quilt_pool_use_count", a.pool_use_count) &&
            resolve(h, "quilt_get_memory_fraction", a.get_fraction) &&
            resolve(h, "quilt_try_set_memory_fraction", a.try_set_fraction) &&
            resolve(h, "quilt_segments", a.segments) &&
            resolve(h, "quilt_history_since", a.history_since) &&
            resolve(h, "quilt_history_last_seq", a.history_last_seq) &&
            resolve(h, "quilt_clear_history", a.clear_history) &&
            resolve(h, "quilt_record_history", a.record_history) &&
            resolve(h, "quilt_empty_cache", a.empty_cache) &&
            resolve(h, "quilt_record_stream", a.record_stream) &&
            resolve(h, "quilt_last_error", a.last_error) &&
            resolve(h, "quilt_pool_checkpoint", a.pool_checkpoint) &&
            resolve(h, "quilt_pool_restore", a.pool_restore) &&
            resolve(h, "quilt_pool_live_blocks", a.pool_live_blocks) &&
            resolve(h, "quilt_in_forked_child", a.in_forked_child) &&
            resolve(h, "quilt_enable_peer_access", a.enable_peer_access);
  if (!ok) {
    write(buf, len, std::string("a function is missing from ") + path);
    return 2;
  }
  cca::CUDAAllocator* current = cca::allocator.load();
  if (current != nullptr && current != instance && current->initialized()) {
    write(buf, len,
          "torch's CUDA allocator (" + current->name() +
              ") is already initialized (CUDA was used before quilt_torch.enable())");
    return 3;
  }
  api = a;
  bound = true;
  if (instance == nullptr) {
    instance = new QuiltCudaAllocator();  // static lifetime, as torch's own
  }
  cca::allocator.store(instance);
  // torch registers its own CUDA allocator with c10::SetAllocator at a
  // priority it does not export: take the lowest priority that replaces it
  // (a lower one leaves the registration as it was).
  for (int priority = 0; priority <= 255; ++priority) {
    c10::SetAllocator(c10::DeviceType::CUDA, instance, static_cast<uint8_t>(priority));
    if (c10::GetAllocator(c10::DeviceType::CUDA) == instance) {
      return 0;
    }
  }
  cca::allocator.store(current);
  write(buf, len, "c10::SetAllocator(CUDA) kept another allocator");
  return 4;
}

// 1 when Quilt is torch's CUDA allocator (as installed above), else 0.
int quilt_allocator_installed() {
  return instance != nullptr && cca::allocator.load() == instance &&
                 c10::GetAllocator(c10::DeviceType::CUDA) == instance
             ? 1
             : 0;
}

// For tests without a GPU (torch's allocate() needs a device): allocates as
// torch would on `device` and `stream`, through the same routing, history
// and out-of-memory path, and says what came of it: 0 a pointer (in *out),
// 1 c10::OutOfMemoryError, 2 another c10::Error, 3 another exception; the
// exception's message (without C++ backtrace) goes into buf.
int quilt_allocator_try_malloc(size_t size, int device, void* stream, void** out, char* buf,
                               size_t len) {
  std::string what;
  int kind = 0;
  try {
    TORCH_CHECK(instance != nullptr, "quilt_torch: the allocator is not installed");
    *out = instance->malloc_on(size, static_cast<c10::DeviceIndex>(device),
                               static_cast<cudaStream_t>(stream));
  } catch (const c10::OutOfMemoryError& e) {
    kind = 1;
    what = e.what_without_backtrace();
  } catch (const c10::Error& e) {
    kind = 2;
    what = e.what_without_backtrace();
  } catch (...) {
    kind = 3;
  }
  write(buf, len, what);
  return kind;
}

// For tests: torch's deleter of a pointer (raw_delete).
void quilt_allocator_free(void* ptr) {
  quilt_raw_delete(ptr);
}

// For tests: the number of allocation routes (beginAllocateToPool) in force.
int quilt_allocator_route_count() {
  return instance == nullptr ? -1 : static_cast<int>(instance->route_count());
}

// For tests without a GPU (torch's _record_memory_history initializes
// CUDA): recordHistory with no context recorder. 0, or 1 on a c10::Error.
int quilt_allocator_record_history(int enabled, size_t max_entries) {
  try {
    TORCH_CHECK(instance != nullptr, "quilt_torch: the allocator is not installed");
    instance->recordHistory(enabled != 0, nullptr, max_entries, cda::RecordContext::NEVER, false,
                            {});
    return 0;
  } catch (const c10::Error&) {
    return 1;
  }
}

// For tests: torch's version this file was compiled against.
const char* quilt_allocator_torch_version() {
  return TORCH_VERSION;
}

}  // extern "C"
