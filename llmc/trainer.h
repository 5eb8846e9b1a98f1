/*
 * The training driver shared by both trainers: model source, recompute
 * choice and memory plan from the flags; data, schedule, evaluation,
 * sampling, checkpoints and the step printout. Each trainer supplies a
 * Backend: the model's forward/backward, optimizer and parameter transfer,
 * on its own device. Nothing here knows whether that device is a CPU or GPU.
 */
#ifndef REMAT_TRAINER_H
#define REMAT_TRAINER_H

#include <math.h>
#include <sys/resource.h>
#include <time.h>
#include "utils.h"
#include "model.h"
#include "plan.h"
#include "plan_report.h"
#include "cli.h"
#include "dataloader.h"
#include "tokenizer.h"
#include "schedule.h"
#include "sampler.h"
#include "logger.h"
#include "checkpoint.h"
#include "loss_scaler.h"
#include "multiproc.h"
#include "run_identity.h"
#include "preempt.h"
#include "dropout.h"

/* The state of a pass that drops nothing: evaluation, sampling. */
static const DropoutState dropout_off = {{0.0f}, 0, 0, 0, 0};

/* ---- the model's buffers ----
 * Points a trainer's model struct `m` at the buffers both trainers keep inside
 * its arena (m->arena, laid out by `plan`), sets the per-layer strides of the
 * stacked parameter tensors, the logits chunk's rows and the plan's B, T.
 * A macro because it is generic over the storage type ELEM (real on the CPU,
 * floatX on the GPU) and STAT, the type of per-token losses and LayerNorm
 * statistics; `m` needs the members assigned here. Buffers only one trainer
 * has stay in that trainer. */
#define TRAINER_CARVE_ARENA(m, plan, ELEM, STAT)                                                         \
    do {                                                                                                 \
        const MemoryPlan* carve_plan_ = (plan);                                                          \
        char* carve_base_ = (m)->arena;                                                                  \
        (m)->params = (ELEM*)(carve_base_ + carve_plan_->off_params);                                    \
        (m)->grads = (ELEM*)(carve_base_ + carve_plan_->off_grads);                                      \
        (m)->adam_m = (float*)(carve_base_ + carve_plan_->off_adam_m);                                   \
        (m)->adam_v = (float*)(carve_base_ + carve_plan_->off_adam_v);                                   \
        ParamLayout carve_pl_;                                                                           \
        param_layout(&carve_plan_->spec.cfg, &carve_pl_);                                                \
        for (int carve_t_ = 0; carve_t_ < NUM_PARAM_TENSORS; carve_t_++) {                               \
            (m)->p[carve_t_] = (m)->params + carve_pl_.offset[carve_t_];                                 \
            (m)->g[carve_t_] = (m)->grads + carve_pl_.offset[carve_t_];                                  \
            (m)->layer_stride[carve_t_] = carve_pl_.count[carve_t_] / (size_t)carve_plan_->spec.cfg.num_layers; \
        }                                                                                                \
        (m)->inputs = (int*)(carve_base_ + carve_plan_->off_inputs);                                     \
        (m)->targets = (int*)(carve_base_ + carve_plan_->off_targets);                                   \
        (m)->losses = (STAT*)(carve_base_ + carve_plan_->off_losses);                                    \
        (m)->final_res = (ELEM*)(carve_base_ + carve_plan_->off_final_res);                              \
        (m)->lnf = (ELEM*)(carve_base_ + carve_plan_->off_lnf);                                          \
        (m)->lnf_mean = (STAT*)(carve_base_ + carve_plan_->off_lnf_mean);                                \
        (m)->lnf_rstd = (STAT*)(carve_base_ + carve_plan_->off_lnf_rstd);                                \
        (m)->logits = (ELEM*)(carve_base_ + carve_plan_->off_logits);                                    \
        for (int carve_g_ = 0; carve_g_ < NUM_GRAD_ACTS; carve_g_++)                                     \
            (m)->grad_act[carve_g_] = (ELEM*)(carve_base_ + carve_plan_->grad_act[carve_g_]);            \
        size_t carve_n_ = (size_t)carve_plan_->spec.B * carve_plan_->spec.T;                             \
        (m)->logits_rows = (size_t)carve_plan_->spec.logits_chunk_rows < carve_n_ ? carve_plan_->spec.logits_chunk_rows : (int)carve_n_; \
        (m)->B = carve_plan_->spec.B;                                                                    \
        (m)->T = carve_plan_->spec.T;                                                                    \
    } while (0)

typedef enum { TENSOR_PARAMS, TENSOR_MASTER, TENSOR_ADAM_M, TENSOR_ADAM_V } StateTensor;

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

/* The part [*begin, *end) of parameter tensor t that lies in a rank's
 * parameter shard [lo, hi) (everything without ZeRO); 0 when they do not meet. */
static inline int shard_slice(const ParamLayout* pl, int t, size_t lo, size_t hi, size_t* begin, size_t* end) {
    *begin = pl->offset[t] > lo ? pl->offset[t] : lo;
    *end = pl->offset[t] + pl->count[t] < hi ? pl->offset[t] + pl->count[t] : hi;
    return *begin < *end;
}

typedef struct {
    void* ctx;
    int* inputs;            /* B*T host tokens the driver fills before each call */
    int* targets;
    int model_file_version; /* 3 (fp32) or 5 (bf16) when writing checkpoints */
    int loss_scaling;       /* 1: dynamic loss scaling (FP16 builds) */
    DeviceRecord device;    /* what it computes on, recorded in checkpoints */
    float* io_chunk;        /* host staging for files, Run.io_chunk_floats floats */
    uint16_t* window;       /* host B*T+1 tokens for the dataloader */
    /* forward and backward of one micro-batch; gradients accumulate; returns the mean loss */
    float (*forward_backward)(void* ctx, float dloss_mean);
    /* the dropout of the forward_backward calls that follow (their step and
     * micro-step fix the masks); forward_loss and next_token_probs never drop */
    void (*set_dropout)(void* ctx, const DropoutState* d);
    float (*forward_loss)(void* ctx);
    /* after forward_loss: its B*T per-token losses, row-major (b, t), to host */
    void (*token_losses)(void* ctx, float* out);
    /* memory in use for the log (device memory on the GPU); NULL: peak resident memory */
    size_t (*memory_bytes)(void* ctx);
    /* probabilities over V of the token after tokens[0..len) */
    void (*next_token_probs)(void* ctx, const int* tokens, int len, float* probs);
    void (*zero_grads)(void* ctx);
    /* after the last micro-step: sum gradients across processes (all-reduce, or
     * reduce-scatter to each rank's shard under ZeRO-1); NULL or a no-op alone */
    void (*sync_grads)(void* ctx);
    /* global gradient norm (across processes when gradients are sharded) */
    float (*grad_norm)(void* ctx);
    void (*update)(void* ctx, const AdamWStep* s);
    /* moves n fp32 values of a state tensor between device and host, from element `start` */
    void (*transfer)(void* ctx, int tensor, size_t start, size_t n, float* host, int to_host);
    /* extra text for the line of step `step` (MFU, device memory); may be NULL */
    void (*step_extras)(void* ctx, int step, double step_ms, char* buf, size_t n);
    /* around each optimizer step (the GPU's step profile); may be NULL */
    void (*step_begin)(void* ctx, int step);
    void (*step_end)(void* ctx, int step);
} Backend;

