/*
 * The training driver shared by both trainers: the loop (one optimizer step
 * over its micro-steps, what happens between steps, the step printout, stop
 * signals), here; the rest by job:
 *   backend.h          what a trainer supplies (Backend) and the run's settings (Run)
 *   rank_parallel.h    one process's part: its context-parallel group, ring chunks, ZeRO-1 shard
 *   run_setup.h        flags, model, recompute choice, memory plan, run identity
 *                      (run_setup, below, adds --plan's printout)
 *   run_checkpoints.h  parameters in (model file, init, resume) and out (checkpoints)
 *   run_eval.h         validation and sampling
 * Nothing here knows whether the device is a CPU or a GPU.
 */
#ifndef REMAT_TRAINER_H
#define REMAT_TRAINER_H

#include "backend.h"
#include "rank_parallel.h"
#include "run_setup.h"
#include "run_checkpoints.h"
#include "run_eval.h"
#include "../plan/plan_report.h"

/* --plan and --plan-json: print and exit without allocating anything. */
static inline void maybe_print_plan_and_exit(const Run* run) {
    if (!run->opt.plan_only && !run->opt.plan_json) return;
    const char* source = "";
    const char* host_source = "";
    size_t budget = memory_budget(run->opt.mem_budget, &source);
    /* the host budget where it matters (it varies with the machine's free memory) */
    int host_matters = run->plan.host_total_bytes || run->opt.offload_checkpoints || run->opt.offload_optimizer || run->opt.host_mem_budget[0];
    size_t host_budget = host_matters ? host_memory_budget(run->opt.host_mem_budget, &host_source) : 0;
    if (run->opt.plan_json) {
        plan_print_json(&run->plan, budget, host_budget, stdout);
    } else {
        printf("model: %s\n", run->model_desc);
        plan_print_table(&run->plan, budget, source, host_budget, host_source, stdout);
    }
    exit(0);
}

/* Everything a trainer needs before it allocates: flags, model, plan.
 * Handles --plan/--plan-json itself (they exit here). */
static inline void run_setup(Run* run, int argc, char** argv, const TrainerTraits* traits) {
    run_resolve(run, argc, argv, traits);
    maybe_print_plan_and_exit(run);
    run_prepare(run);
}

/* This program's peak resident memory: VmHWM, its memory's high-water mark.
 * (getrusage's ru_maxrss survives exec, so a trainer started by a large
 * process, such as Python, would report its parent's size.) */
static inline long peak_rss_kib(void) {
    FILE* f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && kib < 0 && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmHWM: %ld kB", &kib) != 1) kib = -1;
    if (f) fclose(f);
    if (kib >= 0) return kib;
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
    double loss = 0.0, counted = 0.0;
    float scale = loss_scaler_factor(&run->scaler);
    /* summing over processes then gives the gradient of the mean loss of the global batch */
    float dloss_mean = scale / (float)(run->grad_accum * run->world);
    DropoutState drop = run->dropout; /* the masks depend on the step and micro-step, never on what ran before */
    drop.step = (uint32_t)step;
    for (int micro = 0; micro < run->grad_accum; micro++) {
        dataloader_next(train); /* fills be->inputs, be->targets */
        MicroBatch mb = {be->inputs, be->targets, micro, run->grad_accum};
        drop.micro_step = (uint32_t)micro;
        be->set_dropout(be->ctx, &drop);
        float mean = be->forward_backward(be->ctx, &mb, dloss_mean);
        if (!run->docs.eod_mask_loss) { loss += mean; continue; }
        double k = (double)documents_counted(&run->docs, mb.inputs, (size_t)run->opt.B * (size_t)(run->opt.T / run->cp.group_size));
        loss += (double)mean * k;
        counted += k;
    }
    if (be->sync_grads) be->sync_grads(be->ctx);
    if (run->docs.eod_mask_loss) {
        /* the gradients are scale times the sum over the tokens counted over
         * all the step's tokens: as a mean over the tokens counted they are
         * that much smaller, so the factor they carry is scale * counted / all */
        counted = proc_sum(counted, "the count of tokens whose loss counts");
        double sum = proc_sum(loss, "the training loss sum");
        r.loss = counted > 0 ? (float)(sum / counted) : 0.0f;
        if (counted > 0) scale = (float)((double)scale * counted / (double)run_tokens_per_step(run));
    } else {
        r.loss = (float)proc_mean(loss / run->grad_accum, "the training loss mean");
    }
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
    /* group 0 samples: all its members, when they share the sequence */
    if (run->cp.group == 0 && sample_now && is_due(o->sample_every, step, last))
        sample(run, be, ls, step);
    if (o->out_dir[0] && step > start && (is_due(o->checkpoint_every, step, 0) || last))
        save_checkpoint(run, be, step, &ls->train);
    else if (last && o->max_steps == 0 && o->out_dir[0] && run->resume_step < 0)
        save_evaluated_model(run, be, step);
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
    double tokens_per_s = (double)run_tokens_per_step(run) / (ms / 1e3);
    char extras[256] = "";
    if (be->step_extras) be->step_extras(be->ctx, step, ms, extras, sizeof(extras));
    printf("step %4d/%d | loss %.6f | lr %.4e | norm %.4f | %.2f ms | %.0f tok/s%s\n", step, steps, (double)r->loss,
           (double)r->lr, (double)r->norm, ms, tokens_per_s, extras);
    fflush(stdout);
    long long tokens = (long long)step * run_tokens_per_step(run);
    size_t memory = be->memory_bytes ? be->memory_bytes(be->ctx) : (size_t)peak_rss_kib() * 1024;
    logger_train(&ls->log, step, r->loss, r->lr, r->norm, ms, tokens_per_s, tokens, mib(memory));
}

