/*
 * The memory plan: every buffer a training run needs, with its size and its
 * offset in one arena, computed from the model shape, batch, sequence length,
 * storage precision, per-layer recompute choice, ranks and ZeRO stage.
 *
 * Both trainers allocate exactly plan.total_bytes once, before the first step,
 * and carve it up by these offsets; --plan prints the same numbers without
 * allocating. The prediction equals the allocation by construction.
 *
 * Per layer and token, with E = bytes per stored element (4 fp32, 2 bf16/fp16)
 * and fp32 statistics (docs/DESIGN.md; the fp64 gradient-check build stores all in fp64):
 *   -r 0  x ln1 qkv atty res2 ln2 fch fch_gelu = 16C elements + (4 + NH) floats
 *   -r 2  x qkv atty res2 fch                  = 10C elements + (4 + NH) floats
 *   -r 1  x                                    =  1C elements
 *   -r 3  x atty                               =  2C elements + NH floats (logsumexp)
 * (GPT-2's widths; the configurable block keeps the same tensors at its own,
 * layer_act_per_token: qkv (NH + 2 NKV) HD, atty NH HD, fch F or SwiGLU's 2F,
 * fch_gelu F.)
 * Whatever a layer does not keep lives in one shared "recompute set" in the
 * scratch section, which the backward pass refills layer by layer.
 * Under context parallelism (--context-parallel N) every per-token buffer
 * holds this rank's B x T/N tokens, and the ring adds two K/V blocks and two
 * dK/dV blocks (scratch; plan_ring_kv_bytes); on the GPU also one fp32
 * (B, T/N, C) accumulator, the forward's merged output and then the
 * backward's dQ (they are never live at once).
 *
 * Offloaded checkpoints (--offload-checkpoints, or MODEo in a -r mix): what
 * a -r 1 or -r 3 layer keeps (x; -r 3 also its attention output and
 * logsumexp) lives in a host pool instead (pinned memory on a GPU, a second
 * allocation on the CPU reference), outside total_bytes: host_total_bytes.
 * On the device such a layer uses one slot of a ring of OFFLOAD_STAGING_SLOTS
 * staging slots (slot l mod R), which holds its tensors from when they are
 * written (x by the block before, or the encoder) to the copy out after its
 * forward, and again from the prefetch during layer l+1's backward to the end
 * of its own. Three slots let block l+1 run while layer l's copy out is in
 * flight and block l+2 write into the third; the backward needs two.
 *
 * Token tiles (--tile-tokens K): the LayerNorms, the QKV, projection and MLP
 * matmuls, GELU and the residual adds treat tokens independently, so every
 * layer runs them over tiles of K of the B*T rows; the shared recompute set's
 * token-wise tensors (ln1, res2, ln2, fch, fch_gelu and the LayerNorm
 * statistics) then hold one tile, K rows, and only attention's tensors (qkv,
 * atty, att_lse) stay whole in it. The backward then needs the gradients of
 * attention's output and of qkv whole: backward.datty (C) and backward.dqkv
 * (3C) instead of the aliases over res2 and fch. On a GPU the layer's weight,
 * bias and LayerNorm gradients are summed over its tiles in fp32,
 * backward.tile_grads (one layer's parameters, 12C^2 + 13C floats), and
 * rounded into the floatX gradients once per layer and micro-step.
 */
#ifndef REMAT_PLAN_H
#define REMAT_PLAN_H

#include "../core/model.h"
#include "../core/gpu_scratch.h"
#include "../core/loader_state.h" /* loader_token_bytes */

/* -r 3 is full recompute that keeps attention's output and logsumexp: the
 * backward pass reruns everything of the block but attention itself, whose
 * kept output and logsumexp feed attention's backward. */
typedef enum { RECOMPUTE_NONE = 0, RECOMPUTE_FULL = 1, RECOMPUTE_SELECTIVE = 2, RECOMPUTE_KEEP_ATTENTION = 3 } RecomputeMode;
#define NUM_RECOMPUTE_MODES 4

enum {
    SEC_PARAMETERS, SEC_MASTER_WEIGHTS, SEC_GRADIENTS, SEC_OPTIMIZER,
    SEC_ACTIVATIONS, SEC_SCRATCH, SEC_WORKSPACE, NUM_SECTIONS
};
static const char* const plan_section_names[NUM_SECTIONS] = {
    "parameters", "master_weights", "gradients", "optimizer", "activations", "scratch", "workspace"};

/* Per-layer activations, in forward order. */
enum {
    ACT_X, ACT_LN1, ACT_LN1_MEAN, ACT_LN1_RSTD, ACT_QKV, ACT_ATTY, ACT_ATT_LSE, ACT_RES2,
    ACT_LN2, ACT_LN2_MEAN, ACT_LN2_RSTD, ACT_FCH, ACT_FCH_GELU, NUM_LAYER_ACTS
};
static const char* const layer_act_names[NUM_LAYER_ACTS] = {
    "x", "ln1", "ln1_mean", "ln1_rstd", "qkv", "atty", "att_lse", "res2",
    "ln2", "ln2_mean", "ln2_rstd", "fch", "fch_gelu"};

/* Elements per token of a layer activation, and whether it is an fp32
 * statistic; the widths come from the block's shape (model.h's
 * block_widths): qkv (NH + 2 NKV) HD, atty NH HD, fch the FC matmul's
 * output (GELU F, SwiGLU 2F: gate and up), fch_gelu F (GELU's output, or
 * SwiGLU's product silu(gate) up). With RMSNorm the mean slots hold 0s. */
static inline size_t layer_act_per_token(int act, const ModelConfig* cfg, int* is_stat) {
    size_t C = (size_t)cfg->channels;
    BlockWidths w = block_widths(cfg);
    *is_stat = 0;
    switch (act) {
    case ACT_X: case ACT_LN1: case ACT_RES2: case ACT_LN2: return C;
    case ACT_ATTY: return (size_t)w.q_width;
    case ACT_QKV: return (size_t)w.qkv_width;
    case ACT_FCH: return (size_t)w.fc_width;
    case ACT_FCH_GELU: return (size_t)w.F;
    case ACT_ATT_LSE: *is_stat = 1; return (size_t)cfg->num_heads;
    default: *is_stat = 1; return 1; /* norm mean and rstd */
    }
}

/* Whether a layer under `mode` keeps activation `act` through to backward. */
static inline int layer_keeps(int mode, int act) {
    if (mode == RECOMPUTE_NONE) return 1;
    if (mode == RECOMPUTE_FULL) return act == ACT_X;
    if (mode == RECOMPUTE_KEEP_ATTENTION) return act == ACT_X || act == ACT_ATTY || act == ACT_ATT_LSE;
    return act != ACT_LN1 && act != ACT_LN2 && act != ACT_FCH_GELU;
}

/* Whether a layer under `mode` with the offload property keeps `act` in the
 * host pool: offloading applies to what -r 1 and -r 3 layers keep. */
static inline int mode_can_offload(int mode) { return mode == RECOMPUTE_FULL || mode == RECOMPUTE_KEEP_ATTENTION; }
static inline int layer_offloads(int mode, int offload, int act) {
    return offload && mode_can_offload(mode) && layer_keeps(mode, act);
}

#define OFFLOAD_STAGING_SLOTS 3

