/*
 * Causal self-attention without any (T,T) buffer: forward with an online
 * softmax over key tiles, backward recomputing the probabilities tile by tile
 * from the stored log-sum-exp. This file holds the launchers every family
 * shares and the CUDA-core (simt, fp32 math) kernels, the plainest statement
 * of the algorithm; the tensor-core families that BF16 and FP16 builds run by
 * default are in attention_mma.cuh and attention_tc.cuh ("Which kernels run"
 * below).
 *
 * Shapes, for B batch, T time, NH query heads and NKV K/V heads of hs = HD
 * channels (grouped-query attention; GPT-2: NKV = NH, HD = C/NH), QKV =
 * (NH + 2 NKV) HD (AttHeads below):
 *   qkv  (B,T,QKV) floatX: query head h at channels h*hs.., K/V head g at
 *        NH*hs + g*hs.. and (NH + NKV)*hs + g*hs..; query head h reads K/V
 *        head h / (NH/NKV) (no copy per query head). GPT-2: (B,T,3C).
 *   out  (B,T,NH*hs) floatX: head h at channels h*hs..
 *   lse  (B,NH,T) fp32: log sum_{s<=t} exp(scale * q_t.k_s), scale = 1/sqrt(hs)
 *   dout (B,T,NH*hs), dqkv (B,T,QKV) floatX; rowsum (B,NH,T) fp32 scratch:
 *        D_t = sum_i dout_t[i] out_t[i]
 * Backward, with p_ts = exp(scale q_t.k_s - lse_t) for s <= t:
 *   dv_s = sum_{t>=s} p_ts dout_t
 *   ds_ts = p_ts (dout_t.v_s - D_t) scale
 *   dq_t = sum_{s<=t} ds_ts k_s,  dk_s = sum_{t>=s} ds_ts q_t
 *
 * Grouped-query attention (every family, no copy of K/V per query head): the
 * forward and dq kernels of every family (simt, tc, mma) take packed rows
 * (att_pack below): a block serves one (b, K/V head), grid (ceil(G
 * ceil(T/R) / W), B*NKV) for W warps of R rows, each warp R consecutive
 * rows of one of the group's G = NH/NKV query heads, so each K/V tile a
 * block stages serves up to G query heads. The dk/dv kernels' blocks own key rows of one (b, K/V head) and
 * serve its whole group: they load their K and V rows once and stream the
 * queries of the group's NH/NKV query heads one head after the other (head
 * ascending, then query tiles ascending), accumulating dk, dv in registers:
 * each dK/dV element is one thread's, summed over the group in a fixed order
 * inside the block (no atomics, no partial sums). The dk/dv grid is
 * (ceil(T/rows), B*NKV); with NKV = NH (GPT-2) its loop runs once, the same
 * launches, tiles and order as before. Every row*width offset is 64-bit.
 *
 * Work split (all three kernels): a block owns ATT_ROWS rows (queries in the
 * forward and dq kernels: packed, each warp's 32/G of one (b, h); keys of
 * one (b, K/V head) in the dk/dv kernel); G threads
 * share a row, each owning CH = HS/G channels in float4 chunks interleaved
 * across the G threads (conflict-free shared-memory reads). Dot products are
 * summed over the G threads with a butterfly, so all G threads hold the same
 * bits. The other side (keys, or queries for dk/dv) streams through shared
 * memory ATT_TILE rows at a time, converted to fp32, zero-filled past T and
 * past hs. HS is the head size rounded up to 16, 32, 64 or 128 (template);
 * padded channels are zero and add nothing.
 *
 * Determinism: each output element is owned by one thread and accumulated
 * in a fixed order (keys ascending for out and dq, queries ascending for
 * dk and dv); no atomics. dq and dk/dv are two kernels, dq first (it also
 * writes D). Every element of dqkv is written (overwritten), as on the CPU.
 *
 * Masking: key s is used for query t iff s <= t and both < T; T need not be a
 * multiple of any tile size (partial tiles are zero-filled, and rows past T
 * compute on zeros and store nothing). Packed documents (doc_start,
 * llmc/core/documents.h; these kernels, attention_tc.cuh's and attention_mma.cuh's
 * alike): key s is used for query t only when s >= doc_start[t] as well.
 * A row's starts never decrease, so a block of query rows needs no key tile
 * before its first row's start (those tiles are skipped, the others masked
 * per key), and a block of key rows no query past the last one whose
 * document starts at or before its last key (att_queries_end).
 *
 * Dropout (DropoutSite, dropout.h; threshold 0: none, and the launchers then
 * run each kernel's DROPOUT = false instantiation, the code without it):
 * P' = mask * P / keep
 * with mask bit (t, s) = dropout_keep_attention(site, b*NH + h, T, t, s) for
 * query head h (the CPU's indexing; the dk/dv kernels draw each group
 * member's bits with its own b*NH + h),
 * never stored. The forward accumulates P' V but sums the undropped P into
 * the softmax denominator, so out = P' V and lse stays that of P. The
 * backward draws the same bits again in each tile of both kernels:
 *   dv_s = sum_t p'_ts dout_t,  ds_ts = p_ts (mask_ts dout_t.v_s / keep - D_t) scale
 * with D_t = dout_t.out_t unchanged: the softmax's row term is
 * sum_s p_ts dp_ts = sum_s p'_ts dout_t.v_s = dout_t.out_t, since out_t is
 * already the dropped sum. The forward and its recomputation are the same
 * kernels with the same site, so they draw the same mask. Each element's
 * draw is one 16-bit slice of a Philox call (dropout.h); the helpers below
 * make one call per group of elements a thread owns that share it, instead
 * of one call per element.
 *
 * Which kernels run (ATTENTION_KIND, from cuda.mk's ATTENTION): BF16 and
 * FP16 builds use the inline-PTX kernels of attention_mma.cuh (mma.sync,
 * ldmatrix, cp.async; the default) for head sizes 64 and 128 and the WMMA
 * kernels of attention_tc.cuh (same algorithm, WMMA tile products) for the
 * others; ATTENTION=tc (-DATTENTION_TC) uses the WMMA kernels for every head
 * size. FP32 builds, and any build with ATTENTION=simt (-DATTENTION_SIMT),
 * use the CUDA-core kernels below. attention_family is this rule in code,
 * the one every caller follows (docs/attention_kernels.md).
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_ATTENTION_CUH
#define REMAT_ATTENTION_CUH

#include "cuda_common.cuh"
#include "../core/dropout.h"
#include "../core/token_layout.h"
#include "rope.cuh"

enum AttentionKind { ATT_KIND_SIMT = 0, ATT_KIND_TC = 1, ATT_KIND_MMA = 2 };

/* The keep bits of the two 16-bit draws of one Philox word (low half: bit 0). */
__device__ __forceinline__ unsigned att_drop_keep_pair(const DropoutSite& drop, uint32_t word) {
    return (unsigned)((word & 0xffffu) >= drop.threshold) | (unsigned)((word >> 16) >= drop.threshold) << 1;
}

/* Keep bits of probabilities (t, u0 + j), j = 0..15, of head bh: bit j set
 * when key u0 + j is kept. u0 is a multiple of 16, so the 16 keys are one
 * row of one 16x16 block of dropout.h's layout, where keys 2c, 2c+1, 8+2c
 * and 9+2c share a Philox call: four calls instead of sixteen. Draw
 * ((t/8)%2)*4 + ((j/8)%2)*2 + j%2 of a call is half j%2 of word
 * ((t/8)%2)*2 + (j/8)%2; the row's pair of words is selected, not indexed,
 * so the words stay in registers (an index known only at run time would put
 * them in local memory). */
__device__ __forceinline__ unsigned att_drop_keep_row16(const DropoutSite& drop, int bh, int T, int t, int u0) {
    const bool upper = (t >> 3) & 1;
    unsigned bits = 0;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        uint32_t w[4];
        dropout_draws(&drop, dropout_attention_group(bh, T, t, u0 + 2 * c), w);
        bits |= att_drop_keep_pair(drop, upper ? w[2] : w[0]) << (2 * c);
        bits |= att_drop_keep_pair(drop, upper ? w[3] : w[1]) << (8 + 2 * c);
    }
    return bits;
}

/* Keep bits of probabilities (t0 + j, u), j = 0..15, of head bh: bit j set
 * when query t0 + j keeps key u. t0 is a multiple of 16 (one column of a
 * 16x16 block), where queries r and r+8 share a call: eight calls. Their
 * draws are half u%2 of words (u/8)%2 and 2 + (u/8)%2. */
__device__ __forceinline__ unsigned att_drop_keep_col16(const DropoutSite& drop, int bh, int T, int t0, int u) {
    const bool right = (u >> 3) & 1;
    const int shift = 16 * (u & 1);
    unsigned bits = 0;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        uint32_t w[4];
        dropout_draws(&drop, dropout_attention_group(bh, T, t0 + r, u), w);
        bits |= (unsigned)((((right ? w[1] : w[0]) >> shift) & 0xffffu) >= drop.threshold) << r;
        bits |= (unsigned)((((right ? w[3] : w[2]) >> shift) & 0xffffu) >= drop.threshold) << (r + 8);
    }
    return bits;
}

/* The factor of kept bit j of `keep`: 1/keep or 0 (keep_scale: the site's
 * scale). Kernels built without dropout pass keep = ~0u and keep_scale = 1
 * as constants: the factor folds to 1 and the products with it away. */
__device__ __forceinline__ float att_drop_factor(unsigned keep, int j, float keep_scale) {
    return (keep >> j) & 1u ? keep_scale : 0.0f;
}

/* att_drop_keep_row16 for any first key u0: an attention tile's keys start
 * at its global k0, which need not be a multiple of 16; then each key draws
 * on its own (16 calls). */
__device__ __forceinline__ unsigned att_drop_keep_row16_any(const DropoutSite& drop, int bh, int T, int t, int u0) {
    if (u0 % 16 == 0) return att_drop_keep_row16(drop, bh, T, t, u0);
    unsigned bits = 0;
    for (int j = 0; j < 16; j++) bits |= (unsigned)dropout_keep_attention(&drop, bh, T, t, u0 + j) << j;
    return bits;
}

