/*
 * The time model: predicted time of one optimizer step from the work of
 * each op family, so that recompute is priced in time, not in FLOPs that all
 * cost the same. Three rates describe a machine:
 *   matmul_flops_per_s     the four block matmuls and the classifier's
 *   attention_flops_per_s  causal attention, forward and backward
 *   memory_bytes_per_s     the memory-bound kernels: LayerNorm, GELU,
 *                          softmax, encoder, gradient norm, AdamW
 * and a step takes sum(work / rate) over the three. Overlap, launch gaps and
 * data-parallel communication are not modelled: the numbers are for
 * comparing recompute choices on one machine, and for the extra time one
 * costs over -r 0. The one communication priced is the context-parallel
 * ring's (below), because -r 1 repeats it and -r 3 does not.
 *
 * Work per micro-step of B*T = N tokens, C channels, E storage bytes:
 *   block forward    matmul 24 N C^2, attention 2 B T (T+1) C (QK^T and PV
 *                    over the T(T+1)/2 causal pairs), bytes 12 N C E (two
 *                    LayerNorms read and write C, GELU reads and writes 4C)
 *   block backward   matmul 48 N C^2, attention 2.5 x forward (scores again,
 *                    then dV, dP, dQ, dK), bytes 20 N C E
 *   recompute -r 1   the block forward up to the GELU: matmul 16 N C^2, all of
 *                    attention's forward, bytes 12 N C E
 *   recompute -r 3   the same without attention
 *   recompute -r 2   LayerNorm apply twice and GELU: bytes 12 N C E
 *   classifier       matmul 6 N C Vp, bytes 2 N Vp E (fused softmax)
 *   per step         AdamW and the gradient norm: bytes per parameter of the
 *                    shard 3E (gradient, parameter read and written) + 16
 *                    (moments) + 8 (master weights, when kept), plus E to zero
 *                    each gradient
 *
 * Context parallelism (N ranks share each sequence, plan.h): every
 * per-token term above counts this rank's B T / N tokens; attention counts its share of the causal pairs, exactly
 * B T (T+1) / (2N) with the 2N-chunk layout. The ring adds, per layer, with
 * a K/V block of kv = B (T/N) 2C E bytes and a link of bandwidth bw and
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
 *                    backward + recompute)), copy = kept bytes / link rate
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
 * measured ones. --cost-model names a default or a file.
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

/* Work of a span of the step; the last two price token tiles: the tiled
 * matmuls' FLOPs over their tile's rows (F / K, times h / rate), and the
 * passes over tiles beyond one per untiled pass (times o). */
typedef struct { double matmul_flops, attention_flops, memory_bytes, tile_matmul_flops_per_row, tile_passes; } Work;

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

/* Token tiles, assumed: on a GPU a pass is about six kernel launches at
 * 5 us each, and a BF16 tensor-core matmul of a GPT-2 layer's widths runs at
 * about half its rate at 256 rows; on the CPU a pass is about ten OpenMP
 * loops' start and join, and its matmuls' register tiles of 4 to 8 rows
 * fill at 16. */
#define TILE_PASS_S_GPU 3.0e-5
#define TILE_PASS_S_CPU 5.0e-5
#define MATMUL_HALF_ROWS_GPU 256.0
#define MATMUL_HALF_ROWS_CPU 16.0

/* Attention's default rates (forward, recompute and backward together, at
 * GPT-2's head size 64) are never above the best published rate of a kernel
 * of the class remat's default kernels belong to (mma.sync with ldmatrix and
 * cp.async: FlashAttention-2's class) on that card. FlashAttention-2 on an
 * H100 SXM, bf16, head size 64: 295 TFLOP/s causal forward (FlashAttention-3
 * paper, Shah et al. 2024, arXiv:2407.08608, figure 5), and forward plus
 * backward about 300 TFLOP/s non-causal at 8k tokens (flash-attention's own
 * benchmarks/benchmark_flash_attention.py, as posted in
 * Dao-AILab/flash-attention#2688); its backward is slower than its forward,
 * so the pair is below 295. The H200 has the H100's SMs and clocks (more and
 * faster memory only), so the same ceiling holds. remat's mma kernels, read
 * against FA2's, should reach about 200-260: 2.5e14 stays under every
 * published figure of the class. Head size 128 runs faster in FA2 (its
 * published peak: 35% of the H100's 989 TFLOP/s); the default does not
 * assume it. The tc and simt kernel families are slower still: give
 * --cost-model (gpu_check.sh calibrates one from a real run). */