/* Backward-pass gradient buffers, shared by all layers (scratch): the
 * residual stream's gradient and the LayerNorm outputs' (also the final
 * LayerNorm's, from the classifier). The block's other gradients have no
 * buffers of their own: each is written over an activation of the same layer
 * that nothing reads any more when it is produced (block backward orders its
 * steps for that):
 *   d(FC pre-activation) (4C) over the GELU output, after the FC-projection
 *     weight gradient has read it;
 *   d(attention output) (C) over the attention residual, after LN2 backward;
 *   dqkv (3C) over the FC pre-activation (4C), after GELU backward.
 * In every recompute mode these activations are the layer's own (kept) or
 * the shared recompute set's, so the aliasing holds for any mix. ACT_DFCH,
 * ACT_DATTY and ACT_DQKV name those slots when they hold the gradients (with
 * token tiles datty and dqkv have whole-sequence buffers of their own,
 * backward.datty and backward.dqkv: attention runs whole).
 * GRAD_DBRANCH is dln's buffer in its other use: a dropped residual branch's
 * gradient (dres masked), written and read between two LayerNorm backward
 * passes, when no LayerNorm output's gradient is alive. */
enum { GRAD_DRES, GRAD_DLN, NUM_GRAD_ACTS };
enum { ACT_DFCH = ACT_FCH_GELU, ACT_DATTY = ACT_RES2, ACT_DQKV = ACT_FCH, GRAD_DBRANCH = GRAD_DLN };
static const size_t grad_act_width[NUM_GRAD_ACTS] = {1, 1}; /* x C */
static const char* const grad_act_names[NUM_GRAD_ACTS] = {"dres", "dln"};

typedef enum { BACKEND_CPU = 0, BACKEND_GPU = 1 } PlanBackend;

/* Rates of a machine for the time model (llmc/plan/cost_model.h). */
typedef struct {
    char name[200];
    double matmul_flops_per_s, attention_flops_per_s, memory_bytes_per_s;
    double host_link_bytes_per_s; /* one direction of the device-host link (offloaded checkpoints) */
    double tile_pass_s;       /* fixed cost of one pass of a layer's token-wise work over one token tile */
    double matmul_half_rows;  /* rows M at which a matmul reaches half its large-M rate (token tiles) */
    double ring_bytes_per_s, ring_latency_s; /* the ring's link when a file measured it (0: --ring-link's) */
    /* the backward's matmuls and attention, and GELU's bytes, where they run at
     * rates of their own (0: the matmul, attention and memory rates) */
    double matmul_backward_flops_per_s, attention_backward_flops_per_s, gelu_bytes_per_s;
    double host_memory_bytes_per_s; /* the host's memory rate, for AdamW on the host (--offload-optimizer; 0: the default) */
} CostModel;

/* The link the context-parallel ring runs on, for the time model: one
 * direction's bytes per second between neighbours and seconds per message. */
typedef struct {
    char name[16];
    double bytes_per_s, latency_s;
} RingLink;

/* PlanSpec.documents: the flags of packed documents (llmc/core/documents.h) whose
 * buffers the plan holds: the starts (--reset-attention-mask or
 * --reset-position-ids), and on the GPU the position runs (--reset-position-ids). */
enum { PLAN_DOC_STARTS = 1, PLAN_DOC_POSITIONS = 2 };

typedef struct {
    ModelConfig cfg;
    int B, T;
    int backend;
    int elem_bytes;         /* storage bytes of parameters, gradients, activations */
    int stat_bytes;         /* bytes of statistics and losses: 4 (fp32), 8 in the fp64 check build */
    int master_weights;     /* fp32 master copy of the parameters (low-precision builds) */
    int world_size, zero_stage;
    int context_parallel;   /* N: ranks sharing each sequence, each holding B x T/N tokens (0 counts as 1) */
    RingLink ring_link;     /* zero: the backend's default (cost_model.h) */
    int grad_accum;         /* micro-steps per optimizer step, for the time model (0: 1) */
    const unsigned char* layer_mode; /* L recompute modes; NULL means all RECOMPUTE_NONE */
    const unsigned char* layer_offload; /* L flags: the layer's kept tensors in the host pool; NULL: none */
    CostModel cost_model;   /* for predicted step times; zero rates: the backend's default */
    int logits_chunk_rows;  /* rows of (B*T, Vp) logits materialised at once */
    int micro_steps;        /* gradient accumulation: micro-steps per optimizer step (0 counts as 1) */
    int fp32_grad_sums;     /* low-precision storage: sum gradients added to more than once in fp32 (grads_fp32) */
    int tile_tokens;        /* rows per token tile (0: untiled; more than B*T counts as B*T) */
    int segment_layers;     /* K: layers per checkpointed segment (--segment-layers; 0 or 1: off) */
    size_t io_chunk_floats; /* staging for file I/O and parameter init */
    size_t workspace_bytes; /* library workspaces (cuBLASLt), GPU only */
    int doc_len;            /* the time model's packed documents (--plan-doc-len): tokens each; 0: none (the causal triangle) */
    int documents;          /* packed documents' buffers: PLAN_DOC_STARTS, PLAN_DOC_POSITIONS (GPU only); 0: none */
    int host_shares_budget; /* the host pool draws on the device budget (the CPU trainer, whose device is the host) */
    int offload_optimizer;  /* --offload-optimizer: master weights, moments and a gradient copy in the host pool */
} PlanSpec;

typedef struct {
    char name[40];
    int section;
    int layer;    /* -1 for non-layer buffers */
    size_t bytes; /* exact size */
    size_t offset;
} PlanEntry;

typedef struct {
    PlanSpec spec;
    PlanEntry* entries;
    int num_entries, cap_entries;
    size_t section_bytes[NUM_SECTIONS];  /* aligned bytes, as allocated */
    size_t total_bytes;
    size_t (*layer_act)[NUM_LAYER_ACTS]; /* [L][act]: arena offset each layer uses */
    size_t layer_stored_bytes_max;       /* largest per-layer kept bytes */
    size_t grad_act[NUM_GRAD_ACTS];      /* arena offsets of backward buffers */
    size_t off_whole_datty, off_whole_dqkv; /* token tiles only: whole-sequence gradients of atty and qkv */
    size_t off_tile_grads, tile_grads_count; /* token tiles on a GPU: fp32 sums of one layer's parameter gradients; 0: none */
    size_t off_inputs, off_targets, off_final_res, off_lnf, off_lnf_mean, off_lnf_rstd;
    size_t off_losses, off_logits, off_io_chunk, off_loader;
    size_t off_att_rowsum, off_column_partials, off_norm_partials, off_token_buckets; /* GPU only */
    size_t off_top1, off_doc_start, off_pos_runs; /* the last two with spec.documents, the last on a GPU only */
    size_t off_ring_kv, off_ring_dkv; /* context parallelism: two K/V blocks in flight, two dK/dV blocks */
    size_t off_ring_acc;              /* context parallelism on the GPU: fp32 (B,T/N,C), out_acc, then dq_acc */
    size_t off_params, off_master, off_grads, off_adam_m, off_adam_v; /* with offload_optimizer: off_master, off_adam_m,
                                                                        * off_adam_v and off_host_grads are host pool offsets */
    size_t off_host_grads;              /* offload_optimizer: this rank's shard of the gradients, copied down (elem_bytes each) */
    int grad_slots;                     /* layers whose block gradients the device holds (plan_grad_slots); 0: all */
    size_t off_grad_slots, grad_slot_count; /* with grad_slots: the slots, and the elements of one (plan_grad_slot_layout) */
    size_t off_grads_fp32, grads_fp32_first, grads_fp32_count; /* fp32 gradient sums of parameters [first, first + count);
                                                                  * count 0: none */
    size_t num_params, shard_params;    /* all parameters; this rank's optimizer shard */
    int overflow;                       /* some size exceeded 64 bits: total_bytes is SIZE_MAX */
    /* the host pool of offloaded checkpoints: its own entries and offsets */
    PlanEntry* host_entries;
    int num_host_entries, cap_host_entries;
    size_t host_total_bytes;
    size_t host_section_bytes[NUM_SECTIONS]; /* aligned host pool bytes by section */
    size_t (*host_act)[NUM_LAYER_ACTS]; /* [L][act]: host pool offset, where layer_offloads */
    int staging_slots;                  /* slots of the device ring (0: no layer offloads) */
    size_t staging_bytes;               /* device bytes of the ring */
} MemoryPlan;

