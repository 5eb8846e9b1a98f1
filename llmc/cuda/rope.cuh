/*
 * RoPE (rotary position embeddings) on the Q and K heads of qkv, in place,
 * Hugging Face's rotate_half pairing, every scaling type of the CPU
 * reference (default, linear, llama3, yarn: llmc/core/model.h's table).
 *
 * Shapes: qkv rows of ld floatX (the (n, (NH + 2 NKV) HD) QKV matmul output,
 * heads [Q heads | K heads | V heads] of HD each); the first `heads` heads of
 * each row (NH + NKV: Q and K) turn, V stays. In each head, channel j < HD/2
 * pairs with j + HD/2 and the pair turns by angle pos * inv_freq[j]:
 *   x[j] = a cos - b sin,  x[j + HD/2] = b cos + a sin
 * with cos and sin scaled by yarn's attention factor. sign -1 turns back
 * (sin negated): the transpose, which the backward applies to dqkv.
 *
 * Positions: each row's as the CPU's encoder_position computes it: its place
 * in the sequence (token_position: under context parallelism the global one),
 * minus its document's start with --reset-position-ids (pos_start, device
 * (B,T), indexed by the row's index in the call's B*T rows).
 *
 * Angles, cos and sin in double from the integer position and the double
 * table, rounded to fp32 once (as the CPU reference does); the rotation in
 * explicitly rounded fp32 (no FMA contraction), so the forward pass, the
 * recompute and the CPU's fp32 build turn a pair alike.
 *
 * Access: thread t owns row t / P, pairs [p VEC, p VEC + VEC) with p = t % P
 * (P = HD/2 / VEC): it computes their VEC cos/sin once and turns them in all
 * `heads` heads, two 16-byte loads and stores per head (VEC = XVEC where
 * HD/2 and ld are multiples of it and qkv is 16-byte aligned, else 1). The
 * frequency table (at most ROPE_MAX_HALF doubles) travels as a kernel
 * argument and is staged in shared memory. Row offsets in size_t. The
 * double cos and sin take a 40-byte stack frame at sm_90 (their argument
 * reduction's scratch; no register spills): one pass over Q and K is
 * memory-bound, and fp32 angles would not be the CPU's.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_ROPE_CUH
#define REMAT_ROPE_CUH

#include "cuda_common.cuh"
#include "../core/model.h"
#include "../core/token_layout.h"

#define ROPE_MAX_HALF 128 /* head sizes up to 256 */
#define ROPE_THREADS 256

/* The configuration's frequencies (rope_frequencies: the CPU's table, bit for bit). */
typedef struct {
    double inv_freq[ROPE_MAX_HALF];
    double mscale;
    int half; /* HD / 2 */
} RopeTable;

static inline RopeTable rope_table(const ModelConfig* cfg) {
    RopeTable t;
    memset(&t, 0, sizeof(t));
    if (cfg->head_size / 2 > ROPE_MAX_HALF || cfg->head_size % 2)
        fail("RoPE on the GPU: head size %d is not an even number up to %d", cfg->head_size, 2 * ROPE_MAX_HALF);
    t.half = cfg->head_size / 2;
    rope_frequencies(cfg, t.inv_freq, &t.mscale);
    return t;
}

/* Rows [r0, r0 + n) of the call, qkv at row r0. */
template <int VEC>
__global__ void rope_rotate_kernel(floatX* qkv, int ld, RopeTable table, TokenLayout lay, const int* pos_start, int r0, int n, int heads,
                                   int sign) {
    __shared__ double freq[ROPE_MAX_HALF];
    for (int j = threadIdx.x; j < table.half; j += blockDim.x) freq[j] = table.inv_freq[j];
    __syncthreads();
    const int half = table.half, P = half / VEC;
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n * P) return;
    const int i = (int)(t / P), j0 = (int)(t % P) * VEC;
    const size_t bt = (size_t)r0 + i;
    const double pos = (double)(token_position(&lay, bt) - (pos_start ? pos_start[bt] : 0));
    float co[VEC], si[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        double angle = pos * freq[j0 + k];
        co[k] = (float)(cos(angle) * table.mscale);
        si[k] = (float)(sign * sin(angle) * table.mscale);
    }
    floatX* row = qkv + (size_t)i * ld;
    for (int h = 0; h < heads; h++) {
        floatX* x = row + (size_t)h * 2 * half + j0;
        Vec<floatX, VEC> a = vload<VEC>(x), b = vload<VEC>(x + half), ao, bo;
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            float av = to_f32(a.v[k]), bv = to_f32(b.v[k]);
            ao.v[k] = from_f32<floatX>(__fsub_rn(__fmul_rn(av, co[k]), __fmul_rn(bv, si[k])));
            bo.v[k] = from_f32<floatX>(__fadd_rn(__fmul_rn(bv, co[k]), __fmul_rn(av, si[k])));
        }
        vstore<VEC>(x, ao);
        vstore<VEC>(x + half, bo);
    }
}

/* Turns the first `heads` heads of rows [r0, r0 + n) (qkv at row r0, rows ld
 * apart) by their positions, sign 1, or back, sign -1. */
static inline void gpu_rope_rotate(floatX* qkv, int ld, const RopeTable* table, const TokenLayout* lay, const int* pos_start, int r0, int n,
                                   int heads, int sign, cudaStream_t stream) {
    if (table->half % XVEC == 0 && ld % XVEC == 0 && all_aligned16(qkv)) {
        size_t threads = (size_t)n * (table->half / XVEC);
        rope_rotate_kernel<XVEC><<<grid_for(threads, ROPE_THREADS), ROPE_THREADS, 0, stream>>>(qkv, ld, *table, *lay, pos_start, r0, n,
                                                                                              heads, sign);
    } else {
        size_t threads = (size_t)n * table->half;
        rope_rotate_kernel<1><<<grid_for(threads, ROPE_THREADS), ROPE_THREADS, 0, stream>>>(qkv, ld, *table, *lay, pos_start, r0, n, heads,
                                                                                           sign);
    }
    CUDA_CHECK_LAUNCH();
}

#endif
