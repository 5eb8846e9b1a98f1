/*
 * Shared pieces of the CUDA kernels: the storage type, checked calls, and
 * deterministic reductions.
 *
 * Storage type floatX is chosen at build time (PRECISION=BF16 -> ENABLE_BF16,
 * the default; PRECISION=FP16 -> ENABLE_FP16; PRECISION=FP32 -> ENABLE_FP32).
 * Parameters, gradients and activations are floatX; statistics, losses,
 * optimizer moments, master weights and every accumulation inside a kernel
 * are fp32. Kernels touch floatX only through to_f32 (exact widening) and
 * from_f32 (round to nearest even), so no arithmetic ever runs in half
 * precision: in FP16 an intermediate may exceed 65504 (exp, x^3, sums of
 * squares) without harm; only a stored value beyond it becomes +-inf, which
 * is what dynamic loss scaling looks for (gradients) and propagates
 * (inf and NaN pass through every kernel; nothing traps on them).
 *
 * Determinism: no kernel uses floating-point atomics. Every reduction sums
 * in an order fixed by the code and the launch configuration, which never
 * depends on the device, so the same run gives the same bits and a
 * recomputed activation equals the original.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_CUDA_COMMON_CUH
#define REMAT_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#include <math.h>
#include <stdint.h>
#include <dirent.h>
#include <string.h>
#include "../core/utils.h"
#include "../core/gpu_scratch.h"
#include "../core/model.h" /* bf16_to_float, float_to_bf16: the host side of floatX */

/* ---- storage precision ---- */

#if (defined(ENABLE_FP16) + defined(ENABLE_FP32) + defined(ENABLE_BF16)) > 1
#error "define at most one of ENABLE_BF16, ENABLE_FP16, ENABLE_FP32 (make PRECISION=BF16|FP16|FP32)"
#endif

/* NCCL_FLOATX names the NCCL datatype of floatX; it expands only where used,
 * so this file needs no nccl.h. */
#if defined(ENABLE_FP32)
typedef float floatX;
#define PRECISION_NAME "fp32"
#define PRECISION_IS_FP32 1
#define PRECISION_IS_FP16 0
#define PRECISION_IS_BF16 0
#define CUBLAS_FLOATX CUDA_R_32F
#define NCCL_FLOATX ncclFloat
#elif defined(ENABLE_FP16)
typedef __half floatX;
#define PRECISION_NAME "fp16"
#define PRECISION_IS_FP32 0
#define PRECISION_IS_FP16 1
#define PRECISION_IS_BF16 0
#define CUBLAS_FLOATX CUDA_R_16F
#define NCCL_FLOATX ncclHalf
#else
#ifndef ENABLE_BF16
#define ENABLE_BF16
#endif
typedef __nv_bfloat16 floatX;
#define PRECISION_NAME "bf16"
#define PRECISION_IS_FP32 0
#define PRECISION_IS_FP16 0
#define PRECISION_IS_BF16 1
#define CUBLAS_FLOATX CUDA_R_16BF
#define NCCL_FLOATX ncclBfloat16
#endif

/* Model file version the GPU trainer writes: 5 (bf16 payload) holds a BF16
 * build's parameters exactly; FP16 and FP32 builds write 3 (fp32 payload),
 * which holds every fp16 value exactly, so a resumed FP16 run restarts from
 * bitwise the parameters it stopped with (fp16 -> bf16 would drop 3 bits). */
#define MODEL_FILE_VERSION_FLOATX (PRECISION_IS_BF16 ? 5 : 3)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

/* Round to nearest even into the storage type. fp16: |x| >= 65520 gives
 * +-inf, NaN stays NaN, values below 2^-14 become subnormal or zero. */
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

/* ---- floatX on the host (staging buffers of parameter transfers and tests) ----
 * Element i of a host array of floatX, as fp32 (exact), and the reverse
 * (round to nearest even, like from_f32). */
static inline float host_floatX_load(const void* buf, size_t i) {
#if PRECISION_IS_FP32
    return ((const float*)buf)[i];
#elif PRECISION_IS_FP16
    return __half2float(((const __half*)buf)[i]);
#else
    return bf16_to_float(((const uint16_t*)buf)[i]);
#endif
}