#define PLAN_ALIGN 256
/* Bytes left free after every entry, at least: guard zones that a memory
 * checker watches (llmc/cuda/nvtx_regions.cuh), so that an access one element
 * past a buffer does not land in the next one. 0 (only the alignment slack)
 * unless the build sets it: dev/emu builds use 256. */
#ifndef PLAN_GUARD_BYTES
#define PLAN_GUARD_BYTES 0
#endif

/* A new entry at offset `offset` of a pool's list. */
static inline PlanEntry* plan_push_entry(PlanEntry** list, int* num, int* cap, const char* name, int section, int layer,
                                         size_t bytes, size_t offset) {
    if (*num == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        *list = (PlanEntry*)realloc(*list, (size_t)*cap * sizeof(PlanEntry));
        if (!*list) fail("out of host memory for the memory plan");
    }
    PlanEntry* e = &(*list)[(*num)++];
    snprintf(e->name, sizeof(e->name), "%s", name);
    e->section = section;
    e->layer = layer;
    e->bytes = bytes;
    e->offset = offset;
    return e;
}

/* bytes rounded up to PLAN_ALIGN (saturating). */
static inline size_t plan_aligned(size_t bytes) {
    return bytes > SIZE_MAX - PLAN_ALIGN ? SIZE_MAX : ceil_div(bytes, PLAN_ALIGN) * PLAN_ALIGN;
}

static inline size_t plan_add(MemoryPlan* p, const char* name, int section, int layer, size_t bytes) {
    PlanEntry* e = plan_push_entry(&p->entries, &p->num_entries, &p->cap_entries, name, section, layer, bytes, p->total_bytes);
    size_t aligned = plan_aligned(size_add_sat(bytes, PLAN_GUARD_BYTES));
    p->total_bytes = size_add_sat(p->total_bytes, aligned);
    p->section_bytes[section] = size_add_sat(p->section_bytes[section], aligned);
    if (p->total_bytes == SIZE_MAX) p->overflow = 1;
    return e->offset;
}

/* An entry of the host pool in `section`: offloaded checkpoints (activations), the offloaded optimizer's. */
static inline size_t plan_add_host_in(MemoryPlan* p, const char* name, int section, int layer, size_t bytes) {
    PlanEntry* e = plan_push_entry(&p->host_entries, &p->num_host_entries, &p->cap_host_entries, name, section, layer,
                                   bytes, p->host_total_bytes);
    p->host_total_bytes = size_add_sat(p->host_total_bytes, plan_aligned(bytes));
    p->host_section_bytes[section] = size_add_sat(p->host_section_bytes[section], plan_aligned(bytes));
    if (p->host_total_bytes == SIZE_MAX) p->overflow = 1;
    return e->offset;
}

/* An offloaded checkpoint's entry of the host pool. */
static inline size_t plan_add_host(MemoryPlan* p, const char* name, int layer, size_t bytes) {
    return plan_add_host_in(p, name, SEC_ACTIVATIONS, layer, bytes);
}

static inline int plan_layer_mode(const PlanSpec* s, int layer) {
    return s->layer_mode ? (int)s->layer_mode[layer] : (int)RECOMPUTE_NONE;
}

static inline int plan_context_parallel(const PlanSpec* s) { return s->context_parallel > 1 ? s->context_parallel : 1; }

/* Tokens of each row one rank holds: T, or T / N under context parallelism. */
static inline int plan_local_T(const PlanSpec* s) { return s->T / plan_context_parallel(s); }

/* Segments (--segment-layers K > 1): layers [sK, sK+K) form segment s (the
 * last may be shorter). Only the first layer's input x, the segment's input,
 * is kept across the step; what the segment's layers keep under their modes
 * lives in K shared slots, slot l mod K, which the forward fills segment
 * after segment and the backward refills by running a segment's forward
 * again from its input (the top segment's are still there). 1: off. */
static inline int plan_segment_layers(const PlanSpec* s) {
    int K = s->segment_layers, L = s->cfg.num_layers;
    return K <= 1 || L <= 1 ? 1 : K < L ? K : L;
}
static inline int plan_num_segments(const PlanSpec* s) { return (int)ceil_div((size_t)s->cfg.num_layers, (size_t)plan_segment_layers(s)); }

/* Whether layer `layer` offloads: with segments, the segment input of a
 * segment's first layer (whatever its mode); else what a -r 1 or -r 3 layer keeps. */
static inline int plan_layer_offload(const PlanSpec* s, int layer) {
    if (!s->layer_offload || !s->layer_offload[layer]) return 0;
    int K = plan_segment_layers(s);
    return K > 1 ? layer % K == 0 : mode_can_offload(plan_layer_mode(s, layer));
}

/* Whether layer l's activation `act` lives in the host pool across the step. */
static inline int plan_act_offloads(const PlanSpec* s, int l, int act) {
    if (plan_segment_layers(s) > 1) return act == ACT_X && plan_layer_offload(s, l);
    return layer_offloads(plan_layer_mode(s, l), plan_layer_offload(s, l), act);
}

/* The staging ring's unit of layer l: its segment, or itself without segments. */
static inline int plan_staging_unit(const PlanSpec* s, int l) { return l / plan_segment_layers(s); }

/* Bytes of this rank's B*T/N tokens of `bytes_per_token` each (saturating: see size_mul_sat). */
static inline size_t plan_tokens_bytes(const PlanSpec* s, size_t bytes_per_token) {
    return size_mul_sat(size_mul_sat((size_t)s->B, (size_t)plan_local_T(s)), bytes_per_token);
}

/* Bytes of one K/V block the ring passes (this rank's B x T/N keys and
 * values, compact: 2 NKV HD elements a token, 2C for GPT-2; grouped-query
 * attention's K/V heads are not replicated per query head), and of one dK/dV block (the same shape, in
 * the element type of the backward's sums: the storage's on the CPU, fp32
 * on the GPU). */
static inline size_t plan_ring_kv_bytes(const PlanSpec* s) {
    return plan_tokens_bytes(s, 2 * (size_t)block_widths(&s->cfg).kv_width * (size_t)s->elem_bytes);
}
static inline size_t plan_ring_dkv_bytes(const PlanSpec* s) {
    return plan_tokens_bytes(s, 2 * (size_t)block_widths(&s->cfg).kv_width * (size_t)(s->backend == BACKEND_CPU ? s->elem_bytes : 4));
}

