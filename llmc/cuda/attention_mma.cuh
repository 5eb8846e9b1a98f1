/*
 * Causal self-attention with inline-PTX tensor-core instructions (BF16 and
 * FP16 builds, sm_80+, head sizes 64 and 128): the same shapes, outputs and
 * algorithm as attention.cuh (read its header first), in FlashAttention-2's
 * arrangement. Other head sizes run attention_tc.cuh's WMMA kernels.
 *
 * Instructions (llmc/cuda/ptx.cuh): mma.sync.aligned.m16n8k16 (16-bit inputs,
 * fp32 accumulation) for every tile product, ldmatrix (.x4, .x4.trans) for
 * every operand read from shared memory, cp.async.cg 16-byte copies for every
 * tile staged from global memory.
 *
 * Work split: a block of ATT_MMA_WARPS warps owns rows of one (b, K/V head):
 * in the forward and the backward's dQ kernel packed query rows (att_pack,
 * attention.cuh: each warp 16 MT consecutive rows of one of the group's
 * query heads, so a block's K/V tiles serve up to NH/NKV query heads; for
 * GPT-2 ATT_MMA_ROWS (forward: FWD_ROWS) rows of one head, as before), in
 * the dK/dV kernel ATT_MMA_ROWS keys, whose one double-buffered
 * pipeline streams the query tiles of each head of the K/V head's group in
 * turn: attention.cuh's header, grouped-query attention); warp w owns 16 of them (query rows as mma A fragments in
 * registers; the dK/dV kernel reads its K and V rows from shared memory). The other side streams
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
 * two shuffles), O = diag(corr) O + P V. The backward splits FlashAttention-2's
 * 5 tile products per tile pair into a dK/dV kernel over key tiles (S^T,
 * dP^T, dV, dK) and a dQ kernel over query tiles (S, dP, dQ): 7 products,
 * no atomics, no partial sums, and B*NH*ceil(T/64) blocks in each (see
 * "backward" below for the counts behind the choice).
 *
 * Attention dropout (dropout.h): with drop.threshold > 0 the forward
 * multiplies P by the mask's factors (0 or 1/keep) before P V, its lse
 * staying that of the undropped P; the backward draws the same bits for dV
 * (dropped P) and dS = P (factor dP - D). One Philox call per lane per 16x16
 * block in every kernel (att_mma_drop_rows, att_mma_drop_cols).
 *
 * Packed documents (blk.a.doc_start, the whole-sequence launches' too;
 * attention.cuh's header and llmc/core/documents.h): query t sees key s only when
 * s >= its document's start as well. The starts never decrease along a row,
 * so the forward and the dQ kernel begin at the key tile holding the block's
 * first row's start, a warp skips a tile whose keys all precede its first
 * row's start (the least of its rows'), and each element of the remaining
 * tiles is masked by its row's start; the dK/dV kernel streams query tiles
 * only up to the last query whose document starts at or before the block's
 * last key (att_queries_end), a warp skips the tiles past its last key's,
 * and each element is masked by its key row's end (a binary search per
 * lane and key row, before the loop). Without documents every start is 0 and
 * every end the last row: the causal mask alone.
 *
 * Resources, from `nvcc -Xptxas -v` (sm_90, CUDA 13.0.88, BF16 and FP16
 * builds alike, document masks included), every kernel compiled under its
 * register budget (AttMmaRegs below: 240, the dQ block kernels 255 and 248) with
 * 0 bytes of stack and no spills (registers / shared memory bytes; blocks per
 * sm_90 SM):
 *   forward      hs64 240 / 36864 static (2)   hs128 192 / 34816 static (2)
 *   backward dkv hs64 233 / 56320 dynamic (2)  hs128 232 / 70144 dynamic (2)
 *   backward dq  hs64 236 / 36864 static (2)   hs128 230 / 34816 static (2)
 *   rowsum (256)  32 / 0
 * and their attention-tile instantiations (TILE = true, for context
 * parallelism's ring; below): forward hs64 240 (one M-tile per warp),
 * hs128 229; dkv hs64 235, hs128 236; dq hs64 248, hs128 240 (same shared
 * memory, 2 blocks per SM). These are the GPT-2-only kernels' figures;
 * with grouped-query heads (AttHeads; the K/V head is query head / group)
 * the sm_90 BF16 report read forward hs64 238, hs128 196 (tiles 237, 231),
 * dkv hs64 228, hs128 230 (tiles 238, 232), dq hs64 239, hs128 232 (tiles
 * 255 and about 246 under budgets 255 and 248, the K/V rows' pointer in
 * shared memory: +8 bytes of static shared memory in the dQ kernels), no
 * spills; still 2 blocks per SM each. With packed grouped-query rows
 * (att_pack; CUDA 13.0, BF16) the forward reads hs64 240, hs128 188 (tiles
 * 228, 233) and the dQ kernel hs64 234, hs128 236 (tiles 245, 248), no
 * spills; the hs64 forward spilled (20-44 bytes) until its warps' b NH + h
 * went to shared memory (+16 bytes static) and the K/V rows' pointers were
 * taken from the block's K/V head (blockIdx.y) rather than the warp's
 * query head. The whole-sequence dK/dV kernel's narrow blocks
 * (attention_mma_dkv_warps; sm_90, BF16 and FP16 alike, same budget): 2 warps
 * hs64 228, hs128 230 registers / 47104, 52736 bytes (4 blocks, 8 warps
 * per SM), 1 warp 230, 230 / 42496, 44032 (5 blocks, 5 warps per SM), no
 * spills. Under the compiler's own choice (255 allowed)
 * they took 250-255 registers and the tile kernels a 16-byte stack frame
 * (dropout words indexed at run time, now selected: dropout_keeps); the
 * hs128 forward took 168 registers (3 blocks per SM) and takes 192 (2) under
 * the budget: which is faster is unmeasured on a GPU. The forward reads its
 * rows' own document starts only in the tiles that cross one (k0 below the
 * warp's last row's start): held across the key loop they made the hs64
 * forward spill (68 bytes at 240 registers, 48 at 248).
 * AttMmaResources at the end of the file holds the budgets and shared memory;
 * static_asserts check them against the layouts (the recorded shared memory
 * must be what the layout computes) and the blocks per SM they give by the
 * occupancy rules (att_sm90_blocks_per_sm), so a layout change must update
 * the table; `make cuda-all` runs dev/ptxas_check.py on the budgets.
 * The forward at hs64 gives each warp two M-tiles (32 query rows): 240
 * registers and 2 blocks (8 warps, 256 rows) per SM, against 128 registers
 * and 4 blocks of one M-tile (16 warps, the same 256 rows) with half the
 * shared-memory bytes per FLOP. At hs128 two M-tiles hold Q fragments (64
 * registers), O accumulators (128) and scores (32) live at once, 224 before
 * addresses, masks and softmax state, against the 255 limit, so hs128 keeps
 * one M-tile (counted, not compiled: its 128 Q rows would also need both
 * staging buffers). The occupancy and every speed figure are predicted.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_ATTENTION_MMA_CUH
#define REMAT_ATTENTION_MMA_CUH

#include "cuda_common.cuh"
#include "attention_tc.cuh"
#include "ptx.cuh"
#include "rope.cuh"
#include "../core/dropout.h"

#define ATT_MMA_WARPS 4
#define ATT_MMA_ROWS (16 * ATT_MMA_WARPS) /* rows owned by a block */
#define ATT_MMA_THREADS (32 * ATT_MMA_WARPS)

/* Register budget of the mma kernels (ptxas -v, sm_90), asserted at build:
 * dev/ptxas_check.py (run by `make cuda-all` and dev/gpu_check.sh) fails when
 * a kernel uses more registers than its budget, spills, or has a stack frame.
 * Why: 255 is the hardware limit, and at 250-255 registers a small change (a
 * mask, another toolchain's allocation) spills into local memory inside the
 * inner loop with nothing but a slower kernel to show. __maxnreg__ makes
 * ptxas allocate within the budget; 240 leaves 15 registers of headroom and
 * keeps the backward's 2 blocks (8 warps) per SM (the occupancy asserts of
 * AttMmaResources use these figures). The dQ attention-tile kernels, whose
 * K/V head is query head / group (grouped-query attention), spill at 240
 * (CUDA 13.0; hs64: 8 bytes at 248, hs128: 16 at 240): their budgets are 255
 * (hs64) and 248 (hs128), both still 2 blocks (8 warps) per SM, until they
 * are reduced. */
