/*
 * selftest.cu: tests of remat's CPU emulator of CUDA itself (dev/emu).
 *
 * Why it exists: test_gpt under the emulator is only as good as the
 * emulator, so its pieces are checked here against independent references:
 * 16-bit conversions against the compiler's _Float16 and exact arithmetic;
 * shuffles, votes, barriers and index built-ins against their documented
 * definitions; the launch forms transform.py must rewrite (templates, 3rd
 * and 4th launch arguments, several lines, no arguments, a qualified name);
 * shared-memory poisoning, dynamic shared memory, deferred stream execution,
 * poisoned allocations; cuBLASLt matmuls against a double-precision
 * reference; WMMA (mma.h) loads, stores and mma_sync against a CPU product
 * for every layout, with fragments whose layout is scrambled (learnt through
 * loads of row and column numbers, as kernels may); the inline-PTX
 * instructions of emu/ptx.h (mma.sync m16n8k16, ldmatrix, cp.async) against
 * CuTe's statement of the SM80 fragment layouts (read from its MMA traits
 * and written here as shape:stride layouts, independently of emu/ptx.h's
 * ISA-worded tables) and a plain matrix product. With an argument it runs one case that must be refused
 * (tests check the message and a non-zero exit):
 *   emu_selftest                  every positive check; prints PASS
 *   emu_selftest fail:NAME        one misuse the emulator must stop (see FAILS below)
 * The launch in this comment must not be rewritten: k<<<1, 32>>>(x).
 */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cublasLt.h>
#include <mma.h>
#include "llmc/cuda/nvtx_regions.cuh" /* the trainer's NVTX calls, without a plan */
#include <emu/ptx.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

static int g_fail = 0;
#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);               \
            printf(__VA_ARGS__);                                      \
            printf("\n");                                             \
            g_fail++;                                                 \
        }                                                             \
    } while (0)
#define CK(call) CHECK((call) == cudaSuccess, "%s", #call)

static const char* LAUNCH_TEXT = "not a launch: k<<<1, 32>>>(x)";

/* ---------------------------------------------------------------- */
/* 16-bit types                                                       */

static uint16_t ref_half_bits(double d) { /* the compiler's conversion (libgcc, correctly rounded) */
    _Float16 h = (_Float16)d;
    uint16_t b;
    memcpy(&b, &h, 2);
    if ((b & 0x7fff) > 0x7c00) b = 0x7fff; /* NaN: CUDA's canonical NaN */
    return b;
}

/* float -> bf16 by exact comparison (no bit tricks): the nearer neighbour, ties to even */
static uint16_t ref_bf16_bits(float f) {
    if (f != f) return 0x7fff;
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(u >> 16); /* inf */
    double dl = fabs((double)f - (double)flo), dh = fabs((double)fhi - (double)f);
    if ((hi & 0x7fffffffu) == 0x7f800000u) /* hi is inf: compare with the value one ulp past the largest finite */
        dh = fabs(ldexp(1.0, 128) * (f < 0 ? -1 : 1) - (double)f);
    if (dl < dh || (dl == dh && !((lo >> 16) & 1))) return (uint16_t)(lo >> 16);
    return (uint16_t)(hi >> 16);
}

/* sincospi (RoPE's angles, llmc/cuda/rope.cuh) against sin and cos of pi x
 * in long double (64-bit mantissa, pi to match) of x less its whole turns
 * (fmodl, exact): within 8 units of the last double place, over half turns,
 * whole turns and a million turns. */
static void test_sincospi(void) {
    const long double pi = 3.14159265358979323846264338327950288L;
    const double xs[] = {0.0, 0.125, 0.25, 1.0 / 3.0, 0.5, -0.5, 0.75, -0.3, 1.0, 1.75, 2.5, -7.25, 12345.0625, 1048575.4375, -3.0e6 + 0.2};
    int bad = 0;
    for (size_t i = 0; i < sizeof(xs) / sizeof(xs[0]); i++) {
        double s, c;
        sincospi(xs[i], &s, &c);
        const long double r = fmodl((long double)xs[i], 2.0L), want_s = sinl(pi * r), want_c = cosl(pi * r);
        bad += fabsl((long double)s - want_s) > 8 * 0x1p-53L || fabsl((long double)c - want_c) > 8 * 0x1p-53L;
    }
    CHECK(bad == 0, "sincospi: %d of %zu wrong", bad, sizeof(xs) / sizeof(xs[0]));
}

static void test_half_types(void) {
    int bad = 0;
    /* every half converts to float and back unchanged; float value matches the compiler's */
    for (uint32_t b = 0; b < 65536; b++) {
        __half h = __ushort_as_half((unsigned short)b);
        float f = __half2float(h);
        _Float16 r;
        uint16_t rb = (uint16_t)b;
        memcpy(&r, &rb, 2);
        bool nan = (b & 0x7fff) > 0x7c00;
        if (nan ? !(f != f) : (f != (float)r)) bad++;
        if (!nan && __half_as_ushort(__float2half_rn(f)) != b) bad++;
    }
    CHECK(bad == 0, "half <-> float round trip: %d mismatches", bad);
    /* float -> half: every 97th float, plus every tie and its neighbours */
    bad = 0;
    for (uint64_t u = 0; u < (1ull << 32); u += 97) {
        uint32_t v = (uint32_t)u;
        float f;
        memcpy(&f, &v, 4);
        if (__half_as_ushort(__float2half_rn(f)) != ref_half_bits(f)) bad++;
    }
    for (uint32_t b = 0; b < 0x7c00; b++) {
        double lo = (double)__half2float(__ushort_as_half((unsigned short)b));
        double hi = b + 1 == 0x7c00 ? 65536.0 : (double)__half2float(__ushort_as_half((unsigned short)(b + 1)));
        double mid = (lo + hi) / 2;
        for (double d : {mid, nextafter(mid, 0.0), nextafter(mid, 1e9), -mid}) {
            if (__half_as_ushort(__float2half_rn((float)d)) != ref_half_bits((float)d)) bad++;
            if (__half_as_ushort(__double2half(d)) != ref_half_bits(d)) bad++;
        }
    }
    CHECK(bad == 0, "float/double -> half: %d mismatches with _Float16", bad);
    CHECK(__half_as_ushort(__float2half_rn(65519.0f)) == 0x7bff && __half_as_ushort(__float2half_rn(65520.0f)) == 0x7c00,
          "half overflow threshold");
    CHECK(__half_as_ushort(__float2half_rn(1e-8f)) == 0 && __half_as_ushort(__float2half_rn(6e-8f)) == 1, "half underflow");
    /* arithmetic: exact double result rounded once */
    bad = 0;
    uint32_t seed = 12345;
    for (int i = 0; i < 200000; i++) {
        seed = seed * 1664525u + 1013904223u;
        uint16_t ab = (uint16_t)(seed >> 16), bb = (uint16_t)seed;
        if ((ab & 0x7fff) >= 0x7c00 || (bb & 0x7fff) >= 0x7c00) continue;
        __half a = __ushort_as_half(ab), b = __ushort_as_half(bb);
        double x = __half2float(a), y = __half2float(b);
        if (__half_as_ushort(a + b) != ref_half_bits(x + y)) bad++;
        if (__half_as_ushort(a - b) != ref_half_bits(x - y)) bad++;
        if (__half_as_ushort(a * b) != ref_half_bits(x * y)) bad++;
        /* x/y is rounded in double first: innocuous, 53 >= 2*11+2 bits */
        if (y != 0 && __half_as_ushort(a / b) != ref_half_bits(x / y)) bad++;
        if ((a < b) != (x < y) || (a == b) != (x == y)) bad++;
    }
    CHECK(bad == 0, "half arithmetic: %d mismatches", bad);
    /* bf16 */
    bad = 0;
    for (uint64_t u = 0; u < (1ull << 32); u += 89) {
        uint32_t v = (uint32_t)u;
        float f;
        memcpy(&f, &v, 4);
        if (__bfloat16_as_ushort(__float2bfloat16_rn(f)) != ref_bf16_bits(f)) bad++;
    }
    for (uint32_t b = 0; b < 0x7f80; b++) { /* ties */
        uint32_t tie = (b << 16) | 0x8000u;
        float f;
        memcpy(&f, &tie, 4);
        if (__bfloat16_as_ushort(__float2bfloat16_rn(f)) != ref_bf16_bits(f)) bad++;
        if (__bfloat162float(__ushort_as_bfloat16((unsigned short)b)) != (float)__ushort_as_bfloat16((unsigned short)b)) bad++;
    }
    CHECK(bad == 0, "float -> bf16: %d mismatches", bad);
    __nv_bfloat16 one = __float2bfloat16_rn(1.0f), third = __float2bfloat16_rn(1.0f / 3.0f);
    CHECK(__bfloat16_as_ushort(one) == 0x3f80 && __bfloat16_as_ushort(third) == 0x3eab, "bf16 constants");
    CHECK(__bfloat16_as_ushort(__double2bfloat16(1.0 + 1.0 / 256 + 1e-12)) == 0x3f81, "double -> bf16 without double rounding");
    CHECK(__hisinf(__float2half_rn(-1e6f)) == -1 && __hisnan(__float2half_rn(NAN)), "half inf/nan tests");
}

/* ---------------------------------------------------------------- */
/* kernels: indexing, barriers, shuffles                              */

__global__ void index_kernel(int* out) {
    int bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int nthreads = blockDim.x * blockDim.y * blockDim.z;
    out[bid * nthreads + tid] = bid * 100000 + tid;
}

namespace ns {
template <typename T, int N> __global__ void fill_kernel(T* out, T v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = v + (T)i;
}
}  // namespace ns

__global__ void noarg_kernel() {}

