/*
 * What the loop does between steps besides checkpoints: validation loss
 * (with --eval-by-position's buckets) and sampling from a prompt.
 */
#ifndef REMAT_RUN_EVAL_H
#define REMAT_RUN_EVAL_H

#include "run_checkpoints.h"

/* --eval-by-position: buckets [0,W), [W,2W), [2W,4W), ... of the positions
 * 0..T-1, the loss summed per bucket over every validation token. */
#define MAX_POSITION_BUCKETS 32
typedef struct {
    int n;
    int begin[MAX_POSITION_BUCKETS], end[MAX_POSITION_BUCKETS];
    double loss_sum[MAX_POSITION_BUCKETS], tokens[MAX_POSITION_BUCKETS];
    int* bucket_of;    /* (T) bucket of each position */
    float* losses;     /* (B*Tl) host copy of the last batch's losses: this rank's Tl = T / N tokens of each row */
    int* position;     /* (Tl) global position of each of them (llmc/dataloader.h) */
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

static inline void position_losses_init(PositionLosses* pl, int width, int B, int T, const ContextGroups* cp) {
    memset(pl, 0, sizeof(*pl));
    if (width <= 0) return;
    int Tl = T / cp->degree;
    pl->bucket_of = (int*)malloc_check((size_t)T * sizeof(int), "position buckets");
    pl->losses = (float*)malloc_check((size_t)B * Tl * sizeof(float), "position buckets");
    pl->position = (int*)malloc_check((size_t)Tl * sizeof(int), "position buckets");
    for (int i = 0; i < Tl; i++) pl->position[i] = context_position(i, Tl, cp->member, cp->degree);
    for (long begin = 0, end = width; begin < T; begin = end, end *= 2) {
        pl->begin[pl->n] = (int)begin;
        pl->end[pl->n] = (int)(end < T ? end : T);
        for (long t = begin; t < pl->end[pl->n]; t++) pl->bucket_of[t] = pl->n;
        pl->n++;
    }
}

/* Adds the last batch's B x Tl token losses to their positions' buckets:
 * with --reset-position-ids the position within the document, and with
 * --eod-mask-loss only the tokens counted. */
static inline void position_losses_add(PositionLosses* pl, Backend* be, const DocumentOptions* docs, int B, int Tl) {
    be->token_losses(be->ctx, pl->losses);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < Tl; i++) {
            size_t n = (size_t)b * Tl + i;
            if (docs->eod_mask_loss && be->inputs[n] == docs->eot_token) continue;
            int pos = pl->position[i] - (docs->reset_position_ids ? be->doc_start[n] : 0);
            int bucket = pl->bucket_of[pos];
            pl->loss_sum[bucket] += (double)pl->losses[(size_t)b * Tl + i];
            pl->tokens[bucket] += 1.0;
        }
}

static inline void position_losses_free(PositionLosses* pl) {
    free(pl->bucket_of);
    free(pl->losses);
    free(pl->position);
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
    double sum = 0.0, counted = 0.0;
    size_t rows = (size_t)run->opt.B * (size_t)(run->opt.T / run->cp.degree);
    for (int i = 0; i < n; i++) {
        dataloader_next(val); /* fills be->inputs, be->targets */
        double k = (double)documents_counted(&run->docs, be->inputs, rows); /* all of them without --eod-mask-loss */
        sum += (double)be->forward_loss(be->ctx, be->inputs, be->targets) * (run->docs.eod_mask_loss ? k : 1.0);
        counted += k;
        if (pl->n) position_losses_add(pl, be, &run->docs, run->opt.B, run->opt.T / run->cp.degree);
    }
    for (int i = 0; i < pl->n; i++) {
        pl->loss_sum[i] = proc_sum(pl->loss_sum[i], "the validation sums by position");
        pl->tokens[i] = proc_sum(pl->tokens[i], "the validation sums by position");
    }
    float mean;
    if (run->docs.eod_mask_loss) { /* the mean over the tokens counted, all batches and processes */
        counted = proc_sum(counted, "the count of validation tokens counted");
        double total = proc_sum(sum, "the validation loss sum");
        mean = counted > 0 ? (float)(total / counted) : 0.0f;
    } else {
        mean = (float)proc_mean(sum / n, "the validation loss mean");
    }
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