static const CostModel cost_model_defaults[] = {
    /* the CPU reference on a few cores: its loops reach a fraction of a GFLOP per core per GHz; "offloading" is a memcpy */
    {"cpu", 2.0e10, 4.0e9, 8.0e9, 8.0e9, TILE_PASS_S_CPU, MATMUL_HALF_ROWS_CPU, 0, 0},
    {"a100", 2.2e14, 1.2e14, 1.6e12, HOST_LINK_PCIE4, TILE_PASS_S_GPU, MATMUL_HALF_ROWS_GPU, 0, 0},
    {"h100", 6.0e14, 2.5e14, 2.8e12, HOST_LINK_PCIE5, TILE_PASS_S_GPU, MATMUL_HALF_ROWS_GPU, 0, 0},
    {"h200", 6.5e14, 2.5e14, 4.0e12, HOST_LINK_PCIE5, TILE_PASS_S_GPU, MATMUL_HALF_ROWS_GPU, 0, 0},
    {"gh200", 6.5e14, 2.5e14, 4.0e12, HOST_LINK_NVLINK_C2C, TILE_PASS_S_GPU, MATMUL_HALF_ROWS_GPU, 0, 0},
};
enum { COST_MODEL_CPU, COST_MODEL_A100, COST_MODEL_H100 }; /* indices of the table above */
#define NUM_COST_MODEL_DEFAULTS ((int)(sizeof(cost_model_defaults) / sizeof(cost_model_defaults[0])))

/* --ring-link's link ("": MPI on the CPU trainer, NVLink on the GPU's). */
static inline RingLink ring_link_resolve(const char* name, int backend) {
    if (!name[0]) name = backend == BACKEND_CPU ? "mpi" : "nvlink";
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
    return cm;
}

/* The spec's link, or its backend's default when none was set. */
static inline RingLink spec_ring_link(const PlanSpec* s) {
    return s->ring_link.bytes_per_s > 0 ? s->ring_link : ring_link_resolve("", s->backend);
}

static inline double work_seconds(Work w, const CostModel* cm) {
    return (w.matmul_flops + w.tile_matmul_flops_per_row * cm->matmul_half_rows) / cm->matmul_flops_per_s +
           w.attention_flops / cm->attention_flops_per_s + w.memory_bytes / cm->memory_bytes_per_s + w.tile_passes * cm->tile_pass_s;
}

static inline Work work_add(Work a, Work b, double k) {
    a.matmul_flops += k * b.matmul_flops;
    a.attention_flops += k * b.attention_flops;
    a.memory_bytes += k * b.memory_bytes;
    a.tile_matmul_flops_per_row += k * b.tile_matmul_flops_per_row;
    a.tile_passes += k * b.tile_passes;
    return a;
}

/* Attended (query, key) pairs of one sequence: the causal T(T+1)/2, or
 * with packed documents of doc_len tokens (--plan-doc-len with
 * --reset-attention-mask, docs/documents.md) each document's. */
static inline double spec_attended_pairs(const PlanSpec* s) {
    const double T = s->T, L = s->doc_len;
    if (s->doc_len <= 0 || s->doc_len >= s->T) return T * (T + 1.0) / 2.0;
    const double whole = floor(T / L), rest = T - whole * L;
    return whole * L * (L + 1.0) / 2.0 + rest * (rest + 1.0) / 2.0;
}

/* Causal attention forward FLOPs of one layer on this rank (4 C per pair:
 * QK^T and PV): all of the sequence's attended pairs, or under context
 * parallelism its 1/N share. */
static inline double attention_forward_flops(const PlanSpec* s) {
    return 4.0 * s->B * spec_attended_pairs(s) * s->cfg.channels / plan_context_parallel(s);
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
    w.tile_passes = passes * (spec_tiles(s) - 1.0);
    return w;
}

/* Work of one layer's forward (backward = 0) or backward (backward = 1). */
static inline Work layer_work(const PlanSpec* s, int backward) {
    double N = spec_local_tokens(s), C = s->cfg.channels, E = s->elem_bytes;
    Work w = {24.0 * N * C * C, attention_forward_flops(s), 12.0 * N * C * E, 0.0, 0.0};
    if (backward) { w.matmul_flops *= 2.0; w.attention_flops *= 2.5; w.memory_bytes = 20.0 * N * C * E; }
    return tile_cost(s, w, 2.0);
}

/* Extra work in one layer's backward pass under `mode`. */
static inline Work recompute_work(const PlanSpec* s, int mode) {
    double N = spec_local_tokens(s), C = s->cfg.channels, E = s->elem_bytes;
    Work w = {0.0, 0.0, 12.0 * N * C * E, 0.0, 0.0};
    if (mode == RECOMPUTE_NONE) w.memory_bytes = 0.0;
    if (mode == RECOMPUTE_FULL || mode == RECOMPUTE_KEEP_ATTENTION) {
        w.matmul_flops = 16.0 * N * C * C;
        if (spec_tiles(s) > 1.0) w.memory_bytes += 2.0 * N * C * E; /* LN1 again, in the QKV pass */
        w = tile_cost(s, w, 1.0);
    }
    if (mode == RECOMPUTE_FULL) w.attention_flops = attention_forward_flops(s);
    return w;
}