/* block-wide sum through shared memory: every thread gets the total */
__global__ void __launch_bounds__(256) reduce_kernel(const float* in, float* out) {
    __shared__ float part[256];
    part[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = part[0];
}

__global__ void shuffle_kernel(int* out) {
    int lane = threadIdx.x & 31;
    int base = threadIdx.x * 8;
    out[base + 0] = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
    out[base + 1] = __shfl_down_sync(0xffffffffu, lane * 10, 3);
    out[base + 2] = __shfl_up_sync(0xffffffffu, lane * 10, 2);
    out[base + 3] = __shfl_sync(0xffffffffu, lane * 10, 7);
    out[base + 4] = __shfl_down_sync(0xffffffffu, lane * 10, 3, 8);
    out[base + 5] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
    out[base + 6] = __any_sync(0xffffffffu, lane == 17) + 2 * __all_sync(0xffffffffu, lane < 31);
    double d = __shfl_xor_sync(0xffffffffu, (double)lane + 0.5, 1);
    __half h = __shfl_xor_sync(0xffffffffu, __float2half_rn((float)lane), 2);
    out[base + 7] = (int)(d * 2) * 1000 + (int)__half2float(h);
}

__global__ void shared_poison_kernel(unsigned* out) {
    __shared__ float s[64];
    if (threadIdx.x == 0) s[0] = 1.0f; /* only s[0] written */
    __syncthreads();
    unsigned u;
    float v = s[threadIdx.x];
    memcpy(&u, &v, 4);
    out[blockIdx.x * 64 + threadIdx.x] = u;
}

__global__ void dynamic_shared_kernel(float* out) {
    extern __shared__ __align__(16) float dyn[];
    dyn[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = dyn[blockDim.x - 1 - threadIdx.x];
}

__global__ void atomic_kernel(int* counter, unsigned* mx) {
    atomicAdd(counter, 1);
    atomicMax(mx, (unsigned)(blockIdx.x * blockDim.x + threadIdx.x));
}

static void test_kernels(void) {
    /* indices over a 3D grid of 3D blocks */
    dim3 grid(3, 2, 2), block(4, 2, 4);
    int n = 12 * 32;
    int* d_idx;
    CK(cudaMalloc(&d_idx, n * sizeof(int)));
    index_kernel<<<grid, block>>>(d_idx);
    std::vector<int> h(n);
    CK(cudaMemcpy(h.data(), d_idx, n * sizeof(int), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < n; i++) bad += h[i] != (i / 32) * 100000 + i % 32;
    CHECK(bad == 0, "3D indices: %d wrong", bad);

    /* launch forms: qualified template, 3rd and 4th arguments, several lines, no arguments */
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    int* d_fill;
    CK(cudaMalloc(&d_fill, 100 * sizeof(int)));
    ns::fill_kernel<int, 100><<<(100 + 31) / 32, 32, 0, st>>>(d_fill, 7);
    ns::fill_kernel<int, (100 > 50 ? 60 : 10)><<<
        dim3(4), /* a comment, with a comma */ dim3(32),
        0>>>(d_fill, 1000);
    noarg_kernel<<<1, 32>>>();
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(h.data(), d_fill, 100 * sizeof(int), cudaMemcpyDeviceToHost));
    bad = 0;
    for (int i = 0; i < 100; i++) bad += h[i] != (i < 60 ? 1000 + i : 7 + i);
    CHECK(bad == 0, "templated launches: %d wrong", bad);
    CHECK(strstr(LAUNCH_TEXT, "<<<") != NULL, "string literal rewritten");

    /* barriers: tree reduction */
    int nb = 5;
    std::vector<float> in(nb * 256);
    for (int i = 0; i < nb * 256; i++) in[i] = (float)(i % 7);
    float *d_in, *d_out;
    CK(cudaMalloc(&d_in, in.size() * 4));
    CK(cudaMalloc(&d_out, in.size() * 4));
    CK(cudaMemcpy(d_in, in.data(), in.size() * 4, cudaMemcpyHostToDevice));
    reduce_kernel<<<nb, 256>>>(d_in, d_out);
    std::vector<float> out(in.size());
    CK(cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost));
    bad = 0;
    for (int b = 0; b < nb; b++) {
        float s = 0;
        for (int i = 0; i < 256; i++) s += in[b * 256 + i];
        for (int i = 0; i < 256; i++) bad += out[b * 256 + i] != s;
    }
    CHECK(bad == 0, "block reduction: %d wrong", bad);

    /* shuffles and votes, two warps */
    int* d_sh;
    CK(cudaMalloc(&d_sh, 64 * 8 * sizeof(int)));
    shuffle_kernel<<<1, 64>>>(d_sh);
    std::vector<int> sh(64 * 8);
    CK(cudaMemcpy(sh.data(), d_sh, sh.size() * sizeof(int), cudaMemcpyDeviceToHost));
    bad = 0;
    unsigned ballot = 0;
    for (int l = 0; l < 32; l++) ballot |= (l % 3 == 0 ? 1u : 0u) << l;
    for (int t = 0; t < 64; t++) {
        int l = t & 31, *o = &sh[t * 8];
        int seg = l & ~7;
        bad += o[0] != (l ^ 5) * 10;
        bad += o[1] != (l + 3 < 32 ? l + 3 : l) * 10;
        bad += o[2] != (l >= 2 ? l - 2 : l) * 10;
        bad += o[3] != 70;
        bad += o[4] != ((l - seg) + 3 < 8 ? l + 3 : l) * 10;
        bad += (unsigned)o[5] != ballot;
        bad += o[6] != 1;
        bad += o[7] != (2 * (l ^ 1) + 1) * 1000 + (l ^ 2);
    }
    CHECK(bad == 0, "shuffles/votes: %d wrong", bad);

    /* shared memory is NaN-poisoned before every block */
    unsigned* d_u;
    CK(cudaMalloc(&d_u, 2 * 64 * 4));
    shared_poison_kernel<<<2, 64>>>(d_u);
    std::vector<unsigned> u(128);
    CK(cudaMemcpy(u.data(), d_u, u.size() * 4, cudaMemcpyDeviceToHost));
    bad = 0;
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < 64; i++) bad += u[b * 64 + i] != (i == 0 ? 0x3f800000u : 0xffffffffu);
    CHECK(bad == 0, "shared memory poisoning: %d wrong", bad);

    /* dynamic shared memory */
    float* d_dyn;
    CK(cudaMalloc(&d_dyn, 96 * 4));
    dynamic_shared_kernel<<<1, 96, 96 * sizeof(float)>>>(d_dyn);
    CK(cudaMemcpy(out.data(), d_dyn, 96 * 4, cudaMemcpyDeviceToHost));
    bad = 0;
    for (int i = 0; i < 96; i++) bad += out[i] != (float)(95 - i);
    CHECK(bad == 0, "dynamic shared memory: %d wrong", bad);
    /* above 48 KiB once the kernel's limit is raised (fail:dyn_smem_limit: not without); 227 KiB at most */
    CHECK(cudaFuncSetAttribute(dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024) == cudaErrorInvalidValue,
          "cudaFuncSetAttribute accepted 228 KiB of dynamic shared memory");
    cudaGetLastError();
    CK(cudaFuncSetAttribute(dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
    dynamic_shared_kernel<<<1, 96, 100 * 1024>>>(d_dyn);
    CK(cudaMemcpy(out.data(), d_dyn, 96 * 4, cudaMemcpyDeviceToHost));
    bad = 0;
    for (int i = 0; i < 96; i++) bad += out[i] != (float)(95 - i);
    CHECK(bad == 0, "dynamic shared memory above 48 KiB: %d wrong", bad);

    /* atomics */
    int* d_cnt;
    unsigned* d_mx;
    CK(cudaMalloc(&d_cnt, 4));
    CK(cudaMalloc(&d_mx, 4));
    CK(cudaMemset(d_cnt, 0, 4));
    CK(cudaMemset(d_mx, 0, 4));
    atomic_kernel<<<7, 96>>>(d_cnt, d_mx);
    int cnt = 0;
    unsigned mx = 0;
    CK(cudaMemcpy(&cnt, d_cnt, 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&mx, d_mx, 4, cudaMemcpyDeviceToHost));
    CHECK(cnt == 7 * 96 && mx == 7 * 96 - 1, "atomics: %d %u", cnt, mx);

    /* fresh device memory is poisoned (0xff: NaN; read directly, as host and device share one address space here: a copy
     * of it would stop under initcheck); async copies complete at synchronisation */
    float* d_p;
    CK(cudaMalloc(&d_p, 16));
    uint32_t pb;
    memcpy(&pb, d_p, 4);
    CHECK(pb == 0xffffffffu, "fresh cudaMalloc memory not poisoned (0x%08x)", pb);
    float* pinned;
    CK(cudaMallocHost(&pinned, 16));
    pinned[0] = 5.0f;
    CK(cudaMemsetAsync(d_p, 0, 16, st));
    CK(cudaMemcpyAsync(pinned, d_p, 16, cudaMemcpyDeviceToHost, st));
    CHECK(pinned[0] == 5.0f, "an async copy to pinned memory ran before synchronisation");
    CK(cudaStreamSynchronize(st));
    CHECK(pinned[0] == 0.0f, "an async copy to pinned memory did not run at synchronisation (%g)", pinned[0]);
    /* a pageable source is staged at the call */
    float src = 3.0f;
    CK(cudaMemcpyAsync(d_p, &src, 4, cudaMemcpyHostToDevice, st));
    src = 4.0f;
    float back = 0;
    CK(cudaMemcpy(&back, d_p, 4, cudaMemcpyDeviceToHost));
    CHECK(back == 3.0f, "pageable H2D source not staged at the call (%g)", back);

    /* a strided copy: 3 rows of 8 bytes from a pitch of 12 floats to a pitch of 2 floats, in stream order */
    float *d_rows, *d_packed;
    CK(cudaMalloc(&d_rows, 3 * 12 * sizeof(float)));
    CK(cudaMalloc(&d_packed, 6 * sizeof(float)));
    float rows[36], packed[6];
    for (int i = 0; i < 36; i++) rows[i] = (float)i;
    CK(cudaMemcpy(d_rows, rows, sizeof(rows), cudaMemcpyHostToDevice));
    CK(cudaMemcpy2DAsync(d_packed, 2 * sizeof(float), d_rows + 5, 12 * sizeof(float), 2 * sizeof(float), 3, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemcpyAsync(packed, d_packed, sizeof(packed), cudaMemcpyDeviceToHost, st));
    int bad2d = 0;
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 2; c++) bad2d += packed[r * 2 + c] != (float)(r * 12 + 5 + c);
    CHECK(bad2d == 0, "cudaMemcpy2DAsync: %d of 6 values wrong", bad2d);
    CK(cudaFree(d_rows));
    CK(cudaFree(d_packed));

    int count = 0;
    CK(cudaGetDeviceCount(&count));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    CHECK(count == 1 && strstr(prop.name, "not a GPU"), "device %d '%s'", count, prop.name);
    for (void* p : {(void*)d_idx, (void*)d_fill, (void*)d_in, (void*)d_out, (void*)d_sh, (void*)d_u, (void*)d_dyn, (void*)d_cnt,
                    (void*)d_mx, (void*)d_p})
        CK(cudaFree(p));
    CK(cudaFreeHost(pinned));
    CK(cudaStreamDestroy(st));
}

/* ---------------------------------------------------------------- */
/* cuBLASLt                                                           */

struct MatmulCase {
    int m, n, k, transa, transb;
    cudaDataType type;
    bool bias;
    float beta;
};

static float to_float(const void* p, cudaDataType t, size_t i) {
    if (t == CUDA_R_32F) return ((const float*)p)[i];
    if (t == CUDA_R_16F) return __half2float(((const __half*)p)[i]);
    return __bfloat162float(((const __nv_bfloat16*)p)[i]);
}
static void from_float(void* p, cudaDataType t, size_t i, float v) {
    if (t == CUDA_R_32F) ((float*)p)[i] = v;
    else if (t == CUDA_R_16F) ((__half*)p)[i] = __float2half_rn(v);
    else ((__nv_bfloat16*)p)[i] = __float2bfloat16_rn(v);
}

/* Runs D = op(A) op(B) + beta C (+ bias) through cuBLASLt; returns D as floats. */
static std::vector<float> lt_run(cublasLtHandle_t lt, const MatmulCase& c, const std::vector<float>& A, const std::vector<float>& B,
                                 const std::vector<float>& C, const std::vector<float>& bias, int lda, int ldb, int ldd,
                                 uint32_t min_align_a = 256) {
    size_t es = c.type == CUDA_R_32F ? 4 : 2;
    int ar = c.transa ? c.k : c.m, ac = c.transa ? c.m : c.k, br = c.transb ? c.n : c.k, bc = c.transb ? c.k : c.n;
    std::vector<char> hA(A.size() * es), hB(B.size() * es), hC(C.size() * es), hb(bias.size() * es);
    for (size_t i = 0; i < A.size(); i++) from_float(hA.data(), c.type, i, A[i]);
    for (size_t i = 0; i < B.size(); i++) from_float(hB.data(), c.type, i, B[i]);
    for (size_t i = 0; i < C.size(); i++) from_float(hC.data(), c.type, i, C[i]);
    for (size_t i = 0; i < bias.size(); i++) from_float(hb.data(), c.type, i, bias[i]);
    void *dA, *dB, *dD, *db;
    CK(cudaMalloc(&dA, hA.size()));
    CK(cudaMalloc(&dB, hB.size()));
    CK(cudaMalloc(&dD, hC.size()));
    CK(cudaMalloc(&db, hb.size() ? hb.size() : 4));
    CK(cudaMemcpy(dA, hA.data(), hA.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, hB.data(), hB.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dD, hC.data(), hC.size(), cudaMemcpyHostToDevice));
    if (hb.size()) CK(cudaMemcpy(db, hb.data(), hb.size(), cudaMemcpyHostToDevice));
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasOperation_t ta = c.transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = c.transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (c.bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &db, sizeof(db));
    }
    cublasLtMatrixLayoutCreate(&la, c.type, ar, ac, lda);
    cublasLtMatrixLayoutCreate(&lb, c.type, br, bc, ldb);
    cublasLtMatrixLayoutCreate(&ld, c.type, c.m, c.n, ldd);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &min_align_a, sizeof(min_align_a));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &res, &found) == CUBLAS_STATUS_SUCCESS && found == 1,
          "heuristic");
    float alpha = 1.0f;
    CHECK(cublasLtMatmul(lt, desc, &alpha, dA, la, dB, lb, &c.beta, dD, ld, dD, ld, &res.algo, NULL, 0, 0) == CUBLAS_STATUS_SUCCESS,
          "matmul");
    CK(cudaMemcpy(hC.data(), dD, hC.size(), cudaMemcpyDeviceToHost));
    std::vector<float> D(C.size());
    for (size_t i = 0; i < D.size(); i++) D[i] = to_float(hC.data(), c.type, i);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    for (void* p : {dA, dB, dD, db}) CK(cudaFree(p));
    return D;
}

