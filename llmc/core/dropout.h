/*
 * Dropout masks that are computed, never stored.
 *
 * Every mask bit is a pure function of (seed, optimizer step, micro-step,
 * layer, site, global sequence, position, element): a forward, a recomputed
 * forward and the backward all draw the same bits, on the CPU and on the
 * GPU, so no mask is kept, the memory plan does not grow, recompute stays
 * bitwise, and a resumed run draws what the uninterrupted run drew (nothing
 * depends on how many numbers were drawn before). The sequence is its index
 * in the micro-step's global batch (data-parallel group g's B rows are
 * sequences g*B .. g*B+B-1), never the rank: a run's masks do not depend on
 * how many processes hold a sequence (--context-parallel N) or how many
 * groups share the batch, so a resume under another layout draws the same.
 *
 * The generator is Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As
 * Easy as 1, 2, 3", SC11): key (seed, 0); counter (group lo, group hi,
 * step, site word), group counted over the whole micro-step's batch. One call gives 128 bits = eight 16-bit draws, draw d in
 * the low (d even) or high (d odd) half of word d/2. An element is dropped
 * when its draw is below the site's threshold, round(p * 65536), so the keep
 * probability is exactly (65536 - threshold) / 65536 and kept values are
 * scaled by its inverse (inverted dropout: the expectation is unchanged).
 *
 * Which draw an element uses:
 *  - embedding and residual sites, a (B,T,C) tensor with flat index e
 *    counted from the batch's first sequence (a rank's element e0 + e, e0 =
 *    its first global row x C, DropoutSite.row0): group e / 8, draw e % 8 (eight neighbouring channels per call, one
 *    16-byte vector of bf16).
 *  - attention probabilities P (B,NH,T,T), row t (query), column u (key):
 *    the (t,u) plane of head bh is cut into 16x16 blocks, and the eight
 *    elements one lane holds of an mma.sync m16n8k16 accumulator pair
 *    (rows r, r+8; columns 2c, 2c+1, 8+2c, 9+2c; r in 0..7, c in 0..3) share
 *    a call: group ((bh * nb + t/16) * nb + u/16) * 32 + (t%8) * 4 + (u%8)/2
 *    with nb = ceil(T/16), bh counted from the batch's first sequence (a
 *    rank's heads from its first sequence's, DropoutSite.group0 adds them), draw ((t/8)%2) * 4 + ((u/8)%2) * 2 + u%2. Any
 *    kernel may compute any element (the simt and tc kernels call once per
 *    element); the mma kernel pays one call per eight probabilities.
 */
#ifndef REMAT_DROPOUT_H
#define REMAT_DROPOUT_H

#include <math.h>
#include <stdint.h>
#include "rand.h" /* REMAT_HOST_DEVICE */

/* The sites, as GPT-2 (and Hugging Face's embd_pdrop/attn_pdrop/resid_pdrop) has them. */
typedef enum { DROPOUT_EMBEDDING, DROPOUT_ATTENTION, DROPOUT_RESID_ATTN, DROPOUT_RESID_MLP, DROPOUT_NUM_SITES } DropoutSiteKind;

#define DROPOUT_MAX_LAYERS 4096      /* 12 bits of the site word */
#define DROPOUT_MAX_MICRO_STEPS 262144 /* 18 bits */

/* One site of one layer in one micro-step: what a kernel needs to draw its
 * mask. threshold 0 means no dropout (the kernels then take their plain path). */
typedef struct {
    uint32_t key[2];   /* seed, 0 */
    uint32_t step;     /* optimizer step */
    uint32_t site;     /* micro_step << 14 | layer << 2 | kind */
    uint32_t threshold; /* drop a 16-bit draw below this */
    float scale;       /* 65536 / (65536 - threshold) */
    uint64_t row0;     /* embedding and residual sites: the global row of the rank's first token row (its first sequence x T) */
    uint64_t group0;   /* added to every call's group: the attention site's calls before the rank's first sequence, else 0 */
} DropoutSite;

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

/* Philox4x32 with 10 rounds: out = f(counter, key). */
REMAT_HOST_DEVICE static inline void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0, hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* The eight draws of `group` at this site, packed two to a word. */
REMAT_HOST_DEVICE static inline void dropout_draws(const DropoutSite* s, uint64_t group, uint32_t words[4]) {
    group += s->group0;
    uint32_t ctr[4] = {(uint32_t)group, (uint32_t)(group >> 32), s->step, s->site};
    philox4x32_10(ctr, s->key, words);
}