/* Bytes of activation `act` for B*T tokens. */
static inline size_t plan_act_bytes(const PlanSpec* s, int act) {
    int is_stat;
    size_t per_token = layer_act_per_token(act, &s->cfg, &is_stat);
    return plan_tokens_bytes(s, per_token * (size_t)(is_stat ? s->stat_bytes : s->elem_bytes));
}

/* Tokens of a token tile (--tile-tokens): K, at most B*T; 0 untiled. */
static inline size_t plan_tile_tokens(const PlanSpec* s) {
    size_t N = (size_t)s->B * (size_t)plan_local_T(s);
    return s->tile_tokens <= 0 ? 0 : (size_t)s->tile_tokens < N ? (size_t)s->tile_tokens : N;
}

/* Whether the gradients of attention's output and of qkv have buffers of
 * their own (backward.datty, backward.dqkv): with token tiles, and where
 * the aliases over res2 (C) and fch do not fit them (NH HD > C, or a QKV
 * wider than the FC matmul's output). GPT-2 untiled: the aliases. */
static inline int plan_own_attention_grads(const PlanSpec* s) {
    BlockWidths w = block_widths(&s->cfg);
    return plan_tile_tokens(s) || w.q_width > s->cfg.channels || w.qkv_width > w.fc_width;
}

/* Whether activation `act` is computed token by token (and so tiles). */
static inline int act_is_tokenwise(int act) { return act != ACT_X && act != ACT_QKV && act != ACT_ATTY && act != ACT_ATT_LSE; }

/* Tokens per tile of a call of N rows: the plan's (plan_tile_tokens; 0:
 * untiled), or all N when untiled or when the call has fewer rows
 * (sampling). */
static inline int call_tile_tokens(size_t plan_tile, int N) { return plan_tile && plan_tile < (size_t)N ? (int)plan_tile : N; }

/* Rows of the tile that starts at row r0 of N, tiles of K: K, or what is left
 * for the last one. Both trainers' block functions run over the tiles as
 * for (r0 = 0; r0 < N; r0 += K) with tile_len(r0, K, N) rows each. */
static inline int tile_len(int r0, int K, int N) { return r0 + K < N ? K : N - r0; }

/* Elements from the start of layer l's activation `act` to row r0: with
 * token tiles, a token-wise tensor the layer does not keep lives in a buffer
 * of one tile, which holds the current tile's rows from its start (0). */
static inline size_t plan_act_row_offset(const MemoryPlan* p, int l, int act, int r0) {
    int is_stat;
    size_t width = layer_act_per_token(act, &p->spec.cfg, &is_stat);
    int one_tile = plan_tile_tokens(&p->spec) && act_is_tokenwise(act) && !layer_keeps(plan_layer_mode(&p->spec, l), act);
    return one_tile ? 0 : (size_t)r0 * width;
}

/* Bytes of the shared recompute set's buffer for `act`: a tile of it with
 * token tiles, else B*T tokens. */
static inline size_t plan_shared_act_bytes(const PlanSpec* s, int act) {
    size_t rows = plan_tile_tokens(s);
    if (!rows || !act_is_tokenwise(act)) return plan_act_bytes(s, act);
    int is_stat;
    size_t per_token = layer_act_per_token(act, &s->cfg, &is_stat);
    return size_mul_sat(rows, per_token * (size_t)(is_stat ? s->stat_bytes : s->elem_bytes));
}

/* Bytes per token that one layer keeps under `mode` (the docs/DESIGN.md table). */
static inline size_t plan_layer_bytes_per_token(const PlanSpec* s, int mode) {
    size_t total = 0;
    for (int a = 0; a < NUM_LAYER_ACTS; a++) {
        int is_stat;
        size_t per_token = layer_act_per_token(a, &s->cfg, &is_stat);
        if (layer_keeps(mode, a)) total += per_token * (size_t)(is_stat ? s->stat_bytes : s->elem_bytes);
    }
    return total;
}

/* Which parameters have an fp32 gradient sum (grad_accum.cuh says why and
 * how): returns how many, from *first on. Every one with several
 * micro-steps (each adds to every gradient once); else, when the logits take
 * several chunks (one addition per chunk), the classifier's table: wte when
 * tied (index 0 on), an untied lm_head alone (the last tensor; the encoder
 * writes wte's gradient once, from zero, so it needs no sum); else none,
 * every gradient being written once from zero. */
static inline size_t plan_grads_fp32_range(const PlanSpec* s, const ParamLayout* pl, size_t* first) {
    *first = 0;
    if (!s->fp32_grad_sums) return 0;
    if (s->micro_steps > 1) return pl->total;
    size_t rows = (size_t)s->B * (size_t)plan_local_T(s);
    if (rows <= (size_t)s->logits_chunk_rows) return 0;
    int head = config_resolved(&s->cfg).tied ? P_WTE : P_LMHEAD;
    *first = pl->offset[head];
    return pl->count[head];
}

/* Elements of one layer's block-tensor gradients (its 12 tensors' slices). */
static inline size_t plan_layer_grad_count(const ParamLayout* pl, int num_layers) {
    size_t n = 0;
    for (int t = FIRST_BLOCK_TENSOR; t < FIRST_BLOCK_TENSOR + NUM_BLOCK_TENSORS; t++) n += pl->count[t] / (size_t)num_layers;
    return n;
}

/* fp32 sums of one layer's parameter gradients across its token tiles (a
 * GPU with tiles: cuBLASLt and the column sums add into them, tile after
 * tile, and the layer's floatX gradients are rounded from them once): the
 * layer's block tensors one after another, in parameter order. The CPU
 * carries each gradient in its own fp32 (or fp64) storage already. */
static inline size_t plan_tile_grads_count(const PlanSpec* s) {
    if (s->backend != BACKEND_GPU || !plan_tile_tokens(s)) return 0;
    ParamLayout pl;
    param_layout(&s->cfg, &pl);
    return plan_layer_grad_count(&pl, s->cfg.num_layers);
}

/* Whether ZeRO-1 shards the optimizer state: asked for, and more than one
 * process to shard it over (with one, its shard would be everything). */
static inline int plan_zero_sharded(const PlanSpec* s) { return s->zero_stage >= 1 && s->world_size > 1; }

/* Parameters whose optimizer state one process holds: all, or a ZeRO-1 shard. */
static inline size_t plan_shard_params(const PlanSpec* s, size_t num_params) {
    return plan_zero_sharded(s) ? ceil_div(num_params, (size_t)s->world_size) : num_params;
}

/* Bytes of one host copy of this rank's shard of the parameters with
 * --offload-optimizer: fp32 master weights, or without them (-w 0, the CPU
 * trainer, fp32 storage) the parameters in their storage precision, which
 * the host AdamW updates and copies back. */
static inline size_t plan_host_params_bytes(const PlanSpec* s, size_t shard) {
    return size_mul_sat(shard, s->master_weights ? 4 : (size_t)s->elem_bytes);
}

/* --offload-optimizer: this rank's shard of the optimizer in the host pool:
 * the parameters AdamW updates (master weights), the gradients it reads
 * (copied down in their storage precision) and the two fp32 moments. */
