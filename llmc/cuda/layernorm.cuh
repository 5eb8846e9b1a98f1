/*
 * LayerNorm over channels, forward and backward.
 *
 * Shapes: x, out, dout, dx (N,C) row-major floatX; w, b, dw, db (C) floatX;
 * mean, rstd (N) fp32. out = (x - mean) * rstd * w + b, eps 1e-5, population
 * variance (divide by C), like the CPU reference.
 *
 * Access: one warp per row; lane l owns the row's 16-byte groups ("packs")
 * of XVEC elements l, l+32, ... (XVEC = 8 bf16/fp16, 4 fp32), loaded all at
 * once into registers for rows up to 8 packs per lane (C <= 2048 bf16/fp16,
 * 1024 fp32), so the forward pass reads x once and the input-gradient kernel
 * reads dout and x once (a row-at-a-time loop would read it three and two
 * times, two bytes per load). Longer rows read each pack per pass. Where C is no
 * multiple of XVEC, or a pointer is not 16-byte aligned, the same kernels run
 * with packs of one element (scalar accesses).
 *
 * Fusion: the residual adds that precede LayerNorm in a block are fused into
 * the preceding matmul instead (cuBLASLt's D = A B + bias + C with C the
 * residual, see matmul.cuh), which saves a full read and write of the residual
 * stream, so LayerNorm itself reads one input.
 *
 * Recompute (-r 2) re-applies the normalisation from the stored mean and rstd
 * with the same kernel and launch configuration as the forward pass; the
 * normalisation uses explicitly rounded operations (no FMA contraction), so
 * the recomputed output equals the original bit for bit.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_LAYERNORM_CUH
#define REMAT_LAYERNORM_CUH

#include "cuda_common.cuh"

#define LN_ROWS_PER_BLOCK 8 /* one warp per row */

/* Row access of the warp-per-row kernels. A row of C floatX values is
 * C/VEC groups ("packs") of VEC elements; lane l owns packs l, l+32, l+64, ...
 * With K > 0 a lane keeps its (at most K) packs of the row in registers, loaded
 * all at once (K loads in flight) and read from there by every pass, so the
 * row is read from memory once; K = 0 (rows longer than the register cache)
 * reads each pack from memory in every pass. */
template <int VEC, int K>
__device__ __forceinline__ Vec<floatX, VEC> ln_pack(const Vec<floatX, VEC>* cache, const floatX* row, int k, int p) {
    if constexpr (K > 0) {
        (void)row; (void)p;
        return cache[k];
    } else {
        (void)cache; (void)k;
        return vload<VEC>(row + (size_t)p * VEC);
    }
}

template <int VEC, int K>
__device__ __forceinline__ void ln_cache_row(Vec<floatX, VEC>* cache, const floatX* row, int packs, int lane) {
    if constexpr (K > 0) {
#pragma unroll
        for (int k = 0; k < K; k++)
            if (k * 32 + lane < packs) cache[k] = vload<VEC>(row + (size_t)(k * 32 + lane) * VEC);
    } else {
        (void)cache; (void)row; (void)packs; (void)lane;
    }
}

/* The lane's sum over its packs of x - m (square == 0) or of (x - m)^2
 * (square == 1), in pack and element order. */
template <int VEC, int K>
__device__ __forceinline__ float ln_lane_sum(const Vec<floatX, VEC>* cache, const floatX* row, int packs, int per_lane, int lane,
                                             float m, int square) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < per_lane; k++) {
        const int p = k * 32 + lane;
        if (p >= packs) break;
        Vec<floatX, VEC> a = ln_pack<VEC, K>(cache, row, k, p);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float d = to_f32(a.v[j]) - m;
            s += square ? d * d : d;
        }
    }
    return s;
}

/* The normalisation of one element, shared by the forward pass and the
 * selective recompute (the same kernel): explicitly rounded operations, no
 * FMA contraction, so the recomputed output equals the original bit for bit. */
__device__ __forceinline__ floatX ln_out(float x, float m, float r, float w, float b) {
    float n = __fmul_rn(__fsub_rn(x, m), r);
    return from_f32<floatX>(__fadd_rn(__fmul_rn(n, w), b));
}

