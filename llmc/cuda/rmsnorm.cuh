/*
 * RMSNorm over channels (Llama, Qwen2), forward and backward.
 *
 * Shapes: x, out, dout, dx (N,C) row-major floatX; w, dw (C); rstd (N) fp32,
 * and mean (N) fp32, which RMSNorm leaves at 0 (the plan's LayerNorm slot,
 * written so that offloading copies defined values, as the CPU's does).
 *   out = x * rstd * w,   rstd = 1 / sqrt(mean_c(x^2) + eps)
 * no mean subtracted and no bias; statistics in fp32, the weight multiplied
 * last (as transformers and the CPU reference's rmsnorm_forward do).
 *
 * Access: LayerNorm's (layernorm.cuh): one warp per row, the lane's 16-byte
 * packs of the row cached in registers for rows up to 8 packs per lane, the
 * same dispatch (vector width XVEC when C is a multiple of it and the
 * pointers are 16-byte aligned, else packs of one element).
 *
 * Recompute (-r 2) re-applies the normalisation from the stored rstd with the
 * same kernel and launch as the forward pass, in explicitly rounded
 * operations, so the recomputed output equals the original bit for bit.
 *
 * Backward: dx += rstd (dout w - y mean_c(dout w y)), y = x rstd; dw by the
 * column-partials scheme of LayerNorm's (fixed row splits, summed in a fixed
 * order: bitwise reproducible; a token tile's share into fp32 sums).
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_RMSNORM_CUH
#define REMAT_RMSNORM_CUH

#include "cuda_common.cuh"
#include "layernorm.cuh"

/* One element's normalisation, the forward pass's and the recompute's:
 * (x * r) * w, explicitly rounded (no FMA contraction). */
__device__ __forceinline__ floatX rms_out(float x, float r, float w) { return from_f32<floatX>(__fmul_rn(__fmul_rn(x, r), w)); }

/* stats_given == 0: computes rstd of each row from the cached row and stores
 * it (mean, if not NULL, gets 0); 1: reads rstd (recompute). Then writes out.
 * Block: LN_ROWS_PER_BLOCK warps, one row each; VEC, K as in LayerNorm's. */
template <int VEC, int K>
__global__ void rmsnorm_forward_kernel(floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w, int N, int C, float eps,
                                       int stats_given) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LN_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= N) return; /* whole warps leave together */
    const floatX* xr = x + (size_t)row * C;
    const int packs = C / VEC, per_lane = K > 0 ? K : (packs + 31) / 32;
    Vec<floatX, VEC> cache[K > 0 ? K : 1];
    ln_cache_row<VEC, K>(cache, xr, packs, lane);
    float r;
    if (!stats_given) {
        float ss = warp_sum(ln_lane_sum<VEC, K>(cache, xr, packs, per_lane, lane, 0.0f, 1)) / (float)C;
        r = 1.0f / sqrtf(ss + eps);
        if (lane == 0) {
            rstd[row] = r;
            if (mean) mean[row] = 0.0f;
        }
    } else {
        r = rstd[row];
    }
    floatX* o = out + (size_t)row * C;
#pragma unroll
    for (int k = 0; k < per_lane; k++) {
        const int p = k * 32 + lane;
        if (p >= packs) break;
        Vec<floatX, VEC> a = ln_pack<VEC, K>(cache, xr, k, p), wv = vload<VEC>(w + (size_t)p * VEC), ov;
#pragma unroll
        for (int j = 0; j < VEC; j++) ov.v[j] = rms_out(to_f32(a.v[j]), r, to_f32(wv.v[j]));
        vstore<VEC>(o + (size_t)p * VEC, ov);
    }
}

struct RmsNormForwardLaunch {
    floatX* out;
    float *mean, *rstd;
    const floatX *x, *w;
    int N, C;
    float eps;
    int stats_given;
    cudaStream_t stream;
    template <int VEC, int K>
    void run() const {
        rmsnorm_forward_kernel<VEC, K><<<grid_for((size_t)N, LN_ROWS_PER_BLOCK), 32 * LN_ROWS_PER_BLOCK, 0, stream>>>(
            out, mean, rstd, x, w, N, C, eps, stats_given);
    }
};

/* out, rstd (and mean = 0 when not NULL) from x. */
static inline void gpu_rmsnorm_forward(floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w, int N, int C, float eps,
                                       cudaStream_t stream) {
    RmsNormForwardLaunch launch = {out, mean, rstd, x, w, N, C, eps, 0, stream};
    ln_dispatch(launch, C, all_aligned16(out, x, w));
    CUDA_CHECK_LAUNCH();
}

/* Selective recompute: out from x and the stored rstd (same kernel, same launch). */
static inline void gpu_rmsnorm_apply(floatX* out, const float* rstd, const floatX* x, const floatX* w, int N, int C, cudaStream_t stream) {
    RmsNormForwardLaunch launch = {out, NULL, (float*)rstd, x, w, N, C, 0.0f, 1, stream};
    ln_dispatch(launch, C, all_aligned16(out, x, w));
    CUDA_CHECK_LAUNCH();
}

/* dx (N,C) += rstd (dout w - y mean_c(dout w y)), y = x rstd; one warp per
 * row, dout and x cached as in the forward kernel. */
