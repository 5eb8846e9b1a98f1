/*
 * Checkpoints in the output directory, one set per saved step N:
 *   model_%08d.bin        the model (docs/FORMATS.md), written by rank 0
 *   state_%08d_%05d.bin   each rank's training state (layout below)
 *   DONE_%08d             marker, written last: one line "run <id>"
 * Every file goes to a temporary name and is renamed into place (and the
 * directory fsynced after), and resume only considers steps whose DONE marker
 * exists, so a crash mid-write can never be mistaken for a complete checkpoint.
 * Every file of a checkpoint carries the 64-bit id of the run that wrote it
 * (model file: header slots 240-241, llm.c readers ignore them; state file:
 * ST_RUN_ID; DONE: its text), so files of two runs are never mixed on resume.
 *
 * State file: a header of 256 int32 (slots below, unused ones zero; the
 * device record from slot 200 on), then
 * fp32 payloads: AdamW m and v for this rank's shard of the parameters, then
 * the fp32 master weights of that shard when the run keeps them. Slots
 * ST_HPARAMS.. hold the hyperparameters resume compares (llmc/run/run_identity.h).
 * Version 3 added the training data's record (ST_DATA_*): the digest of the
 * shards' token counts, the digest of -i as typed and its first
 * STATE_DATA_TEXT_BYTES bytes (NUL-padded) for messages; a version 2 state
 * (all zeros there) still loads, its data unchecked.
 * ST_CONTEXT_PARALLEL: --context-parallel N of the run that wrote it, 0 for
 * N = 1 (files of runs without it are unchanged); a run resumes under
 * another N when it keeps the processes, T and the sequences per micro-step.
 */
#ifndef REMAT_CHECKPOINT_H
#define REMAT_CHECKPOINT_H

#include <dirent.h>
#include <sys/file.h>
#include "utils.h"
#include "loader_state.h"
#include "model.h"

#define STATE_MAGIC 20240527
#define STATE_VERSION 3
#define STATE_OLDEST_VERSION 2 /* before the data record */
#define STATE_DATA_TEXT_BYTES 256
#define MODEL_RUN_ID_SLOT 240
#define STATE_NUM_HPARAMS 32

enum {
    ST_MAGIC, ST_VERSION, ST_STEP, ST_WORLD, ST_RANK, ST_ZERO, ST_HAS_MASTER, ST_B, ST_T,
    ST_EPOCH, ST_SHARD_POS, ST_BATCH_POS_LO, ST_BATCH_POS_HI, ST_PARAMS_LO, ST_PARAMS_HI,
    ST_SHARD_LO, ST_SHARD_HI, ST_LOSS_SCALE_BITS, ST_CLEAN_STEPS, ST_SHARD_START_LO, ST_SHARD_START_HI, ST_UPDATES,
    ST_RUN_ID_LO, ST_RUN_ID_HI, ST_DATA_COUNTS_LO, ST_DATA_COUNTS_HI, ST_DATA_GLOB_LO, ST_DATA_GLOB_HI,
    ST_CONTEXT_PARALLEL = 30, ST_HPARAMS = 32, ST_DATA_TEXT = 64 /* to 127 */
};

/* The training data a run read (-i), as version 3 records it. */
typedef struct {
    uint64_t counts_digest; /* FNV-1a of the shards' token counts, in shard order; 0: not recorded */
    uint64_t glob_digest;   /* FNV-1a of -i as typed */
    char glob[STATE_DATA_TEXT_BYTES + 1]; /* -i as typed, cut at STATE_DATA_TEXT_BYTES */
} DataRecord;
/* The device record: name (64 bytes, NUL-padded), SM count, CUDA runtime,
 * cuBLASLt and NCCL versions (0 where not used). */
enum { ST_DEVICE_NAME = 200, ST_DEVICE_SMS = 216, ST_CUDA_RUNTIME, ST_CUBLASLT, ST_NCCL };

/* What a run computes on. Bitwise reproducibility (of a resume, of -r
 * settings against each other) holds for one GPU model and one set of
 * library versions: cuBLASLt picks its algorithms by GPU and version, and
 * NCCL its reduction order. An empty name: not recorded (an older state). */
typedef struct {
    char name[64];
    int sm_count, cuda_runtime, cublaslt, nccl;
} DeviceRecord;

static inline int device_record_equal(const DeviceRecord* a, const DeviceRecord* b) {
    return strncmp(a->name, b->name, sizeof(a->name)) == 0 && a->sm_count == b->sm_count && a->cuda_runtime == b->cuda_runtime &&
           a->cublaslt == b->cublaslt && a->nccl == b->nccl;
}

static inline void device_record_format(const DeviceRecord* d, char* buf, size_t n) {
    snprintf(buf, n, "%.64s, %d SMs, CUDA runtime %d, cuBLASLt %d, NCCL %d", d->name, d->sm_count, d->cuda_runtime, d->cublaslt, d->nccl);
}

