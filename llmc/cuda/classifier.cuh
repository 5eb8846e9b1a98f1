/*
 * Fused classifier: softmax, cross-entropy loss and dlogits in one kernel
 * per chunk of rows, never materialising the probabilities.
 *
 * Shapes: logits (rows, Vp) floatX, a chunk of the (B*T, Vp) logits
 * (rows = the plan's logits_chunk_rows or fewer); targets (rows) int;
 * losses (rows) fp32. Only the first V columns are real: the softmax and the
 * loss run over them, and the padded columns V..Vp-1 get dlogits 0.
 *
 * Per row r with target y: lse = log sum_{v<V} exp(logit_v);
 *   loss_r = lse - logit_y
 *   dlogits_v = (exp(logit_v - lse) - [v == y]) * dloss   (v < V), 0 (v >= V)
 * written over the logits in place. With dloss == 0 only the loss is written.
 * A target below 0 marks a row whose loss does not count (--eod-mask-loss,
 * llmc/core/documents.h): loss 0 and dlogits 0.
 *
 * One block per row: each thread keeps an online (max, sum of exp) over its
 * strided columns, the block combines them in a fixed tree, then the row is
 * read once more to write dlogits. Deterministic, no atomics. Access: 16-byte
 * groups of XVEC logits (8 bf16/fp16, 4 fp32; Vp is a multiple of 128), two
 * in flight per thread in the first pass; one element where Vp is no
 * multiple of XVEC or the logits are not 16-byte aligned.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_CLASSIFIER_CUH
#define REMAT_CLASSIFIER_CUH

#include "cuda_common.cuh"

#define CLASSIFIER_THREADS 512

/* Merges (m2, s2) into (m, s): s is a sum of exp(x - m). Symmetric in its
 * arguments, so a butterfly leaves identical bits in both partners. */
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    float mx = fmaxf(m, m2);
    if (mx == -INFINITY) { s = 0.0f; m = mx; return; }
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
    m = mx;
}

/* Adds z to the online (m, s): s is a sum of exp(x - m). */
__device__ __forceinline__ void lse_add(float& m, float& s, float z) {
    if (z > m) {
        s = s * expf(m - z) + 1.0f;
        m = z;
    } else {
        s += expf(z - m);
    }
}

/* Columns: thread t owns the VEC-wide groups t, t + blockDim.x, ... of the
 * row (VEC = XVEC: 16-byte loads and stores, Vp being a multiple of 128; 1
 * where the logits are not 16-byte aligned); columns >= V inside a group
 * are skipped. The first pass keeps two groups in flight per thread. */
template <int VEC>
__global__ void __launch_bounds__(CLASSIFIER_THREADS)
classifier_fused_kernel(floatX* logits, float* losses, const int* targets, int V, int Vp, float dloss) {
    __shared__ float sm[32], ss[32];
    const int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    floatX* x = logits + (size_t)row * Vp;
    const int target = targets[row];
    if (target < 0) { /* a row whose loss does not count (--eod-mask-loss): loss 0, no gradient */
        if (threadIdx.x == 0) losses[row] = 0.0f;
        for (int v = threadIdx.x; dloss != 0.0f && v < Vp; v += blockDim.x) x[v] = from_f32<floatX>(0.0f);
        return;
    }
    const float target_logit = to_f32(x[target]); /* read before any thread overwrites the row */
    const int groups = (V + VEC - 1) / VEC, stride = blockDim.x;
    float m = -INFINITY, s = 0.0f;
    int g = threadIdx.x;
    for (; g + stride < groups; g += 2 * stride) {
        Vec<floatX, VEC> a = vload<VEC>(x + (size_t)g * VEC), b = vload<VEC>(x + (size_t)(g + stride) * VEC);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            if (g * VEC + j < V) lse_add(m, s, to_f32(a.v[j]));
#pragma unroll
        for (int j = 0; j < VEC; j++)
            if ((g + stride) * VEC + j < V) lse_add(m, s, to_f32(b.v[j]));
    }
    if (g < groups) {
        Vec<floatX, VEC> a = vload<VEC>(x + (size_t)g * VEC);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            if (g * VEC + j < V) lse_add(m, s, to_f32(a.v[j]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
        lse_merge(m, s, m2, s2);
    }
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads(); /* also orders every read of the row above before the writes below */
    if (warp == 0) {
        const int nwarps = blockDim.x >> 5;
        m = lane < nwarps ? sm[lane] : -INFINITY;
        s = lane < nwarps ? ss[lane] : 0.0f;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
            lse_merge(m, s, m2, s2);
        }
        if (lane == 0) { sm[0] = m; ss[0] = s; }
    }
    __syncthreads();
    const float lse = sm[0] + logf(ss[0]);
    if (threadIdx.x == 0) losses[row] = lse - target_logit;
    if (dloss == 0.0f) return;
    for (int gv = threadIdx.x; gv < Vp / VEC; gv += stride) {
        Vec<floatX, VEC> a = vload<VEC>(x + (size_t)gv * VEC);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            const int v = gv * VEC + j;
            float d = 0.0f;
            if (v < V) d = (expf(to_f32(a.v[j]) - lse) - (v == target ? 1.0f : 0.0f)) * dloss;
            a.v[j] = from_f32<floatX>(d);
        }
        vstore<VEC>(x + (size_t)gv * VEC, a);
    }
}

