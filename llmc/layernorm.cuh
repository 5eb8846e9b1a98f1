/*
 * LayerNorm over channels, forward and backward.
 *
 * Shapes: x, out, dout, dx (N,C) row-major floatX; w, b, dw, db (C) floatX;
 * mean, rstd (N) fp32. out = (x - mean) * rstd * w + b, eps 1e-5, population
 * variance (divide by C), like the CPU reference.
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
 * Status: compiles, unverified on GPU.
 */
#ifndef REMAT_LAYERNORM_CUH
#define REMAT_LAYERNORM_CUH

#include "cuda_common.cuh"

#define LN_ROWS_PER_BLOCK 8 /* one warp per row */

/* stats_given == 0: computes mean and rstd of each row and stores them.
 * stats_given == 1: reads them (recompute). Then writes out in both cases. */
__global__ void layernorm_forward_kernel(floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w,
                                         const floatX* b, int N, int C, int stats_given) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LN_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= N) return; /* whole warps leave together: no block-wide sync below */
    const floatX* xr = x + (size_t)row * C;
    float m, r;
    if (!stats_given) {
        float s = 0.0f;
        for (int c = lane; c < C; c += 32) s += to_f32(xr[c]);
        m = warp_sum(s) / (float)C;
        float v = 0.0f;
        for (int c = lane; c < C; c += 32) {
            float d = to_f32(xr[c]) - m;
            v += d * d;
        }
        v = warp_sum(v) / (float)C;
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
    for (int c = lane; c < C; c += 32) {
        float n = __fmul_rn(__fsub_rn(to_f32(xr[c]), m), r);
        o[c] = from_f32<floatX>(__fadd_rn(__fmul_rn(n, to_f32(w[c])), to_f32(b[c])));
    }
}

static inline void gpu_layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w,
                                         const floatX* b, int N, int C, cudaStream_t stream) {
    layernorm_forward_kernel<<<grid_for((size_t)N, LN_ROWS_PER_BLOCK), 32 * LN_ROWS_PER_BLOCK, 0, stream>>>(out, mean, rstd, x, w, b, N, C, 0);
    CUDA_CHECK_LAUNCH();
}

/* Selective recompute: out from x and the stored statistics (same kernel, same launch). */
static inline void gpu_layernorm_apply(floatX* out, const float* mean, const float* rstd, const floatX* x, const floatX* w,
                                       const floatX* b, int N, int C, cudaStream_t stream) {
    layernorm_forward_kernel<<<grid_for((size_t)N, LN_ROWS_PER_BLOCK), 32 * LN_ROWS_PER_BLOCK, 0, stream>>>(
        out, (float*)mean, (float*)rstd, x, w, b, N, C, 1);
    CUDA_CHECK_LAUNCH();
}

/* dx (N,C) += input gradient, one warp per row:
 *   dx += rstd * (dout*w - mean_c(dout*w) - norm * mean_c(dout*w*norm)),  norm = (x - mean) * rstd. */
__global__ void layernorm_backward_dx_kernel(floatX* dx, const floatX* dout, const floatX* x, const floatX* w,
                                             const float* mean, const float* rstd, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LN_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= N) return;
    const floatX* xr = x + (size_t)row * C;
    const floatX* dr = dout + (size_t)row * C;
    const float m = mean[row], r = rstd[row];
    float dmean = 0.0f, dnorm_norm = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float dnorm = to_f32(dr[c]) * to_f32(w[c]);
        dmean += dnorm;
        dnorm_norm += dnorm * ((to_f32(xr[c]) - m) * r);
    }
    dmean = warp_sum(dmean) / (float)C;
    dnorm_norm = warp_sum(dnorm_norm) / (float)C;
    floatX* dxr = dx + (size_t)row * C;
    for (int c = lane; c < C; c += 32) {
        float norm = (to_f32(xr[c]) - m) * r;
        float dnorm = to_f32(dr[c]) * to_f32(w[c]);
        dxr[c] = from_f32<floatX>(to_f32(dxr[c]) + r * (dnorm - dmean - norm * dnorm_norm));
    }
}

/* Stage 1 of dw (C) += sum_n dout*norm and db (C) += sum_n dout: block
 * (32 columns) x (COLUMN_BLOCK_Y row lanes), grid (ceil(C/32), COLUMN_SPLITS);
 * block (cx, s) sums rows of slice s for its 32 columns. partials: dw slices
 * [0, SPLITS*C), then db slices [SPLITS*C, 2*SPLITS*C). */
__global__ void layernorm_param_partials_kernel(float* partials, const floatX* dout, const floatX* x, const float* mean,
                                                const float* rstd, int N, int C) {
    __shared__ float sw[COLUMN_BLOCK_Y][32], sb[COLUMN_BLOCK_Y][32];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c = blockIdx.x * 32 + tx;
    const int rps = column_rows_per_split(N);
    const int r0 = blockIdx.y * rps, r1 = min(N, r0 + rps);
    float gw = 0.0f, gb = 0.0f;
    if (c < C) {
        for (int r = r0 + ty; r < r1; r += COLUMN_BLOCK_Y) {
            float d = to_f32(dout[(size_t)r * C + c]);
            gw += d * ((to_f32(x[(size_t)r * C + c]) - mean[r]) * rstd[r]);
            gb += d;
        }
    }
    sw[ty][tx] = gw;
    sb[ty][tx] = gb;
    __syncthreads();
    if (ty == 0 && c < C) {
        float a = 0.0f, bsum = 0.0f;
        for (int k = 0; k < COLUMN_BLOCK_Y; k++) {
            a += sw[k][tx];
            bsum += sb[k][tx];
        }
        partials[(size_t)blockIdx.y * C + c] = a;
        partials[(size_t)COLUMN_SPLITS * C + (size_t)blockIdx.y * C + c] = bsum;
    }
}

/* dx += input gradient; dw, db += parameter gradients. partials: COLUMN_SPLITS*2*C floats. */
static inline void gpu_layernorm_backward(floatX* dx, floatX* dw, floatX* db, float* partials, const floatX* dout,
                                          const floatX* x, const floatX* w, const float* mean, const float* rstd,
                                          int N, int C, cudaStream_t stream) {
    layernorm_backward_dx_kernel<<<grid_for((size_t)N, LN_ROWS_PER_BLOCK), 32 * LN_ROWS_PER_BLOCK, 0, stream>>>(dx, dout, x, w, mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
    dim3 grid((unsigned)ceil_div((size_t)C, 32), COLUMN_SPLITS), block(32, COLUMN_BLOCK_Y);
    layernorm_param_partials_kernel<<<grid, block, 0, stream>>>(partials, dout, x, mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
    gpu_column_finish(dw, partials, C, stream);
    gpu_column_finish(db, partials + (size_t)COLUMN_SPLITS * C, C, stream);
}

#endif