template <int VEC, int K>
__global__ void rmsnorm_backward_dx_kernel(floatX* dx, const floatX* dout, const floatX* x, const floatX* w, const float* rstd, int N,
                                           int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LN_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= N) return;
    const floatX* xr = x + (size_t)row * C;
    const floatX* dr = dout + (size_t)row * C;
    const int packs = C / VEC, per_lane = K > 0 ? K : (packs + 31) / 32;
    Vec<floatX, VEC> xc[K > 0 ? K : 1], dc[K > 0 ? K : 1];
    ln_cache_row<VEC, K>(dc, dr, packs, lane);
    ln_cache_row<VEC, K>(xc, xr, packs, lane);
    const float r = rstd[row];
    float g_dot_y = 0.0f;
#pragma unroll
    for (int k = 0; k < per_lane; k++) {
        const int p = k * 32 + lane;
        if (p >= packs) break;
        Vec<floatX, VEC> a = ln_pack<VEC, K>(xc, xr, k, p), d = ln_pack<VEC, K>(dc, dr, k, p), wv = vload<VEC>(w + (size_t)p * VEC);
#pragma unroll
        for (int j = 0; j < VEC; j++) g_dot_y += to_f32(d.v[j]) * to_f32(wv.v[j]) * (to_f32(a.v[j]) * r);
    }
    g_dot_y = warp_sum(g_dot_y) / (float)C;
    floatX* dxr = dx + (size_t)row * C;
#pragma unroll
    for (int k = 0; k < per_lane; k++) {
        const int p = k * 32 + lane;
        if (p >= packs) break;
        Vec<floatX, VEC> a = ln_pack<VEC, K>(xc, xr, k, p), d = ln_pack<VEC, K>(dc, dr, k, p);
        Vec<floatX, VEC> wv = vload<VEC>(w + (size_t)p * VEC), g = vload<VEC>(dxr + (size_t)p * VEC);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float y = to_f32(a.v[j]) * r;
            g.v[j] = from_f32<floatX>(to_f32(g.v[j]) + r * (to_f32(d.v[j]) * to_f32(wv.v[j]) - y * g_dot_y));
        }
        vstore<VEC>(dxr + (size_t)p * VEC, g);
    }
}

/* Stage 1 of dw (C) += sum_n dout x rstd: block (32 threads of VEC columns)
 * x (COLUMN_BLOCK_Y row lanes), grid (ceil(C/(32 VEC)), COLUMN_SPLITS);
 * block (cx, s) sums the rows of split s for its columns in a fixed order.
 * partials: COLUMN_SPLITS slices of C. */
template <int VEC>
__global__ void rmsnorm_weight_partials_kernel(float* partials, const floatX* dout, const floatX* x, const float* rstd, int N, int C) {
    __shared__ float sw[COLUMN_BLOCK_Y][32 * VEC];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c0 = (blockIdx.x * 32 + tx) * VEC;
    const int rps = column_rows_per_split(N);
    const int r0 = blockIdx.y * rps, r1 = min(N, r0 + rps);
    float gw[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) gw[j] = 0.0f;
    if (c0 < C) {
        for (int r = r0 + ty; r < r1; r += COLUMN_BLOCK_Y) {
            Vec<floatX, VEC> d = vload<VEC>(dout + (size_t)r * C + c0), a = vload<VEC>(x + (size_t)r * C + c0);
            const float rs = rstd[r];
#pragma unroll
            for (int j = 0; j < VEC; j++) gw[j] += to_f32(d.v[j]) * (to_f32(a.v[j]) * rs);
        }
    }
#pragma unroll
    for (int j = 0; j < VEC; j++) sw[ty][tx * VEC + j] = gw[j];
    __syncthreads();
    if (ty == 0 && c0 < C) {
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float a = 0.0f;
            for (int k = 0; k < COLUMN_BLOCK_Y; k++) a += sw[k][tx * VEC + j];
            partials[(size_t)blockIdx.y * C + c0 + j] = a;
        }
    }
}

struct RmsNormBackwardDxLaunch {
    floatX* dx;
    const floatX *dout, *x, *w;
    const float* rstd;
    int N, C;
    cudaStream_t stream;
    template <int VEC, int K>
    void run() const {
        rmsnorm_backward_dx_kernel<VEC, K><<<grid_for((size_t)N, LN_ROWS_PER_BLOCK), 32 * LN_ROWS_PER_BLOCK, 0, stream>>>(
            dx, dout, x, w, rstd, N, C);
    }
};

/* dx += input gradient; dw += weight gradient (floatX, or fp32: a token
 * tile's share added to its layer's fp32 sums). partials: COLUMN_SPLITS*C floats. */
template <typename G>
static inline void gpu_rmsnorm_backward(floatX* dx, G* dw, float* partials, const floatX* dout, const floatX* x, const floatX* w,
                                        const float* rstd, int N, int C, cudaStream_t stream) {
    const int vector_ok = all_aligned16(dx, dout, x, w);
    RmsNormBackwardDxLaunch launch = {dx, dout, x, w, rstd, N, C, stream};
    ln_dispatch(launch, C, vector_ok);
    CUDA_CHECK_LAUNCH();
    dim3 block(32, COLUMN_BLOCK_Y);
    if (vector_ok && C % XVEC == 0) {
        dim3 grid((unsigned)ceil_div((size_t)C, 32 * XVEC), COLUMN_SPLITS);
        rmsnorm_weight_partials_kernel<XVEC><<<grid, block, 0, stream>>>(partials, dout, x, rstd, N, C);
    } else {
        dim3 grid((unsigned)ceil_div((size_t)C, 32), COLUMN_SPLITS);
        rmsnorm_weight_partials_kernel<1><<<grid, block, 0, stream>>>(partials, dout, x, rstd, N, C);
    }
    CUDA_CHECK_LAUNCH();
    gpu_column_finish(dw, partials, C, stream);
}

#endif
