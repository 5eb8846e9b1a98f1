/*
 * AdamW on the CPU reference, and the squared gradient norm it clips with;
 * the GPU's twins are in llmc/cuda/adamw.cuh and llmc/cuda/global_norm.cuh. Both
 * update fp32 moments and parameters element by element from the step's
 * settings (AdamWStep, llmc/core/optimizer.h). Needs `real` (cpu_real.h).
 */
#ifndef REMAT_CPU_ADAMW_H
#define REMAT_CPU_ADAMW_H

#include <math.h>
#include "../core/optimizer.h"
#include "cpu_real.h"

#define NORM_BLOCK 65536 /* fixed partition: the sum does not depend on threads */

/* The sum of g[i]^2 over n gradients, in fp64 per block, blocks in order. */
static double cpu_grad_sumsq(const real* g, size_t n) {
    size_t blocks = ceil_div(n, NORM_BLOCK);
    double total = 0;
    #pragma omp parallel for schedule(static) ordered
    for (size_t b = 0; b < blocks; b++) {
        size_t e = (b + 1) * NORM_BLOCK < n ? (b + 1) * NORM_BLOCK : n;
        double s = 0;
        for (size_t i = b * NORM_BLOCK; i < e; i++) s += (double)g[i] * (double)g[i];
        #pragma omp ordered
        total += s;
    }
    return total;
}

/* One AdamW step on parameters [lo, hi) of the layout pl (this rank's
 * shard; all of them without ZeRO): params, grads, adam_m and adam_v hold
 * the shard's from index 0 (element lo of the model at 0), whether in the
 * arena or in the host pool of --offload-optimizer; weight decay on the
 * tensors param_is_decayed names. */
static void cpu_adamw_update(real* params, const real* grads, float* adam_m, float* adam_v, const ParamLayout* pl, size_t lo, size_t hi,
                             const AdamWStep* s) {
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        size_t begin, end;
        if (!shard_slice(pl, t, lo, hi, &begin, &end)) continue;
        float wd = param_is_decayed(t) ? s->weight_decay : 0.0f;
        #pragma omp parallel for schedule(static)
        for (size_t i = begin; i < end; i++) {
            size_t k = i - lo; /* index into this rank's optimizer shard */
            float g = (float)grads[k] * s->grad_scale;
            float mm = s->beta1 * adam_m[k] + (1.0f - s->beta1) * g;
            float vv = s->beta2 * adam_v[k] + (1.0f - s->beta2) * g * g;
            adam_m[k] = mm;
            adam_v[k] = vv;
            float mhat = mm / s->bias_corr1, vhat = vv / s->bias_corr2;
            float p = (float)params[k];
            params[k] = (real)(p - s->lr * (mhat / (sqrtf(vhat) + s->eps) + wd * p));
        }
    }
}

#endif
