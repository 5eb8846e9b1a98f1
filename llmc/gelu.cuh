/*
 * GELU, tanh approximation, elementwise:
 *   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 * Shapes: x, out, d: n = N*4C floatX values (the MLP's hidden activations).
 *
 * Recompute (-r 1 and -r 2) calls the same forward kernel with the same launch
 * configuration, so the recomputed output equals the original bit for bit.
 * A cuBLASLt GELU epilogue would save a pass but computes GELU its own way;
 * selective recompute needs the one implementation below.
 *
 * Status: compiles, unverified on GPU.
 */
#ifndef REMAT_GELU_CUH
#define REMAT_GELU_CUH

#include "cuda_common.cuh"

#define GELU_SQRT_2_OVER_PI 0.7978845608028654f

/* out[i] = gelu(x[i]) */
__global__ void gelu_forward_kernel(floatX* out, const floatX* x, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = to_f32(x[i]);
    out[i] = from_f32<floatX>(0.5f * v * (1.0f + tanhf(GELU_SQRT_2_OVER_PI * (v + 0.044715f * v * v * v))));
}

/* d[i] *= gelu'(x[i]): d holds the output gradient on entry, the input gradient on exit. */
__global__ void gelu_backward_kernel(floatX* d, const floatX* x, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = to_f32(x[i]);
    float th = tanhf(GELU_SQRT_2_OVER_PI * (v + 0.044715f * v * v * v));
    float dudx = GELU_SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * v * v);
    float grad = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * dudx;
    d[i] = from_f32<floatX>(to_f32(d[i]) * grad);
}

static inline void gpu_gelu_forward(floatX* out, const floatX* x, size_t n, cudaStream_t stream) {
    gelu_forward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, x, n);
    CUDA_CHECK_LAUNCH();
}

static inline void gpu_gelu_backward(floatX* d, const floatX* x, size_t n, cudaStream_t stream) {
    gelu_backward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(d, x, n);
    CUDA_CHECK_LAUNCH();
}

#endif