/* att_drop_keep_col16 for any first query t0 (a tile's global q0 need not be a multiple of 16). */
__device__ __forceinline__ unsigned att_drop_keep_col16_any(const DropoutSite& drop, int bh, int T, int t0, int u) {
    if (t0 % 16 == 0) return att_drop_keep_col16(drop, bh, T, t0, u);
    unsigned bits = 0;
    for (int j = 0; j < 16; j++) bits |= (unsigned)dropout_keep_attention(&drop, bh, T, t0 + j, u) << j;
    return bits;
}

/* A layer's heads (GPT-2: NKV = NH, HD = C/NH): NH query heads, NKV K/V
 * heads of HD channels, query head h reading K/V head h / group. Widths and
 * offsets in elements (int: a row's width fits; every row * width product
 * is taken in 64 bits, (size_t)row * width, so it never wraps): qkv rows of
 * q_ld = (NH + 2 NKV) HD (Q at 0, K at k_off = NH HD, V at v_off =
 * (NH + NKV) HD), out (and dout, dq_acc) rows of out_ld = NH HD, and the
 * ring's compact K/V rows (2 kv_w: K at 0, V at kv_w = NKV HD). */
struct AttHeads {
    int NH, NKV, HD, group;
    int q_ld, out_ld, k_off, v_off, kv_w;
};

static inline AttHeads att_heads(int NH, int NKV, int HD) {
    AttHeads a;
    a.NH = NH;
    a.NKV = NKV;
    a.HD = HD;
    a.group = NKV > 0 ? NH / NKV : 0;
    a.out_ld = NH * HD;
    a.kv_w = NKV * HD;
    a.k_off = a.out_ld;
    a.v_off = a.out_ld + a.kv_w;
    a.q_ld = a.out_ld + 2 * a.kv_w;
    return a;
}

/* Query head h's K/V head's first channel in a qkv row, relative to its own
 * first channel: k_off + (h / group - h) HD (C for GPT-2's heads). */
__device__ __forceinline__ int att_kv_col(const AttHeads& hd, int h) { return hd.k_off + (h / hd.group - h) * hd.HD; }

/* An attention tile's heads: its NKV and HD, or GPT-2's where they are 0. */
static inline AttHeads att_tile_heads(const AttentionTile* a) {
    return att_heads(a->NH, a->NKV ? a->NKV : a->NH, a->HD ? a->HD : a->C / a->NH);
}

/* ---- attention tiles (context parallelism) ----
 * An AttentionTile (token_layout.h) is Tq query rows from local row qi of
 * qkv (B,Tl,QKV) against Tk key rows from local row ki of kv (B,Tl,kv_ld; K
 * heads at channel 0, V heads at kv_w = NKV HD: the ring's compact K/V, 2 NKV
 * HD a token, or qkv itself at its K), key j seen by query i when k0 + j <= q0 + i. The
 * tile launches run each family's kernels with TILE = true: the same
 * loops over query index i and key index j, with key j seen by query i
 * when j <= i + diag (diag = q0 - k0; 0 for a whole sequence), dropout
 * drawn at the global positions (q0 + i, k0 + j) of a sequence of T
 * tokens, and an fp32 epilogue that writes or merges (forward) or adds
 * (backward) instead of storing floatX. What a tile kernel gets besides
 * the whole-sequence arguments (unused, zero, in those launches): */
struct AttTileArgs {
    AttentionTile a;
    const floatX* kv; /* (B,Tl,kv_ld): K heads at channel 0, V heads at kv_w */
    /* a.doc_start: packed documents' starts (device, (B,Tl) global positions;
     * NULL: none), in whole-sequence launches too (the rest zero there) */
    int kv_ld;
    float* acc;       /* forward: out_acc (B,Tl,NH HD); dQ: dq_acc (B,Tl,NH HD); dK/dV: dkv_acc (B,Tl,2 NKV HD) */
    int first;        /* forward: write (1) or merge into (0) out_acc and lse */
};

/* Merges a tile's normalised output (n values of one head row, part[e] at
 * acc[chan[e]]) and its log-sum-exp lpart into acc and *lse (the CPU's
 * attention_merge): weights exp(old - merged) and exp(lpart - merged). All
 * threads sharing the row compute the same weights; the caller has every
 * one of them read *lse before any writes it. */
__device__ __forceinline__ float att_merged_lse(float old, float lpart) {
    const float m = fmaxf(old, lpart);
    return m + logf(expf(old - m) + expf(lpart - m));
}

/* Where a kernel's rows are, for one (b, query head h): queries i in [0, nq)
 * and keys j in [0, nk), key j seen by query i when j <= i + diag and
 * j < nk. q, k, v point at row 0 of this head's slices (k, v: its K/V
 * head's); qrow, krow are the
 * row indices (in (B,Tl,*) tensors) of query 0 and key 0; stat the index of
 * query 0 in (B,NH,Tl) statistics; tq0, tk0 the global positions of query
 * 0 and key 0 in the dropout layout's sequence of T tokens. A whole
 * sequence: nq = nk = T, diag = tq0 = tk0 = 0, Tl = T. */
struct AttSpan {
    const floatX *q, *k, *v;
    size_t q_ld, kv_ld, qrow, krow, stat;
    int nq, nk, diag, tq0, tk0, T;
};

template <bool TILE>
__device__ __forceinline__ AttSpan att_span(const floatX* qkv, int T, const AttHeads hd, const AttTileArgs& blk, int b, int h, int kvh) {
    AttSpan sp;
    if constexpr (TILE) {
        const AttentionTile& a = blk.a;
        sp.qrow = (size_t)b * a.Tl + a.qi;
        sp.krow = (size_t)b * a.Tl + a.ki;
        sp.stat = ((size_t)b * hd.NH + h) * a.Tl + a.qi;
        sp.q = qkv + sp.qrow * hd.q_ld + (size_t)h * hd.HD;
        sp.q_ld = hd.q_ld;
        sp.k = blk.kv + sp.krow * blk.kv_ld + (size_t)kvh * hd.HD;
        sp.v = sp.k + hd.kv_w; /* V heads kv_w after the K heads, here and in qkv */
        sp.kv_ld = blk.kv_ld;
        sp.nq = a.Tq;
        sp.nk = a.Tk;
        sp.diag = a.q0 - a.k0;
        sp.tq0 = a.q0;
        sp.tk0 = a.k0;
        sp.T = a.T;
    } else {
        sp.qrow = sp.krow = (size_t)b * T;
        sp.stat = ((size_t)b * hd.NH + h) * T;
        sp.q = qkv + sp.qrow * hd.q_ld + (size_t)h * hd.HD;
        sp.q_ld = sp.kv_ld = hd.q_ld;
        sp.k = qkv + sp.qrow * hd.q_ld + hd.k_off + (size_t)kvh * hd.HD;
        sp.v = sp.k + hd.kv_w;
        sp.nq = sp.nk = sp.T = T;
        sp.diag = sp.tq0 = sp.tk0 = 0;
    }
    return sp;
}

/* The span of query head h, whose K/V head is h / group (the whole sequence's K/V one add from q, as q + C
 * for GPT-2's heads: the simt and tc kernels' registers were counted with it). */
template <bool TILE>
__device__ __forceinline__ AttSpan att_span(const floatX* qkv, int T, const AttHeads hd, const AttTileArgs& blk, int b, int h) {
    AttSpan sp = att_span<TILE>(qkv, T, hd, blk, b, h, h / hd.group);
    if constexpr (!TILE) {
        sp.k = sp.q + att_kv_col(hd, h);
        sp.v = sp.k + hd.kv_w;
    }
    return sp;
}

/* The first key (the kernel's key index) that query row t (clamped to the
 * span's rows) sees under the document mask: 0 without one. */
__device__ __forceinline__ int att_first_key(const AttTileArgs& blk, const AttSpan& sp, int t) {
    if (!blk.a.doc_start) return 0;
    const int tc = min(max(t, 0), sp.nq - 1);
    return max(blk.a.doc_start[sp.qrow + tc] - sp.tk0, 0);
}

/* Packed grouped-query rows (FlashAttention's "packed GQA", in units of a
 * warp's rows): a block serves one K/V head (b, kvh) (blockIdx.y = b NKV +
 * kvh) and query rows of several of the G = NH/NKV query heads that share
 * it, so every K/V tile it loads serves all of them. The query rows of the
 * group are cut in units of R rows (a warp's: its M-tiles), unit u being
 * positions (u / G) R .. (u / G) R + R - 1 of query head kvh G + u % G; block
 * x (last-first when asked: the longest first) takes units x W .. x W + W - 1,
 * one a warp. A warp's rows are thus those of a one-head block of today's
 * (R consecutive positions of one head, starting at a multiple of R), and
 * each of its rows sees the same key tiles in the same order: the results
 * are bitwise those of one query head per block. The block spans only
 * about W R / G positions, so its causal key range is that much shorter;
 * the bytes staged per query row over a whole sequence are unchanged (each
 * K/V tile still serves the block's W R rows), but G heads share each
 * tile inside one block instead of meeting in L2, and a head with fewer
 * rows than a block (a ring tile's short Tq, a sequence's last partial
 * block) has the rest of its block filled from the group's other heads.
 * With G = 1 this is one head per block, block x rows x W R .., as before.
 * What one warp gets: */
struct AttPack {
    int b, h, kvh;    /* batch row, the warp's query head, the block's K/V head */
    int r0;           /* the warp's first row (query index in the span) */
    int first, last;  /* the block's first and last row (any warp's; last inclusive) */
};

__device__ __forceinline__ AttPack att_pack(const AttHeads& hd, int R, int W, int warp, bool last_first) {
    const int x = last_first ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x, u0 = x * W, u = u0 + warp;
    AttPack p;
    p.b = blockIdx.y / hd.NKV;
    p.kvh = blockIdx.y % hd.NKV;
    p.h = p.kvh * hd.group + u % hd.group;
    p.r0 = u / hd.group * R;
    p.first = u0 / hd.group * R;
    p.last = (u0 + W - 1) / hd.group * R + R - 1;
    return p;
}

/* att_pack's grid for B batch rows of nq query rows: (ceil(G ceil(nq/R) / W), B NKV); with G = 1 (GPT-2)
 * the one-head grid (ceil(nq / (W R)), B NH). */
static inline dim3 att_pack_grid(int B, int nq, int NH, int NKV, int R, int W) {
    if ((long long)B * NKV > 65535) fail("attention: B*NKV = %lld exceeds the grid limit 65535 (use a smaller -b)", (long long)B * NKV);
    return dim3((unsigned)ceil_div((size_t)(NH / NKV) * ceil_div((size_t)nq, R), W), (unsigned)(B * NKV));
}

