/*
 * Checkpoints in the output directory, one set per saved step N:
 *   model_%08d.bin        the model (FORMATS.md), written by rank 0
 *   state_%08d_%05d.bin   each rank's training state (layout below)
 *   DONE_%08d             empty marker, written last
 * Every file goes to a temporary name and is renamed into place, and resume
 * only considers steps whose DONE marker exists, so a crash mid-write can
 * never be mistaken for a complete checkpoint.
 *
 * State file: a header of 256 int32 (slots below, unused ones zero), then
 * fp32 payloads: AdamW m and v for this rank's shard of the parameters, then
 * the fp32 master weights of that shard when the run keeps them.
 */
#ifndef REMAT_CHECKPOINT_H
#define REMAT_CHECKPOINT_H

#include <dirent.h>
#include "utils.h"
#include "dataloader.h"

#define STATE_MAGIC 20240527
#define STATE_VERSION 1

enum {
    ST_MAGIC, ST_VERSION, ST_STEP, ST_WORLD, ST_RANK, ST_ZERO, ST_HAS_MASTER, ST_B, ST_T,
    ST_EPOCH, ST_SHARD_POS, ST_BATCH_POS_LO, ST_BATCH_POS_HI, ST_PARAMS_LO, ST_PARAMS_HI,
    ST_SHARD_LO, ST_SHARD_HI, ST_LOSS_SCALE_BITS, ST_CLEAN_STEPS, ST_SHARD_START_LO, ST_SHARD_START_HI, ST_UPDATES
};

typedef struct {
    int step, world, rank, zero_stage, has_master, B, T;
    DataLoaderState loader;
    size_t num_params, shard_params, shard_start;
    float loss_scale;
    int clean_steps;
    int updates;       /* optimizer updates applied: AdamW's bias-correction step */
} TrainState;

static inline void put64(int32_t* h, int lo, uint64_t v) { h[lo] = (int32_t)(uint32_t)v; h[lo + 1] = (int32_t)(uint32_t)(v >> 32); }
static inline uint64_t get64(const int32_t* h, int lo) { return (uint64_t)(uint32_t)h[lo] | ((uint64_t)(uint32_t)h[lo + 1] << 32); }

static inline void state_header_write(FILE* f, const TrainState* s, const char* path) {
    int32_t h[256];
    memset(h, 0, sizeof(h));
    h[ST_MAGIC] = STATE_MAGIC; h[ST_VERSION] = STATE_VERSION; h[ST_STEP] = s->step;
    h[ST_WORLD] = s->world; h[ST_RANK] = s->rank; h[ST_ZERO] = s->zero_stage; h[ST_HAS_MASTER] = s->has_master;
    h[ST_B] = s->B; h[ST_T] = s->T;
    h[ST_EPOCH] = s->loader.epoch; h[ST_SHARD_POS] = s->loader.shard_pos;
    put64(h, ST_BATCH_POS_LO, (uint64_t)s->loader.batch_pos);
    put64(h, ST_PARAMS_LO, s->num_params);
    put64(h, ST_SHARD_LO, s->shard_params);
    put64(h, ST_SHARD_START_LO, s->shard_start);
    memcpy(&h[ST_LOSS_SCALE_BITS], &s->loss_scale, 4);
    h[ST_CLEAN_STEPS] = s->clean_steps;
    h[ST_UPDATES] = s->updates;
    fwrite_check(h, sizeof(int32_t), 256, f, path);
}

/* Range checks of every header field, before any is used as a size or index
 * (the comparison with this run comes later, in the trainer). */
