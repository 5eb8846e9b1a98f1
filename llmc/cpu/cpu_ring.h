/*
 * Context parallelism's ring on the CPU reference: llmc/core/ring.h's schedule,
 * with train_gpt.c's attention tile kernels run on each step's chunk pairs
 * while MPI moves the K/V block on to the next member (and in the backward
 * the block's dK/dV sums). Part of train_gpt.c's translation unit: the
 * attention tile kernels it calls are train_gpt.c's. Shapes: B rows
 * of Tl local tokens, C channels, heads w (model.h's BlockWidths: NH query
 * heads, NKV K/V heads of HD); qkv (B,Tl,QKV) with QKV = (NH + 2 NKV) HD,
 * out (B,Tl,NH HD), lse (B,NH,Tl); the ring circulates K/V (B,Tl,2 NKV HD),
 * after RoPE; GPT-2: QKV 3C, K/V 2C; doc_start (B,Tl) or NULL (packed documents); chunks (2N): which
 * chunks each member holds (llmc/core/token_layout.h).
 */
#ifndef REMAT_CPU_RING_H
#define REMAT_CPU_RING_H

#include "cpu_real.h"
#include "../core/ring.h"

typedef struct {
    real* kv[2];  /* (B,Tl,2 NKV HD) K/V blocks of the ring: the one computed on, the one arriving */
    real* dkv[2]; /* (B,Tl,2 NKV HD) their dK/dV sums, travelling back to the block's owner */
#ifdef USE_MPI
    RingTransfer transfer;
#endif
} CpuRing;

enum { RING_TAG_KV = 1, RING_TAG_DKV = 2 };

/* train_gpt.c's attention on one tile of queries against one of keys. */
static void attention_tile_forward(real* out, real* lse, const real* qkv, const real* kv, int ld, const AttentionTile* a, int first,
                                   const DropoutSite* drop);
static void attention_tile_backward(real* dqkv, real* dkv, int dld, const real* dout, const real* qkv, const real* kv, int ld,
                                    const real* out, const real* lse, const AttentionTile* a, const DropoutSite* drop);
static void attention_set_heads(AttentionTile* a, const BlockWidths* w);

#ifdef USE_MPI
/* Member r's K/V (B,Tl,2 NKV HD), packed from its qkv (B,Tl,QKV) for sending. */
static void cpu_ring_pack_kv(real* kv, const real* qkv, size_t rows, const BlockWidths* w) {
    size_t kvw = 2 * (size_t)w->kv_width, qkvw = (size_t)w->qkv_width, q = (size_t)w->q_width;
    #pragma omp parallel for schedule(static)
    for (size_t n = 0; n < rows; n++) memcpy(kv + n * kvw, qkv + n * qkvw + q, kvw * sizeof(real));
}

static void cpu_ring_attention_forward(CpuRing* r, const ContextGroups* g, const int* chunks, int B, int Tl, int C, const BlockWidths* w, const int* doc_start, real* out,
                                       real* lse, const real* qkv, const DropoutSite* drop) {
    int N = g->group_size;
    size_t rows = (size_t)B * Tl, kvw = 2 * (size_t)w->kv_width, bytes = rows * kvw * sizeof(real);
    cpu_ring_pack_kv(r->kv[0], qkv, rows, w);
    for (int s = 0; s < N; s++) {
        real* cur = r->kv[s % 2];
        if (s + 1 < N) ring_post(&r->transfer, g, cur, r->kv[(s + 1) % 2], bytes, RING_TAG_KV);
        RingTile tiles[4];
        int n = ring_step_tiles(g, chunks, B, C, w->NH, Tl, s, doc_start, 1, tiles);
        for (int i = 0; i < n; i++) {
            attention_set_heads(&tiles[i].tile, w);
            attention_tile_forward(out, lse, qkv, cur, (int)kvw, &tiles[i].tile, tiles[i].first, drop);
        }
        ring_wait(&r->transfer, g, "the ring attention forward");
    }
}

