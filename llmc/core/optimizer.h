/*
 * One AdamW step's settings, as the driver (run/trainer.h) hands them to a
 * backend's update (cpu/cpu_adamw.h, cuda/adamw.cuh).
 */
#ifndef REMAT_OPTIMIZER_H
#define REMAT_OPTIMIZER_H

#include <math.h>

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    float grad_scale; /* gradients are multiplied by this first (clipping) */
    int t;            /* 1-based optimizer step, for bias correction */
    float bias_corr1, bias_corr2; /* 1 - beta1^t, 1 - beta2^t (computed in double) */
} AdamWStep;

/* Sets s->bias_corr1, s->bias_corr2 from beta1, beta2 and t. */
static inline void adamw_bias_corrections(AdamWStep* s) {
    s->bias_corr1 = (float)(1.0 - pow((double)s->beta1, s->t));
    s->bias_corr2 = (float)(1.0 - pow((double)s->beta2, s->t));
}

#endif