/* stats_given == 0: computes mean and rstd of each row (two passes over the
 * cached row: mean, then the sum of squared deviations) and stores them.
 * stats_given == 1: reads them (recompute). Then writes out in both cases.
 * Block: LN_ROWS_PER_BLOCK warps, one row each; VEC = XVEC (C a multiple of
 * it, every pointer 16-byte aligned) or 1; K packs per lane in registers. */
template <int VEC, int K>
__global__ void layernorm_forward_kernel(floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w,
                                         const floatX* b, int N, int C, int stats_given) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LN_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= N) return; /* whole warps leave together: no block-wide sync below */
    const floatX* xr = x + (size_t)row * C;
    const int packs = C / VEC, per_lane = K > 0 ? K : (packs + 31) / 32;
    Vec<floatX, VEC> cache[K > 0 ? K : 1];
    ln_cache_row<VEC, K>(cache, xr, packs, lane);
    float m, r;
    if (!stats_given) {
        m = warp_sum(ln_lane_sum<VEC, K>(cache, xr, packs, per_lane, lane, 0.0f, 0)) / (float)C;
        float v = warp_sum(ln_lane_sum<VEC, K>(cache, xr, packs, per_lane, lane, m, 1)) / (float)C;
        r = 1.0f / sqrtf(v + 1e-5f);
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = r;
        }
    } else {
        m = mean[row];
        r = rstd[row];
    }
    floatX* o = out + (size_t)row * C;
#pragma unroll
    for (int k = 0; k < per_lane; k++) {
        const int p = k * 32 + lane;
        if (p >= packs) break;
        Vec<floatX, VEC> a = ln_pack<VEC, K>(cache, xr, k, p);
        Vec<floatX, VEC> wv = vload<VEC>(w + (size_t)p * VEC), bv = vload<VEC>(b + (size_t)p * VEC), ov;
#pragma unroll
        for (int j = 0; j < VEC; j++) ov.v[j] = ln_out(to_f32(a.v[j]), m, r, to_f32(wv.v[j]), to_f32(bv.v[j]));
        vstore<VEC>(o + (size_t)p * VEC, ov);
    }
}

/* The path both LayerNorm kernels take for rows of C elements, so that the
 * forward pass and the recompute always take the same one for a shape:
 * vector width XVEC when C is a multiple of it and every pointer is 16-byte
 * aligned, else 1; and K, the smallest of 1, 2, 4, 8 packs of VEC elements
 * per lane that caches the row in registers, else 0 (no cache). ln_dispatch
 * calls launch.run<VEC, K>() of a launcher that holds a kernel's arguments. */
static inline int ln_cache_packs(int C, int vec) {
    int per_lane = (int)ceil_div((size_t)(C / vec), 32);
    return per_lane <= 1 ? 1 : per_lane <= 2 ? 2 : per_lane <= 4 ? 4 : per_lane <= 8 ? 8 : 0;
}

template <int VEC, typename Launch>
static inline void ln_dispatch_cache(const Launch& launch, int C) {
    switch (ln_cache_packs(C, VEC)) {
    case 1: launch.template run<VEC, 1>(); break;
    case 2: launch.template run<VEC, 2>(); break;
    case 4: launch.template run<VEC, 4>(); break;
    case 8: launch.template run<VEC, 8>(); break;
    default: launch.template run<VEC, 0>(); break;
    }
}

template <typename Launch>
static inline void ln_dispatch(const Launch& launch, int C, int vector_ok) {
    if (vector_ok && C % XVEC == 0) ln_dispatch_cache<XVEC>(launch, C);
    else ln_dispatch_cache<1>(launch, C);
}

struct LayerNormForwardLaunch {
    floatX* out;
    float *mean, *rstd;
    const floatX *x, *w, *b;
    int N, C, stats_given;
    cudaStream_t stream;
    template <int VEC, int K>
    void run() const {
        layernorm_forward_kernel<VEC, K><<<grid_for((size_t)N, LN_ROWS_PER_BLOCK), 32 * LN_ROWS_PER_BLOCK, 0, stream>>>(
            out, mean, rstd, x, w, b, N, C, stats_given);
    }
};

