/*
 * Context parallelism's ring on the GPU: llmc/core/ring.h's schedule, step
 * for step the CPU reference's llmc/cpu/cpu_ring.h, with attention.cuh's
 * tile kernels run on each step's chunk pairs while the ring stream sends
 * the K/V block on to the next member and receives the next into the other
 * buffer (llmc/cuda/multigpu.cuh). Two events order each transfer: one
 * recorded on compute before it makes it wait for the compute issued so far
 * (the block sent is packed or has arrived; the buffer received into was
 * last read by the step before), and multigpu_ring_join makes the compute
 * issued next wait for the one recorded after it. The tiles are summed in
 * fp32 (acc; dK/dV in dkv) and stored as floatX once, after the ring
 * (with RoPE, dQ and dK turned back on the way: rope.cuh).
 * Shapes: B rows of Tl local tokens; the layer's heads (RingHeads: NH query
 * heads, NKV K/V heads of HD; GPT-2: NKV = NH, HD = C/NH), Q = NH HD, KV =
 * NKV HD; qkv (B,Tl,Q+2KV), out (B,Tl,Q), lse (B,NH,Tl) fp32; chunks (2N,
 * host): which chunks each member holds (llmc/core/token_layout.h).
 * The ring carries compact K/V: 2 KV elements a token (after RoPE, which
 * the layer applied to qkv's K before attention), not one K/V per query head,
 * and the dK/dV sums likewise (2 KV fp32 a token): grouped-query attention's
 * ring bytes are NKV/NH of a replicated one's.
 */
#ifndef REMAT_RING_CUH
#define REMAT_RING_CUH

#include "cuda_common.cuh"
#include "attention.cuh"
#include "multigpu.cuh"
#include "../core/ring.h"

typedef struct {
    floatX* kv[2];  /* (B,Tl,2KV) compact K/V blocks of the ring: the one computed on, the one arriving */
    float* dkv[2];  /* (B,Tl,2KV) fp32 dK/dV sums of those blocks, travelling back to their owner */
    float* acc;     /* (B,Tl,Q) fp32: the forward's merged output, then the backward's dQ */
    float* rowsum;  /* (B,NH,Tl) fp32: the backward's D (attention's scratch) */
} GpuRing;

/* A layer's heads on the ring: C (the model's width, for the tiles'
 * AttentionTile), NH query heads, NKV K/V heads of HD. */
typedef struct {
    int C, NH, NKV, HD;
} RingHeads;

static inline size_t ring_q_width(const RingHeads* h) { return (size_t)h->NH * h->HD; }
static inline size_t ring_kv_width(const RingHeads* h) { return (size_t)h->NKV * h->HD; }

/* One call's documents: the device starts attention masks with (B,Tl; NULL:
 * none) and their host copy, on which the ring's tiles are chosen. */
typedef struct {
    const int* device;
    const int* host;
} RingDocStarts;

/* The chunk pairs of ring step `step` to launch (llmc/core/ring.h's, chosen
 * on the host copy of the document starts), each pointed at the device copy. */
static int gpu_ring_step_tiles(const ContextGroups* g, const int* chunks, int B, int Tl, const RingHeads* h, RingDocStarts docs, int step,
                               int keep_first, RingTile out[4]) {
    int n = ring_step_tiles(g, chunks, B, h->C, h->NH, Tl, step, docs.device ? docs.host : NULL, keep_first, out);
    for (int i = 0; i < n; i++) {
        out[i].tile.doc_start = docs.device;
        out[i].tile.NKV = h->NKV;
        out[i].tile.HD = h->HD;
    }
    return n;
}

/* Member r's compact K/V (B,Tl,2KV: every K head, then every V head), packed
 * out of its qkv (B,Tl,Q+2KV) for sending: the K and V heads are adjacent
 * in a qkv row, one strided copy. */
static void gpu_ring_pack_kv(floatX* kv, const floatX* qkv, size_t rows, const RingHeads* h, cudaStream_t s) {
    const size_t q = ring_q_width(h), kv2 = 2 * ring_kv_width(h);
    CUDA_CHECK(cudaMemcpy2DAsync(kv, kv2 * sizeof(floatX), qkv + q, (q + kv2) * sizeof(floatX), kv2 * sizeof(floatX), rows,
                                 cudaMemcpyDeviceToDevice, s));
}