static inline void host_floatX_store(void* buf, size_t i, float v) {
#if PRECISION_IS_FP32
    ((float*)buf)[i] = v;
#elif PRECISION_IS_FP16
    ((__half*)buf)[i] = __float2half_rn(v);
#else
    ((uint16_t*)buf)[i] = float_to_bf16(v);
#endif
}

/* v rounded to the nearest floatX value, as fp32. */
static inline float host_round_floatX(float v) {
    floatX t;
    host_floatX_store(&t, 0, v);
    return host_floatX_load(&t, 0);
}

/* ---- checked calls: print the call, where, and why, then exit(1) via fail() ---- */

static inline void cuda_check_impl(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess)
        fail("CUDA call %s failed at %s:%d: %s (%s)", call, file, line, cudaGetErrorString(err), cudaGetErrorName(err));
}
static inline void cublas_check_impl(cublasStatus_t st, const char* call, const char* file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) fail("cuBLAS call %s failed at %s:%d: %s", call, file, line, cublasGetStatusString(st));
}
#define CUDA_CHECK(call) cuda_check_impl((call), #call, __FILE__, __LINE__)
#define CUBLAS_CHECK(call) cublas_check_impl((call), #call, __FILE__, __LINE__)
/* After a kernel launch: reports a bad launch configuration at the launch site. */
#define CUDA_CHECK_LAUNCH() cuda_check_impl(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

/* ---- is there a GPU to run on? ----
 * "No GPU" (a skip in the tests, one line from train_gpt) only where no
 * NVIDIA GPU exists: no device node /dev/nvidia0, /dev/nvidia1, ... (the CI
 * case: the runtime then says "insufficient driver" or "no device"), or
 * CUDA_VISIBLE_DEVICES hides every device. Where a GPU exists, a runtime that
 * cannot use it (a driver too old for this CUDA, an HGX fabric manager that
 * is down, a device in a bad state) is a failure naming the error: a borrowed
 * GPU must never end a session as "SKIP". */
#define GPU_BROKEN (-1)

/* Whether dev_dir holds an NVIDIA GPU's device node: nvidia<digits>. */
static inline int nvidia_device_node_exists(const char* dev_dir) {
    DIR* d = opendir(dev_dir);
    if (!d) return 0;
    int found = 0;
    for (struct dirent* e; !found && (e = readdir(d)) != NULL;)
        found = strncmp(e->d_name, "nvidia", 6) == 0 && e->d_name[6] >= '0' && e->d_name[6] <= '9';
    closedir(d);
    return found;
}

/* The decision, from what cudaGetDeviceCount returned (err, count), whether a
 * device node exists and whether CUDA_VISIBLE_DEVICES is set: the device
 * count, 0 for no GPU, or GPU_BROKEN; `why` says why there is none. */
static inline int gpu_presence(cudaError_t err, int count, int device_node, int visible_set, char* why, size_t n) {
    if (err == cudaSuccess && count > 0) return count;
    if (err == cudaSuccess) snprintf(why, n, "cudaGetDeviceCount found none");
    else snprintf(why, n, "cudaGetDeviceCount: %s, %s", cudaGetErrorName(err), cudaGetErrorString(err));
    if (!device_node) return 0;
    size_t used = strlen(why);
    if (visible_set && (err == cudaErrorNoDevice || err == cudaSuccess)) {
        snprintf(why + used, n - used, "; CUDA_VISIBLE_DEVICES hides the node's GPUs");
        return 0;
    }
    snprintf(why + used, n - used, "; yet an NVIDIA GPU is present (/dev/nvidia*): CUDA cannot use it");
    return GPU_BROKEN;
}

/* The number of usable CUDA devices, 0 when there is no GPU, GPU_BROKEN when
 * one is present but unusable; the first CUDA call of a program. */
static inline int gpu_device_count(char* why, size_t n) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) cudaGetLastError();
    return gpu_presence(err, count, nvidia_device_node_exists("/dev"), getenv("CUDA_VISIBLE_DEVICES") != NULL, why, n);
}

static inline unsigned int grid_for(size_t n, unsigned int block) {
    size_t g = ceil_div(n, block);
    if (g > 0x7fffffffu) fail("internal: a grid of %zu blocks is too large", g);
    return (unsigned int)(g ? g : 1);
}

