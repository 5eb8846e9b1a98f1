/*
 * Learning-rate schedules. Step numbers are 0-based optimizer steps.
 * Warmup rises linearly to the peak over `warmup` steps; then cosine or linear
 * decay reaches peak * final_frac at the last step; constant stays at peak.
 */
#ifndef REMAT_SCHEDULE_H
#define REMAT_SCHEDULE_H

#include <math.h>
#include <string.h>

static inline float learning_rate(const char* schedule, float peak, float final_frac, int warmup, int step, int total_steps) {
    if (step < warmup) return peak * (float)(step + 1) / (float)warmup;
    if (strcmp(schedule, "constant") == 0 || total_steps <= warmup + 1) return peak;
    double progress = (double)(step - warmup) / (double)(total_steps - 1 - warmup);
    if (progress > 1.0) progress = 1.0;
    double floor_lr = (double)peak * final_frac;
    double shape = strcmp(schedule, "cosine") == 0 ? 0.5 * (1.0 + cos(M_PI * progress)) : 1.0 - progress;
    return (float)(floor_lr + ((double)peak - floor_lr) * shape);
}

#endif
