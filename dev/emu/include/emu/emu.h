/*
 * emu.h: the core of remat's CPU emulator of CUDA (dev/emu), shared by the
 * stand-in CUDA headers in dev/emu/include.
 *
 * Why it exists: the CUDA trainer's kernels must be checked against the CPU
 * reference on every change, and a GPU is rarely available. The emulator
 * compiles the CUDA sources with the host C++ compiler and runs every thread
 * block as a set of coroutines (one per CUDA thread) on one CPU core. It is
 * NOT a GPU and its results are never GPU verification (dev/emu/README.md).
 *
 * This header declares what device code sees: the index built-ins, barriers,
 * warp shuffles and votes, warp-collective operations (for mma.h's WMMA),
 * atomics, a few float intrinsics, and emu_launch(),
 * which dev/emu/transform.py substitutes for every kernel<<<...>>>(...) launch.
 * What a kernel may do is checked at run time where the CUDA documentation
 * says the behaviour is undefined (divergent barriers and shuffles, partial
 * shuffle masks, launch configurations beyond the limits); such a kernel is
 * stopped with a message naming the kernel, launch site, block and thread.
 */
#ifndef REMAT_EMU_H
#define REMAT_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

/* ---- qualifiers: host code, all of it ---- */
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
/* transform.py puts emu_launch_bounds(max threads) at the top of the kernel's body */
#define __launch_bounds__(...)
/* a register cap (ptxas's budget, checked by dev/ptxas_check.py): nothing to emulate */
#define __maxnreg__(...)
/* Block-shared: one static object per declaration (blocks run one at a time).
 * transform.py registers each one after its declaration (emu_shared_use),
 * and the emulator fills it with 0xff bytes (NaN) before every block, so a
 * read of shared memory no thread of the block wrote shows up as NaN. */
#define __shared__ static

typedef struct cudaStream_st* cudaStream_t;

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) float2 { float x, y; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(8) int2 { int x, y; };
struct __align__(16) uint4 { unsigned int x, y, z, w; };
struct __align__(8) uint2 { unsigned int x, y; };
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return float2{x, y}; }