static inline void plan_add_host_optimizer(MemoryPlan* p) {
    const PlanSpec* s = &p->spec;
    size_t shard = p->shard_params;
    p->off_master = plan_add_host_in(p, "master_weights", SEC_MASTER_WEIGHTS, -1, plan_host_params_bytes(s, shard));
    p->off_host_grads = plan_add_host_in(p, "grads_copy", SEC_GRADIENTS, -1, size_mul_sat(shard, (size_t)s->elem_bytes));
    p->off_adam_m = plan_add_host_in(p, "adam_m", SEC_OPTIMIZER, -1, size_mul_sat(shard, 4));
    p->off_adam_v = plan_add_host_in(p, "adam_v", SEC_OPTIMIZER, -1, size_mul_sat(shard, 4));
}

/* Host pool bytes of the offloaded optimizer (0 without --offload-optimizer),
 * by the same entries as plan_add_host_optimizer, for the searches. */
static inline size_t plan_host_optimizer_bytes(const PlanSpec* s) {
    if (!s->offload_optimizer) return 0;
    ParamLayout pl;
    param_layout(&s->cfg, &pl);
    size_t shard = plan_shard_params(s, pl.total);
    size_t b = plan_aligned(plan_host_params_bytes(s, shard));
    b = size_add_sat(b, plan_aligned(size_mul_sat(shard, (size_t)s->elem_bytes)));
    return size_add_sat(b, size_mul_sat(2, plan_aligned(size_mul_sat(shard, 4))));
}

/* Layers whose block-tensor gradients the device holds at once (0: all of
 * them, the whole buffer). --offload-optimizer on a GPU with one process and
 * one micro-step: each layer's gradients are final when its backward ends
 * and go down to the host pool at once (optimizer_offload.cuh), so the
 * device keeps GRAD_SLOTS layers in flight, layer l in slot l mod R: layer l
 * writes its slot while layer l+1's copy down runs, and layer l-1 writes the
 * other one only once layer l+1's copy has finished (an event wait). Several
 * micro-steps add into every gradient once each, and several processes
 * reduce them after their layer's backward, so those keep the whole buffer;
 * so does the CPU trainer, whose one memory is the host's. */
#define GRAD_SLOTS 2
static inline int plan_grad_slots(const PlanSpec* s) {
    if (!s->offload_optimizer || s->backend != BACKEND_GPU || s->world_size != 1 || s->micro_steps > 1) return 0;
    return s->cfg.num_layers < GRAD_SLOTS ? s->cfg.num_layers : GRAD_SLOTS;
}

/* A layer slot: block tensor t (from 0) has a region from region[t], its
 * layer's slice (per_layer elements) rounded up to PLAN_ALIGN bytes plus
 * PLAN_ALIGN more; returns the slot's elements. Layer l's slice sits in the
 * region at the offset (plan_grad_slot_at) that gives it the alignment it has
 * in the whole buffer (both start PLAN_ALIGN-aligned): cuBLASLt's algorithm,
 * hence the weight gradient's bits, depends on the output's alignment
 * (matmul.cuh), and the bits must not depend on the flag. */
static inline size_t plan_grad_slot_layout(const ParamLayout* pl, int num_layers, size_t E, size_t region[NUM_BLOCK_TENSORS]) {
    size_t n = 0;
    for (int t = 0; t < NUM_BLOCK_TENSORS; t++) {
        size_t per_layer = pl->count[FIRST_BLOCK_TENSOR + t] / (size_t)num_layers;
        region[t] = n;
        if (per_layer) n += (plan_aligned(per_layer * E) + PLAN_ALIGN) / E;
    }
    return n;
}

/* Element offset in its slot of layer l's slice of block tensor t (from 0). */
static inline size_t plan_grad_slot_at(const ParamLayout* pl, int num_layers, size_t E, const size_t region[NUM_BLOCK_TENSORS], int l,
                                       int t) {
    size_t per_layer = pl->count[FIRST_BLOCK_TENSOR + t] / (size_t)num_layers;
    return region[t] + (pl->offset[FIRST_BLOCK_TENSOR + t] + (size_t)l * per_layer) % (PLAN_ALIGN / E);
}

/* The device's gradients: all of them ("grads", in parameter order), or
 * with plan_grad_slots the tensors outside the blocks ("grads_outside_blocks":
 * wte, wpe, lnfw, lnfb, lm_head in that order) and R layer slots
 * ("grads_in_flight", slot after slot, plan_grad_slot_layout). */
static inline void plan_add_device_grads(MemoryPlan* p, const ParamLayout* pl) {
    const PlanSpec* s = &p->spec;
    size_t E = (size_t)s->elem_bytes, L = (size_t)s->cfg.num_layers;
    p->grad_slots = plan_grad_slots(s);
    if (!p->grad_slots) {
        p->off_grads = plan_add(p, "grads", SEC_GRADIENTS, -1, pl->total * E);
        return;
    }
    size_t region[NUM_BLOCK_TENSORS];
    p->grad_slot_count = plan_grad_slot_layout(pl, s->cfg.num_layers, E, region);
    p->off_grads = plan_add(p, "grads_outside_blocks", SEC_GRADIENTS, -1, (pl->total - L * plan_layer_grad_count(pl, (int)L)) * E);
    p->off_grad_slots = plan_add(p, "grads_in_flight", SEC_GRADIENTS, -1, (size_t)p->grad_slots * p->grad_slot_count * E);
}

static inline void plan_add_model_state(MemoryPlan* p) {
    const PlanSpec* s = &p->spec;
    ParamLayout pl;
    param_layout(&s->cfg, &pl);
    p->num_params = pl.total;
    p->shard_params = plan_shard_params(s, pl.total);
    p->off_params = plan_add(p, "params", SEC_PARAMETERS, -1, pl.total * (size_t)s->elem_bytes);
    if (s->master_weights && !s->offload_optimizer) p->off_master = plan_add(p, "master_weights", SEC_MASTER_WEIGHTS, -1, p->shard_params * 4);
    plan_add_device_grads(p, &pl);
    p->grads_fp32_count = plan_grads_fp32_range(s, &pl, &p->grads_fp32_first);
    if (p->grads_fp32_count) p->off_grads_fp32 = plan_add(p, "grads_fp32", SEC_GRADIENTS, -1, p->grads_fp32_count * 4);
    if (s->offload_optimizer) { plan_add_host_optimizer(p); return; }
    p->off_adam_m = plan_add(p, "adam_m", SEC_OPTIMIZER, -1, p->shard_params * 4);
    p->off_adam_v = plan_add(p, "adam_v", SEC_OPTIMIZER, -1, p->shard_params * 4);
}

/* The staging ring of offloaded layers: R slots of each tensor some
 * offloaded layer keeps (scratch), and layer l's device address = slot
 * l mod R. R is at most the number of layers. */
