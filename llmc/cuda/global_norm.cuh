/*
 * Global L2 norm of the gradients, deterministic in two stages.
 *
 * Shapes: grads (n) floatX; partials (NORM_BLOCKS + 1) fp32 scratch.
 * Stage 1: a fixed grid of NORM_BLOCKS blocks of NORM_THREADS threads; thread
 * k of the grid sums the squares of elements k, k + stride, ... (fp32), and
 * each block reduces its threads in a fixed tree into partials[block].
 * Stage 2: one block sums the partials in a fixed tree into partials[NORM_BLOCKS].
 * The grid does not depend on the device, so neither do the bits.
 *
 * Non-finite gradients (FP16 loss scaling relies on this): every step is an
 * fp32 add of squares, never a max or a compare, so one inf element makes
 * the sum +inf (squares are >= 0: no inf - inf) and one NaN makes it NaN;
 * the driver then sees a non-finite norm and skips the step. Finite fp16
 * gradients cannot overflow the fp32 sum (65504^2 * 2^32 < 2e19, far below
 * 3.4e38), so the norm is non-finite exactly when some gradient is. FP16
 * also counts a stored +-65504 (the largest finite half) as overflow: it is
 * what a saturating conversion would leave behind, and a loss scale that
 * brings a gradient within one ulp of the limit is too large anyway.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_GLOBAL_NORM_CUH
#define REMAT_GLOBAL_NORM_CUH

#include "cuda_common.cuh"

#define NORM_BLOCKS GPU_NORM_BLOCKS
#define NORM_THREADS 512

__global__ void __launch_bounds__(NORM_THREADS) global_norm_partials_kernel(float* partials, const floatX* grads, size_t n) {
    __shared__ float scratch[33];
    const size_t stride = (size_t)NORM_BLOCKS * NORM_THREADS;
    float acc = 0.0f;
    for (size_t i = (size_t)blockIdx.x * NORM_THREADS + threadIdx.x; i < n; i += stride) {
        float g = to_f32(grads[i]);
#if PRECISION_IS_FP16
        if (fabsf(g) >= 65504.0f) g = INFINITY; /* max finite counts as overflow (NaN fails the test, stays NaN) */
#endif
        acc += g * g;
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(NORM_THREADS) global_norm_finish_kernel(float* partials) {
    __shared__ float scratch[33];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < NORM_BLOCKS; i += NORM_THREADS) acc += partials[i];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partials[NORM_BLOCKS] = acc;
}

/* Leaves the sum of squares in partials[NORM_BLOCKS] (device); the caller copies it back. */
static inline void gpu_global_norm_squared(float* partials, const floatX* grads, size_t n, cudaStream_t stream) {
    global_norm_partials_kernel<<<NORM_BLOCKS, NORM_THREADS, 0, stream>>>(partials, grads, n);
    CUDA_CHECK_LAUNCH();
    global_norm_finish_kernel<<<1, NORM_THREADS, 0, stream>>>(partials);
    CUDA_CHECK_LAUNCH();
}

#endif