#define ATT_MMA_MAX_REGS 240
#define ATT_MMA_MAX_REGS_DQ_TILE64 255
#define ATT_MMA_MAX_REGS_DQ_TILE128 248
#define ATT_MMA_MAX_STACK_BYTES 0
template <int HS, bool TILE> struct AttMmaRegs {
    static constexpr int FWD = ATT_MMA_MAX_REGS, DKV = ATT_MMA_MAX_REGS;
    static constexpr int DQ = TILE ? (HS == 64 ? ATT_MMA_MAX_REGS_DQ_TILE64 : ATT_MMA_MAX_REGS_DQ_TILE128) : ATT_MMA_MAX_REGS;
};

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
    /* forward: M-tiles of 16 query rows per warp (2 where the registers allow: hs 64), rows per block */
    static constexpr int FWD_MT = HS == 64 ? 2 : 1;
    static constexpr int FWD_ROWS = 16 * FWD_MT * ATT_MMA_WARPS;
    static_assert(ROWS_BYTES <= STAGE_BYTES && (size_t)FWD_ROWS * LD * sizeof(floatX) <= STAGE_BYTES,
                  "the block's own rows are staged in the second buffer");
    static_assert(SMEM_BYTES <= 48 * 1024, "static shared memory above 48 KiB");
    static_assert(sizeof(floatX) == 2, "mma attention is for 16-bit floatX");
};

/* Buffer j % 2 of the double buffer (computed, not indexed: no local array). */
template <int HS> __device__ __forceinline__ floatX* att_mma_buffer(unsigned char* smem, int j) {
    return (floatX*)(smem + (j & 1) * AttMma<HS>::STAGE_BYTES);
}

/* Stages rows [r0, r0+rows) of a (T, ld)-strided head slice (base: row 0,
 * this head's channel 0) into dst (stride LD): cp.async 16 bytes a copy,
 * zeros past T. Every thread of the block takes part (N = ATT_MMA_THREADS;
 * a narrow dK/dV block's 32 or 64; N = 32 in a whole block: every lane of
 * the calling warp, which stages its own rows); the caller commits. */
template <int HS, int N = ATT_MMA_THREADS>
__device__ __forceinline__ void att_mma_stage(floatX* dst, const floatX* base, size_t ld, int r0, int rows, int T) {
    constexpr int CHUNKS = HS / 8;
    for (int i = threadIdx.x % N; i < rows * CHUNKS; i += N) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        floatX* d = dst + r * AttMma<HS>::LD + c;
        if (r0 + r < T) ptx_cp_async16<true>(d, base + (size_t)(r0 + r) * ld + c);
        else *reinterpret_cast<uint4*>(d) = uint4{0u, 0u, 0u, 0u};
    }
}

/* Stages one tile of the double buffer: rows [r0, r0+BC) of a (ld_a rows)
 * and of b (ld_b rows) into buf and buf + BC rows (K and V, or Q and dO), as
 * att_mma_stage. */
template <int HS, int THREADS = ATT_MMA_THREADS>
__device__ __forceinline__ void att_mma_stage_tile(floatX* buf, const floatX* a, size_t ld_a, const floatX* b, size_t ld_b, int r0, int T) {
    att_mma_stage<HS, THREADS>(buf, a, ld_a, r0, AttMma<HS>::BC, T);
    att_mma_stage<HS, THREADS>(buf + AttMma<HS>::BC * AttMma<HS>::LD, b, ld_b, r0, AttMma<HS>::BC, T);
}

/* A fragments of a warp's 16 rows (shared, stride LD, first row `rows`): a[ks] covers channels 16ks..16ks+15. */
template <int HS> __device__ __forceinline__ void att_mma_load_a(uint32_t a[][4], const floatX* rows) {
    const int lane = threadIdx.x & 31;
    const floatX* p = rows + ((lane & 7) + ((lane >> 3) & 1) * 8) * AttMma<HS>::LD + (lane >> 4) * 8;
#pragma unroll
    for (int ks = 0; ks < AttMma<HS>::KS; ks++) ptx_ldmatrix<4, false>(a[ks], p + ks * 16);
}

/* s[mt][nt] = a[mt] (16 x HS) times tile^T, tile rows (BC of them, stride
 * LD) as columns: s[mt] is 16 x BC, for MT M-tiles of 16 rows; each B
 * fragment read from shared memory feeds all MT of them. */
template <int HS, int MT>
__device__ __forceinline__ void att_mma_scores(float s[][AttMma<HS>::NT][4], uint32_t a[][AttMma<HS>::KS][4], const floatX* tile) {
    typedef AttMma<HS> Cfg;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) s[mt][nt][i] = 0.0f;
    /* ldmatrix.x4: matrices (rows +0..7 | +8..15) x (channels +0..7 | +8..15) give the B fragments of two column blocks */
    const floatX* p = tile + ((lane & 7) + (lane >> 4) * 8) * Cfg::LD + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < Cfg::KS; ks++)
#pragma unroll
        for (int n2 = 0; n2 < Cfg::NT / 2; n2++) {
            uint32_t b[4];
            ptx_ldmatrix<4, false>(b, p + n2 * 16 * Cfg::LD + ks * 16);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                ptx_mma_m16n8k16(s[mt][2 * n2], a[mt][ks], b, s[mt][2 * n2]);
                ptx_mma_m16n8k16(s[mt][2 * n2 + 1], a[mt][ks], b + 2, s[mt][2 * n2 + 1]);
            }
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

/* acc[mt] (16 x HS) += pa[mt] (16 x BC) times tile (BC rows x HS channels,
 * stride LD), tile read transposed, for MT M-tiles: each B fragment feeds all MT. */
template <int HS, int MT>
__device__ __forceinline__ void att_mma_accumulate(float acc[][AttMma<HS>::OT][4], uint32_t pa[][AttMma<HS>::BC / 16][4], const floatX* tile) {
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
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                ptx_mma_m16n8k16(acc[mt][2 * o2], pa[mt][kk], b, acc[mt][2 * o2]);
                ptx_mma_m16n8k16(acc[mt][2 * o2 + 1], pa[mt][kk], b + 2, acc[mt][2 * o2 + 1]);
            }
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

/* RoPE's turn back (rope.cuh) of a warp's 16 rows r0.. of sequence b of
 * dQ or dK in the accumulators' layout, before att_mma_store_rows: this
 * lane's channel 8 ot + 2 tq + k of n-tile ot < OT/2 pairs with the same
 * place of n-tile ot + OT/2 (channel + HS/2), both in its registers. Rows
 * >= T are left alone. */
template <int HS>
__device__ __forceinline__ void att_mma_rope_back(float acc[][4], const RopeRows& rope, int b, int r0, int T) {
    constexpr int HALF = AttMma<HS>::OT / 2;
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int t = r0 + g + 8 * hf;
        if (t >= T) continue;
        const double pos = rope_position_at(rope, b, t);
#pragma unroll
        for (int ot = 0; ot < HALF; ot++)
#pragma unroll
            for (int k = 0; k < 2; k++) {
                float co, si;
                rope_cos_sin(pos, rope.table.inv_freq[ot * 8 + 2 * tq + k], rope.table.mscale, -1, &co, &si);
                rope_turn(&acc[ot][2 * hf + k], &acc[ot + HALF][2 * hf + k], co, si);
            }
    }
}

/* att_mma_drop_rows (COLS false: queries t0.. as rows, keys u0.. as
 * columns) or att_mma_drop_cols (COLS true: the transpose) at global
 * positions (an attention tile's q0, k0): their one call per 16x16 block
 * where t0 and u0 are multiples of 16, else one call per element (32 or 16 a
 * lane and tile: the slow path of blocks at odd offsets). */
template <int HS, bool COLS>
__device__ __forceinline__ void att_mma_drop_at(float f[][4], const DropoutSite& drop, int bh, int T, int t0, int u0) {
    if (((t0 | u0) & 15) == 0) {
        if constexpr (COLS) att_mma_drop_cols<HS>(f, drop, bh, T, t0, u0);
        else att_mma_drop_rows<HS>(f, drop, bh, T, t0, u0);
        return;
    }
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nt = 0; nt < AttMma<HS>::NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = g + 8 * (i >> 1), col = nt * 8 + 2 * tq + (i & 1); /* the accumulator element's */
            f[nt][i] = dropout_keep_attention(&drop, bh, T, COLS ? t0 + col : t0 + row, COLS ? u0 + row : u0 + col) ? drop.scale : 0.0f;
        }
}

/* Adds a warp's 16 x HS accumulators to rows r0.. of an fp32 tensor (rows:
 * row 0, this head's channel 0; stride ld), rows t with lo <= t < hi only:
 * an attention tile's backward epilogue. */
