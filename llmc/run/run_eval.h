/*
 * What the loop does between steps besides checkpoints: validation loss
 * (with --eval-by-position's buckets) and sampling from a prompt.
 */
#ifndef REMAT_RUN_EVAL_H
#define REMAT_RUN_EVAL_H

#include "backend.h"

/* What an evaluation reads of each validation token besides the mean loss,
 * for --eval-by-position and --eval-dump: its loss and whether the model's
 * most probable token (top-1) is the target. Buckets are ranges of global
 * positions 0..T-1: [0,W), [W,2W), [2W,4W), ... for a width W; every:W, all
 * of width W; or explicit edges E0,E1,...,En (positions outside [E0,En) in
 * none). */
#define MAX_POSITION_BUCKETS 256
#define EVAL_DUMP_MAGIC 20261203 /* docs/FORMATS.md: the per-token evaluation dump */
#define EVAL_DUMP_VERSION 2       /* 2 added the `position` array */
#define EVAL_DUMP_ARRAYS 4        /* target, top1, loss, position: (S, T) each, 4 bytes an element */
typedef struct {
    int n;             /* buckets (0: no --eval-by-position) */
    int begin[MAX_POSITION_BUCKETS], end[MAX_POSITION_BUCKETS];
    double loss_sum[MAX_POSITION_BUCKETS], hits[MAX_POSITION_BUCKETS], tokens[MAX_POSITION_BUCKETS];
    double all_hits, all_tokens; /* top-1 over every token evaluated */
    int per_token;     /* buckets or a dump: the per-token results are read */
    int* bucket_of;    /* (T) bucket of each position, -1: none */
    float* losses;     /* (B*Tl) host copy of the last batch's losses: this rank's Tl = T / N tokens of each row */
    int* top1;         /* (B*Tl) the last batch's top-1 tokens */
    int* position;     /* (Tl) global position of each of them in the last batch (llmc/core/dataloader.h) */
    int* given_position; /* (B*Tl) the position the model gave each (within its document under --reset-position-ids), -1: not counted */
    const char* dump_path; /* --eval-dump ("": none) */
    FILE* dump;        /* during an evaluation: the dump's temporary file (rank 0: dump_af's) */
    AtomicFile dump_af;
    long dump_sequences;
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

static inline void position_bucket_add(PositionLosses* pl, long begin, long end, const char* spec) {
    if (pl->n == MAX_POSITION_BUCKETS) fail("flag --eval-by-position: '%s' makes more than %d buckets", spec, MAX_POSITION_BUCKETS);
    pl->begin[pl->n] = (int)begin;
    pl->end[pl->n] = (int)end;
    pl->n++;
}

static inline long position_edge(const char* spec, const char** p) {
    char* end = NULL;
    errno = 0;
    long v = strtol(*p, &end, 10);
    if (end == *p || errno == ERANGE || v < 0 || (*end && *end != ',') || !number_starts_plainly(*p, 0))
        fail("flag --eval-by-position: '%s' is not 0, a width W, every:W, or increasing edges E0,E1,... (non-negative integers)", spec);
    *p = end;
    return v;
}

/* --eval-by-position's buckets over positions 0..T-1 (T: the whole sequence). */
static inline void position_buckets_parse(PositionLosses* pl, const char* given, int T) {
    const char* p = given;
    char spec[56]; /* the flag as messages show it: a long list of edges cut short */
    if (strlen(given) > 48) snprintf(spec, sizeof(spec), "%.45s...", given);
    else snprintf(spec, sizeof(spec), "%s", given);
    if (strncmp(given, "every:", 6) == 0) {
        p += 6;
        long w = position_edge(spec, &p);
        if (w < 1 || *p) fail("flag --eval-by-position: '%s': every:W needs one width W of at least 1", spec);
        if (w > T) fail("flag --eval-by-position: every:%ld is beyond -t %d", w, T);
        for (long b = 0; b < T; b += w) position_bucket_add(pl, b, b + w < T ? b + w : T, spec);
    } else if (strchr(given, ',')) {
        long prev = position_edge(spec, &p);
        while (*p == ',') {
            p++;
            long e = position_edge(spec, &p);
            if (e <= prev) fail("flag --eval-by-position: '%s': the edges must increase (%ld after %ld)", spec, e, prev);
            if (e > T) fail("flag --eval-by-position: '%s': edge %ld is beyond -t %d (positions run 0 to T-1; the last edge is at most T)", spec, e, T);
            position_bucket_add(pl, prev, e, spec);
            prev = e;
        }
    } else {
        long w = position_edge(spec, &p);
        if (w == 0) return;
        if (w > T) fail("flag --eval-by-position: width %ld is beyond -t %d", w, T);
        for (long begin = 0, end = w; begin < T; begin = end, end *= 2) position_bucket_add(pl, begin, end < T ? end : T, spec);
    }
}

static inline void position_losses_init(PositionLosses* pl, const TrainOptions* o, const ContextGroups* cp) {
    memset(pl, 0, sizeof(*pl));
    int B = o->B, T = o->T, Tl = T / cp->group_size;
    position_buckets_parse(pl, o->eval_by_position, T);
    pl->dump_path = o->eval_dump;
    pl->per_token = pl->n > 0 || o->eval_dump[0];
    if (!pl->per_token) return;
    pl->bucket_of = (int*)malloc_check((size_t)T * sizeof(int), "position buckets");
    pl->losses = (float*)malloc_check((size_t)B * Tl * sizeof(float), "per-token results");
    pl->top1 = (int*)malloc_check((size_t)B * Tl * sizeof(int), "per-token results");
    pl->position = (int*)malloc_check((size_t)Tl * sizeof(int), "per-token results");
    pl->given_position = (int*)malloc_check((size_t)B * Tl * sizeof(int), "per-token results");
    for (int t = 0; t < T; t++) pl->bucket_of[t] = -1;
    for (int i = 0; i < pl->n; i++)
        for (int t = pl->begin[i]; t < pl->end[i]; t++) pl->bucket_of[t] = i;
}

/* --eval-dump, before the evaluation's first batch: rank 0 writes the header
 * and sizes the temporary file; then every rank opens it to write its tokens
 * in place (one file for all processes: -o's directory is shared anyway). */
static inline void eval_dump_begin(PositionLosses* pl, const Run* run, int batches, int step) {
    if (!pl->dump_path[0]) return;
    const TrainOptions* o = &run->opt;
    pl->dump_sequences = (long)batches * run->cp.groups * o->B;
    if (run->rank == 0) {
        atomic_open(&pl->dump_af, pl->dump_path);
        int32_t h[256] = {0};
        h[0] = EVAL_DUMP_MAGIC; h[1] = EVAL_DUMP_VERSION; h[2] = o->T; h[3] = (int32_t)pl->dump_sequences; h[4] = step; h[5] = run->cfg.vocab_size;
        fwrite_check(h, 4, 256, pl->dump_af.f, pl->dump_af.tmp_path);
        if (fflush(pl->dump_af.f) != 0 || ftruncate(fileno(pl->dump_af.f), 1024 + 4L * EVAL_DUMP_ARRAYS * pl->dump_sequences * o->T) != 0)
            fail("%s: cannot size the evaluation dump (%s)", pl->dump_af.tmp_path, write_error_why(errno));
        pl->dump = pl->dump_af.f;
    }
    proc_barrier("the barrier after creating the evaluation dump");
    if (run->rank != 0) {
        snprintf(pl->dump_af.tmp_path, sizeof(pl->dump_af.tmp_path), "%s.tmp", pl->dump_path);
        pl->dump = fopen_check(pl->dump_af.tmp_path, "r+b");
    }
}

/* This rank's B x Tl tokens of batch `batch` into the dump's four arrays
 * (sequence, position): target (int32), top-1 (int32), loss (fp32), the
 * position the model gave the token (int32, -1: not counted). */
static inline void eval_dump_batch(PositionLosses* pl, const Run* run, const int* targets, int batch) {
    int B = run->opt.B, T = run->opt.T, Tl = T / run->cp.group_size;
    long plane = (long)pl->dump_sequences * T;
    for (int b = 0; b < B; b++) {
        long seq = ((long)batch * run->cp.groups + run->cp.group) * B + b;
        for (int i = 0; i < Tl;) { /* runs of consecutive positions: the row's chunks */
            int k = 1;
            while (i + k < Tl && pl->position[i + k] == pl->position[i] + k) k++;
            long at = seq * T + pl->position[i];
            size_t row = (size_t)b * Tl + i;
            const void* arrays[EVAL_DUMP_ARRAYS] = {targets + row, pl->top1 + row, pl->losses + row, pl->given_position + row};
            for (int a = 0; a < EVAL_DUMP_ARRAYS; a++) {
                fseek_check(pl->dump, 1024 + 4 * ((long)a * plane + at), SEEK_SET, pl->dump_af.tmp_path);
                fwrite_check(arrays[a], 4, (size_t)k, pl->dump, pl->dump_af.tmp_path);
            }
            i += k;
        }
    }
}

static inline void eval_dump_end(PositionLosses* pl, const Run* run) {
    if (!pl->dump) return;
    if (run->rank != 0) fclose_check(pl->dump, pl->dump_af.tmp_path);
    proc_barrier("the barrier after writing the evaluation dump");
    if (run->rank == 0) atomic_commit(&pl->dump_af);
    pl->dump = NULL;
}

/* Adds the last batch's B x Tl token losses and top-1 hits to their
 * positions' buckets (and the dump): with --reset-position-ids the position
 * within the document, and with --eod-mask-loss only the tokens counted. */
static inline void position_losses_add(PositionLosses* pl, Backend* be, const Run* run, int batch) {
    int B = run->opt.B, Tl = run->opt.T / run->cp.group_size;
    const DocumentOptions* docs = &run->docs;
    TokenLayout lay = token_layout(Tl, run->cp.member, run->cp.group_size, be->ring_chunks); /* this batch's chunks */
    for (int i = 0; i < Tl; i++) pl->position[i] = token_position(&lay, (size_t)i);
    be->token_losses(be->ctx, pl->losses);
    be->token_top1(be->ctx, pl->top1);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < Tl; i++) {
            size_t k = (size_t)b * Tl + i;
            pl->given_position[k] = -1;
            if (docs->eod_mask_loss && be->inputs[k] == docs->eot_token) continue;
            pl->given_position[k] = pl->position[i] - (docs->reset_position_ids ? be->doc_start[k] : 0);
            double hit = pl->top1[k] == be->targets[k];
            pl->all_hits += hit;
            pl->all_tokens += 1.0;
            int bucket = pl->bucket_of[pl->given_position[k]];
            if (bucket < 0) continue;
            pl->loss_sum[bucket] += (double)pl->losses[k];
            pl->hits[bucket] += hit;
            pl->tokens[bucket] += 1.0;
        }
    if (pl->dump) eval_dump_batch(pl, run, be->targets, batch);
}

