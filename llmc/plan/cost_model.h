/*
 * The time model: predicted time of one optimizer step from the work of
 * each op family, so that recompute is priced in time, not in FLOPs that all
 * cost the same. Three rates describe a machine:
 *   matmul_flops_per_s     the four block matmuls and the classifier's
 *   attention_flops_per_s  causal attention, forward and backward
 *   memory_bytes_per_s     the memory-bound kernels: LayerNorm, GELU,
 *                          softmax, encoder, gradient norm, AdamW
 * and a step takes sum(work / rate) over them. Three more may be set where
 * those parts run at rates of their own (0, the default, is the rate above):
 *   matmul_backward_flops_per_s     the backward's matmuls (recompute runs the
 *                                   forward's)
 *   attention_backward_flops_per_s  attention's backward
 *   gelu_bytes_per_s                GELU's bytes, forward and backward: on the
 *                                   CPU a tanh per element makes it compute-
 *                                   bound, 10-20x dearer a byte than LayerNorm
 * The CPU reference's calibration measures all six (cost_model_calibrate_ops);
 * the GPU's phase profile tells neither forward from backward nor GELU from
 * the other memory-bound kernels, so its files give each pair one rate.
 * Overlap, launch gaps and
 * data-parallel communication are not modelled: the numbers are for
 * comparing recompute choices on one machine, and for the extra time one
 * costs over -r 0. The one communication priced is the context-parallel
 * ring's (below), because -r 1 repeats it and -r 3 does not.
 *
 * Work per micro-step of B*T = N tokens, C channels, E storage bytes, for
 * GPT-2's block (the configurable block's widths, model.h's block_widths,
 * in layer_widths below: its matmuls 2 C (QKV + NH HD + FC + F) per token
 * with QKV = (NH + 2 NKV) HD and FC = F or SwiGLU's 2F; attention 4 NH HD
 * per pair; the activation's bytes FC + F forward, 2 FC + F backward;
 * RoPE's pass reads and writes the Q and K heads, forward and in every
 * recompute that reruns the QKV matmul, and backward on the CPU):
 *   block forward    matmul 24 N C^2, attention 2 B T (T+1) C (QK^T and PV
 *                    over the T(T+1)/2 causal pairs), bytes 12 N C E (two
 *                    LayerNorms read and write C, GELU reads and writes 4C:
 *                    8 N C E of them GELU's)
 *   block backward   matmul 48 N C^2, attention 2.5 x forward (scores again,
 *                    then dV, dP, dQ, dK), bytes 20 N C E (GELU's 12: its
 *                    input and gradient read, the gradient written), all at
 *                    the backward's rates
 *   recompute -r 1   the block forward up to the GELU: matmul 16 N C^2, all of
 *                    attention's forward, bytes 12 N C E (GELU's 8)
 *   recompute -r 3   the same without attention
 *   recompute -r 2   LayerNorm apply twice and GELU: bytes 12 N C E (GELU's 8)
 *   classifier       matmul 6 N C Vp (4 N C Vp of it backward), bytes 2 N Vp E
 *                    (fused softmax)
 *   per step         AdamW and the gradient norm: bytes per parameter of the
 *                    shard 3E (gradient, parameter read and written) + 16
 *                    (moments) + 8 (master weights, when kept), plus E to zero
 *                    each gradient
 *
 * The Llama block's kernels have no rates of their own: each is memory-bound
 * (a few FLOPs per element against 2 to 4 bytes moved), so each is priced in
 * its bytes at a rate the GPT-2 kernels already measure:
 *   RMSNorm          LayerNorm's bytes (reads and writes C a token forward;
 *                    reads x and dout, writes dx and adds it into the residual
 *                    gradient backward) at memory_bytes_per_s: the same passes
 *                    with one statistic instead of two
 *   SwiGLU           the activation's bytes above (forward 2F read, F
 *                    written; backward 2F and F read, 2F written over the
 *                    gate and up) at gelu_bytes_per_s: on the CPU silu's exp
 *                    per element makes it compute-bound like GELU's tanh (the
 *                    CPU calibration times both under one clock, OP_GELU); on
 *                    the GPU that rate is memory_bytes_per_s
 *   RoPE             the Q and K heads read and written, (NH + NKV) HD each way,
 *                    forward and in each QKV recompute, at memory_bytes_per_s
 *                    (sin and cos from the position: a few FLOPs an element,
 *                    hidden under the loads); backward the CPU's pass again,
 *                    while the GPU's attention backward turns dQ and dK back
 *                    in its epilogues before storing them (llmc/cuda/rope.cuh):
 *                    no bytes of its own
 *   attention (GQA)  FLOPs for the NH query heads, K/V shared by NH/NKV of
 *                    them: 4 NH HD per pair, as for NH K/V heads (sharing
 *                    saves K/V loads, not products), at the attention family's
 *                    rate for the head size (attention_defaults below)
 * The GPU's phase profile (REMAT_PROFILE, profile.cuh) calibrates them with
 * the rest: its memory rate from AdamW, its attention rate from attention's
 * spans, which hold the GQA kernels for a Llama model; dev/gpu_check.sh runs
 * it for GPT-2 124M and for the smollm2-135m shape and writes both files.
 *
 * Context parallelism (N ranks share each sequence, plan.h): every
 * per-token term above counts this rank's B T / N tokens; attention counts its share of the causal pairs, exactly
 * B T (T+1) / (2N) with the 2N-chunk layout. The ring adds, per layer, with
 * a K/V block of kv = B (T/N) 2 NKV HD E bytes (compact: grouped-query
 * attention's NKV K/V heads of HD, after RoPE, not one per query head; 2C
 * for GPT-2; plan_ring_kv_bytes) and a link of bandwidth bw and
 * latency lat (t(x) = lat + x / bw):
 *   forward          N-1 block transfers, each overlapped with attention on
 *                    the block before: (N-1) max(0, t(kv) - A_f / N), A_f the
 *                    layer's attention forward time
 *   backward         K/V again, overlapped likewise with A_b / N, plus dK/dV
 *                    (the same shape; fp32 on the GPU) passed on after each
 *                    block is done, N transfers not overlapped:
 *                    (N-1) max(0, t(kv) - A_b / N) + N t(dkv)
 *   recompute -r 1   the forward ring again; -r 3 keeps attention's output
 *                    and skips it
 * Keeping the forward's visiting K/V blocks instead of circulating them again
 * would save the backward's K/V transfers for (N-1) kv bytes per layer: the
 * plan prints that alternative, the trainers circulate.
 *
 * Offloaded checkpoints (plan.h) add a fourth rate, the device-host link's
 * bytes per second in one direction. A layer's kept tensors go out after its
 * forward, under the next block's forward, and come back during the backward
 * of the layer above, under its recompute and backward; a copy longer than
 * the compute it hides under costs its excess:
 *   offload          max(0, copy - block forward) + max(0, copy - (block
 *                    backward + recompute)), copy = kept bytes / link rate;
 *                    on the CPU reference, which copies in line (memcpy),
 *                    2 copy
 * Link defaults, achievable per direction: PCIe 4.0 x16 25 GB/s (A100), PCIe
 * 5.0 x16 50 GB/s (H100, H200), NVLink-C2C 360 GB/s (GH200: 450 GB/s peak
 * each way); --host-link picks one or a rate.
 *
 * Token tiles (--tile-tokens K, plan.h) run a layer's token-wise work over
 * n = ceil(B T / K) tiles. Two more numbers of a machine price them:
 *   o  seconds of fixed cost per pass of a layer's token-wise work over one
 *      tile (the kernel launches or parallel-loop start-ups of the pass, and
 *      the synchronisation between them), whatever K is
 *   h  rows at which a matmul reaches half its large-M rate: a matmul of M
 *      rows runs at rate M / (M + h), so F FLOPs over tiles of K rows take
 *      F / rate + (F / K) h / rate
 * A layer passes over its tiles twice in the forward (before and after
 * attention), twice in the backward (the MLP down to attention's output
 * gradient; QKV and LN1), and -r 1 and -r 3 once more to recompute
 * attention's inputs, so tiling adds over the untiled layer (one tile):
 *   forward          2 (n-1) o + (24 N C^2 / K) h / matmul rate
 *   backward         2 (n-1) o + (48 N C^2 / K) h / matmul rate
 *   recompute -r 1/3 (n-1) o + (16 N C^2 / K) h / matmul rate, and with n > 1
 *                    LN1 again from x in the QKV pass: 2 N C E bytes
 * The untiled matmuls (M = B T rows) and the classifier's are taken at the
 * large-M rate the calibration measures. The tile is one size for the run:
 * the shared recompute set that a tile shrinks is one buffer for all layers.
 *
 * Defaults are assumed achievable rates in BF16, not peaks; a calibration
 * file (cost_model_write, from a REMAT_PROFILE run) replaces them with
 * measured ones. --cost-model names a default or a file. The cpu default
 * keeps its three assumed rates (tests and docs plan with it); on the issue's
 * shape a calibration on the development VM measured matmuls 1.7x to 4.6x
 * and attention 1.3x to 1.6x faster, GELU 13x slower a byte
 * (dev/bench/RESULTS.md): calibrate rather than trust it.
 *
 * Links are calibrated from the run's own transfers (link_fit): the host
 * link as the bytes the offload copies moved over the seconds they took,
 * the ring's link by a least-squares fit of t = latency + bytes / bandwidth
 * to its timed messages (when they come in one size only, the latency stays
 * the assumed one and the bandwidth is fitted).
 */
