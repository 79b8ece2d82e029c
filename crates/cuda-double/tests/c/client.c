/*
 * A client of the CUDA driver API that knows only what cuda.h declares: the
 * types, constants and prototypes below are copied from CUDA 12's cuda.h
 * (with its #defines that map a name to its _v2 symbol), for the functions
 * a VMM allocator calls. Built with `cc ... -lcuda` against the double's
 * private folder of libcuda links and run over it by tests/c_client.rs, it
 * checks the double's ABI from C: every call's CUresult and every byte.
 *
 * It prints one line per step and exits non-zero at the first mismatch.
 */
#define _POSIX_C_SOURCE 200809L

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- From cuda.h (CUDA 12) ------------------------------------------ */

#define CUDAAPI

typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef int CUdevice_v1;
typedef CUdevice_v1 CUdevice;
typedef unsigned long long CUdeviceptr_v2;
typedef CUdeviceptr_v2 CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUmemGenericAllocationHandle_v1;
typedef CUmemGenericAllocationHandle_v1 CUmemGenericAllocationHandle;

#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

typedef enum CUstream_flags_enum {
    CU_STREAM_DEFAULT = 0x0,
    CU_STREAM_NON_BLOCKING = 0x1
} CUstream_flags;

typedef enum CUevent_flags_enum {
    CU_EVENT_DEFAULT = 0x0,
    CU_EVENT_BLOCKING_SYNC = 0x1,
    CU_EVENT_DISABLE_TIMING = 0x2,
    CU_EVENT_INTERPROCESS = 0x4
} CUevent_flags;

typedef enum CUdevice_attribute_enum {
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
} CUdevice_attribute;

typedef enum CUpointer_attribute_enum {
    CU_POINTER_ATTRIBUTE_CONTEXT = 1,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
} CUpointer_attribute;

typedef enum CUmemorytype_enum {
    CU_MEMORYTYPE_HOST = 0x01,
    CU_MEMORYTYPE_DEVICE = 0x02,
    CU_MEMORYTYPE_ARRAY = 0x03,
    CU_MEMORYTYPE_UNIFIED = 0x04
} CUmemorytype;