template <int HS>
__device__ __forceinline__ void att_mma_add_rows(float* rows, size_t ld, int r0, int lo, int hi, const float acc[][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int t = r0 + g + 8 * half;
        if (t < lo || t >= hi) continue;
        float* row = rows + (size_t)t * ld + 2 * tq;
#pragma unroll
        for (int ot = 0; ot < AttMma<HS>::OT; ot++) {
            float2* p = reinterpret_cast<float2*>(row + ot * 8);
            float2 v = *p;
            v.x += acc[ot][2 * half];
            v.y += acc[ot][2 * half + 1];
            *p = v;
        }
    }
}

/* An attention tile's forward epilogue for a warp's 16 query rows r0..
 * (accumulators o, raw-score maxima m and this lane's sums l of the two row
 * halves): each row some key of the tile reaches (r0 + ... < nq, t + diag
 * >= 0) gets its normalised output and lse written (first) or merged into
 * out_acc (rows: row 0, this head's channel 0; stride C) and lse (row 0's
 * statistic) by log-sum-exp, as the CPU's attention_merge. A row's lse is
 * read and written by lane tq 0 of its four alone; the others get the old
 * value by a shuffle. Documents: a row may see none of the tile's keys (its
 * sum is 0; else at least 1, its largest score's term); a first tile then
 * writes an empty part (0, lse -inf) for later ones to merge into, a later
 * one leaves the row alone. */
template <int HS>
__device__ __forceinline__ void att_mma_merge_rows(float* rows, size_t C, float* lse, int r0, int nq, int diag, int first, const float o[][4],
                                                   const float m[2], const float l[2], float scale) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    float sum[2], old[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int t = r0 + g + 8 * half;
        sum[half] = att_mma_quad_sum(l[half]);
        old[half] = __shfl_sync(0xffffffffu, (tq == 0 && !first && t < nq && t + diag >= 0 && sum[half] > 0.0f) ? lse[t] : 0.0f, lane & ~3);
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int t = r0 + g + 8 * half;
        const bool any = sum[half] > 0.0f;
        if (t >= nq || t + diag < 0 || !(any || first)) continue;
        const float lpart = any ? m[half] * scale + logf(sum[half]) : -INFINITY, inv = any ? 1.0f / sum[half] : 0.0f;
        const float merged = first ? lpart : att_merged_lse(old[half], lpart);
        const float w0 = first ? 0.0f : expf(old[half] - merged), w1 = first ? 1.0f : expf(lpart - merged);
        float* row = rows + (size_t)t * C + 2 * tq;
#pragma unroll
        for (int ot = 0; ot < AttMma<HS>::OT; ot++) {
            float2* p = reinterpret_cast<float2*>(row + ot * 8);
            const float a = o[ot][2 * half] * inv, b = o[ot][2 * half + 1] * inv;
            if (first) {
                *p = make_float2(a, b);
            } else {
                const float2 v = *p;
                *p = make_float2(v.x * w0 + a * w1, v.y * w0 + b * w1);
            }
        }
        if (tq == 0) lse[t] = merged;
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
 * grid att_pack_grid(B, T, NH, NKV, 16 FWD_MT, ATT_MMA_WARPS): (ceil(G
 * ceil(T/(16 FWD_MT)) / 4), B*NKV), (ceil(T/FWD_ROWS), B*NH) for GPT-2;
 * block ATT_MMA_THREADS; query blocks last-first. Warp w owns FWD_MT
 * M-tiles of 16 query rows of query head h (packed rows, att_pack), rows
 * r0 .. r0 + 16 FWD_MT - 1: every K and V fragment read from shared memory feeds all
 * of them (FWD_MT = 2 halves the shared-memory bytes per FLOP). An M-tile
 * whose rows all precede a key tile its warp still needs computes it as
 * fully masked, an exact no-op (corr = 1, P = 0), so each row's result is
 * the same whatever FWD_MT. ptxas (sm_90): AttMmaResources below. */
/* M-tiles per warp and rows per block of the forward: the whole sequence's
 * FWD_MT; an attention tile's one M-tile (the merge epilogue on top of two
 * M-tiles spills at hs64). */
template <int HS, bool TILE> struct AttMmaForward {
    static constexpr int MT = TILE ? 1 : AttMma<HS>::FWD_MT;
    static constexpr int ROWS = 16 * MT * ATT_MMA_WARPS;
};

template <int HS, bool TILE>
__global__ void __maxnreg__((AttMmaRegs<HS, TILE>::FWD)) /* launched with ATT_MMA_THREADS */
attention_mma_forward_kernel(floatX* out, float* lse, const floatX* qkv, int T, const AttHeads hd, float scale, const DropoutSite drop,
                             const AttTileArgs blk) {
    typedef AttMma<HS> Cfg;
    constexpr int MT = AttMmaForward<HS, TILE>::MT;
    __shared__ __align__(128) unsigned char smem[Cfg::SMEM_BYTES];
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, tq = threadIdx.x & 3;
    /* packed grouped-query rows (att_pack): the warp's 16 MT rows r0.. of query head h; K, V: the block's K/V head */
    const AttPack pk = att_pack(hd, 16 * MT, ATT_MMA_WARPS, warp, true);
    const int h = pk.h, r0 = pk.r0;
    const AttSpan sp = att_span<TILE>(qkv, T, hd, blk, pk.b, h, pk.kvh);
    /* the warp's b NH + h, read from shared memory where needed (dropout, the epilogue): held in a register
     * across the key loop, it and the pointers derived from it made the hs64 forward spill; visible after the
     * first barrier */
    __shared__ int warp_bh[ATT_MMA_WARPS];
    if ((threadIdx.x & 31) == 0) warp_bh[warp] = pk.b * hd.NH + h;
    const int kend = min(pk.last + 1 + sp.diag, sp.nk);
    if constexpr (TILE)
        if (kend <= 0) return; /* the block's mask empties these rows: no copies are started that nothing waits for */
    /* documents: key tiles before the block's first row's start are skipped (tile j is keys (j0 + j) BC ..) */
    const int j0 = att_first_key(blk, sp, pk.first) / Cfg::BC;
    const int ntiles = max((kend + Cfg::BC - 1) / Cfg::BC - j0, 0);

    /* Q into the second buffer: each warp its own rows */
    att_mma_stage<HS, 32>(att_mma_buffer<HS>(smem, 1) + 16 * MT * warp * Cfg::LD, sp.q, sp.q_ld, r0, 16 * MT, sp.nq);
    ptx_cp_async_commit();
    if (!TILE || ntiles > 0) { /* an attention tile's rows may see no key of it (documents): then only the epilogue runs */
        att_mma_stage_tile<HS>(att_mma_buffer<HS>(smem, 0), sp.k, sp.kv_ld, sp.v, sp.kv_ld, j0 * Cfg::BC, sp.nk);
    }
    ptx_cp_async_commit();
    ptx_cp_async_wait<1>(); /* Q has landed */
    __syncthreads();
    uint32_t q[MT][Cfg::KS][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) att_mma_load_a<HS>(q[mt], att_mma_buffer<HS>(smem, 1) + 16 * (MT * warp + mt) * Cfg::LD);
    __syncthreads(); /* the second buffer is free for tile 1 */

    float o[MT][Cfg::OT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int ot = 0; ot < Cfg::OT; ot++)
#pragma unroll
            for (int i = 0; i < 4; i++) o[mt][ot][i] = 0.0f;
    /* per M-tile and row half (rows r0+16mt+g, +8): running max of the raw scores, this lane's part of the sum */
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) m[mt][hf] = -INFINITY, l[mt][hf] = 0.0f;
    const float scale_log2 = scale * 1.4426950408889634f;
    /* documents: the first key of the warp's first row (the least of its rows': starts never decrease) and
     * of its last (the greatest): tiles from there on need no row's own first key */
    const int kwarp = att_first_key(blk, sp, r0), kwarp_last = att_first_key(blk, sp, r0 + 16 * MT - 1);
    for (int j = 0; j < ntiles; j++) {
        if (j + 1 < ntiles) att_mma_stage_tile<HS>(att_mma_buffer<HS>(smem, j + 1), sp.k, sp.kv_ld, sp.v, sp.kv_ld, (j0 + j + 1) * Cfg::BC, sp.nk);
        ptx_cp_async_commit(); /* possibly empty: the group count stays one per tile */
        ptx_cp_async_wait<1>(); /* tile j has landed (this thread's copies) */
        __syncthreads();        /* ... and every thread's */
        const int k0 = (j0 + j) * Cfg::BC;
        /* else every key of the tile is after every query of this warp, or before every query's document */
        if (k0 <= r0 + 16 * MT - 1 + sp.diag && k0 + Cfg::BC > kwarp) {
            const floatX* Ks = att_mma_buffer<HS>(smem, j);
            const floatX* Vs = Ks + Cfg::BC * Cfg::LD;
            float s[MT][Cfg::NT][4];
            att_mma_scores<HS, MT>(s, q, Ks);
            uint32_t pa[MT][Cfg::BC / 16][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const int rm = r0 + 16 * mt;
                int kf[2] = {0, 0}; /* documents: each row's first key, read only where the tile crosses one */
                if (k0 < kwarp_last) kf[0] = att_first_key(blk, sp, rm + g), kf[1] = att_first_key(blk, sp, rm + g + 8);
                float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int key = k0 + nt * 8 + 2 * tq + (i & 1), t = rm + g + 8 * (i >> 1);
                        if (!(key <= t + sp.diag && key < sp.nk && key >= kf[i >> 1])) s[mt][nt][i] = -INFINITY;
                        mx[i >> 1] = fmaxf(mx[i >> 1], s[mt][nt][i]);
                    }
                float corr[2], ref[2];
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const float mnew = fmaxf(m[mt][hf], att_mma_quad_max(mx[hf]));
                    ref[hf] = mnew == -INFINITY ? 0.0f : mnew; /* all masked so far: keep exp2 away from inf - inf */
                    corr[hf] = exp2f((m[mt][hf] - ref[hf]) * scale_log2);
                    m[mt][hf] = mnew;
                    l[mt][hf] *= corr[hf];
                }
#pragma unroll
                for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        s[mt][nt][i] = exp2f((s[mt][nt][i] - ref[i >> 1]) * scale_log2);
                        l[mt][i >> 1] += s[mt][nt][i];
                    }
#pragma unroll
                for (int ot = 0; ot < Cfg::OT; ot++)
#pragma unroll
                    for (int i = 0; i < 4; i++) o[mt][ot][i] *= corr[i >> 1];
                if (drop.threshold) { /* l sums the undropped P; P V takes the dropped one */
                    float f[Cfg::NT][4];
                    if constexpr (TILE) att_mma_drop_at<HS, false>(f, drop, warp_bh[warp], sp.T, sp.tq0 + rm, sp.tk0 + k0);
                    else att_mma_drop_rows<HS>(f, drop, warp_bh[warp], T, rm, k0);
#pragma unroll
                    for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                        for (int i = 0; i < 4; i++) s[mt][nt][i] *= f[nt][i];
                }
                att_mma_to_a<HS>(pa[mt], s[mt]);
            }
            att_mma_accumulate<HS, MT>(o, pa, Vs);
        }
        __syncthreads(); /* buffer j & 1 is no longer read: tile j + 2 goes there */
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        if constexpr (TILE) {
            att_mma_merge_rows<HS>(blk.acc + sp.qrow * hd.out_ld + (size_t)h * HS, hd.out_ld, lse + sp.stat, r0 + 16 * mt, sp.nq, sp.diag, blk.first, o[mt],
                                   m[mt], l[mt], scale);
        } else {
            float inv[2];
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const float sum = att_mma_quad_sum(l[mt][hf]);
                inv[hf] = 1.0f / sum;
                const int t = r0 + 16 * mt + g + 8 * hf;
                if (tq == 0 && t < T) lse[(size_t)warp_bh[warp] * T + t] = m[mt][hf] * scale + logf(sum);
            }
            const int bh = warp_bh[warp], b = bh / hd.NH;
            att_mma_store_rows<HS>(out + (size_t)b * T * hd.out_ld + (size_t)(bh - b * hd.NH) * HS, hd.out_ld, r0 + 16 * mt, T, o[mt], inv);
        }
    }
}