typedef struct {
    TrainOptions opt;
    ModelConfig cfg;
    char model_desc[4200];    /* for the printout */
    const char* model_path;   /* NULL: random init */
    int resume_step;          /* -1: fresh run */
    int rank, world;
    int grad_accum;
    unsigned char* layer_mode;
    MemoryPlan plan;
    size_t io_chunk_floats;   /* size of Backend.io_chunk */
    LossScaler scaler;
    int updates;              /* optimizer updates applied (skipped FP16 steps excluded) */
    uint64_t run_id;          /* written into every checkpoint file (llmc/run_identity.h) */
    DropoutState dropout;     /* the sites' probabilities, seed and rank; train_step sets the step */
    char dropout_desc[400];   /* where each probability came from, for the printout ("" when none) */
} Run;

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* True when -e names a descriptor: random init, which the shape flags may adjust. */
static inline int wants_random_init(const TrainOptions* o) {
    ModelConfig tmp;
    return config_from_descriptor(o->model, &tmp) == 0;
}

/* The run id: the checkpoint's on resume (checked against all its files),
 * else a new one. A fresh run into an -o holding complete checkpoints of an
 * earlier run is refused unless --supersede; -y 1 with none starts fresh. */
static inline void resolve_run_identity(Run* run) {
    const TrainOptions* o = &run->opt;
    FILE* notes = o->plan_json ? stderr : stdout;
    if (run->resume_step >= 0) {
        if (run->rank == 0) run->run_id = checkpoint_verify_run_id(o->out_dir, run->resume_step, remat_proc.world);
    } else {
        if (o->resume) fprintf(notes, "resume: no complete checkpoint (DONE_* marker) in %s: starting a fresh run\n", o->out_dir);
        int existing = o->out_dir[0] && !o->resume && !o->supersede && !o->plan_only && !o->plan_json ? checkpoint_latest(o->out_dir) : -1;
        proc_broadcast(&existing, sizeof(existing), "the check of -o for earlier runs");
        if (existing >= 0)
            fail("-o %s holds checkpoints of an earlier run (the latest complete: step %d): resume it with -y 1, or give "
                 "--supersede to delete them", o->out_dir, existing);
        run->run_id = run_id_new();
    }
    proc_broadcast(&run->run_id, sizeof(run->run_id), "the run id broadcast");
}

/* Each site's dropout: its own flag, else --dropout, else the model file's
 * (an imported config's, or the run's that wrote it), else 0. The resolved
 * values go back into the per-site options, which the state's
 * hyperparameters record, so a resume compares them. */
static inline void resolve_dropout(Run* run, const float* file_pdrop, const char* file) {
    TrainOptions* o = &run->opt;
    float* site[MODEL_NUM_PDROP] = {&o->embd_dropout, &o->attn_dropout, &o->resid_dropout};
    static const char* const flags[MODEL_NUM_PDROP] = {"--embd-dropout", "--attn-dropout", "--resid-dropout"};
    static const char* const names[MODEL_NUM_PDROP] = {"embedding", "attention", "residual"};
    size_t used = (size_t)snprintf(run->dropout_desc, sizeof(run->dropout_desc), "dropout:");
    int any = 0;
    for (int k = 0; k < MODEL_NUM_PDROP; k++) {
        char from[300];
        if (*site[k] >= 0.0f) snprintf(from, sizeof(from), "%s", flags[k]);
        else if (o->dropout >= 0.0f) { *site[k] = o->dropout; snprintf(from, sizeof(from), "--dropout"); }
        else if (file_pdrop[k] > 0.0f) { *site[k] = file_pdrop[k]; snprintf(from, sizeof(from), "%s of %.200s", model_pdrop_names[k], file); }
        else { *site[k] = 0.0f; snprintf(from, sizeof(from), "default"); }
        any |= *site[k] > 0.0f;
        if (used < sizeof(run->dropout_desc))
            used += (size_t)snprintf(run->dropout_desc + used, sizeof(run->dropout_desc) - used, "%s %s %g (%s)", k ? "," : "",
                                     names[k], (double)*site[k], from);
    }
    if (!any) run->dropout_desc[0] = '\0';
    memset(&run->dropout, 0, sizeof(run->dropout));
    run->dropout.p[DROPOUT_EMBEDDING] = o->embd_dropout;
    run->dropout.p[DROPOUT_ATTENTION] = o->attn_dropout;
    run->dropout.p[DROPOUT_RESID_ATTN] = run->dropout.p[DROPOUT_RESID_MLP] = o->resid_dropout;
    run->dropout.seed = (uint32_t)o->seed;
    run->dropout.rank = (uint32_t)run->rank;
}

/* A mask's site word holds the micro-step and the layer in fixed bits
 * (dropout.h): a run with more of either would draw one mask twice. */
static inline void check_dropout_limits(const Run* run) {
    if (!dropout_active(&run->dropout)) return;
    if (run->grad_accum > DROPOUT_MAX_MICRO_STEPS)
        fail("flag -d: %d micro-steps per step; with dropout at most %d (fewer tokens per step, or a larger -b)", run->grad_accum,
             DROPOUT_MAX_MICRO_STEPS);
    if (run->cfg.num_layers > DROPOUT_MAX_LAYERS)
        fail("model shape: %d layers; with dropout at most %d", run->cfg.num_layers, DROPOUT_MAX_LAYERS);
}

static inline void resolve_model(Run* run) {
    TrainOptions* o = &run->opt;
    int shape_flags = o->layers || o->heads || o->channels || o->max_seq_len || o->vocab_size;
    run->resume_step = o->resume ? checkpoint_latest(o->out_dir) : -1;
    proc_broadcast(&run->resume_step, sizeof(run->resume_step), "the resume step broadcast"); /* every rank resumes the same step */
    resolve_run_identity(run);
    static char ckpt_model[4200];
    if (run->resume_step >= 0) {
        checkpoint_path(ckpt_model, sizeof(ckpt_model), o->out_dir, "model", run->resume_step, -1);
        run->model_path = ckpt_model;
    } else if (wants_random_init(o)) {
        run->model_path = NULL;
    } else {
        if (!file_exists(o->model) && !strchr(o->model, '/') && !strchr(o->model, '.'))
            fail("-e: unknown model descriptor '%s' (d6, d12, d24, d36, d48), and no model file of that name", o->model);
        if (o->layers || o->heads || o->channels || o->vocab_size)
            fail("flags --layers/--heads/--channels/--vocab-size apply to random init only, not to the model file %s", o->model);
        run->model_path = o->model;
    }
    if (run->model_path) {
        ModelFileInfo info;
        fclose(model_file_open(run->model_path, &info));
        run->cfg = info.cfg;
        resolve_dropout(run, info.pdrop, run->model_path);
        snprintf(run->model_desc, sizeof(run->model_desc), "%s (version %d)", run->model_path, info.version);
        if (run->resume_step < 0 && o->max_seq_len && o->max_seq_len != info.cfg.max_seq_len) {
            /* long-context fine-tuning: a longer (or shorter) position table */
            run->cfg.max_seq_len = o->max_seq_len;
            size_t used = strlen(run->model_desc);
            snprintf(run->model_desc + used, sizeof(run->model_desc) - used, ", position table resized from %d to %d rows%s",
                     info.cfg.max_seq_len, o->max_seq_len, o->max_seq_len <= info.cfg.max_seq_len ? ""
                     : strcmp(o->wpe_init, "interpolate") == 0 ? " (learned rows interpolated)" : " (learned rows repeated)");
        }
        return;
    }
    config_from_descriptor(o->model, &run->cfg);
    static const float no_file_pdrop[MODEL_NUM_PDROP] = {0.0f, 0.0f, 0.0f};
    resolve_dropout(run, no_file_pdrop, NULL);
    if (o->layers) run->cfg.num_layers = o->layers;
    if (o->heads) run->cfg.num_heads = o->heads;
    if (o->channels) run->cfg.channels = o->channels;
    if (o->max_seq_len) run->cfg.max_seq_len = o->max_seq_len;
    if (o->vocab_size) { run->cfg.vocab_size = o->vocab_size; run->cfg.padded_vocab_size = pad_vocab(o->vocab_size); }
    config_validate(&run->cfg, "model shape");
    snprintf(run->model_desc, sizeof(run->model_desc), "%s%s, random init with seed %d", o->model,
             shape_flags ? " with shape flags" : "", o->seed);
}

