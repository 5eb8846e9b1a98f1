/*
 * Where a rank's token rows sit in their sequences, and the tiles of
 * attention over them: shared by the CPU reference, the CUDA trainer and
 * its kernels (host and device code).
 *
 * Context parallelism (--context-parallel N, docs/context-parallel.md) cuts
 * each sequence of T*N tokens into 2N chunks of Tc = T/2; group member r
 * holds chunks r and 2N-1-r (the zigzag), so every member has the same causal
 * work; with packed documents a micro-batch's chunks may be paired otherwise
 * (ring_chunks_balance), two to a member all the same. A rank's rows are B x T local tokens; without context parallelism (group_size 1)
 * the local row is the global one.
 */
#ifndef REMAT_TOKEN_LAYOUT_H
#define REMAT_TOKEN_LAYOUT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "rand.h" /* REMAT_HOST_DEVICE */

/* Global position of token i (0 <= i < Tl) of the rows member `member` of a
 * group of `group_size` holds under the zigzag layout: Tl tokens, two chunks
 * of Tl / 2. */
REMAT_HOST_DEVICE static inline int context_position(int i, int Tl, int member, int group_size) {
    if (group_size == 1) return i;
    int Tc = Tl / 2;
    return i < Tc ? member * Tc + i : (2 * group_size - 1 - member) * Tc + (i - Tc);
}

/* Which chunks each member holds: chunks[2m] < chunks[2m + 1], the two of
 * member m of a group of N (chunks of Tc = Tl / 2 tokens of a sequence of
 * 2N). NULL anywhere one is taken: the zigzag, m and 2N-1-m. With packed
 * documents the loader chooses them per micro-batch (ring_chunks_balance). */
static inline int ring_chunk(const int* chunks, int N, int member, int k) {
    if (chunks) return chunks[2 * member + k];
    return k == 0 ? member : 2 * N - 1 - member;
}

/* This rank's B x T token rows: row n is token n % T of sequence n / T, at
 * global position token_position(n) of a sequence of T * group_size tokens:
 * n % T without context parallelism (group_size 1), else in the first or
 * second of the member's chunks (first < second, each of T / 2 tokens). */
typedef struct { int T, member, group_size, first, second; } TokenLayout;

static inline TokenLayout token_layout(int T, int member, int group_size, const int* chunks) {
    TokenLayout lay = {T, member, group_size, ring_chunk(chunks, group_size, member, 0), ring_chunk(chunks, group_size, member, 1)};
    return lay;
}

/* The global position of token i (< T) of any of this rank's sequences. */
REMAT_HOST_DEVICE static inline int token_position_of(const TokenLayout* lay, int i) {
    int Tc = lay->T / 2;
    if (lay->group_size == 1) return i;
    return i < Tc ? lay->first * Tc + i : lay->second * Tc + (i - Tc);
}

REMAT_HOST_DEVICE static inline int token_position(const TokenLayout* lay, size_t n) { return token_position_of(lay, (int)(n % (size_t)lay->T)); }

/* The row of the whole (B, T * group_size) batch that local row n is. */
REMAT_HOST_DEVICE static inline size_t token_global_row(const TokenLayout* lay, size_t n) {
    return n / (size_t)lay->T * (size_t)lay->T * (size_t)lay->group_size + (size_t)token_position(lay, n);
}

/* The zigzag gives every member the same causal work; with documents the
 * work of a chunk (its queries' attended pairs, work[c] of 2N) follows the
 * documents' lengths instead. Pairing the heaviest chunk with the lightest,
 * the second heaviest with the second lightest and so on makes the largest
 * pair as small as any pairing can (an exchange argument); the pairs go to
 * members in the order of their first chunk, so that work rising with the
 * position (no documents, or documents of one length) gives back the
 * zigzag. Kept only where it pays: when its busiest member has strictly less
 * work than the zigzag's, else chunks is the zigzag. Integer work, a total
 * order on (work, chunk): the same choice on every rank that has the same
 * tokens. order: scratch of 2N. Returns whether it moved any chunk. */
