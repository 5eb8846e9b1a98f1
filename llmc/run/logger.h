/*
 * Machine-readable training log: DIR/log.jsonl, one JSON object per line.
 *
 * Each line goes out in one write() and is checked: a failed or short write
 * is cut back off the file (ftruncate to the end of the last whole line), so
 * the log stays line-valid; the first failure is reported once on stderr and
 * later lines are still tried. A fresh run starts the log empty; a resumed
 * run at step S first drops the lines a resume re-runs (train lines after S,
 * validation lines from S on, a partial last line), so every step is logged
 * once.
 */
#ifndef REMAT_LOGGER_H
#define REMAT_LOGGER_H

#include <math.h>
#include "../core/utils.h"

typedef struct {
    int fd;           /* -1: no log */
    off_t good_bytes; /* end of the last whole line */
    int failures;     /* lines lost to failed writes */
    char path[4200];
} Logger;

/* Whether a line of an earlier run's log survives a resume at `step`. */
/* `line` is NUL-terminated, n bytes long. */
static inline int logger_line_kept(const char* line, size_t n, int step) {
    int s, key_at = 0;
    if (n == 0 || line[n - 1] != '\n' || sscanf(line, "{\"step\": %d, %n", &s, &key_at) != 1 || key_at == 0) return 0;
    /* validation lines (val_loss, val_loss_by_position) at the resume step
     * are written again by the resumed run's evaluation there */
    int is_val = strncmp(line + key_at, "\"val_loss", 9) == 0;
    return is_val ? s < step : s <= step;
}

/* Rewrites the log with only the lines kept at a resume from `step`. */
static inline void logger_trim(const char* path, int step) {
    FILE* in = fopen(path, "rb");
    if (!in) return;
    AtomicFile af;
    atomic_open(&af, path);
    char* line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, in)) > 0)
        if (logger_line_kept(line, (size_t)n, step)) fwrite_check(line, 1, (size_t)n, af.f, af.tmp_path);
    free(line);
    fclose(in);
    atomic_commit(&af);
}

/* resume_step < 0: a fresh run (the log starts empty). */
static inline void logger_open(Logger* lg, const char* dir, int resume_step) {
    lg->fd = -1;
    lg->failures = 0;
    if (!dir || !dir[0]) return;
    snprintf(lg->path, sizeof(lg->path), "%s/log.jsonl", dir);
    if (resume_step >= 0) logger_trim(lg->path, resume_step);
    lg->fd = open(lg->path, O_WRONLY | O_CREAT | O_APPEND | (resume_step < 0 ? O_TRUNC : 0), 0644);
    if (lg->fd < 0) fail("%s: cannot open (%s)", lg->path, strerror(errno));
    lg->good_bytes = lseek(lg->fd, 0, SEEK_END);
}

static inline void logger_write_line(Logger* lg, const char* line, size_t len) {
    /* a line cut short (the file size limit falls inside it) is cut back off below */
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(lg->fd, line + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        done += (size_t)w;
    }
    if (done == len) { lg->good_bytes += (off_t)len; return; }
    int err = errno;
    if (ftruncate(lg->fd, lg->good_bytes) != 0) { /* the next whole line still starts after a partial one */ }
    if (lg->failures++ == 0)
        fprintf(stderr, "warning: %s: write failed (%s): this line is lost, later ones are still tried (reported once)\n",
                lg->path, write_error_why(err ? err : ENOSPC));
}

static inline void logger_printf(Logger* lg, const char* fmt, ...) REMAT_PRINTF(2, 3);
static inline void logger_printf(Logger* lg, const char* fmt, ...) {
    if (lg->fd < 0) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n > 0 && (size_t)n < sizeof(line)) logger_write_line(lg, line, (size_t)n);
}

/* v with 9 significant digits, or null where it is not finite: JSON has no
 * NaN or infinity (printf's nan and inf would make the line unreadable to a
 * strict parser). The console line shows the value itself. */
typedef struct { char s[32]; } JsonNumber;
static inline JsonNumber json_number(double v) {
    JsonNumber j;
    if (isfinite(v)) snprintf(j.s, sizeof(j.s), "%.9g", v);
    else snprintf(j.s, sizeof(j.s), "null");
    return j;
}

/* tokens: trained on so far (all processes); memory_mib: device memory in
 * use on the GPU, peak resident memory on the CPU. */
static inline void logger_train(Logger* lg, int step, float loss, float lr, float norm, double ms, double tokens_per_s,
                                long long tokens, double memory_mib) {
    logger_printf(lg, "{\"step\": %d, \"loss\": %s, \"lr\": %.9g, \"norm\": %s, \"ms\": %.3f, \"tokens_per_s\": %.1f, "
                  "\"tokens\": %lld, \"memory_mib\": %.1f}\n", step, json_number(loss).s, (double)lr, json_number(norm).s, ms,
                  tokens_per_s, tokens, memory_mib);
}

static inline void logger_val(Logger* lg, int step, float val_loss) {
    logger_printf(lg, "{\"step\": %d, \"val_loss\": %s}\n", step, json_number(val_loss).s);
}

/* --eval-by-position: bucket i covers positions [begin[i], end[i]). */
static inline void logger_val_by_position(Logger* lg, int step, int n, const int* begin, const int* end, const float* loss,
                                          const float* top1, const double* tokens) {
    if (lg->fd < 0) return;
    char line[32768];
    size_t used = (size_t)snprintf(line, sizeof(line), "{\"step\": %d, \"val_loss_by_position\": [", step);
    for (int i = 0; i < n && used < sizeof(line); i++)
        used += (size_t)snprintf(line + used, sizeof(line) - used, "%s{\"begin\": %d, \"end\": %d, \"loss\": %s, \"top1\": %s, \"tokens\": %.0f}",
                                 i ? ", " : "", begin[i], end[i], json_number(loss[i]).s, json_number(top1[i]).s, tokens[i]);
    if (used < sizeof(line)) used += (size_t)snprintf(line + used, sizeof(line) - used, "]}\n");
    if (used < sizeof(line)) logger_write_line(lg, line, used); /* a line too long to be whole is not written at all */
}

static inline void logger_event(Logger* lg, int step, const char* event) {
    logger_printf(lg, "{\"step\": %d, \"event\": \"%s\"}\n", step, event);
}

static inline void logger_close(Logger* lg) {
    if (lg->fd >= 0) {
        if (lg->failures > 1) fprintf(stderr, "warning: %s: %d lines lost to failed writes\n", lg->path, lg->failures);
        close(lg->fd);
    }
    lg->fd = -1;
}

#endif