/* Loss (and, with dloss != 0, dlogits in place) for `rows` rows of logits. */
static inline void gpu_classifier_fused(floatX* logits, float* losses, const int* targets, int rows, int V, int Vp, float dloss,
                                        cudaStream_t stream) {
    if (Vp % XVEC == 0 && aligned16(logits))
        classifier_fused_kernel<XVEC><<<(unsigned)rows, CLASSIFIER_THREADS, 0, stream>>>(logits, losses, targets, V, Vp, dloss);
    else
        classifier_fused_kernel<1><<<(unsigned)rows, CLASSIFIER_THREADS, 0, stream>>>(logits, losses, targets, V, Vp, dloss);
    CUDA_CHECK_LAUNCH();
}

/* Top-1 of each row (evaluation): top1[row] = the first index of the largest
 * of logits[row, 0..V) (padded columns never count). One block per row; each
 * thread scans its strided columns in increasing order, keeping the first
 * maximum, and the block combines them in a fixed tree on (value, lowest
 * index): deterministic, the CPU reference's argmax_row on the same values.
 * Shapes: logits (rows, Vp) floatX, top1 (rows) int. */
__device__ __forceinline__ void top1_merge(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

__global__ void __launch_bounds__(CLASSIFIER_THREADS) classifier_top1_kernel(const floatX* logits, int* top1, int V, int Vp) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const floatX* x = logits + (size_t)blockIdx.x * Vp;
    float v = -INFINITY;
    int i = V; /* above every real column: loses every tie */
    for (int c = threadIdx.x; c < V; c += blockDim.x) top1_merge(v, i, to_f32(x[c]), c);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, off);
        int i2 = __shfl_xor_sync(0xffffffffu, i, off);
        top1_merge(v, i, v2, i2);
    }
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (warp != 0) return;
    const int nwarps = blockDim.x >> 5;
    v = lane < nwarps ? sv[lane] : -INFINITY;
    i = lane < nwarps ? si[lane] : V;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, off);
        int i2 = __shfl_xor_sync(0xffffffffu, i, off);
        top1_merge(v, i, v2, i2);
    }
    if (lane == 0) top1[blockIdx.x] = i < V ? i : 0; /* a row of NaNs: 0, as the CPU's */
}

static inline void gpu_classifier_top1(const floatX* logits, int* top1, int rows, int V, int Vp, cudaStream_t stream) {
    classifier_top1_kernel<<<(unsigned)rows, CLASSIFIER_THREADS, 0, stream>>>(logits, top1, V, Vp);
    CUDA_CHECK_LAUNCH();
}

#endif