static inline void state_header_check(const TrainState* s, const char* path) {
    if (s->step < 0) fail("%s: negative step %d in the header", path, s->step);
    if (s->world < 1 || s->world > 65536 || s->rank < 0 || s->rank >= s->world)
        fail("%s: rank %d of %d processes out of range in the header", path, s->rank, s->world);
    if ((s->zero_stage != 0 && s->zero_stage != 1) || (s->has_master != 0 && s->has_master != 1))
        fail("%s: ZeRO stage %d or master-weight flag %d out of range in the header", path, s->zero_stage, s->has_master);
    if (s->B < 1 || s->T < 1) fail("%s: batch B=%d T=%d out of range in the header", path, s->B, s->T);
    if (s->loader.epoch < 0 || s->loader.shard_pos < 0 || s->loader.batch_pos < 0)
        fail("%s: negative dataloader position in the header", path);
    if (s->num_params == 0 || s->num_params > ((size_t)1 << 40) || s->shard_params > s->num_params ||
        s->shard_start > s->num_params - s->shard_params)
        fail("%s: parameter count %zu or shard [%zu, +%zu) out of range in the header", path, s->num_params, s->shard_start,
             s->shard_params);
}

/* Reads and checks a state header; the stream is left at the payload. */
static inline FILE* state_open(const char* path, TrainState* s) {
    FILE* f = fopen_check(path, "rb");
    int32_t h[256];
    if (fread(h, sizeof(int32_t), 256, f) != 256) fail("%s: too short for a state file header", path);
    if (h[ST_MAGIC] != STATE_MAGIC) fail("%s: bad magic %d (expected %d: not a state file)", path, h[ST_MAGIC], STATE_MAGIC);
    if (h[ST_VERSION] != STATE_VERSION) fail("%s: unsupported state version %d (expected %d)", path, h[ST_VERSION], STATE_VERSION);
    s->step = h[ST_STEP]; s->world = h[ST_WORLD]; s->rank = h[ST_RANK]; s->zero_stage = h[ST_ZERO];
    s->has_master = h[ST_HAS_MASTER]; s->B = h[ST_B]; s->T = h[ST_T];
    s->loader.epoch = h[ST_EPOCH]; s->loader.shard_pos = h[ST_SHARD_POS];
    s->loader.batch_pos = (int64_t)get64(h, ST_BATCH_POS_LO);
    s->num_params = get64(h, ST_PARAMS_LO);
    s->shard_params = get64(h, ST_SHARD_LO);
    s->shard_start = get64(h, ST_SHARD_START_LO);
    memcpy(&s->loss_scale, &h[ST_LOSS_SCALE_BITS], 4);
    s->clean_steps = h[ST_CLEAN_STEPS];
    s->updates = h[ST_UPDATES];
    state_header_check(s, path);
    size_t expected = 1024 + s->shard_params * 4 * (2 + (size_t)(s->has_master != 0));
    size_t actual = file_size_check(f, path);
    if (actual != expected) fail("%s: size %zu bytes does not match its header (expected %zu)", path, actual, expected);
    return f;
}

static inline void checkpoint_path(char* buf, size_t n, const char* dir, const char* kind, int step, int rank) {
    if (rank >= 0) snprintf(buf, n, "%s/%s_%08d_%05d.bin", dir, kind, step, rank);
    else if (strcmp(kind, "DONE") == 0) snprintf(buf, n, "%s/DONE_%08d", dir, step);
    else snprintf(buf, n, "%s/%s_%08d.bin", dir, kind, step);
}

/* The latest step with a DONE marker in dir, or -1. */
static inline int checkpoint_latest(const char* dir) {
    DIR* d = opendir(dir);
    if (!d) return -1;
    int best = -1;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int step;
        char tail;
        if (strncmp(e->d_name, "DONE_", 5) == 0 && strlen(e->d_name) == 13 && sscanf(e->d_name + 5, "%8d%c", &step, &tail) == 1 && step > best)
            best = step;
    }
    closedir(d);
    return best;
}

static inline void checkpoint_write_marker(const char* dir, int step) {
    char path[4200];
    checkpoint_path(path, sizeof(path), dir, "DONE", step, -1);
    AtomicFile af;
    atomic_open(&af, path);
    atomic_commit(&af);
}

#endif
