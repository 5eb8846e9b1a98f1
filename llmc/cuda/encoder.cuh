/*
 * Encoder: token + position embedding, forward and backward.
 *
 * Shapes: tokens (B,T) int; wte (Vp,C), wpe (maxT,C), x (B,T,C), all
 * row-major floatX; N = B*T. The B x T rows are laid out by a TokenLayout
 * (token_layout.h): local token t of a row is at global position
 * token_position(t), t itself for whole sequences, one of this rank's two
 * chunks under context parallelism; wpe rows are those positions.
 *
 * The backward pass scatters dx rows into wte rows, and a token can occur
 * many times in a batch. Instead of atomics, the host groups the positions by
 * token (a counting sort, stable in position order) and one block owns each
 * distinct token's wte row: it sums that token's dx rows in position order in
 * fp32 and adds the sum to the row once; a very frequent token is split into
 * fixed segments summed in a fixed order (below). wpe rows are owned by
 * local position t (each a distinct global position) and summed over b in
 * order. Deterministic, no atomics.
 *
 * Packed documents with --reset-position-ids (pos_start, llmc/core/documents.h):
 * a token's position is its global one less its document's start, so rows
 * share wpe rows. The forward reads that row; the backward groups the local
 * rows into runs of consecutive positions (a document, cut at a row's or a
 * context-parallel chunk's edge) on the host, and one thread per wpe
 * element sums the runs covering its position in run order, which is local
 * row order (the CPU's order).
 *
 * Access: 16-byte vectors of XVEC elements (8 bf16/fp16, 4 fp32) along C
 * where C is a multiple of XVEC and the pointers are 16-byte aligned, one
 * element otherwise; the wte sums keep WTE_LOADS_IN_FLIGHT rows in flight.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_ENCODER_CUH
#define REMAT_ENCODER_CUH

#include "cuda_common.cuh"
#include "../core/token_layout.h"

/* x[b,t,:] = wte[tokens[b,t],:] + wpe[token_position(t),:]. Thread i owns
 * elements [i*VEC, i*VEC + VEC) of x: VEC = XVEC (two 16-byte loads, one
 * store) where C is a multiple of it and the pointers are 16-byte aligned,
 * else 1. */
template <int VEC>
__global__ void encoder_forward_kernel(floatX* x, const int* tokens, const floatX* wte, const floatX* wpe, int N, int C, TokenLayout lay,
                                       const int* pos_start) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= (size_t)N * C) return;
    int bt = (int)(i / C), c = (int)(i % C);
    Vec<floatX, VEC> e = vload<VEC>(wte + (size_t)tokens[bt] * C + c);
    if (!wpe) { /* RoPE: positions enter in attention, x is the token's row */
        vstore<VEC>(x + i, e);
        return;
    }
    int t = token_position(&lay, (size_t)bt) - (pos_start ? pos_start[bt] : 0);
    Vec<floatX, VEC> p = vload<VEC>(wpe + (size_t)t * C + c), o;
#pragma unroll
    for (int k = 0; k < VEC; k++) o.v[k] = from_f32<floatX>(to_f32(e.v[k]) + to_f32(p.v[k]));
    vstore<VEC>(x + i, o);
}

/* pos_start (device (B,T)): the document starts positions restart at, or NULL.
 * wpe NULL (RoPE): no position table, x = wte[tokens]. */
static inline void gpu_encoder_forward(floatX* x, const int* tokens, const floatX* wte, const floatX* wpe, int B, int C,
                                       const TokenLayout* lay, cudaStream_t stream, const int* pos_start = nullptr) {
    int N = B * lay->T;
    size_t n = (size_t)N * C;
    if (C % XVEC == 0 && all_aligned16(x, wte, wpe))
        encoder_forward_kernel<XVEC><<<grid_for(n / XVEC, 256), 256, 0, stream>>>(x, tokens, wte, wpe, N, C, *lay, pos_start);
    else
        encoder_forward_kernel<1><<<grid_for(n, 256), 256, 0, stream>>>(x, tokens, wte, wpe, N, C, *lay, pos_start);
    CUDA_CHECK_LAUNCH();
}

/* Hot tokens. A token at half of a batch (padding, end of text) would make
 * its block sum N/2 rows alone while the rest of the grid idles. A token
 * with at least 2S positions is therefore split into floor(count/S) segments
 * of S consecutive positions (the last takes the rest); one block sums each
 * segment into an fp32 scratch row, then a second kernel adds the token's
 * segment rows in segment order into its wte row. S depends only on N (never
 * on the device), so the summation order and the bits are fixed for a batch.
 * S >= N / WTE_MAX_SEGMENTS bounds the segments of a batch by
 * WTE_MAX_SEGMENTS, whose scratch (WTE_MAX_SEGMENTS * C floats) is the
 * column-partials buffer (COLUMN_SPLITS * 4C floats), idle by then. */