#ifndef REMAT_COST_MODEL_H
#define REMAT_COST_MODEL_H

#include <stddef.h>
#include "plan.h"
#include "../core/token_layout.h"
#include "../core/link_times.h"

/* Work of a span of the step. matmul_flops, attention_flops and memory_bytes
 * are the totals; the *_backward parts of the first two run at the backward's
 * rates and gelu_bytes, part of memory_bytes, at GELU's (each the total's
 * rate when a cost model gives none). The tile terms price token tiles: the
 * tiled matmuls' FLOPs over their tile's rows (F / K, times h / rate; its
 * backward part at the backward's rate), and the passes over tiles beyond
 * one per untiled pass (times o). */
typedef struct {
    double matmul_flops, matmul_backward_flops, attention_flops, attention_backward_flops, memory_bytes, gelu_bytes;
    double tile_matmul_flops_per_row, tile_matmul_backward_flops_per_row, tile_passes;
} Work;

/* Links the ring may run on: one direction's achievable bytes per second
 * between neighbours, and the latency of one message. NVLink 4 (H100, H200:
 * 450 GB/s a direction, about 370 GB/s reached by point-to-point copies);
 * InfiniBand NDR, one 400 Gb/s port per GPU (about 45 GB/s reached); MPI
 * between processes of one machine through shared memory. */
static const RingLink ring_links[] = {
    {"nvlink", 3.7e11, 1.0e-5},
    {"infiniband", 4.5e10, 2.0e-5},
    {"mpi", 5.0e9, 2.0e-6},
};
#define NUM_RING_LINKS ((int)(sizeof(ring_links) / sizeof(ring_links[0])))
#define HOST_LINK_PCIE4 2.5e10
#define HOST_LINK_PCIE5 5.0e10
#define HOST_LINK_NVLINK_C2C 3.6e11

/* The host AdamW of --offload-optimizer streams its bytes through host
 * memory: assumed on a GPU machine 50 GB/s, about half of one socket's
 * achievable bandwidth of a current server (the update is bandwidth bound:
 * a few FLOPs per 30-odd bytes); a calibration file's
 * host_memory_bytes_per_s replaces it. The CPU trainer's host is its
 * device: its memory rate, which REMAT_PROFILE_COST_MODEL measures. */
#define HOST_MEMORY_BYTES_PER_S_GPU 5.0e10

/* Token tiles, assumed: on a GPU a pass is about six kernel launches at
 * 5 us each, and a BF16 tensor-core matmul of a GPT-2 layer's widths runs at
 * about half its rate at 256 rows; on the CPU a pass is about ten OpenMP
 * loops' start and join, and its matmuls' register tiles of 4 to 8 rows
 * fill at 16. */
#define TILE_PASS_S_GPU 3.0e-5
#define TILE_PASS_S_CPU 5.0e-5
#define MATMUL_HALF_ROWS_GPU 256.0
#define MATMUL_HALF_ROWS_CPU 16.0

/* Attention's default rates (forward, recompute and backward together) per
 * card, kernel family (attention.cuh's attention_family: what the GPU build
 * runs for the model's head size) and head size, in the table after the cost
 * models; the cost models' own attention rate is the mma family's at GPT-2's
 * head size 64, which the CPU trainer's plans (no family) use. */
static const CostModel cost_model_defaults[] = {
    /* the CPU reference on a few cores: its loops reach a fraction of a GFLOP per core per GHz; "offloading" is a memcpy */
    {"cpu", 2.0e10, 4.0e9, 8.0e9, 8.0e9, TILE_PASS_S_CPU, MATMUL_HALF_ROWS_CPU, 0, 0, 0, 0, 0, 0},
    {"a100", 2.2e14, 1.2e14, 1.6e12, HOST_LINK_PCIE4, TILE_PASS_S_GPU, MATMUL_HALF_ROWS_GPU, 0, 0, 0, 0, 0, 0},
    {"h100", 6.0e14, 2.5e14, 2.8e12, HOST_LINK_PCIE5, TILE_PASS_S_GPU, MATMUL_HALF_ROWS_GPU, 0, 0, 0, 0, 0, 0},
    {"h200", 6.5e14, 2.5e14, 4.0e12, HOST_LINK_PCIE5, TILE_PASS_S_GPU, MATMUL_HALF_ROWS_GPU, 0, 0, 0, 0, 0, 0},
    {"gh200", 6.5e14, 2.5e14, 4.0e12, HOST_LINK_NVLINK_C2C, TILE_PASS_S_GPU, MATMUL_HALF_ROWS_GPU, 0, 0, 0, 0, 0, 0},
};
enum { COST_MODEL_CPU, COST_MODEL_A100, COST_MODEL_H100 }; /* indices of the table above */
#define NUM_COST_MODEL_DEFAULTS ((int)(sizeof(cost_model_defaults) / sizeof(cost_model_defaults[0])))

/* Attention kernel families, attention.cuh's AttentionKind in its order. */
enum { ATTENTION_FAMILY_SIMT, ATTENTION_FAMILY_TC, ATTENTION_FAMILY_MMA };

