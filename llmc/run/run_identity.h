/*
 * What makes a run the same run: its id, and the hyperparameters a resume
 * must not silently change.
 *
 * A fresh run draws a 64-bit id that goes into every file of its checkpoints
 * (llmc/core/checkpoint.h); a resume checks that the model, every state file and
 * the DONE marker carry the same id, and keeps it. The hyperparameters that
 * change the computation (learning rate and schedule, warmup, tokens per
 * step, seed, weight decay, betas, epsilon, clipping, shuffling, dropout, the
 * number of steps where the schedule decays over them, the token tile size)
 * and the training data (-i) are saved in each state file; a resume with a
 * different value is refused naming the flag, unless --resume-override. The
 * tile size is compared only where it changes the bits (the GPU trainer).
 */
#ifndef REMAT_RUN_IDENTITY_H
#define REMAT_RUN_IDENTITY_H

#include <time.h>
#include "../core/cli.h"
#include "../core/rand.h"
#include "../core/checkpoint.h"
#include "../core/model.h"

static inline uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
    const unsigned char* p = (const unsigned char*)data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}
#define FNV_START 0xcbf29ce484222325ULL

static inline uint64_t run_id_new(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t id = rand_u64((uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec, (uint64_t)getpid(), 0);
    return id ? id : 1; /* 0 never names a run */
}

typedef enum { HP_INT, HP_FLOAT, HP_SCHEDULE, HP_STEPS } HparamKind;

typedef struct {
    const char* flag;
    HparamKind kind;
    size_t offset; /* in TrainOptions; tokens per step (-d) and the steps (-x) are passed in */
} HparamSpec;

/* What a run resolved that its flags alone do not say. */
typedef struct {
    int tokens_per_step; /* -d, resolved */
    int steps;           /* -x, resolved (-1: one epoch); 0: evaluation only */
    /* the flag each dropout site's value came from as typed (--dropout or
     * the site's own), NULL when not typed: named when it differs */
    const char* dropout_flag[MODEL_NUM_PDROP];
    /* whether the tile size changes the bits (the GPU trainer: a tile's
     * fp32 sums; the CPU trainer gives the untiled bits for every K) */
    int tiles_change_bits;
} HparamContext;

#define HP_OPT(field) offsetof(TrainOptions, field)
static const HparamSpec hparam_table[] = {
    {"-l", HP_FLOAT, HP_OPT(lr)}, {"-k", HP_SCHEDULE, HP_OPT(schedule)}, {"-u", HP_INT, HP_OPT(warmup_steps)},
    {"-q", HP_FLOAT, HP_OPT(final_lr_frac)}, {"-c", HP_FLOAT, HP_OPT(weight_decay)}, {"--beta1", HP_FLOAT, HP_OPT(beta1)},
    {"--beta2", HP_FLOAT, HP_OPT(beta2)}, {"--eps", HP_FLOAT, HP_OPT(eps)}, {"--grad-clip", HP_FLOAT, HP_OPT(grad_clip)},
    {"--seed", HP_INT, HP_OPT(seed)}, {"--shuffle", HP_INT, HP_OPT(shuffle)}, {"-d", HP_INT, 0},
    /* last, so that a state holding only the first HPARAMS_BEFORE_DROPOUT reads
     * zeros here, which is what such a run trained with (no dropout) */
    {"--embd-dropout", HP_FLOAT, HP_OPT(embd_dropout)}, {"--attn-dropout", HP_FLOAT, HP_OPT(attn_dropout)},
    {"--resid-dropout", HP_FLOAT, HP_OPT(resid_dropout)},
    /* appended with state version 3 (a version 2 state: not compared) */
    {"-x", HP_STEPS, 0},
    /* a state saved before it has 0 here: untiled */
    {"--tile-tokens", HP_INT, HP_OPT(tile_tokens)},
    /* packed documents (llmc/core/documents.h); a state saved before them reads
     * zeros, which is what it ran with (off), and has no end-of-text token */
    {"--reset-attention-mask", HP_INT, HP_OPT(reset_attention_mask)}, {"--reset-position-ids", HP_INT, HP_OPT(reset_position_ids)},
    {"--eod-mask-loss", HP_INT, HP_OPT(eod_mask_loss)}, {"--eot-token", HP_INT, HP_OPT(eot_token)},
};
#define HPARAMS_BEFORE_DOCUMENTS 17
#define HPARAMS_BEFORE_DROPOUT 12
#define HPARAMS_BEFORE_STEPS 15
#define HP_FIRST_DROPOUT 12
#define HP_TILE_TOKENS 16
#undef HP_OPT
#define NUM_HPARAMS ((int)(sizeof(hparam_table) / sizeof(hparam_table[0])))

/* The tile size a state's run trained with: 0 (untiled) in a state saved before the slot. */
static inline int hparams_saved_tile_tokens(const int32_t* saved) { return saved[0] > HP_TILE_TOKENS ? saved[1 + HP_TILE_TOKENS] : 0; }

static inline int schedule_index(const char* s) { return strcmp(s, "cosine") == 0 ? 0 : strcmp(s, "linear") == 0 ? 1 : 2; }
static const char* const schedule_names[3] = {"cosine", "linear", "constant"};

/* Slot i of the state's hyperparameters; slot 0 says how many are saved. */
static inline int32_t hparam_value(const TrainOptions* o, int i, const HparamContext* ctx) {
    const HparamSpec* h = &hparam_table[i];
    const char* base = (const char*)o + h->offset;
    int32_t v;
    if (h->kind == HP_FLOAT) memcpy(&v, base, 4);
    else if (h->kind == HP_SCHEDULE) v = schedule_index(*(const char* const*)base);
    else if (h->kind == HP_STEPS) v = ctx->steps;
    else v = h->offset ? *(const int*)base : ctx->tokens_per_step;
    return v;
}

static inline void hparams_pack(const TrainOptions* o, const HparamContext* ctx, int32_t* slots) {
    memset(slots, 0, STATE_NUM_HPARAMS * sizeof(int32_t));
    slots[0] = NUM_HPARAMS;
    for (int i = 0; i < NUM_HPARAMS; i++) slots[1 + i] = hparam_value(o, i, ctx);
}

/* The number of steps shapes the learning rate only when a schedule decays
 * over them to a different final rate; -x 0 trains nothing. */
static inline int steps_shape_the_run(const TrainOptions* o, const HparamContext* ctx) {
    return ctx->steps != 0 && strcmp(o->schedule, "constant") != 0 && o->final_lr_frac != 1.0f;
}

static inline void hparam_format(const HparamSpec* h, int32_t v, char* buf, size_t n) {
    if (h->kind == HP_FLOAT) { float f; memcpy(&f, &v, 4); snprintf(buf, n, "%.7g", (double)f); } /* a float's digits */
    else if (h->kind == HP_SCHEDULE) snprintf(buf, n, "%s", v >= 0 && v < 3 ? schedule_names[v] : "?");
    else snprintf(buf, n, "%d", v);
}

/* The flag to name for hyperparameter i: the one the user typed. */
static inline const char* hparam_flag_as_typed(int i, const HparamContext* ctx) {
    int site = i - HP_FIRST_DROPOUT;
    if (site >= 0 && site < MODEL_NUM_PDROP && ctx->dropout_flag[site]) return ctx->dropout_flag[site];
    return hparam_table[i].flag;
}

/* Refuses (or with override, notes) every hyperparameter that differs from the checkpoint's. */
static inline void hparams_check(const TrainOptions* o, const HparamContext* ctx, const int32_t* saved, const char* path) {
    if (saved[0] != NUM_HPARAMS && saved[0] != HPARAMS_BEFORE_DOCUMENTS && saved[0] != HPARAMS_BEFORE_STEPS &&
        saved[0] != HPARAMS_BEFORE_DROPOUT)
        fail("%s: %d hyperparameters saved, this build compares %d", path, saved[0], NUM_HPARAMS);
    for (int i = 0; i < NUM_HPARAMS; i++) {
        /* -x: not recorded before state version 3 (the dropout and document
         * slots of an older state hold zeros, which is what it ran with); an
         * older state's end-of-text token is unknown: any will do */
        if (hparam_table[i].kind == HP_STEPS && (i >= saved[0] || !steps_shape_the_run(o, ctx))) continue;
        if (i == NUM_HPARAMS - 1 && i >= saved[0]) continue;
        int32_t now = hparam_value(o, i, ctx);
        if (now == saved[1 + i]) continue;
        char was[48], is[48];
        hparam_format(&hparam_table[i], saved[1 + i], was, sizeof(was));
        hparam_format(&hparam_table[i], now, is, sizeof(is));
        if (i == HP_TILE_TOKENS && !ctx->tiles_change_bits) { /* no refusal: the bits are the same */
            printf("resume: --tile-tokens %s, the checkpoint's %s: the CPU trainer's results do not depend on the tile size\n", is, was);
            continue;
        }
        const char* flag = hparam_flag_as_typed(i, ctx);
        const char* what = hparam_table[i].kind == HP_STEPS ? " steps (the learning-rate schedule decays over them)" : "";
        if (!o->resume_override)
            fail("flag %s: the checkpoint was trained with %s %s%s, this run gives %s: give the same, or --resume-override to change it",
                 flag, flag, was, what, is);
        printf("resume: %s changed from %s to %s (--resume-override)\n", flag, was, is);
    }
}

/* The training data's record for the state (llmc/core/checkpoint.h). */
static inline DataRecord data_record(const char* glob, uint64_t counts_digest) {
    DataRecord d;
    memset(&d, 0, sizeof(d));
    d.counts_digest = counts_digest;
    d.glob_digest = fnv1a(FNV_START, glob, strlen(glob));
    snprintf(d.glob, sizeof(d.glob), "%s", glob);
    return d;
}

/* Refuses (or with override, notes) training data other than the checkpoint's. */
static inline void data_record_check(const TrainOptions* o, const DataRecord* saved, const DataRecord* now, const char* path) {
    if (!saved->counts_digest) {
        printf("resume: %s predates the record of the training data: -i is not compared\n", path);
        return;
    }
    int same_path = saved->glob_digest == now->glob_digest, same_data = saved->counts_digest == now->counts_digest;
    if (same_path && same_data) return;
    char why[700];
    snprintf(why, sizeof(why), "the checkpoint was trained on -i %.256s%s, this run %s", saved->glob,
             strlen(saved->glob) >= STATE_DATA_TEXT_BYTES ? "..." : "",
             !same_path ? "gives another -i" : "reads shards of other sizes (the data changed)");
    if (!o->resume_override)
        fail("flag -i: %s: give the same data, or --resume-override to continue on this (the data position is kept)", why);
    printf("resume: %s (--resume-override)\n", why);
}

/* Checks that a checkpoint's files all belong to the run its DONE marker names. */
static inline uint64_t checkpoint_verify_run_id(const char* dir, int step, int world) {
    uint64_t id = checkpoint_read_marker(dir, step);
    char path[4200];
    checkpoint_path(path, sizeof(path), dir, "model", step, -1);
    if (checkpoint_file_run_id(path, MODEL_RUN_ID_SLOT) != id)
        fail("%s: written by another run than its DONE marker names (run %016llx): the checkpoint mixes two runs' files", path,
             (unsigned long long)id);
    for (int r = 0; r < world; r++) {
        checkpoint_path(path, sizeof(path), dir, "state", step, r);
        if (file_exists(path) && checkpoint_file_run_id(path, ST_RUN_ID_LO) != id)
            fail("%s: written by another run than its DONE marker names (run %016llx): the checkpoint mixes two runs' files", path,
                 (unsigned long long)id);
    }
    return id;
}

/* ---- ranks of one run must run the same computation ---- */


static inline uint64_t flag_digest(const TrainOptions* o, const FlagSpec* f) {
    const char* field = (const char*)o + f->offset;
    if (f->type == FLAG_STRING) {
        const char* s = *(const char* const*)field;
        return fnv1a(FNV_START, s, strlen(s));
    }
    return fnv1a(FNV_START, field, f->type == FLAG_FLOAT ? sizeof(float) : sizeof(int));
}

/* Compares every flag, the model shape (each skipped when NULL) and `extra`
 * named values across the ranks; a difference stops the job naming the first that differs (rank 0
 * reports it; the others wait for its abort). */
static inline void ranks_check_same(const TrainOptions* o, const ModelConfig* cfg, const char* const* extra_names,
                                    const uint64_t* extra, int num_extra) {
    if (remat_proc.world == 1) return;
    int n = NUM_FLAGS + 1 + num_extra;
    uint64_t* v = (uint64_t*)malloc_check((size_t)n * sizeof(uint64_t), "rank comparison");
    for (int i = 0; i < NUM_FLAGS; i++) v[i] = o ? flag_digest(o, &flag_table[i]) : 0;
    v[NUM_FLAGS] = cfg ? fnv1a(FNV_START, cfg, sizeof(*cfg)) : 0;
    for (int i = 0; i < num_extra; i++) v[NUM_FLAGS + 1 + i] = extra[i];
    int bad = proc_first_mismatch(v, n, "the comparison of flags and data");
    free(v);
    if (bad < 0) return;
    if (remat_proc.rank == 0) {
        const char* what = bad < NUM_FLAGS ? flag_table[bad].name : bad == NUM_FLAGS ? "the model shape (-e and shape flags, or the model file)" : extra_names[bad - NUM_FLAGS - 1];
        fail("%s%s differs between the processes of this run: every rank must be started with the same flags and data",
             bad < NUM_FLAGS ? "flag " : "", what);
    }
    proc_barrier("the wait for rank 0's verdict"); /* rank 0's abort ends the wait */
}

#endif
