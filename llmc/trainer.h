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
    float* io_chunk;        /* host staging for files, Run.io_chunk_floats floats */
    uint16_t* window;       /* host B*T+1 tokens for the dataloader */
    /* forward and backward of one micro-batch; gradients accumulate; returns the mean loss */
    float (*forward_backward)(void* ctx, float dloss_mean);
    float (*forward_loss)(void* ctx);
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

static inline void resolve_model(Run* run) {
    TrainOptions* o = &run->opt;
    int shape_flags = o->layers || o->heads || o->channels || o->max_seq_len || o->vocab_size;
    run->resume_step = o->resume ? checkpoint_latest(o->out_dir) : -1;
    proc_broadcast(&run->resume_step, sizeof(run->resume_step)); /* every rank resumes the same step */
    if (o->resume && run->resume_step < 0) fail("-y 1: no complete checkpoint (DONE_* marker) in %s", o->out_dir);
    static char ckpt_model[4200];
    if (run->resume_step >= 0) {
        checkpoint_path(ckpt_model, sizeof(ckpt_model), o->out_dir, "model", run->resume_step, -1);
        run->model_path = ckpt_model;
    } else if (wants_random_init(o)) {
        run->model_path = NULL;
    } else {
        if (o->layers || o->heads || o->channels || o->vocab_size)
            fail("flags --layers/--heads/--channels/--vocab-size apply to random init only, not to the model file %s", o->model);
        run->model_path = o->model;
    }
    if (run->model_path) {
        ModelFileInfo info;
        fclose(model_file_open(run->model_path, &info));
        run->cfg = info.cfg;
        snprintf(run->model_desc, sizeof(run->model_desc), "%s (version %d)", run->model_path, info.version);
        if (run->resume_step < 0 && o->max_seq_len && o->max_seq_len != info.cfg.max_seq_len) {
            /* long-context fine-tuning: a longer (or shorter) position table */
            run->cfg.max_seq_len = o->max_seq_len;
            size_t used = strlen(run->model_desc);
            snprintf(run->model_desc + used, sizeof(run->model_desc) - used, ", position table resized from %d to %d rows%s",
                     info.cfg.max_seq_len, o->max_seq_len, o->max_seq_len > info.cfg.max_seq_len ? " (learned rows repeated)" : "");
        }
        return;
    }
    config_from_descriptor(o->model, &run->cfg);
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
    run->rank = remat_proc.rank;
    run->world = run->opt.plan_processes ? run->opt.plan_processes : remat_proc.world;
    if (run->opt.zero_stage == 1 && run->world == 1)
        fprintf(setup_notes(&run->opt), "note: -z 1 with one process shards nothing\n");
    resolve_model(run);
    resolve_recompute(run);
    resolve_batch(run);
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
    spec.io_chunk_floats = (size_t)1 << 18;
    spec.workspace_bytes = workspace_bytes;
    plan_validate_spec(&spec);
    if (strcmp(run->opt.recompute, "auto") == 0) resolve_auto_recompute(run, &spec);
    plan_build(&run->plan, &spec);
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

/* Parameters from the model file, tensor by tensor. When --max-seq-len
 * resized the position table, row t of the new table is row t mod maxT of
 * the file's: a longer table repeats the learned positions (the usual start
 * for long-context fine-tuning), a shorter one keeps the first rows. */
static inline void load_parameters_from_file(Run* run, Backend* be, size_t chunk) {
    ModelFileInfo info;
    FILE* f = model_file_open(run->model_path, &info);
    ParamLayout file_pl, run_pl;
    param_layout(&info.cfg, &file_pl);
    param_layout(&run->cfg, &run_pl);
    size_t C = (size_t)run->cfg.channels, file_rows = (size_t)info.cfg.max_seq_len;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (t != P_WPE) {
            copy_from_file(be, f, &info, file_pl.offset[t], run_pl.offset[t], run_pl.count[t], chunk, run->model_path);
            continue;
        }
        size_t rows = (size_t)run->cfg.max_seq_len;
        for (size_t r = 0; r < rows;) {
            size_t src = r % file_rows, k = file_rows - src < rows - r ? file_rows - src : rows - r;
            copy_from_file(be, f, &info, file_pl.offset[t] + src * C, run_pl.offset[t] + r * C, k * C, chunk, run->model_path);
            r += k;
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

/* Streams a state tensor of n elements from element `start` between a file and the backend. */
static inline void stream_tensor(Run* run, Backend* be, int tensor, size_t start, size_t n, FILE* f, const char* path, int write) {
    size_t chunk = run->io_chunk_floats;
    for (size_t s = 0; s < n; s += chunk) {
        size_t k = n - s < chunk ? n - s : chunk;
        if (write) {
            be->transfer(be->ctx, tensor, start + s, k, be->io_chunk, 1);
            fwrite_check(be->io_chunk, 4, k, f, path);
        } else {
            fread_check(be->io_chunk, 4, k, f, path);
            be->transfer(be->ctx, tensor, start + s, k, be->io_chunk, 0);
        }
    }
}

static inline void save_model_file(Run* run, Backend* be, const char* path) {
    AtomicFile af;
    atomic_open(&af, path);
    model_file_write_header(af.f, &run->cfg, be->model_file_version, path);
    size_t n_total = run->plan.num_params, chunk = run->io_chunk_floats;
    for (size_t s = 0; s < n_total; s += chunk) {
        size_t n = n_total - s < chunk ? n_total - s : chunk;
        be->transfer(be->ctx, TENSOR_PARAMS, s, n, be->io_chunk, 1);
        model_file_write_chunk(af.f, be->model_file_version, be->io_chunk, n, path);
    }
    atomic_commit(&af);
}

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
        save_model_file(run, be, path);
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
    checkpoint_path(path, sizeof(path), dir, "state", step, run->rank);
    AtomicFile af;
    atomic_open(&af, path);
    state_header_write(af.f, &st, path);
    stream_tensor(run, be, TENSOR_ADAM_M, st.shard_start, st.shard_params, af.f, path, 1);
    stream_tensor(run, be, TENSOR_ADAM_V, st.shard_start, st.shard_params, af.f, path, 1);
    if (st.has_master) stream_tensor(run, be, TENSOR_MASTER, st.shard_start, st.shard_params, af.f, path, 1);
    atomic_commit(&af);
    proc_barrier(); /* complete only when every rank has written */
    if (run->rank == 0) checkpoint_write_marker(dir, step);
    printf("checkpoint: step %d written to %s\n", step, dir);
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
    run->scaler.scale = st.loss_scale;
    run->scaler.clean_steps = st.clean_steps;
    run->updates = st.updates;
    stream_tensor(run, be, TENSOR_ADAM_M, st.shard_start, st.shard_params, f, path, 0);
    stream_tensor(run, be, TENSOR_ADAM_V, st.shard_start, st.shard_params, f, path, 0);
    if (st.has_master) stream_tensor(run, be, TENSOR_MASTER, st.shard_start, st.shard_params, f, path, 0);
    fclose(f);
    dataloader_set_state(loader, st.loader, path);
    printf("resumed: step %d from %s\n", st.step, run->opt.out_dir);
    return st.step;
}

/* ---- evaluation and sampling ---- */

static inline float evaluate(Run* run, Backend* be, DataLoader* val) {
    dataloader_reset(val);
    size_t batches = dataloader_batches_per_epoch(val);
    int n = (size_t)run->opt.val_batches < batches ? run->opt.val_batches : (int)batches;
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        dataloader_next(val);
        sum += be->forward_loss(be->ctx);
    }
    return (float)proc_mean(sum / n);
}

static inline int end_of_text(const Run* run, const Tokenizer* tk) {
    if (tk->loaded && tk->eot_token < run->cfg.vocab_size) return tk->eot_token;
    return run->cfg.vocab_size == 50257 ? 50256 : run->cfg.vocab_size - 1;
}

static inline void sample(Run* run, Backend* be, const Tokenizer* tk, int step, float* probs, int* tokens) {
    int n = run->opt.gen_tokens < run->opt.T ? run->opt.gen_tokens : run->opt.T - 1;
    tokens[0] = end_of_text(run, tk);
    printf("sample at step %d:\n---\n", step);
    for (int i = 1; i <= n; i++) {
        be->next_token_probs(be->ctx, tokens, i, probs);
        tokens[i] = sample_token(probs, run->cfg.vocab_size, sampler_uniform((uint64_t)run->opt.seed, step, i));
        tokenizer_print(tk, tokens[i], stdout);
    }
    printf("\n---\n");
    fflush(stdout);
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
    for (int micro = 0; micro < run->grad_accum; micro++) {
        dataloader_next(train);
        loss += be->forward_backward(be->ctx, dloss_mean);
    }
    if (be->sync_grads) be->sync_grads(be->ctx);
    r.loss = (float)proc_mean(loss / run->grad_accum);
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
typedef struct {
    DataLoader train, val;
    int has_val;
    Tokenizer tk;
    Logger log;
    float* probs;
    int* gen;
} LoopState;

static inline void between_steps(Run* run, Backend* be, LoopState* ls, int step, int start, int last) {
    const TrainOptions* o = &run->opt;
    if (ls->has_val && is_due(o->val_every, step, last)) {
        float vl = evaluate(run, be, &ls->val);
        printf("val loss %.6f at step %d\n", (double)vl, step);
        logger_val(&ls->log, step, vl);
    }
    /* not at the step a run starts from (its model was sampled when saved),
     * unless nothing is trained: -x 0 (or resuming at -x) samples the model loaded */
    int sample_now = step > start || last;
    if (run->rank == 0 && sample_now && is_due(o->sample_every, step, last))
        sample(run, be, &ls->tk, step, ls->probs, ls->gen);
    if (o->out_dir[0] && step > start && (is_due(o->checkpoint_every, step, 0) || last))
        save_checkpoint(run, be, step, &ls->train);
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
    logger_train(&ls->log, step, r->loss, r->lr, r->norm, ms, tokens_per_s);
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
    logger_open(&ls->log, run->rank == 0 ? o->out_dir : NULL);
    ls->probs = (float*)malloc_check((size_t)run->cfg.vocab_size * sizeof(float), "sampler");
    ls->gen = (int*)malloc_check(((size_t)o->T + 1) * sizeof(int), "sampler");
}

static inline void loop_close(LoopState* ls) {
    logger_close(&ls->log);
    tokenizer_free(&ls->tk);
    free(ls->probs);
    free(ls->gen);
    dataloader_free(&ls->train);
    if (ls->has_val) dataloader_free(&ls->val);
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
    double total_ms = 0.0;
    int timed_steps = 0;
    for (int step = start; step <= steps; step++) {
        between_steps(run, be, &ls, step, start, step == steps);
        if (step == steps) break;
        if (be->step_begin) be->step_begin(be->ctx, step + 1);
        double t0 = now_ms();
        StepResult r = train_step(run, be, &ls.train, step + 1, steps);
        double ms = now_ms() - t0;
        if (be->step_end) be->step_end(be->ctx, step + 1);
        if (step > start) { total_ms += ms; timed_steps++; } /* the first step warms caches */
        report_step(run, be, &ls, step + 1, steps, &r, ms);
    }
    if (timed_steps) printf("average step time %.2f ms over %d steps (first step excluded)\n", total_ms / timed_steps, timed_steps);
    if (p->spec.backend == BACKEND_CPU)
        printf("peak resident memory: %.1f MiB (plan: %.1f MiB)\n", (double)peak_rss_kib() / 1024.0, mib(p->total_bytes));
    else
        printf("peak host resident memory: %.1f MiB\n", (double)peak_rss_kib() / 1024.0);
    loop_close(&ls);
}

#endif