/* 1 when draw d (0..7) of a call's words keeps its element. */
REMAT_HOST_DEVICE static inline int dropout_keeps(const DropoutSite* s, const uint32_t words[4], int d) {
    /* the word selected, not indexed: an index known only at run time put a kernel's
     * words in local memory (the mma attention-tile kernels' 16-byte stack frame) */
    const int i = d >> 1;
    const uint32_t word = i == 0 ? words[0] : i == 1 ? words[1] : i == 2 ? words[2] : words[3];
    return ((word >> (16 * (d & 1))) & 0xffffu) >= s->threshold;
}

/* Element e of an embedding or residual site, counted from the batch's
 * first sequence (row0 not added): kept? */
REMAT_HOST_DEVICE static inline int dropout_keep_flat(const DropoutSite* s, uint64_t e) {
    uint32_t w[4];
    dropout_draws(s, e >> 3, w);
    return dropout_keeps(s, w, (int)(e & 7));
}

REMAT_HOST_DEVICE static inline uint64_t dropout_attention_group(int bh, int T, int t, int u) {
    uint64_t nb = (uint64_t)((T + 15) / 16);
    return (((uint64_t)bh * nb + (uint64_t)(t / 16)) * nb + (uint64_t)(u / 16)) * 32 + (uint64_t)((t % 8) * 4 + (u % 8) / 2);
}

REMAT_HOST_DEVICE static inline int dropout_attention_draw(int t, int u) {
    return ((t / 8) % 2) * 4 + ((u / 8) % 2) * 2 + u % 2;
}

/* Probability (query t, key u) of head bh (= b * NH + h) at a sequence length T: kept? */
REMAT_HOST_DEVICE static inline int dropout_keep_attention(const DropoutSite* s, int bh, int T, int t, int u) {
    uint32_t w[4];
    dropout_draws(s, dropout_attention_group(bh, T, t, u), w);
    return dropout_keeps(s, w, dropout_attention_draw(t, u));
}

/* The 16-bit threshold of probability p in [0, DROPOUT_MAX_P]. */
static inline uint32_t dropout_threshold(float p) {
    return p > 0.0f ? (uint32_t)lrint((double)p * 65536.0) : 0u;
}

/* Where the step's masks come from: the run's seed, which sequences of the
 * global batch this rank holds, and the probability of each site (0
 * everywhere: dropout off, e.g. evaluation). */
typedef struct {
    float p[DROPOUT_NUM_SITES]; /* DROPOUT_RESID_ATTN and DROPOUT_RESID_MLP share --resid-dropout */
    uint32_t seed;
    uint32_t first_sequence; /* the global batch's index of this rank's first sequence: group x B */
    uint32_t step, micro_step;
    int seq_len, heads;      /* a whole sequence's T (N T_rank under context parallelism) and NH: first_sequence's offsets */
} DropoutState;

static inline int dropout_active(const DropoutState* d) {
    for (int k = 0; k < DROPOUT_NUM_SITES; k++)
        if (d->p[k] > 0.0f) return 1;
    return 0;
}

/* Site `kind` of `layer` (0 for the embedding) in the state's micro-step. */
static inline DropoutSite dropout_site(const DropoutState* d, DropoutSiteKind kind, int layer) {
    DropoutSite s;
    s.key[0] = d->seed;
    s.key[1] = 0;
    s.step = d->step;
    s.site = (d->micro_step % DROPOUT_MAX_MICRO_STEPS) << 14 | ((uint32_t)layer % DROPOUT_MAX_LAYERS) << 2 | (uint32_t)kind;
    s.threshold = dropout_threshold(d->p[kind]);
    s.scale = s.threshold ? (float)(65536.0 / (65536.0 - (double)s.threshold)) : 1.0f;
    uint64_t nb = (uint64_t)((d->seq_len + 15) / 16), first = d->first_sequence;
    s.row0 = kind == DROPOUT_ATTENTION ? 0 : first * (uint64_t)d->seq_len;
    s.group0 = kind == DROPOUT_ATTENTION ? first * (uint64_t)d->heads * nb * nb * 32 : 0;
    return s;
}

#endif
