/*
 * Causal self-attention with inline-PTX tensor-core instructions (BF16 and
 * FP16 builds, sm_80+, head sizes 64 and 128): the same shapes, outputs and
 * algorithm as attention.cuh (read its header first), in FlashAttention-2's
 * arrangement. Other head sizes run attention_tc.cuh's WMMA kernels.
 *
 * Instructions (llmc/ptx.cuh): mma.sync.aligned.m16n8k16 (16-bit inputs,
 * fp32 accumulation) for every tile product, ldmatrix (.x4, .x4.trans) for
 * every operand read from shared memory, cp.async.cg 16-byte copies for every
 * tile staged from global memory.
 *
 * Work split: a block of ATT_MMA_WARPS warps owns ATT_MMA_ROWS rows of one
 * (b, h) (queries in the forward and dq kernels, keys in the dk/dv kernel);
 * warp w owns 16 of them and keeps its operand rows (Q; or K and V) as mma
 * A fragments in registers for the whole kernel. The other side streams
 * through shared memory BC rows at a time, double-buffered: tile j+1's
 * cp.async copies are in flight while tile j is multiplied. Scores S, the
 * probabilities P (and dP, dS in the backward) never leave registers: the
 * mma accumulator layout of a 16x16 block of S is, register for register,
 * the A-operand layout of P for the next product (two fp32 accumulators
 * packed into one register of two 16-bit values), so P feeds P*V directly.
 * Rows past T are zero-filled in shared memory (plain stores, not copies);
 * keys past T are masked out of the softmax.
 *
 * Per warp and key tile, forward: S = Q K^T (HS/16 x BC/8 mma), online
 * softmax in fp32 (row max and sum over the four lanes of a row group with
 * two shuffles), O = diag(corr) O + P V. The backward is two passes like
 * attention.cuh's (dQ first, then dK and dV) so that dQ needs no atomics and
 * no scratch: pass 1 does S, dP and dQ += dS K per tile, pass 2 S^T, dP^T,
 * dV += P^T dO and dK += dS^T Q; 7 tile products per tile pair where
 * FlashAttention-2 does 5 with an fp32 atomic dQ. Deterministic: fixed tile
 * order, one warp per output row block, no atomics.
 *
 * Attention dropout (dropout.h): with drop.threshold > 0 the forward
 * multiplies P by the mask's factors (0 or 1/keep) before P V, its lse
 * staying that of the undropped P; the backward draws the same bits for dV
 * (dropped P) and dS = P (factor dP - D). One Philox call per lane per 16x16
 * block in every kernel (att_mma_drop_rows, att_mma_drop_cols).
 *
 * Resources, from `nvcc -Xptxas -v` (sm_90, CUDA 13.0, BF16 build), every
 * kernel at __launch_bounds__(ATT_MMA_THREADS), 0 bytes of stack and no
 * spills except where noted (registers / static shared memory bytes):
 *   forward        hs64 128 / 36864    hs128 160 / 34816
 *   backward dq    hs64 234 / 36864    hs128 240 / 34816
 *   backward dk/dv hs64 254 / 37888    hs128 255 / 35328 (104-byte stack: 100 bytes of spills)
 * AttMmaResources below holds these figures; static_asserts check them
 * against the launch configuration (the recorded shared memory must be what
 * the layout computes, below 48 KiB static; registers times threads within
 * an SM's 64K registers) so a layout change must update the table. At these
 * figures an H100/H200 SM holds 4 forward blocks at hs64 (128 registers), 3 at hs128, and
 * 2 backward blocks; the occupancy and every speed figure are predicted.
 *
 * Status: compiles, unverified on GPU.
 */
#ifndef REMAT_ATTENTION_MMA_CUH
#define REMAT_ATTENTION_MMA_CUH

#include "cuda_common.cuh"
#include "attention_tc.cuh"
#include "ptx.cuh"
#include "dropout.h"

#define ATT_MMA_WARPS 4
#define ATT_MMA_ROWS (16 * ATT_MMA_WARPS) /* rows owned by a block */
#define ATT_MMA_THREADS (32 * ATT_MMA_WARPS)