/* Per-layer recompute modes from -r and --recompute-layers. */
static inline void resolve_recompute(Run* run) {
    int L = run->cfg.num_layers;
    run->layer_mode = (unsigned char*)calloc_check((size_t)L, 1, "recompute plan");
    parse_recompute(run->opt.recompute, run->opt.recompute_layers, L, run->layer_mode);
}

static inline void resolve_batch(Run* run) {
    TrainOptions* o = &run->opt;
    if (o->T > run->cfg.max_seq_len) fail("flag -t: sequence length %d exceeds the model's maximum %d", o->T, run->cfg.max_seq_len);
    long long micro_tokens = (long long)o->B * o->T * run->world;
    if (micro_tokens > INT_MAX) fail("flags -b/-t: %lld tokens per micro-step is too many", micro_tokens);
    long long total = o->total_batch_tokens == -1 ? micro_tokens : o->total_batch_tokens;
    if (total < 1 || total % micro_tokens != 0)
        fail("flag -d: %lld tokens per step is not a positive multiple of B*T*processes = %d*%d*%d = %lld",
             total, o->B, o->T, run->world, micro_tokens);
    run->grad_accum = (int)(total / micro_tokens);
}

/* Where setup notes go: stdout, except under --plan-json, whose stdout is the JSON alone. */
static inline FILE* setup_notes(const TrainOptions* o) { return o->plan_json ? stderr : stdout; }

/* -r auto: the per-layer choice with the least predicted time that fits the
 * budget, printed as the -r flag that reproduces it; or the flags that would
 * fit and a non-zero exit. */
static inline void resolve_auto_recompute(Run* run, PlanSpec* spec) {
    const char* source = "";
    size_t budget = memory_budget(run->opt.mem_budget, &source);
    if (!budget) fail("-r auto: no memory budget known: give --mem-budget");
    if (recompute_auto(spec, budget, run->layer_mode) != 0) {
        fflush(stdout);
        fprintf(stderr, "-r auto: even full recompute on every layer (%.1f MiB) does not fit %.1f MiB (%s)\n",
                mib(plan_total_for(spec, RECOMPUTE_FULL, spec->B, spec->T)), mib(budget), source);
        plan_print_suggestions(spec, budget, stderr);
        fail("-r auto: nothing fits in %.1f MiB", mib(budget));
    }
    char flag[8192];
    format_recompute_flag(run->layer_mode, run->cfg.num_layers, flag, sizeof(flag));
    double extra = 0.0, secs = plan_predicted_seconds(spec, NULL, &extra);
    FILE* out = setup_notes(&run->opt);
    fprintf(out, "recompute auto: fits %.1f MiB (%s) with %.1f MiB: -r %s; predicted %.1f ms per step, +%.1f%% time over -r 0 (cost model %s)\n",
            mib(budget), source, mib(plan_total_for(spec, -1, spec->B, spec->T)), flag, 1e3 * secs, 100.0 * extra,
            spec_cost_model(spec).name);
}

/* --plan and --plan-json: print and exit without allocating anything. */
static inline void maybe_print_plan_and_exit(const Run* run) {
    if (!run->opt.plan_only && !run->opt.plan_json) return;
    const char* source = "";
    size_t budget = memory_budget(run->opt.mem_budget, &source);
    if (run->opt.plan_json) {
        plan_print_json(&run->plan, budget, stdout);
    } else {
        printf("model: %s\n", run->model_desc);
        plan_print_table(&run->plan, budget, source, stdout);
    }
    exit(0);
}

/* The default data is not in the repository: say how to make it, before
 * anything is allocated. */
static inline void check_default_data(const TrainOptions* o) {
    const char* flags[2] = {"-i", "-j"};
    const char* given[2] = {o->train_glob, o->val_every > 0 ? o->val_glob : ""};
    const char* defaults[2] = {DEFAULT_TRAIN_GLOB, DEFAULT_VAL_GLOB};
    for (int i = 0; i < 2; i++)
        if (strcmp(given[i], defaults[i]) == 0 && access(defaults[i], R_OK) != 0)
            fail("%s: the default data %s is missing: make it with python3 dev/data/tinyshakespeare.py, or give %s", flags[i],
                 defaults[i], flags[i]);
}

/* Everything a trainer needs before it allocates: flags, model, plan.
 * Handles --plan/--plan-json itself (they exit here). */
static inline void run_setup(Run* run, int argc, char** argv, int trainer, int elem_bytes, int stat_bytes,
                             int master_weights_supported, size_t workspace_bytes, int logits_chunk_rows) {
    memset(run, 0, sizeof(*run));
    parse_args(argc, argv, &run->opt, trainer);
    proc_set_collective_timeout(run->opt.collective_timeout_s);
    run->rank = remat_proc.rank;
    run->world = run->opt.plan_processes ? run->opt.plan_processes : remat_proc.world;
    if (run->opt.zero_stage == 1 && run->world == 1)
        fprintf(setup_notes(&run->opt), "note: -z 1 with one process shards nothing\n");
    resolve_model(run);
    resolve_recompute(run);
    resolve_batch(run);
    check_dropout_limits(run);
    ranks_check_same(&run->opt, &run->cfg, NULL, NULL, 0);
    PlanSpec spec;
    memset(&spec, 0, sizeof(spec));
    spec.cfg = run->cfg;
    spec.B = run->opt.B;
    spec.T = run->opt.T;
    spec.backend = trainer == FOR_GPU ? BACKEND_GPU : BACKEND_CPU;
    spec.elem_bytes = elem_bytes;
    spec.stat_bytes = stat_bytes;
    spec.master_weights = master_weights_supported && run->opt.master_weights;
    spec.world_size = run->world;
    spec.zero_stage = run->opt.zero_stage;
    spec.layer_mode = run->layer_mode;
    spec.grad_accum = run->grad_accum;
    cost_model_resolve(run->opt.cost_model, remat_device_name_hook ? remat_device_name_hook() : NULL, &spec.cost_model);
    spec.logits_chunk_rows = logits_chunk_rows;
    spec.micro_steps = run->grad_accum;
    spec.fp32_grad_sums = elem_bytes < 4; /* fp32 storage already sums in fp32 */
    spec.io_chunk_floats = (size_t)1 << 18;
    spec.workspace_bytes = workspace_bytes;
    plan_validate_spec(&spec);
    if (strcmp(run->opt.recompute, "auto") == 0) resolve_auto_recompute(run, &spec);
    plan_build(&run->plan, &spec);
    if (run->plan.overflow)
        fail("model shape and batch: the memory plan exceeds 2^64 bytes (-b %d -t %d, %d layers, C=%d): no machine can hold it",
             run->opt.B, run->opt.T, run->cfg.num_layers, run->cfg.channels);
    run->io_chunk_floats = spec.io_chunk_floats;
    maybe_print_plan_and_exit(run);
    check_default_data(&run->opt);
}