/* The summation order follows the algorithm: one problem run with
 * algorithms found for different alignments gives different bits (as on a
 * GPU, where they are different kernels), each one the same bits every time. */
static void test_cublaslt_orders(cublasLtHandle_t lt) {
    const MatmulCase c = {24, 4, 200, 0, 0, CUDA_R_32F, false, 0.0f};
    uint32_t seed = 5;
    std::vector<float> A(24 * 200), B(200 * 4), C(24 * 4, 0.0f), bias;
    for (auto* v : {&A, &B})
        for (float& x : *v) { seed = seed * 1664525u + 1013904223u; x = ((seed >> 8) & 0xffff) / 32768.0f - 1.0f; }
    std::vector<std::vector<float>> results;
    for (uint32_t align = 4; align <= 256; align *= 2) {
        std::vector<float> D = lt_run(lt, c, A, B, C, bias, 24, 200, 24, align);
        std::vector<float> again = lt_run(lt, c, A, B, C, bias, 24, 200, 24, align);
        CHECK(memcmp(D.data(), again.data(), D.size() * 4) == 0, "one algorithm (alignment %u) gave different bits twice", align);
        results.push_back(D);
    }
    int distinct = 0;
    for (size_t i = 0; i < results.size(); i++) {
        bool seen = false;
        for (size_t j = 0; j < i; j++) seen |= memcmp(results[i].data(), results[j].data(), results[i].size() * 4) == 0;
        distinct += !seen;
    }
    CHECK(distinct >= 3, "%d distinct results from %zu algorithms: the summation order does not follow the algorithm", distinct,
          results.size());
}

static void test_cublaslt(void) {
    cublasLtHandle_t lt;
    CHECK(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS, "cublasLtCreate");
    test_cublaslt_orders(lt);
    const MatmulCase cases[] = {
        {5, 7, 3, 0, 0, CUDA_R_32F, false, 0.0f},  {17, 9, 33, 1, 0, CUDA_R_32F, true, 0.0f},
        {16, 12, 40, 0, 1, CUDA_R_32F, false, 1.0f}, {8, 20, 64, 1, 1, CUDA_R_16BF, true, 1.0f},
        {33, 6, 19, 1, 0, CUDA_R_16F, true, 1.0f},  {12, 12, 12, 0, 0, CUDA_R_16F, false, 0.5f},
    };
    uint32_t seed = 99;
    auto rnd = [&seed]() { seed = seed * 1664525u + 1013904223u; return ((seed >> 8) & 0xffff) / 32768.0f - 1.0f; };
    for (const MatmulCase& c : cases) {
        int ar = c.transa ? c.k : c.m, ac = c.transa ? c.m : c.k, br = c.transb ? c.n : c.k, bc = c.transb ? c.k : c.n;
        int lda = ar + 3, ldb = br + 1, ldd = c.m + 2; /* leading dimensions larger than the rows */
        std::vector<float> A((size_t)lda * ac), B((size_t)ldb * bc), C((size_t)ldd * c.n), bias(c.bias ? c.m : 0);
        for (auto* v : {&A, &B, &C, &bias})
            for (float& x : *v) x = c.type == CUDA_R_32F ? rnd() : (c.type == CUDA_R_16F ? __half2float(__float2half_rn(rnd()))
                                                                                           : __bfloat162float(__float2bfloat16_rn(rnd())));
        std::vector<float> D = lt_run(lt, c, A, B, C, bias, lda, ldb, ldd);
        std::vector<float> D2 = lt_run(lt, c, A, B, C, bias, lda, ldb, ldd);
        CHECK(memcmp(D.data(), D2.data(), D.size() * 4) == 0, "matmul not deterministic");
        double worst = 0;
        int pad_changed = 0;
        for (int j = 0; j < c.n; j++)
            for (int i = 0; i < c.m + 2; i++) {
                if (i >= c.m) { pad_changed += memcmp(&D[i + (size_t)j * ldd], &C[i + (size_t)j * ldd], 4) != 0; continue; }
                double acc = 0;
                for (int p = 0; p < c.k; p++) {
                    double a = c.transa ? A[p + (size_t)i * lda] : A[i + (size_t)p * lda];
                    double b = c.transb ? B[j + (size_t)p * ldb] : B[p + (size_t)j * ldb];
                    acc += a * b;
                }
                acc += c.beta * C[i + (size_t)j * ldd] + (c.bias ? bias[i] : 0);
                double tol = c.type == CUDA_R_32F ? 1e-5 * (c.k + 2) : c.type == CUDA_R_16F ? 2e-3 * 4 : 1e-2 * 4;
                worst = fmax(worst, fabs(D[i + (size_t)j * ldd] - acc) / tol);
            }
        CHECK(worst <= 1.0 && pad_changed == 0, "matmul m=%d n=%d k=%d ta=%d tb=%d type %d: error %.2f of tolerance, %d padding changed",
              c.m, c.n, c.k, c.transa, c.transb, (int)c.type, worst, pad_changed);
    }
    cublasLtDestroy(lt);
}

