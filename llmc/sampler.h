/*
 * Sampling the next token from a probability vector. The random number for
 * token i of the sample taken at step s is a pure function of (seed, s, i),
 * so a resumed run samples exactly what an uninterrupted one would.
 */
#ifndef REMAT_SAMPLER_H
#define REMAT_SAMPLER_H

#include "rand.h"

#define SAMPLER_STREAM 0x53414d50ULL

/* Inverse-CDF draw: the first index whose cumulative probability exceeds u. */
static inline int sample_token(const float* probs, int n, float u) {
    float cdf = 0.0f;
    for (int i = 0; i < n; i++) {
        cdf += probs[i];
        if (u < cdf) return i;
    }
    return n - 1; /* rounding left the total just under u */
}

static inline float sampler_uniform(uint64_t seed, int step, int i) {
    return rand_uniform(seed, SAMPLER_STREAM, ((uint64_t)step << 32) | (uint32_t)i);
}

#endif