static inline void plan_add_staging(MemoryPlan* p, const int offloaded[NUM_LAYER_ACTS]) {
    const PlanSpec* s = &p->spec;
    int L = s->cfg.num_layers, U = plan_num_segments(s), R = U < OFFLOAD_STAGING_SLOTS ? U : OFFLOAD_STAGING_SLOTS;
    size_t slot[OFFLOAD_STAGING_SLOTS][NUM_LAYER_ACTS];
    char name[40];
    int any = 0;
    for (int a = 0; a < NUM_LAYER_ACTS; a++) any |= offloaded[a];
    if (!any) return;
    p->staging_slots = R;
    size_t before = p->total_bytes;
    for (int r = 0; r < R; r++)
        for (int a = 0; a < NUM_LAYER_ACTS; a++) {
            if (!offloaded[a]) continue;
            snprintf(name, sizeof(name), "offload_staging%d.%s", r, layer_act_names[a]);
            slot[r][a] = plan_add(p, name, SEC_SCRATCH, -1, plan_act_bytes(s, a));
        }
    p->staging_bytes = p->total_bytes - before;
    for (int l = 0; l < L; l++)
        for (int a = 0; a < NUM_LAYER_ACTS; a++)
            if (plan_act_offloads(s, l, a)) p->layer_act[l][a] = slot[plan_staging_unit(s, l) % R][a];
}

/* Segments: each segment's input (a device entry, or the host pool's), and
 * K slots of what the layers keep, slot i serving layers i, i+K, ...: a
 * tensor is in slot i when one of those layers keeps it (slot 0's x is the
 * segment inputs). Fills needs_shared and offloaded like the per-layer plan. */
static inline void plan_add_segment_activations(MemoryPlan* p, int needs_shared[NUM_LAYER_ACTS], int offloaded[NUM_LAYER_ACTS]) {
    const PlanSpec* s = &p->spec;
    int L = s->cfg.num_layers, K = plan_segment_layers(s);
    char name[40];
    for (int l = 0; l < L; l += K) {
        snprintf(name, sizeof(name), "segment%d.x", l / K);
        if (plan_act_offloads(s, l, ACT_X)) {
            p->host_act[l][ACT_X] = plan_add_host(p, name, l, plan_act_bytes(s, ACT_X));
            offloaded[ACT_X] = 1;
        } else p->layer_act[l][ACT_X] = plan_add(p, name, SEC_ACTIVATIONS, l, plan_act_bytes(s, ACT_X));
    }
    p->layer_stored_bytes_max = 0;
    for (int i = 0; i < K; i++) {
        size_t stored = 0;
        for (int a = 0; a < NUM_LAYER_ACTS; a++) {
            int kept = 0;
            for (int l = i; l < L; l += K) {
                if (layer_keeps(plan_layer_mode(s, l), a)) kept = 1;
                else needs_shared[a] = 1;
            }
            if (!kept || (i == 0 && a == ACT_X)) continue;
            snprintf(name, sizeof(name), "segment_slot%d.%s", i, layer_act_names[a]);
            size_t off = plan_add(p, name, SEC_ACTIVATIONS, i, plan_act_bytes(s, a));
            stored = size_add_sat(stored, plan_act_bytes(s, a));
            for (int l = i; l < L; l += K)
                if (layer_keeps(plan_layer_mode(s, l), a)) p->layer_act[l][a] = off;
        }
        if (stored > p->layer_stored_bytes_max) p->layer_stored_bytes_max = stored;
    }
}

/* Per-layer kept tensors (offloaded ones in the host pool), the shared
 * recompute set for everything some layer does not keep, and the staging
 * ring of offloaded layers. */
static inline void plan_add_layer_activations(MemoryPlan* p) {
    const PlanSpec* s = &p->spec;
    int L = s->cfg.num_layers;
    int needs_shared[NUM_LAYER_ACTS] = {0}, offloaded[NUM_LAYER_ACTS] = {0};
    char name[40];
    p->layer_stored_bytes_max = 0;
    for (int l = 0; l < L && plan_segment_layers(s) == 1; l++) {
        int mode = plan_layer_mode(s, l), off = plan_layer_offload(s, l);
        size_t stored = 0;
        for (int a = 0; a < NUM_LAYER_ACTS; a++) {
            if (!layer_keeps(mode, a)) { needs_shared[a] = 1; continue; }
            if (layer_offloads(mode, off, a)) {
                snprintf(name, sizeof(name), "layer%d.%s", l, layer_act_names[a]);
                p->host_act[l][a] = plan_add_host(p, name, l, plan_act_bytes(s, a));
                offloaded[a] = 1;
                continue;
            }
            snprintf(name, sizeof(name), "layer%d.%s", l, layer_act_names[a]);
            p->layer_act[l][a] = plan_add(p, name, SEC_ACTIVATIONS, l, plan_act_bytes(s, a));
            stored = size_add_sat(stored, plan_act_bytes(s, a));
        }
        if (stored > p->layer_stored_bytes_max) p->layer_stored_bytes_max = stored;
    }
    if (plan_segment_layers(s) > 1) plan_add_segment_activations(p, needs_shared, offloaded);
    for (int a = 0; a < NUM_LAYER_ACTS; a++) {
        if (!needs_shared[a]) continue;
        snprintf(name, sizeof(name), "recompute.%s", layer_act_names[a]);
        size_t off = plan_add(p, name, SEC_SCRATCH, -1, plan_shared_act_bytes(s, a));
        for (int l = 0; l < L; l++)
            if (!layer_keeps(plan_layer_mode(s, l), a)) p->layer_act[l][a] = off;
    }
    plan_add_staging(p, offloaded);
}