static inline void run_print_header(const Run* run) {
    const ModelConfig* c = &run->cfg;
    printf("model: %s\n", run->model_desc);
    printf("  L=%d NH=%d C=%d V=%d Vp=%d maxT=%d, %zu parameters\n", c->num_layers, c->num_heads, c->channels,
           c->vocab_size, c->padded_vocab_size, c->max_seq_len, run->plan.num_params);
    printf("batch: B=%d T=%d x %d process%s, gradient accumulation %d (%lld tokens per step)\n", run->opt.B,
           run->opt.T, run->world, run->world == 1 ? "" : "es", run->grad_accum,
           (long long)run->grad_accum * run->opt.B * run->opt.T * run->world);
    if (run->dropout_desc[0]) printf("%s\n", run->dropout_desc);
    plan_print_summary(&run->plan, stdout);
    const char* big = "";
    size_t largest = plan_largest_entry(&run->plan, &big);
    printf("  largest buffer: %s, %.1f MiB (no buffer grows with T^2)\n", big, mib(largest));
}

/* ---- parameters and checkpoints ---- */

/* Copies n parameters from file element `from` to backend element `to`, in chunks. */
static inline void copy_from_file(Backend* be, FILE* f, const ModelFileInfo* info, size_t from, size_t to, size_t n,
                                  size_t chunk, const char* path) {
    for (size_t s = 0; s < n; s += chunk) {
        size_t k = n - s < chunk ? n - s : chunk;
        model_file_read_at(f, info, from + s, be->io_chunk, k, path);
        be->transfer(be->ctx, TENSOR_PARAMS, to + s, k, be->io_chunk, 0);
    }
}

/* Row r of a position table of `rows` rows interpolated linearly from the
 * file's `file_rows` learned rows, whose first and last rows stay in place. */
static inline void interpolate_position_row(const float* table, size_t file_rows, size_t rows, size_t r, size_t C, float* out) {
    double pos = rows > 1 ? (double)r * (double)(file_rows - 1) / (double)(rows - 1) : 0.0;
    size_t lo = (size_t)pos, hi = lo + 1 < file_rows ? lo + 1 : lo;
    float frac = (float)(pos - (double)lo);
    for (size_t c = 0; c < C; c++) out[c] = table[lo * C + c] * (1.0f - frac) + table[hi * C + c] * frac;
}

/* The position table when --max-seq-len lengthened it, interpolated: the
 * file's table is read whole, the new one sent a chunk of rows at a time. */
static inline void load_interpolated_positions(Run* run, Backend* be, FILE* f, const ModelFileInfo* info, size_t from,
                                               size_t to, size_t chunk) {
    size_t C = (size_t)run->cfg.channels, file_rows = (size_t)info->cfg.max_seq_len, rows = (size_t)run->cfg.max_seq_len;
    float* table = (float*)malloc_check(file_rows * C * sizeof(float), "position table");
    model_file_read_at(f, info, from, table, file_rows * C, run->model_path);
    size_t rows_per_chunk = chunk / C;
    for (size_t r = 0; r < rows; r += rows_per_chunk) {
        size_t k = rows - r < rows_per_chunk ? rows - r : rows_per_chunk;
        for (size_t i = 0; i < k; i++) interpolate_position_row(table, file_rows, rows, r + i, C, be->io_chunk + i * C);
        be->transfer(be->ctx, TENSOR_PARAMS, to + r * C, k * C, be->io_chunk, 0);
    }
    free(table);
}

/* Parameters from the model file, tensor by tensor. When --max-seq-len
 * resized the position table, a shorter one keeps the first rows; a longer
 * one (long-context fine-tuning) starts, with --wpe-init tile, with row t =
 * the file's row t mod maxT (the learned positions repeated), or with
 * --wpe-init interpolate, the learned rows stretched over the new length. */
static inline void load_parameters_from_file(Run* run, Backend* be, size_t chunk) {
    ModelFileInfo info;
    FILE* f = model_file_open(run->model_path, &info);
    ParamLayout file_pl, run_pl;
    param_layout(&info.cfg, &file_pl);
    param_layout(&run->cfg, &run_pl);
    size_t C = (size_t)run->cfg.channels, file_rows = (size_t)info.cfg.max_seq_len, rows = (size_t)run->cfg.max_seq_len;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (t != P_WPE) {
            copy_from_file(be, f, &info, file_pl.offset[t], run_pl.offset[t], run_pl.count[t], chunk, run->model_path);
        } else if (rows > file_rows && strcmp(run->opt.wpe_init, "interpolate") == 0) {
            load_interpolated_positions(run, be, f, &info, file_pl.offset[t], run_pl.offset[t], chunk);
        } else {
            for (size_t r = 0; r < rows;) {
                size_t src = r % file_rows, k = file_rows - src < rows - r ? file_rows - src : rows - r;
                copy_from_file(be, f, &info, file_pl.offset[t] + src * C, run_pl.offset[t] + r * C, k * C, chunk, run->model_path);
                r += k;
            }
        }
    }
    fclose(f);
}

static inline void load_parameters(Run* run, Backend* be) {
    size_t chunk = run->io_chunk_floats / 2; /* half: bf16 staging */
    if (run->model_path) { load_parameters_from_file(run, be, chunk); return; }
    ParamLayout pl;
    param_layout(&run->cfg, &pl);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++)
        for (size_t s = 0; s < pl.count[t]; s += chunk) {
            size_t n = pl.count[t] - s < chunk ? pl.count[t] - s : chunk;
            param_init_chunk(&run->cfg, (uint64_t)run->opt.seed, t, s, n, be->io_chunk);
            be->transfer(be->ctx, TENSOR_PARAMS, pl.offset[t] + s, n, be->io_chunk, 0);
        }
}

static const char* const state_tensor_names[4] = {"parameters", "master weights", "AdamW m", "AdamW v"};

/* A state about to be saved must be finite: a non-finite one (an update that
 * diverged, the last one included) stops the run before any checkpoint of
 * it is complete. The values pass through host memory on their way to the
 * file anyway, so on the GPU too this costs no extra transfer. */
static inline void check_finite_chunk(const float* x, size_t n, int tensor, size_t first, int step, AtomicFile* af) {
    for (size_t i = 0; i < n; i++) {
        if (isfinite(x[i])) continue;
        if (af) atomic_abort(af);
        fail("step %d: %s element %zu is %g: the training state diverged (lower -l, or keep --grad-clip on); no checkpoint "
             "of it is written", step, state_tensor_names[tensor], first + i, (double)x[i]);
    }
}

/* Streams a state tensor of n elements from element `start` between a file
 * (af's when writing, f when reading) and the backend. */