/* ---------------------------------------------------------------- */
/* WMMA (mma.h)                                                        */

namespace wmma = nvcuda::wmma;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragAcc;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> FragABf16;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> FragBBf16;

static uint32_t g_wseed = 4242;
static float wrand(void) {
    g_wseed = g_wseed * 1664525u + 1013904223u;
    return ((g_wseed >> 8) & 0xffff) / 32768.0f - 1.0f;
}

template <typename T> static T* to_device(const std::vector<T>& h) {
    T* d;
    CK(cudaMalloc(&d, h.size() * sizeof(T)));
    CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
template <typename T> static std::vector<T> from_device(const T* d, size_t n) {
    std::vector<T> h(n);
    CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}
/* offset of element (r, c) of a matrix stored with stride ld */
static size_t at(bool col_major, int r, int c, int ld) { return col_major ? (size_t)c * ld + r : (size_t)r * ld + c; }

/* One warp: D = A B + C on 16x16 tiles; A and B (strides lda, ldb, layouts
 * LA, LB) go through shared memory, C and D (stride ldc) are global. */
template <typename T, typename LA, typename LB>
__global__ void wmma_tile_kernel(const T* A, const T* B, const float* C, float* D, int lda, int ldb, int ldc, int c_col, int d_col) {
    __shared__ __align__(32) T sA[16 * 32];
    __shared__ __align__(32) T sB[16 * 32];
    for (int i = threadIdx.x; i < 16 * lda; i += 32) sA[i] = A[i];
    for (int i = threadIdx.x; i < 16 * ldb; i += 32) sB[i] = B[i];
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> b;
    FragAcc acc;
    wmma::load_matrix_sync(a, sA, lda);
    wmma::load_matrix_sync(b, sB, ldb);
    wmma::load_matrix_sync(acc, C, ldc, c_col ? wmma::mem_col_major : wmma::mem_row_major);
    wmma::mma_sync(acc, a, b, acc);
    wmma::store_matrix_sync(D, acc, ldc, d_col ? wmma::mem_col_major : wmma::mem_row_major);
}

/* |got - want| within float rounding of a sum of `mag` (the sum of the terms' magnitudes) */
static bool close(float got, double want, double mag) { return fabs(got - want) <= 1e-5 * mag + 1e-30; }

/* wmma_tile_kernel against a double-precision product; strides above 16 with
 * NaN padding (a load reading outside the tile shows) and D's padding must
 * keep the NaN bytes written before (a store writing outside the tile shows). */
template <typename T, typename LA, typename LB> static void wmma_tile_case(const char* tname, bool c_col, bool d_col) {
    const bool a_col = std::is_same<LA, wmma::col_major>::value, b_col = std::is_same<LB, wmma::col_major>::value;
    const int lda = 24, ldb = 32, ldc = 20;
    std::vector<T> A(16 * lda, T(NAN)), B(16 * ldb, T(NAN));
    std::vector<float> C(16 * ldc, NAN);
    double a[16][16], b[16][16], c[16][16];
    for (int r = 0; r < 16; r++)
        for (int k = 0; k < 16; k++) {
            A[at(a_col, r, k, lda)] = T(wrand());
            a[r][k] = (float)A[at(a_col, r, k, lda)];
            B[at(b_col, r, k, ldb)] = T(wrand());
            b[r][k] = (float)B[at(b_col, r, k, ldb)];
            c[r][k] = C[at(c_col, r, k, ldc)] = wrand();
        }
    T *dA = to_device(A), *dB = to_device(B);
    float *dC = to_device(C), *dD = to_device(std::vector<float>(C.size(), NAN));
    const float nan = NAN;
    uint32_t nan_bits;
    memcpy(&nan_bits, &nan, 4);
    wmma_tile_kernel<T, LA, LB><<<1, 32>>>(dA, dB, dC, dD, lda, ldb, ldc, c_col, d_col);
    std::vector<float> D = from_device(dD, C.size());
    int bad = 0;
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 16; n++) {
            double want = c[r][n], mag = fabs(c[r][n]);
            for (int k = 0; k < 16; k++) {
                want += a[r][k] * b[k][n];
                mag += fabs(a[r][k] * b[k][n]);
            }
            bad += !close(D[at(d_col, r, n, ldc)], want, mag);
        }
    for (size_t i = 0; i < D.size(); i++) {
        uint32_t u;
        memcpy(&u, &D[i], 4);
        bad += (int)(i % ldc) >= 16 && u != nan_bits;
    }
    CHECK(bad == 0, "wmma 16x16x16 %s, A %s, B %s, C %s, D %s: %d wrong", tname, a_col ? "col" : "row", b_col ? "col" : "row",
          c_col ? "col" : "row", d_col ? "col" : "row", bad);
    for (void* p : {(void*)dA, (void*)dB, (void*)dC, (void*)dD}) CK(cudaFree(p));
}

template <typename T> static void wmma_tile_cases(const char* tname) {
    for (int layouts = 0; layouts < 2; layouts++) { /* C row-major and D column-major, then the other way round */
        wmma_tile_case<T, wmma::row_major, wmma::row_major>(tname, layouts, !layouts);
        wmma_tile_case<T, wmma::row_major, wmma::col_major>(tname, layouts, !layouts);
        wmma_tile_case<T, wmma::col_major, wmma::row_major>(tname, layouts, !layouts);
        wmma_tile_case<T, wmma::col_major, wmma::col_major>(tname, layouts, !layouts);
    }
}

/* What kernels may learn of the layout: loading a matrix of row numbers into
 * an accumulator fragment gives the row of each x[i] of every accumulator
 * fragment (and of column numbers, read column-major, the column). Records
 * where[slot] (the element each accumulator slot holds), where_a and where_b
 * (the same for matrix_a and matrix_b, through loads of element numbers);
 * D = P / 2 stored (a uniform operation on x[]), E = P / 2 + 1000 row written
 * lane by lane through the learnt layout (P = A B). */
__global__ void wmma_layout_kernel(const __nv_bfloat16* A, const __nv_bfloat16* B, const __nv_bfloat16* index, int* where,
                                   int* where_a, int* where_b, float* D, float* E) {
    __shared__ __align__(32) float rownum[16 * 16];
    const int lane = threadIdx.x;
    for (int i = lane; i < 256; i += 32) rownum[i] = (float)(i / 16);
    __syncwarp();
    FragAcc rows, cols, acc;
    wmma::load_matrix_sync(rows, rownum, 16, wmma::mem_row_major);
    wmma::load_matrix_sync(cols, rownum, 16, wmma::mem_col_major); /* (r, c) read from rownum[c * 16 + r]: c */
    FragABf16 a, ia;
    FragBBf16 b, ib;
    wmma::load_matrix_sync(ia, index, 16);
    wmma::load_matrix_sync(ib, index, 16); /* column-major: (k, n) holds n * 16 + k */
    wmma::load_matrix_sync(a, A, 16);
    wmma::load_matrix_sync(b, B, 16);
    wmma::fill_fragment(acc, 0.0f);
    wmma::mma_sync(acc, a, b, acc);
    for (int i = 0; i < acc.num_elements; i++) acc.x[i] *= 0.5f;
    wmma::store_matrix_sync(D, acc, 16, wmma::mem_row_major);
    for (int i = 0; i < acc.num_elements; i++) {
        int r = (int)rows.x[i], c = (int)cols.x[i];
        where[lane * acc.num_elements + i] = r * 16 + c;
        E[r * 16 + c] = acc.x[i] + 1000.0f * r;
        where_a[lane * ia.num_elements + i] = (int)(float)ia.x[i];
        int nk = (int)(float)ib.x[i];
        where_b[lane * ib.num_elements + i] = (nk % 16) * 16 + nk / 16;
    }
}

/* D (16x16, column-major) = A (16x64, row-major) B (64x16, row-major) in
 * four mma_sync steps into one accumulator (d is c). */
__global__ void wmma_accumulate_kernel(const __half* A, const __half* B, float* D) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < 4; k++) {
        wmma::load_matrix_sync(a, A + 16 * k, 64);
        wmma::load_matrix_sync(b, B + 16 * 16 * k, 16);
        wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(D, acc, 16, wmma::mem_col_major);
}

/* D (32x32, row-major) = A (32x32, row-major) B (32x32, column-major) as 2x2
 * tiles, one warp a tile, two k steps each; the tiles meet in dynamic shared
 * memory. */
__global__ void wmma_32x32_kernel(const __nv_bfloat16* A, const __nv_bfloat16* B, float* D) {
    extern __shared__ float out_tiles[];
    const int warp = threadIdx.x / 32, tm = warp / 2, tn = warp % 2;
    FragABf16 a;
    FragBBf16 b;
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < 2; k++) {
        wmma::load_matrix_sync(a, A + tm * 16 * 32 + k * 16, 32);
        wmma::load_matrix_sync(b, B + tn * 16 * 32 + k * 16, 32);
        wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(out_tiles + tm * 16 * 32 + tn * 16, acc, 32, wmma::mem_row_major);
    __syncthreads();
    for (int i = threadIdx.x; i < 32 * 32; i += blockDim.x) D[i] = out_tiles[i];
}

/* slots (of 256) where two layouts agree */
static int same_slots(const int* x, const std::vector<int>& y) {
    int n = 0;
    for (int s = 0; s < 256; s++) n += x[s] == y[s];
    return n;
}