#define WTE_MIN_SEGMENT 32
#define WTE_MAX_SEGMENTS (4 * COLUMN_SPLITS)

static inline int wte_segment_positions(int N) {
    int s = (N + WTE_MAX_SEGMENTS - 1) / WTE_MAX_SEGMENTS;
    return s > WTE_MIN_SEGMENT ? s : WTE_MIN_SEGMENT;
}

/* Work lists of the wte gradient, built on the host from the B*T input
 * tokens (a counting sort, stable in position order), in one int array of at
 * most 3N+1 entries (W + H <= N, see encoder_build_buckets):
 *   [0, W)                 per work item: the token (>= 0), whose whole wte row
 *                          the item owns, or -(slot+1) for segment `slot` of a
 *                          split token (its sum goes to scratch row slot)
 *   [W, 2W+1)              start of each item's positions in the list below, then N
 *   [2W+1, 2W+1+N)         positions bt grouped by token, ascending within a token
 *   [2W+1+N, 2W+1+N+H)     the H split tokens
 *   [2W+1+N+H, 2W+1+N+2H)  the first scratch slot of each (its segments are the
 *                          slots up to the next one's first, or `segments`) */
typedef struct {
    int items, splits, segments; /* W, H, scratch rows used */
    size_t ints;                  /* entries used, 2W + 1 + N + 2H (past 2^31 for N past 2^31 / 3: offsets are 64-bit) */
} TokenBuckets;

/* `count` is scratch of V ints. */
static inline TokenBuckets encoder_build_buckets(int* out, int* count, const int* tokens, int N, int V) {
    memset(count, 0, (size_t)V * sizeof(int));
    for (int i = 0; i < N; i++) count[tokens[i]]++;
    const int S = wte_segment_positions(N);
    TokenBuckets tb = {0, 0, 0, 0};
    for (int v = 0; v < V; v++) {
        if (!count[v]) continue;
        tb.items += count[v] >= 2 * S ? count[v] / S : 1;
        tb.splits += count[v] >= 2 * S;
    }
    const int W = tb.items;
    int* dest = out;
    int* starts = out + W;
    int* pos = out + 2 * (size_t)W + 1;
    int* split_token = pos + N;
    int* split_first = split_token + tb.splits;
    int run = 0, item = 0, h = 0;
    for (int v = 0; v < V; v++) { /* count[v] becomes the next free slot of token v */
        int k = count[v];
        if (!k) continue;
        count[v] = run;
        if (k < 2 * S) {
            dest[item] = v;
            starts[item++] = run;
        } else {
            split_token[h] = v;
            split_first[h++] = tb.segments;
            for (int j = 0; j < k / S; j++) {
                dest[item] = -(tb.segments++ + 1);
                starts[item++] = run + j * S;
            }
        }
        run += k;
    }
    starts[W] = run;
    for (int i = 0; i < N; i++) pos[count[tokens[i]]++] = i;
    tb.ints = 2 * (size_t)W + 1 + (size_t)N + 2 * (size_t)tb.splits;
    return tb;
}

/* VEC values of a gradient row (floatX or fp32) as fp32, and back. */
template <int VEC, typename G> __device__ __forceinline__ void grad_load(float* out, const G* p) {
    if constexpr (sizeof(G) == sizeof(float)) {
        load_f32s<VEC>(out, (const float*)p);
    } else {
        Vec<G, VEC> a = vload<VEC>(p);
#pragma unroll
        for (int k = 0; k < VEC; k++) out[k] = to_f32(a.v[k]);
    }
}
template <int VEC, typename G> __device__ __forceinline__ void grad_store(G* p, const float* in) {
    if constexpr (sizeof(G) == sizeof(float)) {
        store_f32s<VEC>((float*)p, in);
    } else {
        Vec<G, VEC> a;
#pragma unroll
        for (int k = 0; k < VEC; k++) a.v[k] = from_f32<G>(in[k]);
        vstore<VEC>(p, a);
    }
}

#define WTE_LOADS_IN_FLIGHT 4

/* acc[0..VEC) = sum over positions pos[k0..k1) in order of dx[pos, c0..c0+VEC),
 * WTE_LOADS_IN_FLIGHT rows loaded before they are added (in order). */