static inline int ring_chunks_balance(int* chunks, int* order, const int64_t* work, int N) {
    int n = 2 * N;
    for (int c = 0; c < n; c++) order[c] = c;
    for (int i = 1; i < n; i++) /* insertion sort, heaviest first: 2N is small */
        for (int j = i; j > 0; j--) {
            int a = order[j - 1], b = order[j];
            if (work[a] > work[b] || (work[a] == work[b] && a < b)) break;
            order[j - 1] = b;
            order[j] = a;
        }
    int64_t zigzag = 0, balanced = 0;
    for (int m = 0; m < N; m++) {
        int64_t z = work[m] + work[n - 1 - m], p = work[order[m]] + work[order[n - 1 - m]];
        zigzag = z > zigzag ? z : zigzag;
        balanced = p > balanced ? p : balanced;
    }
    for (int m = 0; m < N; m++) { chunks[2 * m] = m; chunks[2 * m + 1] = n - 1 - m; }
    if (balanced >= zigzag) return 0;
    for (int k = 0; k < N; k++) { /* pair k: its chunks in order, keyed by the first */
        int a = order[k], b = order[n - 1 - k];
        chunks[2 * k] = a < b ? a : b;
        chunks[2 * k + 1] = a < b ? b : a;
    }
    for (int i = 1; i < N; i++) /* pairs in the order of their first chunk */
        for (int j = i; j > 0 && chunks[2 * j - 2] > chunks[2 * j]; j--) {
            int a0 = chunks[2 * j - 2], a1 = chunks[2 * j - 1];
            chunks[2 * j - 2] = chunks[2 * j]; chunks[2 * j - 1] = chunks[2 * j + 1];
            chunks[2 * j] = a0; chunks[2 * j + 1] = a1;
        }
    return 1;
}

/* Attended pairs of the queries before position x of documents of L tokens
 * packed from position 0 (a query at p attends p mod L + 1 keys). */
static inline int64_t packed_pairs_below(int64_t x, int64_t L) {
    int64_t whole = x / L, rest = x % L;
    return whole * (L * (L + 1) / 2) + rest * (rest + 1) / 2;
}

/* work[2N]: each chunk's attended pairs of a sequence of T tokens holding
 * documents of doc_len tokens packed from position 0 (0 or >= T: one
 * document, the causal triangle), chunks of T / 2N. */
static inline void ring_packed_chunk_work(int64_t* work, int64_t T, int N, int64_t doc_len) {
    int64_t Tc = T / (2 * N), L = doc_len > 0 && doc_len < T ? doc_len : T;
    for (int c = 0; c < 2 * N; c++) work[c] = packed_pairs_below((c + 1) * Tc, L) - packed_pairs_below(c * Tc, L);
}

/* The most work any member has, given chunk work[2N] and chunks (NULL: the zigzag). */
static inline int64_t ring_busiest_work(const int64_t* work, const int* chunks, int N) {
    int64_t most = 0;
    for (int m = 0; m < N; m++) {
        int64_t w = work[ring_chunk(chunks, N, m, 0)] + work[ring_chunk(chunks, N, m, 1)];
        most = w > most ? w : most;
    }
    return most;
}

/* Each member's share of its group's attended pairs, given the chunks' work
 * (2N) and the pairing (NULL: the zigzag), as "0.25 0.25 ..."; returns the
 * busiest member's work over the mean (1: none). */
static inline double ring_member_shares(const int64_t* work, const int* chunks, int N, char* out, size_t size) {
    double all = 0.0;
    for (int c = 0; c < 2 * N; c++) all += (double)work[c];
    size_t used = 0;
    for (int m = 0; m < N && used < size; m++)
        used += (size_t)snprintf(out + used, size - used, "%s%.3f", m ? " " : "",
                                 (double)(work[ring_chunk(chunks, N, m, 0)] + work[ring_chunk(chunks, N, m, 1)]) / all);
    return all > 0.0 ? (double)ring_busiest_work(work, chunks, N) * N / all : 1.0;
}