/* ---- attention tiles (TILE = true) ----
 * The forward, dK/dV and dQ kernels run an AttentionTile (attention.cuh's
 * gpu_attention_tile_*): query rows i < Tq from local row qi of qkv, key
 * rows j < Tk from local row ki of kv (stride kv_ld, K at 0, V at C), key j
 * seen by query i when j <= i + diag (diag = q0 - k0). Tiles are cut on the
 * tile's local indices, so a tile straddles the diagonal wherever diag is
 * no multiple of the tile: the tile skip tests (a warp's last query + diag
 * against the tile's first key, and the reverse) and the per-element mask
 * take diag. The dK/dV kernel streams the query tiles from the first query
 * that sees its first key (max(s0 - diag, 0)); a CTA whose rows the mask
 * empties returns before starting any copy. Dropout draws at the global
 * positions (q0 + i, k0 + j) of a sequence of T tokens: one Philox call per
 * lane and 16x16 block where q0 and k0 are multiples of 16 (then every
 * tile's first row and column are), one per element otherwise
 * (att_mma_drop_at). Epilogues in fp32: the
 * forward writes (first) or merges by log-sum-exp (att_mma_merge_rows) the
 * normalised output and lse of each row a key reaches; the backward adds dQ
 * (rows a key reaches) and dK, dV (keys a query reaches) with float2 loads
 * and stores (att_mma_add_rows). With documents a forward tile's row may
 * see none of its keys (a CTA none at all: it stages no key tile and runs
 * the epilogue alone), which att_mma_merge_rows writes as an empty part
 * where the tile is the first and leaves alone otherwise; the backward's
 * CTAs whose rows see no key return at once. The forward keeps one M-tile
 * per warp (AttMmaForward): two with the merge epilogue spill at hs64. The
 * whole-sequence instantiations (TILE = false) keep their expressions and
 * registers (AttMmaResources). */

/* ---- backward ----
 * Three kernels, nothing summed across blocks and no scratch but D:
 *  1. attention_mma_rowsum_kernel: D_t = dout_t . out_t (fp32) of every row.
 *  2. attention_mma_backward_dkv_kernel: grid (ceil(T/64), B*NKV), key tiles
 *     first-first (the longest first); block (j, bh) owns key tile j,
 *     ATT_MMA_ROWS keys, K_j and V_j in shared memory, warp w keys
 *     16w..16w+15; the query tiles of BC rows from the first at or after
 *     key 64j stream through the double buffer (Q, dO, their lse and D).
 *     Where that grid leaves SMs idle (few K/V heads, short T) the launch
 *     splits each block into 2 or 4 blocks of fewer warps, each warp doing
 *     exactly the wide block's warp's work (attention_mma_dkv_warps).
 *     Per query tile, warp w: S^T = K Q^T, dP^T = V dO^T, P from the
 *     forward's logsumexp, dV += P^T dO and dK += dS^T Q, P^T and dS^T as A
 *     fragments straight from the accumulators (4 tile products).
 *  3. attention_mma_backward_dq_kernel: grid (ceil(G ceil(T/16) / 4),
 *     B*NKV) (GPT-2: (ceil(T/64), B*NH)), query blocks last-first, the
 *     forward's arrangement: warp w owns 16 packed query rows of one head, Q and dO as A fragments in registers, lse and D of its rows in
 *     registers; key tiles of BC rows (K, V) stream through the double
 *     buffer up to the diagonal. Per key tile: S = Q K^T, dP = dO V^T,
 *     dS = P (dP - D) scale, dQ += dS K (3 tile products).
 * Each output element is one thread's, accumulated in a fixed order (query
 * tiles ascending for dK, dV; key tiles ascending for dQ): deterministic
 * without atomics, so every recompute setting is bitwise equal.
 *
 * Why this split (the 7-product split) and not FlashAttention-2's fused 5
 * products with dQ summed across key tiles: counts per (64-key, 64-query)
 * pair of tiles, head size HS, bytes loaded by a block from global memory
 * (L2 or HBM):
 *   fused: 5 x 2*64*64*HS = 40960 HS FLOPs; Q, dO 2*64*HS*2 = 256 HS bytes
 *          plus the dQ partial sums read and written in fp32, 2*64*HS*4 =
 *          512 HS: 768 HS bytes. Blocks B*NH*S, scratch S*4*B*T*C bytes for
 *          S key-tile segments (no atomics).
 *   split: dK/dV 4 products, 32768 HS FLOPs, Q and dO 256 HS bytes; dQ 3
 *          products, 24576 HS FLOPs, K and V 256 HS bytes: 57344 HS FLOPs
 *          (1.4x), 512 HS bytes (2/3), no scratch, B*NH*ceil(T/64) blocks
 *          in each kernel.
 * At B=1, NH=16, T=131072 the fused layout has 16 S blocks: 264 blocks in
 * flight (2 per SM on an H200's 132) need S >= 17, 68*B*T*C bytes of
 * scratch against the layer's Q, K, V of 6*B*T*C; the split has 32768
 * blocks per kernel. Where B*NH alone fills the GPU (S = 1), the fused
 * pair's 512 HS bytes of partials go to HBM once 4*B*T*C passes L2 (50 MB:
 * B*T*C above 12.5M, e.g. 4 x 2048 x 1536), and at H200 rates (989 TFLOP/s
 * dense 16-bit, 4.8 TB/s) a pair at HS=128 costs >= 13.7 ns of HBM against
 * the split's 7.4 ns of tensor-core time at peak for its 7.3 MFLOP: the
 * split is not predicted slower there either, so every shape runs it (one
 * route, nothing for the plan to choose). Predicted, not measured. */