template <int VEC>
__device__ __forceinline__ void wte_sum_rows(float* acc, const floatX* dx, const int* pos, int k0, int k1, int C, int c0) {
#pragma unroll
    for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
    int k = k0;
    for (; k + WTE_LOADS_IN_FLIGHT <= k1; k += WTE_LOADS_IN_FLIGHT) {
        Vec<floatX, VEC> a[WTE_LOADS_IN_FLIGHT];
#pragma unroll
        for (int q = 0; q < WTE_LOADS_IN_FLIGHT; q++) a[q] = vload<VEC>(dx + (size_t)pos[k + q] * C + c0);
#pragma unroll
        for (int q = 0; q < WTE_LOADS_IN_FLIGHT; q++)
#pragma unroll
            for (int j = 0; j < VEC; j++) acc[j] += to_f32(a[q].v[j]);
    }
    for (; k < k1; k++) {
        Vec<floatX, VEC> a = vload<VEC>(dx + (size_t)pos[k] * C + c0);
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[j] += to_f32(a.v[j]);
    }
}

/* Stage 1 of dwte: grid (W, ceil(C/(32 VEC))), one warp per block; thread
 * tx owns columns [c0, c0 + VEC), c0 = (blockIdx.y*32 + tx)*VEC. Item u sums
 * its positions' dx rows in position order in fp32 and adds the sum to its
 * token's row once (dest >= 0) or writes it to its scratch row (a segment).
 * dwte floatX, or fp32 where the token table's gradient is accumulated in
 * fp32 (plan.h). */
template <int VEC, typename G>
__global__ void encoder_backward_wte_kernel(G* dwte, float* scratch, const floatX* dx, const int* buckets, int W, int C) {
    const int u = blockIdx.x;
    const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (c0 >= C) return;
    const int* starts = buckets + W;
    const int* pos = buckets + 2 * (size_t)W + 1;
    float acc[VEC];
    wte_sum_rows<VEC>(acc, dx, pos, starts[u], starts[u + 1], C, c0);
    const int dest = buckets[u];
    if (dest < 0) {
        store_f32s<VEC>(scratch + (size_t)(-dest - 1) * C + c0, acc);
        return;
    }
    G* dst = dwte + (size_t)dest * C + c0;
    float cur[VEC];
    grad_load<VEC>(cur, dst);
#pragma unroll
    for (int j = 0; j < VEC; j++) cur[j] += acc[j];
    grad_store<VEC>(dst, cur);
}

/* Stage 2: grid (H, ceil(C/(32 VEC))); split token h's wte row += the sum of
 * its segment rows, in segment order. */
template <int VEC, typename G>
__global__ void encoder_backward_wte_segments_kernel(G* dwte, const float* scratch, const int* split_list, int H, int segments, int C) {
    const int h = blockIdx.x;
    const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (c0 >= C) return;
    const int first = split_list[H + h], last = h + 1 < H ? split_list[H + h + 1] : segments;
    float acc[VEC], seg[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
    for (int s = first; s < last; s++) {
        load_f32s<VEC>(seg, scratch + (size_t)s * C + c0);
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[j] += seg[j];
    }
    G* dst = dwte + (size_t)split_list[h] * C + c0;
    float cur[VEC];
    grad_load<VEC>(cur, dst);
#pragma unroll
    for (int j = 0; j < VEC; j++) cur[j] += acc[j];
    grad_store<VEC>(dst, cur);
}

/* dwpe[token_position(t),:] += sum over b (in order) of dx[b,t,:]; thread i
 * owns elements [i*VEC, i*VEC + VEC) of the local (T,C) rows, VEC = XVEC
 * where C is a multiple of it and the pointers are aligned, else 1 (a
 * vector never straddles two rows, whose table rows need not be adjacent). */
template <int VEC>
__global__ void encoder_backward_wpe_kernel(floatX* dwpe, const floatX* dx, int B, int C, TokenLayout lay) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    const int T = lay.T;
    if (i >= (size_t)T * C) return;
    floatX* row = dwpe + (size_t)token_position(&lay, i / C) * C + i % C;
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
    for (int b = 0; b < B; b++) {
        Vec<floatX, VEC> a = vload<VEC>(dx + (size_t)b * T * C + i);
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[j] += to_f32(a.v[j]);
    }
    Vec<floatX, VEC> g = vload<VEC>(row);
#pragma unroll
    for (int j = 0; j < VEC; j++) g.v[j] = from_f32<floatX>(to_f32(g.v[j]) + acc[j]);
    vstore<VEC>(row, g);
}

/* Runs of restarting positions (host): out[3k .. 3k+2] = first local row,
 * its position, length of run k, in local row order; returns how many (at
 * most B*T), and *positions one past the largest position. */