static inline void plan_add_other_buffers(MemoryPlan* p) {
    const PlanSpec* s = &p->spec;
    size_t BT = (size_t)s->B * (size_t)plan_local_T(s), C = (size_t)s->cfg.channels, E = (size_t)s->elem_bytes;
    size_t S = (size_t)s->stat_bytes;
    p->off_inputs = plan_add(p, "inputs", SEC_ACTIVATIONS, -1, plan_tokens_bytes(s, 4));
    p->off_targets = plan_add(p, "targets", SEC_ACTIVATIONS, -1, plan_tokens_bytes(s, 4));
    p->off_final_res = plan_add(p, "final_residual", SEC_ACTIVATIONS, -1, plan_tokens_bytes(s, C * E));
    p->off_lnf = plan_add(p, "lnf", SEC_ACTIVATIONS, -1, plan_tokens_bytes(s, C * E));
    p->off_lnf_mean = plan_add(p, "lnf_mean", SEC_ACTIVATIONS, -1, plan_tokens_bytes(s, S));
    p->off_lnf_rstd = plan_add(p, "lnf_rstd", SEC_ACTIVATIONS, -1, plan_tokens_bytes(s, S));
    p->off_losses = plan_add(p, "losses", SEC_ACTIVATIONS, -1, plan_tokens_bytes(s, S));
    for (int g = 0; g < NUM_GRAD_ACTS; g++) {
        char name[40];
        snprintf(name, sizeof(name), "backward.%s", grad_act_names[g]);
        p->grad_act[g] = plan_add(p, name, SEC_SCRATCH, -1, plan_tokens_bytes(s, C * grad_act_width[g] * E));
    }
    if (plan_own_attention_grads(s)) {
        BlockWidths w = block_widths(&s->cfg);
        p->off_whole_datty = plan_add(p, "backward.datty", SEC_SCRATCH, -1, plan_tokens_bytes(s, (size_t)w.q_width * E));
        p->off_whole_dqkv = plan_add(p, "backward.dqkv", SEC_SCRATCH, -1, plan_tokens_bytes(s, (size_t)w.qkv_width * E));
        p->tile_grads_count = plan_tile_grads_count(s);
        if (p->tile_grads_count) p->off_tile_grads = plan_add(p, "backward.tile_grads", SEC_SCRATCH, -1, p->tile_grads_count * 4);
    }
    size_t chunk_rows = (size_t)s->logits_chunk_rows < BT ? (size_t)s->logits_chunk_rows : BT;
    p->off_logits = plan_add(p, "logits_chunk", SEC_SCRATCH, -1, size_mul_sat(chunk_rows, (size_t)s->cfg.padded_vocab_size * E));
    if (s->backend == BACKEND_CPU) { /* on a GPU these live in host memory, outside the device plan */
        p->off_io_chunk = plan_add(p, "io_staging", SEC_SCRATCH, -1, s->io_chunk_floats * 4);
        size_t token_bytes = loader_token_bytes(s->cfg.vocab_size); /* the window's B*T+1 tokens */
        p->off_loader = plan_add(p, "dataloader_tokens", SEC_SCRATCH, -1, size_add_sat(plan_tokens_bytes(s, token_bytes), token_bytes));
    }
    if (s->backend == BACKEND_GPU) { /* device scratch of the CUDA kernels, fp32 and int32 */
        p->off_att_rowsum = plan_add(p, "attention_rowsum", SEC_SCRATCH, -1, plan_tokens_bytes(s, (size_t)s->cfg.num_heads * 4));
        p->off_column_partials = plan_add(p, "column_partials", SEC_SCRATCH, -1, (size_t)GPU_COLUMN_SPLITS * 4 * C * 4);
        size_t norm_floats = (size_t)GPU_NORM_BLOCKS + 1 + ((size_t)s->cfg.num_layers + 1); /* block partials, total, groups */
        p->off_norm_partials = plan_add(p, "grad_norm_partials", SEC_SCRATCH, -1, norm_floats * 4);
        p->off_token_buckets = plan_add(p, "token_buckets", SEC_SCRATCH, -1, size_add_sat(plan_tokens_bytes(s, 12), 4));
    }
    p->off_top1 = plan_add(p, "top1", SEC_SCRATCH, -1, plan_tokens_bytes(s, 4)); /* evaluation's top-1 tokens */
    if (s->documents & PLAN_DOC_STARTS) /* each token's document start, and the GPU encoder's runs of positions */
        p->off_doc_start = plan_add(p, "documents.starts", SEC_SCRATCH, -1, plan_tokens_bytes(s, 4));
    if (s->backend == BACKEND_GPU && (s->documents & PLAN_DOC_POSITIONS))
        p->off_pos_runs = plan_add(p, "documents.position_runs", SEC_SCRATCH, -1, plan_tokens_bytes(s, 12));
    if (plan_context_parallel(s) > 1) { /* double buffers: one block computed on while the next arrives */
        p->off_ring_kv = plan_add(p, "ring.kv_blocks", SEC_SCRATCH, -1, size_mul_sat(2, plan_ring_kv_bytes(s)));
        p->off_ring_dkv = plan_add(p, "ring.dkv_blocks", SEC_SCRATCH, -1, size_mul_sat(2, plan_ring_dkv_bytes(s)));
        if (s->backend == BACKEND_GPU) /* the blocks' fp32 sums: output merged by lse (forward), dQ (backward), NH HD a token */
            p->off_ring_acc = plan_add(p, "ring.acc", SEC_SCRATCH, -1, plan_tokens_bytes(s, (size_t)block_widths(&s->cfg).q_width * 4));
    }
    if (s->workspace_bytes) plan_add(p, "library_workspace", SEC_WORKSPACE, -1, s->workspace_bytes);
}

static inline void plan_validate_spec(const PlanSpec* s) {
    if (s->B < 1) fail("batch size -b %d must be positive", s->B);
    if (s->T < 1) fail("sequence length -t %d must be positive", s->T);
    if (s->T > s->cfg.max_seq_len) fail("sequence length -t %d exceeds the model's maximum %d", s->T, s->cfg.max_seq_len);
    if (s->logits_chunk_rows < 1) fail("logits chunk must have at least one row");
    if (s->world_size < 1) fail("world size %d must be positive", s->world_size);
    if (s->zero_stage != 0 && s->zero_stage != 1) fail("ZeRO stage -z %d unsupported (0 or 1)", s->zero_stage);
    if (s->tile_tokens < 0) fail("token tile --tile-tokens %d must not be negative", s->tile_tokens);
    if (s->segment_layers < 0 || s->segment_layers > s->cfg.num_layers)
        fail("flag --segment-layers: %d is not a number of layers from 1 to the model's %d", s->segment_layers, s->cfg.num_layers);
}

static inline void plan_build(MemoryPlan* p, const PlanSpec* spec) {
    plan_validate_spec(spec);
    memset(p, 0, sizeof(*p));
    p->spec = *spec;
    p->spec.layer_mode = NULL; /* the caller's arrays may not outlive the plan; copied below */
    p->spec.layer_offload = NULL;
    int L = spec->cfg.num_layers;
    p->layer_act = (size_t(*)[NUM_LAYER_ACTS])calloc_check((size_t)L, sizeof(*p->layer_act), "memory plan");
    p->host_act = (size_t(*)[NUM_LAYER_ACTS])calloc_check((size_t)L, sizeof(*p->host_act), "memory plan");
    unsigned char* modes = (unsigned char*)calloc_check((size_t)L, 1, "memory plan");
    unsigned char* offload = (unsigned char*)calloc_check((size_t)L, 1, "memory plan");
    if (spec->layer_mode) memcpy(modes, spec->layer_mode, (size_t)L);
    p->spec.layer_mode = modes;
    for (int l = 0; l < L; l++) offload[l] = (unsigned char)plan_layer_offload(spec, l);
    p->spec.layer_offload = offload;
    plan_add_model_state(p);
    plan_add_layer_activations(p);
    plan_add_other_buffers(p);
}

static inline void plan_free(MemoryPlan* p) {
    free(p->entries);
    free(p->host_entries);
    free(p->layer_act);
    free(p->host_act);
    free((void*)p->spec.layer_mode);
    free((void*)p->spec.layer_offload);
    memset(p, 0, sizeof(*p));
}

/* Activation bytes kept by layers (excluding shared recompute set and non-layer buffers). */
static inline size_t plan_layer_activation_bytes(const MemoryPlan* p) {
    size_t total = 0;
    for (int i = 0; i < p->num_entries; i++)
        if (p->entries[i].section == SEC_ACTIVATIONS && p->entries[i].layer >= 0) total += p->entries[i].bytes;
    return total;
}

/* The largest single buffer: none may grow with T^2; used as a startup check. */
static inline size_t plan_largest_entry(const MemoryPlan* p, const char** name) {
    size_t best = 0;
    for (int i = 0; i < p->num_entries; i++)
        if (p->entries[i].bytes >= best) { best = p->entries[i].bytes; *name = p->entries[i].name; }
    return best;
}



/* ---- reporting ---- */

static inline const char* recompute_mode_name(int mode) {
    static const char* const names[NUM_RECOMPUTE_MODES] = {"-r 0 (none)", "-r 1 (full)", "-r 2 (selective)",
                                                           "-r 3 (full, attention kept)"};
    return names[mode];
}

/* Formats the layers of modes[L] equal to `mode` as "0-3,7" into buf;
 * returns how many there are. */