namespace emu {

/* Where a launch was written (file and line of the rewritten <<<...>>>). */
struct Site {
    const char* kernel;
    const char* file;
    int line;
};

/* The thread being run; read-only views for device code. */
extern uint3 cur_thread_idx, cur_block_idx;
extern dim3 cur_block_dim, cur_grid_dim;

/* The current kernel's grid is run block by block (blocks in the order set by
 * EMU_ORDER), each block's threads as coroutines. body() is one thread.
 * Only blocks whose blockIdx.x is in [x_lo, x_hi) run (emu_block_window). */
void run_grid(const Site& site, dim3 grid, dim3 block, size_t dyn_smem, const std::function<void()>& body, uint64_t x_lo = 0,
              uint64_t x_hi = UINT64_MAX);
/* The window emu_block_window set, read when a kernel is launched. */
void block_window(uint64_t* x_lo, uint64_t* x_hi);

/* Launch checks and deferral: everything on a stream runs in its order at the
 * next synchronisation point (cudaStreamSynchronize, cudaDeviceSynchronize,
 * cudaMemcpy, ...), as on a GPU, so host code reading results early fails;
 * `what` names the operation in streamcheck's messages. */
void check_launch(const Site& site, const void* kernel, dim3 grid, dim3 block, size_t dyn_smem, cudaStream_t stream);
void enqueue_named(cudaStream_t stream, std::string what, std::function<void()> run);
/* true once a second stream exists: operations then carry descriptions for streamcheck */
bool stream_check_on(void);
/* p (a kernel argument) must be NULL or point into device or pinned memory. */
void check_kernel_pointer(const Site& site, int arg_index, const void* p);

[[noreturn]] void fatal(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- warp and block synchronisation (called by the macros below) ---- */
enum WarpOp { OP_SHFL_XOR, OP_SHFL_DOWN, OP_SHFL_UP, OP_SHFL_IDX, OP_BALLOT, OP_ANY, OP_ALL, OP_SYNCWARP, OP_COLLECTIVE };
void syncthreads(int line, const char* file);
/* Posts this lane's 8 bytes, waits for the whole warp, returns the result bits. */
uint64_t warp_op(int line, const char* file, WarpOp op, unsigned mask, uint64_t bits, int arg, int width);

/* A warp operation on more than 8 bytes a lane (WMMA, include/mma.h): each
 * lane posts a pointer to its own arguments (on its stack, which stays valid
 * while it waits); once all 32 lanes are at the same call of api, fn runs
 * once, as lane 0's thread, with the 32 pointers in lane order, and may read
 * and write every lane's data. */
typedef void (*WarpCollective)(void* const lanes[32]);
void warp_collective(int line, const char* file, const char* api, WarpCollective fn, void* mine);
/* The caller of a device function that takes it as a default argument
 * initialised with __builtin_LINE() and __builtin_FILE(): those name the call
 * site there, so messages and the warp's agreement check see where each lane
 * called from. */
struct CallSite {
    int line;
    const char* file;
};
/* Is the call at file:line the one EMU_DELETE_SYNC=FILE:LINE deletes (a
 * barrier, or a cp.async wait: include/emu/ptx.h)? */
bool call_deleted(const char* file, int line);
/* p .. p+bytes must lie in memory a kernel addresses: one cudaMalloc or
 * cudaMallocHost block, or this block's shared memory (static or dynamic);
 * otherwise fatal, naming api and its call site. */
void check_kernel_range(const char* api, const CallSite& where, const void* p, size_t bytes);
/* Racecheck (runtime/emu_racecheck.cpp): the running warp, all its lanes,
 * reads (or writes) `rows` runs of row_bytes bytes, stride_bytes apart, from
 * p: a WMMA load or store, which orders nothing between lanes. Checked for
 * hazards where it is shared memory, by initcheck where it is device memory. */
void race_warp_access(const void* p, size_t rows, size_t row_bytes, size_t stride_bytes, bool write, const CallSite& where);
/* Initcheck (runtime/emu_initcheck.cpp): stops the program if a byte of p .. p+n in device
 * memory was never written (a read by `api` at `where`, done by the emulator for the kernel). */
void init_read(const char* api, const CallSite& where, const void* p, size_t n);

template <typename T> static inline uint64_t to_bits(const T& v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "emu: warp shuffle of a type larger than 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T> static inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <typename T> static inline T shfl(int line, const char* file, WarpOp op, unsigned mask, T v, int arg, int width = 32) {
    return from_bits<T>(warp_op(line, file, op, mask, to_bits(v), arg, width));
}

/* ---- arguments of kernels ----
 * Converted to the parameter type as in a function call; an integer for a
 * pointer parameter must be the null pointer constant (NULL or 0). */
template <typename P, typename A> static inline P convert_arg(A&& a) {
    if constexpr (std::is_pointer<P>::value && std::is_integral<typename std::decay<A>::type>::value) {
        if (a != 0) fatal("kernel argument: integer %lld passed for a pointer parameter", (long long)a);
        return nullptr;
    } else {
        P r = std::forward<A>(a);
        return r;
    }
}
template <typename T> static inline void check_arg(const Site& site, int i, const T& v) {
    if constexpr (std::is_pointer<T>::value) check_kernel_pointer(site, i, (const void*)v);
    (void)site; (void)i; (void)v;
}

}  // namespace emu

/* ---- built-in variables (read-only) ---- */
#define threadIdx (static_cast<const uint3&>(emu::cur_thread_idx))
#define blockIdx (static_cast<const uint3&>(emu::cur_block_idx))
#define blockDim (static_cast<const dim3&>(emu::cur_block_dim))
#define gridDim (static_cast<const dim3&>(emu::cur_grid_dim))
static constexpr int warpSize = 32;

/* ---- synchronisation ---- */
#define __syncthreads() emu::syncthreads(__LINE__, __FILE__)
#define __syncwarp(...) ((void)emu::warp_op(__LINE__, __FILE__, emu::OP_SYNCWARP, emu_syncwarp_mask(__VA_ARGS__), 0, 0, 32))
static inline unsigned emu_syncwarp_mask(unsigned m = 0xffffffffu) { return m; }
#define __shfl_xor_sync(mask, v, ...) emu::shfl(__LINE__, __FILE__, emu::OP_SHFL_XOR, (mask), (v), __VA_ARGS__)
#define __shfl_down_sync(mask, v, ...) emu::shfl(__LINE__, __FILE__, emu::OP_SHFL_DOWN, (mask), (v), __VA_ARGS__)
#define __shfl_up_sync(mask, v, ...) emu::shfl(__LINE__, __FILE__, emu::OP_SHFL_UP, (mask), (v), __VA_ARGS__)
#define __shfl_sync(mask, v, ...) emu::shfl(__LINE__, __FILE__, emu::OP_SHFL_IDX, (mask), (v), __VA_ARGS__)
#define __ballot_sync(mask, pred) ((unsigned)emu::warp_op(__LINE__, __FILE__, emu::OP_BALLOT, (mask), (pred) ? 1u : 0u, 0, 32))
#define __any_sync(mask, pred) ((int)emu::warp_op(__LINE__, __FILE__, emu::OP_ANY, (mask), (pred) ? 1u : 0u, 0, 32))
#define __all_sync(mask, pred) ((int)emu::warp_op(__LINE__, __FILE__, emu::OP_ALL, (mask), (pred) ? 1u : 0u, 0, 32))
/* Memory fences: blocks run one at a time and threads switch only at
 * barriers and warp operations, so every write is visible at once. */
static inline void __threadfence(void) {}
static inline void __threadfence_block(void) {}

/* ---- checks inserted by transform.py ---- */
void emu_launch_bounds(long max_threads);
void emu_shared_use(void* p, size_t bytes);
void* emu_dynamic_shared(void);

/* ---- atomics: threads never run concurrently here, so plain read-modify-write ---- */
template <typename T> static inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T> static inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <typename T> static inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <typename T> static inline T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }
template <typename T> static inline T atomicMin(T* p, T v) { T old = *p; if (v < old) *p = v; return old; }
template <typename T> static inline T atomicOr(T* p, T v) { T old = *p; *p = old | v; return old; }
template <typename T> static inline T atomicAnd(T* p, T v) { T old = *p; *p = old & v; return old; }
template <typename T> static inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }

