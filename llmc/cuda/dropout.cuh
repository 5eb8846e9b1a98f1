/*
 * Dropout at the embedding and residual sites, elementwise over rows of a
 * (B,T,C) floatX tensor: rows [r0, r0+rows) of the local batch, laid out by
 * a TokenLayout (token_layout.h). Element c of local row r is element
 * e = (row0 + token_global_row(r)) * C + c of the whole batch (row0: the
 * site's global row of this rank's first sequence), the numbering the CPU
 * reference's dropout_rows uses, so a token tile, or a rank holding
 * some chunks of a sequence (context parallelism), draws the bits one
 * process holding everything draws. The masks come from llmc/core/dropout.h:
 * element e keeps draw e % 8 of the site's Philox call e / 8, so one thread
 * handles the elements of one call that fall in one stretch of contiguous
 * local elements (a whole row range without context parallelism, else one
 * row): eight, as one 16-byte vector of bf16/fp16 (two of fp32) where the
 * pointers allow it, fewer at the stretch's ends, scalar there. No mask is
 * stored: the forward, every recompute and the backward call these kernels
 * with the same site and draw the same bits. Arithmetic in fp32, one
 * rounding to floatX.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_DROPOUT_CUH
#define REMAT_DROPOUT_CUH

#include "cuda_common.cuh"
#include "../core/dropout.h"
#include "../core/token_layout.h"

#define DROPOUT_THREADS 256
#define DROPOUT_GROUP 8 /* elements per generator call (dropout.h) */

/* The elements one thread handles: draws [k0, k1) of generator call g,
 * which are local elements i0 .. i0 + k1 - k0 - 1 of the tensor. */
struct DropoutSpan {
    uint64_t g;
    int k0, k1;
    size_t i0;
};

/* Generator calls a stretch of C elements can overlap, wherever it starts. */
REMAT_HOST_DEVICE static inline size_t dropout_calls_per_row(int C) { return (size_t)(C / DROPOUT_GROUP + 2); }

/* Threads for rows [r0, r0+rows) of C: one per generator call overlapping
 * the stretch (one stretch of rows*C elements from global element r0*C
 * without context parallelism; else a stretch per row). */
static inline size_t dropout_threads(size_t row0, size_t r0, size_t rows, int C, const TokenLayout* lay) {
    if (lay->group_size == 1) {
        size_t e0 = (row0 + r0) * (size_t)C, n = rows * (size_t)C;
        return (e0 + n + DROPOUT_GROUP - 1) / DROPOUT_GROUP - e0 / DROPOUT_GROUP;
    }
    return rows * dropout_calls_per_row(C);
}

/* Thread t's span; false when it has none (past the end, or one of a row's
 * spare threads). */
__device__ __forceinline__ bool dropout_span(DropoutSpan* sp, size_t t, size_t row0, size_t r0, size_t rows, int C,
                                             const TokenLayout& lay) {
    size_t start, len, local, j; /* the stretch: global start, elements, local start; the call's index in it */
    if (lay.group_size == 1) {
        start = (row0 + r0) * (size_t)C;
        len = rows * (size_t)C;
        local = 0;
        j = t;
    } else {
        size_t per_row = dropout_calls_per_row(C), r = t / per_row;
        if (r >= rows) return false;
        start = (row0 + token_global_row(&lay, r0 + r)) * (size_t)C;
        len = (size_t)C;
        local = r * (size_t)C;
        j = t % per_row;
    }
    size_t g = start / DROPOUT_GROUP + j, first = g * DROPOUT_GROUP;
    size_t lo = first > start ? first : start, hi = first + DROPOUT_GROUP < start + len ? first + DROPOUT_GROUP : start + len;
    if (lo >= hi) return false;
    sp->g = g;
    sp->k0 = (int)(lo - first);
    sp->k1 = (int)(hi - first);
    sp->i0 = local + (lo - start);
    return true;
}

/* A whole call's eight elements, 16-byte aligned (VEC > 1 instantiations
 * run only where the pointers are): vector accesses. */
template <int VEC> __device__ __forceinline__ bool dropout_span_vector(const DropoutSpan& sp) {
    return VEC > 1 && sp.k0 == 0 && sp.k1 == DROPOUT_GROUP && sp.i0 % DROPOUT_GROUP == 0;
}

/* v[k] = the value under draw k of the span (0 outside [k0, k1)). */
template <int VEC>
__device__ __forceinline__ void dropout_load_span(float* v, const floatX* p, const DropoutSpan& sp) {
    if (dropout_span_vector<VEC>(sp)) {
#pragma unroll
        for (int k = 0; k < DROPOUT_GROUP; k += VEC) {
            Vec<floatX, VEC> a = vload<VEC>(p + sp.i0 + k);
#pragma unroll
            for (int j = 0; j < VEC; j++) v[k + j] = to_f32(a.v[j]);
        }
        return;
    }
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] = k >= sp.k0 && k < sp.k1 ? to_f32(p[sp.i0 + (size_t)(k - sp.k0)]) : 0.0f;
}