static inline void position_losses_free(PositionLosses* pl) {
    free(pl->bucket_of);
    free(pl->losses);
    free(pl->top1);
    free(pl->position);
    free(pl->given_position);
}

/* "1k" for multiples of 1024, else the number. */
static inline void position_label(int pos, char* buf, size_t n) {
    if (pos > 0 && pos % 1024 == 0) snprintf(buf, n, "%dk", pos / 1024);
    else snprintf(buf, n, "%d", pos);
}

static inline void print_position_losses(const PositionLosses* pl, int step, Logger* log) {
    printf("val loss by position at step %d:", step);
    float loss[MAX_POSITION_BUCKETS], top1[MAX_POSITION_BUCKETS];
    for (int i = 0; i < pl->n; i++) {
        char a[16], b[16];
        position_label(pl->begin[i], a, sizeof(a));
        position_label(pl->end[i], b, sizeof(b));
        if (pl->tokens[i] == 0.0) { /* e.g. positions past every document's length under --reset-position-ids */
            loss[i] = top1[i] = NAN; /* the log's null, with tokens 0 */
            printf("%s %s-%s - top1 - (0 tokens)", i ? " |" : "", a, b);
            continue;
        }
        loss[i] = (float)(pl->loss_sum[i] / pl->tokens[i]);
        top1[i] = (float)(pl->hits[i] / pl->tokens[i]);
        printf("%s %s-%s %.6f top1 %.4f", i ? " |" : "", a, b, (double)loss[i], (double)top1[i]);
    }
    printf("\n");
    logger_val_by_position(log, step, pl->n, pl->begin, pl->end, loss, top1, pl->tokens);
}