template <int HS> struct AttMma {
    static_assert(HS == 64 || HS == 128, "the mma attention kernels are for head sizes 64 and 128");
    static constexpr int BC = HS == 64 ? 64 : 32;                /* rows of the other side per tile */
    static constexpr int LD = HS + 8;                            /* floatX row stride in shared memory: rows 16 bytes apart mod 128 */
    static constexpr int KS = HS / 16;                           /* k-steps of 16 channels */
    static constexpr int NT = BC / 8;                            /* 8-column blocks of a score tile */
    static constexpr int OT = HS / 8;                            /* 8-column blocks of an output row block */
    static constexpr size_t TILE_BYTES = (size_t)BC * LD * sizeof(floatX);
    static constexpr size_t STAGE_BYTES = 2 * TILE_BYTES;        /* one buffer: two tiles (K and V, or Q and dO) */
    static constexpr size_t ROWS_BYTES = (size_t)ATT_MMA_ROWS * LD * sizeof(floatX);
    static constexpr size_t SMEM_BYTES = 2 * STAGE_BYTES;        /* double buffer */
    static_assert(ROWS_BYTES <= STAGE_BYTES, "the block's own rows are staged in the second buffer");
    static_assert(SMEM_BYTES <= 48 * 1024, "static shared memory above 48 KiB");
    static_assert(sizeof(floatX) == 2, "mma attention is for 16-bit floatX");
};

/* ptxas -v figures (registers, static shared bytes) per kernel, recorded above. */
template <int HS> struct AttMmaResources {
    static constexpr int FWD_REGS = HS == 64 ? 128 : 160, DQ_REGS = HS == 64 ? 234 : 240, DKV_REGS = HS == 64 ? 254 : 255;
    static constexpr size_t FWD_SMEM = HS == 64 ? 36864 : 34816, DQ_SMEM = FWD_SMEM, DKV_SMEM = HS == 64 ? 37888 : 35328;
    static_assert(FWD_SMEM == AttMma<HS>::SMEM_BYTES && DQ_SMEM == AttMma<HS>::SMEM_BYTES, "recorded shared memory is stale");
    static_assert(DKV_SMEM == AttMma<HS>::SMEM_BYTES + 4 * AttMma<HS>::BC * sizeof(float), "recorded shared memory is stale");
    static_assert(DKV_SMEM <= 48 * 1024, "static shared memory above 48 KiB");
    static_assert(FWD_REGS <= 255 && DQ_REGS <= 255 && DKV_REGS <= 255 && DKV_REGS * ATT_MMA_THREADS <= 65536,
                  "a block of ATT_MMA_THREADS must fit one SM's 64K registers");
};
template struct AttMmaResources<64>;
template struct AttMmaResources<128>;

/* Buffer j % 2 of the double buffer (computed, not indexed: no local array). */
template <int HS> __device__ __forceinline__ floatX* att_mma_buffer(unsigned char* smem, int j) {
    return (floatX*)(smem + (j & 1) * AttMma<HS>::STAGE_BYTES);
}

/* Stages rows [r0, r0+rows) of a (T, ld)-strided head slice (base: row 0,
 * this head's channel 0) into dst (stride LD): cp.async 16 bytes a copy,
 * zeros past T. Every thread of the block takes part; the caller commits. */
template <int HS>
__device__ __forceinline__ void att_mma_stage(floatX* dst, const floatX* base, size_t ld, int r0, int rows, int T) {
    constexpr int CHUNKS = HS / 8;
    for (int i = threadIdx.x; i < rows * CHUNKS; i += ATT_MMA_THREADS) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        floatX* d = dst + r * AttMma<HS>::LD + c;
        if (r0 + r < T) ptx_cp_async16<true>(d, base + (size_t)(r0 + r) * ld + c);
        else *reinterpret_cast<uint4*>(d) = uint4{0u, 0u, 0u, 0u};
    }
}

/* A fragments of a warp's 16 rows (shared, stride LD, first row `rows`): a[ks] covers channels 16ks..16ks+15. */
template <int HS> __device__ __forceinline__ void att_mma_load_a(uint32_t a[][4], const floatX* rows) {
    const int lane = threadIdx.x & 31;
    const floatX* p = rows + ((lane & 7) + ((lane >> 3) & 1) * 8) * AttMma<HS>::LD + (lane >> 4) * 8;
#pragma unroll
    for (int ks = 0; ks < AttMma<HS>::KS; ks++) ptx_ldmatrix<4, false>(a[ks], p + ks * 16);
}