typedef struct {
    int step, world, rank, zero_stage, has_master, B, T;
    int context_parallel; /* N, 1 without context parallelism */
    DataLoaderState loader;
    size_t num_params, shard_params, shard_start;
    float loss_scale;
    int clean_steps;
    int updates;       /* optimizer updates applied: AdamW's bias-correction step */
    DeviceRecord device;
    uint64_t run_id;
    int32_t hparams[STATE_NUM_HPARAMS];
    int version;
    DataRecord data;
} TrainState;

static inline void put64(int32_t* h, int lo, uint64_t v) { h[lo] = (int32_t)(uint32_t)v; h[lo + 1] = (int32_t)(uint32_t)(v >> 32); }
static inline uint64_t get64(const int32_t* h, int lo) { return (uint64_t)(uint32_t)h[lo] | ((uint64_t)(uint32_t)h[lo + 1] << 32); }

static inline void state_header_write(FILE* f, const TrainState* s, const char* path) {
    int32_t h[256];
    memset(h, 0, sizeof(h));
    h[ST_MAGIC] = STATE_MAGIC; h[ST_VERSION] = STATE_VERSION; h[ST_STEP] = s->step;
    h[ST_WORLD] = s->world; h[ST_RANK] = s->rank; h[ST_ZERO] = s->zero_stage; h[ST_HAS_MASTER] = s->has_master;
    h[ST_B] = s->B; h[ST_T] = s->T;
    h[ST_CONTEXT_PARALLEL] = s->context_parallel > 1 ? s->context_parallel : 0;
    h[ST_EPOCH] = s->loader.epoch; h[ST_SHARD_POS] = s->loader.shard_pos;
    put64(h, ST_BATCH_POS_LO, (uint64_t)s->loader.batch_pos);
    put64(h, ST_PARAMS_LO, s->num_params);
    put64(h, ST_SHARD_LO, s->shard_params);
    put64(h, ST_SHARD_START_LO, s->shard_start);
    memcpy(&h[ST_LOSS_SCALE_BITS], &s->loss_scale, 4);
    h[ST_CLEAN_STEPS] = s->clean_steps;
    h[ST_UPDATES] = s->updates;
    memcpy(&h[ST_DEVICE_NAME], s->device.name, sizeof(s->device.name));
    h[ST_DEVICE_SMS] = s->device.sm_count; h[ST_CUDA_RUNTIME] = s->device.cuda_runtime;
    h[ST_CUBLASLT] = s->device.cublaslt; h[ST_NCCL] = s->device.nccl;
    put64(h, ST_RUN_ID_LO, s->run_id);
    memcpy(&h[ST_HPARAMS], s->hparams, sizeof(s->hparams));
    put64(h, ST_DATA_COUNTS_LO, s->data.counts_digest);
    put64(h, ST_DATA_GLOB_LO, s->data.glob_digest);
    memcpy(&h[ST_DATA_TEXT], s->data.glob, strnlen(s->data.glob, STATE_DATA_TEXT_BYTES));
    fwrite_check(h, sizeof(int32_t), 256, f, path);
}

/* Range checks of every header field, before any is used as a size or index
 * (the comparison with this run comes later, in the trainer): 0, or -1 with
 * the reason in why[n]. */
static inline int state_header_problem(const TrainState* s, const char* path, char* why, size_t n) {
    if (s->step < 0) snprintf(why, n, "%s: negative step %d in the header", path, s->step);
    else if (s->world < 1 || s->world > 65536 || s->rank < 0 || s->rank >= s->world)
        snprintf(why, n, "%s: rank %d of %d processes out of range in the header", path, s->rank, s->world);
    else if ((s->zero_stage != 0 && s->zero_stage != 1) || (s->has_master != 0 && s->has_master != 1))
        snprintf(why, n, "%s: ZeRO stage %d or master-weight flag %d out of range in the header", path, s->zero_stage, s->has_master);
    else if (s->B < 1 || s->T < 1) snprintf(why, n, "%s: batch B=%d T=%d out of range in the header", path, s->B, s->T);
    else if (s->context_parallel < 1 || s->world % s->context_parallel != 0)
        snprintf(why, n, "%s: context-parallel degree %d does not divide the %d processes in the header", path, s->context_parallel,
                 s->world);
    else if (s->loader.epoch < 0 || s->loader.shard_pos < 0 || s->loader.batch_pos < 0)
        snprintf(why, n, "%s: negative dataloader position in the header", path);
    else if (s->num_params == 0 || s->num_params > ((size_t)1 << 40) || s->shard_params > s->num_params ||
             s->shard_start > s->num_params - s->shard_params)
        snprintf(why, n, "%s: parameter count %zu or shard [%zu, +%zu) out of range in the header", path, s->num_params,
                 s->shard_start, s->shard_params);
    else return 0;
    return -1;
}