/* Mean validation loss over at most -m batches; with --eval-by-position
 * also per position bucket (summed over processes), printed and logged;
 * with --eval-dump every token's results written. */
static inline float evaluate(Run* run, Backend* be, DataLoader* val, PositionLosses* pl, int step, Logger* log) {
    dataloader_reset(val);
    size_t batches = dataloader_batches_per_epoch(val);
    int n = (size_t)run->opt.val_batches < batches ? run->opt.val_batches : (int)batches;
    for (int i = 0; i < pl->n; i++) pl->loss_sum[i] = pl->hits[i] = pl->tokens[i] = 0.0;
    pl->all_hits = pl->all_tokens = 0.0;
    eval_dump_begin(pl, run, n, step);
    double sum = 0.0, counted = 0.0;
    size_t rows = (size_t)run->opt.B * (size_t)(run->opt.T / run->cp.group_size);
    for (int i = 0; i < n; i++) {
        dataloader_next(val); /* fills be->inputs, be->targets */
        double k = (double)documents_counted(&run->docs, be->inputs, rows); /* all of them without --eod-mask-loss */
        sum += (double)be->forward_loss(be->ctx, be->inputs, be->targets) * (run->docs.eod_mask_loss ? k : 1.0);
        counted += k;
        if (pl->per_token) position_losses_add(pl, be, run, i);
    }
    eval_dump_end(pl, run);
    for (int i = 0; i < pl->n; i++) {
        pl->loss_sum[i] = proc_sum(pl->loss_sum[i], "the validation sums by position");
        pl->hits[i] = proc_sum(pl->hits[i], "the validation sums by position");
        pl->tokens[i] = proc_sum(pl->tokens[i], "the validation sums by position");
    }
    float mean;
    int none_counted = 0; /* every token masked: no mean to print (a diverged model's NaN still prints as nan) */
    if (run->docs.eod_mask_loss) { /* the mean over the tokens counted, all batches and processes */
        counted = proc_sum(counted, "the count of validation tokens counted");
        double total = proc_sum(sum, "the validation loss sum");
        none_counted = !(counted > 0);
        mean = none_counted ? NAN : (float)(total / counted); /* no mean of nothing: the log's null */
    } else {
        mean = (float)proc_mean(sum / n, "the validation loss mean");
    }
    static const char* const none = "no token counted: under --eod-mask-loss every input evaluated is the end-of-text token";
    if (none_counted) printf("val loss - at step %d (%s)\n", step, none);
    else printf("val loss %.6f at step %d\n", (double)mean, step);
    logger_val(log, step, mean);
    if (pl->per_token) {
        double hits = proc_sum(pl->all_hits, "the validation top-1 count"), tokens = proc_sum(pl->all_tokens, "the validation top-1 count");
        if (run->rank == 0 && tokens == 0.0) printf("val top-1 accuracy - at step %d (%s)\n", step, none);
        else if (run->rank == 0) printf("val top-1 accuracy %.6f at step %d (%.0f tokens)\n", hits / tokens, step, tokens);
    }
    if (pl->n && run->rank == 0) print_position_losses(pl, step, log);
    if (pl->dump_path[0] && run->rank == 0) printf("eval dump: %ld sequences of %d tokens written to %s\n", pl->dump_sequences, run->opt.T, pl->dump_path);
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
        /* generating token n reads n tokens of context, at most -t: the context must stay below it */
        if (n + 1 >= run->opt.T)
            fail("prompt: %d tokens with the leading end-of-text leave no room to generate within -t %d (at most %d prompt tokens)",
                 prompt->n + (prompt->ids[0] != eot), run->opt.T, run->opt.T - 2);
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

/* --prompt or --prompt-tokens, for the ranks of group 0 when they sample. */
static inline void load_prompt(Run* run, LoopState* ls) {
    const TrainOptions* o = &run->opt;
    memset(&ls->prompt, 0, sizeof(ls->prompt));
    if ((o->prompt[0] || o->prompt_tokens[0]) && o->sample_every == 0) fail("--prompt/--prompt-tokens: -s 0 takes no samples");
    if (run->cp.group != 0 || o->sample_every == 0) return;
    if (o->prompt_tokens[0]) prompt_load_file(&ls->prompt, o->prompt_tokens);
    else if (o->prompt[0]) prompt_from_helper(&ls->prompt, o->prompt, ls->tk.loaded ? ls->tk.path : NULL);
    int context = sample_context(run, &ls->tk, &ls->prompt, ls->gen); /* fails now, not at the first sample, when it does not fit */
    if (ls->prompt.n && o->T - context < o->gen_tokens)
        printf("sample: the prompt (%d tokens with the leading end-of-text) leaves room for %d of the -g %d tokens within -t %d\n",
               context, o->T - context, o->gen_tokens, o->T);
}

/* Default tokenizer: *tokenizer.bin beside the first train shard, else gpt2_tokenizer.bin. */
static inline void load_tokenizer(Run* run, Tokenizer* tk) {
    memset(tk, 0, sizeof(*tk));
    const char* given = run->opt.tokenizer_path;
    if (given[0]) {
        tokenizer_load(tk, given);
        if (tk->vocab_size != run->cfg.vocab_size)
            fail("--tokenizer %s: %d tokens, but the model's vocabulary has %d: it would decode samples into other tokens' text",
                 given, tk->vocab_size, run->cfg.vocab_size);
        return;
    }
    glob_t g;
    char pattern[4300];
    const char* slash = strrchr(run->opt.train_glob, '/');
    int dirlen = slash ? (int)(slash - run->opt.train_glob) : 1;
    snprintf(pattern, sizeof(pattern), "%.*s/*tokenizer.bin", dirlen, slash ? run->opt.train_glob : ".");
    if (glob(pattern, 0, NULL, &g) == 0 && g.gl_pathc > 0) tokenizer_load(tk, g.gl_pathv[0]);
    else if (file_exists("gpt2_tokenizer.bin")) tokenizer_load(tk, "gpt2_tokenizer.bin");
    else printf("tokenizer: none found, samples print token ids (see --tokenizer)\n");
    globfree(&g);
    if (tk->loaded && tk->vocab_size != run->cfg.vocab_size) {
        printf("tokenizer: %s has %d tokens, the model's vocabulary %d: not used, samples print token ids (see --tokenizer)\n",
               tk->path, tk->vocab_size, run->cfg.vocab_size);
        tokenizer_free(tk);
        memset(tk, 0, sizeof(*tk));
    }
}

#endif