/* One past the last query of [t_begin, sp.nq) that sees key s_last or one
 * before it (att_first_key <= s_last): the queries a block of keys up to
 * s_last needs; the first keys never decrease, so a binary search. */
__device__ __forceinline__ int att_queries_end(const AttTileArgs& blk, const AttSpan& sp, int t_begin, int s_last) {
    if (!blk.a.doc_start) return sp.nq;
    int lo = max(t_begin, 0), hi = sp.nq; /* the answer is in [lo, hi] */
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (att_first_key(blk, sp, mid) <= s_last) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

#if PRECISION_IS_FP32 || defined(ATTENTION_SIMT)
#define ATTENTION_TENSOR_CORES 0
#define ATTENTION_KIND ATT_KIND_SIMT
#define ATTENTION_KERNELS_NAME "CUDA cores, fp32 math"
#else
#define ATTENTION_TENSOR_CORES 1
#include "attention_tc.cuh"
#include "attention_mma.cuh"
#if defined(ATTENTION_TC)
#define ATTENTION_KIND ATT_KIND_TC
#define ATTENTION_KERNELS_NAME "tensor cores (WMMA " PRECISION_NAME " x " PRECISION_NAME " -> fp32)"
#else
#define ATTENTION_KIND ATT_KIND_MMA
#define ATTENTION_KERNELS_NAME "tensor cores (inline PTX mma.sync m16n8k16 " PRECISION_NAME " -> fp32, ldmatrix, cp.async)"
#endif
#endif

#define ATT_ROWS 64 /* rows owned by a block */
#define ATT_TILE 32 /* rows of the other side staged in shared memory at a time */
#define ATT_SUB 16  /* forward: scores between two online-softmax rescales */

template <int HS> struct AttConfig {
    static constexpr int CH = HS < 32 ? HS : 32; /* channels per thread */
    static constexpr int G = HS / CH;           /* threads per row: 1, 1, 2, 4 for HS 16, 32, 64, 128 */
    static constexpr int NQ = CH / 4;           /* float4 chunks per thread */
    static constexpr int THREADS = ATT_ROWS * G;
};

/* The simt forward's and dq kernel's grid for nq query rows: att_pack's, units of a warp's 32/G rows,
 * THREADS/32 warps (ATT_ROWS rows) a block. */
template <int HS> static inline dim3 att_simt_grid(int B, int nq, int NH, int NKV) {
    return att_pack_grid(B, nq, NH, NKV, 32 / AttConfig<HS>::G, AttConfig<HS>::THREADS / 32);
}

/* Channel of element e (0..CH-1) of thread g's slice: chunk q = e/4 sits at float4 index q*G + g. */
template <int G> __device__ __forceinline__ int att_channel(int e, int g) { return 4 * ((e >> 2) * G + g) + (e & 3); }

/* Sum over the G consecutive lanes that share a row; identical in all G lanes. */
template <int G> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int off = 1; off < G; off <<= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* Loads this thread's CH channels of one head row (fp32; zero past hs or when !valid). */
template <int HS> __device__ __forceinline__ void att_load_row(float* dst, const floatX* row, int hs, int g, bool valid) {
    constexpr int CH = AttConfig<HS>::CH, G = AttConfig<HS>::G;
#pragma unroll
    for (int e = 0; e < CH; e++) {
        int c = att_channel<G>(e, g);
        dst[e] = (valid && c < hs) ? to_f32(row[c]) : 0.0f;
    }
}

template <int HS> __device__ __forceinline__ void att_store_row(floatX* row, const float* src, float mul, int hs, int g) {
    constexpr int CH = AttConfig<HS>::CH, G = AttConfig<HS>::G;
#pragma unroll
    for (int e = 0; e < CH; e++) {
        int c = att_channel<G>(e, g);
        if (c < hs) row[c] = from_f32<floatX>(src[e] * mul);
    }
}

/* RoPE's turn back (rope.cuh) of this thread's channels of row t of
 * sequence b of dQ or dK, where the head size is the template's
 * (hs = HS, which the launcher checks: attention_rope_in_kernels): channel c <
 * HS/2 of element e pairs with c + HS/2, element e + CH/2 of the same
 * thread (att_channel's chunks: CH/8 chunks further, G threads apart). */
template <int HS> __device__ __forceinline__ void att_rope_back_row(float* x, const RopeRows& rope, int b, int t, int g) {
    constexpr int CH = AttConfig<HS>::CH, G = AttConfig<HS>::G;
    static_assert(CH % 8 == 0, "the pair's element is CH/8 whole chunks further");
    const double pos = rope_position_at(rope, b, t);
#pragma unroll
    for (int e = 0; e < CH / 2; e++) {
        float co, si;
        rope_cos_sin(pos, rope.table.inv_freq[att_channel<G>(e, g)], rope.table.mscale, -1, &co, &si);
        rope_turn(&x[e], &x[e + CH / 2], co, si);
    }
}

/* Partial dot product of this thread's channels with a shared-memory row (HS floats). */
template <int HS> __device__ __forceinline__ float att_dot_smem(const float* reg, const float* srow, int g) {
    constexpr int G = AttConfig<HS>::G, NQ = AttConfig<HS>::NQ;
    const float4* s4 = reinterpret_cast<const float4*>(srow);
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < NQ; q++) {
        float4 s = s4[q * G + g];
        acc += reg[4 * q] * s.x + reg[4 * q + 1] * s.y + reg[4 * q + 2] * s.z + reg[4 * q + 3] * s.w;
    }
    return acc;
}

/* acc[e] += a * srow[channel e] */
template <int HS> __device__ __forceinline__ void att_axpy_smem(float* acc, float a, const float* srow, int g) {
    constexpr int G = AttConfig<HS>::G, NQ = AttConfig<HS>::NQ;
    const float4* s4 = reinterpret_cast<const float4*>(srow);
#pragma unroll
    for (int q = 0; q < NQ; q++) {
        float4 s = s4[q * G + g];
        acc[4 * q] += a * s.x;
        acc[4 * q + 1] += a * s.y;
        acc[4 * q + 2] += a * s.z;
        acc[4 * q + 3] += a * s.w;
    }
}

/* Stages rows [r0, r0+ATT_TILE) of two (B,T,ld)-strided head slices into
 * shared memory as fp32, zero past T and past hs. base_x points at (b, t=0,
 * this head's first channel) of each slice. */
template <int HS> __device__ __forceinline__ void att_stage_tile(float (*sx)[HS], float (*sy)[HS], const floatX* base_x,
                                                                 const floatX* base_y, size_t ld, int r0, int T, int hs) {
    for (int idx = threadIdx.x; idx < ATT_TILE * HS; idx += blockDim.x) {
        int j = idx / HS, c = idx % HS, r = r0 + j;
        bool ok = r < T && c < hs;
        sx[j][c] = ok ? to_f32(base_x[(size_t)r * ld + c]) : 0.0f;
        sy[j][c] = ok ? to_f32(base_y[(size_t)r * ld + c]) : 0.0f;
    }
}

/* ---- forward ----
 * grid att_simt_grid: (ceil(G ceil(nq/R) / W), B*NKV) for R = 32/G rows a
 * warp and W warps (for G = 1, GPT-2: (ceil(nq/ATT_ROWS), B*NH)), block
 * THREADS; packed grouped-query rows (att_pack). Query tiles are visited
 * last-first (the causal mask makes them the longest). Dropout: each
 * 16-key sub-tile draws its row's 16 keep bits once (the G threads of a row
 * draw the same bits); the kept p, scaled, weighs v, while l sums every p.
 * TILE: an attention tile's rows (AttSpan); the normalised output and
 * lse of each query that sees a key are written to blk.acc and lse (first)
 * or merged into them. */
