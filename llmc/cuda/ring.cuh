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
 * fp32 (acc; dK/dV in dkv) and stored as floatX once, after the ring.
 * Shapes: B rows of Tl local tokens, C channels, NH heads; qkv (B,Tl,3C),
 * out (B,Tl,C), lse (B,NH,Tl) fp32; chunks (2N, host): which chunks each
 * member holds (llmc/core/token_layout.h).
 */
#ifndef REMAT_RING_CUH
#define REMAT_RING_CUH

#include "cuda_common.cuh"
#include "attention.cuh"
#include "multigpu.cuh"
#include "../core/ring.h"

typedef struct {
    floatX* kv[2];  /* (B,Tl,2C) K/V blocks of the ring: the one computed on, the one arriving */
    float* dkv[2];  /* (B,Tl,2C) fp32 dK/dV sums of those blocks, travelling back to their owner */
    float* acc;     /* (B,Tl,C) fp32: the forward's merged output, then the backward's dQ */
    float* rowsum;  /* (B,NH,Tl) fp32: the backward's D (attention's scratch) */
} GpuRing;

/* One call's documents: the device starts attention masks with (B,Tl; NULL:
 * none) and their host copy, on which the ring's tiles are chosen. */
typedef struct {
    const int* device;
    const int* host;
} RingDocStarts;

/* The chunk pairs of ring step `step` to launch (llmc/core/ring.h's, chosen
 * on the host copy of the document starts), each pointed at the device copy. */
static int gpu_ring_step_tiles(const ContextGroups* g, const int* chunks, int B, int Tl, int C, int NH, RingDocStarts docs, int step,
                               int keep_first, RingTile out[4]) {
    int n = ring_step_tiles(g, chunks, B, C, NH, Tl, step, docs.device ? docs.host : NULL, keep_first, out);
    for (int i = 0; i < n; i++) out[i].tile.doc_start = docs.device;
    return n;
}

/* Member r's K/V (B,Tl,2C), packed out of its qkv (B,Tl,3C) for sending. */
static void gpu_ring_pack_kv(floatX* kv, const floatX* qkv, size_t rows, int C, cudaStream_t s) {
    size_t row = (size_t)C * sizeof(floatX);
    CUDA_CHECK(cudaMemcpy2DAsync(kv, 2 * row, qkv + C, 3 * row, 2 * row, rows, cudaMemcpyDeviceToDevice, s));
}

/* The K/V block computed on at ring step `step` and its row stride: step 0
 * reads this rank's own keys straight out of qkv. */
static const floatX* gpu_ring_step_kv(const GpuRing* r, const floatX* qkv, int C, int step, int* ld) {
    *ld = (step == 0 ? 3 : 2) * C;
    return step == 0 ? qkv + C : r->kv[step % 2];
}

/* out (B,Tl,C), lse (B,NH,Tl) of this rank's queries over the whole sequence;
 * mg carries the transfers, s the compute. */
static void gpu_ring_attention_forward(GpuRing* r, const ContextGroups* g, const int* chunks, int B, int Tl, int C, int NH, RingDocStarts docs,
                                       floatX* out, float* lse, const floatX* qkv, const DropoutSite* drop, MultiGpu* mg, cudaStream_t s) {
    int N = g->group_size;
    size_t rows = (size_t)B * Tl, bytes = rows * 2 * C * sizeof(floatX);
    gpu_ring_pack_kv(r->kv[0], qkv, rows, C, s);
    for (int step = 0; step < N; step++) {
        if (step + 1 < N) multigpu_ring_pass(mg, s, r->kv[step % 2], r->kv[(step + 1) % 2], bytes, "the ring attention forward");
        int ld;
        const floatX* kv = gpu_ring_step_kv(r, qkv, C, step, &ld);
        RingTile tiles[4];
        int n = gpu_ring_step_tiles(g, chunks, B, Tl, C, NH, docs, step, 1, tiles);
        for (int i = 0; i < n; i++) gpu_attention_tile_forward(r->acc, lse, qkv, kv, ld, &tiles[i].tile, tiles[i].first, drop, s);
        if (step + 1 < N) multigpu_ring_join(mg, s);
    }
    gpu_attention_ring_store_out(out, r->acc, rows, C, s);
}

/* dqkv (B,Tl,3C) is overwritten; the forward's lse is reused. */
static void gpu_ring_attention_backward(GpuRing* r, const ContextGroups* g, const int* chunks, int B, int Tl, int C, int NH, RingDocStarts docs,
                                        floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                                        const DropoutSite* drop, MultiGpu* mg, cudaStream_t s) {
    int N = g->group_size;
    size_t rows = (size_t)B * Tl, kv_bytes = rows * 2 * C * sizeof(floatX), dkv_bytes = rows * 2 * C * sizeof(float);
    gpu_attention_tile_rowsum(r->rowsum, dout, out, B, Tl, C, NH, s);
    CUDA_CHECK(cudaMemsetAsync(r->acc, 0, rows * C * sizeof(float), s));
    CUDA_CHECK(cudaMemsetAsync(r->dkv[0], 0, dkv_bytes, s));
    gpu_ring_pack_kv(r->kv[0], qkv, rows, C, s);
    for (int step = 0; step < N; step++) {
        if (step + 1 < N) multigpu_ring_pass(mg, s, r->kv[step % 2], r->kv[(step + 1) % 2], kv_bytes, "the ring attention backward");
        int ld;
        const floatX* kv = gpu_ring_step_kv(r, qkv, C, step, &ld);
        float* dkv = r->dkv[step % 2];
        RingTile tiles[4];
        int n = gpu_ring_step_tiles(g, chunks, B, Tl, C, NH, docs, step, 0, tiles);
        for (int i = 0; i < n; i++) gpu_attention_tile_backward(r->acc, dkv, r->rowsum, dout, qkv, kv, ld, lse, &tiles[i].tile, drop, s);
        /* the sums go on to the next member; the last step's reach their owner */
        multigpu_ring_pass(mg, s, dkv, r->dkv[(step + 1) % 2], dkv_bytes, "the ring attention backward");
        multigpu_ring_join(mg, s);
    }
    gpu_attention_ring_store_dqkv(dqkv, r->acc, r->dkv[N % 2], rows, C, s);
}

#endif