/* Attention's default rates, bf16, forward with backward (2.5x its FLOPs),
 * each never above the best published rate of a kernel of its class on that
 * card.
 *   mma   mma.sync with ldmatrix and cp.async (attention_mma.cuh): the class
 *         of FlashAttention-2. FA2 on an H100 SXM5, bf16, as the
 *         FlashAttention-3 paper measured it (Shah et al. 2024,
 *         arXiv:2407.08608, figures 5 and 6, sequences of 512 to 16k):
 *         causal forward at most 299 TFLOP/s at head size 64 and 335 at
 *         128, backward at most 291 and 322; forward with 2.5x backward so
 *         at most 293 and 326. remat's kernels, read against FA2's, should
 *         reach 200-260 at 64: 2.5e14, and 2.8e14 at 128 (the same share of
 *         FA2's figure). The H200 and GH200 have the H100's SMs and clocks
 *         (more and faster memory only): the same ceiling. On the A100 FA2's
 *         forward reaches at most 73% of the 312 TFLOP/s peak (FA2 paper,
 *         Dao 2023, arXiv:2307.08691), its backward less: 1.2e14 and 1.35e14.
 *         Grouped-query attention (Llama 3, Qwen2: NH/NKV query heads on
 *         each K/V head) takes the same rate, its FLOPs counted for NH query
 *         heads: the FA3 paper publishes no GQA figure for FA2, and FA2's GQA
 *         path (K/V head h / (NH/NKV) for query head h) runs the MHA kernel's
 *         tiles with fewer distinct K/V loads, no fewer products; the ceiling
 *         stays 326 at 128 (Llama 3.2 3B, Llama 3.1 8B) and 293 at 64
 *         (Llama 3.2 1B, SmolLM2) on the H100 and H200.
 *   tc    WMMA tile products (attention_tc.cuh), every head size the mma
 *         kernels do not take: the same tensor-core products
 *         under the same ceiling, without the mma kernels' ldmatrix loads
 *         and cp.async pipeline; assumed at half the mma rate, unmeasured.
 *   simt  CUDA cores (fp32 builds, ATTENTION=simt): under the card's fp32
 *         peak (A100 19.5 TFLOP/s, H100 SXM 67: NVIDIA's data sheets);
 *         assumed at 30% of it, unmeasured.
 * gpu_check.sh calibrates the real figures from a run (--cost-model). */
typedef struct { const char* card; double mma_hs64, mma_hs128, tc, simt; } AttentionDefaults;
static const AttentionDefaults attention_defaults[] = {
    {"a100", 1.2e14, 1.35e14, 6.0e13, 6.0e12},
    {"h100", 2.5e14, 2.8e14, 1.25e14, 2.0e13},
    {"h200", 2.5e14, 2.8e14, 1.25e14, 2.0e13},
    {"gh200", 2.5e14, 2.8e14, 1.25e14, 2.0e13},
};

/* The default attention rate of `card`'s row for the kernel family that runs
 * at head size hs (family -1, or a card without a row such as cpu: the cost
 * model's own rate). */
static inline void cost_model_attention_default(CostModel* cm, const char* card, int family, int hs) {
    for (size_t i = 0; family >= 0 && i < sizeof(attention_defaults) / sizeof(attention_defaults[0]); i++) {
        const AttentionDefaults* a = &attention_defaults[i];
        if (strcmp(card, a->card) != 0) continue;
        cm->attention_flops_per_s = family == ATTENTION_FAMILY_MMA ? (hs == 128 ? a->mma_hs128 : a->mma_hs64)
                                    : family == ATTENTION_FAMILY_TC ? a->tc : a->simt;
    }
}

/* The ring's link when --ring-link is not given: MPI on the CPU trainer,
 * NVLink on the GPU's (ring_links' entries 2 and 0). */
static inline RingLink ring_link_default(int backend) { return ring_links[backend == BACKEND_CPU ? 2 : 0]; }

/* --ring-link's link ("": the backend's default). */
static inline RingLink ring_link_resolve(const char* name, int backend) {
    if (!name[0]) return ring_link_default(backend);
    for (int i = 0; i < NUM_RING_LINKS; i++)
        if (strcmp(name, ring_links[i].name) == 0) return ring_links[i];
    fail("flag --ring-link: '%s' is not nvlink, infiniband or mpi", name);
    return ring_links[0]; /* not reached */
}

/* The spec's cost model, or the default of its backend when none was set. */
static inline CostModel spec_cost_model(const PlanSpec* s) {
    CostModel cm = s->cost_model;
    const CostModel* fallback = &cost_model_defaults[s->backend == BACKEND_CPU ? COST_MODEL_CPU : COST_MODEL_H100];
    if (!(cm.matmul_flops_per_s > 0)) cm = *fallback;
    if (!(cm.host_link_bytes_per_s > 0)) cm.host_link_bytes_per_s = fallback->host_link_bytes_per_s;
    if (!(cm.tile_pass_s > 0)) cm.tile_pass_s = fallback->tile_pass_s;
    if (!(cm.matmul_half_rows > 0)) cm.matmul_half_rows = fallback->matmul_half_rows;
    if (!(cm.host_memory_bytes_per_s > 0))
        cm.host_memory_bytes_per_s = s->backend == BACKEND_CPU ? cm.memory_bytes_per_s : HOST_MEMORY_BYTES_PER_S_GPU;
    return cm;
}

/* The spec's link, or its backend's default when none was set. */
static inline RingLink spec_ring_link(const PlanSpec* s) {
    return s->ring_link.bytes_per_s > 0 ? s->ring_link : ring_link_default(s->backend);
}

/* Work of the forward's kind (nothing at the backward's rates, no tiles);
 * every field written, as C++ (train_gpt.cu) warns of any left out. */
static inline Work work_new(double matmul_flops, double attention_flops, double memory_bytes, double gelu_bytes) {
    Work w = {matmul_flops, 0.0, attention_flops, 0.0, memory_bytes, gelu_bytes, 0.0, 0.0, 0.0};
    return w;
}

/* A rate of its own, or the one it defaults to (0: not given). */
static inline double rate_or(double rate, double fallback) { return rate > 0 ? rate : fallback; }
static inline double matmul_backward_rate(const CostModel* cm) { return rate_or(cm->matmul_backward_flops_per_s, cm->matmul_flops_per_s); }
static inline double attention_backward_rate(const CostModel* cm) { return rate_or(cm->attention_backward_flops_per_s, cm->attention_flops_per_s); }
static inline double gelu_rate(const CostModel* cm) { return rate_or(cm->gelu_bytes_per_s, cm->memory_bytes_per_s); }

/* The seconds of each of a Work's terms (work_seconds is their sum). */
typedef struct { double matmul_forward, matmul_backward, attention_forward, attention_backward, memory, gelu, tile_passes; } WorkSeconds;

static inline WorkSeconds work_seconds_split(Work w, const CostModel* cm) {
    double h = cm->matmul_half_rows;
    WorkSeconds t;
    t.matmul_forward = (w.matmul_flops - w.matmul_backward_flops + (w.tile_matmul_flops_per_row - w.tile_matmul_backward_flops_per_row) * h) /
                       cm->matmul_flops_per_s;
    t.matmul_backward = (w.matmul_backward_flops + w.tile_matmul_backward_flops_per_row * h) / matmul_backward_rate(cm);
    t.attention_forward = (w.attention_flops - w.attention_backward_flops) / cm->attention_flops_per_s;
    t.attention_backward = w.attention_backward_flops / attention_backward_rate(cm);
    t.memory = (w.memory_bytes - w.gelu_bytes) / cm->memory_bytes_per_s;
    t.gelu = w.gelu_bytes / gelu_rate(cm);
    t.tile_passes = w.tile_passes * cm->tile_pass_s;
    return t;
}

static inline double work_seconds(Work w, const CostModel* cm) {
    WorkSeconds t = work_seconds_split(w, cm);
    return t.matmul_forward + t.matmul_backward + t.attention_forward + t.attention_backward + t.memory + t.gelu + t.tile_passes;
}