/* One tile of causal attention: the Tq queries of one stretch of a row
 * against the Tk keys of another, each stretch given by its global position
 * (q0, k0) and its local index in the row (qi in this rank's rows, ki in the
 * K/V block's rows); key u is seen by query t when u <= t. A whole sequence
 * is the tile q0 = k0 = qi = ki = 0, Tq = Tk = T; under context
 * parallelism a tile is one chunk of queries against one chunk of keys
 * (context_chunk_tile). T is the whole sequence's length (dropout's masks
 * are laid out on it), Tl the tokens of each row the tensors hold.
 * doc_start (packed documents, llmc/core/documents.h; NULL: none) holds, for
 * each of this rank's B x Tl rows, the global position where its document
 * starts: query t then sees key u only when doc_start[t] <= u as well, and
 * the keys before that are skipped, not masked. On the GPU it points at
 * device memory. */
typedef struct {
    int B, C, NH, T, Tl;
    int Tq, Tk, q0, k0, qi, ki;
    const int* doc_start;
    /* grouped-query heads (the CPU reference; 0: GPT-2's NH heads of C/NH):
     * NKV K/V heads of HD, query head h reading K/V head h / (NH/NKV) */
    int NKV, HD;
} AttentionTile;

/* Keys of the tile that query i sees: none, some (the diagonal) or all. */
REMAT_HOST_DEVICE static inline int tile_keys_seen(const AttentionTile* a, int i) {
    int n = a->q0 + i - a->k0 + 1;
    return n < 0 ? 0 : n < a->Tk ? n : a->Tk;
}

/* The first key of the tile that query i of row b sees: 0, or with
 * documents the one at its document's start (tile_keys_seen or more: none). */
REMAT_HOST_DEVICE static inline int tile_keys_first(const AttentionTile* a, int b, int i) {
    if (!a->doc_start) return 0;
    int first = a->doc_start[(size_t)b * (size_t)a->Tl + (size_t)(a->qi + i)] - a->k0;
    return first > 0 ? first : 0;
}

/* Whether any query of the tile sees any of its keys (with documents the
 * ring skips a tile none does). */
static inline int tile_has_pairs(const AttentionTile* a) {
    for (int b = 0; b < a->B; b++)
        for (int i = 0; i < a->Tq; i++)
            if (tile_keys_first(a, b, i) < tile_keys_seen(a, i)) return 1;
    return 0;
}

/* The whole sequence on one process: one tile. */
static inline AttentionTile whole_sequence(int B, int T, int C, int NH) {
    AttentionTile a = {B, C, NH, T, T, T, T, 0, 0, 0, 0, NULL, 0, 0};
    return a;
}

/* The chunk pair (query chunk qc of member `member`, key chunk kc of member
 * `origin`, each 0 or 1: the member's first or second chunk) of a group of
 * `group_size` members holding B x Tl tokens each (which chunks: `chunks`,
 * NULL the zigzag), as an attention tile; 0 when the causal mask empties it. */
static inline int context_chunk_tile(int B, int C, int NH, int Tl, int group_size, const int* chunks, int member, int origin, int qc,
                                      int kc, AttentionTile* a) {
    int Tc = Tl / 2;
    int gq = ring_chunk(chunks, group_size, member, qc), gk = ring_chunk(chunks, group_size, origin, kc);
    if (gk > gq) return 0;
    AttentionTile b = {B, C, NH, group_size * Tl, Tl, Tc, Tc, gq * Tc, gk * Tc, qc * Tc, kc * Tc, NULL, 0, 0};
    *a = b;
    return 1;
}

#endif