template <int HS, bool DROPOUT, bool TILE>
__global__ void __launch_bounds__(AttConfig<HS>::THREADS)
attention_forward_kernel(floatX* out, float* lse, const floatX* qkv, int T, const AttHeads hd, float scale, DropoutSite drop,
                         AttTileArgs blk) {
    constexpr int CH = AttConfig<HS>::CH, G = AttConfig<HS>::G;
    static_assert(ATT_SUB == 16, "a sub-tile's keep bits are one att_drop_keep_row16");
    __shared__ __align__(16) float ks[ATT_TILE][HS];
    __shared__ __align__(16) float vs[ATT_TILE][HS];
    /* packed grouped-query rows (att_pack): a warp's 32/G rows of query head h, K/V the block's K/V head */
    const AttPack pk = att_pack(hd, 32 / G, AttConfig<HS>::THREADS / 32, threadIdx.x / 32, true);
    const int b = pk.b, h = pk.h, hs = hd.HD, bh = b * hd.NH + h;
    const int g = threadIdx.x % G, t = pk.r0 + (threadIdx.x % 32) / G;
    /* where the rows are: an attention tile's or the whole sequence's (AttSpan) */
    const AttSpan sp = att_span<TILE>(qkv, T, hd, blk, b, h, pk.kvh);
    const size_t ld = hd.q_ld;
    const floatX* base = sp.q;
    const int nqr = TILE ? sp.nq : T, nkr = TILE ? sp.nk : T, diag = TILE ? sp.diag : 0;
    float q[CH], o[CH];
    att_load_row<HS>(q, base + (size_t)min(t, nqr - 1) * ld, hs, g, t < nqr);
#pragma unroll
    for (int e = 0; e < CH; e++) o[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const float keep_scale = DROPOUT ? drop.scale : 1.0f;
    const int kend = min(pk.last + 1 + diag, nkr);
    /* documents: the key tiles before the block's first row's start are skipped */
    const int kfirst = att_first_key(blk, sp, t), kbegin = att_first_key(blk, sp, pk.first) / ATT_TILE * ATT_TILE;
    for (int k0 = kbegin; k0 < kend; k0 += ATT_TILE) {
        __syncthreads();
        att_stage_tile<HS>(ks, vs, sp.k, sp.v, sp.kv_ld, k0, nkr, hs);
        __syncthreads();
        for (int j0 = 0; j0 < ATT_TILE; j0 += ATT_SUB) {
            unsigned keep = ~0u;
            if constexpr (DROPOUT && TILE) keep = att_drop_keep_row16_any(drop, bh, sp.T, sp.tq0 + t, sp.tk0 + k0 + j0);
            else if constexpr (DROPOUT) keep = att_drop_keep_row16(drop, bh, T, t, k0 + j0);
            float s[ATT_SUB];
            float mx = -INFINITY;
#pragma unroll
            for (int u = 0; u < ATT_SUB; u++) {
                const int key = k0 + j0 + u;
                float d = group_sum<G>(att_dot_smem<HS>(q, ks[j0 + u], g));
                s[u] = (key <= t + diag && key < nkr && key >= kfirst) ? d * scale : -INFINITY;
                mx = fmaxf(mx, s[u]);
            }
            const float mnew = fmaxf(m, mx);
            const float ref = mnew == -INFINITY ? 0.0f : mnew; /* all masked so far: keep exp() away from inf - inf */
            const float corr = expf(m - ref);
            l *= corr;
#pragma unroll
            for (int e = 0; e < CH; e++) o[e] *= corr;
#pragma unroll
            for (int u = 0; u < ATT_SUB; u++) {
                const float p = expf(s[u] - ref);
                l += p;
                att_axpy_smem<HS>(o, p * att_drop_factor(keep, u, keep_scale), vs[j0 + u], g);
            }
            m = mnew;
        }
    }
    if constexpr (TILE) {
        const bool seen = t < sp.nq && t + sp.diag >= 0; /* else the tile leaves the row alone */
        /* documents: a row may see none of the tile's keys; a first tile
         * then writes an empty part (0, lse -inf) for later ones to merge into */
        const bool any = seen && kfirst <= t + sp.diag && kfirst < sp.nk;
        float* l_row = lse + sp.stat + min(t, sp.nq - 1);
        /* the row's lse is read and written by its thread g == 0 alone; the others get it by a shuffle */
        const float lpart = any ? m + logf(l) : -INFINITY;
        const float old = __shfl_sync(0xffffffffu, (g == 0 && any && !blk.first) ? *l_row : 0.0f, (threadIdx.x & 31) & ~(G - 1));
        if (any || (seen && blk.first)) {
            const float merged = blk.first ? lpart : att_merged_lse(old, lpart);
            const float w0 = blk.first ? 0.0f : expf(old - merged), w1 = blk.first ? 1.0f : expf(lpart - merged);
            float* row = blk.acc + (sp.qrow + t) * hd.out_ld + (size_t)h * hs;
#pragma unroll
            for (int e = 0; e < CH; e++) {
                const int c = att_channel<G>(e, g);
                if (c < hs) row[c] = blk.first ? (any ? o[e] / l : 0.0f) : row[c] * w0 + o[e] / l * w1;
            }
            if (g == 0) *l_row = merged;
        }
    } else if (t < T) {
        att_store_row<HS>(out + ((size_t)b * T + t) * hd.out_ld + (size_t)h * hs, o, 1.0f / l, hs, g);
        if (g == 0) lse[sp.stat + t] = m + logf(l);
    }
}

/* ---- backward, pass 1: dq and D ----
 * grid att_simt_grid (as the forward's; packed rows), block THREADS; one
 * query row per G threads.
 * Dropout: each key tile draws the row's 32 keep bits again (the forward's
 * mask), and only dp is masked and scaled: D = dout.out is already the
 * dropped row sum (header). TILE: D comes from rowsum (the tile rowsum
 * kernel's), and dq is added to blk.acc (rows that see a key). */
template <int HS, bool DROPOUT, bool TILE>
__global__ void __launch_bounds__(AttConfig<HS>::THREADS)
attention_backward_dq_kernel(floatX* dqkv, float* rowsum, const floatX* dout, const floatX* qkv, const floatX* out,
                             const float* lse, int T, const AttHeads hd, float scale, DropoutSite drop, AttTileArgs blk,
                             const RopeRows rope) {
    constexpr int CH = AttConfig<HS>::CH, G = AttConfig<HS>::G;
    static_assert(ATT_TILE == 32, "a tile's keep bits are two att_drop_keep_row16");
    __shared__ __align__(16) float ks[ATT_TILE][HS];
    __shared__ __align__(16) float vs[ATT_TILE][HS];
    /* where the rows are: as in the forward (packed grouped-query rows) */
    const AttPack pk = att_pack(hd, 32 / G, AttConfig<HS>::THREADS / 32, threadIdx.x / 32, true);
    const int b = pk.b, h = pk.h, hs = hd.HD, bh = b * hd.NH + h;
    const int g = threadIdx.x % G, t = pk.r0 + (threadIdx.x % 32) / G;
    const AttSpan sp = att_span<TILE>(qkv, T, hd, blk, b, h, pk.kvh);
    const int nqr = TILE ? sp.nq : T, nkr = TILE ? sp.nk : T, diag = TILE ? sp.diag : 0;
    const bool valid = t < nqr;
    const int tc = min(t, nqr - 1);
    const size_t ld = hd.q_ld;
    const floatX* base = sp.q;
    const size_t orow = (sp.qrow + tc) * hd.out_ld + (size_t)h * hs;
    float q[CH], dO[CH], dq[CH];
    att_load_row<HS>(q, base + (size_t)tc * ld, hs, g, valid);
    att_load_row<HS>(dO, dout + orow, hs, g, valid);
    const size_t srow = sp.stat + tc;
    float D;
    if constexpr (TILE) {
        D = valid ? rowsum[srow] : 0.0f;
    } else {
        float o[CH];
        att_load_row<HS>(o, out + orow, hs, g, valid);
        float acc = 0.0f;
#pragma unroll
        for (int e = 0; e < CH; e++) acc += dO[e] * o[e];
        D = group_sum<G>(acc);
        if (valid && g == 0) rowsum[srow] = D;
    }
    const float row_lse = valid ? lse[srow] : 0.0f;
#pragma unroll
    for (int e = 0; e < CH; e++) dq[e] = 0.0f;
    const float keep_scale = DROPOUT ? drop.scale : 1.0f;
    const int kend = min(pk.last + 1 + diag, nkr);
    const int kfirst = att_first_key(blk, sp, t), kbegin = att_first_key(blk, sp, pk.first) / ATT_TILE * ATT_TILE; /* as in the forward */
    for (int k0 = kbegin; k0 < kend; k0 += ATT_TILE) {
        __syncthreads();
        att_stage_tile<HS>(ks, vs, sp.k, sp.v, sp.kv_ld, k0, nkr, hs);
        __syncthreads();
        unsigned keep = ~0u;
        if constexpr (DROPOUT && TILE)
            keep = att_drop_keep_row16_any(drop, bh, sp.T, sp.tq0 + t, sp.tk0 + k0) |
                   att_drop_keep_row16_any(drop, bh, sp.T, sp.tq0 + t, sp.tk0 + k0 + 16) << 16;
        else if constexpr (DROPOUT)
            keep = att_drop_keep_row16(drop, bh, T, t, k0) | att_drop_keep_row16(drop, bh, T, t, k0 + 16) << 16;
        for (int j = 0; j < ATT_TILE; j++) {
            const int key = k0 + j;
            const float s = group_sum<G>(att_dot_smem<HS>(q, ks[j], g));
            const float dp = group_sum<G>(att_dot_smem<HS>(dO, vs[j], g));
            const float p = (key <= t + diag && key < nkr && key >= kfirst) ? expf(s * scale - row_lse) : 0.0f;
            const float ds = p * (att_drop_factor(keep, j, keep_scale) * dp - D) * scale;
            att_axpy_smem<HS>(dq, ds, ks[j], g);
        }
    }
    if constexpr (TILE) {
        if (valid && t + diag >= 0) {
            float* row = blk.acc + (sp.qrow + t) * hd.out_ld + (size_t)h * hs;
#pragma unroll
            for (int e = 0; e < CH; e++) {
                const int c = att_channel<G>(e, g);
                if (c < hs) row[c] += dq[e];
            }
        }
    } else if (valid) {
        if (rope.table.half) att_rope_back_row<HS>(dq, rope, b, t, g);
        att_store_row<HS>(dqkv + ((size_t)b * T + t) * ld + (size_t)h * hs, dq, 1.0f, hs, g);
    }
}

/* ---- backward, pass 2: dk and dv ----
 * grid (ceil(nk/ATT_ROWS), B*NKV), block THREADS; one key row of one (b,
 * K/V head) per G threads; for each query head of the group in turn (head
 * ascending), the queries that see the block's first key (t >= s0 - diag)
 * stream through shared memory, and dk, dv sum over all of them. Key tiles
 * are visited first-first (the longest). Dropout: each query tile draws the
 * key's column of 32 keep bits again, with the query head's b*NH + h; dv
 * takes the dropped, scaled p, ds masks dp only (D unchanged, header). TILE:
 * dk and dv are added to blk.acc (K at channel 0, V at kv_w; keys some query
 * of the tile sees). */
template <int HS, bool DROPOUT, bool TILE>
__global__ void __launch_bounds__(AttConfig<HS>::THREADS)
attention_backward_dkv_kernel(floatX* dqkv, const float* rowsum, const floatX* dout, const floatX* qkv, const float* lse,
                              int T, const AttHeads hd, float scale, DropoutSite drop, AttTileArgs blk, const RopeRows rope) {
    constexpr int CH = AttConfig<HS>::CH, G = AttConfig<HS>::G;
    static_assert(ATT_TILE == 32 && ATT_ROWS % 16 == 0, "a tile's keep bits are two att_drop_keep_col16 (t0 a multiple of 16)");
    __shared__ __align__(16) float qs[ATT_TILE][HS];
    __shared__ __align__(16) float dos[ATT_TILE][HS];
    __shared__ float lse_s[ATT_TILE], d_s[ATT_TILE];
    __shared__ int kf_s[ATT_TILE]; /* documents: each staged query's first key */
    const int b = blockIdx.y / hd.NKV, kvh = blockIdx.y % hd.NKV, hs = hd.HD;
    const int s0 = blockIdx.x * ATT_ROWS;
    const int g = threadIdx.x % G, s = s0 + threadIdx.x / G;
    /* where the rows are: as in the forward, for the group's first query head (the K/V rows are the group's) */
    const AttSpan sp0 = att_span<TILE>(qkv, T, hd, blk, b, kvh * hd.group);
    const int nqr = TILE ? sp0.nq : T, nkr = TILE ? sp0.nk : T, diag = TILE ? sp0.diag : 0;
    const bool valid = s < nkr;
    const int sc = min(s, nkr - 1);
    const size_t ld = hd.q_ld;
    float k[CH], v[CH], dk[CH], dv[CH];
    att_load_row<HS>(k, sp0.k + (size_t)sc * sp0.kv_ld, hs, g, valid);
    att_load_row<HS>(v, sp0.v + (size_t)sc * sp0.kv_ld, hs, g, valid);
#pragma unroll
    for (int e = 0; e < CH; e++) { dk[e] = 0.0f; dv[e] = 0.0f; }
    const float keep_scale = DROPOUT ? drop.scale : 1.0f;
    const int t_begin = TILE ? max(s0 - diag, 0) : s0;
    /* documents: no query past the last one whose document starts at or before this block's last key */
    const int t_end = att_queries_end(blk, sp0, t_begin, min(s0 + ATT_ROWS, nkr) - 1);
    for (int j = 0; j < hd.group; j++) { /* the group's query heads, in order */
        const int h = kvh * hd.group + j, bh = b * hd.NH + h;
        const floatX* base = sp0.q + (size_t)j * hs;
        const floatX* obase = dout + sp0.qrow * hd.out_ld + (size_t)h * hs;
        const size_t stat0 = sp0.stat + (size_t)j * (TILE ? blk.a.Tl : T);
        for (int t0 = t_begin; t0 < t_end; t0 += ATT_TILE) {
            __syncthreads(); /* the previous tile (of this head or the one before) is no longer read */
            /* q rows have stride QKV, dout rows stride NH HD: stage them separately */
            for (int idx = threadIdx.x; idx < ATT_TILE * HS; idx += blockDim.x) {
                int jj = idx / HS, c = idx % HS, r = t0 + jj;
                bool ok = r < nqr && c < hs;
                qs[jj][c] = ok ? to_f32(base[(size_t)r * ld + c]) : 0.0f;
                dos[jj][c] = ok ? to_f32(obase[(size_t)r * hd.out_ld + c]) : 0.0f;
            }
            for (int jj = threadIdx.x; jj < ATT_TILE; jj += blockDim.x) {
                int r = t0 + jj;
                lse_s[jj] = r < nqr ? lse[stat0 + r] : 0.0f;
                d_s[jj] = r < nqr ? rowsum[stat0 + r] : 0.0f;
                kf_s[jj] = att_first_key(blk, sp0, r);
            }
            __syncthreads();
            unsigned keep = ~0u;
            if constexpr (DROPOUT && TILE)
                keep = att_drop_keep_col16_any(drop, bh, sp0.T, sp0.tq0 + t0, sp0.tk0 + s) |
                       att_drop_keep_col16_any(drop, bh, sp0.T, sp0.tq0 + t0 + 16, sp0.tk0 + s) << 16;
            else if constexpr (DROPOUT)
                keep = att_drop_keep_col16(drop, bh, T, t0, s) | att_drop_keep_col16(drop, bh, T, t0 + 16, s) << 16;
            for (int jj = 0; jj < ATT_TILE; jj++) {
                const int t = t0 + jj;
                const float score = group_sum<G>(att_dot_smem<HS>(k, qs[jj], g));
                const float dp = group_sum<G>(att_dot_smem<HS>(v, dos[jj], g));
                const float p = (t + diag >= s && t < nqr && kf_s[jj] <= s) ? expf(score * scale - lse_s[jj]) : 0.0f;
                const float f = att_drop_factor(keep, jj, keep_scale);
                const float ds = p * (f * dp - d_s[jj]) * scale;
                att_axpy_smem<HS>(dv, p * f, dos[jj], g);
                att_axpy_smem<HS>(dk, ds, qs[jj], g);
            }
        }
    }
    if constexpr (TILE) {
        if (valid && s <= nqr - 1 + diag) {
            float* row = blk.acc + (sp0.krow + s) * 2 * hd.kv_w + (size_t)kvh * hs;
#pragma unroll
            for (int e = 0; e < CH; e++) {
                const int c = att_channel<G>(e, g);
                if (c < hs) {
                    row[c] += dk[e];
                    row[hd.kv_w + c] += dv[e];
                }
            }
        }
    } else if (valid) {
        floatX* drow = dqkv + ((size_t)b * T + s) * ld + (size_t)kvh * hs;
        att_store_row<HS>(drow + hd.v_off, dv, 1.0f, hs, g); /* dV first: its registers are free for RoPE's turn of dK */
        if (rope.table.half) att_rope_back_row<HS>(dk, rope, b, s, g);
        att_store_row<HS>(drow + hd.k_off, dk, 1.0f, hs, g);
    }
}

/* Smallest supported template head size >= hs, or 0. */
static inline int attention_head_bucket(int hs) {
    return hs <= 16 ? 16 : hs <= 32 ? 32 : hs <= 64 ? 64 : hs <= 128 ? 128 : 0;
}

/* The heads the kernels take: HD at most 128, NKV dividing NH. */
static inline void attention_check_heads(int NH, int NKV, int HD) {
    if (NH <= 0 || NKV <= 0 || HD <= 0 || NH % NKV)
        fail("attention: %d query heads, %d K/V heads of %d: the K/V heads must divide the query heads", NH, NKV, HD);
    if (!attention_head_bucket(HD)) fail("attention: head size %d is above the 128 the CUDA kernels support", HD);
}

/* grid (ceil(T/rows), B*heads): heads NH for the query-row kernels, NKV for the dK/dV ones. */
static inline dim3 attention_grid(int B, int T, int NH, int rows_per_block) {
    if ((long long)B * NH > 65535) fail("attention: B*NH = %lld exceeds the grid limit 65535 (use a smaller -b)", (long long)B * NH);
    return dim3((unsigned)ceil_div((size_t)T, rows_per_block), (unsigned)(B * NH));
}

/* The kernel family that runs for head size hs when `kind` is asked for
 * (the trainer asks for ATTENTION_KIND): the one statement of the dispatch
 * described in the header, which the launchers, the start-up note and
 * bench_attention's launch report all follow. CUDA cores where the build
 * has no tensor-core kernels (fp32, ATTENTION=simt) or simt is asked for;
 * the mma kernels for head sizes 64 and 128 exactly (no padded channels)
 * when asked for; the WMMA kernels otherwise. (The mma launch also needs
 * 16-byte aligned rows for cp.async: attention_mma_fits.) */
static inline int attention_family(int kind, int hs) {
    if (!ATTENTION_TENSOR_CORES || kind == ATT_KIND_SIMT) return ATT_KIND_SIMT;
    if (kind == ATT_KIND_MMA && (hs == 64 || hs == 128)) return ATT_KIND_MMA;
    return ATT_KIND_TC;
}

/* The mma kernels run: attention_family says so, the template is the head
 * size itself, and the rows are 16-byte aligned; else the WMMA kernels. */
static inline bool attention_mma_fits(int kind, int HS, int hs, const void* a, const void* b, const void* c) {
    return attention_family(kind, hs) == ATT_KIND_MMA && HS == hs && (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 == 0);
}

/* What the build's kernels do with head size hs: "" or the one-line note a
 * trainer prints at start-up when the mma build falls back to WMMA. */
static inline const char* attention_kernels_note(int hs) {
    if (ATTENTION_KIND == ATT_KIND_MMA && attention_family(ATTENTION_KIND, hs) != ATT_KIND_MMA)
        return "attention: head size is neither 64 nor 128: the WMMA (tc) kernels run instead of the mma ones";
    return "";
}

/* The launchers take the kernel family (AttentionKind; tc and mma only where
 * they are built, ATTENTION_TENSOR_CORES), the heads (AttHeads) and the
 * dropout site (threshold 0: none). The trainer passes ATTENTION_KIND;
 * bench_attention every kind. The simt and tc kernels are built twice,
 * DROPOUT false and true: without dropout the plain instantiation runs,
 * whose code (and register count) carries nothing of dropout, so a run
 * without it pays nothing for it. The query-row kernels' grids are
 * att_pack_grid's ((ceil(G ceil(T/R) / W), B*NKV): mma, simt, tc), the
 * dK/dV kernels' (ceil(T/rows), B*NKV). */
template <int HS, bool DROPOUT>
static void attention_forward_launch_as(floatX* out, float* lse, const floatX* qkv, int B, int T, const AttHeads& hd, int kind,
                                        const DropoutSite& drop, const int* doc_start, cudaStream_t stream) {
    const int hs = hd.HD, NH = hd.NH;
    float scale = 1.0f / sqrtf((float)hs);
    AttTileArgs docs{};
    docs.a.doc_start = doc_start;
#if ATTENTION_TENSOR_CORES
    if constexpr (HS == 64 || HS == 128) {
        if (attention_mma_fits(kind, HS, hs, out, qkv, qkv)) {
            attention_mma_forward_kernel<HS, false><<<att_pack_grid(B, T, NH, hd.NKV, 16 * AttMma<HS>::FWD_MT, ATT_MMA_WARPS), ATT_MMA_THREADS, 0, stream>>>(out, lse, qkv, T, hd,
                                                                                                                         scale, drop, docs);
            CUDA_CHECK_LAUNCH();
            return;
        }
    }
    if (kind != ATT_KIND_SIMT) {
        attention_tc_forward_kernel<HS, DROPOUT><<<att_tc_grid(B, T, NH, hd.NKV), ATT_TC_THREADS, 0, stream>>>(out, lse, qkv, T, hd, scale, drop,
                                                                                                                       doc_start);
        CUDA_CHECK_LAUNCH();
        return;
    }
#else
    (void)kind;
#endif
    attention_forward_kernel<HS, DROPOUT, false><<<att_simt_grid<HS>(B, T, NH, hd.NKV), AttConfig<HS>::THREADS, 0, stream>>>(out, lse, qkv, T, hd, scale, drop,
                                                                                                                    docs);
    CUDA_CHECK_LAUNCH();
}

template <int HS>
static void attention_forward_launch(floatX* out, float* lse, const floatX* qkv, int B, int T, const AttHeads& hd, int kind,
                                     const DropoutSite& drop, cudaStream_t stream, const int* doc_start = nullptr) {
    if (drop.threshold) attention_forward_launch_as<HS, true>(out, lse, qkv, B, T, hd, kind, drop, doc_start, stream);
    else attention_forward_launch_as<HS, false>(out, lse, qkv, B, T, hd, kind, drop, doc_start, stream);
}

/* RoPE in the backward (rope.cuh): the kernels of `family` turn dQ and dK
 * back in their epilogues, where a channel and its pair (c + HS/2) meet in
 * one thread: the mma kernels (head sizes 64 and 128, their templates'),
 * and the simt ones where the head size is the template's (16, 32, 64,
 * 128; not a padded bucket). Elsewhere rope.cuh's pass turns dqkv back
 * after them: the tc kernels, at their register limits (the dK/dV kernel
 * at 255 at hs128), spilled with the turn in their epilogue (BF16 hs128
 * with dropout 8 bytes, FP16 hs32 4), and the padded simt buckets would
 * need the pair from another thread. */
static inline bool attention_rope_in_kernels(int family, int HS, int hs) {
    return family == ATT_KIND_MMA || (family == ATT_KIND_SIMT && HS == hs);
}

/* rope: RoPE's rows (table.half 0: none); returns whether the kernels
 * that ran turned dQ and dK back by it (attention_rope_in_kernels). */
template <int HS, bool DROPOUT>
static bool attention_backward_launch_as(floatX* dqkv, float* rowsum, const floatX* dout, const floatX* qkv,
                                         const floatX* out, const float* lse, int B, int T, const AttHeads& hd, int kind, const DropoutSite& drop,
                                         const int* doc_start, const RopeRows& rope, cudaStream_t stream) {
    const int hs = hd.HD, NH = hd.NH, NKV = hd.NKV;
    float scale = 1.0f / sqrtf((float)hs);
    AttTileArgs docs{};
    docs.a.doc_start = doc_start;
#if ATTENTION_TENSOR_CORES
    if constexpr (HS == 64 || HS == 128) {
        if (attention_mma_fits(kind, HS, hs, dqkv, dout, qkv) && attention_mma_fits(kind, HS, hs, out, out, out)) {
            att_pack_grid(B, T, NH, NKV, 16, ATT_MMA_WARPS); /* the grid limit on B*NKV, checked before any launch */
            attention_mma_backward_launch<HS>(dqkv, rowsum, dout, qkv, out, lse, B, T, hd, scale, drop, doc_start, rope, stream);
            return true;
        }
    }
    if (kind != ATT_KIND_SIMT) {
        attention_tc_backward_dq_kernel<HS, DROPOUT><<<att_tc_grid(B, T, NH, NKV), ATT_TC_THREADS, 0, stream>>>(
            dqkv, rowsum, dout, qkv, out, lse, T, hd, scale, drop, doc_start);
        CUDA_CHECK_LAUNCH();
        const size_t dkv_smem = AttTcDkvSmem<HS>::BYTES;
        CUDA_CHECK(cudaFuncSetAttribute(attention_tc_backward_dkv_kernel<HS, DROPOUT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dkv_smem));
        attention_tc_backward_dkv_kernel<HS, DROPOUT><<<attention_grid(B, T, NKV, ATT_TC_ROWS), ATT_TC_THREADS, dkv_smem, stream>>>(
            dqkv, rowsum, dout, qkv, lse, T, hd, scale, drop, doc_start);
        CUDA_CHECK_LAUNCH();
        return false;
    }
#else
    (void)kind;
#endif
    const bool turn = attention_rope_in_kernels(ATT_KIND_SIMT, HS, hs);
    const RopeRows in_kernels = turn ? rope : RopeRows{};
    attention_backward_dq_kernel<HS, DROPOUT, false><<<att_simt_grid<HS>(B, T, NH, NKV), AttConfig<HS>::THREADS, 0, stream>>>(
        dqkv, rowsum, dout, qkv, out, lse, T, hd, scale, drop, docs, in_kernels);
    CUDA_CHECK_LAUNCH();
    attention_backward_dkv_kernel<HS, DROPOUT, false><<<attention_grid(B, T, NKV, ATT_ROWS), AttConfig<HS>::THREADS, 0, stream>>>(
        dqkv, rowsum, dout, qkv, lse, T, hd, scale, drop, docs, in_kernels);
    CUDA_CHECK_LAUNCH();
    return turn;
}

/* Whether rope (NULL or table.half 0: none) turns heads of HD, which its table must be for. */
static inline bool attention_rope_turns(const RopeRows* rope, int HD) {
    if (!rope || !rope->table.half) return false;
    if (2 * rope->table.half != HD) fail("attention: RoPE's table is for head size %d, the heads' is %d", 2 * rope->table.half, HD);
    return true;
}

/* rope: RoPE's rows (NULL or table.half 0: none), turned back in the
 * kernels or after them (attention_rope_in_kernels). */
template <int HS>
static void attention_backward_launch(floatX* dqkv, float* rowsum, const floatX* dout, const floatX* qkv,
                                      const floatX* out, const float* lse, int B, int T, const AttHeads& hd, int kind, const DropoutSite& drop,
                                      cudaStream_t stream, const int* doc_start = nullptr, const RopeRows* rope = nullptr) {
    const bool turn = attention_rope_turns(rope, hd.HD);
    if (turn && rope->lay.T != T) fail("attention: RoPE's rows are sequences of %d tokens, the call's of %d", rope->lay.T, T);
    const RopeRows rows = turn ? *rope : RopeRows{};
    const bool turned = drop.threshold
                            ? attention_backward_launch_as<HS, true>(dqkv, rowsum, dout, qkv, out, lse, B, T, hd, kind, drop, doc_start, rows, stream)
                            : attention_backward_launch_as<HS, false>(dqkv, rowsum, dout, qkv, out, lse, B, T, hd, kind, drop, doc_start, rows, stream);
    if (turn && !turned) gpu_rope_rotate(dqkv, hd.q_ld, rope, 0, B * T, hd.NH + hd.NKV, -1, stream);
}

/* One kernel launch of the attention forward or backward, as the launchers
 * make it for kind's family (attention_family) without dropout: for the
 * launch report (bench_attention --launch), which prints it without running
 * it. smem: static plus dynamic shared memory bytes; regs: the recorded
 * ptxas figure (attention_mma.cuh's table), 0 where none is recorded (a GPU's
 * cudaFuncGetAttributes knows it). */
typedef struct {
    const char* name;
    const void* fn;
    dim3 grid;
    int threads;
    size_t smem;
    bool dynamic_smem; /* smem is the launch's dynamic shared memory (else static) */
    int regs;
} AttLaunch;

#if ATTENTION_TENSOR_CORES
/* The mma dK/dV kernel's launch at `warps` warps a block (attention_mma_dkv_warps). */
template <int HS, int WARPS> static AttLaunch attention_mma_dkv_launch_of(int B, int T, int NKV) {
    return AttLaunch{"attention_mma_backward_dkv_kernel", (const void*)attention_mma_backward_dkv_kernel<HS, false, WARPS>,
                     attention_mma_dkv_grid(B, T, NKV, WARPS), 32 * WARPS, AttMmaBwd<HS, WARPS>::SMEM_BYTES, true, AttMmaResources<HS>::DKV_REGS};
}
#endif

/* Fills l[0..] with the forward's launches then the backward's for NH query
 * and NKV K/V heads of hs (template HS: its bucket) on a device of `sms`
 * SMs (the mma dK/dV kernel's width depends on it), in launch order;
 * returns how many (at most 4); *forward = how many are the forward's. */
template <int HS>
static int attention_launches(AttLaunch* l, int* forward, int B, int T, int NH, int NKV, int hs, int kind, int sms) {
    const int family = attention_family(kind, hs);
    int n = 0;
#if ATTENTION_TENSOR_CORES
    if constexpr (HS == 64 || HS == 128) {
        if (family == ATT_KIND_MMA) {
            typedef AttMmaResources<HS> R;
            l[n++] = AttLaunch{"attention_mma_forward_kernel", (const void*)attention_mma_forward_kernel<HS, false>,
                               att_pack_grid(B, T, NH, NKV, 16 * AttMma<HS>::FWD_MT, ATT_MMA_WARPS), ATT_MMA_THREADS, R::FWD_SMEM, false, R::FWD_REGS};
            *forward = n;
            l[n++] = AttLaunch{"attention_mma_rowsum_kernel", (const void*)attention_mma_rowsum_kernel<HS>,
                               dim3((unsigned)ceil_div((size_t)B * T * NH, 256)), 256, 0, false, R::ROWSUM_REGS};
            const int warps = attention_mma_dkv_warps(B, T, NKV, sms);
            l[n++] = warps == 1   ? attention_mma_dkv_launch_of<HS, 1>(B, T, NKV)
                     : warps == 2 ? attention_mma_dkv_launch_of<HS, 2>(B, T, NKV)
                                  : attention_mma_dkv_launch_of<HS, ATT_MMA_WARPS>(B, T, NKV);
            l[n++] = AttLaunch{"attention_mma_backward_dq_kernel", (const void*)attention_mma_backward_dq_kernel<HS, false>,
                               att_pack_grid(B, T, NH, NKV, 16, ATT_MMA_WARPS), ATT_MMA_THREADS, R::DQ_SMEM, false, R::DQ_REGS};
            return n;
        }
    }
    if (family == ATT_KIND_TC) {
        const dim3 grid = att_tc_grid(B, T, NH, NKV);
        l[n++] = AttLaunch{"attention_tc_forward_kernel", (const void*)attention_tc_forward_kernel<HS, false>, grid, ATT_TC_THREADS,
                           AttTcForwardSmem<HS>::BYTES, false, 0};
        *forward = n;
        l[n++] = AttLaunch{"attention_tc_backward_dq_kernel", (const void*)attention_tc_backward_dq_kernel<HS, false>, grid, ATT_TC_THREADS,
                           AttTcDqSmem<HS>::BYTES, false, 0};
        l[n++] = AttLaunch{"attention_tc_backward_dkv_kernel", (const void*)attention_tc_backward_dkv_kernel<HS, false>,
                           attention_grid(B, T, NKV, ATT_TC_ROWS), ATT_TC_THREADS, AttTcDkvSmem<HS>::BYTES, true, 0};
        return n;
    }
#endif
    (void)family;
    (void)sms; /* only the mma dK/dV kernel's width depends on it */
    const dim3 grid = att_simt_grid<HS>(B, T, NH, NKV);
    const size_t tile = (size_t)ATT_TILE * HS * sizeof(float);
    l[n++] = AttLaunch{"attention_forward_kernel", (const void*)attention_forward_kernel<HS, false, false>, grid, AttConfig<HS>::THREADS, 2 * tile, false, 0};
    *forward = n;
    l[n++] = AttLaunch{"attention_backward_dq_kernel", (const void*)attention_backward_dq_kernel<HS, false, false>, grid, AttConfig<HS>::THREADS, 2 * tile, false, 0};
    l[n++] = AttLaunch{"attention_backward_dkv_kernel", (const void*)attention_backward_dkv_kernel<HS, false, false>, attention_grid(B, T, NKV, ATT_ROWS),
                       AttConfig<HS>::THREADS, 2 * tile + 2 * ATT_TILE * sizeof(float), false, 0};
    return n;
}

/* Device scratch of the attention backward, every family: D (rowsum), one
 * fp32 per (b, query head, t). */
static inline size_t attention_scratch_bytes(int B, int T, int NH) { return (size_t)B * T * NH * sizeof(float); }

/* A site that drops nothing: what callers without dropout pass. */
static inline DropoutSite attention_no_dropout(void) {
    DropoutSite none;
    memset(&none, 0, sizeof(none));
    none.scale = 1.0f;
    return none;
}

/* out (B,T,NH*HD), lse (B,NH,T) from qkv (B,T,(NH+2NKV)*HD) (the header's
 * layout; GPT-2: NKV = NH, HD = C/NH); drop: the attention site of this
 * layer and micro-step (dropout.h), or NULL for none; doc_start (device
 * (B,T)): packed documents' starts, or NULL for none (every kernel family
 * masks them: docs/documents.md). */
static inline void gpu_attention_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int HD,
                                         const DropoutSite* drop, cudaStream_t stream, const int* doc_start = nullptr) {
    attention_check_heads(NH, NKV, HD);
    DropoutSite d = drop ? *drop : attention_no_dropout();
    const AttHeads hd = att_heads(NH, NKV, HD);
    switch (attention_head_bucket(HD)) {
    case 16: attention_forward_launch<16>(out, lse, qkv, B, T, hd, ATTENTION_KIND, d, stream, doc_start); break;
    case 32: attention_forward_launch<32>(out, lse, qkv, B, T, hd, ATTENTION_KIND, d, stream, doc_start); break;
    case 64: attention_forward_launch<64>(out, lse, qkv, B, T, hd, ATTENTION_KIND, d, stream, doc_start); break;
    default: attention_forward_launch<128>(out, lse, qkv, B, T, hd, ATTENTION_KIND, d, stream, doc_start); break;
    }
}