static inline Work work_add(Work a, Work b, double k) {
    a.matmul_flops += k * b.matmul_flops;
    a.matmul_backward_flops += k * b.matmul_backward_flops;
    a.attention_flops += k * b.attention_flops;
    a.attention_backward_flops += k * b.attention_backward_flops;
    a.memory_bytes += k * b.memory_bytes;
    a.gelu_bytes += k * b.gelu_bytes;
    a.tile_matmul_flops_per_row += k * b.tile_matmul_flops_per_row;
    a.tile_matmul_backward_flops_per_row += k * b.tile_matmul_backward_flops_per_row;
    a.tile_passes += k * b.tile_passes;
    return a;
}

/* Attended (query, key) pairs of one sequence: the causal T(T+1)/2, or
 * with packed documents of doc_len tokens (--plan-doc-len with
 * --reset-attention-mask, docs/documents.md) each document's. */
static inline double spec_attended_pairs(const PlanSpec* s) {
    return (double)packed_pairs_below(s->T, s->doc_len > 0 && s->doc_len < s->T ? s->doc_len : s->T);
}

/* The ring's chunks for documents of doc_len tokens packed back to back
 * (--plan-doc-len; 0: the causal triangle): each chunk's attended pairs
 * (*work, 2N) and the pairing the loader would choose (*chunks, 2N,
 * ring_chunks_balance), in one allocation at *work that the caller frees;
 * returns whether the pairing moved a chunk from the zigzag. */
static inline int spec_ring_pairing(const PlanSpec* s, int64_t** work, int** chunks) {
    int N = plan_context_parallel(s);
    *work = (int64_t*)malloc_check(2 * (size_t)N * (sizeof(int64_t) + 2 * sizeof(int)), "the ring's shares");
    *chunks = (int*)(*work + 2 * N);
    ring_packed_chunk_work(*work, s->T, N, s->doc_len);
    return ring_chunks_balance(*chunks, *chunks + 2 * N, *work, N);
}

/* Attended pairs of the busiest ring member, which the ring's steps wait
 * for; without documents the zigzag gives every member 1/N of them. */
static inline double spec_busiest_member_pairs(const PlanSpec* s) {
    int64_t* work;
    int* chunks;
    spec_ring_pairing(s, &work, &chunks);
    double most = (double)ring_busiest_work(work, chunks, plan_context_parallel(s));
    free(work);
    return most;
}

/* Causal attention forward FLOPs of one layer on this rank (4 NH HD per
 * pair, GPT-2's 4 C: QK^T and PV): all of the sequence's attended pairs, or
 * under context parallelism the busiest member's. */
static inline double attention_forward_flops(const PlanSpec* s) {
    double pairs = plan_context_parallel(s) > 1 ? spec_busiest_member_pairs(s) : spec_attended_pairs(s);
    return 4.0 * s->B * pairs * block_widths(&s->cfg).q_width;
}

/* One layer's work per token from the block's widths (elements; x 2 for
 * FLOPs of a matmul). GPT-2: qkv 3C, proj C, fc 4C, fcproj 4C. */
typedef struct {
    double mm_qkv, mm_proj, mm_fc, mm_fcproj; /* C x output of each matmul (in x out) */
    double act_fwd, act_bwd;                  /* the MLP activation's elements read and written: GELU 8C / 12C */
    double rope;                              /* RoPE's pass: the Q and K heads read and written (0: learned positions) */
} LayerWidths;

static inline LayerWidths layer_widths(const PlanSpec* s) {
    BlockWidths b = block_widths(&s->cfg);
    ModelConfig r = config_resolved(&s->cfg);
    double C = s->cfg.channels;
    LayerWidths w;
    w.mm_qkv = C * b.qkv_width;
    w.mm_proj = C * b.q_width;
    w.mm_fc = C * b.fc_width;
    w.mm_fcproj = C * b.F;
    w.act_fwd = (double)b.fc_width + b.F;
    w.act_bwd = 2.0 * b.fc_width + b.F;
    w.rope = r.positions == POS_ROPE ? 2.0 * ((double)b.q_width + b.kv_width) : 0.0;
    return w;
}

/* This rank's tokens of a micro-step: B*T, or B*T/N under context parallelism. */
static inline double spec_local_tokens(const PlanSpec* s) { return (double)s->B * plan_local_T(s); }

/* Token tiles of this rank's rows: ceil(B T / K), 1 untiled. */
static inline double spec_tiles(const PlanSpec* s) {
    size_t K = plan_tile_tokens(s);
    return K ? ceil(spec_local_tokens(s) / (double)K) : 1.0;
}

/* What tiling adds to work whose block matmuls are w.matmul_flops, made in
 * `passes` passes over the tiles (see the top). */
static inline Work tile_cost(const PlanSpec* s, Work w, double passes) {
    size_t K = plan_tile_tokens(s);
    if (!K) return w;
    w.tile_matmul_flops_per_row = w.matmul_flops / (double)K;
    w.tile_matmul_backward_flops_per_row = w.matmul_backward_flops / (double)K;
    w.tile_passes = passes * (spec_tiles(s) - 1.0);
    return w;
}

/* Work of one layer's forward (backward = 0) or backward (backward = 1). */
static inline Work layer_work(const PlanSpec* s, int backward) {
    double N = spec_local_tokens(s), C = s->cfg.channels, E = s->elem_bytes;
    LayerWidths lw = layer_widths(s);
    double matmul = 2.0 * (lw.mm_qkv + lw.mm_proj + lw.mm_fc + lw.mm_fcproj); /* GPT-2: 24 C^2 */
    Work w = work_new(matmul * N, attention_forward_flops(s), (4.0 * C + lw.act_fwd + lw.rope) * N * E, lw.act_fwd * N * E);
    if (backward) {
        w.matmul_flops = w.matmul_backward_flops = 2.0 * matmul * N;
        w.attention_flops = w.attention_backward_flops = 2.5 * attention_forward_flops(s);
        const double rope_back = s->backend == BACKEND_GPU ? 0.0 : lw.rope; /* the GPU turns back in attention's epilogues */
        w.memory_bytes = (8.0 * C + lw.act_bwd + rope_back) * N * E;
        w.gelu_bytes = lw.act_bwd * N * E; /* reads its input and the gradient, writes the gradient */
    }
    return tile_cost(s, w, 2.0);
}

/* What a layer in `mode` recomputes before its backward, as plan.h's
 * layer_keeps says: attention (its output not kept: -r 1); the block's
 * matmuls up to the GELU (their outputs not kept: -r 1, 3); the two
 * LayerNorms (-r 2: applied from the kept statistics) and GELU (its output
 * not kept: all but -r 0). */
static inline int recomputes_attention(int mode) { return !layer_keeps(mode, ACT_ATTY); }
static inline int recomputes_matmuls(int mode) { return !layer_keeps(mode, ACT_QKV); }
static inline int recomputes_gelu(int mode) { return !layer_keeps(mode, ACT_FCH_GELU); }

