/*
 * Context parallelism's ring (--context-parallel N), the part both trainers
 * share: which ranks form a group, which chunk pairs a member computes at
 * each step of the ring and in what order, which member holds a position,
 * the sizes of the link-timing messages, and the CPU's transport over MPI.
 * The GPU's transport (NCCL send/receive on a ring stream) is in
 * llmc/cuda/multigpu.cuh; the attention of one tile in train_gpt.c
 * (attention_tile_*) and llmc/cuda/attention.cuh (gpu_attention_tile_*).
 *
 * The ring: member r of a group of N holds chunks r and 2N-1-r (Tc = Tl/2
 * tokens each of its Tl per row; llmc/core/dataloader.h loads them), or with
 * packed documents the pair of chunks ring_chunks_balance gives it for the
 * batch (llmc/core/token_layout.h; every rank chooses the same from the same
 * tokens, and every function below takes the pairing). At ring step
 * s it computes its queries against the K/V block of member r - s while
 * sending that block on to r + 1 and receiving the next from r - 1 (two
 * buffers); chunk pairs the causal mask empties are skipped. Each query
 * chunk's first tile is written and later ones are merged by log-sum-exp in
 * step order, then chunk order: a fixed order, so the result does not depend
 * on when messages arrive. Backward passes the K/V blocks round again with
 * their dK/dV sums, which each member adds to and passes on after its
 * tiles' work; after N steps they are back with their owner. dQ stays
 * local; the forward's lse is reused.
 */
#ifndef REMAT_RING_H
#define REMAT_RING_H

#include "documents.h"
#include "multiproc.h"
#include "token_layout.h"

/* The ranks form world / N groups of N consecutive ranks: group g = rank / N
 * shares the sequences of its batch, and member i = rank % N of it holds
 * chunks i and 2N-1-i of each (llmc/core/dataloader.h). Data parallelism runs
 * across the groups; gradients are still summed over every rank. The group
 * is a ring: member i sends to member i+1 and receives from member i-1
 * (attention's K/V and their gradients). */
typedef struct {
    int group_size, member; /* N (--context-parallel), and this rank's place in its group */
    int groups, group;   /* world / N (the data-parallel degree), and this rank's group */
} ContextGroups;

static inline ContextGroups context_groups(int group_size, int rank, int world) {
    ContextGroups g = {group_size, rank % group_size, world / group_size, rank / group_size};
    return g;
}

/* World ranks of this member's neighbours: it receives from prev, sends to next. */
static inline int ring_prev_rank(const ContextGroups* g) { return g->group * g->group_size + (g->member + g->group_size - 1) % g->group_size; }
static inline int ring_next_rank(const ContextGroups* g) { return g->group * g->group_size + (g->member + 1) % g->group_size; }

/* One chunk pair of a ring step: the attention tile, and whether it is the
 * first its query chunk sees (the forward writes it; later ones merge). */
typedef struct {
    AttentionTile tile;
    int first;
} RingTile;

/* The chunk pairs member g->member computes at ring step `step` (on the K/V
 * block that started at member - step; which chunks each member holds:
 * `chunks`, NULL the zigzag, llmc/core/token_layout.h), in the order the merge needs (query
 * chunk, then key chunk); the causal mask's empty pairs are left out. Rows
 * of B x Tl local tokens. With doc_start (B, Tl: packed documents, the
 * document start of each row, in host memory) a pair in which no query
 * shares a document with a key is left out too, except with keep_first a
 * query chunk's first tile: the forward writes the row there even when it
 * sees nothing, for later tiles to merge into. Returns how many (at most 4). */
static inline int ring_step_tiles(const ContextGroups* g, const int* chunks, int B, int C, int NH, int Tl, int step, const int* doc_start,
                                   int keep_first, RingTile out[4]) {
    int N = g->group_size, origin = (g->member - step + N) % N, n = 0;
    for (int qc = 0; qc < 2; qc++)
        for (int kc = 0; kc < 2; kc++) {
            RingTile* r = &out[n];
            if (!context_chunk_tile(B, C, NH, Tl, N, chunks, g->member, origin, qc, kc, &r->tile)) continue;
            r->tile.doc_start = doc_start;
            r->first = step == 0 && kc == 0;
            if (doc_start && !(keep_first && r->first) && !tile_has_pairs(&r->tile)) continue;
            n++;
        }
    return n;
}

/* Tokens a group runs for a sequence of len: a multiple of 2N, so that each
 * member holds two equal chunks. */
static inline int ring_padded_length(int len, int N) { return (len + 2 * N - 1) / (2 * N) * (2 * N); }

/* The rows this rank runs for the next-token probabilities of a prompt of
 * len tokens: the sequence padded to `padded` tokens (ring_padded_length
 * under context parallelism; causal attention keeps the padding from
 * reaching the prompt) and laid out as in training (lay: lay->T rows here),
 * and with eot >= 0 (packed documents) each row's document start in the
 * padded sequence. With chunks (2N, the ring under --reset-attention-mask)
 * the chunks are paired as the loader pairs a micro-batch's
 * (ring_chunks_balance) and *lay follows. Both trainers' samplers call it. */