static void test_wmma(void) {
    wmma_tile_cases<__nv_bfloat16>("bf16");
    wmma_tile_cases<__half>("half");

    /* the layout: scrambled, different for A, B and the accumulator, and learnable */
    std::vector<__nv_bfloat16> A(256), B(256), index(256);
    for (int i = 0; i < 256; i++) {
        A[i] = __float2bfloat16_rn(wrand());
        B[i] = __float2bfloat16_rn(wrand());
        index[i] = __float2bfloat16_rn((float)i);
    }
    __nv_bfloat16 *dA = to_device(A), *dB = to_device(B), *dI = to_device(index);
    int *dW, *dWa, *dWb;
    float *dD, *dE;
    for (int** p : {&dW, &dWa, &dWb}) CK(cudaMalloc(p, 256 * sizeof(int)));
    for (float** p : {&dD, &dE}) CK(cudaMalloc(p, 256 * sizeof(float)));
    wmma_layout_kernel<<<1, 32>>>(dA, dB, dI, dW, dWa, dWb, dD, dE);
    std::vector<int> where = from_device(dW, 256), where_a = from_device(dWa, 256), where_b = from_device(dWb, 256);
    std::vector<float> D = from_device(dD, 256), E = from_device(dE, 256);
    int row_major[256], col_major[256], mma_sync_layout[256]; /* the last: sm_80 mma.m16n8k16's accumulator, two n halves */
    for (int s = 0; s < 256; s++) {
        int lane = s / 8, i = s % 8;
        row_major[s] = s;
        col_major[s] = (s % 16) * 16 + s / 16;
        mma_sync_layout[s] = (lane / 4 + 8 * ((i / 2) % 2)) * 16 + (lane % 4) * 2 + i % 2 + 8 * (i / 4);
    }
    for (const std::vector<int>* w : {&where, &where_a, &where_b}) {
        std::vector<int> seen(256, 0);
        for (int e : *w) seen[e >= 0 && e < 256 ? e : 0]++;
        CHECK(std::count(seen.begin(), seen.end(), 1) == 256, "a fragment's slots do not hold every tile element once");
        CHECK(same_slots(row_major, *w) < 8 && same_slots(col_major, *w) < 8 && same_slots(mma_sync_layout, *w) < 8,
              "fragment layout not scrambled: %d, %d, %d slots as row-major, column-major, mma.sync", same_slots(row_major, *w),
              same_slots(col_major, *w), same_slots(mma_sync_layout, *w));
    }
    CHECK(same_slots(where.data(), where_a) < 8 && same_slots(where.data(), where_b) < 8 && same_slots(where_a.data(), where_b) < 8,
          "matrix_a, matrix_b and accumulator share a layout");
    int bad = 0;
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 16; n++) {
            double p = 0, mag = 0;
            for (int k = 0; k < 16; k++) {
                p += (double)(float)A[r * 16 + k] * (float)B[n * 16 + k];
                mag += fabs((double)(float)A[r * 16 + k] * (float)B[n * 16 + k]);
            }
            bad += !close(D[r * 16 + n], p / 2, mag) + !close(E[r * 16 + n], p / 2 + 1000.0 * r, mag + 1000.0 * r);
        }
    CHECK(bad == 0, "wmma fragment x[] by the learnt layout: %d wrong", bad);
    for (void* p : {(void*)dA, (void*)dB, (void*)dI, (void*)dW, (void*)dWa, (void*)dWb, (void*)dD, (void*)dE}) CK(cudaFree(p));

    /* accumulation over K = 64 in four steps (half) */
    std::vector<__half> hA(16 * 64), hB(64 * 16);
    for (auto& v : hA) v = __float2half_rn(wrand());
    for (auto& v : hB) v = __float2half_rn(wrand());
    __half *dhA = to_device(hA), *dhB = to_device(hB);
    CK(cudaMalloc(&dD, 256 * sizeof(float)));
    wmma_accumulate_kernel<<<1, 32>>>(dhA, dhB, dD);
    D = from_device(dD, 256);
    bad = 0;
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 16; n++) {
            double p = 0, mag = 0;
            for (int k = 0; k < 64; k++) {
                p += (double)(float)hA[r * 64 + k] * (float)hB[k * 16 + n];
                mag += fabs((double)(float)hA[r * 64 + k] * (float)hB[k * 16 + n]);
            }
            bad += !close(D[n * 16 + r], p, mag);
        }
    CHECK(bad == 0, "wmma accumulation over four mma_sync: %d wrong", bad);
    for (void* p : {(void*)dhA, (void*)dhB, (void*)dD}) CK(cudaFree(p));

    /* 32x32 from 2x2 tiles, four warps */
    std::vector<__nv_bfloat16> A32(32 * 32), B32(32 * 32);
    for (auto& v : A32) v = __float2bfloat16_rn(wrand());
    for (auto& v : B32) v = __float2bfloat16_rn(wrand());
    dA = to_device(A32);
    dB = to_device(B32);
    CK(cudaMalloc(&dD, 32 * 32 * sizeof(float)));
    wmma_32x32_kernel<<<1, 128, 32 * 32 * sizeof(float)>>>(dA, dB, dD);
    D = from_device(dD, 32 * 32);
    bad = 0;
    for (int r = 0; r < 32; r++)
        for (int n = 0; n < 32; n++) {
            double p = 0, mag = 0;
            for (int k = 0; k < 32; k++) {
                p += (double)(float)A32[r * 32 + k] * (float)B32[n * 32 + k];
                mag += fabs((double)(float)A32[r * 32 + k] * (float)B32[n * 32 + k]);
            }
            bad += !close(D[r * 32 + n], p, mag);
        }
    CHECK(bad == 0, "wmma 32x32 product from 2x2 tiles: %d wrong", bad);
    for (void* p : {(void*)dA, (void*)dB, (void*)dD}) CK(cudaFree(p));
}

/* The racy patterns of race_kernel and race_wmma_kernel (below) with their
 * barriers: racecheck must let them run. d: 64 + 256 floats. */
__global__ void race_free_kernel(float* d) {
    __shared__ float s[64];
    __shared__ __align__(32) float tile[256];
    const int t = threadIdx.x, lane = t & 31;
    s[t] = (float)t;
    __syncthreads();
    float across = s[(t + 32) % 64];
    __syncthreads();
    s[t] = 1.0f;
    __syncwarp();
    float v = s[t ^ 1];
    __syncwarp();
    s[t] = v + across;
    __syncwarp();
    d[t] = s[t ^ 1];
    if (t < 32) { /* warp 0: lanes fill a tile, WMMA loads it, stores it back, lanes read it */
        for (int i = lane; i < 256; i += 32) tile[i] = (float)i;
        __syncwarp();
        FragAcc c;
        wmma::load_matrix_sync(c, tile, 16, wmma::mem_row_major);
        for (int i = 0; i < c.num_elements; i++) c.x[i] += 1.0f;
        __syncwarp(); /* the load's reads before the store's writes */
        wmma::store_matrix_sync(tile, c, 16, wmma::mem_row_major);
        __syncwarp();
        for (int i = lane; i < 256; i += 32) d[64 + i] = tile[i];
    }
}

static void test_race_free(void) {
    float* d;
    CK(cudaMalloc(&d, (64 + 256) * sizeof(float)));
    race_free_kernel<<<1, 64>>>(d);
    std::vector<float> h(64 + 256);
    CK(cudaMemcpy(h.data(), d, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int t = 0; t < 64; t++) bad += h[t] != 1.0f + (float)(((t ^ 1) + 32) % 64); /* s[t^1] = 1 + what t^1 read across */
    for (int i = 0; i < 256; i++) bad += h[64 + i] != (float)i + 1.0f;
    CHECK(bad == 0, "race-free shared-memory patterns: %d wrong", bad);
    CK(cudaFree(d));
}

/* ---------------------------------------------------------------- */
/* misuse the emulator must stop                                       */

__global__ void divergent_barrier_kernel(float* x) {
    if (threadIdx.x < 16) return;
    __syncthreads();
    x[threadIdx.x] = 1;
}
__global__ void two_barriers_kernel(float* x) {
    if (threadIdx.x & 1) {
        __syncthreads();
    } else {
        x[threadIdx.x] = 0;
        __syncthreads();
    }
}
__global__ void divergent_shuffle_kernel(float* x) {
    float v = 1;
    if (threadIdx.x % 32 < 20) v = __shfl_xor_sync(0xffffffffu, v, 1);
    x[threadIdx.x] = v;
}
__global__ void partial_mask_kernel(float* x) { x[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, 1.0f, 1); }
__global__ void __launch_bounds__(64) bounded_kernel(float* x) { x[threadIdx.x] = 0; }
__global__ void write_kernel(float* x, int n) { x[n + threadIdx.x] = 1.0f; }
/* a 16-byte load from an address 4 bytes past a 16-byte boundary: "misaligned address" on a GPU */
__global__ void misaligned_vector_kernel(float* x) { x[0] = reinterpret_cast<const float4*>(x + 1)->y; }
__device__ __noinline__ int deep(int depth) {
    volatile char buf[4096];
    buf[0] = (char)depth;
    return depth > 0 ? deep(depth - 1) + buf[0] : 0;
}
__global__ void deep_kernel(float* x, int depth) { x[threadIdx.x] = (float)deep(depth); }
/* WMMA misuse; d: 1000 floats of device memory */
__global__ void wmma_misuse_kernel(float* d, int mode) {
    const int lane = threadIdx.x;
    __nv_bfloat16* h = (__nv_bfloat16*)d;
    FragABf16 a;
    FragBBf16 b;
    FragAcc c;
    wmma::fill_fragment(a, 1.0f);
    wmma::fill_fragment(b, 1.0f);
    wmma::fill_fragment(c, 0.0f);
    if (mode == 0) wmma::load_matrix_sync(a, h + 4, 16); /* 8 bytes past a 32-byte boundary */
    if (mode == 1) wmma::load_matrix_sync(a, h, 12);
    if (mode == 2 && lane >= 16) wmma::mma_sync(c, a, b, c);
    if (mode == 3) wmma::load_matrix_sync(a, h + (lane == 5 ? 16 : 0), 16);
    if (mode == 4) {
        __align__(32) float local[256] = {0};
        wmma::load_matrix_sync(c, local, 16, wmma::mem_row_major);
    }
    if (mode == 5) wmma::store_matrix_sync(d + 1000 - 248, c, 16, wmma::mem_row_major); /* 32 bytes past the end */
    if (mode == 7) wmma::load_matrix_sync(a, h + 16 * 16, 16); /* from device memory nothing wrote (initcheck) */
    if (mode == 6) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> ha;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> hb;
        wmma::fill_fragment(ha, 1.0f);
        wmma::fill_fragment(hb, 1.0f);
        if (lane == 3) ha.x[5] = 2.0f; /* one copy of an element changed */
        wmma::mma_sync(c, ha, hb, c);
    }
}