/* D_t of every row: thread per (b, t, h), 16-byte loads, fp32 products summed in channel order.
 * grid ceil(B*T*NH / 256), block 256. */
template <int HS>
__global__ void __launch_bounds__(256) attention_mma_rowsum_kernel(float* rowsum, const floatX* dout, const floatX* out, int B, int T, int NH) {
    const size_t idx = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (idx >= (size_t)B * T * NH) return;
    const int h = (int)(idx % NH);
    const size_t bt = idx / NH;
    const size_t off = bt * NH * HS + (size_t)h * HS;
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < HS; c += XVEC) {
        const Vec<floatX, XVEC> d = vload<XVEC>(dout + off + c), o = vload<XVEC>(out + off + c);
#pragma unroll
        for (int k = 0; k < XVEC; k++) acc += to_f32(d.v[k]) * to_f32(o.v[k]);
    }
    const size_t b = bt / T, t = bt % T;
    rowsum[(b * NH + h) * T + t] = acc;
}

/* Where a backward kernel's rows are, for one (b, h): an attention tile's
 * (AttSpan), or the whole sequence's in the expressions whose code (and
 * register count, AttMmaResources) the TILE = false instantiations keep.
 * q, k, v, dout: row 0 of this head's slices (k, v: its K/V head's; rows
 * ld, kv_ld, kv_ld, NH HD apart); stat: the index of query 0's statistics (lse, D); nq query and nk
 * key rows, key j seen by query i when j <= i + diag. */
struct AttMmaRows {
    const floatX *q, *k, *v, *dout;
    size_t ld, kv_ld, stat;
    int nq, nk, diag;
};

template <int HS, bool TILE>
__device__ __forceinline__ AttMmaRows att_mma_rows(const AttSpan& sp, const floatX* dout, int T, const AttHeads hd, int h) {
    return AttMmaRows{sp.q, sp.k, sp.v, dout + sp.qrow * hd.out_ld + (size_t)h * HS, (size_t)hd.q_ld, sp.kv_ld, sp.stat,
                      TILE ? sp.nq : T, TILE ? sp.nk : T, TILE ? sp.diag : 0};
}

/* Shared memory of the dK/dV kernel of WARPS warps (dynamic: above the 48
 * KiB static limit): the Q/dO double buffer (AttMma::SMEM_BYTES), the
 * block's K and V rows (16 per warp), and per buffer the query rows' lse
 * (log2 units) and D. */
template <int HS, int WARPS = ATT_MMA_WARPS> struct AttMmaBwd {
    typedef AttMma<HS> Cfg;
    static constexpr size_t ROWS_BYTES = (size_t)16 * WARPS * Cfg::LD * sizeof(floatX);
    static constexpr size_t KV_OFF = Cfg::SMEM_BYTES;
    static constexpr size_t STATS_OFF = KV_OFF + 2 * ROWS_BYTES;
    static constexpr size_t SMEM_BYTES = STATS_OFF + 2 * 2 * Cfg::BC * sizeof(float);
    static_assert(STATS_OFF % 16 == 0, "ldmatrix rows are 16-byte aligned");
    static_assert(SMEM_BYTES <= 227 * 1024, "above an sm_90 block's shared memory");
};

/* WARPS: warps per block, ATT_MMA_WARPS (the wide kernel) or a divisor
 * (narrow: attention_mma_dkv_warps picks it where the wide grid leaves SMs
 * idle). Whatever the width, warp w of 64-key tile j computes keys 64j + 16w
 * .. + 15 exactly as the wide kernel's warp w: the same query tiles from the
 * same start (the 64-key tile's), the same order, skips, masks and
 * products, so every width gives the same bits; a narrow block is the
 * wide block's warps SPLIT ways (block x: tile x / SPLIT, warps (x % SPLIT)
 * WARPS ..), each block staging every Q/dO tile for its own warps. */
