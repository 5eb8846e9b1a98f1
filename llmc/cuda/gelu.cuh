/*
 * GELU, tanh approximation, elementwise:
 *   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 * Shapes: x, out, d: n = N*4C floatX values (the MLP's hidden activations),
 * flat. Vector width XVEC (16 bytes: 8 bf16/fp16, 4 fp32) per thread, the
 * last n % XVEC elements scalar; width 1 when a pointer is not 16-byte aligned.
 *
 * Recompute (-r 1 and -r 2) calls the same forward kernel with the same launch
 * configuration, so the recomputed output equals the original bit for bit.
 * A cuBLASLt GELU epilogue would save a pass but computes GELU its own way;
 * selective recompute needs the one implementation below.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_GELU_CUH
#define REMAT_GELU_CUH

#include "cuda_common.cuh"

#define GELU_SQRT_2_OVER_PI 0.7978845608028654f

__device__ __forceinline__ float gelu_f(float v) {
    return 0.5f * v * (1.0f + tanhf(GELU_SQRT_2_OVER_PI * (v + 0.044715f * v * v * v)));
}

__device__ __forceinline__ float gelu_grad_f(float v) {
    float th = tanhf(GELU_SQRT_2_OVER_PI * (v + 0.044715f * v * v * v));
    float dudx = GELU_SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * v * v);
    return 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * dudx;
}

#define GELU_THREADS 256

/* out[i] = gelu(x[i]). Thread t owns elements [t*VEC, t*VEC + VEC): one
 * VEC-wide load and store (VEC = XVEC: 16 bytes), or, for the last partial
 * group when n is no multiple of VEC, plain scalar accesses. */
template <int VEC>
__global__ void gelu_forward_kernel(floatX* out, const floatX* x, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    if (i + VEC <= n) {
        Vec<floatX, VEC> a = vload<VEC>(x + i), o;
#pragma unroll
        for (int k = 0; k < VEC; k++) o.v[k] = from_f32<floatX>(gelu_f(to_f32(a.v[k])));
        vstore<VEC>(out + i, o);
    } else {
        for (; i < n; i++) out[i] = from_f32<floatX>(gelu_f(to_f32(x[i])));
    }
}

/* d[i] *= gelu'(x[i]): d holds the output gradient on entry, the input
 * gradient on exit. Layout as gelu_forward_kernel: two VEC-wide loads in
 * flight per thread (d and x), one store. */
template <int VEC>
__global__ void gelu_backward_kernel(floatX* d, const floatX* x, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    if (i + VEC <= n) {
        Vec<floatX, VEC> a = vload<VEC>(x + i), g = vload<VEC>(d + i);
#pragma unroll
        for (int k = 0; k < VEC; k++) g.v[k] = from_f32<floatX>(to_f32(g.v[k]) * gelu_grad_f(to_f32(a.v[k])));
        vstore<VEC>(d + i, g);
    } else {
        for (; i < n; i++) d[i] = from_f32<floatX>(to_f32(d[i]) * gelu_grad_f(to_f32(x[i])));
    }
}

/* Width XVEC where both buffers are 16-byte aligned (the plan aligns every
 * buffer to 256 bytes), else 1. Elementwise, so the width changes no bit. */
static inline void gpu_gelu_forward(floatX* out, const floatX* x, size_t n, cudaStream_t stream) {
    if (all_aligned16(out, x)) gelu_forward_kernel<XVEC><<<grid_for(ceil_div(n, XVEC), GELU_THREADS), GELU_THREADS, 0, stream>>>(out, x, n);
    else gelu_forward_kernel<1><<<grid_for(n, GELU_THREADS), GELU_THREADS, 0, stream>>>(out, x, n);
    CUDA_CHECK_LAUNCH();
}

static inline void gpu_gelu_backward(floatX* d, const floatX* x, size_t n, cudaStream_t stream) {
    if (all_aligned16(d, x)) gelu_backward_kernel<XVEC><<<grid_for(ceil_div(n, XVEC), GELU_THREADS), GELU_THREADS, 0, stream>>>(d, x, n);
    else gelu_backward_kernel<1><<<grid_for(n, GELU_THREADS), GELU_THREADS, 0, stream>>>(d, x, n);
    CUDA_CHECK_LAUNCH();
}

#endif