/* Racy toy kernels: each misses one barrier (racecheck must name the hazard). */
__global__ void race_kernel(float* d, int mode) {
    __shared__ float s[64];
    const int t = threadIdx.x, lane = t & 31;
    if (mode == 0) { /* across warps: no __syncthreads between a write and another warp's read */
        s[t] = (float)t;
        d[t] = s[(t + 32) % 64];
    } else if (mode == 1) { /* inside a warp: lane^1 reads s[lane] in the epoch it is rewritten */
        s[t] = 1.0f;
        __syncwarp();
        float v = s[t ^ 1];
        s[t] = v + 1.0f;
        d[t] = v;
    } else if (mode == 2) { /* WAW: threads 0 and 32 write s[0] in one epoch */
        if (lane == 0) s[0] = (float)t;
        __syncthreads();
        d[t] = s[0];
    } else if (mode == 3) { /* a shuffle is no memory fence */
        s[t] = (float)t;
        float v = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
        d[t] = s[t ^ 1] + v;
    }
}
/* WMMA store to shared memory, then a lane reads what another lane stored (mode 0) or
 * lanes write a tile the WMMA load then reads (mode 1), without __syncwarp. */
__global__ void race_wmma_kernel(float* d, int mode) {
    __shared__ __align__(32) float tile[256];
    const int lane = threadIdx.x;
    FragAcc c;
    wmma::fill_fragment(c, 2.0f);
    if (mode == 0) {
        wmma::store_matrix_sync(tile, c, 16, wmma::mem_row_major);
        d[lane] = tile[lane];
    } else {
        for (int i = lane; i < 256; i += 32) tile[i] = 1.0f;
        wmma::load_matrix_sync(c, tile, 16, wmma::mem_row_major);
        wmma::store_matrix_sync(d, c, 16, wmma::mem_row_major);
    }
}
/* d[i] for i = n: one element past a 100-float region (memcheck) */
__global__ void region_kernel(float* d, int n, int write) {
    if (write) d[n] = 1.0f;
    else d[0] = d[n];
}

/* Registers a, b (100 floats each, 400 bytes apart) as NVTX regions of the block d. */
static void register_regions(float* d) {
    nvtx_plan_domain = nvtxDomainCreateA("selftest");
    nvtx_plan_heap = nvtx_register_heap(nvtx_plan_domain, d, 1000 * sizeof(float), "selftest heap");
    nvtx_register_region(nvtx_plan_domain, nvtx_plan_heap, d, 100 * sizeof(float), "buffer_a");
    nvtx_register_region(nvtx_plan_domain, nvtx_plan_heap, d + 200, 100 * sizeof(float), "buffer_b");
}

/* A region registered anew (as the trainer renews its dead buffers before
 * each forward pass) holds NaN bytes again, not what was written before
 * (read directly: a copy of it stops under initcheck, as fail:renewed_read
 * shows). */
static void test_region_renewal(void) {
    float* d;
    CK(cudaMalloc(&d, 1000 * sizeof(float)));
    register_regions(d);
    CK(cudaMemset(d, 0, 100 * sizeof(float)));
    nvtx_unregister_region(nvtx_plan_domain, d);
    nvtx_register_region(nvtx_plan_domain, nvtx_plan_heap, d, 100 * sizeof(float), "buffer_a");
    std::vector<unsigned char> h(100 * sizeof(float));
    memcpy(h.data(), d, h.size());
    CHECK(std::count(h.begin(), h.end(), 0xff) == (long)h.size(), "a renewed region is not NaN-poisoned");
    CK(cudaFree(d));
}

/* ---------------------------------------------------------------- */
/* inline PTX (emu/ptx.h)                                             */

/* CuTe's (thread, value) -> linear index layouts of SM80_16x8x16_F32{BF16,F16}
 * (MMA_Traits): thread t = t0 + 4 t1 (t0 < 4, t1 < 8), value v = v0 + 2 v1 (+ 4 v2).
 *   A: ((4,8),(2,2,2)) : ((32,1),(16,8,128)), index m + 16 k of the 16x16 A
 *   B: ((4,8),(2,2))   : ((16,1),(8,64)),     index n + 8 k of the 16x8 B
 *   C: ((4,8),(2,2))   : ((32,1),(16,8)),     index m + 16 n of the 16x8 C */
static int cute_a(int t, int v) { return 32 * (t % 4) + (t / 4) + 16 * (v % 2) + 8 * ((v / 2) % 2) + 128 * (v / 4); }
static int cute_b(int t, int v) { return 16 * (t % 4) + (t / 4) + 8 * (v % 2) + 64 * (v / 2); }
static int cute_c(int t, int v) { return 32 * (t % 4) + (t / 4) + 16 * (v % 2) + 8 * (v / 2); }

static uint16_t bits16(float f, bool bf16) { return bf16 ? emu::float_to_bf16_bits(f) : emu::double_to_half_bits(f); }

/* A (16x16 row-major), B (16x8 row-major, k x n) as 16-bit bits; D (16x8 row-major) = A B + C (C[m][n] = m - n) */
__global__ void ptx_mma_cute_kernel(const uint16_t* A, const uint16_t* B, float* D, int bf16) {
    const int t = threadIdx.x;
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float c[4], d[4];
    for (int v = 0; v < 8; v++) {
        int e = cute_a(t, v), m = e % 16, k = e / 16;
        a[v / 2] |= (uint32_t)A[m * 16 + k] << (16 * (v % 2));
    }
    for (int v = 0; v < 4; v++) {
        int e = cute_b(t, v), n = e % 8, k = e / 8;
        b[v / 2] |= (uint32_t)B[k * 8 + n] << (16 * (v % 2));
    }
    for (int v = 0; v < 4; v++) {
        int e = cute_c(t, v), m = e % 16, n = e / 16;
        c[v] = (float)(m - n);
    }
    emu::ptx::mma(d, a, b, c, bf16 != 0, emu::CallSite{__LINE__, __FILE__});
    for (int v = 0; v < 4; v++) {
        int e = cute_c(t, v), m = e % 16, n = e / 16;
        D[m * 8 + n] = d[v];
    }
}

/* ldmatrix of four 8x8 matrices of their own element numbers (matrix j, row r, column c: 256 j + 16 r + c)
 * at a padded stride of 24: out[(num, trans, lane, reg)] */
template <int NUM, bool TRANS> __device__ void ptx_ldm_case(const uint16_t* sm, uint32_t* out) {
    const int l = threadIdx.x;
    uint32_t r[4] = {0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu};
    const uint16_t* row = l < 8 * NUM ? sm + (l / 8) * 8 * 24 + (l % 8) * 24 : (const uint16_t*)1; /* unread lanes: any address */
    emu::ptx::ldmatrix(r, row, NUM, TRANS, emu::CallSite{__LINE__, __FILE__});
    for (int j = 0; j < 4; j++) out[l * 4 + j] = r[j];
}

__global__ void ptx_ldmatrix_kernel(uint32_t* out) {
    __shared__ __align__(16) uint16_t sm[32 * 24];
    for (int i = threadIdx.x; i < 32 * 24; i += 32) {
        int j = i / (8 * 24), r = (i / 24) % 8, c = i % 24;
        sm[i] = c < 8 ? (uint16_t)(256 * j + 16 * r + c) : 0xffff;
    }
    __syncthreads();
    ptx_ldm_case<1, false>(sm, out + 0 * 128);
    ptx_ldm_case<2, false>(sm, out + 1 * 128);
    ptx_ldm_case<4, false>(sm, out + 2 * 128);
    ptx_ldm_case<1, true>(sm, out + 3 * 128);
    ptx_ldm_case<2, true>(sm, out + 4 * 128);
    ptx_ldm_case<4, true>(sm, out + 5 * 128);
}

/* rows x cols 16-bit elements from src (stride cols) into dst (stride ld) by 16-byte cp.async, lane l's share */
__device__ void ptx_copy_rows(uint16_t* dst, const uint16_t* src, int rows, int cols, int ld, int l) {
    for (int i = l; i < rows * cols / 8; i += 32) {
        int r = i / (cols / 8), c = (i % (cols / 8)) * 8;
        emu::ptx::cp_async(dst + r * ld + c, src + r * cols + c, emu::CallSite{__LINE__, __FILE__});
    }
}

/* The kernels' path: A (16x16) and B^T (8x16, n x k) staged in shared memory by cp.async, A by ldmatrix.x4,
 * B by ldmatrix.x2 from B^T and by ldmatrix.x2.trans from B (16x8, k x n); D twice (16x8 row-major each). */