template <int VEC>
__device__ __forceinline__ void dropout_store_span(floatX* p, const float* v, const DropoutSpan& sp) {
    if (dropout_span_vector<VEC>(sp)) {
#pragma unroll
        for (int k = 0; k < DROPOUT_GROUP; k += VEC) {
            Vec<floatX, VEC> a;
#pragma unroll
            for (int j = 0; j < VEC; j++) a.v[j] = from_f32<floatX>(v[k + j]);
            vstore<VEC>(p + sp.i0 + k, a);
        }
        return;
    }
    for (int k = sp.k0; k < sp.k1; k++) p[sp.i0 + (size_t)(k - sp.k0)] = from_f32<floatX>(v[k]);
}

/* v[k] with call g's mask: v * 1/keep where kept, else 0 (a select, so a
 * dropped inf does not become NaN). */
__device__ __forceinline__ void dropout_apply_group(float* v, const DropoutSite& s, uint64_t g) {
    uint32_t words[4];
    dropout_draws(&s, g, words);
#pragma unroll
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] = dropout_keeps(&s, words, k) ? v[k] * s.scale : 0.0f;
}

/* dst = src dropped at site s (dst may be src), rows [r0, r0+rows) of C;
 * dst and src point at row r0. */
template <int VEC>
__global__ void dropout_mask_kernel(floatX* dst, const floatX* src, size_t r0, size_t rows, int C, TokenLayout lay, DropoutSite s) {
    DropoutSpan sp;
    if (!dropout_span(&sp, (size_t)blockIdx.x * blockDim.x + threadIdx.x, s.row0, r0, rows, C, lay)) return;
    float v[DROPOUT_GROUP];
    dropout_load_span<VEC>(v, src, sp);
    dropout_apply_group(v, s, sp.g);
    dropout_store_span<VEC>(dst, v, sp);
}

/* out = (branch dropped at site s) + res: a residual add (out may be branch). */
template <int VEC>
__global__ void dropout_residual_kernel(floatX* out, const floatX* branch, const floatX* res, size_t r0, size_t rows, int C,
                                        TokenLayout lay, DropoutSite s) {
    DropoutSpan sp;
    if (!dropout_span(&sp, (size_t)blockIdx.x * blockDim.x + threadIdx.x, s.row0, r0, rows, C, lay)) return;
    float v[DROPOUT_GROUP], r[DROPOUT_GROUP];
    dropout_load_span<VEC>(v, branch, sp);
    dropout_load_span<VEC>(r, res, sp);
    dropout_apply_group(v, s, sp.g);
#pragma unroll
    for (int k = 0; k < DROPOUT_GROUP; k++) v[k] += r[k];
    dropout_store_span<VEC>(out, v, sp);
}

/* Vector width XVEC where every pointer is 16-byte aligned (the plan aligns
 * its buffers to 256 bytes), else 1; elementwise, so the width changes no bit. */
static inline void gpu_dropout_mask(floatX* dst, const floatX* src, size_t r0, size_t rows, int C, const TokenLayout* lay,
                                    const DropoutSite* s, cudaStream_t stream) {
    unsigned int grid = grid_for(dropout_threads(s->row0, r0, rows, C, lay), DROPOUT_THREADS);
    if (all_aligned16(dst, src)) dropout_mask_kernel<XVEC><<<grid, DROPOUT_THREADS, 0, stream>>>(dst, src, r0, rows, C, *lay, *s);
    else dropout_mask_kernel<1><<<grid, DROPOUT_THREADS, 0, stream>>>(dst, src, r0, rows, C, *lay, *s);
    CUDA_CHECK_LAUNCH();
}

static inline void gpu_dropout_residual(floatX* out, const floatX* branch, const floatX* res, size_t r0, size_t rows, int C,
                                        const TokenLayout* lay, const DropoutSite* s, cudaStream_t stream) {
    unsigned int grid = grid_for(dropout_threads(s->row0, r0, rows, C, lay), DROPOUT_THREADS);
    if (all_aligned16(out, branch, res))
        dropout_residual_kernel<XVEC><<<grid, DROPOUT_THREADS, 0, stream>>>(out, branch, res, r0, rows, C, *lay, *s);
    else dropout_residual_kernel<1><<<grid, DROPOUT_THREADS, 0, stream>>>(out, branch, res, r0, rows, C, *lay, *s);
    CUDA_CHECK_LAUNCH();
}

#endif
