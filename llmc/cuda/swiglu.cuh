/*
 * SwiGLU, the Llama family's MLP activation, forward and backward.
 *
 * Shapes: fch (n, 2F) floatX rows [gate | up] (the FC matmul's output: its
 * weight is [gate; up] stacked, (2F, C)); out, dout (n, F) floatX.
 *   out = silu(gate) * up,   silu(g) = g / (1 + exp(-g))
 * The backward writes d gate = dout up silu'(gate) and d up = dout silu(gate)
 * over fch in place (as the CPU reference's swiglu_backward), each element
 * read before it is written: the FC matmul's backward reads them there.
 *
 * Access: thread t owns elements [t VEC, t VEC + VEC) of the flat (n, F)
 * product, so its gate and up are VEC consecutive elements of one fch row:
 * three 16-byte accesses (VEC = XVEC) where F is a multiple of XVEC and the
 * pointers are 16-byte aligned, else elements one at a time. Offsets in
 * size_t (n F and n 2F pass 2^31 on long sequences).
 *
 * Recompute (-r 1 and -r 2) calls the same forward kernel with the same
 * launch, so the recomputed product equals the original bit for bit.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_SWIGLU_CUH
#define REMAT_SWIGLU_CUH

#include "cuda_common.cuh"

#define SWIGLU_THREADS 256

__device__ __forceinline__ float swiglu_f(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* out (n, F) = silu(gate) * up from fch (n, 2F). */
template <int VEC>
__global__ void swiglu_forward_kernel(floatX* out, const floatX* fch, size_t n, int F) {
    size_t e = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (e >= n * (size_t)F) return;
    size_t row = e / (size_t)F, i = e % (size_t)F;
    const floatX* g = fch + row * 2 * (size_t)F + i;
    Vec<floatX, VEC> gv = vload<VEC>(g), uv = vload<VEC>(g + F), ov;
#pragma unroll
    for (int k = 0; k < VEC; k++) ov.v[k] = from_f32<floatX>(swiglu_f(to_f32(gv.v[k]), to_f32(uv.v[k])));
    vstore<VEC>(out + e, ov);
}

/* fch (n, 2F): [gate | up] on entry, [d gate | d up] on exit, from dout (n, F). */
template <int VEC>
__global__ void swiglu_backward_kernel(floatX* fch, const floatX* dout, size_t n, int F) {
    size_t e = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (e >= n * (size_t)F) return;
    size_t row = e / (size_t)F, i = e % (size_t)F;
    floatX* g = fch + row * 2 * (size_t)F + i;
    Vec<floatX, VEC> gv = vload<VEC>(g), uv = vload<VEC>(g + F), dv = vload<VEC>(dout + e), dg, du;
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        float x = to_f32(gv.v[k]), u = to_f32(uv.v[k]), d = to_f32(dv.v[k]);
        float sig = 1.0f / (1.0f + expf(-x)), silu = x * sig;
        dg.v[k] = from_f32<floatX>(d * u * sig * (1.0f + x * (1.0f - sig)));
        du.v[k] = from_f32<floatX>(d * silu);
    }
    vstore<VEC>(g, dg);
    vstore<VEC>(g + F, du);
}

/* Width XVEC when F is a multiple of it and the buffers are 16-byte aligned
 * (then every row's gate, up and product are), else 1. Elementwise: the
 * width changes no bit. */
static inline int swiglu_vector_ok(int F, const void* a, const void* b) { return F % XVEC == 0 && all_aligned16(a, b); }

static inline void gpu_swiglu_forward(floatX* out, const floatX* fch, size_t n, int F, cudaStream_t stream) {
    size_t elems = n * (size_t)F;
    if (swiglu_vector_ok(F, out, fch))
        swiglu_forward_kernel<XVEC><<<grid_for(elems / XVEC, SWIGLU_THREADS), SWIGLU_THREADS, 0, stream>>>(out, fch, n, F);
    else swiglu_forward_kernel<1><<<grid_for(elems, SWIGLU_THREADS), SWIGLU_THREADS, 0, stream>>>(out, fch, n, F);
    CUDA_CHECK_LAUNCH();
}

static inline void gpu_swiglu_backward(floatX* fch, const floatX* dout, size_t n, int F, cudaStream_t stream) {
    size_t elems = n * (size_t)F;
    if (swiglu_vector_ok(F, fch, dout))
        swiglu_backward_kernel<XVEC><<<grid_for(elems / XVEC, SWIGLU_THREADS), SWIGLU_THREADS, 0, stream>>>(fch, dout, n, F);
    else swiglu_backward_kernel<1><<<grid_for(elems, SWIGLU_THREADS), SWIGLU_THREADS, 0, stream>>>(fch, dout, n, F);
    CUDA_CHECK_LAUNCH();
}

#endif
