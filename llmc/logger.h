/*
 * Machine-readable training log: DIR/log.jsonl, one JSON object per line,
 * flushed after every line so a crash loses at most the line being written.
 */
#ifndef REMAT_LOGGER_H
#define REMAT_LOGGER_H

#include "utils.h"

typedef struct {
    FILE* f;
    char path[4200];
} Logger;

static inline void logger_open(Logger* lg, const char* dir) {
    lg->f = NULL;
    if (!dir || !dir[0]) return;
    snprintf(lg->path, sizeof(lg->path), "%s/log.jsonl", dir);
    lg->f = fopen_check(lg->path, "a");
}

/* tokens: trained on so far (all processes); memory_mib: device memory in
 * use on the GPU, peak resident memory on the CPU. */
static inline void logger_train(Logger* lg, int step, float loss, float lr, float norm, double ms, double tokens_per_s,
                                long long tokens, double memory_mib) {
    if (!lg->f) return;
    fprintf(lg->f, "{\"step\": %d, \"loss\": %.9g, \"lr\": %.9g, \"norm\": %.9g, \"ms\": %.3f, \"tokens_per_s\": %.1f, "
            "\"tokens\": %lld, \"memory_mib\": %.1f}\n", step, (double)loss, (double)lr, (double)norm, ms, tokens_per_s, tokens, memory_mib);
    fflush(lg->f);
}

static inline void logger_val(Logger* lg, int step, float val_loss) {
    if (!lg->f) return;
    fprintf(lg->f, "{\"step\": %d, \"val_loss\": %.9g}\n", step, (double)val_loss);
    fflush(lg->f);
}

/* --eval-by-position: bucket i covers positions [begin[i], end[i]). */
static inline void logger_val_by_position(Logger* lg, int step, int n, const int* begin, const int* end, const float* loss,
                                          const double* tokens) {
    if (!lg->f) return;
    fprintf(lg->f, "{\"step\": %d, \"val_loss_by_position\": [", step);
    for (int i = 0; i < n; i++)
        fprintf(lg->f, "%s{\"begin\": %d, \"end\": %d, \"loss\": %.9g, \"tokens\": %.0f}", i ? ", " : "", begin[i], end[i],
                (double)loss[i], tokens[i]);
    fprintf(lg->f, "]}\n");
    fflush(lg->f);
}

static inline void logger_event(Logger* lg, int step, const char* event) {
    if (!lg->f) return;
    fprintf(lg->f, "{\"step\": %d, \"event\": \"%s\"}\n", step, event);
    fflush(lg->f);
}

static inline void logger_close(Logger* lg) {
    if (lg->f) fclose(lg->f);
    lg->f = NULL;
}

#endif