/* s[nt] = a (16 x HS) times tile^T, tile rows (BC of them, stride LD) as columns: s is 16 x BC. */
template <int HS> __device__ __forceinline__ void att_mma_scores(float s[][4], const uint32_t a[][4], const floatX* tile) {
    typedef AttMma<HS> Cfg;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) s[nt][i] = 0.0f;
    /* ldmatrix.x4: matrices (rows +0..7 | +8..15) x (channels +0..7 | +8..15) give the B fragments of two column blocks */
    const floatX* p = tile + ((lane & 7) + (lane >> 4) * 8) * Cfg::LD + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < Cfg::KS; ks++)
#pragma unroll
        for (int n2 = 0; n2 < Cfg::NT / 2; n2++) {
            uint32_t b[4];
            ptx_ldmatrix<4, false>(b, p + n2 * 16 * Cfg::LD + ks * 16);
            ptx_mma_m16n8k16(s[2 * n2], a[ks], b, s[2 * n2]);
            ptx_mma_m16n8k16(s[2 * n2 + 1], a[ks], b + 2, s[2 * n2 + 1]);
        }
}

/* The A fragments of a 16 x BC probability tile from its fp32 accumulators, rounded to floatX. */
template <int HS> __device__ __forceinline__ void att_mma_to_a(uint32_t pa[][4], const float s[][4]) {
#pragma unroll
    for (int kk = 0; kk < AttMma<HS>::BC / 16; kk++) {
        pa[kk][0] = ptx_pack2(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = ptx_pack2(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = ptx_pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = ptx_pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

/* acc (16 x HS) += pa (16 x BC) times tile (BC rows x HS channels, stride LD), tile read transposed. */
template <int HS> __device__ __forceinline__ void att_mma_accumulate(float acc[][4], const uint32_t pa[][4], const floatX* tile) {
    typedef AttMma<HS> Cfg;
    const int lane = threadIdx.x & 31;
    /* ldmatrix.x4.trans: matrices (rows +0..7 | +8..15) x (channels +0..7 | +8..15) */
    const floatX* p = tile + ((lane & 7) + ((lane >> 3) & 1) * 8) * Cfg::LD + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < Cfg::BC / 16; kk++)
#pragma unroll
        for (int o2 = 0; o2 < Cfg::OT / 2; o2++) {
            uint32_t b[4];
            ptx_ldmatrix<4, true>(b, p + kk * 16 * Cfg::LD + o2 * 16);
            ptx_mma_m16n8k16(acc[2 * o2], pa[kk], b, acc[2 * o2]);
            ptx_mma_m16n8k16(acc[2 * o2 + 1], pa[kk], b + 2, acc[2 * o2 + 1]);
        }
}

/* Sum or max over the four lanes of a row group (lanes 4g..4g+3); the same bits in all four. */
__device__ __forceinline__ float att_mma_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float att_mma_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

/* ---- attention dropout (dropout.h's layout) ----
 * The (t, u) plane of head bh is cut in 16x16 blocks; lane 4g + tq of an
 * m16n8k16 accumulator pair holding a block with queries as rows (rows g,
 * g+8; columns 2tq, 2tq+1, 8+2tq, 9+2tq) owns group lane of that block, so
 * one Philox call gives it all eight of its draws: s[2kk + n][i] of a 16 x
 * BC tile is draw (i >> 1) * 4 + n * 2 + (i & 1). */
__device__ __forceinline__ void att_mma_drop_words(const DropoutSite& drop, int bh, int T, int t, int u, uint32_t w[4]) {
    dropout_draws(&drop, dropout_attention_group(bh, T, t, u), w);
}

/* f = the dropout factors (0 or drop.scale) of a 16 x BC tile with queries
 * t0.. as rows and keys u0.. as columns (both multiples of 16). */
template <int HS>
__device__ __forceinline__ void att_mma_drop_rows(float f[][4], const DropoutSite& drop, int bh, int T, int t0, int u0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int kk = 0; kk < AttMma<HS>::BC / 16; kk++) {
        uint32_t w[4];
        att_mma_drop_words(drop, bh, T, t0 + g, u0 + 16 * kk + 2 * tq, w);
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) f[2 * kk + n][i] = dropout_keeps(&drop, w, (i >> 1) * 4 + n * 2 + (i & 1)) ? drop.scale : 0.0f;
    }
}

/* The same with the tile transposed: f (16 x BC) holds keys u0.. as rows and
 * queries t0.. as columns, so lane 4g + tq holds queries t0 + 16kk + 8n + 2tq
 * + e (e = 0, 1) of keys u0 + g + 8h: half of group (2tq + e) * 4 + g / 2,
 * the other half being lane ^ 4's (key g ^ 1). Each lane draws the group of
 * e = g & 1 (one call per eight elements, as in the forward) and the pair
 * swaps words with one shuffle each; element f[2kk + n][2h + e] is draw
 * n * 4 + h * 2 + (g & 1) of group e's words. */
template <int HS>
__device__ __forceinline__ void att_mma_drop_cols(float f[][4], const DropoutSite& drop, int bh, int T, int t0, int u0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3, own = g & 1;
#pragma unroll
    for (int kk = 0; kk < AttMma<HS>::BC / 16; kk++) {
        uint32_t mine[4], other[4];
        att_mma_drop_words(drop, bh, T, t0 + 16 * kk + 2 * tq + own, u0 + g, mine);
#pragma unroll
        for (int k = 0; k < 4; k++) other[k] = __shfl_xor_sync(0xffffffffu, mine[k], 4);
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) { /* draw n * 4 + h * 2 + own: word n * 2 + h, half own */
                const uint32_t word = (i & 1) == own ? mine[n * 2 + (i >> 1)] : other[n * 2 + (i >> 1)];
                f[2 * kk + n][i] = ((word >> (16 * own)) & 0xffffu) >= drop.threshold ? drop.scale : 0.0f;
            }
    }
}