/* dqkv (B,T,(NH+2NKV)*HD) overwritten from dout (B,T,NH*HD); rowsum
 * (B,NH,T) fp32 scratch (the only scratch of every kernel family); drop: the
 * forward's site, so the same mask is drawn again; doc_start: the forward's;
 * rope: RoPE's rows (the call's B*T) where qkv's Q and K were turned, and
 * dqkv's dQ and dK are then the gradients before the turn (NULL: none). */
static inline void gpu_attention_backward(floatX* dqkv, float* rowsum, const floatX* dout, const floatX* qkv, const floatX* out,
                                          const float* lse, int B, int T, int NH, int NKV, int HD, const DropoutSite* drop,
                                          cudaStream_t stream, const int* doc_start = nullptr, const RopeRows* rope = nullptr) {
    attention_check_heads(NH, NKV, HD);
    DropoutSite d = drop ? *drop : attention_no_dropout();
    const AttHeads hd = att_heads(NH, NKV, HD);
    switch (attention_head_bucket(HD)) {
    case 16: attention_backward_launch<16>(dqkv, rowsum, dout, qkv, out, lse, B, T, hd, ATTENTION_KIND, d, stream, doc_start, rope); break;
    case 32: attention_backward_launch<32>(dqkv, rowsum, dout, qkv, out, lse, B, T, hd, ATTENTION_KIND, d, stream, doc_start, rope); break;
    case 64: attention_backward_launch<64>(dqkv, rowsum, dout, qkv, out, lse, B, T, hd, ATTENTION_KIND, d, stream, doc_start, rope); break;
    default: attention_backward_launch<128>(dqkv, rowsum, dout, qkv, out, lse, B, T, hd, ATTENTION_KIND, d, stream, doc_start, rope); break;
    }
}

