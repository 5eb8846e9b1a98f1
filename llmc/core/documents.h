/*
 * Packed documents (docs/documents.md): --reset-attention-mask,
 * --reset-position-ids, --eod-mask-loss (Megatron-LM's names).
 *
 * In llm.c's shards the end-of-text token precedes each document, so a
 * document starts at its end-of-text token and runs up to the next one; a
 * row's first token starts a document too (the packing cut whatever came
 * before). Everything the three flags need is one array per micro-batch:
 * for each of a rank's B x Tl token rows, the global position (in its
 * sequence of T tokens, llmc/core/token_layout.h) at which that token's document
 * starts. With it
 *   - attention: query t sees key u when start[t] <= u <= t (documents are
 *     contiguous, so the causal mask with a per-query lower bound is the
 *     document mask, and every key before start[t] is work skipped);
 *   - positions: token t's position is t - start[t];
 *   - loss: a token whose input is end of text predicts its document's first
 *     token without context of its own and is not counted (a row's first
 *     token, when it is not end of text, is counted: the packing cut its
 *     context, as it cuts any long document's).
 * The data loader builds the array (it alone reads the tokens before a
 * context-parallel rank's chunks); a trainer that makes its own tokens
 * (sampling) builds it with document_starts_extend.
 */
#ifndef REMAT_DOCUMENTS_H
#define REMAT_DOCUMENTS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int reset_attention_mask; /* attention stays inside each document */
    int reset_position_ids;   /* positions restart at 0 at each document start */
    int eod_mask_loss;        /* no loss where the input token is end of text */
    int eot_token;            /* the token that starts a document; -1: none of the three is on */
} DocumentOptions;

/* Whether the per-token document starts are needed (attention or positions). */
static inline int documents_need_starts(const DocumentOptions* d) {
    return d->eot_token >= 0 && (d->reset_attention_mask || d->reset_position_ids);
}

static inline int documents_any(const DocumentOptions* d) {
    return d->reset_attention_mask || d->reset_position_ids || d->eod_mask_loss;
}

/* start[i] for tokens[0..n), which sit at global positions p0, p0+1, ... of
 * their row; `cur` is the start in force before p0 (0 at a row's start).
 * Returns the start in force after the last of them. */
static inline int document_starts_extend(int* start, const int* tokens, int n, int p0, int cur, int eot) {
    for (int i = 0; i < n; i++) {
        if (tokens[i] == eot) cur = p0 + i;
        start[i] = cur;
    }
    return cur;
}

/* The start in force after tokens[0..n) at positions p0..: the last
 * end-of-text among them, else cur (a chunk of a row this rank skips). */
static inline int document_starts_skip(const uint16_t* tokens, int n, int p0, int cur, int eot) {
    for (int i = 0; i < n; i++)
        if (tokens[i] == eot) cur = p0 + i;
    return cur;
}

/* Tokens of inputs[0..n) whose loss counts: all, or with --eod-mask-loss
 * those whose input is not end of text. */
static inline size_t documents_counted(const DocumentOptions* d, const int* inputs, size_t n) {
    if (!d->eod_mask_loss) return n;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += inputs[i] != d->eot_token;
    return k;
}

/* Attended (query, key) pairs of one row of the batch under the mask: the
 * causal triangle's T (T + 1) / 2 without documents, the sum over documents
 * of len (len + 1) / 2 with them. starts: the row's per-token starts (whole
 * row, positions 0..T-1), NULL: no document mask. */
static inline double documents_attended_pairs(const int* starts, int T) {
    double pairs = 0.0;
    for (int t = 0; t < T; t++) pairs += starts ? (double)(t - starts[t] + 1) : (double)(t + 1);
    return pairs;
}

#endif