/* The K/V block computed on at ring step `step` and its row stride: step 0
 * reads this rank's own keys straight out of qkv. */
static const floatX* gpu_ring_step_kv(const GpuRing* r, const floatX* qkv, const RingHeads* h, int step, int* ld) {
    const size_t q = ring_q_width(h), kv2 = 2 * ring_kv_width(h);
    *ld = (int)(step == 0 ? q + kv2 : kv2);
    return step == 0 ? qkv + q : r->kv[step % 2];
}

/* out (B,Tl,C), lse (B,NH,Tl) of this rank's queries over the whole sequence;
 * mg carries the transfers, s the compute. */
static void gpu_ring_attention_forward(GpuRing* r, const ContextGroups* g, const int* chunks, int B, int Tl, const RingHeads* h, RingDocStarts docs,
                                       floatX* out, float* lse, const floatX* qkv, const DropoutSite* drop, MultiGpu* mg, cudaStream_t s) {
    int N = g->group_size;
    size_t rows = (size_t)B * Tl, bytes = rows * 2 * ring_kv_width(h) * sizeof(floatX);
    gpu_ring_pack_kv(r->kv[0], qkv, rows, h, s);
    for (int step = 0; step < N; step++) {
        if (step + 1 < N) multigpu_ring_pass(mg, s, r->kv[step % 2], r->kv[(step + 1) % 2], bytes, "the ring attention forward");
        int ld;
        const floatX* kv = gpu_ring_step_kv(r, qkv, h, step, &ld);
        RingTile tiles[4];
        int n = gpu_ring_step_tiles(g, chunks, B, Tl, h, docs, step, 1, tiles);
        for (int i = 0; i < n; i++) gpu_attention_tile_forward(r->acc, lse, qkv, kv, ld, &tiles[i].tile, tiles[i].first, drop, s);
        if (step + 1 < N) multigpu_ring_join(mg, s);
    }
    gpu_attention_ring_store_out(out, r->acc, rows, (int)ring_q_width(h), s);
}

/* dqkv (B,Tl,Q+2KV) is overwritten; the forward's lse is reused; rope:
 * RoPE's rows (this member's), dQ and dK turned back as the fp32 sums are
 * stored (NULL: none). */
static void gpu_ring_attention_backward(GpuRing* r, const ContextGroups* g, const int* chunks, int B, int Tl, const RingHeads* h, RingDocStarts docs,
                                        floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                                        const DropoutSite* drop, const RopeRows* rope, MultiGpu* mg, cudaStream_t s) {
    int N = g->group_size;
    const size_t kvw = 2 * ring_kv_width(h);
    size_t rows = (size_t)B * Tl, kv_bytes = rows * kvw * sizeof(floatX), dkv_bytes = rows * kvw * sizeof(float);
    gpu_attention_tile_rowsum(r->rowsum, dout, out, B, Tl, h->NH, h->HD, s);
    CUDA_CHECK(cudaMemsetAsync(r->acc, 0, rows * ring_q_width(h) * sizeof(float), s));
    CUDA_CHECK(cudaMemsetAsync(r->dkv[0], 0, dkv_bytes, s));
    gpu_ring_pack_kv(r->kv[0], qkv, rows, h, s);
    for (int step = 0; step < N; step++) {
        if (step + 1 < N) multigpu_ring_pass(mg, s, r->kv[step % 2], r->kv[(step + 1) % 2], kv_bytes, "the ring attention backward");
        int ld;
        const floatX* kv = gpu_ring_step_kv(r, qkv, h, step, &ld);
        float* dkv = r->dkv[step % 2];
        RingTile tiles[4];
        int n = gpu_ring_step_tiles(g, chunks, B, Tl, h, docs, step, 0, tiles);
        for (int i = 0; i < n; i++) gpu_attention_tile_backward(r->acc, dkv, r->rowsum, dout, qkv, kv, ld, lse, &tiles[i].tile, drop, s);
        /* the sums go on to the next member; the last step's reach their owner */
        multigpu_ring_pass(mg, s, dkv, r->dkv[(step + 1) % 2], dkv_bytes, "the ring attention backward");
        multigpu_ring_join(mg, s);
    }
    gpu_attention_ring_store_dqkv(dqkv, r->acc, r->dkv[N % 2], rows, h->NH, h->NKV, h->HD, s, rope);
}

#endif