/* Extra work in one layer's backward pass under `mode`. */
static inline Work recompute_work(const PlanSpec* s, int mode) {
    double N = spec_local_tokens(s), C = s->cfg.channels, E = s->elem_bytes;
    LayerWidths lw = layer_widths(s);
    /* two norms (-r 2: applied) and the activation (GELU, SwiGLU's product) */
    Work w = work_new(0.0, 0.0, (4.0 * C + lw.act_fwd) * N * E, lw.act_fwd * N * E);
    if (!recomputes_gelu(mode)) w.memory_bytes = w.gelu_bytes = 0.0;
    if (recomputes_matmuls(mode)) {
        w.matmul_flops = 2.0 * (lw.mm_qkv + lw.mm_proj + lw.mm_fc) * N; /* GPT-2: 16 C^2 */
        w.memory_bytes += lw.rope * N * E;                                /* RoPE again after the QKV matmul */
        if (spec_tiles(s) > 1.0) w.memory_bytes += 2.0 * N * C * E; /* LN1 again, in the QKV pass */
        w = tile_cost(s, w, 1.0);
    }
    if (recomputes_attention(mode)) w.attention_flops = attention_forward_flops(s);
    return w;
}

/* Segments (plan.h): how layer l runs forward again in the backward: 0 not
 * (no segments, or the top segment, whose tensors are still there), 1 whole
 * (to feed the next layer of its segment), 2 only up to what its mode keeps
 * (the segment's last layer: nothing for -r 1; LN1, QKV and attention for
 * -r 3; all but the MLP projection for -r 0 and 2). */
static inline int segment_rerun(const PlanSpec* s, int l) {
    int K = plan_segment_layers(s);
    if (K == 1 || l >= (plan_num_segments(s) - 1) * K) return 0;
    return l % K == K - 1 ? 2 : 1;
}

/* Whether that rerun includes attention (and so, under context parallelism,
 * the ring's forward): a whole one does, and one up to what the layer keeps
 * when it keeps attention's output (all but -r 1). */
static inline int rerun_has_attention(int mode, int rerun) { return rerun == 1 || (rerun == 2 && layer_keeps(mode, ACT_ATTY)); }

static inline Work rerun_work(const PlanSpec* s, int mode, int rerun) {
    Work none = work_new(0.0, 0.0, 0.0, 0.0);
    if (rerun == 0 || (rerun == 2 && !rerun_has_attention(mode, rerun))) return none; /* -r 1 keeps x alone */
    if (rerun == 1) return layer_work(s, 0);
    double N = spec_local_tokens(s), C = s->cfg.channels, E = s->elem_bytes;
    LayerWidths lw = layer_widths(s);
    int attention_only = !layer_keeps(mode, ACT_RES2); /* keeps attention's output, not the residual after it: -r 3 */
    double matmul = 2.0 * (attention_only ? lw.mm_qkv : lw.mm_qkv + lw.mm_proj + lw.mm_fc); /* GPT-2: 6 or 16 C^2 */
    double act = attention_only ? 0.0 : lw.act_fwd;
    Work w = work_new(matmul * N, attention_forward_flops(s), ((attention_only ? 3.0 : 2.0) * C + act + lw.rope) * N * E, act * N * E);
    return tile_cost(s, w, attention_only ? 1.0 : 2.0);
}

/* Classifier, encoder and final LayerNorm of one micro-step, forward and backward. */
static inline Work head_work(const PlanSpec* s) {
    double N = spec_local_tokens(s), C = s->cfg.channels, E = s->elem_bytes, Vp = s->cfg.padded_vocab_size;
    Work w = work_new(6.0 * N * C * Vp, 0.0, 2.0 * N * Vp * E + 10.0 * N * C * E, 0.0);
    w.matmul_backward_flops = 4.0 * N * C * Vp;
    return w;
}

/* Once per optimizer step: gradient zeroing, norm and AdamW over this
 * process's shard; with --offload-optimizer the device keeps the zeroing
 * and the norm, AdamW runs on the host (optimizer_offload_seconds). */
static inline Work update_work(const PlanSpec* s) {
    ParamLayout pl;
    param_layout(&s->cfg, &pl);
    double P = (double)pl.total, shard = (double)plan_shard_params(s, pl.total), E = s->elem_bytes;
    if (s->offload_optimizer) return work_new(0.0, 0.0, P * E + shard * E, 0.0);
    Work w = work_new(0.0, 0.0, P * E + shard * (3.0 * E + 16.0 + (s->master_weights ? 8.0 : 0.0)), 0.0);
    return w;
}

/* --offload-optimizer's parts of a step, in seconds: the gradients' copy
 * down, the host AdamW (its bytes at the host's memory rate: gradient read,
 * master weights read and written, both moments read and written, the
 * parameter written in the device's precision) and the parameters' copy
 * up, and the part of them the step does not hide. As built on a GPU
 * (llmc/cuda/optimizer_offload.cuh): with one process each layer's
 * gradients go down while the layers below run their backward, so what
 * exceeds the backward shows, and at least the last layer's and the tensors
 * outside the blocks (embeddings, final norm, head), copied after it; with
 * several the whole shard goes down after the reductions. With several
 * processes AdamW then runs tensor by tensor, each tensor's copy up queued
 * as soon as it is updated, so the copies up hide behind the host's work but
 * for the last tensor's, and the gather waits for them: the slower of update
 * and copy up shows. With one the next forward runs the update layer by
 * layer (optimizer_update_exposed). On the CPU trainer everything runs in
 * line: all of it. */
typedef struct { double down, adamw, up, exposed; } OptimizerOffloadSeconds;

/* One process on a GPU: the update deferred to the next forward, group by
 * group in the forward's order (optimizer_offload.cuh: the embeddings, each
 * layer's slices, the final norm and head). The host runs a group's AdamW
 * and queues its copy up, the copy stream copies the groups in turn, and a
 * group's forward waits for its copy while the host goes on to the next
 * group: the previous layer's forward hides this one's AdamW and copy. Each
 * group's AdamW and copy take its share of `adamw` and `up`; the encoder and
 * the final norm take no time here. What shows is how long the forward
 * waits: at least the embeddings' group and the first layer's (nothing but
 * the encoder runs before them), and what a layer's AdamW or copy takes
 * beyond a layer's forward. */
static inline double optimizer_update_exposed(const PlanSpec* s, const CostModel* cm, const ParamLayout* pl, double adamw, double up) {
    int L = s->cfg.num_layers;
    double f = work_seconds(layer_work(s, 0), cm), total = (double)pl->total, block = 0.0;
    for (int t = FIRST_BLOCK_TENSOR; t < FIRST_BLOCK_TENSOR + NUM_BLOCK_TENSORS; t++) block += (double)pl->count[t];
    double embeddings = (double)(pl->count[P_WTE] + pl->count[P_WPE]), host = 0.0, copy = 0.0, device = 0.0;
    for (int g = 0; g < L + 2; g++) {
        double n = g == 0 ? embeddings : g <= L ? block / L : total - block - embeddings;
        host += adamw * n / total;
        copy = (copy > host ? copy : host) + up * n / total;
        device = (device > copy ? device : copy) + (g >= 1 && g <= L ? f : 0.0);
    }
    return device - L * f;
}