/* Stores a warp's 16 x HS accumulators (rows r0.., each times mul[row half]) as floatX rows of stride ld. */
template <int HS>
__device__ __forceinline__ void att_mma_store_rows(floatX* base, size_t ld, int r0, int T, const float acc[][4], const float mul[2]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int t = r0 + g + 8 * half;
        if (t >= T) continue;
        floatX* row = base + (size_t)t * ld + 2 * tq;
#pragma unroll
        for (int ot = 0; ot < AttMma<HS>::OT; ot++) {
            uint32_t v = ptx_pack2(acc[ot][2 * half] * mul[half], acc[ot][2 * half + 1] * mul[half]);
            *reinterpret_cast<uint32_t*>(row + ot * 8) = v;
        }
    }
}

/* Where a thread works: as attention_tc.cuh's (same block of 64 rows and warp
 * split: warp owns rows r0..r0+15 of the block's first row row0, batch b,
 * head h), and lane = 4g + tq holds rows r0+g and r0+g+8 of each
 * accumulator, columns 2tq, 2tq+1 of each 8-column block. */
struct AttMmaThread {
    int warp, g, tq, b, h, row0, r0;
};

__device__ __forceinline__ AttMmaThread att_mma_thread(int NH, bool last_first) {
    static_assert(ATT_MMA_ROWS == ATT_TC_ROWS && ATT_MMA_THREADS == ATT_TC_THREADS, "the block shapes of tc and mma agree");
    const AttTcThread t = att_tc_thread(NH, last_first);
    return AttMmaThread{t.warp, (int)(threadIdx.x & 31) >> 2, (int)threadIdx.x & 3, t.b, t.h, t.row0, t.r0};
}

/* ---- forward ----
 * grid (ceil(T/ROWS), B*NH), block ATT_MMA_THREADS; query blocks last-first.
 * ptxas (sm_90): see the README's attention section for the recorded figures. */
