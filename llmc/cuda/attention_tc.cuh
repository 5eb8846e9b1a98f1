/*
 * Causal self-attention on tensor cores (BF16 and FP16 builds): the same
 * algorithm, shapes and outputs as the CUDA-core kernels in attention.cuh
 * (read its header first), with every product of two tiles done by WMMA
 * 16x16x16 matrix multiply-accumulate (16-bit inputs, fp32 accumulation).
 * FP32 builds keep the CUDA-core kernels (WMMA has no fp32 inputs, and the
 * FP32 build is the tight check against the CPU reference).
 *
 * Work split: a block of ATT_TC_WARPS warps owns ATT_TC_ROWS rows, warp w
 * 16 of them: in the forward and dq kernels packed query rows of one (b,
 * K/V head) (attention.cuh's att_pack: each warp 16 consecutive rows of one
 * of the group's query heads, so each K/V tile staged serves the group; for
 * GPT-2 the block's 64 rows of one head, as before), in the dk/dv kernel
 * keys of one (b, K/V head), streaming the queries of each of the head's
 * group in turn (attention.cuh's header, grouped-query attention). The other side streams through shared memory
 * ATT_TC_TILE rows at a time as floatX, zero past T and past hs (HS is hs
 * rounded up to a multiple of 16; padded channels are zero and add nothing).
 * Per tile, a warp:
 *   1. computes its 16 x TILE score tile (and dP tile in backward) with
 *      WMMA into shared memory (fp32);
 *   2. applies the mask, softmax and dS formula lane by lane in fp32
 *      (lane pair 2r, 2r+1 owns row r, half the columns each), writing the
 *      probabilities or dS as floatX for the next product;
 *   3. accumulates its 16 x HS output (O, dQ, or dK and dV) in WMMA
 *      accumulator fragments held in registers for the whole kernel.
 * The forward rescales O by each row's online-softmax correction. WMMA does
 * not document which row each accumulator element belongs to, so each warp
 * learns it once: it loads an accumulator fragment from a 16x16 matrix whose
 * entries are their own row numbers (row_of below); element i of every
 * accumulator fragment of that type then lies in row row_of[i].
 *
 * Rounding: the probabilities and dS enter the second product as floatX
 * (like the activations of every other matmul); scores, softmax statistics,
 * D and all accumulations are fp32. So results differ from the CUDA-core
 * kernels by floatX rounding, within test_gpt's BF16/FP16 tolerances.
 *
 * Dropout (attention.cuh's header has the formulas): in the lane-wise step
 * each lane owns 16 consecutive columns of one row of the tile, which is one
 * row (forward, dq: a query's 16 keys) or one column (dk/dv: a key's 16
 * queries) of a 16x16 block of dropout.h's layout, so it draws its keep bits
 * with att_drop_keep_row16 / att_drop_keep_col16, once per element and per
 * tile. The dropped, scaled probabilities enter the P V and P^T dO products;
 * the softmax sums and D take the undropped ones.
 *
 * Determinism: one warp owns each output tile and accumulates tiles in a
 * fixed order (keys ascending for O and dQ, queries ascending for dK, dV);
 * no atomics; launch shapes depend only on the problem.
 *
 * Shared memory (static, below 48 KiB for every HS, checked at compile time;
 * the dk/dv kernel's is dynamic, 81,152 bytes at hs128, as it keeps K and V staged)
 * is one byte array carved per phase: the rows a block owns are staged once
 * at the start in the space the tiles use later. Row strides are padded by
 * 16 bytes against bank conflicts while every fragment's first element stays
 * 32-byte aligned, as WMMA requires.
 *
 * Status: see the status table in README.md (the SASS for sm_80 and sm_90
 * has HMMA.16816.F32.BF16 and no register spills; the CPU emulator's WMMA
 * stand-in scrambles the fragment layout, so a layout assumption fails there).
 */
#ifndef REMAT_ATTENTION_TC_CUH
#define REMAT_ATTENTION_TC_CUH

#include <mma.h>
#include "cuda_common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "tensor-core attention (16-bit WMMA) needs sm_80 or newer: build with ATTENTION=simt for an older GPU"
#endif

#define ATT_TC_WARPS 4
#define ATT_TC_ROWS (16 * ATT_TC_WARPS) /* rows owned by a block */
#define ATT_TC_TILE 32                  /* rows of the other side per shared-memory tile */
#define ATT_TC_THREADS (32 * ATT_TC_WARPS)

namespace wmma = nvcuda::wmma;

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, floatX, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, floatX, wmma::row_major> FragBRow;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, floatX, wmma::col_major> FragBCol;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragAcc;

static constexpr size_t att_tc_max(size_t a, size_t b) { return a > b ? a : b; }
/* Rounded up to 128 bytes, so every carved region starts 32-byte aligned. */
static constexpr size_t att_tc_align(size_t n) { return (n + 127) / 128 * 128; }