/* ---- attention tiles (context parallelism's ring attention) ----
 * The GPU's side of the CPU reference's attention_tile_forward,
 * attention_tile_backward and attention_merge (train_gpt.c), for the ring
 * driver: each ring step runs the tiles of its K/V chunk in a fixed order,
 * so every result is deterministic (no atomics; one thread owns each
 * accumulator element, tiles add in launch order on one stream). Tensors,
 * for the tile's heads (att_tile_heads: NH query heads, NKV K/V heads of HD;
 * Q = NH HD, KV = NKV HD, QKV = Q + 2 KV):
 *   out_acc (B,Tl,Q), lse (B,NH,Tl), rowsum (B,NH,Tl) fp32;
 *   dq_acc (B,Tl,Q), dkv_acc (B,Tl,2KV; dK heads at 0, dV heads at KV) fp32;
 *   qkv (B,Tl,QKV), kv (B,Tl,kv_ld; K heads at 0, V heads at KV: the ring's
 *   compact K/V, or qkv + Q itself), dout, out (B,Tl,Q) floatX.
 * A tile whose causal mask is empty (k0 > q0 + Tq - 1) launches nothing;
 * rows (queries or keys) a tile's mask empties are left untouched.
 * Families: the mma family runs its kernels' TILE instantiations
 * (attention_mma.cuh) where attention_tile_mma_fits; every other case, the
 * tc family included (head sizes other than 64 and 128 in the 16-bit
 * builds, or ATTENTION=tc), runs the simt kernels' (CUDA cores, fp32 math):
 * the WMMA kernels have no tile variant yet (docs/attention_kernels.md).
 * Packed documents (a->doc_start, a device pointer) are masked by the mma
 * and simt tile kernels alike. */