template <int HS>
__global__ void __launch_bounds__(ATT_MMA_THREADS)
attention_mma_forward_kernel(floatX* out, float* lse, const floatX* qkv, int T, int C, int NH, float scale, const DropoutSite drop) {
    typedef AttMma<HS> Cfg;
    __shared__ __align__(128) unsigned char smem[Cfg::SMEM_BYTES];
    const AttMmaThread at = att_mma_thread(NH, true);
    const int q0 = at.row0, r0 = at.r0, g = at.g, tq = at.tq;
    const size_t ld = 3 * (size_t)C;
    const floatX* base = qkv + (size_t)at.b * T * ld + (size_t)at.h * HS;
    const int kend = min(q0 + ATT_MMA_ROWS, T);
    const int ntiles = (kend + Cfg::BC - 1) / Cfg::BC;

    att_mma_stage<HS>(att_mma_buffer<HS>(smem, 1), base, ld, q0, ATT_MMA_ROWS, T); /* Q into the second buffer */
    ptx_cp_async_commit();
    att_mma_stage<HS>(att_mma_buffer<HS>(smem, 0), base + C, ld, 0, Cfg::BC, T);
    att_mma_stage<HS>(att_mma_buffer<HS>(smem, 0) + Cfg::BC * Cfg::LD, base + 2 * C, ld, 0, Cfg::BC, T);
    ptx_cp_async_commit();
    ptx_cp_async_wait<1>(); /* Q has landed */
    __syncthreads();
    uint32_t q[Cfg::KS][4];
    att_mma_load_a<HS>(q, att_mma_buffer<HS>(smem, 1) + 16 * at.warp * Cfg::LD);
    __syncthreads(); /* the second buffer is free for tile 1 */

    float o[Cfg::OT][4];
#pragma unroll
    for (int ot = 0; ot < Cfg::OT; ot++)
#pragma unroll
        for (int i = 0; i < 4; i++) o[ot][i] = 0.0f;
    /* per row half (rows r0+g, r0+g+8): running max of the raw scores, this lane's part of the sum */
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float scale_log2 = scale * 1.4426950408889634f;
    for (int j = 0; j < ntiles; j++) {
        if (j + 1 < ntiles) {
            floatX* nb = att_mma_buffer<HS>(smem, j + 1);
            att_mma_stage<HS>(nb, base + C, ld, (j + 1) * Cfg::BC, Cfg::BC, T);
            att_mma_stage<HS>(nb + Cfg::BC * Cfg::LD, base + 2 * C, ld, (j + 1) * Cfg::BC, Cfg::BC, T);
        }
        ptx_cp_async_commit(); /* possibly empty: the group count stays one per tile */
        ptx_cp_async_wait<1>(); /* tile j has landed (this thread's copies) */
        __syncthreads();        /* ... and every thread's */
        const int k0 = j * Cfg::BC;
        if (k0 <= r0 + 15) { /* else every key of the tile is after every query of this warp */
            const floatX* Ks = att_mma_buffer<HS>(smem, j);
            const floatX* Vs = Ks + Cfg::BC * Cfg::LD;
            float s[Cfg::NT][4];
            att_mma_scores<HS>(s, q, Ks);
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int key = k0 + nt * 8 + 2 * tq + (i & 1), t = r0 + g + 8 * (i >> 1);
                    if (!(key <= t && key < T)) s[nt][i] = -INFINITY;
                    mx[i >> 1] = fmaxf(mx[i >> 1], s[nt][i]);
                }
            float corr[2], ref[2];
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const float mnew = fmaxf(m[hf], att_mma_quad_max(mx[hf]));
                ref[hf] = mnew == -INFINITY ? 0.0f : mnew; /* all masked so far: keep exp2 away from inf - inf */
                corr[hf] = exp2f((m[hf] - ref[hf]) * scale_log2);
                m[hf] = mnew;
                l[hf] *= corr[hf];
            }
#pragma unroll
            for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    s[nt][i] = exp2f((s[nt][i] - ref[i >> 1]) * scale_log2);
                    l[i >> 1] += s[nt][i];
                }
#pragma unroll
            for (int ot = 0; ot < Cfg::OT; ot++)
#pragma unroll
                for (int i = 0; i < 4; i++) o[ot][i] *= corr[i >> 1];
            if (drop.threshold) { /* l sums the undropped P; P V takes the dropped one */
                float f[Cfg::NT][4];
                att_mma_drop_rows<HS>(f, drop, at.b * NH + at.h, T, r0, k0);
#pragma unroll
                for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) s[nt][i] *= f[nt][i];
            }
            uint32_t pa[Cfg::BC / 16][4];
            att_mma_to_a<HS>(pa, s);
            att_mma_accumulate<HS>(o, pa, Vs);
        }
        __syncthreads(); /* buffer j & 1 is no longer read: tile j + 2 goes there */
    }
    float inv[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const float sum = att_mma_quad_sum(l[hf]);
        inv[hf] = 1.0f / sum;
        const int t = r0 + g + 8 * hf;
        if (tq == 0 && t < T) lse[((size_t)at.b * NH + at.h) * T + t] = m[hf] * scale + logf(sum);
    }
    att_mma_store_rows<HS>(out + (size_t)at.b * T * C + (size_t)at.h * HS, C, r0, T, o, inv);
}