static inline void state_header_read(const int32_t* h, TrainState* s) {
    memset(s, 0, sizeof(*s));
    s->version = h[ST_VERSION];
    s->data.counts_digest = get64(h, ST_DATA_COUNTS_LO);
    s->data.glob_digest = get64(h, ST_DATA_GLOB_LO);
    memcpy(s->data.glob, &h[ST_DATA_TEXT], STATE_DATA_TEXT_BYTES);
    s->data.glob[STATE_DATA_TEXT_BYTES] = '\0';
    s->step = h[ST_STEP]; s->world = h[ST_WORLD]; s->rank = h[ST_RANK]; s->zero_stage = h[ST_ZERO];
    s->has_master = h[ST_HAS_MASTER]; s->B = h[ST_B]; s->T = h[ST_T];
    s->context_parallel = h[ST_CONTEXT_PARALLEL] ? h[ST_CONTEXT_PARALLEL] : 1;
    s->loader.epoch = h[ST_EPOCH]; s->loader.shard_pos = h[ST_SHARD_POS];
    s->loader.batch_pos = (int64_t)get64(h, ST_BATCH_POS_LO);
    s->num_params = get64(h, ST_PARAMS_LO);
    s->shard_params = get64(h, ST_SHARD_LO);
    s->shard_start = get64(h, ST_SHARD_START_LO);
    memcpy(&s->loss_scale, &h[ST_LOSS_SCALE_BITS], 4);
    s->clean_steps = h[ST_CLEAN_STEPS];
    s->updates = h[ST_UPDATES];
    memcpy(s->device.name, &h[ST_DEVICE_NAME], sizeof(s->device.name));
    s->device.name[sizeof(s->device.name) - 1] = '\0';
    s->device.sm_count = h[ST_DEVICE_SMS]; s->device.cuda_runtime = h[ST_CUDA_RUNTIME];
    s->device.cublaslt = h[ST_CUBLASLT]; s->device.nccl = h[ST_NCCL];
    s->run_id = get64(h, ST_RUN_ID_LO);
    memcpy(s->hparams, &h[ST_HPARAMS], sizeof(s->hparams));
}

/* Reads and checks a state header and the file's size; the stream is left
 * at the payload. NULL, with the reason in why[n], when the file cannot be
 * opened or is not a whole state file. */
static inline FILE* state_try_open(const char* path, TrainState* s, char* why, size_t n) {
    int32_t h[256];
    FILE* f = header_file_open(path, h, "state file", why, n);
    if (!f) return NULL;
    if (h[ST_MAGIC] != STATE_MAGIC) {
        snprintf(why, n, "%s: bad magic %d (expected %d: not a state file)", path, h[ST_MAGIC], STATE_MAGIC);
        goto bad;
    }
    if (h[ST_VERSION] < STATE_OLDEST_VERSION || h[ST_VERSION] > STATE_VERSION) {
        snprintf(why, n, "%s: unsupported state version %d (expected %d to %d)", path, h[ST_VERSION], STATE_OLDEST_VERSION, STATE_VERSION);
        goto bad;
    }
    state_header_read(h, s);
    if (state_header_problem(s, path, why, n)) goto bad;
    return header_file_end(f, path, 1024 + s->shard_params * 4 * (2 + (size_t)(s->has_master != 0)), "", why, n);
bad:
    fclose(f);
    return NULL;
}

static inline FILE* state_open(const char* path, TrainState* s) {
    char why[4800];
    FILE* f = state_try_open(path, s, why, sizeof(why));
    if (!f) fail("%s", why);
    return f;
}

static inline void checkpoint_path(char* buf, size_t n, const char* dir, const char* kind, int step, int rank) {
    if (rank >= 0) snprintf(buf, n, "%s/%s_%08d_%05d.bin", dir, kind, step, rank);
    else if (strcmp(kind, "DONE") == 0) snprintf(buf, n, "%s/DONE_%08d", dir, step);
    else snprintf(buf, n, "%s/%s_%08d.bin", dir, kind, step);
}

/* The step of a file name kind_%08d<suffix> (exactly 8 digits), or -1. */
static inline int checkpoint_step_of_name(const char* name, const char* kind, const char* suffix) {
    size_t k = strlen(kind), n = strlen(name), sl = strlen(suffix);
    if (n != k + 9 + sl || strncmp(name, kind, k) != 0 || name[k] != '_' || strcmp(name + k + 9, suffix) != 0) return -1;
    int step = 0;
    for (size_t i = k + 1; i < k + 9; i++) {
        if (name[i] < '0' || name[i] > '9') return -1;
        step = step * 10 + (name[i] - '0');
    }
    return step;
}

/* The step of a state file name state_%08d_%05d.bin<suffix>, or -1. */
static inline int state_step_of_name(const char* name, const char* suffix) {
    size_t n = strlen(name), sl = strlen(suffix);
    if (n != 24 + sl || strncmp(name, "state_", 6) != 0 || name[14] != '_' || strncmp(name + 20, ".bin", 4) != 0 ||
        strcmp(name + 24, suffix) != 0)
        return -1;
    int step = 0;
    for (int i = 6; i < 20; i++) {
        if (i == 14) continue;
        if (name[i] < '0' || name[i] > '9') return -1;
        if (i < 14) step = step * 10 + (name[i] - '0');
    }
    return step;
}

