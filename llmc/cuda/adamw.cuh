/*
 * AdamW update, elementwise over one parameter tensor.
 *
 * Shapes: params, grads (n) floatX; master (n) fp32 or NULL; m, v (n) fp32.
 * The same arithmetic as the CPU reference:
 *   g = grad * grad_scale
 *   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
 *   p -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd p)
 * where p is the fp32 master weight when the run keeps them (-w 1), else the
 * parameter itself. BF16 parameters are written back with stochastic
 * rounding: the 16 bits dropped from the fp32 value are compared against 16
 * random bits that are a pure function of (seed, step, element index), so a
 * rerun or a resumed run rounds identically. FP16 parameters are rounded to
 * nearest even: fp16 keeps 11 significant bits (bf16 8), so with fp32 master
 * weights (-w 1, the default) nothing accumulates in fp16 and the rounding
 * bias of round-to-nearest is at most half an fp16 ulp of the current value,
 * never a sum of lost updates. (With -w 0 an update smaller than half an ulp
 * of its parameter is lost; keep -w 1 in FP16.) FP32 parameters are stored as is.
 * The kernel runs only after a finite gradient norm (the driver skips the
 * step otherwise), so grads hold no inf or NaN here.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_ADAMW_CUH
#define REMAT_ADAMW_CUH

#include "cuda_common.cuh"
#include "../core/rand.h"

#define SR_STREAM 0x5352000000000000ULL /* "SR": apart from the init streams (tensor ids) */

/* The element functions below run on the device (adamw_kernel) and on the
 * host (host_adamw, --offload-optimizer's update) and must give the same
 * bits on both: every multiply and add is written as one rounded operation
 * (on the device __fmul_rn and __fadd_rn, which nvcc never fuses into a
 * multiply-add; on the host plain operators, which the host compiler does
 * not contract for a target without FMA or under -ffp-contract=off), and the
 * bit casts go through memcpy on the host. */
#ifdef __CUDA_ARCH__
#define ADAMW_MUL(a, b) __fmul_rn((a), (b))
#define ADAMW_ADD(a, b) __fadd_rn((a), (b))
#define ADAMW_SUB(a, b) __fsub_rn((a), (b))
#else
#define ADAMW_MUL(a, b) ((a) * (b))
#define ADAMW_ADD(a, b) ((a) + (b))
#define ADAMW_SUB(a, b) ((a) - (b))
#endif

__host__ __device__ __forceinline__ uint32_t adamw_float_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
#endif
}

__host__ __device__ __forceinline__ float adamw_bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, 4);
    return x;
#endif
}

/* 32 random bits for element `index` at optimizer step `step`. */
__host__ __device__ __forceinline__ uint32_t sr_bits(uint64_t seed, int step, uint64_t index) {
    return (uint32_t)(rand_u64(seed, SR_STREAM + (uint64_t)step, index) >> 32);
}

/* Rounding to the storage type: for bf16, stochastic (rounds away from zero
 * with probability (dropped bits) / 2^16, else truncates; unbiased); fp16
 * round to nearest even (bits unused); fp32 exact. */
__host__ __device__ __forceinline__ floatX round_stochastic(float x, uint32_t bits) {
#if PRECISION_IS_FP32
    (void)bits;
    return x;
#elif PRECISION_IS_FP16
    (void)bits;
    return __float2half_rn(x);
#else
    uint32_t u = adamw_float_bits(x);
    if ((u & 0x7fffffffu) >= 0x7f800000u) return __float2bfloat16_rn(x); /* inf, nan */
    u = (u + (bits & 0xffffu)) & 0xffff0000u;
    return __float2bfloat16_rn(adamw_bits_float(u)); /* exact: the low 16 bits are zero */
#endif
}

/* The update of one element; p is the fp32 master weight or the parameter. */
__host__ __device__ __forceinline__ float adamw_element(float p, float grad, float* m, float* v, float lr, float beta1, float beta2,
                                                        float bc1, float bc2, float eps, float wd, float grad_scale) {
    float g = ADAMW_MUL(grad, grad_scale);
    float mm = ADAMW_ADD(ADAMW_MUL(beta1, *m), ADAMW_MUL(1.0f - beta1, g));
    float vv = ADAMW_ADD(ADAMW_MUL(beta2, *v), ADAMW_MUL(ADAMW_MUL(1.0f - beta2, g), g));
    *m = mm;
    *v = vv;
    float mhat = mm / bc1, vhat = vv / bc2;
    return ADAMW_SUB(p, ADAMW_MUL(lr, ADAMW_ADD(mhat / ADAMW_ADD(sqrtf(vhat), eps), ADAMW_MUL(wd, p))));
}