/* dqkv (B,Tl,3C) is overwritten. */
static void cpu_ring_attention_backward(CpuRing* r, const ContextGroups* g, const int* chunks, int B, int Tl, int C, const BlockWidths* w, const int* doc_start, real* dqkv,
                                        const real* dout, const real* qkv, const real* out, const real* lse, const DropoutSite* drop) {
    int N = g->group_size;
    size_t rows = (size_t)B * Tl, kvw = 2 * (size_t)w->kv_width, bytes = rows * kvw * sizeof(real);
    size_t qkvw = (size_t)w->qkv_width, q = (size_t)w->q_width;
    memset(dqkv, 0, rows * qkvw * sizeof(real));
    cpu_ring_pack_kv(r->kv[0], qkv, rows, w);
    memset(r->dkv[0], 0, bytes);
    for (int s = 0; s < N; s++) {
        real* cur = r->kv[s % 2];
        real* dcur = r->dkv[s % 2];
        if (s + 1 < N) ring_post(&r->transfer, g, cur, r->kv[(s + 1) % 2], bytes, RING_TAG_KV);
        RingTile tiles[4];
        int n = ring_step_tiles(g, chunks, B, C, w->NH, Tl, s, doc_start, 0, tiles);
        for (int i = 0; i < n; i++) {
            attention_set_heads(&tiles[i].tile, w);
            attention_tile_backward(dqkv, dcur, (int)kvw, dout, qkv, cur, (int)kvw, out, lse, &tiles[i].tile, drop);
        }
        /* the sums go on to the next member; the last step's reach their owner */
        ring_post(&r->transfer, g, dcur, r->dkv[(s + 1) % 2], bytes, RING_TAG_DKV);
        ring_wait(&r->transfer, g, "the ring attention backward");
    }
    const real* own = r->dkv[N % 2];
    #pragma omp parallel for schedule(static)
    for (size_t n = 0; n < rows; n++)
        for (size_t c = 0; c < kvw; c++) dqkv[n * qkvw + q + c] = own[n * kvw + c];
}

/* The ring's link timed on its own buffers after the profiled step
 * (llmc/core/ring.h's messages of kv_bytes and a sixteenth of it), each after a
 * one-byte exchange that lines the neighbours up. */
static void cpu_ring_time(CpuRing* r, const ContextGroups* g, size_t kv_bytes, LinkTimes* t) {
    for (int i = 0; i < RING_TIMING_MESSAGES; i++) {
        size_t bytes = ring_timing_bytes(kv_bytes, i);
        ring_post(&r->transfer, g, r->kv[0], r->kv[1], 1, RING_TAG_KV);
        ring_wait(&r->transfer, g, "the ring's link timing");
        double t0 = now_ms();
        ring_post(&r->transfer, g, r->kv[0], r->kv[1], bytes, RING_TAG_KV);
        ring_wait(&r->transfer, g, "the ring's link timing");
        link_times_add(t, (double)bytes, 1e-3 * (now_ms() - t0));
    }
}

static void cpu_ring_free(CpuRing* r) { ring_free(&r->transfer); }
#else
static void cpu_ring_attention_forward(CpuRing* r, const ContextGroups* g, const int* chunks, int B, int Tl, int C, const BlockWidths* w, const int* doc_start, real* out,
                                       real* lse, const real* qkv, const DropoutSite* drop) {
    (void)r; (void)g; (void)chunks; (void)B; (void)Tl; (void)C; (void)w; (void)doc_start; (void)out; (void)lse; (void)qkv; (void)drop;
    fail("internal: context parallelism needs MPI (this build has none)");
}
static void cpu_ring_attention_backward(CpuRing* r, const ContextGroups* g, const int* chunks, int B, int Tl, int C, const BlockWidths* w, const int* doc_start, real* dqkv,
                                        const real* dout, const real* qkv, const real* out, const real* lse, const DropoutSite* drop) {
    (void)r; (void)g; (void)chunks; (void)B; (void)Tl; (void)C; (void)w; (void)doc_start; (void)dqkv; (void)dout; (void)qkv; (void)out; (void)lse;
    (void)drop;
    fail("internal: context parallelism needs MPI (this build has none)");
}
static void cpu_ring_time(CpuRing* r, const ContextGroups* g, size_t kv_bytes, LinkTimes* t) { (void)r; (void)g; (void)kv_bytes; (void)t; }
static void cpu_ring_free(CpuRing* r) { (void)r; }
#endif

#endif