/* rowsum (B,NH,Tl) = dout . out of each (row, head): one thread per (b, t, h),
 * fp32 products summed in channel order. grid ceil(B*Tl*NH / 256), block 256. */
__global__ void __launch_bounds__(256)
attention_tile_rowsum_kernel(float* rowsum, const floatX* dout, const floatX* out, int B, int Tl, int NH, int hs) {
    const size_t idx = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (idx >= (size_t)B * Tl * NH) return;
    const int h = (int)(idx % NH);
    const size_t bt = idx / NH, off = bt * NH * hs + (size_t)h * hs;
    float acc = 0.0f;
    for (int c = 0; c < hs; c++) acc += to_f32(dout[off + c]) * to_f32(out[off + c]);
    rowsum[(bt / Tl * NH + h) * Tl + bt % Tl] = acc;
}

/* out (rows, width) floatX = acc rounded. grid ceil(rows*width / 256), block 256. */
__global__ void __launch_bounds__(256) attention_ring_store_out_kernel(floatX* out, const float* acc, size_t n) {
    const size_t i = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (i < n) out[i] = from_f32<floatX>(acc[i]);
}

/* dqkv (rows, Q + 2KV) floatX: channels [0,Q) from dq_acc (rows, Q), [Q,Q+2KV)
 * from dkv_acc (rows, 2KV), rounded. grid ceil(rows*(Q+2KV) / 256), block 256. */
__global__ void __launch_bounds__(256)
attention_ring_store_dqkv_kernel(floatX* dqkv, const float* dq_acc, const float* dkv_acc, size_t rows, size_t q_w, size_t kv2_w) {
    const size_t i = (size_t)blockIdx.x * 256 + threadIdx.x, ld = q_w + kv2_w;
    if (i >= rows * ld) return;
    const size_t r = i / ld, c = i % ld;
    dqkv[i] = from_f32<floatX>(c < q_w ? dq_acc[r * q_w + c] : dkv_acc[r * kv2_w + (c - q_w)]);
}

/* attention_ring_store_dqkv_kernel with RoPE's turn back (rope.cuh) of dQ
 * and dK: thread (r, j) of rows x HD/2 computes the angle of row r's
 * position and channel j once and turns pair (j, j + HD/2) of each of the
 * row's NH dQ and NKV dK heads in fp32 before the rounding; dV's pair is
 * copied. grid ceil(rows*HD/2 / 256), block 256. */
__global__ void __launch_bounds__(256)
attention_ring_store_dqkv_rope_kernel(floatX* dqkv, const float* dq_acc, const float* dkv_acc, size_t rows, int NH, int NKV, RopeRows rope) {
    const int half = rope.table.half, HD = 2 * half;
    const size_t i = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (i >= rows * half) return;
    const size_t r = i / half, q_w = (size_t)NH * HD, kv_w = (size_t)NKV * HD;
    const int j = (int)(i % half);
    float co, si;
    rope_cos_sin(rope_position(rope, r), rope.table.inv_freq[j], rope.table.mscale, -1, &co, &si);
    floatX* out = dqkv + r * (q_w + 2 * kv_w) + j;
    for (int h = 0; h < NH + 2 * NKV; h++) { /* the row's heads in dqkv's order: dQ, dK, dV */
        const float* src = h < NH ? dq_acc + r * q_w + (size_t)h * HD : dkv_acc + r * 2 * kv_w + (size_t)(h - NH) * HD;
        float a = src[j], b = src[j + half];
        if (h < NH + NKV) rope_turn(&a, &b, co, si);
        out[(size_t)h * HD] = from_f32<floatX>(a);
        out[(size_t)h * HD + half] = from_f32<floatX>(b);
    }
}

static inline unsigned attention_elementwise_blocks(size_t n) {
    if (ceil_div(n, 256) > 0x7fffffffu) fail("attention: %zu elements exceed one launch's grid", n);
    return (unsigned)ceil_div(n, 256);
}

/* The mma tile kernels run: attention_mma_fits for the tile's head size
 * (the family, 16-byte aligned rows for cp.async: kv_ld a multiple of 8
 * elements too) and 8-byte aligned fp32 accumulators (float2 accesses). */