/* Classifier, encoder and final LayerNorm of one micro-step, forward and backward. */
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

static inline Work rerun_work(const PlanSpec* s, int mode, int rerun) {
    Work none = {0.0, 0.0, 0.0, 0.0, 0.0};
    if (rerun == 0 || (rerun == 2 && mode == RECOMPUTE_FULL)) return none;
    if (rerun == 1) return layer_work(s, 0);
    double N = spec_local_tokens(s), C = s->cfg.channels, E = s->elem_bytes;
    int attention_only = mode == RECOMPUTE_KEEP_ATTENTION;
    Work w = {(attention_only ? 6.0 : 16.0) * N * C * C, attention_forward_flops(s), (attention_only ? 3.0 : 10.0) * N * C * E, 0.0, 0.0};
    return tile_cost(s, w, attention_only ? 1.0 : 2.0);
}

/* Whether that rerun includes attention (and so, under context parallelism, the ring's forward). */
static inline int rerun_has_attention(int mode, int rerun) { return rerun == 1 || (rerun == 2 && mode != RECOMPUTE_FULL); }

static inline Work head_work(const PlanSpec* s) {
    double N = spec_local_tokens(s), C = s->cfg.channels, E = s->elem_bytes, Vp = s->cfg.padded_vocab_size;
    Work w = {6.0 * N * C * Vp, 0.0, 2.0 * N * Vp * E + 10.0 * N * C * E, 0.0, 0.0};
    return w;
}

/* Once per optimizer step: gradient zeroing, norm and AdamW over this process's shard. */
static inline Work update_work(const PlanSpec* s) {
    ParamLayout pl;
    param_layout(&s->cfg, &pl);
    double P = (double)pl.total, shard = (double)plan_shard_params(s, pl.total), E = s->elem_bytes;
    Work w = {0.0, 0.0, P * E + shard * (3.0 * E + 16.0 + (s->master_weights ? 8.0 : 0.0)), 0.0, 0.0};
    return w;
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
    Work zero = {0.0, 0.0, 0.0, 0.0, 0.0};
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
    double step = 2.5 * attention_forward_flops(s) / cm->attention_flops_per_s / N;
    double exposed = ring_transfer_seconds(s, plan_ring_kv_bytes(s)) - step;
    return (N - 1) * (exposed > 0 ? exposed : 0.0) + N * ring_transfer_seconds(s, plan_ring_dkv_bytes(s));
}