/* The latest step with a DONE marker in dir, or -1. */
static inline int checkpoint_latest(const char* dir) {
    DIR* d = opendir(dir);
    if (!d) return -1;
    int best = -1;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int step = checkpoint_step_of_name(e->d_name, "DONE", "");
        if (step > best) best = step;
    }
    closedir(d);
    return best;
}

static inline void checkpoint_write_marker(const char* dir, int step, uint64_t run_id) {
    char path[4200];
    checkpoint_path(path, sizeof(path), dir, "DONE", step, -1);
    AtomicFile af;
    atomic_open(&af, path);
    if (fprintf(af.f, "run %016llx\n", (unsigned long long)run_id) < 0) fail("%s: write failed (%s)", af.tmp_path, strerror(errno));
    atomic_commit(&af);
}

/* The run id in a DONE marker's text "run <16 hex digits>\n". */
static inline int checkpoint_parse_marker(const char* text, size_t n, uint64_t* run_id) {
    if (n != 21 || memcmp(text, "run ", 4) != 0 || text[20] != '\n') return -1;
    uint64_t v = 0;
    for (int i = 4; i < 20; i++) {
        char c = text[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v << 4 | (uint64_t)d;
    }
    *run_id = v;
    return 0;
}

static inline uint64_t checkpoint_read_marker(const char* dir, int step) {
    char path[4200], text[64];
    checkpoint_path(path, sizeof(path), dir, "DONE", step, -1);
    FILE* f = fopen_check(path, "rb");
    size_t n = fread(text, 1, sizeof(text), f);
    fclose(f);
    uint64_t id = 0;
    if (checkpoint_parse_marker(text, n, &id) != 0) fail("%s: not a checkpoint marker (expected one line \"run <16 hex digits>\")", path);
    return id;
}

/* The run id in header slots [slot, slot+1] of a model or state file. */
static inline uint64_t checkpoint_file_run_id(const char* path, int slot) {
    FILE* f = fopen_check(path, "rb");
    int32_t h[256];
    if (fread(h, sizeof(int32_t), 256, f) != 256) fail("%s: too short for a header", path);
    fclose(f);
    return get64(h, slot);
}

/* Removes the files of checkpoint `step`: the DONE marker first (and the
 * directory synced), so an interrupted removal never leaves a checkpoint that
 * looks complete with files missing; then the model and every rank's state. */
static inline void checkpoint_remove(const char* dir, int step) {
    char path[4200];
    checkpoint_path(path, sizeof(path), dir, "DONE", step, -1);
    if (remove(path) != 0 && errno != ENOENT) fail("%s: cannot remove (%s)", path, strerror(errno));
    fsync_dir_of(path);
    DIR* d = opendir(dir);
    if (!d) fail("%s: cannot list (%s)", dir, strerror(errno));
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        if (checkpoint_step_of_name(e->d_name, "model", ".bin") != step && state_step_of_name(e->d_name, "") != step) continue;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (remove(path) != 0 && errno != ENOENT) fail("%s: cannot remove (%s)", path, strerror(errno));
    }
    closedir(d);
}

/* Steps of every checkpoint file (model, state, DONE) in dir, ascending, unique. */
static inline int checkpoint_steps(const char* dir, int* steps, int cap) {
    DIR* d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int step = checkpoint_step_of_name(e->d_name, "DONE", "");
        if (step < 0) step = checkpoint_step_of_name(e->d_name, "model", ".bin");
        if (step < 0) step = state_step_of_name(e->d_name, "");
        if (step < 0) continue;
        int i = 0;
        while (i < n && steps[i] < step) i++;
        if (i < n && steps[i] == step) continue;
        if (n == cap) fail("%s: more than %d checkpoints", dir, cap);
        memmove(steps + i + 1, steps + i, (size_t)(n - i) * sizeof(int));
        steps[i] = step;
        n++;
    }
    closedir(d);
    return n;
}

#define CHECKPOINT_MAX_LISTED 100000

/* Header slots of a state file that are the rank's own: its rank, its
 * ZeRO-1 shard and the device it ran on. Every other slot must be the same
 * in every rank's file of one checkpoint. */
static inline int state_slot_is_per_rank(int i) {
    return i == ST_RANK || (i >= ST_SHARD_LO && i <= ST_SHARD_HI) || i == ST_SHARD_START_LO || i == ST_SHARD_START_HI ||
           (i >= ST_DEVICE_NAME && i <= ST_NCCL);
}