static inline OptimizerOffloadSeconds optimizer_offload_seconds(const PlanSpec* s, const CostModel* cm) {
    OptimizerOffloadSeconds o = {0.0, 0.0, 0.0, 0.0};
    if (!s->offload_optimizer) return o;
    ParamLayout pl;
    param_layout(&s->cfg, &pl);
    double shard = (double)plan_shard_params(s, pl.total), E = s->elem_bytes, H = s->master_weights ? 4.0 : E;
    double link = s->backend == BACKEND_CPU ? cm->memory_bytes_per_s : cm->host_link_bytes_per_s;
    o.down = shard * E / link;
    o.up = shard * E / link;
    o.adamw = shard * (2.0 * E + 2.0 * H + 16.0) / cm->host_memory_bytes_per_s;
    if (s->backend == BACKEND_CPU) { o.exposed = o.down + o.adamw + o.up; return o; }
    double down = o.down;
    if (s->world_size <= 1) {
        double L = s->cfg.num_layers, block = 0.0, bwd = L * work_seconds(layer_work(s, 1), cm);
        for (int t = FIRST_BLOCK_TENSOR; t < FIRST_BLOCK_TENSOR + NUM_BLOCK_TENSORS; t++) block += (double)pl.count[t];
        double tail = o.down * (shard - block + block / L) / shard; /* the last layer's and the rest's */
        down = o.down > bwd + tail ? o.down - bwd : tail;
    }
    o.exposed = down + (s->world_size <= 1 ? optimizer_update_exposed(s, cm, &pl, o.adamw, o.up) : o.adamw > o.up ? o.adamw : o.up);
    return o;
}

static inline int spec_grad_accum(const PlanSpec* s) { return s->grad_accum > 0 ? s->grad_accum : 1; }

/* The work of one optimizer step with per-layer modes (NULL: -r 0 everywhere). */
static inline Work step_work(const PlanSpec* s, const unsigned char* modes) {
    Work micro = head_work(s);
    for (int l = 0; l < s->cfg.num_layers; l++) {
        micro = work_add(micro, layer_work(s, 0), 1.0);
        micro = work_add(micro, layer_work(s, 1), 1.0);
        micro = work_add(micro, recompute_work(s, modes ? (int)modes[l] : (int)RECOMPUTE_NONE), 1.0);
        micro = work_add(micro, rerun_work(s, modes ? (int)modes[l] : (int)RECOMPUTE_NONE, segment_rerun(s, l)), 1.0);
    }
    Work zero = work_new(0.0, 0.0, 0.0, 0.0);
    return work_add(work_add(zero, micro, spec_grad_accum(s)), update_work(s), 1.0);
}

/* ---- the context-parallel ring (see the top) ---- */

static inline double ring_transfer_seconds(const PlanSpec* s, size_t bytes) {
    RingLink link = spec_ring_link(s);
    return link.latency_s + (double)bytes / link.bytes_per_s;
}

/* Time one layer's forward ring adds over its attention (0 without context parallelism). */
static inline double ring_forward_seconds(const PlanSpec* s, const CostModel* cm) {
    int N = plan_context_parallel(s);
    if (N == 1) return 0.0;
    double step = attention_forward_flops(s) / cm->attention_flops_per_s / N;
    double exposed = ring_transfer_seconds(s, plan_ring_kv_bytes(s)) - step;
    return (N - 1) * (exposed > 0 ? exposed : 0.0);
}

/* Time one layer's backward ring adds: K/V overlapped, dK/dV not. */
static inline double ring_backward_seconds(const PlanSpec* s, const CostModel* cm) {
    int N = plan_context_parallel(s);
    if (N == 1) return 0.0;
    double step = 2.5 * attention_forward_flops(s) / attention_backward_rate(cm) / N;
    double exposed = ring_transfer_seconds(s, plan_ring_kv_bytes(s)) - step;
    return (N - 1) * (exposed > 0 ? exposed : 0.0) + N * ring_transfer_seconds(s, plan_ring_dkv_bytes(s));
}

/* Ring time of one optimizer step with per-layer modes (NULL: -r 0). */
static inline double ring_step_seconds(const PlanSpec* s, const CostModel* cm, const unsigned char* modes) {
    double per_layer = ring_forward_seconds(s, cm) + ring_backward_seconds(s, cm), total = 0.0;
    for (int l = 0; l < s->cfg.num_layers; l++) {
        int mode = modes ? (int)modes[l] : (int)RECOMPUTE_NONE;
        total += per_layer + (recomputes_attention(mode) ? ring_forward_seconds(s, cm) : 0.0);
        if (rerun_has_attention(mode, segment_rerun(s, l))) total += ring_forward_seconds(s, cm); /* the segment's forward again */
    }
    return spec_grad_accum(s) * total;
}

/* Bytes one offloaded layer in `mode` copies each way per micro-step. */
static inline double offload_bytes(const PlanSpec* s, int mode) {
    double b = 0.0;
    for (int a = 0; a < NUM_LAYER_ACTS; a++)
        if (layer_offloads(mode, 1, a)) b += (double)plan_act_bytes(s, a);
    return b;
}

/* What a copy out and its copy back add when `fwd` and `bwd` seconds of
 * compute run beside them: on the GPU (a copy stream) the part each does not
 * hide; on the CPU reference (memcpy in line) all of both. */
static inline double copies_exposed(const PlanSpec* s, double copy, double fwd, double bwd) {
    if (s->backend == BACKEND_CPU) return 2.0 * copy;
    return (copy > fwd ? copy - fwd : 0.0) + (copy > bwd ? copy - bwd : 0.0);
}

/* Time per optimizer step an offloaded layer in `mode` adds: the part of
 * each copy its compute does not hide (0 for modes that do not offload). */
static inline double offload_seconds(const PlanSpec* s, const CostModel* cm, int mode) {
    if (!mode_can_offload(mode)) return 0.0;
    double copy = offload_bytes(s, mode) / cm->host_link_bytes_per_s;
    double fwd = work_seconds(layer_work(s, 0), cm), bwd = work_seconds(work_add(layer_work(s, 1), recompute_work(s, mode), 1.0), cm);
    return spec_grad_accum(s) * copies_exposed(s, copy, fwd, bwd);
}

/* An offloaded segment input's copies not hidden: out behind its first
 * layer's forward, back behind the layer backward of the segment above. */
static inline double segment_offload_seconds(const PlanSpec* s, const CostModel* cm) {
    double copy = (double)plan_act_bytes(s, ACT_X) / cm->host_link_bytes_per_s;
    double fwd = work_seconds(layer_work(s, 0), cm), bwd = work_seconds(layer_work(s, 1), cm);
    return spec_grad_accum(s) * copies_exposed(s, copy, fwd, bwd);
}

/* Modes and offload flags per layer (NULL: -r 0, no offloading): the work,
 * the ring's exposed transfers and the offloaded copies' excess. */
static inline double predicted_step_seconds(const PlanSpec* s, const CostModel* cm, const unsigned char* modes,
                                            const unsigned char* offload) {
    double t = work_seconds(step_work(s, modes), cm) + ring_step_seconds(s, cm, modes) + optimizer_offload_seconds(s, cm).exposed;
    int K = plan_segment_layers(s);
    for (int l = 0; modes && offload && l < s->cfg.num_layers; l++) {
        if (!offload[l]) continue;
        if (K == 1) t += offload_seconds(s, cm, modes[l]);
        else if (l % K == 0) t += segment_offload_seconds(s, cm);
    }
    return t;
}

/* Layer time beyond -r 0's of a layer in `mode` that reruns as `rerun`
 * (segment_rerun): its recompute, its segment's forward again, and their
 * ring; the step's prediction is -r 0's plus these over the layers. */
static inline double layer_extra_seconds(const PlanSpec* s, const CostModel* cm, int mode, int rerun) {
    double ring = (recomputes_attention(mode) ? ring_forward_seconds(s, cm) : 0.0) +
                  (rerun_has_attention(mode, rerun) ? ring_forward_seconds(s, cm) : 0.0);
    return spec_grad_accum(s) * (work_seconds(work_add(recompute_work(s, mode), rerun_work(s, mode, rerun), 1.0), cm) + ring);
}