/* ---- integer and float intrinsics (IEEE semantics of the CUDA documentation) ---- */
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
/* The _rn operations are never contracted into an FMA; volatile keeps the host compiler from doing it. */
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frcp_rn(float a) { volatile float r = 1.0f / a; return r; }
/* Fast-math intrinsics: the GPU's are approximations; the emulator uses libm
 * (glibc itself declares __expf and __logf, as aliases of expf and logf), so
 * results differ from a GPU's in the last bits. */
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
/* sincospi: sin(pi x) and cos(pi x), x reduced by whole turns first (exact:
 * x - 2 rint(x/2)), then libm at pi times the rest: within about two ulps
 * where the GPU's is within about one (its reduction is exact too). */
static inline void sincospi(double x, double* s, double* c) {
    const double r = x - 2.0 * rint(0.5 * x);
    *s = sin(M_PI * r);
    *c = cos(M_PI * r);
}
static inline float __saturatef(float a) { return a != a ? 0.0f : a < 0.0f ? 0.0f : a > 1.0f ? 1.0f : a; }
static inline int __popc(unsigned int v) { return __builtin_popcount(v); }
static inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
static inline int __ffs(int v) { return __builtin_ffs(v); }
template <typename T> static inline T __ldg(const T* p) { return *p; }

/* CUDA's min/max overloads (device code calls them unqualified). */
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
static inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
static inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
static inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
static inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
static inline long min(long a, long b) { return a < b ? a : b; }
static inline long max(long a, long b) { return a > b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }

/* ---- kernel launch: what transform.py writes for kernel<<<grid, block, smem, stream>>>(args) ----
 * The arguments are converted to the kernel's parameter types at the launch
 * (as CUDA does), pointer arguments are checked, and the grid is queued on
 * the stream. */
template <typename... P, typename... A>
static inline void emu_launch(const emu::Site& site, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void (*kernel)(P...),
                              A&&... args) {
    static_assert(sizeof...(P) == sizeof...(A), "emu: kernel launched with the wrong number of arguments");
    emu::check_launch(site, (const void*)kernel, grid, block, smem, stream);
    std::tuple<typename std::decay<P>::type...> params(emu::convert_arg<typename std::decay<P>::type>(std::forward<A>(args))...);
    std::apply([&](const auto&... v) {
        int i = 0;
        (emu::check_arg(site, i++, v), ...);
    }, params);
    emu::Site s = site;
    uint64_t x_lo, x_hi;
    emu::block_window(&x_lo, &x_hi);
    std::string what;
    if (emu::stream_check_on()) what = std::string("kernel ") + site.kernel + " launched at " + site.file + ":" + std::to_string(site.line);
    emu::enqueue_named(stream, std::move(what), [s, grid, block, smem, kernel, params, x_lo, x_hi]() {
        emu::run_grid(s, grid, block, smem, [&kernel, &params]() { std::apply(kernel, params); }, x_lo, x_hi);
    });
}

#endif