/* Packed documents: the end-of-text token (--eot-token, else the
 * tokenizer file's, else GPT-2's 50256 for its vocabulary), handed to the
 * loaders, which build the document starts, and to the trainer. */
static inline void documents_resolve(Run* run, Backend* be, LoopState* ls) {
    const TrainOptions* o = &run->opt;
    DocumentOptions d = {o->reset_attention_mask, o->reset_position_ids, o->eod_mask_loss, -1};
    if (!documents_any(&d)) { run->docs = d; return; }
    if (o->eot_token >= run->cfg.vocab_size)
        fail("flag --eot-token %d: not a token of the model's vocabulary (%d)", o->eot_token, run->cfg.vocab_size);
    if (o->eot_token >= 0) {
        if (ls->tk.loaded && ls->tk.eot_token != o->eot_token)
            fail("flag --eot-token %d: the tokenizer file %s says end of text is %d", o->eot_token, ls->tk.path, ls->tk.eot_token);
        d.eot_token = o->eot_token;
    } else if (ls->tk.loaded) {
        d.eot_token = ls->tk.eot_token;
    } else if (run->cfg.vocab_size == 50257) {
        d.eot_token = 50256;
    } else {
        fail("flags --reset-attention-mask, --reset-position-ids, --eod-mask-loss: no tokenizer file says which token ends a text, "
             "and the vocabulary (%d) is not GPT-2's: give --eot-token N", run->cfg.vocab_size);
    }
    if (d.eot_token >= run->cfg.vocab_size)
        fail("the tokenizer file's end-of-text token %d is not a token of the model's vocabulary (%d)", d.eot_token, run->cfg.vocab_size);
    if (!be->set_documents) fail("flags --reset-attention-mask, --reset-position-ids, --eod-mask-loss: this trainer has no document masking");
    run->docs = d;
    be->set_documents(be->ctx, &d);
    int* starts = documents_need_starts(&d) ? be->doc_start : NULL;
    int* chunks = d.reset_attention_mask && run->cp.group_size > 1 ? be->ring_chunks : NULL; /* the ring pairs chunks by their work */
    if (starts) {
        dataloader_documents(&ls->train, d.eot_token, starts, chunks);
        if (ls->has_val) dataloader_documents(&ls->val, d.eot_token, starts, chunks);
    }
    printf("documents: start at token %d;%s%s%s\n", d.eot_token, d.reset_attention_mask ? " attention masked to each document;" : "",
           d.reset_position_ids ? " positions restart at each document;" : "", d.eod_mask_loss ? " no loss where the input is end of text" : "");
}

/* After the first step with --reset-attention-mask: the share of the causal
 * (query, key) pairs the last micro-batch's documents leave to attention,
 * and how unevenly the ranks share that work: each rank's pairs against the
 * mean of all; under the ring (where the zigzag chunks no longer carry equal
 * work) each member's share in group 0, as the loader paired the chunks and
 * as the zigzag would have. */
