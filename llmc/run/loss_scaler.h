/*
 * Dynamic loss scaling for FP16 training, as a host-side state machine.
 *
 * FP16 gradients underflow unless the loss is multiplied by a large scale
 * before backward. The scale adapts: a step whose gradients hold inf or NaN
 * is skipped and the scale halved; after `growth_interval` clean steps in a
 * row the scale doubles. The state (scale, clean steps) is saved in
 * checkpoints so a resumed run scales exactly as an uninterrupted one.
 */
#ifndef REMAT_LOSS_SCALER_H
#define REMAT_LOSS_SCALER_H

#include <math.h>

typedef struct {
    int enabled;
    float scale;
    int clean_steps;     /* finite steps since the last change of scale */
    int growth_interval;
    float min_scale, max_scale;
} LossScaler;

#define LOSS_SCALE_INIT 65536.0f
#define LOSS_SCALE_GROWTH_INTERVAL 2000

static inline void loss_scaler_init(LossScaler* s, int enabled) {
    s->enabled = enabled;
    s->scale = enabled ? LOSS_SCALE_INIT : 1.0f;
    s->clean_steps = 0;
    s->growth_interval = LOSS_SCALE_GROWTH_INTERVAL;
    s->min_scale = 1.0f;
    s->max_scale = 16777216.0f; /* 2^24: beyond it fp16 gradients overflow at once */
}

/* The factor the loss gradient is multiplied by this step. */
static inline float loss_scaler_factor(const LossScaler* s) { return s->enabled ? s->scale : 1.0f; }

/* Records a step's outcome; returns 1 when its update should be applied,
 * 0 when it must be skipped (non-finite gradients under scaling). */
static inline int loss_scaler_update(LossScaler* s, int grads_finite) {
    if (!s->enabled) return 1;
    if (!grads_finite) {
        s->scale = s->scale * 0.5f < s->min_scale ? s->min_scale : s->scale * 0.5f;
        s->clean_steps = 0;
        return 0;
    }
    if (++s->clean_steps >= s->growth_interval) {
        s->scale = s->scale * 2.0f > s->max_scale ? s->max_scale : s->scale * 2.0f;
        s->clean_steps = 0;
    }
    return 1;
}

#endif
