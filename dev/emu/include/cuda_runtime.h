/*
 * cuda_runtime.h stand-in for remat's CPU emulator of CUDA (dev/emu; not a GPU).
 *
 * Why it exists: the CUDA sources include <cuda_runtime.h>; under the
 * emulator this header (first on the include path) supplies the runtime API
 * they use, implemented in dev/emu/runtime/emu_runtime.cpp with the
 * documented semantics: device memory is separate host memory (poisoned with
 * 0xff bytes, guard pages around each allocation, range-checked copies);
 * kernels, async copies and memsets are queued on the stream and run at the
 * next synchronisation point, in order, so reading results without the
 * documented synchronisation gives stale data here as on a GPU. A call or
 * argument the emulator does not implement stops the program with a message
 * naming it (no silent guesses). Environment: EMU_DEVICE_COUNT (default 1),
 * EMU_DEVICE_MEMORY (bytes, default 80 GiB), EMU_SYNC=1 (run everything at
 * once, for debugging), EMU_ORDER=forward|reverse|shuffle[:seed] (order of
 * blocks, warps and lanes).
 */
#ifndef REMAT_EMU_CUDA_RUNTIME_H
#define REMAT_EMU_CUDA_RUNTIME_H

#include "emu/emu.h"

#define CUDART_VERSION 12040

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInsufficientDriver = 35,
    cudaErrorInvalidDevice = 101,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorSystemNotReady = 802,
} cudaError_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
} cudaMemcpyKind;

typedef enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9,
} cudaFuncAttribute;

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02

typedef struct cudaEvent_st* cudaEvent_t;

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    size_t sharedMemPerBlockOptin;
    int regsPerBlock;
    int warpSize;
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    int major;
    int minor;
    int multiProcessorCount;
    int maxThreadsPerMultiProcessor;
    int l2CacheSize;
    int clockRate;
    int memoryClockRate;
    int memoryBusWidth;
};

/* Emulator only (no CUDA call): kernels launched from now on run only the
 * blocks whose blockIdx.x is in [x_lo, x_hi) (every y and z), the others
 * skipped as if a GPU had run them out of sight; (0, 0) restores whole
 * grids. For tests of offsets that a large grid's last blocks reach
 * (test_gpt.cu's check_wide_offsets): those blocks run on the rows they own
 * of a huge cudaMalloc block, which costs only the pages they touch. */
void emu_block_window(uint64_t x_lo, uint64_t x_hi);

const char* cudaGetErrorString(cudaError_t err);
const char* cudaGetErrorName(cudaError_t err);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaRuntimeGetVersion(int* version); /* the emulator: 0 */
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
/* the attributes emulated (values as CUDA 12.2+'s driver_types.h) */
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrHostNumaId = 134 };
/* cudaDevAttrMultiProcessorCount: 1, as cudaGetDeviceProperties says;
 * cudaDevAttrHostNumaId: EMU_HOST_NUMA_NODE (default -1: the system does not say) */
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
/* the emulated device has no PCI bus: cudaErrorInvalidValue */
cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceReset(void);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);

cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMallocHost(void** ptr, size_t bytes);
cudaError_t cudaFreeHost(void* ptr);
template <typename T> static inline cudaError_t cudaMalloc(T** ptr, size_t bytes) { return cudaMalloc((void**)ptr, bytes); }
template <typename T> static inline cudaError_t cudaMallocHost(T** ptr, size_t bytes) { return cudaMallocHost((void**)ptr, bytes); }

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream = 0);
/* height rows of width bytes, row i from src + i*spitch to dst + i*dpitch; cudaMemcpyDeviceToDevice (or Default
 * between device buffers) only */
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream = 0);
cudaError_t cudaMemset(void* dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream = 0);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority);
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest);
/* Every stream has its own queue (runtime/emu_runtime.cpp): the wait holds
 * `stream` until the event's latest record has run. A macro, so that the call
 * site reaches EMU_DELETE_SYNC=FILE:LINE (that wait skipped: a mutant without
 * a rebuild). */
cudaError_t emu_stream_wait_event(cudaStream_t stream, cudaEvent_t event, unsigned int flags, const char* file, int line);
#define cudaStreamWaitEvent(stream, event, flags) emu_stream_wait_event((stream), (event), (flags), __FILE__, __LINE__)
/* Queries run what can run first (work progresses on a GPU too), then report completion. */
cudaError_t cudaStreamQuery(cudaStream_t stream);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t emu_func_set_attribute(const void* func, cudaFuncAttribute attr, int value);
template <typename F> static inline cudaError_t cudaFuncSetAttribute(F* func, cudaFuncAttribute attr, int value) {
    return emu_func_set_attribute((const void*)func, attr, value);
}

#endif