template <int HS, bool TILE, int WARPS = ATT_MMA_WARPS>
__global__ void __maxnreg__((AttMmaRegs<HS, TILE>::DKV)) /* launched with 32 WARPS threads */
attention_mma_backward_dkv_kernel(floatX* dqkv, const float* rowsum, const floatX* dout, const floatX* qkv, const float* lse, int T,
                                  const AttHeads hd, float scale, const DropoutSite drop, const AttTileArgs blk, const RopeRows rope) {
    typedef AttMma<HS> Cfg;
    typedef AttMmaBwd<HS, WARPS> Bwd;
    static_assert(ATT_MMA_WARPS % WARPS == 0, "a narrow block holds a whole share of the 64-key tile's warps");
    constexpr int THREADS = 32 * WARPS, SPLIT = ATT_MMA_WARPS / WARPS; /* blocks per 64-key tile */
    extern __shared__ __align__(128) unsigned char smem[];
    floatX* Ks = (floatX*)(smem + Bwd::KV_OFF);
    floatX* Vs = (floatX*)(smem + Bwd::KV_OFF + Bwd::ROWS_BYTES);
    float* stats = (float*)(smem + Bwd::STATS_OFF); /* [buffer][lse (log2 units), D][BC] */
    const int b = blockIdx.y / hd.NKV, kvh = blockIdx.y % hd.NKV, h0 = kvh * hd.group; /* the K/V head, its group's first query head */
    const int own = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3; /* own: the warp in this block */
    const int warp = (int)(blockIdx.x % SPLIT) * WARPS + own;                                /* ... and in the 64-key tile */
    const AttSpan sp = att_span<TILE>(qkv, T, hd, blk, b, h0);
    const AttMmaRows rw = att_mma_rows<HS, TILE>(sp, dout, T, hd, h0);
    const size_t stat_head = TILE ? (size_t)blk.a.Tl : (size_t)T; /* statistics of query head h0 + j at rw.stat + j stat_head */
    const int nqr = rw.nq, diag = rw.diag;
    const float scale_log2 = scale * 1.4426950408889634f;
    const int s0 = (int)(blockIdx.x / SPLIT) * ATT_MMA_ROWS, r0 = s0 + 16 * warp; /* the 64-key tile's first key, the warp's */
    const int kb = s0 + (int)(blockIdx.x % SPLIT) * 16 * WARPS;                   /* the block's first key */
    const int tstart = TILE ? max(s0 - diag, 0) : s0; /* the first query that sees key s0 */
    /* documents: no query past the last one whose document starts at or before the 64-key tile's last key (the
     * wide block's, at every width: the same query tiles) */
    const int tend = att_queries_end(blk, sp, tstart, min(s0 + ATT_MMA_ROWS, rw.nk) - 1);
    const int nq = (tend - tstart + Cfg::BC - 1) / Cfg::BC, nall = nq * hd.group;
    if constexpr (TILE)
        if (tstart >= tend) return; /* no query of the tile sees these keys: no copies are started that nothing waits for */
    /* step i: query head h0 + i / nq (the group's heads in order), its query
     * tile i % nq, rows tstart + (i % nq) BC .., into buffer i & 1 (Q, dO by
     * cp.async; lse, D by plain stores): one pipeline over the whole group */
    auto stage = [&](int i) {
        const int j = i / nq, t0 = tstart + (i - j * nq) * Cfg::BC;
        att_mma_stage_tile<HS, THREADS>(att_mma_buffer<HS>(smem, i), rw.q + (size_t)j * HS, rw.ld, rw.dout + (size_t)j * HS, hd.out_ld, t0, nqr);
        float* st = stats + (i & 1) * 2 * Cfg::BC;
        const size_t stat = rw.stat + (size_t)j * stat_head;
        for (int k = threadIdx.x; k < Cfg::BC; k += THREADS) {
            const int t = t0 + k;
            st[k] = t < nqr ? lse[stat + t] * 1.4426950408889634f : 0.0f;
            st[Cfg::BC + k] = t < nqr ? rowsum[stat + t] : 0.0f;
        }
    };
    att_mma_stage<HS, THREADS>(Ks, rw.k, rw.kv_ld, kb, 16 * WARPS, rw.nk); /* the block's own key rows */
    att_mma_stage<HS, THREADS>(Vs, rw.v, rw.kv_ld, kb, 16 * WARPS, rw.nk);
    stage(0);
    ptx_cp_async_commit();
    float dk[Cfg::OT][4], dv[Cfg::OT][4];
#pragma unroll
    for (int ot = 0; ot < Cfg::OT; ot++)
#pragma unroll
        for (int i = 0; i < 4; i++) dk[ot][i] = dv[ot][i] = 0.0f;
    /* documents: one past the last query that sees each of this lane's key rows (r0 + g, r0 + g + 8), and the warp's last key */
    const int tend_row[2] = {att_queries_end(blk, sp, tstart, r0 + g), att_queries_end(blk, sp, tstart, r0 + g + 8)};
    const int tend_warp = __shfl_sync(0xffffffffu, tend_row[1], 28);
    for (int i = 0; i < nall; i++) {
        if (i + 1 < nall) stage(i + 1);
        ptx_cp_async_commit(); /* possibly empty: one group per tile */
        ptx_cp_async_wait<1>(); /* tile i (and, with tile 0, K and V) has landed */
        __syncthreads();
        const int j = i / nq, t0 = tstart + (i - j * nq) * Cfg::BC, bh = b * hd.NH + h0 + j; /* dropout: the query head's */
        /* else every query of the tile is before every key of this warp, or after their documents: nothing to add */
        if (t0 + Cfg::BC - 1 + diag >= r0 && t0 < tend_warp) {
            const floatX* Qs = att_mma_buffer<HS>(smem, i);
            const floatX* dOs = Qs + Cfg::BC * Cfg::LD;
            const float* lse_s = stats + (i & 1) * 2 * Cfg::BC;
            const float* d_s = lse_s + Cfg::BC;
            float st[Cfg::NT][4], dpt[Cfg::NT][4];
            {
                uint32_t ka[Cfg::KS][4];
                att_mma_load_a<HS>(ka, Ks + 16 * own * Cfg::LD);
                att_mma_scores<HS, 1>(&st, &ka, Qs);
                att_mma_load_a<HS>(ka, Vs + 16 * own * Cfg::LD);
                att_mma_scores<HS, 1>(&dpt, &ka, dOs);
            }
            float f[Cfg::NT][4]; /* dropout factors: dV takes the dropped P, dS = P (f dP' - D) */
            if (drop.threshold) {
                if constexpr (TILE) att_mma_drop_at<HS, true>(f, drop, bh, sp.T, sp.tq0 + t0, sp.tk0 + r0);
                else att_mma_drop_cols<HS>(f, drop, bh, T, t0, r0);
            }
#pragma unroll
            for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const int c = nt * 8 + 2 * tq + (k & 1), t = t0 + c, s = r0 + g + 8 * (k >> 1);
                    const float p = (t + diag >= s && t < nqr && t < tend_row[k >> 1]) ? exp2f(st[nt][k] * scale_log2 - lse_s[c]) : 0.0f;
                    if (drop.threshold) {
                        st[nt][k] = p * f[nt][k];
                        dpt[nt][k] = p * (f[nt][k] * dpt[nt][k] - d_s[c]) * scale;
                    } else {
                        st[nt][k] = p;
                        dpt[nt][k] = p * (dpt[nt][k] - d_s[c]) * scale;
                    }
                }
            uint32_t pa[Cfg::BC / 16][4];
            att_mma_to_a<HS>(pa, st);
            att_mma_accumulate<HS, 1>(&dv, &pa, dOs);
            att_mma_to_a<HS>(pa, dpt);
            att_mma_accumulate<HS, 1>(&dk, &pa, Qs);
        }
        __syncthreads(); /* buffer i & 1 and its stats are no longer read: tile i + 2 goes there */
    }
    if constexpr (TILE) { /* keys some query of the tile sees: s <= nq - 1 + diag */
        float* rows = blk.acc + sp.krow * 2 * hd.kv_w + (size_t)kvh * HS;
        const int hi = min(sp.nk, sp.nq + sp.diag);
        att_mma_add_rows<HS>(rows, 2 * hd.kv_w, r0, 0, hi, dk);
        att_mma_add_rows<HS>(rows + hd.kv_w, 2 * hd.kv_w, r0, 0, hi, dv);
    } else {
        const float one[2] = {1.0f, 1.0f};
        floatX* drows = dqkv + (size_t)b * T * rw.ld + (size_t)kvh * HS;
        if (rope.table.half) att_mma_rope_back<HS>(dk, rope, b, r0, T);
        att_mma_store_rows<HS>(drows + hd.k_off, rw.ld, r0, T, dk, one);
        att_mma_store_rows<HS>(drows + hd.v_off, rw.ld, r0, T, dv, one);
    }
}

/* grid att_pack_grid(B, T, NH, NKV, 16, ATT_MMA_WARPS) (packed rows), block ATT_MMA_THREADS, static shared memory:
 * the forward's double buffer of K, V tiles (Q and dO staged through it
 * first); query blocks last-first. */
template <int HS, bool TILE>
__global__ void __maxnreg__((AttMmaRegs<HS, TILE>::DQ)) /* launched with ATT_MMA_THREADS */
attention_mma_backward_dq_kernel(floatX* dqkv, const float* rowsum, const floatX* dout, const floatX* qkv, const float* lse, int T,
                                 const AttHeads hd, float scale, const DropoutSite drop, const AttTileArgs blk, const RopeRows rope) {
    typedef AttMma<HS> Cfg;
    __shared__ __align__(128) unsigned char smem[Cfg::SMEM_BYTES];
    /* packed grouped-query rows (att_pack): the warp's 16 rows r0.. of query head h; K, V: the block's K/V head */
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, tq = threadIdx.x & 3;
    const AttPack pk = att_pack(hd, 16, ATT_MMA_WARPS, warp, true);
    const int r0 = pk.r0, bh = pk.b * hd.NH + pk.h;
    const AttSpan sp = att_span<TILE>(qkv, T, hd, blk, pk.b, pk.h, pk.kvh);
    const AttMmaRows rw = att_mma_rows<HS, TILE>(sp, dout, T, hd, pk.h);
    /* an attention tile's K/V head's rows: read from shared memory at each tile's copies (held in registers
     * across the key loop they spilled: the K/V head is query head / group; the whole sequence's are q + a
     * column, as before); set by thread 0, visible after the first barrier */
    __shared__ const floatX* kv_rows;
    if (threadIdx.x == 0) kv_rows = rw.k;
    const floatX* const& krows = TILE ? kv_rows : rw.k;
    const int nqr = rw.nq, nkr = rw.nk, diag = rw.diag;
    const int kend = min(pk.last + 1 + diag, nkr);
    /* documents: key tiles before the block's first row's start are skipped (tile j is keys (j0 + j) BC ..) */
    const int j0 = att_first_key(blk, sp, pk.first) / Cfg::BC;
    const int ntiles = (kend + Cfg::BC - 1) / Cfg::BC - j0;
    if constexpr (TILE)
        if (ntiles <= 0) return; /* the block's mask empties these rows: no copies are started that nothing waits for */
    const float scale_log2 = scale * 1.4426950408889634f;

    /* Q into the second buffer, dO into the first: each warp its own rows */
    att_mma_stage<HS, 32>(att_mma_buffer<HS>(smem, 1) + 16 * warp * Cfg::LD, rw.q, rw.ld, r0, 16, nqr);
    att_mma_stage<HS, 32>(att_mma_buffer<HS>(smem, 0) + 16 * warp * Cfg::LD, rw.dout, hd.out_ld, r0, 16, nqr);
    ptx_cp_async_commit();
    float lse_log2[2], d_row[2]; /* rows r0 + g, r0 + g + 8 */
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int t = r0 + g + 8 * hf;
        lse_log2[hf] = t < nqr ? lse[rw.stat + t] * 1.4426950408889634f : 0.0f;
        d_row[hf] = t < nqr ? rowsum[rw.stat + t] : 0.0f;
    }
    ptx_cp_async_wait<0>();
    __syncthreads();
    uint32_t q[Cfg::KS][4], dO[Cfg::KS][4];
    att_mma_load_a<HS>(q, att_mma_buffer<HS>(smem, 1) + 16 * warp * Cfg::LD);
    att_mma_load_a<HS>(dO, att_mma_buffer<HS>(smem, 0) + 16 * warp * Cfg::LD);
    __syncthreads(); /* both buffers are free for key tiles */
    att_mma_stage_tile<HS>(att_mma_buffer<HS>(smem, 0), krows, rw.kv_ld, krows + hd.kv_w, rw.kv_ld, j0 * Cfg::BC, nkr);
    ptx_cp_async_commit();

    float dq[Cfg::OT][4];