static inline void stream_tensor(Run* run, Backend* be, int tensor, size_t start, size_t n, FILE* f, const char* path,
                                 AtomicFile* af, int step) {
    size_t chunk = run->io_chunk_floats;
    for (size_t s = 0; s < n; s += chunk) {
        size_t k = n - s < chunk ? n - s : chunk;
        if (af) {
            be->transfer(be->ctx, tensor, start + s, k, be->io_chunk, 1);
            check_finite_chunk(be->io_chunk, k, tensor, start + s, step, af);
            fwrite_check(be->io_chunk, 4, k, af->f, path);
        } else {
            fread_check(be->io_chunk, 4, k, f, path);
            be->transfer(be->ctx, tensor, start + s, k, be->io_chunk, 0);
        }
    }
}

static inline void save_model_file(Run* run, Backend* be, const char* path, int step) {
    AtomicFile af;
    atomic_open(&af, path);
    /* the run's dropout goes with the model, as save_pretrained's config does (a resume reads it back) */
    const float pdrop[MODEL_NUM_PDROP] = {run->opt.embd_dropout, run->opt.attn_dropout, run->opt.resid_dropout};
    model_file_write_header(af.f, &run->cfg, be->model_file_version, pdrop, path);
    int32_t id_slots[2];
    put64(id_slots, 0, run->run_id);
    fseek_check(af.f, 4L * MODEL_RUN_ID_SLOT, SEEK_SET, af.tmp_path);
    fwrite_check(id_slots, 4, 2, af.f, af.tmp_path);
    fseek_check(af.f, 1024, SEEK_SET, af.tmp_path);
    size_t n_total = run->plan.num_params, chunk = run->io_chunk_floats;
    for (size_t s = 0; s < n_total; s += chunk) {
        size_t n = n_total - s < chunk ? n_total - s : chunk;
        be->transfer(be->ctx, TENSOR_PARAMS, s, n, be->io_chunk, 1);
        check_finite_chunk(be->io_chunk, n, TENSOR_PARAMS, s, step, &af);
        model_file_write_chunk(af.f, be->model_file_version, be->io_chunk, n, path);
    }
    atomic_commit(&af);
}

/* Without -o nothing is saved, but a run that ends with a non-finite model
 * still must not exit 0. */
static inline void check_parameters_finite(Run* run, Backend* be, int step) {
    size_t n_total = run->plan.num_params, chunk = run->io_chunk_floats;
    for (size_t s = 0; s < n_total; s += chunk) {
        size_t n = n_total - s < chunk ? n_total - s : chunk;
        be->transfer(be->ctx, TENSOR_PARAMS, s, n, be->io_chunk, 1);
        check_finite_chunk(be->io_chunk, n, TENSOR_PARAMS, s, step, NULL);
    }
}

static inline int run_tokens_per_step(const Run* run) { return run->grad_accum * run->opt.B * run->opt.T * run->world; }

/* The parameters whose optimizer state this rank holds: all of them, or its
 * ZeRO-1 shard. */
static inline void run_shard(const Run* run, size_t* start, size_t* count) {
    if (run->plan.shard_params == run->plan.num_params) { *start = 0; *count = run->plan.num_params; return; }
    shard_range(run->plan.num_params, run->world, run->rank, start, count);
}

static inline void save_checkpoint(Run* run, Backend* be, int step, const DataLoader* loader) {
    const char* dir = run->opt.out_dir;
    char path[4200];
    if (run->rank == 0) {
        checkpoint_path(path, sizeof(path), dir, "model", step, -1);
        save_model_file(run, be, path, step);
    }
    TrainState st;
    memset(&st, 0, sizeof(st));
    st.step = step; st.world = run->world; st.rank = run->rank; st.zero_stage = run->opt.zero_stage;
    st.has_master = run->plan.spec.master_weights; st.B = run->opt.B; st.T = run->opt.T;
    st.loader = dataloader_get_state(loader);
    st.num_params = run->plan.num_params;
    run_shard(run, &st.shard_start, &st.shard_params);
    st.loss_scale = run->scaler.scale;
    st.clean_steps = run->scaler.clean_steps;
    st.updates = run->updates;
    st.device = be->device;
    st.run_id = run->run_id;
    hparams_pack(&run->opt, run_tokens_per_step(run), st.hparams);
    checkpoint_path(path, sizeof(path), dir, "state", step, run->rank);
    AtomicFile af;
    atomic_open(&af, path);
    state_header_write(af.f, &st, path);
    stream_tensor(run, be, TENSOR_ADAM_M, st.shard_start, st.shard_params, NULL, path, &af, step);
    stream_tensor(run, be, TENSOR_ADAM_V, st.shard_start, st.shard_params, NULL, path, &af, step);
    if (st.has_master) stream_tensor(run, be, TENSOR_MASTER, st.shard_start, st.shard_params, NULL, path, &af, step);
    atomic_commit(&af);
    proc_barrier("the checkpoint barrier"); /* complete only when every rank has written */
    if (run->rank == 0) {
        checkpoint_write_marker(dir, step, run->run_id);
        checkpoint_retain(dir, run->opt.keep_last, run->opt.keep_every);
    }
    printf("checkpoint: step %d written to %s\n", step, dir);
}

/* A resume on another GPU model or library version continues correctly but
 * not bitwise as the run would have without stopping: say so, once. */
static inline void warn_if_other_device(const DeviceRecord* saved, const DeviceRecord* now, const char* path) {
    if (!saved->name[0] || device_record_equal(saved, now)) return;
    char a[200], b[200];
    device_record_format(saved, a, sizeof(a));
    device_record_format(now, b, sizeof(b));
    fprintf(stderr, "warning: %s was written on %s; this run is on %s: it continues, but is not bitwise the run that did not stop"
                    " (cuBLASLt and NCCL choose by GPU model and version)\n", path, a, b);
}

/* Restores optimizer state and data position; the parameters were loaded
 * from the checkpoint's model file. Returns the step to continue after. */
static inline int load_checkpoint(Run* run, Backend* be, DataLoader* loader) {
    char path[4200];
    TrainState st;
    checkpoint_path(path, sizeof(path), run->opt.out_dir, "state", run->resume_step, 0);
    fclose(state_open(path, &st));
    if (st.world != run->world)
        fail("%s: checkpoint written by %d process%s; resume needs the same number (this run has %d)", path, st.world,
             st.world == 1 ? "" : "es", run->world);
    checkpoint_path(path, sizeof(path), run->opt.out_dir, "state", run->resume_step, run->rank);
    FILE* f = state_open(path, &st);
    if (st.world != run->world)
        fail("%s: checkpoint written by %d process%s; resume needs the same number (this run has %d)", path, st.world,
             st.world == 1 ? "" : "es", run->world);
    if (st.B != run->opt.B || st.T != run->opt.T)
        fail("%s: checkpoint written with B=%d T=%d; resume needs the same (-b %d -t %d given)", path, st.B, st.T, run->opt.B, run->opt.T);
    if (st.zero_stage != run->opt.zero_stage) fail("%s: checkpoint written with -z %d; resume needs the same", path, st.zero_stage);
    size_t my_start, my_count;
    run_shard(run, &my_start, &my_count);
    if (st.num_params != run->plan.num_params || st.shard_params != my_count || st.shard_start != my_start)
        fail("%s: parameter count or shard does not match this run", path);
    if (st.has_master != run->plan.spec.master_weights) fail("%s: checkpoint master-weight setting (-w) differs from this run", path);
    if (!(st.loss_scale >= 1.0f) || st.clean_steps < 0 || st.updates < 0 || st.updates > st.step)
        fail("%s: corrupt loss-scaler or step state in the header", path);
    if (st.run_id != run->run_id)
        fail("%s: written by run %016llx, its DONE marker names run %016llx: the checkpoint mixes two runs' files", path,
             (unsigned long long)st.run_id, (unsigned long long)run->run_id);
    hparams_check(&run->opt, run_tokens_per_step(run), st.hparams, path);
    run->scaler.scale = st.loss_scale;
    run->scaler.clean_steps = st.clean_steps;
    run->updates = st.updates;
    warn_if_other_device(&st.device, &be->device, path);
    stream_tensor(run, be, TENSOR_ADAM_M, st.shard_start, st.shard_params, f, path, NULL, 0);
    stream_tensor(run, be, TENSOR_ADAM_V, st.shard_start, st.shard_params, f, path, NULL, 0);
    if (st.has_master) stream_tensor(run, be, TENSOR_MASTER, st.shard_start, st.shard_params, f, path, NULL, 0);
    fclose(f);
    dataloader_set_state(loader, st.loader, path);
    printf("resumed: step %d from %s\n", st.step, run->opt.out_dir);
    return st.step;
}