static inline void report_attended_pairs(const Run* run, const Backend* be, const DataLoader* train) {
    if (!run->docs.reset_attention_mask) return;
    int N = run->cp.group_size, Tl = run->opt.T / N;
    TokenLayout lay = token_layout(Tl, run->cp.member, N, be->ring_chunks);
    double mine = 0.0, causal = 0.0;
    for (size_t n = 0; n < (size_t)run->opt.B * (size_t)Tl; n++) {
        int pos = token_position(&lay, n);
        mine += (double)(pos - be->doc_start[n] + 1);
        causal += (double)(pos + 1);
    }
    double all = proc_sum(mine, "the attended pairs"), all_causal = proc_sum(causal, "the causal pairs");
    double most = proc_max(mine, "the attended pairs"), least = -proc_max(-mine, "the attended pairs");
    double mean = all / run->world;
    if (run->rank != 0) return;
    printf("documents: attention attends %.3g%% of the causal pairs (the last micro-batch)", 100.0 * all / all_causal);
    if (run->world > 1) printf("; ranks' pairs from %.2f to %.2f of their mean", least / mean, most / mean);
    printf("\n");
    if (N == 1 || !train->chunk_work) return;
    char paired[1024], zigzag[1024];
    double busiest = ring_member_shares(train->chunk_work, be->ring_chunks, N, paired, sizeof(paired));
    double busiest_zigzag = ring_member_shares(train->chunk_work, NULL, N, zigzag, sizeof(zigzag));
    printf("ring balance: members' shares of the attended pairs %s, the busiest %.3fx the mean (the zigzag chunks: %s, %.3fx)\n", paired,
           busiest, zigzag, busiest_zigzag);
}

/* Data loaders (validated here, before any step), tokenizer, prompt,
 * buffers. Reads only: nothing in -o changes before open_output. */
static inline void loop_open(Run* run, Backend* be, LoopState* ls) {
    const TrainOptions* o = &run->opt;
    void* staging = be->io_chunk;
    size_t staging_bytes = run->io_chunk_floats * 4;
    ls->log.fd = -1;
    const ContextGroups* g = &run->cp;
    memset(&ls->train, 0, sizeof(ls->train));
    if (o->max_steps != 0) /* -x 0 trains nothing: no training data is read */
        dataloader_init(&ls->train, "-i", o->train_glob, o->B, o->T, run->rank, run->world, g->group, g->groups, g->member, g->group_size,
                        run->cfg.vocab_size,
                        o->shuffle, (uint64_t)o->seed, be->window, be->inputs, be->targets, staging, staging_bytes);
    ls->has_val = o->val_glob[0] != '\0' && o->val_every > 0;
    if (ls->has_val)
        dataloader_init(&ls->val, "-j", o->val_glob, o->B, o->T, run->rank, run->world, g->group, g->groups, g->member, g->group_size,
                        run->cfg.vocab_size, 0,
                        (uint64_t)o->seed, be->window, be->inputs, be->targets, staging, staging_bytes);
    load_tokenizer(run, &ls->tk);
    documents_resolve(run, be, ls);
    ls->probs = (float*)malloc_check((size_t)run->cfg.vocab_size * sizeof(float), "sampler");
    ls->gen = (int*)malloc_check(((size_t)o->T + 1) * sizeof(int), "sampler");
    ls->candidates = (SampleCandidate*)malloc_check((size_t)run->cfg.vocab_size * sizeof(SampleCandidate), "sampler");
    load_prompt(run, ls);
    position_losses_init(&ls->by_position, o, &run->cp);
    const char* per_token = ls->by_position.n ? "--eval-by-position" : "--eval-dump";
    if (ls->by_position.per_token && !ls->has_val) fail("%s needs validation: shards in -j and -v above 0", per_token);
    if (ls->by_position.per_token && (!be->token_losses || !be->token_top1))
        fail("%s: this trainer cannot report per-token losses and top-1 tokens", per_token);
    struct stat dump_st;
    if (o->eval_dump[0] && stat(o->eval_dump, &dump_st) == 0 && S_ISDIR(dump_st.st_mode))
        fail("--eval-dump %s: is a directory (give the file to write)", o->eval_dump);
    char dump_dir[4096];
    const char* slash = strrchr(o->eval_dump, '/');
    int dir_len = slash ? (slash == o->eval_dump ? 1 : (int)(slash - o->eval_dump)) : 0; /* 0: the working directory */
    snprintf(dump_dir, sizeof(dump_dir), "%.*s", dir_len, o->eval_dump);
    if (dir_len > 0 && (stat(dump_dir, &dump_st) != 0 || !S_ISDIR(dump_st.st_mode))) /* else the first evaluation fails, -o written */
        fail("--eval-dump %s: the directory %s does not exist (create it first)", o->eval_dump, dump_dir);
    /* -x 0 does only these three; with none of them the run would do nothing and report success */
    if (o->max_steps == 0 && !ls->has_val && o->sample_every == 0 && !(o->out_dir[0] && run->resume_step < 0))
        fail("flag -x 0: nothing to do: no validation (-j \"\" or -v 0), no samples (-s 0) and no -o to write the model to");
}