static inline int encoder_position_runs(int* out, const int* pos_start, const TokenLayout* lay, int B, int* positions) {
    int n = 0, top = 0, N = B * lay->T;
    for (int r = 0; r < N; r++) {
        int pos = token_position(lay, (size_t)r) - pos_start[r];
        int* last = n > 0 ? out + 3 * (size_t)(n - 1) : NULL; /* 3n passes 2^31 for n past 2^31 / 3 */
        if (last && r % lay->T != 0 && pos == last[1] + last[2]) {
            last[2]++;
        } else {
            int* run = out + 3 * (size_t)n;
            run[0] = r;
            run[1] = pos;
            run[2] = 1;
            n++;
        }
        top = pos + 1 > top ? pos + 1 : top;
    }
    *positions = top;
    return n;
}

/* dwpe[p,:] += the sum over the runs covering position p (runs: n triples of
 * encoder_position_runs, device), in run order, of dx at the run's row for
 * p. Thread i owns element i of the (positions, C) rows. */
__global__ void encoder_backward_wpe_runs_kernel(floatX* dwpe, const floatX* dx, const int* runs, int n, int positions, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)positions * C) return;
    const int p = (int)(i / C), c = (int)(i % C);
    float acc = 0.0f;
    for (int k = 0; k < n; k++) {
        const int* run = runs + 3 * (size_t)k;
        const int row = run[0], p0 = run[1], len = run[2];
        if (p >= p0 && p < p0 + len) acc += to_f32(dx[(size_t)(row + p - p0) * C + c]);
    }
    dwpe[i] = from_f32<floatX>(to_f32(dwpe[i]) + acc);
}

/* The wpe gradient of restarting positions: runs (device) and their count,
 * positions as encoder_position_runs gave them. */
static inline void gpu_encoder_backward_wpe_runs(floatX* dwpe, const floatX* dx, const int* runs, int n, int positions, int C,
                                                 cudaStream_t stream) {
    size_t elems = (size_t)positions * C;
    if (elems == 0) return;
    encoder_backward_wpe_runs_kernel<<<grid_for(elems, 256), 256, 0, stream>>>(dwpe, dx, runs, n, positions, C);
    CUDA_CHECK_LAUNCH();
}

template <int VEC, typename G>
static inline void encoder_backward_wte_launch(G* dwte, float* scratch, const floatX* dx, const int* d_buckets,
                                               const TokenBuckets* tb, int N, int C, cudaStream_t stream) {
    const unsigned col_blocks = (unsigned)ceil_div((size_t)C, 32 * VEC);
    encoder_backward_wte_kernel<VEC, G><<<dim3((unsigned)tb->items, col_blocks), 32, 0, stream>>>(dwte, scratch, dx, d_buckets,
                                                                                                  tb->items, C);
    CUDA_CHECK_LAUNCH();
    if (tb->splits == 0) return;
    const int* split_list = d_buckets + 2 * (size_t)tb->items + 1 + N;
    encoder_backward_wte_segments_kernel<VEC, G><<<dim3((unsigned)tb->splits, col_blocks), 32, 0, stream>>>(
        dwte, scratch, split_list, tb->splits, tb->segments, C);
    CUDA_CHECK_LAUNCH();
}

/* d_buckets: the device copy of encoder_build_buckets' output, tb its
 * counts; scratch: WTE_MAX_SEGMENTS * C floats (the column partials).
 * dwte: floatX* or float* (see the kernel); dwpe NULL: none (RoPE). */
/* pos_runs: with restarting positions, the device runs (encoder_position_runs)
 * and their count and positions (then the wpe gradient is theirs); NULL: none. */
template <typename G>
static inline void gpu_encoder_backward(G* dwte, floatX* dwpe, const floatX* dx, const int* d_buckets, const TokenBuckets* tb,
                                        float* scratch, int B, int C, const TokenLayout* lay, cudaStream_t stream,
                                        const int* pos_runs = nullptr, int runs = 0, int positions = 0) {
    int T = lay->T;
    if (tb->items > 0) {
        if (C % XVEC == 0 && all_aligned16(dwte, dx, scratch))
            encoder_backward_wte_launch<XVEC, G>(dwte, scratch, dx, d_buckets, tb, B * T, C, stream);
        else
            encoder_backward_wte_launch<1, G>(dwte, scratch, dx, d_buckets, tb, B * T, C, stream);
    }
    if (!dwpe) return; /* RoPE: no position table */
    if (pos_runs) {
        gpu_encoder_backward_wpe_runs(dwpe, dx, pos_runs, runs, positions, C, stream);
        return;
    }
    size_t n = (size_t)T * C;
    if (C % XVEC == 0 && all_aligned16(dwpe, dx))
        encoder_backward_wpe_kernel<XVEC><<<grid_for(n / XVEC, 256), 256, 0, stream>>>(dwpe, dx, B, C, *lay);
    else
        encoder_backward_wpe_kernel<1><<<grid_for(n, 256), 256, 0, stream>>>(dwpe, dx, B, C, *lay);
    CUDA_CHECK_LAUNCH();
}

#endif
