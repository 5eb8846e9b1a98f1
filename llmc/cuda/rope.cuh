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
 * (sin negated): the transpose, which the backward applies to dQ and dK.
 *
 * Where it runs: the forward turns Q and K in a pass of its own after the
 * QKV matmul (gpu_rope_rotate), because attention reads the turned rows
 * many times over (K and V once per query tile, Q and dO once per key tile
 * in the dK/dV kernel), and turning them at each load would compute each
 * angle that many times. The backward has no pass where the mma and simt
 * attention kernels run: they turn dQ and dK back in fp32 in their
 * epilogues, before the one rounding to floatX (rope_cos_sin and
 * rope_turn, with a RopeRows argument; attention.cuh's
 * attention_rope_in_kernels says where), and so does the ring's store of
 * its fp32 sums (ring.cuh). After the tc kernels this pass turns back.
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
 * argument and is staged in shared memory. Row offsets in size_t. Angles
 * in double (rope_cos_sin): one pass over Q and K is memory-bound, and
 * fp32 angles would not be the CPU's.
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

/* RoPE as a kernel applies it to rows of the call (its B*T rows, row bt of
 * sequence bt / T): the frequencies, how rows map to positions
 * (token_position) and the documents' starts they restart at (pos_start,
 * device (B,T); NULL: none). table.half 0: no RoPE (learned positions). By
 * value: the attention backward's kernels take it as an argument and turn
 * dQ and dK back in their epilogues (attention.cuh). */
typedef struct {
    RopeTable table;
    TokenLayout lay;
    const int* pos_start;
} RopeRows;

/* Row bt's position, as the CPU's encoder_position computes it. */
__device__ __forceinline__ double rope_position(const RopeRows& r, size_t bt) {
    return (double)(token_position(&r.lay, bt) - (r.pos_start ? r.pos_start[bt] : 0));
}

/* The same for token t of sequence b (row b T + t, T = lay.T): no 64-bit
 * division, for kernels that know both (the attention backward's epilogues,
 * at their register limit). */
__device__ __forceinline__ double rope_position_at(const RopeRows& r, int b, int t) {
    return (double)(token_position_of(&r.lay, t) - (r.pos_start ? r.pos_start[(size_t)b * r.lay.T + t] : 0));
}

/* 1/pi as the double nearest it and the rest of it (1/pi = HI + LO to about 2^-110). */
#define ROPE_INV_PI_HI 0x1.45f306dc9c883p-2
#define ROPE_INV_PI_LO -0x1.6b01ec5417056p-56

/* cos and sin of the angle a = pos * freq (the double product, as the CPU
 * forms it), scaled by yarn's factor and rounded to fp32 once; sign -1
 * negates sin (turning back). a is taken in half turns, a = (n + r) pi with
 * n whole and |r| <= 1/2: a / pi in two doubles (the product by HI, its
 * rounding error by fma, and a LO), of which n - the whole part is exact
 * - and r to about 2^-54, so cos a = (-1)^n cospi r, sin a = (-1)^n sinpi r
 * within a few units of the last double place, as the library's cos and
 * sin of a are; the rounding to fp32 hides either. sincospi reduces its
 * argument exactly, where cos and sin of a would carry Payne-Hanek's slow
 * path (a call and a 40-byte array) into every kernel that turns a pair:
 * the attention backward's epilogues among them, at their register limit. */
__device__ __forceinline__ void rope_cos_sin(double pos, double freq, double mscale, int sign, float* co, float* si) {
    const double a = pos * freq, y = a * ROPE_INV_PI_HI, y_err = fma(a, ROPE_INV_PI_HI, -y);
    const double n = rint(y), r = (y - n) + fma(a, ROPE_INV_PI_LO, y_err);
    double s, c;
    sincospi(r, &s, &c);
    const double turn = ((long long)n & 1) ? -mscale : mscale; /* (-1)^n and yarn's factor */
    *co = (float)(c * turn);
    *si = (float)(sign * s * turn);
}

/* The pair (a, b) = (x[j], x[j + HD/2]) turned: a cos - b sin, b cos + a
 * sin, every product and sum rounded (no FMA contraction: the CPU's bits). */
__device__ __forceinline__ void rope_turn(float* a, float* b, float co, float si) {
    const float av = *a, bv = *b;
    *a = __fsub_rn(__fmul_rn(av, co), __fmul_rn(bv, si));
    *b = __fadd_rn(__fmul_rn(bv, co), __fmul_rn(av, si));
}

/* Rows [r0, r0 + n) of the call, qkv at row r0. */
template <int VEC>
__global__ void rope_rotate_kernel(floatX* qkv, int ld, RopeRows rope, int r0, int n, int heads, int sign) {
    __shared__ double freq[ROPE_MAX_HALF];
    for (int j = threadIdx.x; j < rope.table.half; j += blockDim.x) freq[j] = rope.table.inv_freq[j];
    __syncthreads();
    const int half = rope.table.half, P = half / VEC;
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n * P) return;
    const int i = (int)(t / P), j0 = (int)(t % P) * VEC;
    const double pos = rope_position(rope, (size_t)r0 + i);
    float co[VEC], si[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) rope_cos_sin(pos, freq[j0 + k], rope.table.mscale, sign, &co[k], &si[k]);
    floatX* row = qkv + (size_t)i * ld;
    for (int h = 0; h < heads; h++) {
        floatX* x = row + (size_t)h * 2 * half + j0;
        Vec<floatX, VEC> a = vload<VEC>(x), b = vload<VEC>(x + half), ao, bo;
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            float av = to_f32(a.v[k]), bv = to_f32(b.v[k]);
            rope_turn(&av, &bv, co[k], si[k]);
            ao.v[k] = from_f32<floatX>(av);
            bo.v[k] = from_f32<floatX>(bv);
        }
        vstore<VEC>(x, ao);
        vstore<VEC>(x + half, bo);
    }
}

/* Turns the first `heads` heads of rows [r0, r0 + n) (qkv at row r0, rows ld
 * apart) by their positions, sign 1, or back, sign -1. */
static inline void gpu_rope_rotate(floatX* qkv, int ld, const RopeRows* rope, int r0, int n, int heads, int sign, cudaStream_t stream) {
    const int half = rope->table.half;
    if (half % XVEC == 0 && ld % XVEC == 0 && all_aligned16(qkv)) {
        size_t threads = (size_t)n * (half / XVEC);
        rope_rotate_kernel<XVEC><<<grid_for(threads, ROPE_THREADS), ROPE_THREADS, 0, stream>>>(qkv, ld, *rope, r0, n, heads, sign);
    } else {
        size_t threads = (size_t)n * half;
        rope_rotate_kernel<1><<<grid_for(threads, ROPE_THREADS), ROPE_THREADS, 0, stream>>>(qkv, ld, *rope, r0, n, heads, sign);
    }
    CUDA_CHECK_LAUNCH();
}

#endif