static inline void sampling_rows(TokenLayout* lay, int* chunks, const int* tokens, int len, int padded, int eot, int* inputs, int* doc_start) {
    int* whole = eot >= 0 ? (int*)malloc_check((size_t)padded * 2 * sizeof(int), "document starts") : NULL;
    for (int p = 0; whole && p < padded; p++) whole[padded + p] = p < len ? tokens[p] : 0;
    if (whole) document_starts_extend(whole, whole + padded, padded, 0, 0, eot);
    if (whole && chunks && lay->group_size > 1) {
        int N = lay->group_size, Tc = lay->T / 2;
        int64_t* work = (int64_t*)malloc_check(2 * (size_t)N * (sizeof(int64_t) + sizeof(int)), "the ring's chunk work");
        for (int c = 0; c < 2 * N; c++) work[c] = 0;
        for (int p = 0; p < padded; p++) work[p / Tc] += p - whole[p] + 1;
        ring_chunks_balance(chunks, (int*)(work + 2 * N), work, N);
        *lay = token_layout(lay->T, lay->member, N, chunks);
        free(work);
    }
    for (int i = 0; i < lay->T; i++) {
        int pos = token_position(lay, (size_t)i);
        inputs[i] = pos < len ? tokens[pos] : 0;
        if (whole) doc_start[i] = whole[pos];
    }
    free(whole);
}

/* The member holding global position `pos` of a sequence laid out as Tl
 * tokens a member (which chunks: `chunks`, NULL the zigzag), and (in *row)
 * its local row there. */
static inline int ring_position_owner(int pos, int Tl, int N, const int* chunks, int* row) {
    int Tc = Tl / 2, chunk = pos / Tc;
    for (int m = 0; m < N; m++)
        for (int k = 0; k < 2; k++)
            if (ring_chunk(chunks, N, m, k) == chunk) {
                *row = k * Tc + pos % Tc;
                return m;
            }
    fail("internal: position %d lies in no member's chunk", pos);
    return 0;
}

/* The ring's link is timed after the profiled step with RING_TIMING_MESSAGES
 * messages of the run's K/V block size and of a sixteenth of it, alternately
 * (for the latency): the step's own waits hold whatever the neighbour's
 * attention was late, which on a loaded machine is most of them. */
#define RING_TIMING_MESSAGES 6
static inline size_t ring_timing_bytes(size_t kv_bytes, int i) { return i % 2 ? kv_bytes : (kv_bytes + 15) / 16; }

#ifdef USE_MPI
static MPI_Comm proc_ring_comm = MPI_COMM_NULL; /* this rank's group, for the ring's messages */

/* Collective over all ranks: makes the group communicators. */
static inline void proc_context_init(const ContextGroups* g) {
    if (g->group_size == 1 || proc_ring_comm != MPI_COMM_NULL) return;
    MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, g->group, g->member, &proc_ring_comm));
}

/* Messages of one ring step in flight: pieces of at most 1 GiB (MPI counts are int). */
typedef struct {
    MPI_Request* req;
    int n, cap;
} RingTransfer;

static inline MPI_Request* ring_request(RingTransfer* t) {
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 8;
        t->req = (MPI_Request*)realloc(t->req, (size_t)t->cap * sizeof(MPI_Request));
        if (!t->req) fail("out of host memory for the ring's requests");
    }
    return &t->req[t->n++];
}

/* Starts sending `bytes` of send to the next member and receiving as many
 * from the previous into recv (either may be NULL); tag tells the kinds of
 * message apart. */
static inline void ring_post(RingTransfer* t, const ContextGroups* g, const void* send, void* recv, size_t bytes, int tag) {
    const size_t piece = (size_t)1 << 30;
    int next = (g->member + 1) % g->group_size, prev = (g->member + g->group_size - 1) % g->group_size;
    for (size_t s = 0; recv && s < bytes; s += piece)
        MPI_CHECK(MPI_Irecv((char*)recv + s, (int)(bytes - s < piece ? bytes - s : piece), MPI_BYTE, prev, tag, proc_ring_comm, ring_request(t)));
    for (size_t s = 0; send && s < bytes; s += piece)
        MPI_CHECK(MPI_Isend((const char*)send + s, (int)(bytes - s < piece ? bytes - s : piece), MPI_BYTE, next, tag, proc_ring_comm, ring_request(t)));
}

/* Waits for every message posted since the last wait. With
 * --collective-timeout a wait past the deadline names the two neighbours
 * (world ranks): one of them did not send, or did not receive. */
static inline void ring_wait(RingTransfer* t, const ContextGroups* g, const char* what) {
    if (!proc_timed()) {
        MPI_CHECK(MPI_Waitall(t->n, t->req, MPI_STATUSES_IGNORE));
        t->n = 0;
        return;
    }
    double start = proc_clock_s(), now = start;
    proc_deadline_s = start + proc_timeout_s;
    for (;;) {
        int done = 0;
        MPI_CHECK(MPI_Testall(t->n, t->req, &done, MPI_STATUSES_IGNORE));
        if (done) break;
        if (now > proc_deadline_s) {
            int prev = ring_prev_rank(g), next = ring_next_rank(g);
            char whom[160];
            if (prev == next) snprintf(whom, sizeof(whom), "rank %d, the other member of this rank's context-parallel ring", prev);
            else snprintf(whom, sizeof(whom), "rank %d or rank %d, the previous and the next of this rank's context-parallel ring", prev, next);
            fail("waited more than %d s in %s (step %d) for %s: it is stuck, stopped or gone; stopping the job "
                 "(--collective-timeout)", proc_timeout_s, what, proc_step, whom);
        }
        now = proc_pause(start, now);
    }
    t->n = 0;
}

static inline void ring_free(RingTransfer* t) {
    free(t->req);
    memset(t, 0, sizeof(*t));
}
#endif

/* Bytes (under 2 GiB) from member `root` to every member of this rank's
 * context-parallel group, and only those: the sampler runs in group 0 alone. */
static inline void proc_ring_broadcast(void* buf, size_t bytes, int root) {
#ifdef USE_MPI
    if (proc_ring_comm != MPI_COMM_NULL) MPI_CHECK(MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, proc_ring_comm));
#else
    (void)buf;
    (void)bytes;
    (void)root;
#endif
}

#endif
