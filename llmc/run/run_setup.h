/*
 * Before anything is allocated: flags, model source and shape, recompute
 * choice (with -r auto), batch, dropout, the memory plan (--plan exits here)
 * and the run's identity.
 */
#ifndef REMAT_RUN_SETUP_H
#define REMAT_RUN_SETUP_H

#include "backend.h"
#include "../plan/budget.h"
#include "../plan/plan_search.h"

/* Where setup notes go: stdout, except under --plan-json, whose stdout is the JSON alone. */
static inline FILE* setup_notes(const TrainOptions* o) { return o->plan_json ? stderr : stdout; }

/* True when -e names a descriptor: random init, which the shape flags may adjust. */
static inline int wants_random_init(const TrainOptions* o) {
    ModelConfig tmp;
    return config_from_descriptor(o->model, &tmp) == 0;
}

/* The run id: the checkpoint's on resume (checked against all its files and
 * every other file of -o), else a new one; -y 1 with no checkpoint starts
 * fresh. What a fresh run refuses in -o: output_check, in resolve_model. */
static inline void resolve_run_identity(Run* run) {
    const TrainOptions* o = &run->opt;
    FILE* notes = setup_notes(o);
    if (run->resume_step >= 0) {
        if (run->rank == 0) run->run_id = checkpoint_verify_run_id(o->out_dir, run->resume_step, remat_proc.world);
        if (run->rank == 0) output_check(o->out_dir, OUTPUT_RESUME, NULL, run->run_id);
    } else {
        if (o->resume) fprintf(notes, "resume: no complete checkpoint (DONE_* marker) in %s: starting a fresh run\n", o->out_dir);
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
        run->hp.dropout_flag[k] = NULL;
        if (*site[k] >= 0.0f) { snprintf(from, sizeof(from), "%s", flags[k]); run->hp.dropout_flag[k] = flags[k]; }
        else if (o->dropout >= 0.0f) { *site[k] = o->dropout; snprintf(from, sizeof(from), "--dropout"); run->hp.dropout_flag[k] = "--dropout"; }
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
}

/* Masks are keyed by the global sequence and position (dropout.h): this
 * rank's first sequence is its data-parallel group's first row of the
 * micro-step's batch, whatever N and the number of groups. */
static inline void resolve_dropout_sequences(Run* run) {
    run->dropout.first_sequence = (uint32_t)run->cp.group * (uint32_t)run->opt.B;
    run->dropout.seq_len = run->opt.T;
    run->dropout.heads = run->cfg.num_heads;
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

/* -y 1 takes the model from the checkpoint: the flags that choose or shape
 * a model are said to be ignored rather than silently dropped. */
static inline void note_flags_ignored_on_resume(const Run* run, const char* model_path) {
    static const char* const flags[] = {"-e", "--layers", "--heads", "--channels", "--max-seq-len", "--vocab-size", "--wpe-init"};
    char list[200] = "";
    size_t used = 0;
    for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++)
        if (option_given(&run->opt, flags[i]) && used < sizeof(list))
            used += (size_t)snprintf(list + used, sizeof(list) - used, "%s%s", used ? ", " : "", flags[i]);
    if (used && run->rank == 0)
        fprintf(setup_notes(&run->opt), "resume: %s ignored: the model (its shape and position table) is the checkpoint's, %s\n", list,
                model_path);
}

/* --wpe-init chooses how a lengthened position table starts: any other use
 * would be without effect. */
static inline void check_wpe_init_applies(const Run* run, const ModelFileInfo* file) {
    if (!option_given(&run->opt, "--wpe-init") || run->resume_step >= 0) return;
    if (!file) fail("flag --wpe-init: applies to a model file whose position table --max-seq-len lengthens, not to random init");
    if (file->cfg.positions != POS_LEARNED) fail("flag --wpe-init: %s uses RoPE and has no position table", run->model_path);
    if (run->cfg.max_seq_len <= file->cfg.max_seq_len)
        fail("flag --wpe-init: applies only when --max-seq-len lengthens the position table of %s (%d rows; this run: %d)",
             run->model_path, file->cfg.max_seq_len, run->cfg.max_seq_len);
}

/* --rope-scaling TYPE:FACTOR onto a RoPE model file's configuration whose
 * --max-seq-len this run lengthens from file_max (the original length). */
static inline void apply_rope_scaling(Run* run, const ModelFileInfo* file) {
    const char* flag = run->opt.rope_scaling;
    if (!flag[0] || run->resume_step >= 0) return;
    if (!file) fail("flag --rope-scaling: applies to a model file whose --max-seq-len this run lengthens, not to random init");
    if (file->cfg.positions != POS_ROPE) fail("flag --rope-scaling: %s has learned positions, not RoPE (use --wpe-init)", run->model_path);
    if (file->cfg.rope_scaling != ROPE_DEFAULT)
        fail("flag --rope-scaling: %s already has %s RoPE scaling; one scaling over another is not defined", run->model_path,
             rope_type_names[file->cfg.rope_scaling]);
    if (run->cfg.max_seq_len <= file->cfg.max_seq_len)
        fail("flag --rope-scaling: applies when --max-seq-len lengthens %s (%d positions; this run: %d)", run->model_path,
             file->cfg.max_seq_len, run->cfg.max_seq_len);
    char type[16];
    float factor = 0.0f;
    int used = 0;
    if (sscanf(flag, "%15[a-z0-9]:%f%n", type, &factor, &used) != 2 || flag[used] != '\0')
        fail("flag --rope-scaling: '%s' is not TYPE:FACTOR (linear:4, llama3:8, yarn:4)", flag);
    if (!(factor >= 1.0f && factor <= 1e6f)) fail("flag --rope-scaling: factor %g must be from 1 to 1e6", (double)factor);
    ModelConfig* c = &run->cfg;
    c->rope_factor = factor;
    c->rope_original_max = file->cfg.max_seq_len;
    c->hf_max_positions = c->max_seq_len;
    if (strcmp(type, "linear") == 0) c->rope_scaling = ROPE_LINEAR;
    else if (strcmp(type, "llama3") == 0) { c->rope_scaling = ROPE_LLAMA3; c->rope_low = 1.0f; c->rope_high = 4.0f; }
    else if (strcmp(type, "yarn") == 0) { c->rope_scaling = ROPE_YARN; c->rope_low = 32.0f; c->rope_high = 1.0f; c->rope_attn_factor = 0.0f; }
    else fail("flag --rope-scaling: type '%s' is not linear, llama3 or yarn", type);
    config_validate(c, "flag --rope-scaling");
}

static inline void resolve_model(Run* run) {
    TrainOptions* o = &run->opt;
    int shape_flags = o->layers || o->heads || o->channels || o->max_seq_len || o->vocab_size;
    if (o->out_dir[0] && run->rank == 0 && !o->plan_only && !o->plan_json) {
        output_lock(o->out_dir, 0); /* before -o is read */
        output_check(o->out_dir, o->supersede ? OUTPUT_SUPERSEDE : o->resume ? OUTPUT_RESUME : OUTPUT_FRESH, o->model, 0);
    }
    run->resume_step = o->resume && run->rank == 0 ? checkpoint_latest_whole(o->out_dir, setup_notes(o)) : -1;
    proc_broadcast(&run->resume_step, sizeof(run->resume_step), "the resume step broadcast"); /* every rank resumes the same step */
    resolve_run_identity(run);
    static char ckpt_model[4200];
    if (run->resume_step >= 0) {
        checkpoint_path(ckpt_model, sizeof(ckpt_model), o->out_dir, "model", run->resume_step, -1);
        run->model_path = ckpt_model;
        note_flags_ignored_on_resume(run, ckpt_model);
    } else if (wants_random_init(o)) {
        run->model_path = NULL;
    } else {
        if (!file_exists(o->model) && !strchr(o->model, '/') && !strchr(o->model, '.'))
            fail("-e: unknown model descriptor '%s' (" MODEL_DESCRIPTOR_LIST "), and no model file of that name", o->model);
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
        int table = info.cfg.positions == POS_LEARNED; /* RoPE has no table: its longest length is a number */
        if (run->resume_step < 0 && table && o->max_seq_len > info.cfg.max_seq_len && !option_given(o, "--wpe-init"))
            fail("--max-seq-len %d lengthens the position table of %s (%d rows): choose how its new rows start, --wpe-init "
                 "interpolate (the learned rows stretched over %d positions) or --wpe-init tile (row t = learned row t mod %d); "
                 "neither is better for every model (docs/finetune_long.md measures both)",
                 o->max_seq_len, run->model_path, info.cfg.max_seq_len, o->max_seq_len, info.cfg.max_seq_len);
        if (run->resume_step < 0 && o->max_seq_len && o->max_seq_len != info.cfg.max_seq_len) {
            /* long-context fine-tuning: a longer (or shorter) position table */
            run->cfg.max_seq_len = o->max_seq_len;
            size_t used = strlen(run->model_desc);
            if (!table) snprintf(run->model_desc + used, sizeof(run->model_desc) - used, ", RoPE set up for %d positions (was %d)",
                                 o->max_seq_len, info.cfg.max_seq_len);
            else snprintf(run->model_desc + used, sizeof(run->model_desc) - used, ", position table resized from %d to %d rows%s",
                     info.cfg.max_seq_len, o->max_seq_len, o->max_seq_len <= info.cfg.max_seq_len ? ""
                     : strcmp(o->wpe_init, "interpolate") == 0 ? " (learned rows interpolated)" : " (learned rows repeated)");
        }
        check_wpe_init_applies(run, &info);
        apply_rope_scaling(run, &info);
        if (run->opt.rope_scaling[0] && run->resume_step < 0) {
            size_t used = strlen(run->model_desc);
            snprintf(run->model_desc + used, sizeof(run->model_desc) - used, ", RoPE scaling %s", run->opt.rope_scaling);
        }
        return;
    }
    check_wpe_init_applies(run, NULL);
    apply_rope_scaling(run, NULL);
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

/* Per-layer recompute modes and offload flags from -r, --recompute-layers
 * and --offload-checkpoints (which under -r auto lets the planner choose). */
static inline void resolve_recompute(Run* run) {
    int L = run->cfg.num_layers;
    run->layer_mode = (unsigned char*)calloc_check((size_t)L, 1, "recompute plan");
    run->layer_offload = (unsigned char*)calloc_check((size_t)L, 1, "recompute plan");
    parse_recompute(run->opt.recompute, run->opt.recompute_layers, L, run->layer_mode, run->layer_offload);
    if (run->opt.segment_layers > L)
        fail("flag --segment-layers: %d is more than the model's %d layers (at most %d: one segment)", run->opt.segment_layers, L, L);
    int K = run->opt.segment_layers;
    for (int l = 0; K > 1 && !run->opt.offload_checkpoints && l < L; l++)
        if (run->layer_offload[l] && l % K != 0) {
            char starts[64]; /* the segment inputs there are, the model's, not a pattern past its last layer */
            if (K >= L) snprintf(starts, sizeof(starts), "layer 0 alone: one segment");
            else if (2 * K >= L) snprintf(starts, sizeof(starts), "layers 0 and %d", K);
            else snprintf(starts, sizeof(starts), "layers 0, %d, ..., %d", K, (L - 1) / K * K);
            fail("flag -r: '%s' offloads layer %d, which starts no segment of --segment-layers %d: with segments only the "
                 "segment inputs (%s) offload", run->opt.recompute, l, K, starts);
        }
    if (!run->opt.offload_checkpoints || strcmp(run->opt.recompute, "auto") == 0) return;
    int any = 0, segments = K > 1;
    for (int l = 0; l < L; l++) { /* with segments: every segment's input */
        run->layer_offload[l] = (unsigned char)(segments || mode_can_offload(run->layer_mode[l]));
        any |= run->layer_offload[l];
    }
    if (!any) fail("flag --offload-checkpoints: no layer recomputes with -r 1 or -r 3 (-r %s), so none keeps checkpoints to offload", run->opt.recompute);
}

/* --host-mem-budget and --host-link concern offloaded checkpoints, which a
 * run has with --offload-checkpoints or an offloaded group in a mix, and
 * which -r auto's search and suggestions and --plan consider; --ring-link
 * prices the context-parallel ring. Given to a run without them, they
 * would do nothing: refused. */
static inline void check_link_and_host_flags_apply(const Run* run) {
    const TrainOptions* o = &run->opt;
    int offloads = o->offload_checkpoints || o->offload_optimizer;
    for (int l = 0; l < run->cfg.num_layers; l++) offloads |= run->layer_offload[l];
    int considers_offload = offloads || strcmp(o->recompute, "auto") == 0 || o->plan_only || o->plan_json;
    static const char* const host_flags[2] = {"--host-mem-budget", "--host-link"};
    for (int i = 0; i < 2; i++)
        if (option_given(o, host_flags[i]) && !considers_offload)
            fail("flag %s: applies to offloading (--offload-checkpoints, a mix like 1o:0-3, --offload-optimizer, -r auto or --plan), and "
                 "this run has none (-r %s)", host_flags[i], o->recompute);
    if (option_given(o, "--ring-link") && run->cp.group_size <= 1)
        fail("flag --ring-link: applies to the ring of --context-parallel N > 1, and this run has none");
}

/* --context-parallel N: groups of N processes, each sequence in 2N equal
 * chunks (-t is checked against 2N with the model's length, in resolve_batch). */
static inline void resolve_context_parallel(Run* run) {
    int N = run->opt.context_parallel;
    if (run->world % N != 0)
        fail("flag --context-parallel: %d does not divide the %d process%s of this run (a group of N shares each sequence%s)", N,
             run->world, run->world == 1 ? "" : "es", run->opt.plan_only || run->opt.plan_json ? "; --plan-processes P plans for P" : "");
    run->cp = context_groups(N, run->rank, run->world);
    if (run->world == remat_proc.world) remat_ring_degree_hint = N; /* not for --plan-processes: no ring to connect */
}

/* Under context parallelism -t must be a multiple of 2N: the refusal names
 * the neighbours that are, within the model's length. */
static inline void check_context_parallel_length(const Run* run) {
    int N = run->cp.group_size, T = run->opt.T, max_T = run->cfg.max_seq_len;
    if (N <= 1 || T % (2 * N) == 0) return;
    int below = T / (2 * N) * (2 * N), above = below + 2 * N;
    char works[64];
    if (below > 0 && above <= max_T) snprintf(works, sizeof(works), "-t %d or %d work", below, above);
    else if (below > 0) snprintf(works, sizeof(works), "-t %d works (the model's maximum is %d)", below, max_T);
    else if (above <= max_T) snprintf(works, sizeof(works), "-t %d works", above);
    else snprintf(works, sizeof(works), "no -t works with the model's maximum %d: a smaller N", max_T);
    fail("flag -t: %d is not a multiple of 2N = %d (--context-parallel %d cuts each sequence into %d equal chunks): %s", T, 2 * N, N,
         2 * N, works);
}

static inline void resolve_batch(Run* run) {
    TrainOptions* o = &run->opt;
    if (o->T > run->cfg.max_seq_len) fail("flag -t: sequence length %d exceeds the model's maximum %d", o->T, run->cfg.max_seq_len);
    check_context_parallel_length(run);
    int groups = run->cp.groups;
    long long micro_tokens = (long long)o->B * o->T * groups;
    if (micro_tokens > INT_MAX)
        fail("flags -b/-t: %d x %d%s = %lld tokens per micro-step, more than 2^31-1 = 2147483647 (token positions and counts are "
             "32-bit): a smaller -b or -t", o->B, o->T, groups > 1 ? " x data-parallel groups" : "", micro_tokens);
    long long total = o->total_batch_tokens == -1 ? micro_tokens : o->total_batch_tokens;
    if (total < 1 || total % micro_tokens != 0) {
        if (run->cp.group_size > 1)
            fail("flag -d: %lld tokens per step is not a positive multiple of B*T*(processes / --context-parallel) = %d*%d*%d = %lld",
                 total, o->B, o->T, groups, micro_tokens);
        fail("flag -d: %lld tokens per step is not a positive multiple of B*T*processes = %d*%d*%d = %lld",
             total, o->B, o->T, run->world, micro_tokens);
    }
    run->grad_accum = (int)(total / micro_tokens);
}

/* " --tile-tokens K" when K tiles, else "". */
static inline const char* tile_flag(int K, char* buf, size_t n) {
    if (K > 0) snprintf(buf, n, " --tile-tokens %d", K);
    else buf[0] = '\0';
    return buf;
}

/* "%s, and %s of host memory" of a device and a host size. */
static inline const char* format_sizes(size_t device, size_t host, char* buf, size_t n) {
    char d[32], h[32];
    snprintf(buf, n, "%s, and %s of host memory", format_size(device, d, sizeof(d)), format_size(host, h, sizeof(h)));
    return buf;
}

/* -r auto found nothing that fits: the least plan it could reach (-r 1 on
 * every layer, offloaded with --offload-checkpoints, at the smallest tile
 * searched, at the segment size of least memory when it searches segments),
 * then what would fit: plan_print_suggestions' flags, and with a host budget
 * the offloaded ones (-r auto with --offload-checkpoints at this batch when
 * the run did not offload; -r 1o:all with a shorter -t). */
static inline void refuse_auto_recompute(Run* run, PlanSpec* spec, size_t budget, const char* source, size_t host_budget,
                                         const char* host_source, int search_tiles, int search_segments) {
    char have[32], tiles[48], sizes[96], host_have[32], segments[48] = "";
    format_size(budget, have, sizeof(have));
    format_size(host_budget, host_have, sizeof(host_have));
    fflush(stdout);
    int least[PLAN_MAX_TILE_CANDIDATES], given = spec->tile_tokens, given_k = spec->segment_layers;
    if (search_tiles) spec->tile_tokens = least[plan_tile_candidates(spec, least) - 1];
    int least_tile = spec->tile_tokens;
    size_t host_1o = 0, device_1o = SIZE_MAX, least_1o = SIZE_MAX, device_1 = SIZE_MAX;
    int k_lo = search_segments ? 1 : given_k, k_hi = search_segments ? run->cfg.num_layers : given_k, k_1 = k_lo, k_1o = k_lo;
    for (int K = k_lo; K <= k_hi; K++) { /* the least memory, each way */
        spec->segment_layers = K;
        size_t host = 0, device = plan_totals_for(spec, PLAN_CODE_OFFLOAD + RECOMPUTE_FULL, spec->B, spec->T, &host);
        size_t least = spec->host_shares_budget ? size_add_sat(device, host) : device; /* the CPU's pool: the same memory */
        if (least < least_1o) { least_1o = least; device_1o = device; host_1o = host; k_1o = K; }
        device = plan_total_for(spec, RECOMPUTE_FULL, spec->B, spec->T);
        if (device < device_1) { device_1 = device; k_1 = K; }
    }
    spec->segment_layers = given_k;
    int offload_least = run->opt.offload_checkpoints && least_1o < device_1; /* what the search could reach */
    int k = offload_least ? k_1o : k_1;
    if (k > 1) snprintf(segments, sizeof(segments), " --segment-layers %d", k);
    if (offload_least)
        fprintf(stderr, "-r auto: even -r 1o:all%s%s (%s) does not fit %s (%s)\n", tile_flag(spec->tile_tokens, tiles, sizeof(tiles)),
                segments, format_sizes(device_1o, host_1o, sizes, sizeof(sizes)), have, source);
    else
        fprintf(stderr, "-r auto: even full recompute on every layer%s%s (%.1f MiB) does not fit %s (%s)\n",
                tile_flag(spec->tile_tokens, tiles, sizeof(tiles)), segments, mib(device_1), have, source);
    spec->tile_tokens = given; /* the suggestions: flags that fit as they are */
    plan_print_suggestions(spec, budget, stderr);
    int offloaded_fits = 0;
    if (host_budget && !run->opt.offload_checkpoints) {
        PlanSpec s = *spec;
        int L = run->cfg.num_layers;
        unsigned char* modes = (unsigned char*)malloc_check((size_t)L, "plan");
        unsigned char* offload = (unsigned char*)malloc_check((size_t)L, "plan");
        size_t host = 0, device = SIZE_MAX;
        if (recompute_auto_tiles(&s, budget, host_budget, search_tiles, modes, offload) == 0) {
            s.layer_mode = modes;
            s.layer_offload = offload;
            device = plan_totals_for(&s, -1, s.B, s.T, &host); /* the plan the run would build: it must fit */
        }
        if (device <= budget && host <= host_budget && (!s.host_shares_budget || size_add_sat(device, host) <= budget)) {
            char flag[8192];
            format_recompute_flag(modes, offload, L, flag, sizeof(flag));
            fprintf(stderr, "  --offload-checkpoints -r auto: here -r %s%s (%s of %s, %s)\n", flag,
                    tile_flag(s.tile_tokens, tiles, sizeof(tiles)), format_sizes(device, host, sizes, sizeof(sizes)), host_have, host_source);
            offloaded_fits = 1;
        }
        free(modes);
        free(offload);
    }
    if (host_budget && !offloaded_fits) {
        PlanSpec s = *spec;
        s.tile_tokens = least_tile;
        int t_step = run->cp.group_size > 1 ? 2 * run->cp.group_size : 1;
        int t = plan_max_fitting_host(&s, PLAN_CODE_OFFLOAD + RECOMPUTE_FULL, 1, s.T, budget, host_budget) / t_step * t_step;
        if (t >= 1) {
            size_t host = 0, device = plan_totals_for(&s, PLAN_CODE_OFFLOAD + RECOMPUTE_FULL, s.B, t, &host);
            fprintf(stderr, "  -r 1o:all%s -t %d (%s of %s, %s)\n", tile_flag(least_tile, tiles, sizeof(tiles)), t,
                    format_sizes(device, host, sizes, sizeof(sizes)), host_have, host_source);
        }
    }
    if (offloaded_fits) fail("-r auto: nothing without offloading fits in %s: --offload-checkpoints lets it offload (above)", have);
    fail("-r auto: nothing fits in %s", have);
}

/* Every automatic choice (-r auto's modes and offloading, the tile size) is
 * rank 0's, sent to all: the ranks made it from the same least budget, but
 * a cost model named by each rank's own device could still differ, and
 * under context parallelism one rank with an extra recompute would run the
 * ring again in its backward against its neighbours' other transfers. */
static inline void plan_choice_broadcast(Run* run, PlanSpec* spec) {
    int L = run->cfg.num_layers;
    proc_broadcast(run->layer_mode, (size_t)L, "the broadcast of rank 0's recompute choice");
    proc_broadcast(run->layer_offload, (size_t)L, "the broadcast of rank 0's offload choice");
    proc_broadcast(&spec->tile_tokens, sizeof(spec->tile_tokens), "the broadcast of rank 0's tile size");
    proc_broadcast(&spec->segment_layers, sizeof(spec->segment_layers), "the broadcast of rank 0's segment size");
    proc_broadcast(&spec->offload_optimizer, sizeof(spec->offload_optimizer), "the broadcast of rank 0's optimizer place");
}

/* Before the first step: the plan every rank built is the same (modes,
 * offloading, tiles, device and host bytes); a rank that differs stops the
 * job, naming what. */
static inline void ranks_check_same_plan(const Run* run) {
    const MemoryPlan* p = &run->plan;
    int L = run->cfg.num_layers;
    static const char* const names[] = {"the per-layer recompute modes (-r)", "the offloaded layers", "the token tile size",
                                        "the segment size", "the memory plan's device bytes", "the memory plan's host bytes"};
    uint64_t v[6] = {fnv1a(FNV_START, run->layer_mode, (size_t)L), fnv1a(FNV_START, run->layer_offload, (size_t)L),
                     (uint64_t)p->spec.tile_tokens, (uint64_t)plan_segment_layers(&p->spec), (uint64_t)p->total_bytes,
                     (uint64_t)p->host_total_bytes};
    ranks_check_same(NULL, NULL, names, v, 6);
}

/* -r auto: the per-layer choice (and with search_tiles the tile size) with
 * the least predicted time that fits the budgets, printed as the flags that
 * reproduce it; or the flags that would fit and a non-zero exit. */
/* The -r flags that reproduce run's modes and offloading: with segments the
 * offloaded segment inputs are --offload-checkpoints (all of them). */
static inline void auto_recompute_flags(const Run* run, const PlanSpec* spec, char* flag, size_t n) {
    int L = run->cfg.num_layers, K = plan_segment_layers(spec), off = 0;
    format_recompute_flag(run->layer_mode, K > 1 ? NULL : run->layer_offload, L, flag, n);
    for (int l = 0; K > 1 && l < L; l += K) off |= run->layer_offload[l];
    size_t used = strlen(flag);
    if (K > 1) snprintf(flag + used, n - used, " --segment-layers %d%s", K, off ? " --offload-checkpoints" : "");
}

/* -y 1 where the planner chooses the tile on the GPU: the tile size the
 * checkpoint trained with, which a GPU run's bits depend on (another size
 * sums in another fp32 order; docs/DESIGN.md, token tiles); -1 elsewhere:
 * the CPU trainer's bits do not depend on it. */
static inline int resume_tile_tokens(const Run* run, int trainer) {
    int tile = -1;
    if (run->resume_step >= 0 && trainer == FOR_GPU && run->rank == 0) {
        char path[4200];
        TrainState st;
        checkpoint_path(path, sizeof(path), run->opt.out_dir, "state", run->resume_step, 0);
        fclose(state_open(path, &st));
        tile = hparams_saved_tile_tokens(st.hparams);
    }
    proc_broadcast(&tile, sizeof(tile), "the broadcast of the checkpoint's tile size");
    return tile;
}

/* With resume_tile >= 0 (resume_tile_tokens), -r auto keeps the
 * checkpoint's tile where some plan at it fits, and says so; where none
 * does it refuses, unless --resume-override lets it choose another. */
static inline void resolve_auto_recompute(Run* run, PlanSpec* spec, int search_tiles, int search_segments, int resume_tile) {
    const char* source = "";
    const char* host_source = "";
    size_t budget = memory_budget(run->opt.mem_budget, &source);
    int host_pool = run->opt.offload_checkpoints || run->opt.offload_optimizer;
    size_t host_budget = host_pool ? host_memory_budget(run->opt.host_mem_budget, &host_source) : 0;
    if (!budget) fail("-r auto: no memory budget known: give --mem-budget");
    if (spec->host_shares_budget && host_budget > budget) { /* one memory: the pool and the plan share the budget */
        host_budget = budget;
        host_source = "the same memory as the plan (the CPU trainer's device is the host)";
    }
    char have[32], tiles[48];
    format_size(budget, have, sizeof(have));
    int kept_tile = 0;
    if (resume_tile >= 0) {
        spec->tile_tokens = resume_tile;
        kept_tile = recompute_auto_place(spec, budget, host_budget, run->opt.offload_checkpoints, run->opt.offload_optimizer, 0,
                                         search_segments, run->layer_mode, run->layer_offload) == 0;
        if (!kept_tile && !run->opt.resume_override)
            fail("-r auto: the checkpoint in %s was trained with --tile-tokens %d, and no plan at that tile fits %s "
                 "(%s); a GPU run's bits depend on the tile size: a larger --mem-budget, or --resume-override to let -r auto choose "
                 "another tile", run->opt.out_dir, resume_tile, have, source);
    }
    if (!kept_tile && recompute_auto_place(spec, budget, host_budget, run->opt.offload_checkpoints, run->opt.offload_optimizer,
                                           search_tiles, search_segments, run->layer_mode, run->layer_offload) != 0) {
        /* the suggestions may offload where a host budget is known: --offload-checkpoints' own, or one given */
        if (!host_budget && run->opt.host_mem_budget[0]) host_budget = host_memory_budget(run->opt.host_mem_budget, &host_source);
        refuse_auto_recompute(run, spec, budget, source, host_budget, host_source, search_tiles, search_segments);
    }
    plan_choice_broadcast(run, spec);
    run->opt.tile_tokens = spec->tile_tokens;
    run->opt.segment_layers = spec->segment_layers;
    run->opt.offload_optimizer = spec->offload_optimizer;
    char flag[8192];
    auto_recompute_flags(run, spec, flag, sizeof(flag));
    double extra = 0.0, secs = plan_predicted_seconds(spec, NULL, &extra);
    FILE* out = setup_notes(&run->opt);
    size_t host = 0, device = plan_totals_for(spec, -1, spec->B, spec->T, &host);
    fprintf(out, "recompute auto: fits %s (%s) with %.1f MiB: -r %s%s; predicted %.1f ms per step, +%.1f%% time over -r 0 (cost model %s)\n",
            have, source, mib(device), flag, tile_flag(spec->tile_tokens, tiles, sizeof(tiles)), 1e3 * secs, 100.0 * extra,
            spec_cost_model(spec).name);
    if (kept_tile)
        fprintf(out, "recompute auto: --tile-tokens %d is the checkpoint's, kept on resume (a GPU run's bits depend on the tile size; "
                "it fits)\n", spec->tile_tokens);
    char used[32], host_have[32];
    if (host_pool)
        fprintf(out, "recompute auto: host memory %s of %s (%s) for offloaded checkpoints and the optimizer\n", format_size(host, used, sizeof(used)),
                format_size(host_budget, host_have, sizeof(host_have)), host_source);
    if (option_given(&run->opt, "--offload-optimizer"))
        fprintf(out, "recompute auto: the optimizer %s\n", spec->offload_optimizer ? "in host memory: --offload-optimizer"
                                                                                  : "on the device (no --offload-optimizer): it fits and is faster");
}

/* --tile-tokens auto with a fixed -r: the fastest predicted tile size that
 * fits (plan_auto_tile). With -r auto the tile is part of its search. */
static inline void resolve_auto_tiles(Run* run, PlanSpec* spec, int resume_tile) {
    const char* source = "";
    size_t budget = memory_budget(run->opt.mem_budget, &source);
    if (resume_tile >= 0) { /* the checkpoint's, as with -r auto (resolve_auto_recompute) */
        spec->tile_tokens = resume_tile;
        if (plan_total_for(spec, -1, spec->B, spec->T) <= budget) {
            plan_choice_broadcast(run, spec); /* rank 0's verdict, as below */
            run->opt.tile_tokens = spec->tile_tokens;
            fprintf(setup_notes(&run->opt), "token tiles auto: --tile-tokens %d, the checkpoint's, kept on resume (a GPU run's bits "
                    "depend on the tile size; it fits %.1f MiB, %s)\n", spec->tile_tokens, mib(budget), source);
            return;
        }
        if (!run->opt.resume_override)
            fail("--tile-tokens auto: the checkpoint in %s was trained with --tile-tokens %d, whose plan does not fit %.1f MiB (%s); a "
                 "GPU run's bits depend on the tile size: a larger --mem-budget, or --resume-override to choose another tile",
                 run->opt.out_dir, resume_tile, mib(budget), source);
    }
    spec->tile_tokens = plan_auto_tile(spec, budget);
    plan_choice_broadcast(run, spec);
    int k = spec->tile_tokens;
    run->opt.tile_tokens = k;
    int fits = plan_total_for(spec, -1, spec->B, spec->T) <= budget;
    fprintf(setup_notes(&run->opt), "token tiles auto: %s (budget %.1f MiB, %s)\n",
            !fits ? "no tile fits, the smallest tried" : k ? "on, the fastest predicted that fits" : "off, the untiled plan fits", mib(budget), source);
    if (k) fprintf(setup_notes(&run->opt), "token tiles auto: --tile-tokens %d\n", k);
}

/* --segment-layers auto with a fixed -r: of K = 1 to L, the fastest
 * predicted whose plan fits the budget; the least memory when none fits. */
static inline void resolve_auto_segments(Run* run, PlanSpec* spec) {
    const char* source = "";
    size_t budget = memory_budget(run->opt.mem_budget, &source), least = SIZE_MAX;
    int L = run->cfg.num_layers, best_k = 1, found = 0;
    double best = 0.0;
    for (int K = 1; K <= L; K++) {
        spec->segment_layers = K;
        size_t total = plan_total_for(spec, -1, spec->B, spec->T);
        double t = plan_predicted_seconds_offload(spec, NULL, NULL, NULL);
        if (total <= budget ? found && !(t < best) : found || total >= least) continue;
        if (total <= budget) { found = 1; best = t; }
        least = total;
        best_k = K;
    }
    spec->segment_layers = best_k;
    plan_choice_broadcast(run, spec); /* rank 0's K, as for -r auto */
    best_k = run->opt.segment_layers = spec->segment_layers;
    fprintf(setup_notes(&run->opt), "segments auto: --segment-layers %d (%s; budget %.1f MiB, %s)\n", best_k,
            found ? "the fastest predicted that fits" : "none fits: the least memory", mib(budget), source);
}

/* Whether the planner chooses K: --segment-layers auto, or -r auto where
 * --segment-layers is not given. */
static inline int segments_chosen_by_planner(const Run* run) {
    if (strcmp(run->opt.segment_layers_flag, "auto") == 0) return 1;
    return strcmp(run->opt.recompute, "auto") == 0 && !option_given(&run->opt, "--segment-layers");
}

/* Whether the planner chooses the tile size: --tile-tokens auto, or -r auto
 * where the trainer has tiles and --tile-tokens is not given a size. */
static inline int tiles_chosen_by_planner(const Run* run, int trainer) {
    if (strcmp(run->opt.tile_tokens_flag, "auto") == 0) return 1;
    return strcmp(run->opt.recompute, "auto") == 0 && !option_given(&run->opt, "--tile-tokens") && flag_for_trainer("--tile-tokens", trainer);
}

/* The host pool of offloaded checkpoints must fit the host budget: pinned
 * memory that does not fit would take the machine's memory from under it. */
static inline void check_host_budget(const Run* run) {
    if (!run->plan.host_total_bytes || run->opt.plan_only || run->opt.plan_json) return;
    const char* source = "";
    size_t host_budget = host_memory_budget(run->opt.host_mem_budget, &source);
    char need[32], have[32];
    format_size_over(run->plan.host_total_bytes, host_budget, need, have, sizeof(need));
    if (run->plan.host_total_bytes > host_budget)
        fail("%s: the host pool needs %s, more than %s (%s): fewer offloaded layers, or --host-mem-budget", plan_host_pool_contents(&run->plan),
             need, have, source);
    /* the CPU trainer's plan lives in host memory too: one memory holds both */
    if (run->plan.spec.host_shares_budget && size_add_sat(run->plan.host_total_bytes, run->plan.total_bytes) > host_budget) {
        char plan_bytes[32];
        fail("%s: the host pool (%s) and the plan (%s) are both host memory on the CPU, more than %s (%s) "
             "together: less offloading (offloading saves no memory on the CPU)", plan_host_pool_contents(&run->plan),
             format_size(run->plan.host_total_bytes, need, sizeof(need)), format_size(run->plan.total_bytes, plan_bytes, sizeof(plan_bytes)),
             format_size(host_budget, have, sizeof(have)), source);
    }
}

/* --mem-budget with a fixed -r is a limit the plan must keep: a plan over
 * it is refused with what would fit, not run past the budget in silence.
 * The CPU trainer's host pool is the same memory: it counts too. */
static inline void check_fixed_plan_budget(const Run* run, const PlanSpec* spec) {
    const TrainOptions* o = &run->opt;
    if (!o->mem_budget[0] || strcmp(o->recompute, "auto") == 0 || o->plan_only || o->plan_json) return;
    const char* source = "";
    size_t budget = memory_budget(o->mem_budget, &source);
    int pool = spec->host_shares_budget && run->plan.host_total_bytes;
    size_t total = pool ? size_add_sat(run->plan.total_bytes, run->plan.host_total_bytes) : run->plan.total_bytes;
    if (total <= budget) return;
    char need[32], have[32];
    format_size_over(total, budget, need, have, sizeof(need));
    fflush(stdout);
    fprintf(stderr, "the plan of -r %s needs %s%s, more than --mem-budget %s\n", o->recompute, need,
            pool ? " with its offloaded checkpoints' host pool (the same memory on the CPU)" : "", have);
    plan_print_suggestions(spec, budget, stderr);
    fail("flag --mem-budget: the plan (%s with -r %s) does not fit %s; -r auto chooses recompute modes that do", need, o->recompute, have);
}

/* The default data is not in the repository: say how to make it, before
 * anything is allocated. */
static inline void check_default_data(const TrainOptions* o) {
    const char* flags[2] = {"-i", "-j"};
    const char* given[2] = {o->max_steps != 0 ? o->train_glob : "", o->val_every > 0 ? o->val_glob : ""}; /* -x 0 reads no -i */
    const char* defaults[2] = {DEFAULT_TRAIN_GLOB, DEFAULT_VAL_GLOB};
    for (int i = 0; i < 2; i++)
        if (strcmp(given[i], defaults[i]) == 0 && access(defaults[i], R_OK) != 0)
            fail("%s: the default data %s is missing: make it with python3 dev/data/tinyshakespeare.py, or give %s", flags[i],
                 defaults[i], flags[i]);
}

/* Flags, model and memory plan: everything a trainer needs to know before
 * it allocates (run/trainer.h's run_setup prints the plan for --plan after it). */
static inline void run_resolve(Run* run, int argc, char** argv, const TrainerTraits* traits) {
    int trainer = traits->trainer, elem_bytes = traits->elem_bytes;
    memset(run, 0, sizeof(*run));
    parse_args(argc, argv, &run->opt, trainer);
    proc_set_collective_timeout(run->opt.collective_timeout_s);
    run->rank = remat_proc.rank;
    run->world = run->opt.plan_processes ? run->opt.plan_processes : remat_proc.world;
    if (run->opt.zero_stage == 1 && run->world == 1)
        fprintf(setup_notes(&run->opt), "note: -z 1 with one process shards nothing\n");
    if (run->opt.collective_timeout_s > 0 && remat_proc.world == 1) /* (a build without MPI refused it above) */
        fprintf(setup_notes(&run->opt), "note: --collective-timeout with one process: no collective to time out\n");
    resolve_context_parallel(run); /* no limit on T / N beyond -t's: the GPU's offsets are 64-bit (docs/DESIGN.md, "Index widths") */
    resolve_model(run);
    resolve_recompute(run);
    resolve_batch(run);
    resolve_dropout_sequences(run);
    check_dropout_limits(run);
    ranks_check_same(&run->opt, &run->cfg, NULL, NULL, 0);
    PlanSpec spec;
    memset(&spec, 0, sizeof(spec));
    spec.cfg = run->cfg;
    spec.B = run->opt.B;
    spec.T = run->opt.T;
    spec.backend = trainer == FOR_GPU ? BACKEND_GPU : BACKEND_CPU;
    spec.elem_bytes = elem_bytes;
    spec.stat_bytes = traits->stat_bytes;
    spec.master_weights = traits->master_weights && run->opt.master_weights;
    spec.world_size = run->world;
    spec.context_parallel = run->cp.group_size;
    spec.zero_stage = run->opt.zero_stage;
    spec.layer_mode = run->layer_mode;
    spec.layer_offload = run->layer_offload;
    spec.grad_accum = run->grad_accum;
    int hs = block_widths(&run->cfg).HD;
    int family = remat_attention_family_hook ? remat_attention_family_hook(hs) : -1;
    cost_model_resolve(run->opt.cost_model, remat_device_name_hook ? remat_device_name_hook() : NULL, family, hs, &spec.cost_model);
    spec.ring_link = ring_link_resolve(run->opt.ring_link, spec.backend);
    if (!run->opt.ring_link[0] && spec.cost_model.ring_bytes_per_s > 0) { /* measured, in the --cost-model file */
        RingLink measured = {"measured", spec.cost_model.ring_bytes_per_s, spec.cost_model.ring_latency_s};
        spec.ring_link = measured;
    }
    if (run->opt.host_link[0]) spec.cost_model.host_link_bytes_per_s = host_link_parse(run->opt.host_link, "flag --host-link");
    check_link_and_host_flags_apply(run);
    spec.logits_chunk_rows = traits->logits_chunk_rows;
    spec.micro_steps = run->grad_accum;
    spec.fp32_grad_sums = elem_bytes < 4; /* fp32 storage already sums in fp32 */
    spec.io_chunk_floats = (size_t)1 << 18;
    spec.workspace_bytes = traits->workspace_bytes;
    spec.doc_len = run->opt.plan_doc_len;
    spec.documents = (run->opt.reset_attention_mask || run->opt.reset_position_ids ? PLAN_DOC_STARTS : 0) |
                     (run->opt.reset_position_ids ? PLAN_DOC_POSITIONS : 0);
    /* the CPU trainer's plan and offloaded pool are one memory, unless both
     * budgets are given (then the user has said what each may take) */
    spec.host_shares_budget = trainer == FOR_CPU && !(run->opt.mem_budget[0] && run->opt.host_mem_budget[0]);
    spec.offload_optimizer = run->opt.offload_optimizer; /* -r auto: may choose the device instead */
    plan_validate_spec(&spec);
    spec.tile_tokens = run->opt.tile_tokens;
    spec.segment_layers = run->opt.segment_layers;
    int choose_tiles = tiles_chosen_by_planner(run, trainer), choose_segments = segments_chosen_by_planner(run);
    int resume_tile = choose_tiles ? resume_tile_tokens(run, trainer) : -1;
    run->hp.tiles_change_bits = trainer == FOR_GPU;
    if (strcmp(run->opt.recompute, "auto") == 0) resolve_auto_recompute(run, &spec, choose_tiles, choose_segments, resume_tile);
    else {
        if (choose_segments) resolve_auto_segments(run, &spec);
        if (choose_tiles) resolve_auto_tiles(run, &spec, resume_tile);
    }
    plan_build(&run->plan, &spec);
    if (run->plan.overflow)
        fail("model shape and batch: the memory plan exceeds 2^64 bytes (-b %d -t %d, %d layers, C=%d): no machine can hold it",
             run->opt.B, run->opt.T, run->cfg.num_layers, run->cfg.channels);
    run->io_chunk_floats = spec.io_chunk_floats;
    ranks_check_same_plan(run);
    check_fixed_plan_budget(run, &spec);
}

/* What is checked once --plan has had its say: the host budget, the default
 * data, and the context-parallel communicators. */
static inline void run_prepare(Run* run) {
    check_host_budget(run);
    check_default_data(&run->opt);
#ifdef USE_MPI
    proc_context_init(&run->cp);
#endif
}

static inline void run_print_header(const Run* run) {
    const ModelConfig* c = &run->cfg;
    printf("model: %s\n", run->model_desc);
    printf("  L=%d NH=%d C=%d V=%d Vp=%d maxT=%d, %zu parameters\n", c->num_layers, c->num_heads, c->channels,
           c->vocab_size, c->padded_vocab_size, c->max_seq_len, run->plan.num_params);
    printf("batch: B=%d T=%d x %d process%s, gradient accumulation %d (%lld tokens per step)\n", run->opt.B,
           run->opt.T, run->world, run->world == 1 ? "" : "es", run->grad_accum, (long long)run_tokens_per_step(run));
    if (run->cp.group_size > 1)
        printf("context parallel: %d group%s of %d processes share each sequence; each process holds chunks %d and %d of %d "
               "(%d tokens of each row%s), attention as a ring\n", run->cp.groups, run->cp.groups == 1 ? "" : "s", run->cp.group_size,
               run->cp.member, 2 * run->cp.group_size - 1 - run->cp.member, 2 * run->cp.group_size, run->opt.T / run->cp.group_size,
               run->opt.reset_attention_mask ? "; with the document mask each batch's chunks are paired by their attended pairs" : "");
    if (run->dropout_desc[0]) printf("%s\n", run->dropout_desc);
    plan_print_summary(&run->plan, stdout);
    const char* big = "";
    size_t largest = plan_largest_entry(&run->plan, &big);
    printf("  largest buffer: %s, %.1f MiB (no buffer grows with T^2)\n", big, mib(largest));
}

#endif