/* Extra time per optimizer step of one layer in `mode`, over -r 0: -r 1 runs the ring again. */
static inline double recompute_seconds(const PlanSpec* s, const CostModel* cm, int mode) {
    double ring = recomputes_attention(mode) ? ring_forward_seconds(s, cm) : 0.0;
    return spec_grad_accum(s) * (work_seconds(recompute_work(s, mode), cm) + ring);
}

/* ---- defaults and calibration files ---- */

static inline int cost_model_default(const char* name, CostModel* out) {
    for (int i = 0; i < NUM_COST_MODEL_DEFAULTS; i++)
        if (strcmp(name, cost_model_defaults[i].name) == 0) { *out = cost_model_defaults[i]; return 0; }
    return -1;
}

/* The default for a GPU named `device` (cudaDeviceProp.name), or -1. */
static inline int cost_model_for_device(const char* device, CostModel* out) {
    const char* name = strstr(device, "H200") ? "h200" : strstr(device, "H100") ? "h100" : strstr(device, "A100") ? "a100" : NULL;
    return name ? cost_model_default(name, out) : -1;
}

/* --host-link: pcie4, pcie5, nvlink-c2c or a positive rate in bytes/s. */
static inline double host_link_parse(const char* v, const char* what) {
    if (strcmp(v, "pcie4") == 0) return HOST_LINK_PCIE4;
    if (strcmp(v, "pcie5") == 0) return HOST_LINK_PCIE5;
    if (strcmp(v, "nvlink-c2c") == 0) return HOST_LINK_NVLINK_C2C;
    char* end = NULL;
    double r = strtod(v, &end);
    if (end == v || *end != '\0' || !isfinite(r) || r <= 0) fail("%s: '%s' is not pcie4, pcie5, nvlink-c2c nor a positive rate in bytes/s", what, v);
    return r;
}

/* The keys of a calibration file, the CostModel field each sets, and
 * whether the file must give it (an optional one left out reads 0: the
 * default of the backend or of the flag, spec_cost_model). */
typedef struct { const char* key; size_t offset; int required; } CostModelKey;
static const CostModelKey cost_model_keys[] = {
    {"matmul_flops_per_s", offsetof(CostModel, matmul_flops_per_s), 1},
    {"attention_flops_per_s", offsetof(CostModel, attention_flops_per_s), 1},
    {"memory_bytes_per_s", offsetof(CostModel, memory_bytes_per_s), 1},
    {"host_link_bytes_per_s", offsetof(CostModel, host_link_bytes_per_s), 0},
    {"tile_pass_s", offsetof(CostModel, tile_pass_s), 0},
    {"matmul_half_rows", offsetof(CostModel, matmul_half_rows), 0},
    {"ring_link_bytes_per_s", offsetof(CostModel, ring_bytes_per_s), 0},
    {"ring_link_latency_s", offsetof(CostModel, ring_latency_s), 0},
    {"matmul_backward_flops_per_s", offsetof(CostModel, matmul_backward_flops_per_s), 0},
    {"attention_backward_flops_per_s", offsetof(CostModel, attention_backward_flops_per_s), 0},
    {"gelu_bytes_per_s", offsetof(CostModel, gelu_bytes_per_s), 0},
    {"host_memory_bytes_per_s", offsetof(CostModel, host_memory_bytes_per_s), 0},
};
#define NUM_COST_MODEL_KEYS ((int)(sizeof(cost_model_keys) / sizeof(cost_model_keys[0])))

static inline double* cost_model_field(CostModel* cm, int k) { return (double*)((char*)cm + cost_model_keys[k].offset); }

/* A calibration file: '#' comments and lines `key = value`, name (free
 * text) and the rates of cost_model_keys, each given at most once. The
 * ring's bandwidth and latency come together. */
static inline void cost_model_read(const char* path, CostModel* out) {
    FILE* f = fopen(path, "r");
    if (!f) fail("--cost-model %s: not cpu, a100, h100, h200, gh200 nor a readable file (%s)", path, strerror(errno));
    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "%s", path);
    char line[512];
    for (int n = 1; fgets(line, sizeof(line), f); n++) {
        size_t len = strlen(line);
        if (len == sizeof(line) - 1 && line[len - 1] != '\n') fail("--cost-model %s: line %d is too long", path, n);
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ')) line[--len] = '\0';
        const char* p = line + strspn(line, " \t");
        if (*p == '\0' || *p == '#') continue;
        const char* eq = strchr(p, '=');
        if (!eq) fail("--cost-model %s: line %d is not 'key = value'", path, n);
        size_t klen = (size_t)(eq - p);
        while (klen && (p[klen - 1] == ' ' || p[klen - 1] == '\t')) klen--;
        const char* val = eq + 1 + strspn(eq + 1, " \t");
        if (klen == 4 && strncmp(p, "name", 4) == 0) { snprintf(out->name, sizeof(out->name), "%s", val); continue; }
        int k = 0;
        while (k < NUM_COST_MODEL_KEYS && !(strlen(cost_model_keys[k].key) == klen && strncmp(p, cost_model_keys[k].key, klen) == 0)) k++;
        if (k == NUM_COST_MODEL_KEYS) fail("--cost-model %s: line %d: unknown key '%.*s'", path, n, (int)klen, p);
        char* end = NULL;
        double v = strtod(val, &end);
        if (end == val || *end != '\0' || !isfinite(v) || v <= 0)
            fail("--cost-model %s: line %d: %s must be a positive number", path, n, cost_model_keys[k].key);
        if (*cost_model_field(out, k) != 0) fail("--cost-model %s: line %d: %s given twice", path, n, cost_model_keys[k].key);
        *cost_model_field(out, k) = v;
    }
    fclose(f);
    for (int k = 0; k < NUM_COST_MODEL_KEYS; k++)
        if (cost_model_keys[k].required && *cost_model_field(out, k) == 0) fail("--cost-model %s: %s missing", path, cost_model_keys[k].key);
    if ((out->ring_bytes_per_s == 0) != (out->ring_latency_s == 0))
        fail("--cost-model %s: ring_link_bytes_per_s and ring_link_latency_s go together", path);
}

/* Every rate that is set (positive), in cost_model_keys' order. */
static inline void cost_model_write(const CostModel* cm, const char* path, const char* how) {
    FILE* f = fopen(path, "w");
    if (!f) fail("%s: cannot write the cost model (%s)", path, strerror(errno));
    fprintf(f, "# remat cost model (llmc/plan/cost_model.h), read by --cost-model %s\n# %s\nname = %s\n", path, how, cm->name);
    CostModel copy = *cm;
    for (int k = 0; k < NUM_COST_MODEL_KEYS; k++)
        if (*cost_model_field(&copy, k) > 0) fprintf(f, "%s = %.6g\n", cost_model_keys[k].key, *cost_model_field(&copy, k));
    if (fclose(f) != 0) fail("%s: write failed", path);
}

/* Measured times of one step's phases (profile.cuh's kinds), in ms. */
typedef struct {
    double forward_ms, classifier_ms, backward_ms, update_ms;
    double attention_ms; /* attention forward, recompute and backward together */
} PhaseTimes;

/* Rates from a profiled step of `s` (its modes, grad_accum): memory bandwidth
 * from the update (AdamW is memory-bound alone), attention from its spans,
 * and matmuls from what is left of forward, classifier and backward once
 * attention and the memory-bound kernels are taken out. Returns 0, or -1
 * with a reason when the times leave no room for the matmuls. */