__global__ void ptx_ldmatrix_mma_kernel(const uint16_t* A, const uint16_t* Bt, const uint16_t* B, float* D, int bf16) {
    __shared__ __align__(16) uint16_t sa[16 * 24], sbt[8 * 24], sb[16 * 16];
    const int l = threadIdx.x;
    ptx_copy_rows(sa, A, 16, 16, 24, l);
    ptx_copy_rows(sbt, Bt, 8, 16, 24, l);
    ptx_copy_rows(sb, B, 16, 8, 16, l);
    emu::ptx::commit_group();
    emu::ptx::wait_group(0, emu::CallSite{__LINE__, __FILE__});
    __syncthreads();
    uint32_t a[4], b[2], b2[2];
    const emu::CallSite w{__LINE__, __FILE__};
    emu::ptx::ldmatrix(a, sa + ((l / 8) % 2 * 8 + l % 8) * 24 + (l / 16) * 8, 4, false, w);
    emu::ptx::ldmatrix(b, sbt + (l % 8) * 24 + ((l / 8) % 2) * 8, 2, false, w);
    emu::ptx::ldmatrix(b2, sb + ((l / 8) % 2 * 8 + l % 8) * 16, 2, true, w);
    float c[4] = {0, 0, 0, 0}, d[4], d2[4];
    emu::ptx::mma(d, a, b, c, bf16 != 0, w);
    emu::ptx::mma(d2, a, b2, c, bf16 != 0, w);
    for (int v = 0; v < 4; v++) {
        int e = cute_c(l, v), m = e % 16, n = e / 16;
        D[m * 8 + n] = d[v];
        D[128 + m * 8 + n] = d2[v];
    }
}

/* cp.async: out[0..3] = the shared word before any wait, after wait_group 1 (of two groups), after wait_group 0 */
__global__ void ptx_cp_async_kernel(const uint32_t* src, uint32_t* out) {
    __shared__ __align__(16) uint32_t s1[4 * 32], s2[4 * 32];
    const int l = threadIdx.x;
    s1[4 * l] = s2[4 * l] = 7;
    const emu::CallSite w{__LINE__, __FILE__};
    emu::ptx::cp_async(s1 + 4 * l, src + 4 * l, w);
    emu::ptx::commit_group();
    emu::ptx::cp_async(s2 + 4 * l, src + 128 + 4 * l, w);
    emu::ptx::commit_group();
    out[4 * l] = s1[4 * l] + 1000 * s2[4 * l];
    emu::ptx::wait_group(1, w);
    out[4 * l + 1] = s1[4 * l] + 1000 * s2[4 * l];
    emu::ptx::wait_group(0, w);
    out[4 * l + 2] = s1[4 * l] + 1000 * s2[4 * l];
    out[4 * l + 3] = s2[4 * l + 3];
}

static void test_ptx(void) {
    for (int bf16 = 0; bf16 < 2; bf16++) {
        std::vector<uint16_t> A(256), B(128), Bt(128);
        std::vector<float> Af(256), Bf(128);
        for (int i = 0; i < 256; i++) { A[i] = bits16(wrand(), bf16); Af[i] = emu::ptx::b16_to_float(A[i], bf16); }
        for (int k = 0; k < 16; k++)
            for (int n = 0; n < 8; n++) {
                uint16_t v = bits16(wrand(), bf16);
                B[k * 8 + n] = Bt[n * 16 + k] = v;
                Bf[k * 8 + n] = emu::ptx::b16_to_float(v, bf16);
            }
        uint16_t *dA = to_device(A), *dB = to_device(B), *dBt = to_device(Bt);
        float* dD;
        CK(cudaMalloc(&dD, 256 * sizeof(float)));
        ptx_mma_cute_kernel<<<1, 32>>>(dA, dB, dD, bf16);
        std::vector<float> D = from_device(dD, 128);
        ptx_ldmatrix_mma_kernel<<<1, 32>>>(dA, dBt, dB, dD, bf16);
        std::vector<float> D2 = from_device(dD, 256);
        int bad = 0, bad2 = 0;
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 8; n++) {
                double p = 0, mag = 0;
                for (int k = 0; k < 16; k++) {
                    p += (double)Af[m * 16 + k] * Bf[k * 8 + n];
                    mag += fabs((double)Af[m * 16 + k] * Bf[k * 8 + n]);
                }
                bad += !close(D[m * 8 + n], p + (m - n), mag + 16);
                bad2 += !close(D2[m * 8 + n], p, mag) + !close(D2[128 + m * 8 + n], p, mag);
            }
        CHECK(bad == 0, "mma.sync m16n8k16 %s with CuTe's fragment layouts: %d of 128 wrong", bf16 ? "bf16" : "f16", bad);
        CHECK(bad2 == 0, "cp.async + ldmatrix + mma.sync %s against a plain product: %d of 256 wrong", bf16 ? "bf16" : "f16", bad2);
        for (void* p : {(void*)dA, (void*)dB, (void*)dBt, (void*)dD}) CK(cudaFree(p));
    }

    /* ldmatrix: word w of row r of matrix j goes to register j of lane 4 r + w (columns 2w, 2w+1);
     * .trans: the same of the transposed matrix; lanes past 8 num give no address, registers past num are untouched */
    uint32_t* dO;
    CK(cudaMalloc(&dO, 6 * 128 * sizeof(uint32_t)));
    ptx_ldmatrix_kernel<<<1, 32>>>(dO);
    std::vector<uint32_t> O = from_device(dO, 6 * 128);
    int bad = 0;
    for (int cs = 0; cs < 6; cs++) {
        const int num = cs % 3 == 0 ? 1 : cs % 3 == 1 ? 2 : 4;
        const bool trans = cs >= 3;
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 8; r++)
                for (int w = 0; w < 4; w++) {
                    uint32_t got = O[cs * 128 + (4 * r + w) * 4 + j];
                    auto el = [&](int row, int col) { return (uint32_t)(256 * j + 16 * (trans ? col : row) + (trans ? row : col)); };
                    uint32_t want = j < num ? el(r, 2 * w) | el(r, 2 * w + 1) << 16 : 0xdeadbeefu;
                    bad += got != want;
                }
    }
    CHECK(bad == 0, "ldmatrix x1/x2/x4 (.trans): %d of %d registers wrong", bad, 6 * 128);
    CK(cudaFree(dO));

    /* cp.async lands at the wait for its group, not before */
    std::vector<uint32_t> src(256);
    for (int i = 0; i < 256; i++) src[i] = 1 + i;
    uint32_t *dS = to_device(src), *dR;
    CK(cudaMalloc(&dR, 128 * sizeof(uint32_t)));
    ptx_cp_async_kernel<<<1, 32>>>(dS, dR);
    std::vector<uint32_t> R = from_device(dR, 128);
    bad = 0;
    for (int l = 0; l < 32; l++) {
        bad += R[4 * l] != 7 + 1000 * 7;
        bad += R[4 * l + 1] != src[4 * l] + 1000 * 7;
        bad += R[4 * l + 2] != src[4 * l] + 1000 * src[128 + 4 * l];
        bad += R[4 * l + 3] != src[128 + 4 * l + 3];
    }
    CHECK(bad == 0, "cp.async commit/wait_group: %d of 128 words wrong", bad);
    for (void* p : {(void*)dS, (void*)dR}) CK(cudaFree(p));
}

/* Misuse the PTX emulation must stop: mode 0 ldmatrix row misaligned, 1 a lane skips mma,
 * 2 cp.async never waited for (the next block's thread finds its copies pending) */
__global__ void ptx_misuse_kernel(float* d, int mode) {
    __shared__ __align__(16) uint16_t sm[32 * 8];
    const int l = threadIdx.x;
    const emu::CallSite w{__LINE__, __FILE__};
    uint32_t r[4] = {0, 0, 0, 0};
    float c[4] = {0, 0, 0, 0};
    if (mode == 0) emu::ptx::ldmatrix(r, sm + (l % 8) * 16 + (l == 3 ? 4 : 0), 1, false, w);
    else if (mode == 1) { if (l < 16) emu::ptx::mma(c, r, r, c, true, w); }
    else emu::ptx::cp_async(sm + l * 8, d, w); /* 16 bytes per lane, none shared (that would be a race) */
}

/* Streams (streamcheck): work ordered by an event wait, by the legacy default
 * stream's implicit synchronisation with a blocking stream, and by the host,
 * runs without a hazard and gives the values in stream order; the unordered
 * forms are fail:stream_* below. */
__global__ void add_one_kernel(float* d, int n) {
    if (threadIdx.x < (unsigned)n) d[threadIdx.x] += 1.0f;
}

static void test_streams(void) {
    float* d;
    CK(cudaMalloc(&d, 64 * sizeof(float)));
    cudaStream_t side, blocking;
    cudaEvent_t e;
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&blocking, cudaStreamDefault));
    CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CK(cudaMemsetAsync(d, 0, 64 * sizeof(float), side));
    add_one_kernel<<<1, 64, 0, side>>>(d, 64);           /* 1 */
    CK(cudaEventRecord(e, side));
    CK(cudaStreamWaitEvent(0, e, 0));
    add_one_kernel<<<1, 64>>>(d, 64);                    /* 2: after the side stream's work (event) */
    add_one_kernel<<<1, 64, 0, blocking>>>(d, 64);       /* 3: after the default stream's (implicit) */
    add_one_kernel<<<1, 64>>>(d, 64);                    /* 4: after the blocking stream's (implicit) */
    CK(cudaStreamSynchronize(0));
    add_one_kernel<<<1, 64, 0, side>>>(d, 64);           /* 5: after the host saw the default stream done */
    float h[64];
    CK(cudaMemcpyAsync(h, d, sizeof(h), cudaMemcpyDeviceToHost, side));
    int bad = 0;
    for (int i = 0; i < 64; i++) bad += h[i] != 5.0f;
    CHECK(bad == 0, "streams: %d of 64 values are not 5 after five ordered additions on three streams", bad);
    CK(cudaEventDestroy(e));
    CK(cudaStreamDestroy(side));
    CK(cudaStreamDestroy(blocking));
    CK(cudaFree(d));
}

