/*
 * Where a rank's token rows sit in their sequences, and the blocks of
 * attention over them: shared by the CPU reference, the CUDA trainer and
 * its kernels (host and device code).
 *
 * Context parallelism (--context-parallel N, docs/context-parallel.md) cuts
 * each sequence of T*N tokens into 2N chunks of Tc = T/2; group member r
 * holds chunks r and 2N-1-r, so every member has the same causal work. A
 * rank's rows are B x T local tokens; without context parallelism (group_size 1)
 * the local row is the global one.
 */
#ifndef REMAT_TOKEN_LAYOUT_H
#define REMAT_TOKEN_LAYOUT_H

#include <stddef.h>
#include "rand.h" /* REMAT_HOST_DEVICE */

/* Global position of token i (0 <= i < Tl) of the rows member `member` of a
 * group of `group_size` holds: Tl tokens, two chunks of Tl / 2. */
REMAT_HOST_DEVICE static inline int context_position(int i, int Tl, int member, int group_size) {
    if (group_size == 1) return i;
    int Tc = Tl / 2;
    return i < Tc ? member * Tc + i : (2 * group_size - 1 - member) * Tc + (i - Tc);
}

/* This rank's B x T token rows: row n is token n % T of sequence n / T, at
 * global position context_position(n % T, ...) of a sequence of T * group_size
 * tokens (group_size 1: n % T). */
typedef struct { int T, member, group_size; } TokenLayout;

REMAT_HOST_DEVICE static inline int token_position(const TokenLayout* lay, size_t n) {
    return context_position((int)(n % (size_t)lay->T), lay->T, lay->member, lay->group_size);
}

/* The row of the whole (B, T * group_size) batch that local row n is. */
REMAT_HOST_DEVICE static inline size_t token_global_row(const TokenLayout* lay, size_t n) {
    return n / (size_t)lay->T * (size_t)lay->T * (size_t)lay->group_size + (size_t)token_position(lay, n);
}

/* One block of causal attention: the Tq queries of one stretch of a row
 * against the Tk keys of another, each stretch given by its global position
 * (q0, k0) and its local index in the row (qi in this rank's rows, ki in the
 * K/V block's rows); key u is seen by query t when u <= t. A whole sequence
 * is the block q0 = k0 = qi = ki = 0, Tq = Tk = T; under context
 * parallelism a block is one chunk of queries against one chunk of keys
 * (context_chunk_block). T is the whole sequence's length (dropout's masks
 * are laid out on it), Tl the tokens of each row the tensors hold.
 * doc_start (packed documents, llmc/documents.h; NULL: none) holds, for
 * each of this rank's B x Tl rows, the global position where its document
 * starts: query t then sees key u only when doc_start[t] <= u as well, and
 * the keys before that are skipped, not masked. On the GPU it points at
 * device memory. */
typedef struct {
    int B, C, NH, T, Tl;
    int Tq, Tk, q0, k0, qi, ki;
    const int* doc_start;
} AttentionBlock;

/* Keys of the block that query i sees: none, some (the diagonal) or all. */
REMAT_HOST_DEVICE static inline int block_keys_seen(const AttentionBlock* a, int i) {
    int n = a->q0 + i - a->k0 + 1;
    return n < 0 ? 0 : n < a->Tk ? n : a->Tk;
}

/* The first key of the block that query i of row b sees: 0, or with
 * documents the one at its document's start (block_keys_seen or more: none). */
REMAT_HOST_DEVICE static inline int block_keys_first(const AttentionBlock* a, int b, int i) {
    if (!a->doc_start) return 0;
    int first = a->doc_start[(size_t)b * (size_t)a->Tl + (size_t)(a->qi + i)] - a->k0;
    return first > 0 ? first : 0;
}

/* Whether any query of the block sees any of its keys (with documents the
 * ring skips a block none does). */
static inline int block_has_pairs(const AttentionBlock* a) {
    for (int b = 0; b < a->B; b++)
        for (int i = 0; i < a->Tq; i++)
            if (block_keys_first(a, b, i) < block_keys_seen(a, i)) return 1;
    return 0;
}

/* The whole sequence on one process: one block. */
static inline AttentionBlock whole_sequence(int B, int T, int C, int NH) {
    AttentionBlock a = {B, C, NH, T, T, T, T, 0, 0, 0, 0, NULL};
    return a;
}

/* The chunk pair (query chunk qc of member `member`, key chunk kc of member
 * `origin`, each 0 or 1: the member's first or second chunk) of a group of
 * `group_size` members holding B x Tl tokens each, as an attention block; 0 when
 * the causal mask empties it. */
static inline int context_chunk_block(int B, int C, int NH, int Tl, int group_size, int member, int origin, int qc, int kc,
                                      AttentionBlock* a) {
    int Tc = Tl / 2;
    int gq = qc == 0 ? member : 2 * group_size - 1 - member, gk = kc == 0 ? origin : 2 * group_size - 1 - origin;
    if (gk > gq) return 0;
    AttentionBlock b = {B, C, NH, group_size * Tl, Tl, Tc, Tc, gq * Tc, gk * Tc, qc * Tc, kc * Tc, NULL};
    *a = b;
    return 1;
}

#endif
