/*
 * Global L2 norm of the gradients, deterministic, group by group.
 *
 * Why groups: with --offload-optimizer on one process (plan.h,
 * plan_grad_slots) a layer's gradients leave the device while the backward
 * runs on (they live in a slot that the layer R below writes over), so their
 * squares must be summed before the slot is reused; the whole buffer never
 * exists at once. The norm is therefore summed the same way in every run, so
 * that it has the same bits with and without the flag: one partial sum per
 * gradient group in the order model.h's param_group_slices lists a group's
 * tensors (group l < L: layer l's 12 block tensors; group L: the tensors
 * outside the blocks), then the groups' sums in group order. A group's sum
 * depends only on the sequence of its values, not on where they lie (slot or
 * whole buffer: GradSlices, grad_accum.cuh).
 *
 * Shapes: partials (NORM_BLOCKS + 1 + groups) fp32 scratch: [0, NORM_BLOCKS)
 * one group's block partials, [NORM_BLOCKS] the total, NORM_GROUP_SUM(g) group
 * g's sum. A group of n values (its slices back to back, index v):
 * Stage 1: norm_blocks_for(n) blocks of NORM_THREADS threads (a function of n
 * only); thread k of the grid sums the squares of values k, k + stride, ...
 * (fp32), and each block reduces its threads in a fixed tree into partials[block].
 * Stage 2: one block sums the block partials in a fixed tree into the group's sum.
 * Stage 3 (gpu_norm_total): one block sums the group sums in a fixed tree into
 * partials[NORM_BLOCKS]. Nothing depends on the device, so neither do the bits.
 *
 * Non-finite gradients (FP16 loss scaling relies on this): every step is an
 * fp32 add of squares, never a max or a compare, so one inf element makes
 * its group's sum and the total +inf (squares are >= 0: no inf - inf) and one
 * NaN makes them NaN; the driver then sees a non-finite norm and skips the
 * step: a layer's overflow test is its group's sum. Finite fp16 gradients
 * cannot overflow the fp32 sum (65504^2 * 2^32 < 2e19, far below 3.4e38), so
 * the norm is non-finite exactly when some gradient is. FP16 also counts a
 * stored +-65504 (the largest finite half) as overflow: it is what a
 * saturating conversion would leave behind, and a loss scale that brings a
 * gradient within one ulp of the limit is too large anyway.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_GLOBAL_NORM_CUH
#define REMAT_GLOBAL_NORM_CUH

#include "cuda_common.cuh"
#include "grad_accum.cuh" /* GradSlices */

#define NORM_BLOCKS GPU_NORM_BLOCKS
#define NORM_THREADS 512
#define NORM_GROUP_SUM(g) (NORM_BLOCKS + 1 + (g))

/* Stage 1 of one group: the slices of g back to back are values v = 0..n-1;
 * grid (norm_blocks_for(n)), thread k sums v = k mod the grid's threads. */
__global__ void __launch_bounds__(NORM_THREADS) global_norm_partials_kernel(float* partials, const floatX* g, GradSlices slices) {
    __shared__ float scratch[33];
    const size_t stride = (size_t)gridDim.x * NORM_THREADS, k = (size_t)blockIdx.x * NORM_THREADS + threadIdx.x;
    float acc = 0.0f;
    size_t base = 0; /* v of the slice's first value */
    for (int s = 0; s < slices.n; s++) {
        for (size_t i = (k + stride - base % stride) % stride; i < slices.count[s]; i += stride) {
            float x = to_f32(g[slices.offset[s] + i]);
#if PRECISION_IS_FP16
            if (fabsf(x) >= 65504.0f) x = INFINITY; /* max finite counts as overflow (NaN fails the test, stays NaN) */
#endif
            acc += x * x;
        }
        base += slices.count[s];
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

/* One block: *out = in[0] + ... + in[n-1] in a fixed tree (stages 2 and 3). */
__global__ void __launch_bounds__(NORM_THREADS) global_norm_sum_kernel(float* out, const float* in, int n) {
    __shared__ float scratch[33];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n; i += NORM_THREADS) acc += in[i];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) *out = acc;
}

/* Stage 1's blocks for n values: at most NORM_BLOCKS, none idle (a layer's
 * small group does not launch a grid made for the largest). */
static inline unsigned norm_blocks_for(size_t n) {
    size_t b = (n + NORM_THREADS - 1) / NORM_THREADS;
    return b < 1 ? 1u : b > NORM_BLOCKS ? (unsigned)NORM_BLOCKS : (unsigned)b;
}

/* Group `group`'s sum of squares into partials[NORM_GROUP_SUM(group)]: the
 * slices of g (element offsets from g) back to back. */
static inline void gpu_norm_group(float* partials, int group, const floatX* g, const GradSlices* s, cudaStream_t stream) {
    size_t n = 0;
    for (int j = 0; j < s->n; j++) n += s->count[j];
    unsigned blocks = norm_blocks_for(n);
    global_norm_partials_kernel<<<blocks, NORM_THREADS, 0, stream>>>(partials, g, *s);
    CUDA_CHECK_LAUNCH();
    global_norm_sum_kernel<<<1, NORM_THREADS, 0, stream>>>(partials + NORM_GROUP_SUM(group), partials, (int)blocks);
    CUDA_CHECK_LAUNCH();
}

/* Stage 3: the sums of groups 0..groups-1 into partials[NORM_BLOCKS] (device). */
static inline void gpu_norm_total(float* partials, int groups, cudaStream_t stream) {
    global_norm_sum_kernel<<<1, NORM_THREADS, 0, stream>>>(partials + NORM_BLOCKS, partials + NORM_GROUP_SUM(0), groups);
    CUDA_CHECK_LAUNCH();
}

/* n contiguous values as one group: leaves their sum of squares in
 * partials[NORM_BLOCKS] (device); the caller copies it back. */
static inline void gpu_global_norm_squared(float* partials, const floatX* grads, size_t n, cudaStream_t stream) {
    GradSlices s;
    memset(&s, 0, sizeof(s));
    s.n = 1;
    s.count[0] = n;
    gpu_norm_group(partials, 0, grads, &s, stream);
    gpu_norm_total(partials, 1, stream);
}

#endif