/* Ring time of one optimizer step with per-layer modes (NULL: -r 0). */
static inline double ring_step_seconds(const PlanSpec* s, const CostModel* cm, const unsigned char* modes) {
    double per_layer = ring_forward_seconds(s, cm) + ring_backward_seconds(s, cm), total = 0.0;
    for (int l = 0; l < s->cfg.num_layers; l++) {
        int mode = modes ? (int)modes[l] : (int)RECOMPUTE_NONE;
        total += per_layer + (mode == RECOMPUTE_FULL ? ring_forward_seconds(s, cm) : 0.0);
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

/* Time per optimizer step an offloaded layer in `mode` adds: the part of
 * each copy its compute does not hide (0 for modes that do not offload). */
static inline double offload_seconds(const PlanSpec* s, const CostModel* cm, int mode) {
    if (!mode_can_offload(mode)) return 0.0;
    double copy = offload_bytes(s, mode) / cm->host_link_bytes_per_s;
    double fwd = work_seconds(layer_work(s, 0), cm), bwd = work_seconds(work_add(layer_work(s, 1), recompute_work(s, mode), 1.0), cm);
    double excess = (copy > fwd ? copy - fwd : 0.0) + (copy > bwd ? copy - bwd : 0.0);
    return spec_grad_accum(s) * excess;
}

/* Modes and offload flags per layer (NULL: -r 0, no offloading): the work,
 * the ring's exposed transfers and the offloaded copies' excess. */
/* An offloaded segment input's copies not hidden: out behind its first
 * layer's forward, back behind the layer backward of the segment above. */
static inline double segment_offload_seconds(const PlanSpec* s, const CostModel* cm) {
    double copy = (double)plan_act_bytes(s, ACT_X) / cm->host_link_bytes_per_s;
    double fwd = work_seconds(layer_work(s, 0), cm), bwd = work_seconds(layer_work(s, 1), cm);
    return spec_grad_accum(s) * ((copy > fwd ? copy - fwd : 0.0) + (copy > bwd ? copy - bwd : 0.0));
}

static inline double predicted_step_seconds(const PlanSpec* s, const CostModel* cm, const unsigned char* modes,
                                            const unsigned char* offload) {
    double t = work_seconds(step_work(s, modes), cm) + ring_step_seconds(s, cm, modes);
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
    double ring = (mode == RECOMPUTE_FULL ? ring_forward_seconds(s, cm) : 0.0) + (rerun_has_attention(mode, rerun) ? ring_forward_seconds(s, cm) : 0.0);
    return spec_grad_accum(s) * (work_seconds(work_add(recompute_work(s, mode), rerun_work(s, mode, rerun), 1.0), cm) + ring);
}

/* Extra time per optimizer step of one layer in `mode`, over -r 0: -r 1 runs the ring again. */
static inline double recompute_seconds(const PlanSpec* s, const CostModel* cm, int mode) {
    double ring = mode == RECOMPUTE_FULL ? ring_forward_seconds(s, cm) : 0.0;
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
    fprintf(f, "# remat cost model (llmc/cost_model.h), read by --cost-model %s\n# %s\nname = %s\n", path, how, cm->name);
    CostModel copy = *cm;
    for (int k = 0; k < NUM_COST_MODEL_KEYS; k++)
        if (*cost_model_field(&copy, k) > 0) fprintf(f, "%s = %.6g\n", cost_model_keys[k].key, *cost_model_field(&copy, k));
    if (fclose(f) != 0) fail("%s: write failed", path);
}

/* Transfers a trainer timed on one link: sums for link_fit. */
typedef struct { double count, bytes, seconds, bytes_sq, bytes_seconds; } LinkTimes;

static inline void link_times_add(LinkTimes* t, double bytes, double seconds) {
    t->count += 1.0;
    t->bytes += bytes;
    t->seconds += seconds;
    t->bytes_sq += bytes * bytes;
    t->bytes_seconds += bytes * seconds;
}

/* The least-squares line t = latency + bytes / bandwidth through the timed
 * transfers; returns 0. When they do not tell latency from bandwidth (one
 * size, or a fit with a negative latency or no positive slope), the latency
 * is `assumed_latency_s`, at most half the mean transfer's time, and the
 * bandwidth the bytes over the time the latencies leave; returns 1. Returns
 * -1 with nothing timed. */
static inline int link_fit(const LinkTimes* t, double assumed_latency_s, double* bytes_per_s, double* latency_s) {
    if (!(t->count > 0) || !(t->bytes > 0) || !(t->seconds > 0)) return -1;
    double spread = t->count * t->bytes_sq - t->bytes * t->bytes;
    if (spread > 1e-9 * t->count * t->bytes_sq) {
        double slope = (t->count * t->bytes_seconds - t->bytes * t->seconds) / spread;
        double lat = (t->seconds - slope * t->bytes) / t->count;
        if (slope > 0 && lat >= 0) { *bytes_per_s = 1.0 / slope; *latency_s = lat; return 0; }
    }
    double lat = assumed_latency_s;
    if (t->seconds - t->count * lat <= 0.5 * t->seconds) lat = 0.5 * t->seconds / t->count;
    *latency_s = lat;
    *bytes_per_s = t->bytes / (t->seconds - t->count * lat);
    return 1;
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
    if (!(t->update_ms > 0) || !(t->attention_ms > 0)) { snprintf(why, n, "the profile has no update or attention time"); return -1; }
    out->memory_bytes_per_s = upd.memory_bytes / (t->update_ms * 1e-3);
    out->attention_flops_per_s = compute.attention_flops / (t->attention_ms * 1e-3);
    double matmul_s = (t->forward_ms + t->classifier_ms + t->backward_ms - t->attention_ms) * 1e-3 -
                      compute.memory_bytes / out->memory_bytes_per_s - compute.tile_passes * given->tile_pass_s;
    if (!(matmul_s > 0)) { snprintf(why, n, "forward, classifier and backward take no longer than attention and the memory-bound work"); return -1; }
    /* tiled matmuls take (F + (F / K) h) / rate */
    out->matmul_flops_per_s = (compute.matmul_flops + compute.tile_matmul_flops_per_row * given->matmul_half_rows) / matmul_s;
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
 * device (`device`, NULL on the CPU trainer; "" when no GPU is found). */
static inline void cost_model_resolve(const char* flag, const char* device, CostModel* out) {
    if (flag[0]) {
        if (cost_model_default(flag, out) != 0) cost_model_read(flag, out);
        return;
    }
    if (device && strstr(device, "GH200")) { cost_model_default("gh200", out); return; }
    if (!device) { cost_model_default("cpu", out); return; }
    if (cost_model_for_device(device, out) == 0) return;
    cost_model_default("h100", out);
    if (device[0]) snprintf(out->name, sizeof(out->name), "h100 (assumed: no defaults for %s; give --cost-model)", device);
    else snprintf(out->name, sizeof(out->name), "h100 (assumed: no GPU found; give --cost-model)");
}

#endif