static inline void layernorm_forward_launch(floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w,
                                            const floatX* b, int N, int C, int stats_given, cudaStream_t stream) {
    LayerNormForwardLaunch launch = {out, mean, rstd, x, w, b, N, C, stats_given, stream};
    ln_dispatch(launch, C, all_aligned16(out, x, w, b));
    CUDA_CHECK_LAUNCH();
}

static inline void gpu_layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w,
                                         const floatX* b, int N, int C, cudaStream_t stream) {
    layernorm_forward_launch(out, mean, rstd, x, w, b, N, C, 0, stream);
}

/* Selective recompute: out from x and the stored statistics (same kernel, same launch). */
static inline void gpu_layernorm_apply(floatX* out, const float* mean, const float* rstd, const floatX* x, const floatX* w,
                                       const floatX* b, int N, int C, cudaStream_t stream) {
    layernorm_forward_launch(out, (float*)mean, (float*)rstd, x, w, b, N, C, 1, stream);
}

/* dx (N,C) += input gradient, one warp per row:
 *   dx += rstd * (dout*w - mean_c(dout*w) - norm * mean_c(dout*w*norm)),  norm = (x - mean) * rstd.
 * Packs as in the forward kernel: the lane's packs of dout and x are cached
 * (2K loads in flight), so both passes read the row from memory once. */
template <int VEC, int K>
__global__ void layernorm_backward_dx_kernel(floatX* dx, const floatX* dout, const floatX* x, const floatX* w,
                                             const float* mean, const float* rstd, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LN_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= N) return;
    const floatX* xr = x + (size_t)row * C;
    const floatX* dr = dout + (size_t)row * C;
    const int packs = C / VEC, per_lane = K > 0 ? K : (packs + 31) / 32;
    Vec<floatX, VEC> xc[K > 0 ? K : 1], dc[K > 0 ? K : 1];
    ln_cache_row<VEC, K>(dc, dr, packs, lane);
    ln_cache_row<VEC, K>(xc, xr, packs, lane);
    const float m = mean[row], r = rstd[row];
    float dmean = 0.0f, dnorm_norm = 0.0f;
#pragma unroll
    for (int k = 0; k < per_lane; k++) {
        const int p = k * 32 + lane;
        if (p >= packs) break;
        Vec<floatX, VEC> a = ln_pack<VEC, K>(xc, xr, k, p), d = ln_pack<VEC, K>(dc, dr, k, p);
        Vec<floatX, VEC> wv = vload<VEC>(w + (size_t)p * VEC);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float dnorm = to_f32(d.v[j]) * to_f32(wv.v[j]);
            dmean += dnorm;
            dnorm_norm += dnorm * ((to_f32(a.v[j]) - m) * r);
        }
    }
    dmean = warp_sum(dmean) / (float)C;
    dnorm_norm = warp_sum(dnorm_norm) / (float)C;
    floatX* dxr = dx + (size_t)row * C;
#pragma unroll
    for (int k = 0; k < per_lane; k++) {
        const int p = k * 32 + lane;
        if (p >= packs) break;
        Vec<floatX, VEC> a = ln_pack<VEC, K>(xc, xr, k, p), d = ln_pack<VEC, K>(dc, dr, k, p);
        Vec<floatX, VEC> wv = vload<VEC>(w + (size_t)p * VEC), g = vload<VEC>(dxr + (size_t)p * VEC);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float norm = (to_f32(a.v[j]) - m) * r;
            float dnorm = to_f32(d.v[j]) * to_f32(wv.v[j]);
            g.v[j] = from_f32<floatX>(to_f32(g.v[j]) + r * (dnorm - dmean - norm * dnorm_norm));
        }
        vstore<VEC>(dxr + (size_t)p * VEC, g);
    }
}

/* Stage 1 of dw (C) += sum_n dout*norm and db (C) += sum_n dout: block
 * (32 threads of VEC columns each) x (COLUMN_BLOCK_Y row lanes), grid
 * (ceil(C/(32 VEC)), COLUMN_SPLITS); block (cx, s) sums rows of slice s for
 * its 32*VEC columns, each thread with VEC-wide loads of dout and x (VEC =
 * XVEC when C is a multiple of it and the pointers are aligned, else 1).
 * partials: dw slices [0, SPLITS*C), then db slices [SPLITS*C, 2*SPLITS*C). */