/* ---- 16-byte vector access ----
 * Vec<T, n>: n consecutive elements moved as one access of n*sizeof(T) bytes,
 * aligned to its size, so a 16-byte Vec compiles to one 128-bit load or store
 * (LDG.128/STG.128) and a misaligned address faults (on a GPU; in the
 * emulator, UBSan's alignment check stops the run). XVEC: floatX elements in
 * 16 bytes (8 bf16 or fp16, 4 fp32). Kernels take the vector width as a
 * template parameter; the host launches width XVEC where the row length and
 * every pointer allow it and width 1 (plain scalar accesses) otherwise, so
 * both paths share one body and one arithmetic. */
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };
#define XVEC (16 / (int)sizeof(floatX))

template <int N, typename T> __device__ __forceinline__ Vec<T, N> vload(const T* p) { return *reinterpret_cast<const Vec<T, N>*>(p); }
template <int N, typename T> __device__ __forceinline__ void vstore(T* p, const Vec<T, N>& x) { *reinterpret_cast<Vec<T, N>*>(p) = x; }

/* n fp32 values at p (4-aligned groups as 16-byte loads when n is a multiple of 4). */
template <int N> __device__ __forceinline__ void load_f32s(float* out, const float* p) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int k = 0; k < N; k += 4) {
            Vec<float, 4> a = vload<4>(p + k);
#pragma unroll
            for (int j = 0; j < 4; j++) out[k + j] = a.v[j];
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; k++) out[k] = p[k];
    }
}
template <int N> __device__ __forceinline__ void store_f32s(float* p, const float* in) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int k = 0; k < N; k += 4) {
            Vec<float, 4> a;
#pragma unroll
            for (int j = 0; j < 4; j++) a.v[j] = in[k + j];
            vstore<4>(p + k, a);
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; k++) p[k] = in[k];
    }
}

/* Whether every pointer given is 16-byte aligned (NULL counts as aligned). */
static inline int aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }
template <typename... P> static inline int all_aligned16(const void* p, P... rest) {
    if constexpr (sizeof...(rest) == 0) return aligned16(p);
    else return aligned16(p) && all_aligned16(rest...);
}

/* ---- deterministic reductions ---- */

/* Butterfly sum over a warp: every lane ends with the same value, because at
 * each step both partners add the same two numbers (a + b == b + a). */
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* Sum over a block of blockDim.x threads (a multiple of 32, at most 1024):
 * warp sums, then warp 0 sums the per-warp results in a fixed tree. Every
 * thread gets the total. `scratch`: 33 floats of shared memory. */
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads(); /* scratch may still be read after a previous call */
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nwarps ? scratch[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) scratch[32] = w;
    }
    __syncthreads();
    return scratch[32];
}

/* ---- deterministic column sums (bias and LayerNorm parameter gradients) ----
 * Stage 1 (in the op's own file) writes fp32 partial sums over COLUMN_SPLITS
 * fixed slices of the rows: partials[split * ncols + col]. Stage 2, below,
 * adds the slices in order into the floatX gradient. The split count is a
 * constant, not a function of the device, so the bits do not depend on the
 * GPU model. Stage-1 blocks are (32 columns) x (COLUMN_BLOCK_Y row lanes). */
#define COLUMN_SPLITS GPU_COLUMN_SPLITS
#define COLUMN_BLOCK_Y 8

__host__ __device__ static inline int column_rows_per_split(int N) { return (N + COLUMN_SPLITS - 1) / COLUMN_SPLITS; }

/* grad[c] += sum over s (in order) of partials[s * ncols + c]; one thread
 * per column. G is floatX (the gradient itself, rounded once per call) or
 * float (a token-tiled layer's fp32 sum, plan.h's backward.tile_grads). */
template <typename G>
__global__ void column_finish_kernel(G* grad, const float* partials, int ncols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ncols) return;
    float acc = 0.0f;
    for (int s = 0; s < COLUMN_SPLITS; s++) acc += partials[(size_t)s * ncols + c];
    grad[c] = from_f32<G>(to_f32(grad[c]) + acc);
}

template <typename G>
static inline void gpu_column_finish(G* grad, const float* partials, int ncols, cudaStream_t stream) {
    column_finish_kernel<G><<<grid_for((size_t)ncols, 256), 256, 0, stream>>>(grad, partials, ncols);
    CUDA_CHECK_LAUNCH();
}

#endif