typedef enum CUmemAllocationHandleType_enum {
    CU_MEM_HANDLE_TYPE_NONE = 0x0,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
    CU_MEM_HANDLE_TYPE_WIN32 = 0x2,
    CU_MEM_HANDLE_TYPE_WIN32_KMT = 0x4,
    CU_MEM_HANDLE_TYPE_FABRIC = 0x8,
    CU_MEM_HANDLE_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationHandleType;

typedef enum CUmemAccess_flags_enum {
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
    CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
    CU_MEM_ACCESS_FLAGS_PROT_MAX = 0x7FFFFFFF
} CUmemAccess_flags;

typedef enum CUmemLocationType_enum {
    CU_MEM_LOCATION_TYPE_INVALID = 0x0,
    CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
    CU_MEM_LOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemLocationType;

typedef enum CUmemAllocationType_enum {
    CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
    CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
    CU_MEM_ALLOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationType;

typedef enum CUmemAllocationGranularity_flags_enum {
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
} CUmemAllocationGranularity_flags;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id;
} CUmemLocation_v1;
typedef CUmemLocation_v1 CUmemLocation;

typedef struct CUmemAllocationProp_st {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp_v1;
typedef CUmemAllocationProp_v1 CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    CUmemAccess_flags flags;
} CUmemAccessDesc_v1;
typedef CUmemAccessDesc_v1 CUmemAccessDesc;

#define cuDeviceTotalMem cuDeviceTotalMem_v2
#define cuCtxCreate cuCtxCreate_v2
#define cuCtxDestroy cuCtxDestroy_v2
#define cuCtxPopCurrent cuCtxPopCurrent_v2
#define cuCtxPushCurrent cuCtxPushCurrent_v2
#define cuDevicePrimaryCtxRelease cuDevicePrimaryCtxRelease_v2
#define cuMemGetInfo cuMemGetInfo_v2
#define cuMemAlloc cuMemAlloc_v2
#define cuMemFree cuMemFree_v2
#define cuMemGetAddressRange cuMemGetAddressRange_v2
#define cuMemAllocHost cuMemAllocHost_v2
#define cuMemcpyHtoD cuMemcpyHtoD_v2
#define cuMemcpyDtoH cuMemcpyDtoH_v2
#define cuMemcpyDtoD cuMemcpyDtoD_v2
#define cuMemcpyHtoDAsync cuMemcpyHtoDAsync_v2
#define cuMemcpyDtoHAsync cuMemcpyDtoHAsync_v2
#define cuMemcpyDtoDAsync cuMemcpyDtoDAsync_v2
#define cuMemsetD8 cuMemsetD8_v2
#define cuMemsetD16 cuMemsetD16_v2
#define cuMemsetD32 cuMemsetD32_v2
#define cuStreamDestroy cuStreamDestroy_v2
#define cuEventDestroy cuEventDestroy_v2

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr);
CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr);
CUresult CUDAAPI cuInit(unsigned int Flags);
CUresult CUDAAPI cuDriverGetVersion(int *driverVersion);
CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal);
CUresult CUDAAPI cuDeviceGetCount(int *count);
CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev);
CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult CUDAAPI cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult CUDAAPI cuCtxDestroy(CUcontext ctx);
CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx);
CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx);
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx);
CUresult CUDAAPI cuCtxGetDevice(CUdevice *device);
CUresult CUDAAPI cuCtxSynchronize(void);
CUresult CUDAAPI cuMemGetInfo(size_t *free, size_t *total);
CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize);
CUresult CUDAAPI cuMemFree(CUdeviceptr dptr);
CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr);
CUresult CUDAAPI cuMemAllocHost(void **pp, size_t bytesize);
CUresult CUDAAPI cuMemFreeHost(void *p);
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult CUDAAPI cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
CUresult CUDAAPI cuMemcpyDtoD(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N);
CUresult CUDAAPI cuMemsetD16(CUdeviceptr dstDevice, unsigned short us, size_t N);
CUresult CUDAAPI cuMemsetD32(CUdeviceptr dstDevice, unsigned int ui, size_t N);
CUresult CUDAAPI cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream);
CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);
CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);
CUresult CUDAAPI cuStreamQuery(CUstream hStream);
CUresult CUDAAPI cuStreamSynchronize(CUstream hStream);
CUresult CUDAAPI cuStreamDestroy(CUstream hStream);
CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult CUDAAPI cuEventQuery(CUevent hEvent);
CUresult CUDAAPI cuEventSynchronize(CUevent hEvent);
CUresult CUDAAPI cuEventDestroy(CUevent hEvent);
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags);
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags);
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags);
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult CUDAAPI cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr);
CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle, CUmemAllocationHandleType handleType, unsigned long long flags);
CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, CUmemAllocationHandleType shHandleType);
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags option);
CUresult CUDAAPI cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle);
CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);

/* ---- The client -------------------------------------------------------- */

static const char *name_of(CUresult r) {
    const char *name = NULL;
    if (cuGetErrorName(r, &name) != CUDA_SUCCESS || name == NULL) {
        return "(no name)";
    }
    return name;
}

static void fail_call(const char *call, CUresult got, CUresult want, int line) {
    printf("FAIL line %d: %s returned %d (%s), expected %d (%s)\n", line, call, (int)got,
           name_of(got), (int)want, name_of(want));
    fflush(stdout);
    exit(1);
}

#define EXPECT(call, want)                                                      \
    do {                                                                        \
        CUresult got_ = (call);                                                 \
        if (got_ != (want)) fail_call(#call, got_, (want), __LINE__);           \
    } while (0)
#define CHECK(call) EXPECT(call, CUDA_SUCCESS)
#define REQUIRE(cond)                                                           \
    do {                                                                        \
        if (!(cond)) {                                                          \
            printf("FAIL line %d: %s\n", __LINE__, #cond);                      \
            fflush(stdout);                                                     \
            exit(1);                                                            \
        }                                                                       \
    } while (0)
#define STEP(text) printf("ok %s\n", text)

static int all_bytes(const unsigned char *p, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] != v) return 0;
    }
    return 1;
}

static CUmemAllocationProp device_prop(CUdevice dev, CUmemAllocationHandleType types) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = types;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    return prop;
}