template <int VEC>
__global__ void layernorm_param_partials_kernel(float* partials, const floatX* dout, const floatX* x, const float* mean,
                                                const float* rstd, int N, int C) {
    __shared__ float sw[COLUMN_BLOCK_Y][32 * VEC], sb[COLUMN_BLOCK_Y][32 * VEC];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c0 = (blockIdx.x * 32 + tx) * VEC;
    const int rps = column_rows_per_split(N);
    const int r0 = blockIdx.y * rps, r1 = min(N, r0 + rps);
    float gw[VEC], gb[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) gw[j] = gb[j] = 0.0f;
    if (c0 < C) {
        for (int r = r0 + ty; r < r1; r += COLUMN_BLOCK_Y) {
            Vec<floatX, VEC> d = vload<VEC>(dout + (size_t)r * C + c0), a = vload<VEC>(x + (size_t)r * C + c0);
            const float m = mean[r], rs = rstd[r];
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                float dj = to_f32(d.v[j]);
                gw[j] += dj * ((to_f32(a.v[j]) - m) * rs);
                gb[j] += dj;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        sw[ty][tx * VEC + j] = gw[j];
        sb[ty][tx * VEC + j] = gb[j];
    }
    __syncthreads();
    if (ty == 0 && c0 < C) {
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float a = 0.0f, bsum = 0.0f;
            for (int k = 0; k < COLUMN_BLOCK_Y; k++) {
                a += sw[k][tx * VEC + j];
                bsum += sb[k][tx * VEC + j];
            }
            partials[(size_t)blockIdx.y * C + c0 + j] = a;
            partials[(size_t)COLUMN_SPLITS * C + (size_t)blockIdx.y * C + c0 + j] = bsum;
        }
    }
}

struct LayerNormBackwardDxLaunch {
    floatX* dx;
    const floatX *dout, *x, *w;
    const float *mean, *rstd;
    int N, C;
    cudaStream_t stream;
    template <int VEC, int K>
    void run() const {
        layernorm_backward_dx_kernel<VEC, K><<<grid_for((size_t)N, LN_ROWS_PER_BLOCK), 32 * LN_ROWS_PER_BLOCK, 0, stream>>>(
            dx, dout, x, w, mean, rstd, N, C);
    }
};

/* dx += input gradient; dw, db += parameter gradients (floatX, or fp32: a
 * token tile's share added to its layer's fp32 sums). partials:
 * COLUMN_SPLITS*2*C floats. */
template <typename G>
static inline void gpu_layernorm_backward(floatX* dx, G* dw, G* db, float* partials, const floatX* dout,
                                          const floatX* x, const floatX* w, const float* mean, const float* rstd,
                                          int N, int C, cudaStream_t stream) {
    const int vector_ok = all_aligned16(dx, dout, x, w);
    LayerNormBackwardDxLaunch launch = {dx, dout, x, w, mean, rstd, N, C, stream};
    ln_dispatch(launch, C, vector_ok);
    CUDA_CHECK_LAUNCH();
    dim3 block(32, COLUMN_BLOCK_Y);
    if (vector_ok && C % XVEC == 0) {
        dim3 grid((unsigned)ceil_div((size_t)C, 32 * XVEC), COLUMN_SPLITS);
        layernorm_param_partials_kernel<XVEC><<<grid, block, 0, stream>>>(partials, dout, x, mean, rstd, N, C);
    } else {
        dim3 grid((unsigned)ceil_div((size_t)C, 32), COLUMN_SPLITS);
        layernorm_param_partials_kernel<1><<<grid, block, 0, stream>>>(partials, dout, x, mean, rstd, N, C);
    }
    CUDA_CHECK_LAUNCH();
    gpu_column_finish(dw, partials, C, stream);
    gpu_column_finish(db, partials + (size_t)COLUMN_SPLITS * C, C, stream);
}

#endif