static inline int cost_model_calibrate(const PlanSpec* s, const PhaseTimes* t, CostModel* out, char* why, size_t n) {
    Work all = step_work(s, s->layer_mode), upd = update_work(s);
    Work compute = work_add(all, upd, -1.0);
    /* the profile times no copies and no tiles on their own: links and tile
     * costs stay the spec's (cost_model_add_links measures the links) */
    CostModel spec_cm = spec_cost_model(s);
    const CostModel* given = &spec_cm;
    out->host_link_bytes_per_s = given->host_link_bytes_per_s;
    out->tile_pass_s = given->tile_pass_s;
    out->matmul_half_rows = given->matmul_half_rows;
    out->ring_bytes_per_s = given->ring_bytes_per_s;
    out->ring_latency_s = given->ring_latency_s;
    out->host_memory_bytes_per_s = given->host_memory_bytes_per_s; /* the host AdamW: not in a GPU step's profile */
    if (!(t->update_ms > 0) || !(t->attention_ms > 0)) { snprintf(why, n, "the profile has no update or attention time"); return -1; }
    out->memory_bytes_per_s = upd.memory_bytes / (t->update_ms * 1e-3);
    out->attention_flops_per_s = compute.attention_flops / (t->attention_ms * 1e-3);
    double matmul_s = (t->forward_ms + t->classifier_ms + t->backward_ms - t->attention_ms) * 1e-3 -
                      compute.memory_bytes / out->memory_bytes_per_s - compute.tile_passes * given->tile_pass_s;
    if (!(matmul_s > 0)) { snprintf(why, n, "forward, classifier and backward take no longer than attention and the memory-bound work"); return -1; }
    /* tiled matmuls take (F + (F / K) h) / rate */
    out->matmul_flops_per_s = (compute.matmul_flops + compute.tile_matmul_flops_per_row * given->matmul_half_rows) / matmul_s;
    /* the phases do not tell forward from backward, nor GELU from the other memory-bound kernels */
    out->matmul_backward_flops_per_s = out->matmul_flops_per_s;
    out->attention_backward_flops_per_s = out->attention_flops_per_s;
    out->gelu_bytes_per_s = out->memory_bytes_per_s;
    return 0;
}

/* Measured seconds of one step of the CPU reference (llmc/cpu/cpu_calibrate.h):
 * the step, and in it every call of each op family the model prices apart,
 * and the offload copies. */
typedef struct {
    double step, matmul_forward, matmul_backward, attention_forward, attention_backward, gelu, copies;
} OpTimes;

/* Every compute rate from a step of `s` (its modes, tiles, grad_accum) whose
 * op families were timed call by call: each family's work in the model over
 * its time, recompute and segment reruns included (they call the forward's
 * functions). The memory-bound rate takes what is left of the step (the
 * LayerNorms, residual adds, softmax, encoder, optimizer, and the loops and
 * calls between them) less the copies and the tiles' pass costs at the
 * spec's o, so the calibrated model predicts the step it was measured on.
 * Under context parallelism the attention calls include the ring's waits.
 * Links, h and o stay `out`'s. Returns 0, or -1 with a reason. */
static inline int cost_model_calibrate_ops(const PlanSpec* s, const OpTimes* t, CostModel* out, char* why, size_t n) {
    Work all = step_work(s, s->layer_mode);
    double h = out->matmul_half_rows;
    const double timed[5] = {t->matmul_forward, t->matmul_backward, t->attention_forward, t->attention_backward, t->gelu};
    static const char* const names[5] = {"forward matmuls", "backward matmuls", "attention forward", "attention backward", "GELU"};
    for (int k = 0; k < 5; k++)
        if (!(timed[k] > 0)) { snprintf(why, n, "the step timed no %s", names[k]); return -1; }
    double rest = t->step - (timed[0] + timed[1] + timed[2] + timed[3] + timed[4]) - t->copies - all.tile_passes * out->tile_pass_s;
    if (!(rest > 0)) { snprintf(why, n, "the timed families and copies take the whole step: nothing is left for the memory-bound kernels"); return -1; }
    out->matmul_flops_per_s = (all.matmul_flops - all.matmul_backward_flops + (all.tile_matmul_flops_per_row - all.tile_matmul_backward_flops_per_row) * h) / timed[0];
    out->matmul_backward_flops_per_s = (all.matmul_backward_flops + all.tile_matmul_backward_flops_per_row * h) / timed[1];
    out->attention_flops_per_s = (all.attention_flops - all.attention_backward_flops) / timed[2];
    out->attention_backward_flops_per_s = all.attention_backward_flops / timed[3];
    out->gelu_bytes_per_s = all.gelu_bytes / timed[4];
    out->memory_bytes_per_s = (all.memory_bytes - all.gelu_bytes) / rest;
    out->host_memory_bytes_per_s = out->memory_bytes_per_s; /* the CPU's host AdamW streams through this same memory */
    return 0;
}

/* The links measured from a run's own transfers into `cm`: the host link
 * from the offload copies (bytes over seconds: the model has no latency
 * there), the ring's link by link_fit around the assumed latency of the
 * spec's link. A link without transfers keeps its rate. Returns how many
 * links were measured. */
static inline int cost_model_add_links(const PlanSpec* s, const LinkTimes* host, const LinkTimes* ring, CostModel* cm) {
    int measured = 0;
    if (host->bytes > 0 && host->seconds > 0) { cm->host_link_bytes_per_s = host->bytes / host->seconds; measured++; }
    if (link_fit(ring, spec_ring_link(s).latency_s, &cm->ring_bytes_per_s, &cm->ring_latency_s) >= 0) measured++;
    return measured;
}

/* REMAT_PROFILE=N with REMAT_PROFILE_COST_MODEL=FILE: the step whose
 * measurements calibrate the time model, and the file it goes to; NULL
 * (and step 0) when not asked for. */
static inline const char* cost_model_profile_request(int* step) {
    const char* path = getenv("REMAT_PROFILE_COST_MODEL");
    const char* n = getenv("REMAT_PROFILE");
    *step = 0;
    if (!path || !path[0]) return NULL;
    char* end = NULL;
    long v = n && n[0] ? strtol(n, &end, 10) : 0;
    if (!n || !n[0] || *end != '\0' || v < 1 || v > INT_MAX)
        fail("REMAT_PROFILE_COST_MODEL needs REMAT_PROFILE=N: the step whose profile calibrates it");
    *step = (int)v;
    return path;
}

/* --cost-model: a default's name or a file; "" picks the default for the
 * device (`device`, NULL on the CPU trainer; "" when no GPU is found). A
 * default takes the attention rate of `attention_family`, the kernel family
 * the GPU trainer runs at head size `hs` (-1 on the CPU trainer: the
 * default's own rate). */
static inline void cost_model_resolve(const char* flag, const char* device, int attention_family, int hs, CostModel* out) {
    const char* card = "h100";
    if (flag[0]) {
        if (cost_model_default(flag, out) != 0) { cost_model_read(flag, out); return; }
        card = flag;
    } else if (!device) {
        cost_model_default("cpu", out);
        return;
    } else if (strstr(device, "GH200") && cost_model_default("gh200", out) == 0) {
        card = "gh200";
    } else if (cost_model_for_device(device, out) == 0) {
        card = out->name;
    } else {
        cost_model_default("h100", out);
        if (device[0]) snprintf(out->name, sizeof(out->name), "h100 (assumed: no defaults for %s; give --cost-model)", device);
        else snprintf(out->name, sizeof(out->name), "h100 (assumed: no GPU found; give --cost-model)");
    }
    cost_model_attention_default(out, card, attention_family, hs);
}

#endif
