/*
 * Gradients summed in fp32 across micro-steps and logits chunks (BF16 and
 * FP16 builds; plan.h decides which parameters, "grads_fp32").
 *
 * Why: a floatX gradient that is added to many times is rounded after every
 * addition, 8 significant bits in bf16, so small contributions are lost: the
 * token table's gradient gets one addition per 2048-row logits chunk (64 per
 * micro-step at B*T = 131072) and every gradient one per micro-step with -d.
 *
 * How: the token table's classifier part (fp32 matmul output) and its
 * embedding part (encoder backward) go straight into its fp32 sum. Every
 * other covered gradient is computed in floatX within one micro-step, as
 * without the sums (each kernel writes it once, from zero), and folded after its
 * layer's backward:
 *   not the last micro-step:  sum += g; g = 0   (g starts the next one at zero)
 *   the last micro-step:      g = floatX(sum + g), rounded once
 * so after the last micro-step the floatX gradients hold the fp32 total, and
 * the gradient all-reduce, norm and update read them as they do without
 * the sums. The fold runs
 * in the same place in every recompute setting, so the bits do not depend on
 * what is recomputed. Layout: sum[i] is parameter first + i's (the parameter
 * layout of model.h; plan->grads_fp32_first and grads_fp32_count: all of
 * them with micro-steps, else the classifier's table alone, wte from 0 when
 * tied, an untied lm_head at its own offset).
 *
 * Token tiles (plan.h's backward.tile_grads): a tiled layer's weight, bias
 * and LayerNorm gradients are summed over its tiles in one fp32 buffer (the
 * layer's 12 block tensors back to back, zeroed before the layer's first
 * tile) and added to the floatX gradients once, after its last tile
 * (gpu_grad_round_layer); the fold above then runs as without tiles.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_GRAD_ACCUM_CUH
#define REMAT_GRAD_ACCUM_CUH

#include "cuda_common.cuh"

/* At most this many slices are folded by one launch. */
#define GRAD_FOLD_MAX_SLICES 16

typedef struct {
    size_t offset[GRAD_FOLD_MAX_SLICES]; /* parameter index of each slice's first element */
    size_t count[GRAD_FOLD_MAX_SLICES];
    int n;
} GradSlices;

/* grid (ceil(max count / 256), n slices); one thread per element: g[k]
 * (parameter k) with sum[k - first]. */
__global__ void grad_fold_kernel(float* sum, size_t first, floatX* g, GradSlices slices, int last) {
    int s = blockIdx.y;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= slices.count[s]) return;
    size_t k = slices.offset[s] + i;
    float total = sum[k - first] + to_f32(g[k]);
    if (last) {
        g[k] = from_f32<floatX>(total);
    } else {
        sum[k - first] = total;
        g[k] = from_f32<floatX>(0.0f);
    }
}

/* Folds the slices of g (whole parameter indices; only their parts inside
 * the fp32 sums' range [first, first + count), the rest left alone) into
 * sum, which holds parameter first's sum at index 0. */
static inline void gpu_grad_fold(float* sum, size_t first, size_t count, floatX* g, const GradSlices* in, int last, cudaStream_t stream) {
    GradSlices s;
    memset(&s, 0, sizeof(s));
    size_t longest = 0, stop = first + count;
    for (int j = 0; j < in->n; j++) {
        size_t begin = in->offset[j] > first ? in->offset[j] : first;
        size_t end = in->offset[j] + in->count[j] < stop ? in->offset[j] + in->count[j] : stop;
        if (begin >= end) continue;
        if (s.n == GRAD_FOLD_MAX_SLICES) fail("internal: more than %d gradient slices in one fold", GRAD_FOLD_MAX_SLICES);
        s.offset[s.n] = begin;
        s.count[s.n] = end - begin;
        if (s.count[s.n] > longest) longest = s.count[s.n];
        s.n++;
    }
    if (s.n == 0) return;
    dim3 grid(grid_for(longest, 256), (unsigned)s.n);
    grad_fold_kernel<<<grid, 256, 0, stream>>>(sum, first, g, s, last);
    CUDA_CHECK_LAUNCH();
}

/* grid (ceil(max count / 256), n slices); one thread per element: slice s
 * of g (from its offset) += the fp32 sums packed back to back in `sums`
 * (slice s from the sum of the counts before it), rounded once. */
__global__ void grad_round_kernel(floatX* g, const float* sums, GradSlices slices) {
    int s = blockIdx.y;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= slices.count[s]) return;
    size_t packed = 0;
    for (int j = 0; j < s; j++) packed += slices.count[j];
    size_t k = slices.offset[s] + i;
    g[k] = from_f32<floatX>(to_f32(g[k]) + sums[packed + i]);
}

/* Adds a tiled layer's fp32 gradient sums (its slices packed in `sums`, in
 * slice order) into the floatX gradients. */
static inline void gpu_grad_round_layer(floatX* g, const float* sums, const GradSlices* s, cudaStream_t stream) {
    size_t longest = 0;
    for (int j = 0; j < s->n; j++) longest = s->count[j] > longest ? s->count[j] : longest;
    if (s->n == 0) return;
    dim3 grid(grid_for(longest, 256), (unsigned)s->n);
    grad_round_kernel<<<grid, 256, 0, stream>>>(g, sums, *s);
    CUDA_CHECK_LAUNCH();
}

#endif
