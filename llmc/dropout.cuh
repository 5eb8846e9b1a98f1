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

/* Group g's elements [8g, 8g + 8) of p, as fp32 (fewer at the end of n). */
template <int VEC>
__device__ __forceinline__ void dropout_load_group(float* v, const floatX* p, size_t e0, size_t n) {
    if (e0 + DROPOUT_GROUP <= n) {
#pragma unroll
        for (int k = 0; k < DROPOUT_GROUP; k += VEC) {
            Vec<floatX, VEC> a = vload<VEC>(p + e0 + k);
#pragma unroll
            for (int j = 0; j < VEC; j++) v[k + j] = to_f32(a.v[j]);
        }
        return;
    }
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] = e0 + k < n ? to_f32(p[e0 + k]) : 0.0f;
}

template <int VEC>
__device__ __forceinline__ void dropout_store_group(floatX* p, const float* v, size_t e0, size_t n) {
    if (e0 + DROPOUT_GROUP <= n) {
#pragma unroll
        for (int k = 0; k < DROPOUT_GROUP; k += VEC) {
            Vec<floatX, VEC> a;
#pragma unroll
            for (int j = 0; j < VEC; j++) a.v[j] = from_f32<floatX>(v[k + j]);
            vstore<VEC>(p + e0 + k, a);
        }
        return;
    }
    for (int k = 0; e0 + k < n; k++) p[e0 + k] = from_f32<floatX>(v[k]);
}

/* v[k] with group g's mask: v * 1/keep where kept, else 0 (a select, so a
 * dropped inf does not become NaN). */
__device__ __forceinline__ void dropout_apply_group(float* v, const DropoutSite& s, size_t g) {
    uint32_t words[4];
    dropout_draws(&s, (uint64_t)g, words);
#pragma unroll
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] = dropout_keeps(&s, words, k) ? v[k] * s.scale : 0.0f;
}

/* dst = src dropped at site s (dst may be src). */
template <int VEC>
__global__ void dropout_mask_kernel(floatX* dst, const floatX* src, size_t n, DropoutSite s) {
    size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x, e0 = g * DROPOUT_GROUP;
    if (e0 >= n) return;
    float v[DROPOUT_GROUP];
    dropout_load_group<VEC>(v, src, e0, n);
    dropout_apply_group(v, s, g);
    dropout_store_group<VEC>(dst, v, e0, n);
}

/* out = (branch dropped at site s) + res: a residual add (out may be branch). */
template <int VEC>
__global__ void dropout_residual_kernel(floatX* out, const floatX* branch, const floatX* res, size_t n, DropoutSite s) {
    size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x, e0 = g * DROPOUT_GROUP;
    if (e0 >= n) return;
    float v[DROPOUT_GROUP], r[DROPOUT_GROUP];
    dropout_load_group<VEC>(v, branch, e0, n);
    dropout_load_group<VEC>(r, res, e0, n);
    dropout_apply_group(v, s, g);
#pragma unroll
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] += r[k];
    dropout_store_group<VEC>(out, v, e0, n);
}

/* Vector width XVEC where every pointer is 16-byte aligned (the plan aligns
 * its buffers to 256 bytes), else 1; elementwise, so the width changes no bit. */
static inline void gpu_dropout_mask(floatX* dst, const floatX* src, size_t n, const DropoutSite* s, cudaStream_t stream) {
    unsigned int grid = grid_for(ceil_div(n, DROPOUT_GROUP), DROPOUT_THREADS);
    if (all_aligned16(dst, src)) dropout_mask_kernel<XVEC><<<grid, DROPOUT_THREADS, 0, stream>>>(dst, src, n, *s);
    else dropout_mask_kernel<1><<<grid, DROPOUT_THREADS, 0, stream>>>(dst, src, n, *s);
    CUDA_CHECK_LAUNCH();
}

static inline void gpu_dropout_residual(floatX* out, const floatX* branch, const floatX* res, size_t n, const DropoutSite* s,
                                        cudaStream_t stream) {
    unsigned int grid = grid_for(ceil_div(n, DROPOUT_GROUP), DROPOUT_THREADS);
    if (all_aligned16(out, branch, res)) dropout_residual_kernel<XVEC><<<grid, DROPOUT_THREADS, 0, stream>>>(out, branch, res, n, *s);
    else dropout_residual_kernel<1><<<grid, DROPOUT_THREADS, 0, stream>>>(out, branch, res, n, *s);
    CUDA_CHECK_LAUNCH();
}

#endif