static inline const char* state_slot_name(int i) {
    switch (i) {
    case ST_STEP: return "step";
    case ST_WORLD: return "number of processes";
    case ST_ZERO: return "ZeRO stage";
    case ST_HAS_MASTER: return "master-weight flag";
    case ST_B: return "B";
    case ST_T: return "T";
    case ST_EPOCH: return "data epoch";
    case ST_SHARD_POS: case ST_BATCH_POS_LO: case ST_BATCH_POS_HI: return "data position";
    case ST_PARAMS_LO: case ST_PARAMS_HI: return "parameter count";
    case ST_LOSS_SCALE_BITS: case ST_CLEAN_STEPS: return "loss scaler";
    case ST_UPDATES: return "AdamW update count";
    case ST_RUN_ID_LO: case ST_RUN_ID_HI: return "run id";
    case ST_CONTEXT_PARALLEL: return "context-parallel degree";
    case ST_DATA_COUNTS_LO: case ST_DATA_COUNTS_HI: case ST_DATA_GLOB_LO: case ST_DATA_GLOB_HI: return "data record";
    default:
        if (i >= ST_HPARAMS && i < ST_HPARAMS + STATE_NUM_HPARAMS) return "hyperparameter";
        return i >= ST_DATA_TEXT && i < ST_DATA_TEXT + STATE_DATA_TEXT_BYTES / 4 ? "data record" : "unused slot";
    }
}

/* State file `rank` of checkpoint `step` against its name, the run id of
 * its DONE marker and rank 0's header h0 (NULL for rank 0 itself): 0, or -1
 * with the disagreement in why[n]. */
static inline int state_disagrees(const char* path, int step, int rank, uint64_t run_id, const int32_t* h, const int32_t* h0,
                                  char* why, size_t n) {
    if (h[ST_STEP] != step || h[ST_RANK] != rank) {
        snprintf(why, n, "%s: step %d of rank %d in its header, its name says step %d of rank %d", path, h[ST_STEP], h[ST_RANK],
                 step, rank);
        return -1;
    }
    if (get64(h, ST_RUN_ID_LO) != run_id) {
        snprintf(why, n, "%s: written by run %016llx, its DONE marker names run %016llx: the checkpoint mixes two runs' files", path,
                 (unsigned long long)get64(h, ST_RUN_ID_LO), (unsigned long long)run_id);
        return -1;
    }
    for (int i = 0; h0 && i < 256; i++)
        if (!state_slot_is_per_rank(i) && h[i] != h0[i]) {
            snprintf(why, n, "%s: its %s (header slot %d: %d) differs from rank 0's state_%08d_00000.bin (%d): the ranks' states do not "
                     "belong together", path, state_slot_name(i), i, h[i], step, h0[i]);
            return -1;
        }
    return 0;
}

/* Whether checkpoint `step` is whole: its DONE marker; the model file and
 * every rank's state file (as many as rank 0's state names) open, have the
 * sizes their headers give and carry the marker's run id; each state's step
 * and rank are its name's, and every field the ranks share is the same in
 * every state. 0, or -1 with the first damage in why[n]. */
static inline int checkpoint_damage(const char* dir, int step, char* why, size_t n) {
    char path[4200], text[64];
    checkpoint_path(path, sizeof(path), dir, "DONE", step, -1);
    FILE* f = fopen(path, "rb");
    if (!f) { snprintf(why, n, "%s: cannot open (%s)", path, strerror(errno)); return -1; }
    size_t len = fread(text, 1, sizeof(text), f);
    fclose(f);
    uint64_t id;
    if (checkpoint_parse_marker(text, len, &id) != 0) { snprintf(why, n, "%s: not a checkpoint marker", path); return -1; }
    ModelFileInfo info;
    int32_t h[256], h0[256];
    checkpoint_path(path, sizeof(path), dir, "model", step, -1);
    if (!(f = model_file_try_open(path, &info, why, n))) return -1;
    int read_ok = fseek(f, 0, SEEK_SET) == 0 && fread(h, sizeof(int32_t), 256, f) == 256;
    fclose(f);
    if (!read_ok) { snprintf(why, n, "%s: cannot read its header", path); return -1; }
    if (get64(h, MODEL_RUN_ID_SLOT) != id) {
        snprintf(why, n, "%s: written by run %016llx, its DONE marker names run %016llx: the checkpoint mixes two runs' files", path,
                 (unsigned long long)get64(h, MODEL_RUN_ID_SLOT), (unsigned long long)id);
        return -1;
    }
    int world = 1;
    for (int r = 0; r < world; r++) {
        TrainState st;
        checkpoint_path(path, sizeof(path), dir, "state", step, r);
        if (!(f = state_try_open(path, &st, why, n))) return -1;
        read_ok = fseek(f, 0, SEEK_SET) == 0 && fread(h, sizeof(int32_t), 256, f) == 256;
        fclose(f);
        if (!read_ok) { snprintf(why, n, "%s: cannot read its header", path); return -1; }
        if (state_disagrees(path, step, r, id, h, r ? h0 : NULL, why, n)) return -1;
        if (r == 0) { world = st.world; memcpy(h0, h, sizeof(h0)); }
    }
    return 0;
}