static inline bool attention_tile_mma_fits(int HS, const AttHeads& hd, const floatX* qkv, const floatX* kv, int kv_ld, const float* acc0,
                                           const float* acc1) {
    return attention_mma_fits(ATTENTION_KIND, HS, hd.HD, qkv, kv, kv) && kv_ld % 8 == 0 && (((uintptr_t)acc0 | (uintptr_t)acc1) % 8 == 0);
}

/* The tile's mask keeps no (query, key) pair: nothing to launch. */
static inline bool attention_tile_empty(const AttentionTile* a) {
    return a->Tq <= 0 || a->Tk <= 0 || a->k0 > a->q0 + a->Tq - 1;
}

template <int HS, bool DROPOUT>
static void attention_tile_forward_as(float* out_acc, float* lse, const floatX* qkv, const floatX* kv, int kv_ld, const AttentionTile* a,
                                      const AttHeads& hd, int first, const DropoutSite& drop, cudaStream_t stream) {
    const float scale = 1.0f / sqrtf((float)hd.HD);
    const AttTileArgs blk = {*a, kv, kv_ld, out_acc, first};
    attention_forward_kernel<HS, DROPOUT, true><<<att_simt_grid<HS>(a->B, a->Tq, hd.NH, hd.NKV), AttConfig<HS>::THREADS, 0, stream>>>(
        nullptr, lse, qkv, a->Tl, hd, scale, drop, blk);
    CUDA_CHECK_LAUNCH();
}

template <int HS>
static void attention_tile_forward_launch(float* out_acc, float* lse, const floatX* qkv, const floatX* kv, int kv_ld, const AttentionTile* a,
                                          const AttHeads& hd, int first, const DropoutSite& drop, cudaStream_t stream) {
#if ATTENTION_TENSOR_CORES
    if constexpr (HS == 64 || HS == 128) {
        if (attention_tile_mma_fits(HS, hd, qkv, kv, kv_ld, out_acc, out_acc)) {
            attention_mma_tile_forward_launch<HS>(out_acc, lse, qkv, kv, kv_ld, a, hd, first, 1.0f / sqrtf((float)HS), drop, stream);
            return;
        }
    }
#endif
    if (drop.threshold) attention_tile_forward_as<HS, true>(out_acc, lse, qkv, kv, kv_ld, a, hd, first, drop, stream);
    else attention_tile_forward_as<HS, false>(out_acc, lse, qkv, kv, kv_ld, a, hd, first, drop, stream);
}

template <int HS, bool DROPOUT>
static void attention_tile_backward_as(float* dq_acc, float* dkv_acc, const float* rowsum, const floatX* dout, const floatX* qkv,
                                       const floatX* kv, int kv_ld, const float* lse, const AttentionTile* a, const AttHeads& hd,
                                       const DropoutSite& drop, cudaStream_t stream) {
    const float scale = 1.0f / sqrtf((float)hd.HD);
    /* the dQ kernel's rowsum is written only by its whole-sequence instantiation */
    attention_backward_dq_kernel<HS, DROPOUT, true><<<att_simt_grid<HS>(a->B, a->Tq, hd.NH, hd.NKV), AttConfig<HS>::THREADS, 0, stream>>>(
        nullptr, const_cast<float*>(rowsum), dout, qkv, nullptr, lse, a->Tl, hd, scale, drop, AttTileArgs{*a, kv, kv_ld, dq_acc, 0}, RopeRows{});
    CUDA_CHECK_LAUNCH();
    attention_backward_dkv_kernel<HS, DROPOUT, true><<<attention_grid(a->B, a->Tk, hd.NKV, ATT_ROWS), AttConfig<HS>::THREADS, 0, stream>>>(
        nullptr, rowsum, dout, qkv, lse, a->Tl, hd, scale, drop, AttTileArgs{*a, kv, kv_ld, dkv_acc, 0}, RopeRows{});
    CUDA_CHECK_LAUNCH();
}

template <int HS>
static void attention_tile_backward_launch(float* dq_acc, float* dkv_acc, const float* rowsum, const floatX* dout, const floatX* qkv,
                                           const floatX* kv, int kv_ld, const float* lse, const AttentionTile* a, const AttHeads& hd,
                                           const DropoutSite& drop, cudaStream_t stream) {
#if ATTENTION_TENSOR_CORES
    if constexpr (HS == 64 || HS == 128) {
        if (attention_tile_mma_fits(HS, hd, qkv, kv, kv_ld, dq_acc, dkv_acc) && attention_mma_fits(ATTENTION_KIND, HS, HS, dout, dout, dout)) {
            attention_mma_tile_backward_launch<HS>(dq_acc, dkv_acc, rowsum, dout, qkv, kv, kv_ld, lse, a, hd, 1.0f / sqrtf((float)HS), drop, stream);
            return;
        }
    }
#endif
    if (drop.threshold) attention_tile_backward_as<HS, true>(dq_acc, dkv_acc, rowsum, dout, qkv, kv, kv_ld, lse, a, hd, drop, stream);
    else attention_tile_backward_as<HS, false>(dq_acc, dkv_acc, rowsum, dout, qkv, kv, kv_ld, lse, a, hd, drop, stream);
}

/* out_acc (B,Tl,NH HD) fp32, lse (B,NH,Tl) fp32: first != 0 writes the
 * tile's query rows, else merges into them by log-sum-exp (the CPU's
 * attention_merge), in launch order: deterministic, no atomics. The heads
 * are the tile's (a->NKV, a->HD; 0: GPT-2's). drop: the layer's attention
 * site (masks at global positions), or NULL. */
static inline void gpu_attention_tile_forward(float* out_acc, float* lse, const floatX* qkv, const floatX* kv, int kv_ld,
                                              const AttentionTile* a, int first, const DropoutSite* drop, cudaStream_t s) {
    if (attention_tile_empty(a)) return;
    const AttHeads hd = att_tile_heads(a);
    attention_check_heads(hd.NH, hd.NKV, hd.HD);
    const DropoutSite d = drop ? *drop : attention_no_dropout();
    switch (attention_head_bucket(hd.HD)) {
    case 16: attention_tile_forward_launch<16>(out_acc, lse, qkv, kv, kv_ld, a, hd, first, d, s); break;
    case 32: attention_tile_forward_launch<32>(out_acc, lse, qkv, kv, kv_ld, a, hd, first, d, s); break;
    case 64: attention_tile_forward_launch<64>(out_acc, lse, qkv, kv, kv_ld, a, hd, first, d, s); break;
    default: attention_tile_forward_launch<128>(out_acc, lse, qkv, kv, kv_ld, a, hd, first, d, s); break;
    }
}

/* rowsum (B,NH,Tl) = dout . out per (row, query head of hs); out: the merged
 * output as the layer stores it (floatX (B,Tl,NH hs)). */
static inline void gpu_attention_tile_rowsum(float* rowsum, const floatX* dout, const floatX* out, int B, int Tl, int NH, int hs, cudaStream_t s) {
    attention_tile_rowsum_kernel<<<attention_elementwise_blocks((size_t)B * Tl * NH), 256, 0, s>>>(rowsum, dout, out, B, Tl, NH, hs);
    CUDA_CHECK_LAUNCH();
}

/* dq_acc (B,Tl,NH HD) fp32 (the tile's query rows) and dkv_acc (B,Tl,2 NKV
 * HD) fp32 (its key rows; dK heads at 0, dV heads at NKV HD) accumulate (+=)
 * the tile's share, a K/V head's summed over its query heads in order; lse:
 * the merged forward's; drop: the forward's site. */
static inline void gpu_attention_tile_backward(float* dq_acc, float* dkv_acc, const float* rowsum, const floatX* dout, const floatX* qkv,
                                               const floatX* kv, int kv_ld, const float* lse, const AttentionTile* a, const DropoutSite* drop,
                                               cudaStream_t s) {
    if (attention_tile_empty(a)) return;
    const AttHeads hd = att_tile_heads(a);
    attention_check_heads(hd.NH, hd.NKV, hd.HD);
    const DropoutSite d = drop ? *drop : attention_no_dropout();
    switch (attention_head_bucket(hd.HD)) {
    case 16: attention_tile_backward_launch<16>(dq_acc, dkv_acc, rowsum, dout, qkv, kv, kv_ld, lse, a, hd, d, s); break;
    case 32: attention_tile_backward_launch<32>(dq_acc, dkv_acc, rowsum, dout, qkv, kv, kv_ld, lse, a, hd, d, s); break;
    case 64: attention_tile_backward_launch<64>(dq_acc, dkv_acc, rowsum, dout, qkv, kv, kv_ld, lse, a, hd, d, s); break;
    default: attention_tile_backward_launch<128>(dq_acc, dkv_acc, rowsum, dout, qkv, kv, kv_ld, lse, a, hd, d, s); break;
    }
}

/* out (rows, width) floatX = out_acc rounded (width: NH HD). */
static inline void gpu_attention_ring_store_out(floatX* out, const float* out_acc, size_t rows, int width, cudaStream_t s) {
    const size_t n = rows * (size_t)width;
    attention_ring_store_out_kernel<<<attention_elementwise_blocks(n), 256, 0, s>>>(out, out_acc, n);
    CUDA_CHECK_LAUNCH();
}

/* dqkv (rows, (NH + 2 NKV) HD) floatX from dq_acc (rows, NH HD) and dkv_acc
 * (rows, 2 NKV HD); rope: RoPE's rows (this member's), whose dQ and dK are
 * turned back on the way (NULL or table.half 0: none). */
static inline void gpu_attention_ring_store_dqkv(floatX* dqkv, const float* dq_acc, const float* dkv_acc, size_t rows, int NH, int NKV, int HD,
                                                 cudaStream_t s, const RopeRows* rope = nullptr) {
    if (attention_rope_turns(rope, HD)) {
        attention_ring_store_dqkv_rope_kernel<<<attention_elementwise_blocks(rows * rope->table.half), 256, 0, s>>>(dqkv, dq_acc, dkv_acc, rows,
                                                                                                                    NH, NKV, *rope);
        CUDA_CHECK_LAUNCH();
        return;
    }
    const size_t q_w = (size_t)NH * HD, kv2_w = 2 * (size_t)NKV * HD;
    attention_ring_store_dqkv_kernel<<<attention_elementwise_blocks(rows * (q_w + kv2_w)), 256, 0, s>>>(dqkv, dq_acc, dkv_acc, rows, q_w, kv2_w);
    CUDA_CHECK_LAUNCH();
}

#endif