/* The first step that changes -o, taken only once everything that can be
 * checked (flags, model, data, tokenizer, prompt, the checkpoint resumed)
 * has been: creates -o (and locks it, if it did not exist before), removes
 * the DONE markers of damaged checkpoints newer than the one resumed, this
 * run's stale temporaries (left by
 * kill -9 or a second signal), with --supersede every checkpoint file of an
 * earlier run (a fresh run without it was refused any: output_check), and opens the log (a fresh
 * run's starts empty; a resumed run's loses the lines it will write again). */
static inline void open_output(Run* run, LoopState* ls) {
    const TrainOptions* o = &run->opt;
    if (o->out_dir[0]) mkdir_check(o->out_dir); /* by every rank: each writes its own state file there */
    if (o->out_dir[0] && run->rank == 0) {
        output_lock(o->out_dir, 1); /* when this run created -o */
        int unmarked = run->resume_step >= 0 ? checkpoint_unmark_newer(o->out_dir, run->resume_step) : 0;
        if (unmarked)
            printf("checkpoints: removed the DONE marker%s of %d damaged checkpoint%s after step %d (their files stay until this run "
                   "writes those steps again)\n", unmarked == 1 ? "" : "s", unmarked, unmarked == 1 ? "" : "s", run->resume_step);
        int stale = checkpoint_remove_temporaries(o->out_dir);
        if (stale) printf("checkpoints: removed %d stale temporary file%s (*.tmp) from %s\n", stale, stale == 1 ? "" : "s", o->out_dir);
        int removed = o->supersede ? checkpoint_remove_all(o->out_dir) : 0; /* else output_check refused any */
        if (removed) printf("checkpoints: removed %d earlier checkpoint%s from %s\n", removed, removed == 1 ? "" : "s", o->out_dir);
    }
    proc_barrier("the barrier after clearing -o");
    logger_open(&ls->log, run->rank == 0 ? o->out_dir : NULL, run->resume_step);
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
    /* 75 tells a requeue loop to resume; without -o there is nothing to
     * resume, so the status is the signal's, as if it had ended the run */
    exit(dir[0] ? PREEMPT_EXIT_STATUS : 128 + sig);
}

/* Loads the parameters (or checkpoint), runs all steps, reports. */
static inline void train(Run* run, Backend* be) {
    const MemoryPlan* p = &run->plan;
    load_parameters(run, be);
    loss_scaler_init(&run->scaler, be->loss_scaling);
    run->updates = 0;
    LoopState ls;
    loop_open(run, be, &ls);
    int steps = total_steps(run, &ls.train);
    ranks_check_data_and_steps(&ls, steps);
    run->hp.tokens_per_step = run_tokens_per_step(run);
    run->hp.steps = run->opt.max_steps == 0 ? 0 : steps;
    run->data = data_record(run->opt.train_glob, loader_digest(&ls.train));
    int start = run->resume_step >= 0 ? load_checkpoint(run, be, &ls.train) : 0;
    if (steps < start && run->opt.max_steps != 0)
        fail("flag -x: %d steps, but the checkpoint resumed is at step %d (more steps, or -x 0 to evaluate it)", steps, start);
    open_output(run, &ls); /* everything is checked: from here on -o changes */
    if (start > 0) logger_event(&ls.log, start, "resumed");
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
        test_hook_stall(step + 1); /* REMAT_TEST_STALL: a test hook, nothing unless set */
        if (be->step_begin) be->step_begin(be->ctx, step + 1);
        double t0 = now_ms();
        StepResult r = train_step(run, be, &ls.train, step + 1, steps);
        double ms = now_ms() - t0;
        if (be->step_end) be->step_end(be->ctx, step + 1);
        if (step > start) { total_ms += ms; timed_steps++; } /* the first step warms caches */
        report_step(run, be, &ls, step + 1, steps, &r, ms);
        if (step == start) report_attended_pairs(run, be, &ls.train);
        if (step + 1 < steps) maybe_stop_on_signal(run, be, &ls, step + 1);
    }
    if (timed_steps) printf("average step time %.2f ms over %d steps (first step excluded)\n", total_ms / timed_steps, timed_steps);
    if (p->spec.backend == BACKEND_CPU)
        printf("peak resident memory: %.1f MiB (plan: %.1f MiB%s, and up to %.0f MiB for the program%s)\n", (double)peak_rss_kib() / 1024.0,
               mib(p->total_bytes + p->host_total_bytes), !p->host_total_bytes ? "" : p->spec.offload_optimizer ? " with the host pool of the offloaded optimizer" : " with the offloaded checkpoints' host pool",
               mib(plan_program_bytes()), remat_proc.uses_mpi ? " and MPI" : "");
    else
        printf("peak host resident memory: %.1f MiB\n", (double)peak_rss_kib() / 1024.0);
    loop_close(&ls);
}

#endif