template <int HS> struct AttTc {
    static_assert(HS % 16 == 0, "head size bucket must be a multiple of 16");
    static constexpr int NF = HS / 16;             /* 16-channel fragments per row block */
    static constexpr int LD = HS + 8;              /* floatX row stride of staged rows */
    static constexpr int SLD = ATT_TC_TILE + 4;    /* fp32 stride of a warp's score tile */
    static constexpr int PLD = ATT_TC_TILE + 8;    /* floatX stride of a warp's P / dS tile */
    static constexpr int HALF = ATT_TC_TILE / 2;   /* columns per lane in the lane-wise step */
    static constexpr size_t ROWS_BYTES = (size_t)ATT_TC_ROWS * LD * sizeof(floatX);
    static constexpr size_t ROWS_SPAN = att_tc_align(ROWS_BYTES); /* offset of the second staged row block */
    static constexpr size_t TILE_BYTES = (size_t)ATT_TC_TILE * LD * sizeof(floatX);
    static constexpr size_t S_BYTES = (size_t)ATT_TC_WARPS * 16 * SLD * sizeof(float);
    static constexpr size_t P_BYTES = (size_t)ATT_TC_WARPS * 16 * PLD * sizeof(floatX);
};

/* Stages rows [r0, r0+nrows) of a (B,T,ld)-strided head slice into dst (stride
 * LD) as floatX, zero past T and past hs. src points at (b, t=0, this head's
 * first channel). Called by all threads of the block. When hs is a multiple
 * of 8, every 8-channel chunk starts 16 bytes aligned in global memory (ld and
 * the head offset h*hs are multiples of 8, buffers are 256-byte aligned) and
 * in dst (LD is), and lies wholly inside or outside hs: one 16-byte load per
 * chunk instead of eight 2-byte ones. */
template <int HS>
__device__ __forceinline__ void att_tc_stage(floatX* dst, const floatX* src, size_t ld, int r0, int nrows, int T, int hs) {
    constexpr int LD = AttTc<HS>::LD;
    if (hs % 8 == 0) {
        constexpr int CHUNKS = HS / 8;
        for (int idx = threadIdx.x; idx < nrows * CHUNKS; idx += blockDim.x) {
            int j = idx / CHUNKS, c = (idx % CHUNKS) * 8, r = r0 + j;
            uint4 v = {0u, 0u, 0u, 0u}; /* all-zero bits: +0.0 in bf16 and fp16 */
            if (r < T && c < hs) v = *reinterpret_cast<const uint4*>(src + (size_t)r * ld + c);
            *reinterpret_cast<uint4*>(dst + j * LD + c) = v;
        }
        return;
    }
    const floatX zero = from_f32<floatX>(0.0f);
    for (int idx = threadIdx.x; idx < nrows * HS; idx += blockDim.x) {
        int j = idx / HS, c = idx % HS, r = r0 + j;
        dst[j * LD + c] = (r < T && c < hs) ? src[(size_t)r * ld + c] : zero;
    }
}

/* att_tc_stage of one warp's own 16 rows r0.. (packed grouped-query rows:
 * each warp's rows are of its own query head), by the warp's 32 lanes. Its
 * own loop rather than a lane/step parameter of att_tc_stage: that change
 * alone spilled the dk/dv kernel at hs128 with dropout (BF16: 4 bytes). */
template <int HS>
__device__ __forceinline__ void att_tc_stage_warp(floatX* dst, const floatX* src, size_t ld, int r0, int T, int hs) {
    constexpr int LD = AttTc<HS>::LD, CHUNKS = HS / 8;
    const int lane = threadIdx.x & 31;
    if (hs % 8 == 0) {
        for (int idx = lane; idx < 16 * CHUNKS; idx += 32) {
            int j = idx / CHUNKS, c = (idx % CHUNKS) * 8, r = r0 + j;
            uint4 v = {0u, 0u, 0u, 0u};
            if (r < T && c < hs) v = *reinterpret_cast<const uint4*>(src + (size_t)r * ld + c);
            *reinterpret_cast<uint4*>(dst + j * LD + c) = v;
        }
        return;
    }
    const floatX zero = from_f32<floatX>(0.0f);
    for (int idx = lane; idx < 16 * HS; idx += 32) {
        int j = idx / HS, c = idx % HS, r = r0 + j;
        dst[j * LD + c] = (r < T && c < hs) ? src[(size_t)r * ld + c] : zero;
    }
}

/* Row of each element of this thread's accumulator fragments (see header).
 * scratch: 16 x ldm fp32 of this warp's shared memory, free on entry and exit. */
__device__ __forceinline__ void att_tc_row_of(int* row_of, float* scratch, int ldm) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < 256; i += 32) scratch[(i / 16) * ldm + i % 16] = (float)(i / 16);
    __syncwarp();
    FragAcc rows;
    wmma::load_matrix_sync(rows, scratch, ldm, wmma::mem_row_major);
#pragma unroll
    for (int i = 0; i < FragAcc::num_elements; i++) row_of[i] = (int)rows.x[i];
    __syncwarp();
}

/* acc[f] row r *= row_mul[r] for every fragment f (row_of: att_tc_row_of). */
template <int HS> __device__ __forceinline__ void att_tc_scale_rows(FragAcc* acc, const float* row_mul, const int* row_of) {
    float mul[FragAcc::num_elements];
#pragma unroll
    for (int i = 0; i < FragAcc::num_elements; i++) mul[i] = row_mul[row_of[i]];
#pragma unroll
    for (int f = 0; f < AttTc<HS>::NF; f++)
#pragma unroll
        for (int i = 0; i < FragAcc::num_elements; i++) acc[f].x[i] *= mul[i];
}