/* The block's own rows of two (T, ld_x) / (T, ld_y)-strided head slices as
 * the warp's A fragments: staged once through shared memory, then the whole
 * shared memory is free for the tiles. */
template <int HS>
__device__ __forceinline__ void att_mma_own_rows(uint32_t x[][4], uint32_t y[][4], unsigned char* smem, const floatX* base_x, size_t ld_x,
                                                 const floatX* base_y, size_t ld_y, int row0, int T) {
    typedef AttMma<HS> Cfg;
    static_assert(2 * Cfg::ROWS_BYTES <= Cfg::SMEM_BYTES, "two row blocks must fit the tile buffers");
    floatX* xs = (floatX*)smem;
    floatX* ys = (floatX*)(smem + Cfg::ROWS_BYTES);
    att_mma_stage<HS>(xs, base_x, ld_x, row0, ATT_MMA_ROWS, T);
    att_mma_stage<HS>(ys, base_y, ld_y, row0, ATT_MMA_ROWS, T);
    ptx_cp_async_commit();
    ptx_cp_async_wait<0>();
    __syncthreads();
    const int warp = threadIdx.x >> 5;
    att_mma_load_a<HS>(x, xs + 16 * warp * Cfg::LD);
    att_mma_load_a<HS>(y, ys + 16 * warp * Cfg::LD);
    __syncthreads(); /* the buffers are free for the tiles */
}

/* ---- backward, pass 1: dq and D ----
 * grid (ceil(T/ROWS), B*NH), block ATT_MMA_THREADS; warp w owns 16 query
 * rows (Q and dO as A fragments); K, V tiles double-buffered. Per tile:
 * S = Q K^T, dP = dO V^T, dS = P (dP - D) scale, dQ += dS K. */