#pragma unroll
    for (int ot = 0; ot < Cfg::OT; ot++)
#pragma unroll
        for (int i = 0; i < 4; i++) dq[ot][i] = 0.0f;
    const int kwarp = att_first_key(blk, sp, r0); /* documents: as in the forward */
    for (int j = 0; j < ntiles; j++) {
        if (j + 1 < ntiles)
            att_mma_stage_tile<HS>(att_mma_buffer<HS>(smem, j + 1), krows, rw.kv_ld, krows + hd.kv_w, rw.kv_ld, (j0 + j + 1) * Cfg::BC, nkr);
        ptx_cp_async_commit(); /* possibly empty: the group count stays one per tile */
        ptx_cp_async_wait<1>(); /* tile j has landed (this thread's copies) */
        __syncthreads();        /* ... and every thread's */
        const int k0 = (j0 + j) * Cfg::BC;
        /* else every key of the tile is after every query of this warp, or before every query's document */
        if (k0 <= r0 + 15 + diag && k0 + Cfg::BC > kwarp) {
            const floatX* Ks = att_mma_buffer<HS>(smem, j);
            const floatX* Vs = Ks + Cfg::BC * Cfg::LD;
            float s[Cfg::NT][4], dp[Cfg::NT][4];
            att_mma_scores<HS, 1>(&s, &q, Ks);
            att_mma_scores<HS, 1>(&dp, &dO, Vs);
            float f[Cfg::NT][4]; /* dropout factors: dS = P (f dP' - D) */
            if (drop.threshold) {
                if constexpr (TILE) att_mma_drop_at<HS, false>(f, drop, bh, sp.T, sp.tq0 + r0, sp.tk0 + k0);
                else att_mma_drop_rows<HS>(f, drop, bh, T, r0, k0);
            }
            const int kf[2] = {att_first_key(blk, sp, r0 + g), att_first_key(blk, sp, r0 + g + 8)}; /* documents: each row's first key */
#pragma unroll
            for (int nt = 0; nt < Cfg::NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int hf = i >> 1, key = k0 + nt * 8 + 2 * tq + (i & 1), t = r0 + g + 8 * hf;
                    const float p = (key <= t + diag && key < nkr && key >= kf[hf]) ? exp2f(s[nt][i] * scale_log2 - lse_log2[hf]) : 0.0f;
                    const float dpf = drop.threshold ? f[nt][i] * dp[nt][i] : dp[nt][i];
                    s[nt][i] = p * (dpf - d_row[hf]) * scale;
                }
            uint32_t dsa[Cfg::BC / 16][4];
            att_mma_to_a<HS>(dsa, s);
            att_mma_accumulate<HS, 1>(&dq, &dsa, Ks);
        }
        __syncthreads(); /* buffer j & 1 is no longer read: tile j + 2 goes there */
    }
    if constexpr (TILE) { /* query rows that see a key of the tile: t + diag >= 0 */
        att_mma_add_rows<HS>(blk.acc + sp.qrow * hd.out_ld + (size_t)pk.h * HS, hd.out_ld, r0, -sp.diag, sp.nq, dq);
    } else {
        const float one[2] = {1.0f, 1.0f};
        if (rope.table.half) att_mma_rope_back<HS>(dq, rope, pk.b, r0, T);
        att_mma_store_rows<HS>(dqkv + (size_t)pk.b * T * rw.ld + (size_t)pk.h * HS, rw.ld, r0, T, dq, one);
    }
}

/* The dK/dV kernel's grid at `warps` warps a block: a block per 16 x warps
 * keys of each (b, K/V head). */
static inline dim3 attention_mma_dkv_grid(int B, int T, int NKV, int warps = ATT_MMA_WARPS) {
    return dim3((unsigned)ceil_div((size_t)T, (size_t)16 * warps), (unsigned)(B * NKV));
}

/* Tests only (test_gpt's bitwise check of the widths): 0, the launch picks
 * the width (attention_mma_dkv_warps); 4, 2 or 1, that width. */
static int g_att_mma_dkv_warps = 0;

/* Warps a block of the whole-sequence dK/dV kernel for B sequences of T
 * keys, NKV K/V heads, on a device of `sms` SMs: the wide ATT_MMA_WARPS
 * where its grid has a block for every SM, else the widest narrower block
 * (2 warps, then 1) whose grid has, else 1. Why this rule: narrowing adds
 * no warp (ceil(T/16) B NKV of them at every width, each with the same
 * serial work: the group's query tiles from its 64-key tile's start), it
 * only spreads the warps over more SMs, each block staging every Q/dO
 * tile for fewer warps (SPLIT times the copies and L2 reads); it helps
 * where the wide grid leaves SMs idle and not past that (at llama3.1-8b's
 * T = 1024 the wide grid's 128 blocks already hold 4 warps on 128 of 132
 * SMs: 2 narrow blocks a SM would hold the same 4). At B = 1 on 132 SMs
 * the wide grid reaches every SM from T = 1,025 for llama3.1-8b (NKV 8),
 * 2,753 for smollm2-135m (3), 4,161 for qwen2.5-0.5b (2), and GPT-2 124M's
 * (12 heads) from 641; as launched from 257, 689 and 1,041
 * (bench_attention --fill). Every width gives the same bits (the kernel's
 * comment), so the choice, which depends on the device, changes no
 * result. */
static inline int attention_mma_dkv_warps(int B, int T, int NKV, int sms) {
    if (g_att_mma_dkv_warps) return g_att_mma_dkv_warps;
    int warps = ATT_MMA_WARPS;
    while (warps > 1) {
        const dim3 grid = attention_mma_dkv_grid(B, T, NKV, warps);
        if ((size_t)grid.x * grid.y >= (size_t)sms) break;
        warps /= 2;
    }
    return warps;
}

/* The current device's SMs (a driver attribute: no synchronisation). */
static inline int attention_device_sms(void) {
    int dev = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return sms;
}