/* The latest whole checkpoint in dir, or -1 when there is no DONE marker.
 * A damaged newer one (a file truncated or lost after its marker was
 * written) is skipped, saying so on `notes`; when every one is damaged the
 * run stops, naming the latest's damage. */
static inline int checkpoint_latest_whole(const char* dir, FILE* notes) {
    int* steps = (int*)malloc_check(CHECKPOINT_MAX_LISTED * sizeof(int), "checkpoint list");
    int n = 0;
    DIR* d = opendir(dir);
    struct dirent* e;
    while (d && (e = readdir(d)) != NULL) {
        int step = checkpoint_step_of_name(e->d_name, "DONE", "");
        if (step >= 0 && n < CHECKPOINT_MAX_LISTED) steps[n++] = step;
    }
    if (d) closedir(d);
    char why[4800], first_why[4800] = "";
    int found = -1, latest = -1;
    while (n > 0 && found < 0) {
        int best = 0;
        for (int i = 1; i < n; i++)
            if (steps[i] > steps[best]) best = i;
        int step = steps[best];
        steps[best] = steps[--n];
        if (latest < 0) latest = step;
        if (checkpoint_damage(dir, step, why, sizeof(why)) == 0) { found = step; break; }
        fprintf(notes, "resume: checkpoint of step %d is damaged (%s): skipped, its files left in place\n", step, why);
        if (!first_why[0]) memcpy(first_why, why, sizeof(why));
    }
    free(steps);
    if (latest >= 0 && found < 0) fail("-y 1: no whole checkpoint in %s (the latest, step %d: %s)", dir, latest, first_why);
    if (found >= 0 && found != latest) fprintf(notes, "resume: falling back to step %d, the latest whole checkpoint\n", found);
    return found;
}

/* One job per -o: rank 0 holds an exclusive flock on the directory from
 * before it reads a checkpoint until it exits, so a second job on it is
 * refused, and one killed in any way leaves no lock behind (the kernel
 * releases a dead process's locks). Where a directory cannot be flocked
 * (NFS emulates flock with POSIX locks, which need a file open for
 * writing), the lock is on the file DIR/.lock instead; where neither can be,
 * a warning says so. Returns -1 when dir cannot be opened and the caller
 * has not `created` it yet (nothing to protect: it locks once it has),
 * else 0. */
static inline int output_lock(const char* dir, int created) {
    static int held = 0;
    if (held) return 0;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 && !created) return -1; /* not there yet, or not a directory: creating it says */
    int err = fd < 0 ? errno : flock(fd, LOCK_EX | LOCK_NB) == 0 ? 0 : errno;
    if (err && err != EWOULDBLOCK) {
        if (fd >= 0) close(fd);
        char path[4200];
        snprintf(path, sizeof(path), "%s/.lock", dir);
        fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        int file_err = fd < 0 ? errno : flock(fd, LOCK_EX | LOCK_NB) == 0 ? 0 : errno;
        if (file_err && file_err != EWOULDBLOCK) {
            fprintf(stderr, "warning: -o %s cannot be locked (%s): a second job on it would not be refused\n", dir, strerror(err));
            if (fd >= 0) close(fd);
        }
        err = file_err;
    }
    if (err == EWOULDBLOCK)
        fail("-o %s is in use by another job (which holds its lock while it runs): give another -o, or let that job end first", dir);
    held = 1; /* fd stays open: the lock lasts as long as the process */
    return 0;
}

/* Whether a file name is one of a run's temporaries in -o: a checkpoint
 * file's or the log's name with ".tmp" (what an atomic write interrupted by
 * kill -9 or a second signal leaves). */
static inline int is_run_temporary(const char* name) {
    return strcmp(name, "log.jsonl.tmp") == 0 || checkpoint_step_of_name(name, "DONE", ".tmp") >= 0 ||
           checkpoint_step_of_name(name, "model", ".bin.tmp") >= 0 || state_step_of_name(name, ".tmp") >= 0;
}

/* Removes the files of dir whose name `doomed` picks (given `step`);
 * returns how many. */
static inline int checkpoint_remove_where(const char* dir, int (*doomed)(const char* name, int step), int step) {
    DIR* d = opendir(dir);
    if (!d) fail("%s: cannot list (%s)", dir, strerror(errno));
    int removed = 0;
    struct dirent* e;
    char path[4400];
    while ((e = readdir(d)) != NULL) {
        if (!doomed(e->d_name, step)) continue;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (remove(path) != 0 && errno != ENOENT) fail("%s: cannot remove (%s)", path, strerror(errno));
        removed++;
    }
    closedir(d);
    if (removed) fsync_dir_of(path);
    return removed;
}

static inline int is_run_temporary_file(const char* name, int step) {
    (void)step;
    return is_run_temporary(name);
}

/* Removes the run temporaries in dir (nothing writes them at start);
 * returns how many. */