/* Thread t owns elements [t*VEC, t*VEC + VEC): VEC = XVEC (16 bytes of
 * params and grads, 2 (bf16/fp16) or 1 (fp32) 16-byte loads each of m, v and
 * master: 4 to 8 loads in flight) where every pointer is 16-byte aligned,
 * else 1; the last n % VEC elements are scalar. Elementwise, so the width
 * changes no bit. */
template <int VEC>
__global__ void adamw_kernel(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t n,
                             size_t first_index, float lr, float beta1, float beta2, float bc1, float bc2, float eps,
                             float wd, float grad_scale, uint64_t seed, int step) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    if (i + VEC <= n) {
        Vec<floatX, VEC> pv = vload<VEC>(params + i), gv = vload<VEC>(grads + i);
        float mv[VEC], vv[VEC], p[VEC];
        load_f32s<VEC>(mv, m + i);
        load_f32s<VEC>(vv, v + i);
        if (master) {
            load_f32s<VEC>(p, master + i);
        } else {
#pragma unroll
            for (int k = 0; k < VEC; k++) p[k] = to_f32(pv.v[k]);
        }
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            p[k] = adamw_element(p[k], to_f32(gv.v[k]), &mv[k], &vv[k], lr, beta1, beta2, bc1, bc2, eps, wd, grad_scale);
            pv.v[k] = round_stochastic(p[k], sr_bits(seed, step, first_index + i + k));
        }
        store_f32s<VEC>(m + i, mv);
        store_f32s<VEC>(v + i, vv);
        if (master) store_f32s<VEC>(master + i, p);
        vstore<VEC>(params + i, pv);
        return;
    }
    for (; i < n; i++) {
        float np = adamw_element(master ? master[i] : to_f32(params[i]), to_f32(grads[i]), &m[i], &v[i], lr, beta1, beta2, bc1,
                                 bc2, eps, wd, grad_scale);
        if (master) master[i] = np;
        params[i] = round_stochastic(np, sr_bits(seed, step, first_index + i));
    }
}

/* One tensor of n elements starting at element first_index of the parameter
 * buffer (the index keys the rounding bits). bc1, bc2: bias corrections. */
static inline void gpu_adamw(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t n, size_t first_index,
                             float lr, float beta1, float beta2, float bc1, float bc2, float eps, float wd, float grad_scale,
                             uint64_t seed, int step, cudaStream_t stream) {
    if (all_aligned16(params, master, grads, m, v))
        adamw_kernel<XVEC><<<grid_for(ceil_div(n, XVEC), 256), 256, 0, stream>>>(params, master, grads, m, v, n, first_index, lr, beta1,
                                                                               beta2, bc1, bc2, eps, wd, grad_scale, seed, step);
    else
        adamw_kernel<1><<<grid_for(n, 256), 256, 0, stream>>>(params, master, grads, m, v, n, first_index, lr, beta1, beta2, bc1, bc2,
                                                            eps, wd, grad_scale, seed, step);
    CUDA_CHECK_LAUNCH();
}

/* --offload-optimizer's update on the host (llmc/cuda/optimizer_offload.cuh):
 * the kernel's arithmetic element by element, so the bits are the device's.
 * Shapes: grads_params (n) floatX, in: the gradients, out: the updated
 * parameters in floatX (each element read before it is written); master (n)
 * fp32, or NULL when host_params (n) floatX holds the parameters (updated in
 * place; grads_params then gets a copy); m, v (n) fp32. first_index keys the
 * rounding bits as in gpu_adamw. OpenMP over elements: elementwise, so the
 * schedule changes no bit. */
static inline void host_adamw(floatX* grads_params, float* master, floatX* host_params, float* m, float* v, size_t n, size_t first_index,
                              float lr, float beta1, float beta2, float bc1, float bc2, float eps, float wd, float grad_scale,
                              uint64_t seed, int step) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float p = master ? master[i] : host_floatX_load(host_params, i);
        float np = adamw_element(p, host_floatX_load(grads_params, i), &m[i], &v[i], lr, beta1, beta2, bc1, bc2, eps, wd, grad_scale);
        floatX r = round_stochastic(np, sr_bits(seed, step, first_index + i));
        if (master) master[i] = np;
        else host_params[i] = r;
        grads_params[i] = r;
    }
}

#endif
