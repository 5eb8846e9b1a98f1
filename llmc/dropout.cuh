/*
 * Dropout at the embedding and residual sites, elementwise over the n
 * values of a (B,T,C) floatX tensor, flat. The masks come from llmc/dropout.h,
 * the functions the CPU reference calls: element e keeps draw e % 8 of the
 * site's Philox call e / 8, so one thread handles one call's eight elements
 * (one 16-byte vector of bf16/fp16, two of fp32; scalar accesses where a
 * pointer is not 16-byte aligned, and in a partial last group), and a GPU
 * drops exactly the elements the CPU does. No mask is stored: the forward,
 * every recompute and the backward call these kernels with the same site
 * and draw the same bits. Arithmetic in fp32, one rounding to floatX.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_DROPOUT_CUH
#define REMAT_DROPOUT_CUH

#include "cuda_common.cuh"
#include "dropout.h"

#define DROPOUT_THREADS 256
#define DROPOUT_GROUP 8 /* elements per generator call (dropout.h) */

/* Elements [lo, hi) of group g, the part of [8g, 8g + 8) inside [e0, e0 + n):
 * p points at element e0. Loaded as fp32 (slot k for element 8g + k). */
template <int VEC>
__device__ __forceinline__ void dropout_load_group(float* v, const floatX* p, size_t g, size_t e0, size_t n) {
    size_t lo = g * DROPOUT_GROUP, hi = lo + DROPOUT_GROUP;
    if (lo >= e0 && hi <= e0 + n) {
#pragma unroll
        for (int k = 0; k < DROPOUT_GROUP; k += VEC) {
            Vec<floatX, VEC> a = vload<VEC>(p + (lo - e0) + k);
#pragma unroll
            for (int j = 0; j < VEC; j++) v[k + j] = to_f32(a.v[j]);
        }
        return;
    }
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] = lo + k >= e0 && lo + k < e0 + n ? to_f32(p[lo + k - e0]) : 0.0f;
}

template <int VEC>
__device__ __forceinline__ void dropout_store_group(floatX* p, const float* v, size_t g, size_t e0, size_t n) {
    size_t lo = g * DROPOUT_GROUP, hi = lo + DROPOUT_GROUP;
    if (lo >= e0 && hi <= e0 + n) {
#pragma unroll
        for (int k = 0; k < DROPOUT_GROUP; k += VEC) {
            Vec<floatX, VEC> a;
#pragma unroll
            for (int j = 0; j < VEC; j++) a.v[j] = from_f32<floatX>(v[k + j]);
            vstore<VEC>(p + (lo - e0) + k, a);
        }
        return;
    }
    for (int k = 0; k < DROPOUT_GROUP; k++)
        if (lo + k >= e0 && lo + k < e0 + n) p[lo + k - e0] = from_f32<floatX>(v[k]);
}

/* v[k] with group g's mask: v * 1/keep where kept, else 0 (a select, so a
 * dropped inf does not become NaN). */
__device__ __forceinline__ void dropout_apply_group(float* v, const DropoutSite& s, size_t g) {
    uint32_t words[4];
    dropout_draws(&s, (uint64_t)g, words);
#pragma unroll
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] = dropout_keeps(&s, words, k) ? v[k] * s.scale : 0.0f;
}

/* dst = src dropped at site s (dst may be src): elements [e0, e0 + n) of the
 * tensor, dst and src pointing at element e0; one thread per group from e0 / 8. */
template <int VEC>
__global__ void dropout_mask_kernel(floatX* dst, const floatX* src, size_t e0, size_t n, DropoutSite s) {
    size_t g = e0 / DROPOUT_GROUP + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g * DROPOUT_GROUP >= e0 + n) return;
    float v[DROPOUT_GROUP];
    dropout_load_group<VEC>(v, src, g, e0, n);
    dropout_apply_group(v, s, g);
    dropout_store_group<VEC>(dst, v, g, e0, n);
}

/* out = (branch dropped at site s) + res: a residual add (out may be branch), elements as above. */
template <int VEC>
__global__ void dropout_residual_kernel(floatX* out, const floatX* branch, const floatX* res, size_t e0, size_t n, DropoutSite s) {
    size_t g = e0 / DROPOUT_GROUP + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g * DROPOUT_GROUP >= e0 + n) return;
    float v[DROPOUT_GROUP], r[DROPOUT_GROUP];
    dropout_load_group<VEC>(v, branch, g, e0, n);
    dropout_load_group<VEC>(r, res, g, e0, n);
    dropout_apply_group(v, s, g);
#pragma unroll
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] += r[k];
    dropout_store_group<VEC>(out, v, g, e0, n);
}

/* Groups touching elements [e0, e0 + n). */
static inline size_t dropout_groups(size_t e0, size_t n) { return ceil_div(e0 + n, DROPOUT_GROUP) - e0 / DROPOUT_GROUP; }

/* Rows [r0, r0 + rows) of C elements (element c of row r: r*C + c), dst and
 * src pointing at row r0. Vector width XVEC where every pointer is 16-byte
 * aligned and groups start on the rows' first element, else 1;
 * elementwise, so the width changes no bit. `lay`: whole sequences only
 * (interim, until the shared token layout). */
static inline void gpu_dropout_mask(floatX* dst, const floatX* src, size_t r0, size_t rows, int C, const void* lay, const DropoutSite* s,
                                    cudaStream_t stream) {
    (void)lay;
    size_t e0 = r0 * (size_t)C, n = rows * (size_t)C;
    unsigned int grid = grid_for(dropout_groups(e0, n), DROPOUT_THREADS);
    if (all_aligned16(dst, src) && e0 % DROPOUT_GROUP == 0) dropout_mask_kernel<XVEC><<<grid, DROPOUT_THREADS, 0, stream>>>(dst, src, e0, n, *s);
    else dropout_mask_kernel<1><<<grid, DROPOUT_THREADS, 0, stream>>>(dst, src, e0, n, *s);
    CUDA_CHECK_LAUNCH();
}

static inline void gpu_dropout_residual(floatX* out, const floatX* branch, const floatX* res, size_t r0, size_t rows, int C, const void* lay,
                                        const DropoutSite* s, cudaStream_t stream) {
    (void)lay;
    size_t e0 = r0 * (size_t)C, n = rows * (size_t)C;
    unsigned int grid = grid_for(dropout_groups(e0, n), DROPOUT_THREADS);
    if (all_aligned16(out, branch, res) && e0 % DROPOUT_GROUP == 0)
        dropout_residual_kernel<XVEC><<<grid, DROPOUT_THREADS, 0, stream>>>(out, branch, res, e0, n, *s);
    else dropout_residual_kernel<1><<<grid, DROPOUT_THREADS, 0, stream>>>(out, branch, res, e0, n, *s);
    CUDA_CHECK_LAUNCH();
}

#endif
