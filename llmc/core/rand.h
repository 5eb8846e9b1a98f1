/*
 * Counter-based random numbers.
 *
 * Every random value is a pure function of (seed, stream, index), so parameter
 * init is independent of thread count and chunking, and anything random that
 * a recomputed block needs can be drawn again without saving generator state.
 * The mixer is SplitMix64's finaliser, applied twice with the stream folded in.
 */
#ifndef REMAT_RAND_H
#define REMAT_RAND_H

#include <math.h>
#include <stdint.h>

/* Callable from CUDA kernels too (stochastic rounding draws the same way). */
#ifdef __CUDACC__
#define REMAT_HOST_DEVICE __host__ __device__
#else
#define REMAT_HOST_DEVICE
#endif

REMAT_HOST_DEVICE static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

REMAT_HOST_DEVICE static inline uint64_t rand_u64(uint64_t seed, uint64_t stream, uint64_t index) {
    uint64_t h = mix64(seed + 0x9e3779b97f4a7c15ULL * (stream + 1));
    return mix64(h ^ (index * 0xd1b54a32d192ed03ULL + 0x632be59bd9b4e019ULL));
}

/* Uniform in [0, 1) with 24 random bits, exactly representable in fp32. */
static inline float rand_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    return (float)(rand_u64(seed, stream, index) >> 40) * (1.0f / 16777216.0f);
}

/* Standard normal by Box-Muller on two uniforms in (0, 1]; computed in double
 * so the result does not depend on the float math library's accuracy. */
static inline float rand_normal(uint64_t seed, uint64_t stream, uint64_t index) {
    uint64_t a = rand_u64(seed, stream, 2 * index), b = rand_u64(seed, stream, 2 * index + 1);
    double u1 = ((double)(a >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = (double)(b >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

#endif