/* ---- evaluation and sampling ---- */

/* --eval-by-position: buckets [0,W), [W,2W), [2W,4W), ... of the positions
 * 0..T-1, the loss summed per bucket over every validation token. */
#define MAX_POSITION_BUCKETS 32
typedef struct {
    int n;
    int begin[MAX_POSITION_BUCKETS], end[MAX_POSITION_BUCKETS];
    double loss_sum[MAX_POSITION_BUCKETS], tokens[MAX_POSITION_BUCKETS];
    int* bucket_of;    /* (T) bucket of each position */
    float* losses;     /* (B*T) host copy of the last batch's losses */
} PositionLosses;

/* What the loop keeps between steps: data, tokenizer, log, sampling buffers. */
typedef struct {
    DataLoader train, val;
    int has_val;
    Tokenizer tk;
    Logger log;
    float* probs;
    int* gen;
    SampleCandidate* candidates;
    Prompt prompt;
    PositionLosses by_position;
} LoopState;

static inline void position_losses_init(PositionLosses* pl, int width, int B, int T) {
    memset(pl, 0, sizeof(*pl));
    if (width <= 0) return;
    pl->bucket_of = (int*)malloc_check((size_t)T * sizeof(int), "position buckets");
    pl->losses = (float*)malloc_check((size_t)B * T * sizeof(float), "position buckets");
    for (long begin = 0, end = width; begin < T; begin = end, end *= 2) {
        pl->begin[pl->n] = (int)begin;
        pl->end[pl->n] = (int)(end < T ? end : T);
        for (long t = begin; t < pl->end[pl->n]; t++) pl->bucket_of[t] = pl->n;
        pl->n++;
    }
}

static inline void position_losses_add(PositionLosses* pl, Backend* be, int B, int T) {
    be->token_losses(be->ctx, pl->losses);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            pl->loss_sum[pl->bucket_of[t]] += (double)pl->losses[(size_t)b * T + t];
            pl->tokens[pl->bucket_of[t]] += 1.0;
        }
}

static inline void position_losses_free(PositionLosses* pl) {
    free(pl->bucket_of);
    free(pl->losses);
}

/* "1k" for multiples of 1024, else the number. */
static inline void position_label(int pos, char* buf, size_t n) {
    if (pos > 0 && pos % 1024 == 0) snprintf(buf, n, "%dk", pos / 1024);
    else snprintf(buf, n, "%d", pos);
}

static inline void print_position_losses(const PositionLosses* pl, int step, Logger* log) {
    printf("val loss by position at step %d:", step);
    float loss[MAX_POSITION_BUCKETS];
    for (int i = 0; i < pl->n; i++) {
        char a[16], b[16];
        position_label(pl->begin[i], a, sizeof(a));
        position_label(pl->end[i], b, sizeof(b));
        loss[i] = (float)(pl->loss_sum[i] / pl->tokens[i]);
        printf("%s %s-%s %.6f", i ? " |" : "", a, b, (double)loss[i]);
    }
    printf("\n");
    logger_val_by_position(log, step, pl->n, pl->begin, pl->end, loss, pl->tokens);
}

/* Mean validation loss over at most -m batches; with --eval-by-position
 * also per position bucket (summed over processes), printed and logged. */
static inline float evaluate(Run* run, Backend* be, DataLoader* val, PositionLosses* pl, int step, Logger* log) {
    dataloader_reset(val);
    size_t batches = dataloader_batches_per_epoch(val);
    int n = (size_t)run->opt.val_batches < batches ? run->opt.val_batches : (int)batches;
    for (int i = 0; i < pl->n; i++) pl->loss_sum[i] = pl->tokens[i] = 0.0;
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        dataloader_next(val);
        sum += be->forward_loss(be->ctx);
        if (pl->n) position_losses_add(pl, be, run->opt.B, run->opt.T);
    }
    for (int i = 0; i < pl->n; i++) {
        pl->loss_sum[i] = proc_sum(pl->loss_sum[i], "the validation sums by position");
        pl->tokens[i] = proc_sum(pl->tokens[i], "the validation sums by position");
    }
    float mean = (float)proc_mean(sum / n, "the validation loss mean");
    printf("val loss %.6f at step %d\n", (double)mean, step);
    logger_val(log, step, mean);
    if (pl->n && run->rank == 0) print_position_losses(pl, step, log);
    return mean;
}

static inline int end_of_text(const Run* run, const Tokenizer* tk) {
    if (tk->loaded && tk->eot_token >= 0 && tk->eot_token < run->cfg.vocab_size) return tk->eot_token;
    return run->cfg.vocab_size == 50257 ? 50256 : run->cfg.vocab_size - 1;
}

/* The context a sample starts from: end-of-text (a document start, as in the
 * training data), then the prompt's tokens (its own leading end-of-text is
 * not doubled). Returns its length; checks the prompt fits T with room to
 * generate. */
static inline int sample_context(const Run* run, const Tokenizer* tk, const Prompt* prompt, int* tokens) {
    int n = 0, eot = end_of_text(run, tk);
    tokens[n++] = eot;
    for (int i = 0; i < prompt->n; i++) {
        if (prompt->ids[i] >= run->cfg.vocab_size)
            fail("prompt: token %d at position %d is not below the vocabulary size %d", prompt->ids[i], i, run->cfg.vocab_size);
        if (i == 0 && prompt->ids[0] == eot) continue;
        if (n >= run->opt.T) fail("prompt: %d tokens (with the leading end-of-text) leave no room to generate within -t %d", prompt->n + 1, run->opt.T);
        tokens[n++] = prompt->ids[i];
    }
    return n;
}