static inline int checkpoint_remove_temporaries(const char* dir) { return checkpoint_remove_where(dir, is_run_temporary_file, 0); }

/* --supersede: every checkpoint of an earlier run goes, complete or not. */
static inline int checkpoint_remove_all(const char* dir) {
    int* steps = (int*)malloc_check(CHECKPOINT_MAX_LISTED * sizeof(int), "checkpoint list");
    int n = checkpoint_steps(dir, steps, CHECKPOINT_MAX_LISTED);
    for (int i = 0; i < n; i++) checkpoint_remove(dir, steps[i]);
    free(steps);
    return n;
}

/* ---- what -o holds, before a run changes it ---- */

/* A file of -o named like a checkpoint's (model_%08d.bin, state_%08d_%05d.bin,
 * DONE_%08d), with the run id it carries: a DONE marker's line, a model
 * header's slots MODEL_RUN_ID_SLOT.. (llm.c's magic), a state header's
 * ST_RUN_ID_* (this trainer's magic and versions); 0 where it carries none
 * (llm.c's files, an empty marker) or its header cannot be read. */
typedef struct {
    char name[256]; /* a dirent name, though those matched are 24 characters at most */
    int step, is_marker;
    uint64_t run_id;
    dev_t dev;
    ino_t ino;
} OutputFile;

static inline uint64_t output_file_run_id(const char* path, int is_marker, int is_model) {
    FILE* f = fopen(path, "rb");
    if (!f) return 0;
    int32_t h[256];
    size_t got = fread(h, 1, sizeof(h), f);
    fclose(f);
    uint64_t id = 0;
    if (is_marker) {
        if (checkpoint_parse_marker((const char*)h, got, &id) != 0) id = 0;
    } else if (got == sizeof(h)) {
        if (is_model && h[0] == MODEL_MAGIC) id = get64(h, MODEL_RUN_ID_SLOT);
        if (!is_model && h[ST_MAGIC] == STATE_MAGIC && h[ST_VERSION] >= STATE_OLDEST_VERSION && h[ST_VERSION] <= STATE_VERSION)
            id = get64(h, ST_RUN_ID_LO);
    }
    return id;
}

/* The checkpoint-named files of dir (none when it cannot be listed), in
 * *files (malloc'ed); returns how many. */
static inline int output_files_list(const char* dir, OutputFile** files) {
    int n = 0, cap = 16;
    *files = (OutputFile*)malloc_check((size_t)cap * sizeof(OutputFile), "the list of -o");
    DIR* d = opendir(dir);
    struct dirent* e;
    char path[4400];
    while (d && (e = readdir(d)) != NULL) {
        int marker = checkpoint_step_of_name(e->d_name, "DONE", ""), model = checkpoint_step_of_name(e->d_name, "model", ".bin");
        int step = marker >= 0 ? marker : model >= 0 ? model : state_step_of_name(e->d_name, "");
        struct stat sb;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (step < 0 || stat(path, &sb) != 0) continue;
        if (n == cap && !(*files = (OutputFile*)realloc(*files, (size_t)(cap *= 2) * sizeof(OutputFile))))
            fail("out of host memory listing -o %s", dir);
        OutputFile* of = &(*files)[n++];
        snprintf(of->name, sizeof(of->name), "%s", e->d_name);
        of->step = step;
        of->is_marker = marker >= 0;
        of->run_id = output_file_run_id(path, marker >= 0, model >= 0);
        of->dev = sb.st_dev;
        of->ino = sb.st_ino;
    }
    if (d) closedir(d);
    return n;
}

/* Whether the files of `step` are this trainer's: its DONE marker carries a
 * run id, or without a marker, one of its files does. */
static inline int output_step_is_ours(const OutputFile* files, int n, int step) {
    int any_id = 0;
    for (int i = 0; i < n; i++)
        if (files[i].step == step) {
            if (files[i].is_marker) return files[i].run_id != 0;
            any_id |= files[i].run_id != 0;
        }
    return any_id;
}

/* Whether `step` has a DONE marker naming run_id: its files are that run's
 * checkpoint, damaged where one carries another id (-y 1 skipped it, and
 * the run writes that step again). */
static inline int output_step_marked_by(const OutputFile* files, int n, int step, uint64_t run_id) {
    for (int i = 0; i < n; i++)
        if (files[i].step == step && files[i].is_marker) return files[i].run_id == run_id;
    return 0;
}

typedef enum { OUTPUT_FRESH, OUTPUT_SUPERSEDE, OUTPUT_RESUME } OutputUse;

/* Refuses, in one line naming the file and what to do, a run that would
 * lose a file of -o (checkpoint files are the only ones a run overwrites or
 * deletes):
 * - in every use, files named like checkpoints but not this trainer's
 *   (llm.c's, an empty DONE marker): no run resumes, overwrites or deletes them;
 * - a fresh run (also -y 1 with no DONE marker to resume): any checkpoint
 *   file, as nothing in -o is provably its own; --supersede deletes them;
 * - a fresh run or --supersede: the file -e (`reads`) names, found by inode;
 * - a resume of run `resumed_id` (0: not known yet): a file of another run,
 *   but for the files of its own marked steps (a damaged checkpoint of it).
 * For rank 0, before anything in -o changes. */