int main(void) {
    const char *text = NULL;
    int version = 0, count = 0, attr = 0;
    CUdevice dev = -1, cur_dev = -1;
    char name[64];
    setvbuf(stdout, NULL, _IOLBF, 0); /* every step's line survives a crash */

    /* Error names need no initialisation. */
    CHECK(cuGetErrorName(CUDA_ERROR_INVALID_VALUE, &text));
    REQUIRE(strcmp(text, "CUDA_ERROR_INVALID_VALUE") == 0);
    CHECK(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &text));
    REQUIRE(strcmp(text, "out of memory") == 0);
    CHECK(cuDriverGetVersion(&version));
    REQUIRE(version >= 12000);
    EXPECT(cuDeviceGetCount(&count), CUDA_ERROR_NOT_INITIALIZED);
    STEP("error names, driver version, nothing before cuInit");

    CHECK(cuInit(0));
    CHECK(cuDeviceGetCount(&count));
    REQUIRE(count >= 1);
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDeviceGetName(name, (int)sizeof name, dev));
    REQUIRE(strlen(name) > 0);
    size_t device_bytes = 0;
    CHECK(cuDeviceTotalMem(&device_bytes, dev));
    REQUIRE(device_bytes > 0);
    CHECK(cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
    REQUIRE(attr == 1);
    printf("ok device 0: %s, %zu bytes, driver %d\n", name, device_bytes, version);

    /* A context of our own, then the primary context as a typical library does. */
    CUcontext own = NULL, primary = NULL, current = NULL, popped = NULL;
    EXPECT(cuCtxGetDevice(&cur_dev), CUDA_ERROR_INVALID_CONTEXT);
    CHECK(cuCtxCreate(&own, 0, dev));
    CHECK(cuCtxGetCurrent(&current));
    REQUIRE(current == own);
    CHECK(cuCtxDestroy(own));
    CHECK(cuDevicePrimaryCtxRetain(&primary, dev));
    CHECK(cuCtxPushCurrent(primary));
    CHECK(cuCtxGetDevice(&cur_dev));
    REQUIRE(cur_dev == dev);
    size_t free0 = 0, total = 0;
    CHECK(cuMemGetInfo(&free0, &total));
    REQUIRE(total == device_bytes && free0 <= total);
    STEP("contexts");

    /* Granularity, reserve, create, map, access. */
    CUmemAllocationProp prop = device_prop(dev, CU_MEM_HANDLE_TYPE_NONE);
    size_t g = 0;
    CHECK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    REQUIRE(g > 0 && (g & (g - 1)) == 0);
    CUdeviceptr base = 0;
    CHECK(cuMemAddressReserve(&base, 4 * g, 0, 0, 0));
    REQUIRE(base != 0 && base % g == 0);
    CUmemGenericAllocationHandle h[2] = {0, 0};
    CHECK(cuMemCreate(&h[0], 2 * g, &prop, 0));
    CHECK(cuMemCreate(&h[1], 2 * g, &prop, 0));
    size_t free1 = 0;
    CHECK(cuMemGetInfo(&free1, &total));
    REQUIRE(free1 + 4 * g == free0);
    CHECK(cuMemMap(base, 2 * g, 0, h[0], 0));
    CHECK(cuMemMap(base + 2 * g, 2 * g, 0, h[1], 0));
    EXPECT(cuMemMap(base, 2 * g, 0, h[1], 0), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(base, 4 * g, &access, 1));
    unsigned long long granted = 0;
    CHECK(cuMemGetAccess(&granted, &access.location, base + 3 * g));
    REQUIRE(granted == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CUdeviceptr range_base = 0;
    size_t range_size = 0;
    CHECK(cuMemGetAddressRange(&range_base, &range_size, base + 2 * g + 5));
    REQUIRE(range_base == base + 2 * g && range_size == 2 * g);
    CUmemGenericAllocationHandle again = 0;
    CHECK(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)(base + 1)));
    REQUIRE(again == h[0]);
    CHECK(cuMemRelease(again));
    CUmemAllocationProp back;
    CHECK(cuMemGetAllocationPropertiesFromHandle(&back, h[1]));
    REQUIRE(back.type == CU_MEM_ALLOCATION_TYPE_PINNED && back.location.id == dev);
    STEP("reserve, create, map, set access");

    /* Synchronous copies and fills across the two handles' boundary. */
    const size_t n = 64 * 1024;
    const CUdeviceptr seam = base + 2 * g - n / 2;
    unsigned char *src = malloc(n), *dst = malloc(n);
    REQUIRE(src != NULL && dst != NULL);
    for (size_t i = 0; i < n; i++) src[i] = (unsigned char)(i * 31 + 7);
    CHECK(cuMemcpyHtoD(seam, src, n));
    memset(dst, 0, n);
    CHECK(cuMemcpyDtoH(dst, seam, n));
    REQUIRE(memcmp(src, dst, n) == 0);
    CHECK(cuMemsetD8(base, 0x5a, n));
    CHECK(cuMemsetD32(base + n, 0xdeadbeefu, n / 4));
    CHECK(cuMemcpyDtoD(base + 3 * g, seam, n));
    CHECK(cuMemcpyDtoH(dst, base, n));
    REQUIRE(all_bytes(dst, n, 0x5a));
    CHECK(cuMemcpyDtoH(dst, base + n, n));
    for (size_t i = 0; i < n / 4; i++) {
        unsigned int word;
        memcpy(&word, dst + 4 * i, 4);
        REQUIRE(word == 0xdeadbeefu);
    }
    CHECK(cuMemcpyDtoH(dst, base + 3 * g, n));
    REQUIRE(memcmp(src, dst, n) == 0);
    /* Refused: part of a mapping, memory without a mapping. */
    EXPECT(cuMemUnmap(base, g), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemcpyHtoD(base + 4 * g, src, 16), CUDA_ERROR_INVALID_VALUE);
    STEP("synchronous copies and fills");

    /* Unified addressing: cuMemcpy tells host from device memory itself. */
    const CUdeviceptr host_src = (CUdeviceptr)(uintptr_t)src, host_dst = (CUdeviceptr)(uintptr_t)dst;
    CHECK(cuMemcpy(base + 2 * g, host_src, n));
    CHECK(cuMemcpy(base + 3 * g + n, base + 2 * g, n));
    memset(dst, 0, n);
    CHECK(cuMemcpy(host_dst, base + 3 * g + n, n));
    REQUIRE(memcmp(src, dst, n) == 0);
    CHECK(cuMemsetD16(base + 2 * n, 0xbeef, n / 2));
    CHECK(cuMemsetD16Async(base + 3 * n, 0x1234, n / 2, CU_STREAM_LEGACY));
    for (int k = 0; k < 2; k++) {
        memset(dst, 0, n);
        CHECK(cuMemcpyAsync(host_dst, base + (2 + k) * n, n, CU_STREAM_LEGACY));
        CHECK(cuStreamSynchronize(CU_STREAM_LEGACY));
        for (size_t i = 0; i < n / 2; i++) {
            unsigned short half;
            memcpy(&half, dst + 2 * i, 2);
            REQUIRE(half == (k == 0 ? 0xbeef : 0x1234));
        }
    }
    unsigned int memory_type = 0;
    CUdeviceptr start = 0;
    size_t extent = 0;
    int ordinal = -1;
    CHECK(cuPointerGetAttribute(&memory_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, base + 2 * g + 7));
    REQUIRE(memory_type == CU_MEMORYTYPE_DEVICE);
    CHECK(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, base + 2 * g + 7));
    CHECK(cuPointerGetAttribute(&extent, CU_POINTER_ATTRIBUTE_RANGE_SIZE, base + 2 * g + 7));
    REQUIRE(start == base + 2 * g && extent == 2 * g);
    CHECK(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, base));
    REQUIRE(ordinal == dev);
    STEP("unified copies, 16-bit fills, pointer attributes");

    /* Streams and events: s2 waits for s1's fill through an event. */
    CUstream s1 = NULL, s2 = NULL;
    CUevent ev = NULL;
    CHECK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    unsigned char *pinned = NULL;
    CHECK(cuMemAllocHost((void **)&pinned, n));
    memset(pinned, 0, n);
    CHECK(cuMemsetD8Async(base + g, 0xa5, n, s1));
    CHECK(cuEventRecord(ev, s1));
    CUresult q = cuEventQuery(ev);
    REQUIRE(q == CUDA_SUCCESS || q == CUDA_ERROR_NOT_READY);
    CHECK(cuStreamWaitEvent(s2, ev, 0));
    CHECK(cuMemcpyDtoDAsync(base + 2 * g + g / 2, base + g, n, s2));
    CHECK(cuMemcpyDtoHAsync(pinned, base + 2 * g + g / 2, n, s2));
    CHECK(cuStreamSynchronize(s2));
    REQUIRE(all_bytes(pinned, n, 0xa5));
    CHECK(cuEventQuery(ev));
    CHECK(cuStreamQuery(s1));
    /* Pinned host to device on s1, checked after an event synchronisation. */
    memset(pinned, 0x3c, n);
    CHECK(cuMemcpyHtoDAsync(base + g, pinned, n, s1));
    CHECK(cuEventRecord(ev, s1));
    CHECK(cuEventSynchronize(ev));
    CHECK(cuMemcpyDtoH(dst, base + g, n));
    REQUIRE(all_bytes(dst, n, 0x3c));
    STEP("streams and events");

    /* The default streams: the legacy stream and this thread's own. */
    CHECK(cuMemsetD8Async(base, 0x11, n, CU_STREAM_PER_THREAD));
    CHECK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
    CHECK(cuMemsetD8Async(base + n, 0x22, n, CU_STREAM_LEGACY));
    CHECK(cuStreamSynchronize(CU_STREAM_LEGACY));
    CHECK(cuMemcpyDtoH(dst, base, n));
    REQUIRE(all_bytes(dst, n, 0x11));
    CHECK(cuMemcpyDtoH(dst, base + n, n));
    REQUIRE(all_bytes(dst, n, 0x22));
    STEP("legacy and per-thread default streams");

    /* Sharing: export a POSIX descriptor, import it, map it elsewhere. */
    CUmemAllocationProp shared_prop = device_prop(dev, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    size_t sg = 0;
    CHECK(cuMemGetAllocationGranularity(&sg, &shared_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle exported = 0, imported = 0;
    CHECK(cuMemCreate(&exported, sg, &shared_prop, 0));
    int fd = -1;
    CHECK(cuMemExportToShareableHandle(&fd, exported, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    REQUIRE(fd >= 0);
    CHECK(cuMemImportFromShareableHandle(&imported, (void *)(uintptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CUdeviceptr ea = 0, ia = 0;
    CHECK(cuMemAddressReserve(&ea, sg, 0, 0, 0));
    CHECK(cuMemAddressReserve(&ia, sg, 0, 0, 0));
    CHECK(cuMemMap(ea, sg, 0, exported, 0));
    CHECK(cuMemMap(ia, sg, 0, imported, 0));
    CHECK(cuMemSetAccess(ea, sg, &access, 1));
    CHECK(cuMemSetAccess(ia, sg, &access, 1));
    CHECK(cuMemcpyHtoD(ea, src, n));
    CHECK(cuMemcpyDtoH(dst, ia, n));
    REQUIRE(memcmp(src, dst, n) == 0);
    CHECK(cuMemUnmap(ea, sg));
    CHECK(cuMemUnmap(ia, sg));
    CHECK(cuMemRelease(exported));
    CHECK(cuMemRelease(imported));
    CHECK(cuMemAddressFree(ea, sg));
    CHECK(cuMemAddressFree(ia, sg));
    STEP("export and import of a POSIX descriptor");

    /* cuMemAlloc, as a non-VMM allocator does. */
    CUdeviceptr plain = 0;
    CHECK(cuMemAlloc(&plain, 1000));
    CHECK(cuMemsetD8(plain, 0x44, 1000));
    CHECK(cuMemcpyDtoH(dst, plain, 1000));
    REQUIRE(all_bytes(dst, 1000, 0x44));
    CHECK(cuMemFree(plain));
    EXPECT(cuMemFree(plain), CUDA_ERROR_INVALID_VALUE);
    STEP("cuMemAlloc and cuMemFree");

    /* Tear down: synchronise, then unmap, release, free, destroy. */
    CHECK(cuCtxSynchronize());
    CHECK(cuStreamDestroy(s1));
    CHECK(cuStreamDestroy(s2));
    EXPECT(cuStreamQuery(s1), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuEventDestroy(ev));
    EXPECT(cuEventQuery(ev), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuMemFreeHost(pinned));
    CHECK(cuMemUnmap(base, 2 * g));
    CHECK(cuMemUnmap(base + 2 * g, 2 * g));
    CHECK(cuMemRelease(h[0]));
    CHECK(cuMemRelease(h[1]));
    EXPECT(cuMemRelease(h[1]), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAddressFree(base, 2 * g), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemAddressFree(base, 4 * g));
    size_t free2 = 0;
    CHECK(cuMemGetInfo(&free2, &total));
    REQUIRE(free2 == free0);
    CHECK(cuCtxPopCurrent(&popped));
    REQUIRE(popped == primary);
    CHECK(cuDevicePrimaryCtxRelease(dev));
    free(src);
    free(dst);
    STEP("teardown");

    printf("client: all checks passed\n");
    return 0;
}