template <int HS>
__global__ void __launch_bounds__(ATT_MMA_THREADS)
attention_mma_backward_dq_kernel(floatX* dqkv, float* rowsum, const floatX* dout, const floatX* qkv, const floatX* out,
                                 const float* lse, int T, int C, int NH, float scale, const DropoutSite drop) {
    typedef AttMma<HS> Cfg;
    __shared__ __align__(128) unsigned char smem[Cfg::SMEM_BYTES];
    const AttMmaThread at = att_mma_thread(NH, true);
    const int q0 = at.row0, r0 = at.r0, g = at.g, tq = at.tq;
    const size_t ld = 3 * (size_t)C;
    const floatX* base = qkv + (size_t)at.b * T * ld + (size_t)at.h * HS;
    const size_t obase = (size_t)at.b * T * C + (size_t)at.h * HS;
    const size_t stat0 = ((size_t)at.b * NH + at.h) * T;
    uint32_t q[Cfg::KS][4], dO[Cfg::KS][4];
    att_mma_own_rows<HS>(q, dO, smem, base, ld, dout + obase, C, q0, T);
    /* D_t = dout_t . out_t (fp32) for rows r0+g, r0+g+8: this lane's channels 8ot+2tq, +1, then over the quad */
    float D[2], row_lse[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int t = r0 + g + 8 * hf;
        float acc = 0.0f;
        if (t < T) {
            const floatX* orow = out + obase + (size_t)t * C + 2 * tq;
            const floatX* drow = dout + obase + (size_t)t * C + 2 * tq;
#pragma unroll
            for (int ot = 0; ot < Cfg::OT; ot++)
                acc += to_f32(drow[8 * ot]) * to_f32(orow[8 * ot]) + to_f32(drow[8 * ot + 1]) * to_f32(orow[8 * ot + 1]);
        }
        D[hf] = att_mma_quad_sum(acc);
        if (t < T && tq == 0) rowsum[stat0 + t] = D[hf];
        row_lse[hf] = t < T ? lse[stat0 + t] * 1.4426950408889634f : 0.0f; /* in log2 units */
    }
    const float scale_log2 = scale * 1.4426950408889634f;
    float dq[Cfg::OT][4];
#pragma unroll
    for (int ot = 0; ot < Cfg::OT; ot++)
#pragma unroll
        for (int i = 0; i < 4; i++) dq[ot][i] = 0.0f;
    const int ntiles = (min(q0 + ATT_MMA_ROWS, T) + Cfg::BC - 1) / Cfg::BC;
    att_mma_stage<HS>(att_mma_buffer<HS>(smem, 0), base + C, ld, 0, Cfg::BC, T);
    att_mma_stage<HS>(att_mma_buffer<HS>(smem, 0) + Cfg::BC * Cfg::LD, base + 2 * C, ld, 0, Cfg::BC, T);
    ptx_cp_async_commit();
    for (int j = 0; j < ntiles; j++) {
        if (j + 1 < ntiles) {
            floatX* nb = att_mma_buffer<HS>(smem, j + 1);
            att_mma_stage<HS>(nb, base + C, ld, (j + 1) * Cfg::BC, Cfg::BC, T);
            att_mma_stage<HS>(nb + Cfg::BC * Cfg::LD, base + 2 * C, ld, (j + 1) * Cfg::BC, Cfg::BC, T);
        }
        ptx_cp_async_commit();
        ptx_cp_async_wait<1>();
        __syncthreads();
        const int k0 = j * Cfg::BC;
        if (k0 <= r0 + 15) {
            const floatX* Ks = att_mma_buffer<HS>(smem, j);
            const floatX* Vs = Ks + Cfg::BC * Cfg::LD;
            float s[Cfg::NT][4], dp[Cfg::NT][4];
            att_mma_scores<HS>(s, q, Ks);
            att_mma_scores<HS>(dp, dO, Vs);
            if (drop.threshold) { /* dP' = dO V^T feeds the dropped P: dS = P (f dP' - D) */
                float f[Cfg::NT][4];
                att_mma_drop_rows<HS>(f, drop, at.b * NH + at.h, T, r0, k0);
#pragma unroll
                for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) dp[nt][i] *= f[nt][i];
            }
#pragma unroll
            for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int key = k0 + nt * 8 + 2 * tq + (i & 1), t = r0 + g + 8 * (i >> 1);
                    const float p = (key <= t && key < T) ? exp2f(s[nt][i] * scale_log2 - row_lse[i >> 1]) : 0.0f;
                    s[nt][i] = p * (dp[nt][i] - D[i >> 1]) * scale;
                }
            uint32_t dsa[Cfg::BC / 16][4];
            att_mma_to_a<HS>(dsa, s);
            att_mma_accumulate<HS>(dq, dsa, Ks);
        }
        __syncthreads();
    }
    const float one[2] = {1.0f, 1.0f};
    att_mma_store_rows<HS>(dqkv + (size_t)at.b * T * ld + (size_t)at.h * HS, ld, r0, T, dq, one);
}

/* ---- backward, pass 2: dk and dv ----
 * grid (ceil(T/ROWS), B*NH), block ATT_MMA_THREADS; warp w owns 16 key rows
 * (K and V as A fragments); tiles of queries t >= the block's first key
 * (Q, dO, and their lse and D) double-buffered; key blocks first-first. Per
 * tile: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q. */