/* The whole-sequence dK/dV kernel of WARPS warps a block. */
template <int HS, int WARPS>
static void attention_mma_dkv_launch_as(floatX* dqkv, const float* rowsum, const floatX* dout, const floatX* qkv, const float* lse, int B, int T,
                                        const AttHeads& hd, float scale, const DropoutSite& drop, const AttTileArgs& docs, const RopeRows& rope,
                                        cudaStream_t stream) {
    const size_t smem = AttMmaBwd<HS, WARPS>::SMEM_BYTES;
    CUDA_CHECK(cudaFuncSetAttribute(attention_mma_backward_dkv_kernel<HS, false, WARPS>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attention_mma_backward_dkv_kernel<HS, false, WARPS><<<attention_mma_dkv_grid(B, T, hd.NKV, WARPS), 32 * WARPS, smem, stream>>>(
        dqkv, rowsum, dout, qkv, lse, T, hd, scale, drop, docs, rope);
    CUDA_CHECK_LAUNCH();
}

/* The backward's three launches; doc_start: packed documents' starts (device (B,T)), or NULL; rope: RoPE's
 * turn back in the dK and dQ epilogues (table.half 0: none). */
template <int HS>
static void attention_mma_backward_launch(floatX* dqkv, float* rowsum, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                                          int B, int T, const AttHeads& hd, float scale, const DropoutSite& drop, const int* doc_start,
                                          const RopeRows& rope, cudaStream_t stream) {
    const size_t rows = (size_t)B * T * hd.NH;
    attention_mma_rowsum_kernel<HS><<<(unsigned)ceil_div(rows, 256), 256, 0, stream>>>(rowsum, dout, out, B, T, hd.NH);
    CUDA_CHECK_LAUNCH();
    AttTileArgs docs{};
    docs.a.doc_start = doc_start;
    switch (attention_mma_dkv_warps(B, T, hd.NKV, attention_device_sms())) {
    case 1: attention_mma_dkv_launch_as<HS, 1>(dqkv, rowsum, dout, qkv, lse, B, T, hd, scale, drop, docs, rope, stream); break;
    case 2: attention_mma_dkv_launch_as<HS, 2>(dqkv, rowsum, dout, qkv, lse, B, T, hd, scale, drop, docs, rope, stream); break;
    default: attention_mma_dkv_launch_as<HS, ATT_MMA_WARPS>(dqkv, rowsum, dout, qkv, lse, B, T, hd, scale, drop, docs, rope, stream); break;
    }
    const dim3 grid = att_pack_grid(B, T, hd.NH, hd.NKV, 16, ATT_MMA_WARPS);
    attention_mma_backward_dq_kernel<HS, false><<<grid, ATT_MMA_THREADS, 0, stream>>>(dqkv, rowsum, dout, qkv, lse, T, hd, scale, drop, docs,
                                                                                 rope);
    CUDA_CHECK_LAUNCH();
}

/* An attention tile's forward (attention.cuh's gpu_attention_tile_forward): grid (ceil(G ceil(Tq/16) / 4), B*NKV), packed rows. */
template <int HS>
static void attention_mma_tile_forward_launch(float* out_acc, float* lse, const floatX* qkv, const floatX* kv, int kv_ld, const AttentionTile* a,
                                               const AttHeads& hd, int first, float scale, const DropoutSite& drop, cudaStream_t stream) {
    const dim3 grid = att_pack_grid(a->B, a->Tq, hd.NH, hd.NKV, 16 * AttMmaForward<HS, true>::MT, ATT_MMA_WARPS);
    attention_mma_forward_kernel<HS, true><<<grid, ATT_MMA_THREADS, 0, stream>>>(nullptr, lse, qkv, a->Tl, hd, scale, drop,
                                                                                 AttTileArgs{*a, kv, kv_ld, out_acc, first});
    CUDA_CHECK_LAUNCH();
}

/* An attention tile's backward: the dK/dV kernel over the tile's key
 * tiles, grid (ceil(Tk/64), B*NKV), then the dQ kernel over its query tiles,
 * grid (ceil(G ceil(Tq/16) / 4), B*NKV), packed rows; rowsum: gpu_attention_tile_rowsum's. */
template <int HS>
static void attention_mma_tile_backward_launch(float* dq_acc, float* dkv_acc, const float* rowsum, const floatX* dout, const floatX* qkv,
                                                const floatX* kv, int kv_ld, const float* lse, const AttentionTile* a, const AttHeads& hd,
                                                float scale, const DropoutSite& drop, cudaStream_t stream) {
    const size_t smem = AttMmaBwd<HS>::SMEM_BYTES;
    CUDA_CHECK(cudaFuncSetAttribute(attention_mma_backward_dkv_kernel<HS, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attention_mma_backward_dkv_kernel<HS, true><<<attention_mma_dkv_grid(a->B, a->Tk, hd.NKV), ATT_MMA_THREADS, smem, stream>>>(
        nullptr, rowsum, dout, qkv, lse, a->Tl, hd, scale, drop, AttTileArgs{*a, kv, kv_ld, dkv_acc, 0}, RopeRows{});
    CUDA_CHECK_LAUNCH();
    attention_mma_backward_dq_kernel<HS, true><<<att_pack_grid(a->B, a->Tq, hd.NH, hd.NKV, 16, ATT_MMA_WARPS), ATT_MMA_THREADS, 0, stream>>>(
        nullptr, rowsum, dout, qkv, lse, a->Tl, hd, scale, drop, AttTileArgs{*a, kv, kv_ld, dq_acc, 0}, RopeRows{});
    CUDA_CHECK_LAUNCH();
}

/* Blocks of one kernel an sm_90 SM holds (the occupancy calculator's rules):
 * registers allocated per warp in units of 256 (8 a thread) from 64K, shared
 * memory plus 1 KiB reserved per block from 228 KiB, at most 64 warps and 32
 * blocks. What the launch report (bench_attention --launch) prints where no
 * GPU answers the occupancy API. */
constexpr int att_sm90_blocks_per_sm(int regs, int threads, size_t smem) {
    const int warps = (threads + 31) / 32;
    const int by_regs = 65536 / (warps * ((regs * 32 + 255) / 256 * 256));
    const int by_smem = (int)((size_t)228 * 1024 / (smem + 1024));
    const int by_warps = 64 / warps;
    int n = by_regs < by_smem ? by_regs : by_smem;
    if (by_warps < n) n = by_warps;
    return n < 32 ? n : 32;
}

/* Blocks per SM the backward's kernels must reach: at B = 1 and NH = 16 a
 * 64-row tile per block gives 16 ceil(T/64) blocks, 264 (two per SM of an
 * H200) from T = 1024 on, if two fit an SM. */
#define ATT_MMA_BWD_MIN_BLOCKS_PER_SM 2

/* Resources of the attention kernels: registers at most their budgets
 * (AttMmaRegs, asserted at build by dev/ptxas_check.py), shared bytes from
 * the layouts. */
template <int HS> struct AttMmaResources {
    static constexpr int FWD_REGS = AttMmaRegs<HS, false>::FWD, DKV_REGS = AttMmaRegs<HS, false>::DKV, DQ_REGS = AttMmaRegs<HS, false>::DQ,
                         ROWSUM_REGS = 32;
    /* the attention-tile instantiations (TILE = true; gpu_attention_tile_forward/backward) */
    static constexpr int FWD_BLOCK_REGS = AttMmaRegs<HS, true>::FWD, DKV_BLOCK_REGS = AttMmaRegs<HS, true>::DKV, DQ_BLOCK_REGS = AttMmaRegs<HS, true>::DQ;
    /* static shared memory besides the buffers: the forward's warps' b NH + h (4 ints, 16 bytes), the dQ
     * kernel's K/V rows' pointer (8 bytes); ptxas reports each padded to the buffers' 128-byte alignment */
    static constexpr size_t FWD_SMEM = HS == 64 ? 36880 : 34832, DKV_SMEM = HS == 64 ? 56320 : 70144, DQ_SMEM = HS == 64 ? 36872 : 34824;
    static_assert(FWD_SMEM == AttMma<HS>::SMEM_BYTES + ATT_MMA_WARPS * sizeof(int) && DQ_SMEM == AttMma<HS>::SMEM_BYTES + sizeof(void*) &&
                      DKV_SMEM == AttMmaBwd<HS>::SMEM_BYTES,
                  "recorded shared memory is stale");
    static_assert(FWD_REGS <= 255 && DKV_REGS <= 255 && DQ_REGS <= 255, "above the 255-register limit");
    static_assert(att_sm90_blocks_per_sm(FWD_BLOCK_REGS, ATT_MMA_THREADS, FWD_SMEM) >= 2 &&
                      att_sm90_blocks_per_sm(DKV_BLOCK_REGS, ATT_MMA_THREADS, DKV_SMEM) >= ATT_MMA_BWD_MIN_BLOCKS_PER_SM &&
                      att_sm90_blocks_per_sm(DQ_BLOCK_REGS, ATT_MMA_THREADS, DQ_SMEM) >= ATT_MMA_BWD_MIN_BLOCKS_PER_SM,
                  "the attention tiles' blocks per SM");
    static_assert(att_sm90_blocks_per_sm(FWD_REGS, ATT_MMA_THREADS, FWD_SMEM) >= 2, "the forward's 2 blocks per SM (header)");
    static_assert(att_sm90_blocks_per_sm(DKV_REGS, ATT_MMA_THREADS, DKV_SMEM) >= ATT_MMA_BWD_MIN_BLOCKS_PER_SM &&
                      att_sm90_blocks_per_sm(DQ_REGS, ATT_MMA_THREADS, DQ_SMEM) >= ATT_MMA_BWD_MIN_BLOCKS_PER_SM,
                  "the backward's blocks per SM");
    /* the whole-sequence dK/dV kernel's narrow blocks (attention_mma_dkv_warps): 2 and 1 warps */
    static constexpr size_t DKV2_SMEM = HS == 64 ? 47104 : 52736, DKV1_SMEM = HS == 64 ? 42496 : 44032;
    static_assert(DKV2_SMEM == AttMmaBwd<HS, 2>::SMEM_BYTES && DKV1_SMEM == AttMmaBwd<HS, 1>::SMEM_BYTES, "recorded shared memory is stale");
    static_assert(att_sm90_blocks_per_sm(DKV_REGS, 64, DKV2_SMEM) >= 4 && att_sm90_blocks_per_sm(DKV_REGS, 32, DKV1_SMEM) >= 5,
                  "the narrow dK/dV blocks per SM (header)");
};
template struct AttMmaResources<64>;
template struct AttMmaResources<128>;

#endif