static inline void sample(Run* run, Backend* be, LoopState* ls, int step) {
    const TrainOptions* o = &run->opt;
    int* tokens = ls->gen;
    int start = sample_context(run, &ls->tk, &ls->prompt, tokens);
    int n = o->gen_tokens < o->T - start ? o->gen_tokens : o->T - start;
    Utf8Stream text = {{0}, 0, 0};
    printf("sample at step %d:\n---\n", step);
    for (int i = 1; i < start; i++) tokenizer_print(&ls->tk, tokens[i], &text, stdout);
    for (int i = start; i < start + n; i++) {
        be->next_token_probs(be->ctx, tokens, i, ls->probs);
        float u = sampler_uniform((uint64_t)o->seed, step, i - start + 1);
        tokens[i] = sample_next(ls->probs, run->cfg.vocab_size, o->temperature, o->top_k, u, ls->candidates);
        tokenizer_print(&ls->tk, tokens[i], &text, stdout);
    }
    utf8_finish(&text, stdout);
    printf("\n---\n");
    fflush(stdout);
}

/* --prompt or --prompt-tokens, for rank 0 when it samples. */
static inline void load_prompt(Run* run, LoopState* ls) {
    const TrainOptions* o = &run->opt;
    memset(&ls->prompt, 0, sizeof(ls->prompt));
    if ((o->prompt[0] || o->prompt_tokens[0]) && o->sample_every == 0) fail("--prompt/--prompt-tokens: -s 0 takes no samples");
    if (run->rank != 0 || o->sample_every == 0) return;
    if (o->prompt_tokens[0]) prompt_load_file(&ls->prompt, o->prompt_tokens);
    else if (o->prompt[0]) prompt_from_helper(&ls->prompt, o->prompt, ls->tk.loaded ? ls->tk.path : NULL);
    sample_context(run, &ls->tk, &ls->prompt, ls->gen); /* fails now, not at the first sample, when it does not fit */
}

/* Default tokenizer: *tokenizer.bin beside the first train shard, else gpt2_tokenizer.bin. */
static inline void load_tokenizer(Run* run, Tokenizer* tk) {
    memset(tk, 0, sizeof(*tk));
    const char* given = run->opt.tokenizer_path;
    if (given[0]) { tokenizer_load(tk, given); return; }
    glob_t g;
    char pattern[4300];
    const char* slash = strrchr(run->opt.train_glob, '/');
    int dirlen = slash ? (int)(slash - run->opt.train_glob) : 1;
    snprintf(pattern, sizeof(pattern), "%.*s/*tokenizer.bin", dirlen, slash ? run->opt.train_glob : ".");
    if (glob(pattern, 0, NULL, &g) == 0 && g.gl_pathc > 0) tokenizer_load(tk, g.gl_pathv[0]);
    else if (file_exists("gpt2_tokenizer.bin")) tokenizer_load(tk, "gpt2_tokenizer.bin");
    else printf("tokenizer: none found, samples print token ids (see --tokenizer)\n");
    globfree(&g);
}

/* ---- the loop ---- */

static inline long peak_rss_kib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

static inline int total_steps(const Run* run, const DataLoader* train) {
    if (run->opt.max_steps >= 0) return run->opt.max_steps;
    size_t steps = dataloader_batches_per_epoch(train) / (size_t)run->grad_accum;
    return steps ? (int)(steps > INT_MAX ? INT_MAX : steps) : 1;
}

typedef struct {
    float loss, norm, lr;
    int skipped; /* FP16: gradients overflowed, no update */
} StepResult;

static inline StepResult train_step(Run* run, Backend* be, DataLoader* train, int step, int steps) {
    const TrainOptions* o = &run->opt;
    StepResult r = {0.0f, 0.0f, 0.0f, 0};
    be->zero_grads(be->ctx);
    double loss = 0.0;
    float scale = loss_scaler_factor(&run->scaler);
    /* summing over processes then gives the gradient of the mean loss of the global batch */
    float dloss_mean = scale / (float)(run->grad_accum * run->world);
    DropoutState drop = run->dropout; /* the masks depend on the step and micro-step, never on what ran before */
    drop.step = (uint32_t)step;
    for (int micro = 0; micro < run->grad_accum; micro++) {
        dataloader_next(train);
        drop.micro_step = (uint32_t)micro;
        be->set_dropout(be->ctx, &drop);
        loss += be->forward_backward(be->ctx, dloss_mean);
    }
    if (be->sync_grads) be->sync_grads(be->ctx);
    r.loss = (float)proc_mean(loss / run->grad_accum, "the training loss mean");
    r.norm = be->grad_norm(be->ctx) / scale;
    r.lr = learning_rate(o->schedule, o->lr, o->final_lr_frac, o->warmup_steps, step - 1, steps);
    int finite = isfinite(r.norm) && isfinite(r.loss);
    if (!loss_scaler_update(&run->scaler, finite)) {
        if (run->scaler.scale <= run->scaler.min_scale)
            fail("step %d: gradients overflow even at the minimum loss scale %g: the model exceeds fp16's range (train in BF16)",
                 step, (double)run->scaler.min_scale);
        r.skipped = 1;
        return r;
    }
    if (!finite) fail("step %d: loss %g, gradient norm %g: training diverged (lower -l, or keep --grad-clip on)", step, (double)r.loss, (double)r.norm);
    AdamWStep s;
    s.lr = r.lr;
    s.beta1 = o->beta1; s.beta2 = o->beta2; s.eps = o->eps; s.weight_decay = o->weight_decay;
    float clip = (o->grad_clip > 0.0f && r.norm > o->grad_clip) ? o->grad_clip / r.norm : 1.0f;
    s.grad_scale = clip / scale;
    s.t = ++run->updates;
    adamw_bias_corrections(&s);
    be->update(be->ctx, &s);
    return r;
}

static inline int is_due(int every, int step, int last) { return every > 0 && (step % every == 0 || last); }

/* What happens between steps, at step `step` (after that many updates):
 * validation, a sample, a checkpoint. None of it changes the training state. */
static inline void between_steps(Run* run, Backend* be, LoopState* ls, int step, int start, int last) {
    const TrainOptions* o = &run->opt;
    if (ls->has_val && is_due(o->val_every, step, last)) evaluate(run, be, &ls->val, &ls->by_position, step, &ls->log);
    /* not at the step a run starts from (its model was sampled when saved),
     * unless nothing is trained: -x 0 (or resuming at -x) samples the model loaded */
    int sample_now = step > start || last;
    if (run->rank == 0 && sample_now && is_due(o->sample_every, step, last))
        sample(run, be, ls, step);
    if (o->out_dir[0] && step > start && (is_due(o->checkpoint_every, step, 0) || last))
        save_checkpoint(run, be, step, &ls->train);
    else if (last && step > start && !o->out_dir[0])
        check_parameters_finite(run, be, step);
}

static inline void report_step(Run* run, Backend* be, LoopState* ls, int step, int steps, const StepResult* r, double ms) {
    if (r->skipped) {
        printf("step %4d/%d | loss %.6f | skipped: inf/NaN gradients, loss scale now %g\n", step, steps, (double)r->loss,
               (double)run->scaler.scale);
        logger_event(&ls->log, step, "skipped: inf/NaN gradients, loss scale halved");
        return;
    }
    double tokens_per_s = (double)run->grad_accum * run->opt.B * run->opt.T * run->world / (ms / 1e3);
    char extras[256] = "";
    if (be->step_extras) be->step_extras(be->ctx, step, ms, extras, sizeof(extras));
    printf("step %4d/%d | loss %.6f | lr %.4e | norm %.4f | %.2f ms | %.0f tok/s%s\n", step, steps, (double)r->loss,
           (double)r->lr, (double)r->norm, ms, tokens_per_s, extras);
    fflush(stdout);
    long long tokens = (long long)step * run->grad_accum * run->opt.B * run->opt.T * run->world;
    size_t memory = be->memory_bytes ? be->memory_bytes(be->ctx) : (size_t)peak_rss_kib() * 1024;
    logger_train(&ls->log, step, r->loss, r->lr, r->norm, ms, tokens_per_s, tokens, mib(memory));
}