static inline int format_layers_with_mode(const unsigned char* modes, int L, int mode, char* buf, size_t n) {
    int count = 0;
    size_t used = 0;
    buf[0] = '\0';
    for (int l = 0; l < L; l++) {
        if (modes[l] != mode) continue;
        int e = l;
        while (e + 1 < L && modes[e + 1] == mode) e++;
        int w = e > l ? snprintf(buf + used, n - used, "%s%d-%d", count ? "," : "", l, e)
                      : snprintf(buf + used, n - used, "%s%d", count ? "," : "", l);
        if (w < 0 || (size_t)w >= n - used) { snprintf(buf + (n > 4 ? n - 4 : 0), n > 4 ? 4 : n, "..."); used = n - 1; }
        else used += (size_t)w;
        count += e - l + 1;
        l = e;
    }
    return count;
}

static inline int plan_layers_with_mode(const MemoryPlan* p, int mode, char* buf, size_t n) {
    return format_layers_with_mode(p->spec.layer_mode, p->spec.cfg.num_layers, mode, buf, n);
}

/* The -r value that reproduces modes[L] and offload[L] (NULL: none): one
 * digit when every layer has the same mode and none offloads, else the mix
 * MODE:LAYERS/... of the layers that recompute (the others keep everything),
 * MODEo for offloaded groups. Fails rather than truncate. */
static inline void format_recompute_flag(const unsigned char* modes, const unsigned char* offload, int L, char* buf, size_t n) {
    unsigned char* codes = (unsigned char*)calloc_check((size_t)L + 1, 1, "recompute flag"); /* mode, +4 offloaded */
    int uniform = 1;
    for (int l = 0; l < L; l++) {
        codes[l] = (unsigned char)(modes[l] + (offload && offload[l] && mode_can_offload(modes[l]) ? 4 : 0));
        uniform &= codes[l] == codes[0];
    }
    if (uniform && codes[0] < 4) { snprintf(buf, n, "%d", modes[0]); free(codes); return; }
    size_t used = 0;
    buf[0] = '\0';
    char* layers = (char*)malloc_check(n, "recompute flag");
    for (int code = 1; code < 2 * NUM_RECOMPUTE_MODES; code++) {
        if (code == 4 || !format_layers_with_mode(codes, L, code, layers, n)) continue;
        int w = snprintf(buf + used, n - used, "%s%d%s:%s", used ? "/" : "", code & 3, code >= 4 ? "o" : "", uniform ? "all" : layers);
        if (w < 0 || (size_t)w >= n - used) fail("internal: the -r flag of this layer mix is longer than %zu characters", n);
        used += (size_t)w;
    }
    free(layers);
    free(codes);
}

/* What the host pool holds, for messages. */
static inline const char* plan_host_pool_contents(const MemoryPlan* p) {
    if (!p->spec.offload_optimizer) return "offloaded checkpoints";
    return p->host_section_bytes[SEC_ACTIVATIONS] ? "offloaded checkpoints and the optimizer" : "the offloaded optimizer";
}

/* The startup printout: the four components plus scratch and workspace, in
 * MiB, the total allocated, and the bytes per token per layer of each mode. */
static inline void plan_print_summary(const MemoryPlan* p, FILE* out) {
    static const char* labels[NUM_SECTIONS] = {"parameters", "master weights", "gradients", "optimizer state",
                                               "activations", "scratch", "workspace"};
    fprintf(out, "memory plan (%d-byte storage, B=%d T=%d", p->spec.elem_bytes, p->spec.B, p->spec.T);
    if (p->spec.world_size > 1)
        fprintf(out, "; per process, %d processes, ZeRO-%d", p->spec.world_size, p->spec.zero_stage);
    if (plan_context_parallel(&p->spec) > 1)
        fprintf(out, "; context parallel %d: %d tokens of each row per process", plan_context_parallel(&p->spec), plan_local_T(&p->spec));
    fprintf(out, "):\n");
    const char* host = p->spec.backend == BACKEND_GPU ? "pinned host" : "host pool";
    for (int s = 0; s < NUM_SECTIONS; s++) {
        fprintf(out, "  %-16s %12.1f MiB", labels[s], mib(p->section_bytes[s]));
        if (p->host_total_bytes) fprintf(out, " %12.1f MiB %s", mib(p->host_section_bytes[s]), host);
        fprintf(out, "\n");
    }
    fprintf(out, "  %-16s %12.1f MiB (%zu bytes, allocated once)\n", "total", mib(p->total_bytes), p->total_bytes);
    if (p->spec.offload_optimizer)
        fprintf(out, "  optimizer offloaded (--offload-optimizer): master weights, gradient copy and moments of %zu parameters in the "
                "%s, %.1f MiB; AdamW runs on the host\n", p->shard_params, p->spec.backend == BACKEND_GPU ? "pinned host pool" : "host pool",
                mib(plan_host_optimizer_bytes(&p->spec)));
    if (p->grad_slots)
        fprintf(out, "  gradients on the device: the tensors outside the blocks and %d layers in flight (grads_in_flight, %.1f MiB: "
                "each layer's go down as its backward ends)\n", p->grad_slots,
                mib((size_t)p->grad_slots * p->grad_slot_count * (size_t)p->spec.elem_bytes));
    else if (p->spec.offload_optimizer && p->spec.backend == BACKEND_GPU)
        fprintf(out, "  gradients on the device: all of them (%s; one process with one micro-step keeps %d layers in flight)\n",
                p->spec.world_size > 1 ? "several processes reduce them after the backward" : "micro-steps add into each",
                GRAD_SLOTS);
    for (int mode = 0; mode < NUM_RECOMPUTE_MODES; mode++) {
        char layers[256];
        int count = plan_layers_with_mode(p, mode, layers, sizeof(layers));
        if (!count) continue;
        fprintf(out, "  activations per token per layer, %s: %zu bytes (%.2f C) on %d layer%s [%s]\n",
                recompute_mode_name(mode), plan_layer_bytes_per_token(&p->spec, mode),
                (double)plan_layer_bytes_per_token(&p->spec, mode) / p->spec.cfg.channels,
                count, count == 1 ? "" : "s", layers);
    }
    if (plan_tile_tokens(&p->spec))
        fprintf(out, "  token tiles: %zu of the %d rows at a time (--tile-tokens %d)\n", plan_tile_tokens(&p->spec),
                p->spec.B * plan_local_T(&p->spec), p->spec.tile_tokens); /* a rank's rows: B x T/N under context parallelism */
    int K = plan_segment_layers(&p->spec), S = plan_num_segments(&p->spec);
    if (K > 1)
        fprintf(out, "  segments: %d segments of %d layers (--segment-layers %d; the last of %d): %d segment inputs kept, %d slots of what "
                "the layers keep; the backward runs %d segment%s forward again\n", S, K, K, p->spec.cfg.num_layers - (S - 1) * K, S, K,
                S - 1, S - 1 == 1 ? "" : "s");
    if (p->host_section_bytes[SEC_ACTIVATIONS])
        fprintf(out, "  host memory, offloaded checkpoints: %.1f MiB (%s), device staging ring %d slots, %.1f MiB\n",
                mib(p->host_section_bytes[SEC_ACTIVATIONS]), p->spec.backend == BACKEND_GPU ? "pinned" : "a second allocation", p->staging_slots,
                mib(p->staging_bytes));
}
#endif
