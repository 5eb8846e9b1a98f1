/*
 * RoPE's per-pair frequencies from a configuration (host code both trainers
 * use: the CPU reference's rope_rotate and the GPU's llmc/cuda/rope.cuh turn
 * by the same table). In double: fp32 angles drift by about 0.06 rad at
 * position 10^6.
 */
#ifndef REMAT_ROPE_H
#define REMAT_ROPE_H

#include <math.h>
#include "model.h"

/* yarn's dimension index at which a wavelength fits `rotations` turns into the original context. */
static inline double yarn_correction_dim(double rotations, int dim, double base, double original_max) {
    return dim * log(original_max / (rotations * 2 * M_PI)) / (2 * log(base));
}

/* inv_freq (HD/2) and the attention factor of a configuration (transformers'
 * modeling_rope_utils semantics for default, linear, llama3 and yarn with
 * truncated correction bounds). */
static inline void rope_frequencies(const ModelConfig* c, double* inv_freq, double* mscale) {
    int half = c->head_size / 2, dim = c->head_size;
    double base = c->rope_theta, factor = c->rope_factor, orig = c->rope_original_max;
    *mscale = 1;
    for (int j = 0; j < half; j++) inv_freq[j] = 1.0 / pow(base, (double)(2 * j) / dim);
    if (c->rope_scaling == ROPE_LINEAR)
        for (int j = 0; j < half; j++) inv_freq[j] /= factor;
    if (c->rope_scaling == ROPE_LLAMA3) {
        /* long wavelengths (beyond orig / low) slow down by factor, short ones
         * (below orig / high) stay, those between ramp smoothly */
        double low_wavelen = orig / c->rope_low, high_wavelen = orig / c->rope_high;
        for (int j = 0; j < half; j++) {
            double wavelen = 2 * M_PI / inv_freq[j];
            if (wavelen > low_wavelen) inv_freq[j] /= factor;
            else if (wavelen >= high_wavelen) {
                double smooth = (orig / wavelen - c->rope_low) / (c->rope_high - c->rope_low);
                inv_freq[j] = (1 - smooth) * inv_freq[j] / factor + smooth * inv_freq[j];
            }
        }
    }
    if (c->rope_scaling == ROPE_YARN) {
        /* beta_fast (rope_low) and beta_slow (rope_high) turns bound the ramp
         * from extrapolated (unchanged) to interpolated (slowed by factor) */
        double lo = floor(yarn_correction_dim(c->rope_low, dim, base, orig));
        double hi = ceil(yarn_correction_dim(c->rope_high, dim, base, orig));
        if (lo < 0) lo = 0;
        if (hi > dim - 1) hi = dim - 1;
        if (lo == hi) hi += 0.001;
        for (int j = 0; j < half; j++) {
            double ramp = ((double)j - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extrapolate = 1 - ramp;
            inv_freq[j] = inv_freq[j] / factor * (1 - extrapolate) + inv_freq[j] * extrapolate;
        }
        *mscale = c->rope_attn_factor > 0 ? c->rope_attn_factor : factor <= 1 ? 1.0 : 0.1 * log(factor) + 1.0;
    }
}

#endif