/* acc[f] (16 x HS, fp32) -> rows r0..r0+15 of a (B,T,ld)-strided floatX slice
 * (rows >= T and channels >= hs are not written). scratch: 16 x ldm fp32 of
 * this warp's shared memory. */
template <int HS>
__device__ __forceinline__ void att_tc_store_rows(floatX* dst, size_t ld, int r0, int T, int hs, FragAcc* acc,
                                                  float* scratch, int ldm) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int f = 0; f < AttTc<HS>::NF; f++) {
        wmma::store_matrix_sync(scratch, acc[f], ldm, wmma::mem_row_major);
        __syncwarp();
        for (int i = lane; i < 256; i += 32) {
            int r = i / 16, c = f * 16 + i % 16;
            if (r0 + r < T && c < hs) dst[(size_t)(r0 + r) * ld + c] = from_f32<floatX>(scratch[r * ldm + i % 16]);
        }
        __syncwarp();
    }
}

/* S (16 x TILE, fp32, stride SLD) = A (16 x HS, fragments a[]) times the
 * transpose of tile rows (TILE x HS floatX, stride LD). */
template <int HS>
__device__ __forceinline__ void att_tc_scores(float* S, const FragA* a, const floatX* tile) {
    constexpr int LD = AttTc<HS>::LD;
#pragma unroll
    for (int n = 0; n < ATT_TC_TILE / 16; n++) {
        FragAcc s;
        wmma::fill_fragment(s, 0.0f);
#pragma unroll
        for (int k = 0; k < AttTc<HS>::NF; k++) {
            FragBCol b; /* (k-slice of channels) x (16 tile rows): tile rows read as columns */
            wmma::load_matrix_sync(b, tile + n * 16 * LD + k * 16, LD);
            wmma::mma_sync(s, a[k], b, s);
        }
        wmma::store_matrix_sync(S + n * 16, s, AttTc<HS>::SLD, wmma::mem_row_major);
    }
}

/* acc[f] += P (16 x TILE floatX, stride PLD) times tile (TILE x HS floatX, stride LD). */
template <int HS>
__device__ __forceinline__ void att_tc_accumulate(FragAcc* acc, const floatX* P, const floatX* tile) {
    constexpr int LD = AttTc<HS>::LD;
#pragma unroll
    for (int k = 0; k < ATT_TC_TILE / 16; k++) {
        FragA p;
        wmma::load_matrix_sync(p, P + k * 16, AttTc<HS>::PLD);
#pragma unroll
        for (int f = 0; f < AttTc<HS>::NF; f++) {
            FragBRow b;
            wmma::load_matrix_sync(b, tile + k * 16 * LD + f * 16, LD);
            wmma::mma_sync(acc[f], p, b, acc[f]);
        }
    }
}

/* Where a thread works: warp `warp` owns rows r0..r0+15 of the block's
 * ATT_TC_ROWS rows (first: row0) of batch b, head h; in the lane-wise steps
 * lanes 2i and 2i+1 share row r0+i (row = i), half the columns each. Blocks
 * run last-first when the last rows are the longest (causal mask). */
struct AttTcThread {
    int warp, row, half, b, h, row0, r0;
};