/* Data loaders (validated here, before any step), tokenizer, log, buffers. */
static inline void loop_open(Run* run, Backend* be, LoopState* ls) {
    const TrainOptions* o = &run->opt;
    uint16_t* staging = (uint16_t*)be->io_chunk;
    size_t staging_tokens = run->io_chunk_floats * 2;
    dataloader_init(&ls->train, "-i", o->train_glob, o->B, o->T, run->rank, run->world, run->cfg.vocab_size,
                    o->shuffle, (uint64_t)o->seed, be->window, be->inputs, be->targets, staging, staging_tokens);
    ls->has_val = o->val_glob[0] != '\0' && o->val_every > 0;
    if (ls->has_val)
        dataloader_init(&ls->val, "-j", o->val_glob, o->B, o->T, run->rank, run->world, run->cfg.vocab_size, 0,
                        (uint64_t)o->seed, be->window, be->inputs, be->targets, staging, staging_tokens);
    load_tokenizer(run, &ls->tk);
    if (o->out_dir[0]) mkdir_check(o->out_dir);
    /* a fresh run: --supersede's checkpoints, or incomplete leftovers, go before anything is written */
    if (o->out_dir[0] && run->resume_step < 0 && run->rank == 0) {
        int removed = checkpoint_remove_all(o->out_dir);
        if (removed) printf("checkpoints: removed %d earlier checkpoint%s from %s\n", removed, removed == 1 ? "" : "s", o->out_dir);
    }
    proc_barrier("the barrier after clearing -o");
    logger_open(&ls->log, run->rank == 0 ? o->out_dir : NULL, run->resume_step);
    ls->probs = (float*)malloc_check((size_t)run->cfg.vocab_size * sizeof(float), "sampler");
    ls->gen = (int*)malloc_check(((size_t)o->T + 1) * sizeof(int), "sampler");
    ls->candidates = (SampleCandidate*)malloc_check((size_t)run->cfg.vocab_size * sizeof(SampleCandidate), "sampler");
    load_prompt(run, ls);
    if (o->eval_by_position && !ls->has_val) fail("--eval-by-position needs validation: shards in -j and -v above 0");
    if (o->eval_by_position && !be->token_losses) fail("--eval-by-position: this trainer cannot report per-token losses");
    position_losses_init(&ls->by_position, o->eval_by_position, o->B, o->T);
}

static inline void loop_close(LoopState* ls) {
    logger_close(&ls->log);
    tokenizer_free(&ls->tk);
    free(ls->probs);
    free(ls->gen);
    free(ls->candidates);
    prompt_free(&ls->prompt);
    position_losses_free(&ls->by_position);
    dataloader_free(&ls->train);
    if (ls->has_val) dataloader_free(&ls->val);
}

static inline uint64_t loader_digest(const DataLoader* dl) {
    uint64_t h = FNV_START;
    for (int i = 0; i < dl->num_shards; i++) h = fnv1a(h, &dl->num_tokens[i], sizeof(size_t));
    return h;
}

/* Ranks that read different data, or would run a different number of
 * steps, would diverge or hang in a collective: refused at start. */
static inline void ranks_check_data_and_steps(const LoopState* ls, int steps) {
    static const char* const names[3] = {"-i (the token counts of the training shards)",
                                         "-j (the token counts of the validation shards)", "the number of steps (-x)"};
    uint64_t v[3] = {loader_digest(&ls->train), ls->has_val ? loader_digest(&ls->val) : 0, (uint64_t)steps};
    ranks_check_same(NULL, NULL, names, v, 3);
}

/* After step `step`: when any rank was signalled, checkpoint that step (with
 * -o) and exit with PREEMPT_EXIT_STATUS. Every rank takes part in the vote,
 * so all stop after the same step. */
static inline void maybe_stop_on_signal(Run* run, Backend* be, LoopState* ls, int step) {
    int sig = (int)proc_max((double)remat_stop_signal, "the stop-signal vote");
    if (!sig) return;
    const char* dir = run->opt.out_dir;
    if (dir[0]) save_checkpoint(run, be, step, &ls->train);
    printf("stopped by %s after step %d: %s\n", preempt_signal_name(sig), step,
           dir[0] ? "checkpoint written, resume with -y 1" : "no -o, nothing saved");
    logger_event(&ls->log, step, "stopped by signal");
    loop_close(ls);
    fflush(stdout);
    exit(PREEMPT_EXIT_STATUS);
}

/* Loads the parameters (or checkpoint), runs all steps, reports. */
static inline void train(Run* run, Backend* be) {
    const MemoryPlan* p = &run->plan;
    load_parameters(run, be);
    loss_scaler_init(&run->scaler, be->loss_scaling);
    run->updates = 0;
    LoopState ls;
    loop_open(run, be, &ls);
    int start = run->resume_step >= 0 ? load_checkpoint(run, be, &ls.train) : 0;
    int steps = total_steps(run, &ls.train);
    ranks_check_data_and_steps(&ls, steps);
    if (start > 0) logger_event(&ls.log, start, "resumed");
    if (steps < start && run->opt.max_steps != 0)
        fail("flag -x: %d steps, but the checkpoint resumed is at step %d (more steps, or -x 0 to evaluate it)", steps, start);
    if (run->opt.max_steps == 0) {
        steps = start; /* -x 0: evaluate (and sample) the model loaded, at its step */
        printf("training: none (-x 0): evaluating the model at step %d\n", start);
    } else {
        printf("training: %d steps (from step %d), lr %g %s schedule, warmup %d\n", steps, start + 1, (double)run->opt.lr,
               run->opt.schedule, run->opt.warmup_steps);
    }
    fflush(stdout);
    preempt_install();
    double total_ms = 0.0;
    int timed_steps = 0;
    for (int step = start; step <= steps; step++) {
        proc_set_step(step); /* named by --collective-timeout's messages */
        between_steps(run, be, &ls, step, start, step == steps);
        if (step == steps) break;
        proc_set_step(step + 1);
        proc_test_stall(step + 1);
        if (be->step_begin) be->step_begin(be->ctx, step + 1);
        double t0 = now_ms();
        StepResult r = train_step(run, be, &ls.train, step + 1, steps);
        double ms = now_ms() - t0;
        if (be->step_end) be->step_end(be->ctx, step + 1);
        if (step > start) { total_ms += ms; timed_steps++; } /* the first step warms caches */
        report_step(run, be, &ls, step + 1, steps, &r, ms);
        if (step + 1 < steps) maybe_stop_on_signal(run, be, &ls, step + 1);
    }
    if (timed_steps) printf("average step time %.2f ms over %d steps (first step excluded)\n", total_ms / timed_steps, timed_steps);
    if (p->spec.backend == BACKEND_CPU)
        printf("peak resident memory: %.1f MiB (plan: %.1f MiB)\n", (double)peak_rss_kib() / 1024.0, mib(p->total_bytes));
    else
        printf("peak host resident memory: %.1f MiB\n", (double)peak_rss_kib() / 1024.0);
    loop_close(&ls);
}

#endif