static inline void output_check(const char* dir, OutputUse use, const char* reads, uint64_t resumed_id) {
    OutputFile* files;
    int n = output_files_list(dir, &files), latest_marked = -1;
    for (int i = 0; i < n; i++) {
        const OutputFile* f = &files[i];
        if (!output_step_is_ours(files, n, f->step)) {
            for (int j = 0; j < n; j++) /* the marker, when the step has one, says best what the files are */
                if (files[j].step == f->step && files[j].is_marker) f = &files[j];
            fail("-o %s holds %s, %s: not a checkpoint of this trainer (llm.c writes such files), which it neither resumes nor "
                 "deletes: give another -o, or move the files of step %d out of it", dir, f->name,
                 f->is_marker ? "a DONE marker without the line \"run <16 hex digits>\"" : "which carries no run id and has no DONE marker",
                 f->step);
        }
        if (f->is_marker && f->step > latest_marked) latest_marked = f->step;
    }
    if (use == OUTPUT_RESUME && latest_marked < 0) use = OUTPUT_FRESH; /* -y 1 with nothing to resume starts fresh */
    struct stat sb;
    if (use != OUTPUT_RESUME && reads && stat(reads, &sb) == 0)
        for (int i = 0; i < n; i++)
            if (files[i].dev == sb.st_dev && files[i].ino == sb.st_ino)
                fail("-e %s is %s in -o %s, where this run writes its checkpoints (a fresh run's -o holds none of an earlier run; "
                     "--supersede deletes them): copy it out of -o first, or give another -o", reads, files[i].name, dir);
    if (use == OUTPUT_FRESH && latest_marked >= 0)
        fail("-o %s holds checkpoints of an earlier run (the latest complete: step %d): resume it with -y 1, or give "
             "--supersede to delete them", dir, latest_marked);
    for (int i = 0; use == OUTPUT_FRESH && i < n; i++)
        if (files[i].run_id)
            fail("-o %s holds %s of run %016llx with no DONE marker (a checkpoint a run did not finish, or the model a -x 0 "
                 "run saved), which a fresh run would overwrite or delete: give another -o, or delete it (--supersede, "
                 "without -y 1, does)", dir, files[i].name, (unsigned long long)files[i].run_id);
    for (int i = 0; use == OUTPUT_RESUME && resumed_id && i < n; i++)
        if (files[i].run_id && files[i].run_id != resumed_id && !output_step_marked_by(files, n, files[i].step, resumed_id))
            fail("-o %s holds %s of run %016llx, not of the run resumed (%016llx), which this run would overwrite or delete: move "
                 "it out of -o", dir, files[i].name, (unsigned long long)files[i].run_id, (unsigned long long)resumed_id);
    free(files);
}

/* Retention after checkpoint `newest` is complete: keep the last keep_last
 * whole checkpoints (0: all) and those whose step is a multiple of
 * keep_every; remove the other whole ones. A damaged checkpoint is never
 * one of those kept (nor removed: its files stay for inspection, and -y 1
 * skips it), so a run always keeps keep_last it can resume from.
 * Incomplete leftovers stay for resume to ignore (a crash may be writing one
 * right now on another rank). */
static inline void checkpoint_retain(const char* dir, int keep_last, int keep_every) {
    if (keep_last <= 0) return;
    int* steps = (int*)malloc_check(CHECKPOINT_MAX_LISTED * sizeof(int), "checkpoint list");
    int n = checkpoint_steps(dir, steps, CHECKPOINT_MAX_LISTED);
    char why[4800];
    int whole = 0;
    for (int i = 0; i < n; i++)
        if (checkpoint_damage(dir, steps[i], why, sizeof(why)) == 0) steps[whole++] = steps[i];
    for (int i = 0; i < whole; i++) {
        int newer = 0;
        for (int j = 0; j < whole; j++) newer += steps[j] > steps[i];
        if (newer >= keep_last && !(keep_every > 0 && steps[i] % keep_every == 0)) checkpoint_remove(dir, steps[i]);
    }
    free(steps);
}

static inline int is_done_marker_after(const char* name, int step) { return checkpoint_step_of_name(name, "DONE", "") > step; }

/* On resume from `step`: the DONE markers of newer checkpoints (damaged
 * ones, which -y 1 skipped) go, before this run writes those steps again,
 * so a crash mid-write never leaves an old marker over a mix of old and new
 * files. Their files stay until overwritten. Returns how many. */
static inline int checkpoint_unmark_newer(const char* dir, int step) { return checkpoint_remove_where(dir, is_done_marker_after, step); }

#endif