template <int HS>
__global__ void __launch_bounds__(ATT_MMA_THREADS)
attention_mma_backward_dkv_kernel(floatX* dqkv, const float* rowsum, const floatX* dout, const floatX* qkv, const float* lse, int T,
                                  int C, int NH, float scale, const DropoutSite drop) {
    typedef AttMma<HS> Cfg;
    __shared__ __align__(128) unsigned char smem[Cfg::SMEM_BYTES];
    __shared__ float stats[2][2][Cfg::BC]; /* per buffer: lse (log2 units) and D of the tile's query rows */
    const AttMmaThread at = att_mma_thread(NH, false);
    const int s0 = at.row0, r0 = at.r0, g = at.g, tq = at.tq;
    const size_t ld = 3 * (size_t)C;
    const floatX* base = qkv + (size_t)at.b * T * ld + (size_t)at.h * HS;
    const floatX* dobase = dout + (size_t)at.b * T * C + (size_t)at.h * HS;
    const size_t stat0 = ((size_t)at.b * NH + at.h) * T;
    uint32_t k[Cfg::KS][4], v[Cfg::KS][4];
    att_mma_own_rows<HS>(k, v, smem, base + C, ld, base + 2 * C, ld, s0, T);
    const float scale_log2 = scale * 1.4426950408889634f;
    float dk[Cfg::OT][4], dv[Cfg::OT][4];
#pragma unroll
    for (int ot = 0; ot < Cfg::OT; ot++)
#pragma unroll
        for (int i = 0; i < 4; i++) dk[ot][i] = dv[ot][i] = 0.0f;
    const int ntiles = s0 < T ? (T - s0 + Cfg::BC - 1) / Cfg::BC : 0;
    /* tile j: query rows s0 + j BC .., into buffer j & 1 (Q, dO by cp.async; lse, D by plain stores) */
    auto stage = [&](int j) {
        const int t0 = s0 + j * Cfg::BC;
        floatX* nb = att_mma_buffer<HS>(smem, j);
        att_mma_stage<HS>(nb, base, ld, t0, Cfg::BC, T);
        att_mma_stage<HS>(nb + Cfg::BC * Cfg::LD, dobase, C, t0, Cfg::BC, T);
        for (int i = threadIdx.x; i < Cfg::BC; i += ATT_MMA_THREADS) {
            const int t = t0 + i;
            stats[j & 1][0][i] = t < T ? lse[stat0 + t] * 1.4426950408889634f : 0.0f;
            stats[j & 1][1][i] = t < T ? rowsum[stat0 + t] : 0.0f;
        }
    };
    if (ntiles) stage(0);
    ptx_cp_async_commit();
    for (int j = 0; j < ntiles; j++) {
        if (j + 1 < ntiles) stage(j + 1);
        ptx_cp_async_commit();
        ptx_cp_async_wait<1>();
        __syncthreads();
        const int t0 = s0 + j * Cfg::BC;
        if (t0 + Cfg::BC - 1 >= r0) { /* else every query of the tile is before every key of this warp */
            const floatX* Qs = att_mma_buffer<HS>(smem, j);
            const floatX* dOs = Qs + Cfg::BC * Cfg::LD;
            const float* lse_s = stats[j & 1][0];
            const float* d_s = stats[j & 1][1];
            float st[Cfg::NT][4], dpt[Cfg::NT][4];
            att_mma_scores<HS>(st, k, Qs);
            att_mma_scores<HS>(dpt, v, dOs);
            float f[Cfg::NT][4]; /* dropout factors: dV takes the dropped P, dS = P (f dP' - D) */
            if (drop.threshold) att_mma_drop_cols<HS>(f, drop, at.b * NH + at.h, T, t0, r0);
#pragma unroll
            for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int c = nt * 8 + 2 * tq + (i & 1), t = t0 + c, s = r0 + g + 8 * (i >> 1);
                    const float p = (t >= s && t < T) ? exp2f(st[nt][i] * scale_log2 - lse_s[c]) : 0.0f;
                    if (drop.threshold) {
                        st[nt][i] = p * f[nt][i];
                        dpt[nt][i] = p * (f[nt][i] * dpt[nt][i] - d_s[c]) * scale;
                    } else {
                        st[nt][i] = p;
                        dpt[nt][i] = p * (dpt[nt][i] - d_s[c]) * scale;
                    }
                }
            uint32_t pa[Cfg::BC / 16][4];
            att_mma_to_a<HS>(pa, st);
            att_mma_accumulate<HS>(dv, pa, dOs);
            att_mma_to_a<HS>(pa, dpt);
            att_mma_accumulate<HS>(dk, pa, Qs);
        }
        __syncthreads();
    }
    const float one[2] = {1.0f, 1.0f};
    floatX* drows = dqkv + (size_t)at.b * T * ld + (size_t)at.h * HS;
    att_mma_store_rows<HS>(drows + C, ld, r0, T, dk, one);
    att_mma_store_rows<HS>(drows + 2 * C, ld, r0, T, dv, one);
}

#endif
