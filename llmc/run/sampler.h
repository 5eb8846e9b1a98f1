/*
 * Sampling the next token from a probability vector. The random number for
 * token i of the sample taken at step s is a pure function of (seed, s, i),
 * so a resumed run samples exactly what an uninterrupted one would.
 */
#ifndef REMAT_SAMPLER_H
#define REMAT_SAMPLER_H

#include <math.h>
#include <stdlib.h>
#include "../core/rand.h"

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

typedef struct {
    float prob;
    int token;
} SampleCandidate;

/* Descending probability, then ascending token: a total order, so the k most
 * probable are one set whatever qsort does with ties. */
static inline int by_probability_desc(const void* a, const void* b) {
    const SampleCandidate *x = (const SampleCandidate*)a, *y = (const SampleCandidate*)b;
    if (x->prob != y->prob) return x->prob > y->prob ? -1 : 1;
    return x->token < y->token ? -1 : 1;
}

/* The next token from probs[0..n): at temperature 0 the most probable (lowest
 * index among equals); otherwise a draw by u from probs^(1/temperature),
 * restricted to the top_k most probable (0: all) and renormalised.
 * `work` holds n candidates. */
static inline int sample_next(const float* probs, int n, float temperature, int top_k, float u, SampleCandidate* work) {
    if (temperature <= 0.0f) {
        int best = 0;
        for (int i = 1; i < n; i++) best = probs[i] > probs[best] ? i : best;
        return best;
    }
    if (temperature == 1.0f && (top_k <= 0 || top_k >= n)) return sample_token(probs, n, u);
    int kept = top_k > 0 && top_k < n ? top_k : n;
    for (int i = 0; i < n; i++) { work[i].prob = probs[i]; work[i].token = i; }
    if (kept < n) qsort(work, (size_t)n, sizeof(SampleCandidate), by_probability_desc);
    double pmax = 0.0, total = 0.0, inv_t = 1.0 / (double)temperature;
    for (int r = 0; r < kept; r++) pmax = work[r].prob > pmax ? work[r].prob : pmax;
    if (pmax <= 0.0) return work[0].token;
    for (int r = 0; r < kept; r++) total += pow((double)work[r].prob / pmax, inv_t);
    double target = (double)u * total, cdf = 0.0;
    int last = work[0].token;
    for (int r = 0; r < kept; r++) {
        double w = pow((double)work[r].prob / pmax, inv_t);
        if (w <= 0.0) continue;
        cdf += w;
        last = work[r].token;
        if (target < cdf) return last;
    }
    return last; /* rounding left the total just under target */
}

static inline float sampler_uniform(uint64_t seed, int step, int i) {
    return rand_uniform(seed, SAMPLER_STREAM, ((uint64_t)step << 32) | (uint32_t)i);
}

#endif