__device__ __forceinline__ AttTcThread att_tc_thread(int NH, bool last_first) {
    AttTcThread p;
    p.warp = threadIdx.x >> 5;
    p.row = (threadIdx.x & 31) >> 1;
    p.half = threadIdx.x & 1;
    p.b = blockIdx.y / NH;
    p.h = blockIdx.y % NH;
    p.row0 = (int)(last_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * ATT_TC_ROWS;
    p.r0 = p.row0 + 16 * p.warp;
    return p;
}

/* Loads a warp's 16 staged rows (stride LD) as NF row-major A fragments. */
template <int HS> __device__ __forceinline__ void att_tc_load_a(FragA* a, const floatX* rows) {
#pragma unroll
    for (int k = 0; k < AttTc<HS>::NF; k++) wmma::load_matrix_sync(a[k], rows + k * 16, AttTc<HS>::LD);
}

/* Packed grouped-query rows (attention.cuh's att_pack) in the forward and dq
 * kernels: warp w's 16 rows r0.. of query head h of batch row b; K, V: the
 * block's K/V head (blockIdx.y = b NKV + kvh). The warp's b NH + h
 * (warp_bh[w]: dropout's head index, the statistics' and outputs' rows) and
 * the K/V head's first K row (kv_rows) are kept in shared memory and read
 * where used: in registers across the tile loop, beside the packed rows'
 * own offsets, they spilled (BF16: forward hs32 12 bytes, dq hs64 16). They
 * are visible after the kernel's first barrier. */
__device__ __forceinline__ void att_tc_pack_shared(int* warp_bh, const floatX** kv_rows, const floatX* qkv, int T, const AttHeads& hd,
                                                   const AttPack& pk, int warp) {
    if ((threadIdx.x & 31) == 0) warp_bh[warp] = pk.b * hd.NH + pk.h;
    if (threadIdx.x == 0) *kv_rows = qkv + (size_t)pk.b * T * hd.q_ld + hd.k_off + (size_t)pk.kvh * hd.HD;
}

/* Offset of (b, t = 0, head h) in a (B,T,ld) tensor of NH heads of hs, bh = b NH + h. */
__device__ __forceinline__ size_t att_tc_head_rows(int bh, int T, int NH, int hs, size_t ld) {
    return (size_t)(bh / NH) * T * ld + (size_t)(bh % NH) * hs;
}

/* The forward's and dq kernel's grid: att_pack's, units of a warp's 16 rows, ATT_TC_WARPS a block. */
static inline dim3 att_tc_grid(int B, int nq, int NH, int NKV) { return att_pack_grid(B, nq, NH, NKV, 16, ATT_TC_WARPS); }

/* ---- forward ----
 * grid att_tc_grid: (ceil(G ceil(T/16) / ATT_TC_WARPS), B*NKV) for G =
 * NH/NKV (GPT-2: (ceil(T/ROWS), B*NH)), block ATT_TC_THREADS; warp w owns
 * 16 packed query rows (att_tc_pack_shared). Query blocks are visited
 * last-first (the causal mask makes them the longest). Dropout: Pw holds
 * p * mask / keep for the P V product; sum (and so l, lse) adds every p. */
template <int HS> struct AttTcForwardSmem {
    static constexpr size_t KV = 0;                                   /* K tile, V tile */
    static constexpr size_t S = KV + att_tc_align(2 * AttTc<HS>::TILE_BYTES);
    static constexpr size_t P = S + att_tc_align(AttTc<HS>::S_BYTES);
    static constexpr size_t CORR = P + att_tc_align(AttTc<HS>::P_BYTES); /* per warp 16 fp32 */
    static constexpr size_t LOOP_END = CORR + ATT_TC_WARPS * 16 * sizeof(float);
    static constexpr size_t BYTES = att_tc_max(LOOP_END, AttTc<HS>::ROWS_BYTES); /* Q staged at KV.. at the start */
    static_assert(BYTES <= 48 * 1024, "static shared memory above 48 KiB");
};

/* Packed documents (doc_start: this row's (T) starts, NULL: none; llmc/core/documents.h):
 * the first key query t sees. The starts never decrease along a row. */
__device__ __forceinline__ int att_tc_first_key(const int* doc_start, int t, int T) {
    return doc_start ? doc_start[min(max(t, 0), T - 1)] : 0;
}

/* One past the last query of [t_begin, T) whose document starts at or before
 * key s_last (a binary search; T without documents). */
__device__ __forceinline__ int att_tc_queries_end(const int* doc_start, int t_begin, int s_last, int T) {
    if (!doc_start) return T;
    int lo = max(t_begin, 0), hi = T;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (doc_start[mid] <= s_last) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

template <int HS, bool DROPOUT>
__global__ void __launch_bounds__(ATT_TC_THREADS)
attention_tc_forward_kernel(floatX* out, float* lse, const floatX* qkv, int T, const AttHeads hd, float scale,
                            DropoutSite drop, const int* doc_start) {
    typedef AttTc<HS> Cfg;
    static_assert(AttTc<HS>::HALF == 16, "a lane's columns are one att_drop_keep_row16");
    typedef AttTcForwardSmem<HS> L;
    __shared__ __align__(128) unsigned char smem[L::BYTES];
    const int warp = threadIdx.x >> 5, row = (threadIdx.x & 31) >> 1, half = threadIdx.x & 1, hs = hd.HD;
    const AttPack pk = att_pack(hd, 16, ATT_TC_WARPS, warp, true);
    const int r0 = pk.r0, t = r0 + row;
    const size_t ld = hd.q_ld;
    __shared__ int warp_bh[ATT_TC_WARPS];
    __shared__ const floatX* kv_rows;
    att_tc_pack_shared(warp_bh, &kv_rows, qkv, T, hd, pk, warp);
    floatX* Ks = (floatX*)(smem + L::KV);
    floatX* Vs = Ks + ATT_TC_TILE * Cfg::LD;
    float* Sw = (float*)(smem + L::S) + warp * 16 * Cfg::SLD;
    floatX* Pw = (floatX*)(smem + L::P) + warp * 16 * Cfg::PLD;
    float* corr_w = (float*)(smem + L::CORR) + warp * 16;

    FragA q[Cfg::NF];
    FragAcc o[Cfg::NF];
    int row_of[FragAcc::num_elements];
    att_tc_stage_warp<HS>((floatX*)smem + 16 * warp * Cfg::LD, qkv + (size_t)pk.b * T * ld + (size_t)pk.h * hs, ld, r0, T, hs);
    __syncthreads();
    att_tc_load_a<HS>(q, (floatX*)smem + 16 * warp * Cfg::LD);
    att_tc_row_of(row_of, Sw, Cfg::SLD);
#pragma unroll
    for (int f = 0; f < Cfg::NF; f++) wmma::fill_fragment(o[f], 0.0f);
    float m = -INFINITY, l = 0.0f; /* row t's running max (scaled scores) and sum; same in both lanes */
    const float keep_scale = DROPOUT ? drop.scale : 1.0f;
    const int kend = min(pk.last + 1, T);
    /* documents: key tiles before the block's first row's start are skipped, before the warp's first row's too */
    const int* row_starts = doc_start ? doc_start + (size_t)pk.b * T : nullptr;
    const int kfirst = att_tc_first_key(row_starts, t, T), kwarp = att_tc_first_key(row_starts, r0, T);
    for (int k0 = att_tc_first_key(row_starts, pk.first, T) / ATT_TC_TILE * ATT_TC_TILE; k0 < kend; k0 += ATT_TC_TILE) {
        __syncthreads(); /* the previous tile (or the staged Q) is no longer read */
        att_tc_stage<HS>(Ks, kv_rows, ld, k0, ATT_TC_TILE, T, hs);
        att_tc_stage<HS>(Vs, kv_rows + hd.kv_w, ld, k0, ATT_TC_TILE, T, hs);
        __syncthreads();
        if (k0 > r0 + 15) continue; /* every key of this tile is after every query of this warp */
        if (k0 + ATT_TC_TILE <= kwarp) continue; /* every key of it is before every query's document */
        att_tc_scores<HS>(Sw, q, Ks);
        __syncwarp();
        float s[Cfg::HALF];
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < Cfg::HALF; j++) {
            const int c = half * Cfg::HALF + j, key = k0 + c;
            s[j] = (key <= t && key < T && key >= kfirst) ? Sw[row * Cfg::SLD + c] * scale : -INFINITY;
            mx = fmaxf(mx, s[j]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float mnew = fmaxf(m, mx);
        const float ref = mnew == -INFINITY ? 0.0f : mnew; /* all masked so far: keep exp() away from inf - inf */
        const float corr = expf(m - ref);
        const unsigned keep = DROPOUT ? att_drop_keep_row16(drop, warp_bh[warp], T, t, k0 + half * Cfg::HALF) : ~0u;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < Cfg::HALF; j++) {
            const float p = expf(s[j] - ref);
            sum += p;
            Pw[row * Cfg::PLD + half * Cfg::HALF + j] = from_f32<floatX>(p * att_drop_factor(keep, j, keep_scale));
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * corr + sum;
        m = mnew;
        if (half == 0) corr_w[row] = corr;
        __syncwarp();
        att_tc_scale_rows<HS>(o, corr_w, row_of);
        att_tc_accumulate<HS>(o, Pw, Vs);
        __syncwarp(); /* corr_w and Pw are rewritten at the next tile */
    }
    const int bh = warp_bh[warp];
    if (half == 0) {
        corr_w[row] = 1.0f / l;
        if (t < T) lse[(size_t)bh * T + t] = m + logf(l);
    }
    __syncwarp();
    att_tc_scale_rows<HS>(o, corr_w, row_of);
    att_tc_store_rows<HS>(out + att_tc_head_rows(bh, T, hd.NH, hs, hd.out_ld), hd.out_ld, r0, T, hs, o, Sw, Cfg::SLD);
}

/* ---- backward, pass 1: dq and D ----
 * grid att_tc_grid, as the forward's; warp w owns 16 packed query rows.
 * Dropout: the lane's keep bits are drawn again per key tile; dS masks and
 * scales dP only, D = dout.out is already the dropped row sum. */
template <int HS> struct AttTcDqSmem {
    static constexpr size_t KV = 0;                                   /* K tile, V tile */
    static constexpr size_t S = KV + att_tc_align(2 * AttTc<HS>::TILE_BYTES);
    static constexpr size_t DP = S + att_tc_align(AttTc<HS>::S_BYTES);
    static constexpr size_t DS = DP + att_tc_align(AttTc<HS>::S_BYTES);
    static constexpr size_t LOOP_END = DS + AttTc<HS>::P_BYTES;
    static constexpr size_t STAGE_END = 2 * AttTc<HS>::ROWS_SPAN; /* Q, dO staged at the start */
    static constexpr size_t BYTES = att_tc_max(LOOP_END, STAGE_END);
    static_assert(BYTES <= 48 * 1024, "static shared memory above 48 KiB");
};

template <int HS, bool DROPOUT>
__global__ void __launch_bounds__(ATT_TC_THREADS)
attention_tc_backward_dq_kernel(floatX* dqkv, float* rowsum, const floatX* dout, const floatX* qkv, const floatX* out,
                                const float* lse, int T, const AttHeads hd, float scale, DropoutSite drop, const int* doc_start) {
    typedef AttTc<HS> Cfg;
    typedef AttTcDqSmem<HS> L;
    __shared__ __align__(128) unsigned char smem[L::BYTES];
    /* packed grouped-query rows, as in the forward */
    const int warp = threadIdx.x >> 5, row = (threadIdx.x & 31) >> 1, half = threadIdx.x & 1, hs = hd.HD;
    const AttPack pk = att_pack(hd, 16, ATT_TC_WARPS, warp, true);
    const int r0 = pk.r0, t = r0 + row;
    const size_t ld = hd.q_ld;
    const int C = hd.out_ld;
    __shared__ int warp_bh[ATT_TC_WARPS];
    __shared__ const floatX* kv_rows;
    att_tc_pack_shared(warp_bh, &kv_rows, qkv, T, hd, pk, warp);
    const size_t head_rows = att_tc_head_rows(pk.b * hd.NH + pk.h, T, hd.NH, hs, C); /* out's, dout's */
    floatX* Qs = (floatX*)smem;
    floatX* dOs = (floatX*)(smem + Cfg::ROWS_SPAN);
    floatX* Ks = (floatX*)(smem + L::KV);
    floatX* Vs = Ks + ATT_TC_TILE * Cfg::LD;
    float* Sw = (float*)(smem + L::S) + warp * 16 * Cfg::SLD;
    float* dPw = (float*)(smem + L::DP) + warp * 16 * Cfg::SLD;
    floatX* dSw = (floatX*)(smem + L::DS) + warp * 16 * Cfg::PLD;

    att_tc_stage_warp<HS>(Qs + 16 * warp * Cfg::LD, qkv + (size_t)pk.b * T * ld + (size_t)pk.h * hs, ld, r0, T, hs);
    att_tc_stage_warp<HS>(dOs + 16 * warp * Cfg::LD, dout + head_rows, C, r0, T, hs);
    __syncthreads();
    FragA q[Cfg::NF], dO[Cfg::NF];
    att_tc_load_a<HS>(q, Qs + 16 * warp * Cfg::LD);
    att_tc_load_a<HS>(dO, dOs + 16 * warp * Cfg::LD);
    /* D_t = dout_t . out_t in fp32, each lane half the channels, from the staged dout */
    float D = 0.0f;
    if (t < T) {
        const floatX* drow = dOs + (16 * warp + row) * Cfg::LD;
        const floatX* orow = out + head_rows + (size_t)t * C;
        for (int c = half * (HS / 2); c < (half + 1) * (HS / 2) && c < hs; c++) D += to_f32(drow[c]) * to_f32(orow[c]);
    }
    D += __shfl_xor_sync(0xffffffffu, D, 1);
    const size_t stat = ((size_t)pk.b * hd.NH + pk.h) * T + t;
    if (t < T && half == 0) rowsum[stat] = D;
    const float row_lse = t < T ? lse[stat] : 0.0f;
    FragAcc dq[Cfg::NF];
#pragma unroll
    for (int f = 0; f < Cfg::NF; f++) wmma::fill_fragment(dq[f], 0.0f);
    const float keep_scale = DROPOUT ? drop.scale : 1.0f;
    const int kend = min(pk.last + 1, T);
    const int* row_starts = doc_start ? doc_start + (size_t)pk.b * T : nullptr; /* as in the forward */
    const int kfirst = att_tc_first_key(row_starts, t, T), kwarp = att_tc_first_key(row_starts, r0, T);
    for (int k0 = att_tc_first_key(row_starts, pk.first, T) / ATT_TC_TILE * ATT_TC_TILE; k0 < kend; k0 += ATT_TC_TILE) {
        __syncthreads(); /* the previous tile (or the staged Q, dO) is no longer read */
        att_tc_stage<HS>(Ks, kv_rows, ld, k0, ATT_TC_TILE, T, hs);
        att_tc_stage<HS>(Vs, kv_rows + hd.kv_w, ld, k0, ATT_TC_TILE, T, hs);
        __syncthreads();
        if (k0 > r0 + 15 || k0 + ATT_TC_TILE <= kwarp) continue;
        att_tc_scores<HS>(Sw, q, Ks);
        att_tc_scores<HS>(dPw, dO, Vs);
        const unsigned keep = DROPOUT ? att_drop_keep_row16(drop, warp_bh[warp], T, t, k0 + half * Cfg::HALF) : ~0u;
        __syncwarp();
#pragma unroll
        for (int j = 0; j < Cfg::HALF; j++) {
            const int c = half * Cfg::HALF + j, key = k0 + c;
            const float p = (key <= t && key < T && key >= kfirst) ? expf(Sw[row * Cfg::SLD + c] * scale - row_lse) : 0.0f;
            const float dp = att_drop_factor(keep, j, keep_scale) * dPw[row * Cfg::SLD + c];
            dSw[row * Cfg::PLD + c] = from_f32<floatX>(p * (dp - D) * scale);
        }
        __syncwarp();
        att_tc_accumulate<HS>(dq, dSw, Ks);
        __syncwarp(); /* dSw is rewritten at the next tile */
    }
    att_tc_store_rows<HS>(dqkv + att_tc_head_rows(warp_bh[warp], T, hd.NH, hs, ld), ld, r0, T, hs, dq, Sw, Cfg::SLD);
}

/* ---- backward, pass 2: dk and dv ----
 * grid (ceil(T/ROWS), B*NKV), block ATT_TC_THREADS; warp w owns 16 key rows
 * of one K/V head; for each query head of its group in turn, queries t >=
 * the block's first key stream through shared memory. Key blocks
 * are visited first-first (the longest). Dropout: the lane's keep bits (its
 * key's 16 queries) are drawn again per query tile; Pw holds the dropped,
 * scaled P for dV, dS masks and scales dP only (D unchanged). */
template <int HS> struct AttTcDkvSmem {
    static constexpr size_t QD = 0;                                   /* Q tile, dO tile */
    static constexpr size_t S = QD + att_tc_align(2 * AttTc<HS>::TILE_BYTES);
    static constexpr size_t DP = S + att_tc_align(AttTc<HS>::S_BYTES);
    static constexpr size_t P = DP + att_tc_align(AttTc<HS>::S_BYTES);
    static constexpr size_t DS = P + att_tc_align(AttTc<HS>::P_BYTES);
    static constexpr size_t STATS = DS + att_tc_align(AttTc<HS>::P_BYTES); /* lse, D of the tile's rows */
    static constexpr size_t LOOP_END = STATS + 2 * ATT_TC_TILE * sizeof(float);
    /* K and V stay staged for the whole kernel, their fragments loaded per
     * tile: held in registers, k, v, dk and dv took 192 of 255 registers at
     * hs128, and the lane-wise step on top spilled (FP16 with dropout: 136 bytes) */
    static constexpr size_t K = att_tc_align(LOOP_END);
    static constexpr size_t V = K + AttTc<HS>::ROWS_SPAN;
    static constexpr size_t BYTES = V + AttTc<HS>::ROWS_BYTES; /* dynamic: 81,152 at hs128 */
    static_assert(BYTES <= 227 * 1024, "above an sm_90 block's shared memory");
};

/* att_drop_keep_col16's bits with its eight Philox calls in a loop, not
 * unrolled: the dK/dV kernel at hs128, whose dk and dv accumulators take
 * half the registers, spilled with the unrolled draws beside a group's loop. */
__device__ __forceinline__ unsigned att_tc_keep_col16_rolled(const DropoutSite& drop, int bh, int T, int t0, int u) {
    const bool right = (u >> 3) & 1;
    const int shift = 16 * (u & 1);
    unsigned bits = 0;
#pragma unroll 1
    for (int r = 0; r < 8; r++) {
        uint32_t w[4];
        dropout_draws(&drop, dropout_attention_group(bh, T, t0 + r, u), w);
        bits |= (unsigned)((((right ? w[1] : w[0]) >> shift) & 0xffffu) >= drop.threshold) << r;
        bits |= (unsigned)((((right ? w[3] : w[2]) >> shift) & 0xffffu) >= drop.threshold) << (r + 8);
    }
    return bits;
}

template <int HS, bool DROPOUT>
__global__ void __launch_bounds__(ATT_TC_THREADS)
attention_tc_backward_dkv_kernel(floatX* dqkv, const float* rowsum, const floatX* dout, const floatX* qkv, const float* lse,
                                 int T, const AttHeads hd, float scale, DropoutSite drop, const int* doc_start) {
    typedef AttTc<HS> Cfg;
    typedef AttTcDkvSmem<HS> L;
    extern __shared__ __align__(128) unsigned char smem[]; /* L::BYTES */
    const AttTcThread at = att_tc_thread(hd.NKV, false); /* at.h: the K/V head */
    const int warp = at.warp, row = at.row, half = at.half, b = at.b, kvh = at.h, hs = hd.HD;
    const int s0 = at.row0, r0 = at.r0, s = r0 + row;
    const size_t ld = hd.q_ld;
    const floatX* row0 = qkv + (size_t)b * T * ld;
    floatX* Qs = (floatX*)(smem + L::QD);
    floatX* dOs = Qs + ATT_TC_TILE * Cfg::LD;
    float* Sw = (float*)(smem + L::S) + warp * 16 * Cfg::SLD;
    float* dPw = (float*)(smem + L::DP) + warp * 16 * Cfg::SLD;
    floatX* Pw = (floatX*)(smem + L::P) + warp * 16 * Cfg::PLD;
    floatX* dSw = (floatX*)(smem + L::DS) + warp * 16 * Cfg::PLD;
    float* lse_s = (float*)(smem + L::STATS);
    float* d_s = lse_s + ATT_TC_TILE;

    /* this warp's 16 K and V rows (Kw, Vw), staged for the whole kernel (every head of the group) */
    att_tc_stage<HS>((floatX*)(smem + L::K), row0 + hd.k_off + (size_t)kvh * hs, ld, s0, ATT_TC_ROWS, T, hs);
    att_tc_stage<HS>((floatX*)(smem + L::V), row0 + hd.v_off + (size_t)kvh * hs, ld, s0, ATT_TC_ROWS, T, hs);
    FragAcc dk[Cfg::NF], dv[Cfg::NF];
#pragma unroll
    for (int f = 0; f < Cfg::NF; f++) {
        wmma::fill_fragment(dk[f], 0.0f);
        wmma::fill_fragment(dv[f], 0.0f);
    }
    const float keep_scale = DROPOUT ? drop.scale : 1.0f;
    /* documents: no query past the last one whose document starts at or before the block's (the warp's) last key */
    const int* row_starts = doc_start ? doc_start + (size_t)b * T : nullptr;
    const int t_end = att_tc_queries_end(row_starts, s0, min(s0 + ATT_TC_ROWS, T) - 1, T);
    const int t_end_warp = att_tc_queries_end(row_starts, r0, min(r0 + 16, T) - 1, T);
    /* each staged query's first key (documents; 0 without), and this row's starts for staging them: in shared
     * memory, so that no pointer to the starts stays in a register across the loop (at hs128 one too many) */
    __shared__ int kf_s[ATT_TC_TILE];
    __shared__ const int* starts_rows;
    __shared__ int query_end; /* t_end, likewise */
    __shared__ floatX* dkv_rows; /* where dK and dV go, likewise, read after the loop */
    if (threadIdx.x == 0) {
        starts_rows = row_starts;
        query_end = t_end;
        dkv_rows = dqkv + (size_t)b * T * ld + (size_t)kvh * hs;
    }
    __syncthreads(); /* they are visible (the loop's bound is read before its first barrier; the loop may not run) */
    /* the group's query heads in order (dk, dv sum over all of them). The
     * current head's Q rows, dout rows and statistics are read from shared
     * memory when a tile is staged: held in registers across the tile loop,
     * next to dk and dv, they spilled at hs128. Thread 0 sets them before a
     * head's first tile, after every thread has staged the previous head's
     * last one (its second barrier). */
    __shared__ const floatX* head_q;
    __shared__ const floatX* head_dout;
    __shared__ const float* head_lse;
    __shared__ const float* head_rowsum;
    int bh = b * hd.NH + kvh * hd.group; /* a multiple of group: the heads run until the next one */
    do {
        if (threadIdx.x == 0) { /* from bh and the arguments alone: nothing else stays live across the loop */
            const size_t hb = (size_t)(bh / hd.NH) * T, hh = (size_t)(bh % hd.NH) * hs;
            head_q = qkv + hb * hd.q_ld + hh;
            head_dout = dout + hb * hd.out_ld + hh;
            head_lse = lse + (size_t)bh * T;
            head_rowsum = rowsum + (size_t)bh * T;
        }
        for (int t0 = s0; t0 < query_end; t0 += ATT_TC_TILE) {
            __syncthreads(); /* the previous tile is no longer read (the staged K, V and the head's pointers are visible after it) */
            att_tc_stage<HS>(Qs, head_q, ld, t0, ATT_TC_TILE, T, hs);
            att_tc_stage<HS>(dOs, head_dout, hd.out_ld, t0, ATT_TC_TILE, T, hs);
            for (int jj = threadIdx.x; jj < ATT_TC_TILE; jj += blockDim.x) {
                const int r = t0 + jj;
                lse_s[jj] = r < T ? head_lse[r] : 0.0f;
                d_s[jj] = r < T ? head_rowsum[r] : 0.0f;
                kf_s[jj] = att_tc_first_key(starts_rows, r, T);
            }
            __syncthreads();
            if (t0 + ATT_TC_TILE - 1 < r0 || t0 >= t_end_warp) continue; /* every query of this tile is before every key of this warp, or after their documents */
            /* the keep bits before the products: their Philox rounds then share the registers with fewer live values */
            const unsigned keep = !DROPOUT ? ~0u
                                  : HS == 128 ? att_tc_keep_col16_rolled(drop, bh, T, t0 + half * Cfg::HALF, s)
                                              : att_drop_keep_col16(drop, bh, T, t0 + half * Cfg::HALF, s);
            {
                FragA kv[Cfg::NF];
                att_tc_load_a<HS>(kv, (const floatX*)(smem + L::K) + 16 * warp * Cfg::LD); /* Kw */
                att_tc_scores<HS>(Sw, kv, Qs); /* S^T: key rows x query columns */
                att_tc_load_a<HS>(kv, (const floatX*)(smem + L::V) + 16 * warp * Cfg::LD); /* Vw */
                att_tc_scores<HS>(dPw, kv, dOs); /* dP^T */
            }
            __syncwarp();
#pragma unroll
            for (int jj = 0; jj < Cfg::HALF; jj++) {
                const int c = half * Cfg::HALF + jj, tq = t0 + c;
                const float p = (tq >= s && tq < T && kf_s[c] <= s) ? expf(Sw[row * Cfg::SLD + c] * scale - lse_s[c]) : 0.0f;
                const float f = att_drop_factor(keep, jj, keep_scale);
                Pw[row * Cfg::PLD + c] = from_f32<floatX>(p * f);
                dSw[row * Cfg::PLD + c] = from_f32<floatX>(p * (f * dPw[row * Cfg::SLD + c] - d_s[c]) * scale);
            }
            __syncwarp();
            att_tc_accumulate<HS>(dv, Pw, dOs);
            att_tc_accumulate<HS>(dk, dSw, Qs);
            __syncwarp(); /* Pw, dSw are rewritten at the next tile */
        }
    } while (++bh % hd.group);
    floatX* drows = dkv_rows;
    att_tc_store_rows<HS>(drows + hd.k_off, ld, r0, T, hs, dk, Sw, Cfg::SLD);
    att_tc_store_rows<HS>(drows + hd.v_off, ld, r0, T, hs, dv, Sw, Cfg::SLD);
}

#endif