static int run_fail(const char* name) {
    float* d;
    CK(cudaMalloc(&d, 1000 * sizeof(float)));
    std::string n = name;
    if (n == "divergent_barrier") divergent_barrier_kernel<<<1, 64>>>(d);
    else if (n == "two_barriers") two_barriers_kernel<<<1, 64>>>(d);
    else if (n == "divergent_shuffle") divergent_shuffle_kernel<<<1, 32>>>(d);
    else if (n == "partial_mask") partial_mask_kernel<<<1, 32>>>(d);
    else if (n == "launch_bounds") bounded_kernel<<<1, 128>>>(d);
    else if (n == "bad_block") bounded_kernel<<<1, 2048>>>(d);
    else if (n == "dyn_smem_limit") dynamic_shared_kernel<<<1, 96, 64 * 1024>>>(d);
    else if (n == "host_pointer") { static float h[64]; bounded_kernel<<<1, 64>>>(h); }
    else if (n == "write_past_end") write_kernel<<<1, 1>>>(d, 1000);          /* into the slack: canary */
    else if (n == "misaligned_vector") misaligned_vector_kernel<<<1, 1>>>(d);
    else if (n == "guard_page") write_kernel<<<1, 1>>>(d, 1024 + 5);         /* 4116 bytes in: the guard page after the block, SIGSEGV */
    else if (n == "use_after_free") { CK(cudaFree(d)); float x; cudaMemcpy(&x, d, 4, cudaMemcpyDeviceToHost); }
    else if (n == "memcpy_past_end") { std::vector<float> h(1001); cudaMemcpy(h.data(), d, 1001 * 4, cudaMemcpyDeviceToHost); }
    else if (n == "memcpy_wrong_kind") { std::vector<float> h(10); cudaMemcpy(d, h.data(), 40, cudaMemcpyDeviceToHost); }
    else if (n == "stack_overflow") deep_kernel<<<1, 32>>>(d, 1000);
    else if (n == "race_across_warps") race_kernel<<<1, 64>>>(d, 0);
    else if (n == "race_in_warp") race_kernel<<<1, 64>>>(d, 1);
    else if (n == "race_same_address") race_kernel<<<1, 64>>>(d, 2);
    else if (n == "race_shuffle_no_fence") race_kernel<<<1, 64>>>(d, 3);
    else if (n == "race_wmma_store") race_wmma_kernel<<<1, 32>>>(d, 0);
    else if (n == "race_wmma_load") race_wmma_kernel<<<1, 32>>>(d, 1);
    else if (n == "region_write") { register_regions(d); region_kernel<<<1, 1>>>(d, 100, 1); }
    else if (n == "region_read") { register_regions(d); region_kernel<<<1, 1>>>(d + 200, 100, 0); }
    else if (n == "region_memset") { register_regions(d); cudaMemset(d + 50, 0, 51 * sizeof(float)); }
    else if (n.rfind("stream_", 0) == 0) {
        cudaStream_t side;
        cudaEvent_t e;
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        cudaEventCreate(&e);
        cudaMemsetAsync(d, 0, 1000 * sizeof(float), side);
        if (n == "stream_no_wait") region_kernel<<<1, 1>>>(d, 5, 0); /* reads what the side stream's memset writes */
        else if (n == "stream_stale_record") {
            cudaEventRecord(e, side);
            region_kernel<<<1, 1, 0, side>>>(d, 5, 1); /* after the record: the wait below does not cover it */
            cudaStreamWaitEvent(0, e, 0);
            region_kernel<<<1, 1>>>(d, 5, 0);
        } else if (n == "stream_write_after_read") {
            cudaStreamSynchronize(side);
            region_kernel<<<1, 1, 0, side>>>(d, 5, 0); /* reads d[5] */
            cudaMemsetAsync(d + 5, 0, 4, 0);            /* the default stream overwrites it, unordered */
        } else {
            fprintf(stderr, "unknown failure case %s\n", name);
            return 2;
        }
    }
    else if (n == "ptx_ldmatrix_misaligned") ptx_misuse_kernel<<<1, 32>>>(d, 0);
    else if (n == "ptx_mma_divergent") ptx_misuse_kernel<<<1, 32>>>(d, 1);
    else if (n == "ptx_cp_async_never_waited") { cudaMemset(d, 0, 32 * 16); ptx_misuse_kernel<<<2, 32>>>(d, 2); }
    else if (n == "ptx_cp_async_uninit") ptx_misuse_kernel<<<1, 32>>>(d, 2); /* copies from device memory nothing wrote */
    /* initcheck: reads of device memory nothing wrote since it was allocated, or since its NVTX region was renewed */
    else if (n == "uninit_read") region_kernel<<<1, 1>>>(d, 5, 0);
    else if (n == "renewed_read") {
        register_regions(d);
        cudaMemset(d, 0, 100 * sizeof(float));
        nvtx_unregister_region(nvtx_plan_domain, d);
        nvtx_register_region(nvtx_plan_domain, nvtx_plan_heap, d, 100 * sizeof(float), "buffer_a");
        region_kernel<<<1, 1>>>(d, 7, 0);
    } else if (n == "memcpy_uninit") {
        float h[8];
        cudaMemset(d, 0, 7 * sizeof(float));
        cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
    }
    else if (n.rfind("wmma_", 0) == 0) {
        const char* modes[] = {"wmma_misaligned", "wmma_bad_ldm", "wmma_divergent", "wmma_args_differ", "wmma_local_memory",
                               "wmma_past_end", "wmma_half_copies", "wmma_uninit"};
        int mode = (int)(std::find(modes, modes + 8, n) - modes);
        if (mode == 8) {
            fprintf(stderr, "unknown failure case %s\n", name);
            return 2;
        }
        wmma_misuse_kernel<<<1, 32>>>(d, mode);
    }
    else if (n == "lt_epilogue") {
        cublasLtMatmulDesc_t desc;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_GELU;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    } else if (n == "lt_tf32") {
        cublasLtMatmulDesc_t desc;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F);
    } else if (n == "lt_workspace_unaligned" || n == "lt_workspace_small") {
        /* the library refuses with a status, not a crash: the case stops itself on CUBLAS_STATUS_INVALID_VALUE
         * (lt_workspace_small runs under EMU_LT_WORKSPACE=1024, with 512 bytes) */
        cublasLtHandle_t lt;
        cublasLtCreate(&lt);
        cublasLtMatmulDesc_t desc;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        cublasLtMatrixLayout_t l8;
        cublasLtMatrixLayoutCreate(&l8, CUDA_R_32F, 8, 8, 8);
        cublasLtMatmulPreference_t pref;
        cublasLtMatmulPreferenceCreate(&pref);
        uint64_t ws_max = 4096;
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_max, sizeof(ws_max));
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        if (cublasLtMatmulAlgoGetHeuristic(lt, desc, l8, l8, l8, l8, pref, 1, &res, &found) != CUBLAS_STATUS_SUCCESS || found != 1) {
            printf("NO ALGORITHM: %s\n", name);
            return 0;
        }
        float one = 1, zero = 0;
        cudaMemset(d, 0, 192 * sizeof(float));
        const bool small = n == "lt_workspace_small";
        cublasStatus_t st = cublasLtMatmul(lt, desc, &one, d, l8, d + 64, l8, &zero, d + 128, l8, d + 128, l8, &res.algo,
                                           small ? (void*)(d + 256) : (void*)(d + 257), small ? 512 : 1024, 0);
        cudaDeviceSynchronize();
        if (st == CUBLAS_STATUS_INVALID_VALUE) return 1;
    } else if (n == "lt_algo_mismatch" || n == "lt_alignment" || n == "lt_uninit") {
        cublasLtHandle_t lt;
        cublasLtCreate(&lt);
        cublasLtMatmulDesc_t desc;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        cublasLtMatrixLayout_t l8, l4;
        cublasLtMatrixLayoutCreate(&l8, CUDA_R_32F, 8, 8, 8);
        cublasLtMatrixLayoutCreate(&l4, CUDA_R_32F, 4, 4, 4);
        cublasLtMatmulPreference_t pref;
        cublasLtMatmulPreferenceCreate(&pref);
        cublasLtMatmulHeuristicResult_t res;
        int found;
        cublasLtMatmulAlgoGetHeuristic(lt, desc, l8, l8, l8, l8, pref, 1, &res, &found);
        float one = 1, zero = 0;
        if (n == "lt_algo_mismatch") cublasLtMatmul(lt, desc, &one, d, l4, d + 16, l4, &zero, d + 32, l4, d + 32, l4, &res.algo, NULL, 0, 0);
        else if (n == "lt_uninit") { /* A written, B's last column not (initcheck) */
            cudaMemset(d, 0, (64 + 56) * sizeof(float));
            cublasLtMatmul(lt, desc, &one, d, l8, d + 64, l8, &zero, d + 128, l8, d + 128, l8, &res.algo, NULL, 0, 0);
        }
        else cublasLtMatmul(lt, desc, &one, d + 1, l8, d + 128, l8, &zero, d + 256, l8, d + 256, l8, &res.algo, NULL, 0, 0);
    } else {
        fprintf(stderr, "unknown failure case %s\n", name);
        return 2;
    }
    cudaDeviceSynchronize();
    printf("NOT STOPPED: %s\n", name);
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 2 && strncmp(argv[1], "fail:", 5) == 0) return run_fail(argv[1] + 5);
    test_half_types();
    test_sincospi();
    test_kernels();
    test_race_free();
    test_region_renewal();
    test_cublaslt();
    test_wmma();
    test_ptx();
    test_streams();
    if (g_fail) {
        printf("emu selftest: %d check%s FAILED\n", g_fail, g_fail == 1 ? "" : "s");
        return 1;
    }
    printf("emu selftest: PASS\n");
    return 0;
}
