/*
 * remat CUDA trainer: GPT-2 on one GPU, hand-written kernels (one .cuh per
 * op family in llmc/) and cuBLASLt matmuls; on several GPUs, one process per
 * GPU, with NCCL (llmc/cuda/multigpu.cuh: built with MULTI_GPU).
 *
 * The same model, flags, files and output as the CPU reference train_gpt.c,
 * through the shared driver in llmc/run/trainer.h; this file supplies the
 * Backend. It mirrors train_gpt.c function by function (gpu_model_create,
 * gpu_block_forward_qkv/_mlp, gpu_block_forward, gpu_block_backward_mlp/_qkv,
 * gpu_block_backward, gpu_classifier, gpu_model_backward, gpu_backend,
 * main), so the two read side by side; both run the token-wise work over
 * token tiles (--tile-tokens).
 *
 * Storage: floatX (bf16 by default, fp16 or fp32 with PRECISION=FP16|FP32) for parameters,
 * gradients and activations; fp32 for statistics, losses, AdamW moments and
 * master weights. Memory: one cudaMalloc of the plan's total before step 1,
 * carved by the plan's offsets; nothing is allocated on the device inside the
 * training loop. Host buffers the driver fills (tokens, file staging) are
 * pinned host memory outside the device plan.
 *
 * Shapes: B batch, T time, C channels, NH heads, N = B*T rows, V vocabulary,
 * Vp padded vocabulary, L layers. Weights are (out, in).
 *
 * Status: see the status table in README.md.
 */
#include "llmc/run/trainer.h"
#include "llmc/cuda/cuda_common.cuh"
#include "llmc/cuda/encoder.cuh"
#include "llmc/cuda/layernorm.cuh"
#include "llmc/cuda/rmsnorm.cuh"
#include "llmc/cuda/rope.cuh"
#include "llmc/cuda/swiglu.cuh"
#include "llmc/cuda/matmul.cuh"
#include "llmc/cuda/attention.cuh"
#include "llmc/cuda/gelu.cuh"
#include "llmc/cuda/dropout.cuh"
#include "llmc/cuda/classifier.cuh"
#include "llmc/cuda/adamw.cuh"
#include "llmc/cuda/global_norm.cuh"
#include "llmc/cuda/multigpu.cuh"
#include "llmc/cuda/ring.cuh"
#include "llmc/cuda/grad_accum.cuh"
#include "llmc/cuda/profile.cuh"
#include "llmc/cuda/nvtx_regions.cuh"
#include "llmc/cuda/offload.cuh"
#include "llmc/cuda/optimizer_offload.cuh"

#define GPU_WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLASLt workspace */
/* Rows of the (B*T, Vp) logits materialised at once: 197 MiB at Vp=50304 in
 * bf16. Each chunk's three classifier matmuls are still (2048 x 50304 x C),
 * thousands of output tiles, enough to fill any GPU. The cost of small
 * chunks: the token table's gradient (Vp x C) is read, added to and rounded
 * to floatX once per chunk (B*T/2048 times per micro-step, as gradient
 * accumulation does across micro-steps). 8192 rows took 786 MiB, more than
 * all of d12's layer inputs at B=1, T=32768 under -r 1. Unmeasured on a GPU:
 * REMAT_PROFILE's classifier time says whether it matters. */
#define GPU_LOGITS_CHUNK_ROWS 2048

/* ------------------------------------------------------------------------ */
/* the model                                                                  */

typedef PARAM_TENSORS(floatX) GpuParamTensors;
typedef BLOCK_TENSORS(floatX) GpuBlockTensors;
typedef BLOCK_TENSORS(float) GpuTileGrads; /* one layer's gradients summed over its token tiles in fp32 */

typedef struct {
    ModelConfig cfg;     /* resolved: every switch set (config_resolved) */
    BlockWidths w;       /* the block's widths (block_widths) */
    RopeTable rope;      /* RoPE's frequencies (positions POS_ROPE) */
    const MemoryPlan* plan;
    char* arena; /* device, plan->total_bytes */
    floatX* params;
    floatX* grads;            /* all gradients, or with slots those outside the blocks (plan.h, plan_add_device_grads) */
    size_t grad_count;        /* elements of grads */
    floatX* grad_slots;       /* plan_grad_slots: the block tensors' gradients of the layers in flight, layer l in slot l mod R */
    int num_grad_slots;       /* R; 0: the block tensors' gradients are in grads */
    size_t grad_slot_count;   /* elements of a slot: one layer's block tensors (plan.h, plan_grad_slot_layout) */
    size_t slot_region[NUM_BLOCK_TENSORS]; /* where each block tensor's region begins in a slot */
    size_t block_grad_count;  /* with slots: the block tensors' elements, all layers (not in grads) */
    float* grads_fp32;        /* fp32 gradient sums of parameters [first, first + count) (grad_accum.cuh), or NULL */
    size_t grads_fp32_first, grads_fp32_count;
    int wte_grad_fp32;        /* the token table's gradient goes straight into grads_fp32 */
    float* head_grad_fp32;    /* the classifier's (wte's or lm_head's) fp32 sum in grads_fp32, or NULL */
    int last_micro_step;      /* the running backward is the step's last micro-step */
    float* master; /* NULL without master weights */
    float* adam_m;
    float* adam_v;
    GpuParamTensors p; /* the parameters by name, views into params */
    GpuParamTensors g; /* their gradients, views into grads */
    size_t layer_stride[NUM_PARAM_TENSORS];
    int* inputs; /* device (N) */
    int* targets;
    float* losses; /* (N) per-token loss */
    floatX* final_res;
    floatX* lnf;
    float* lnf_mean;
    float* lnf_rstd;
    floatX* logits; /* (chunk rows, Vp) */
    int logits_rows;
    floatX* grad_act[NUM_GRAD_ACTS];
    int tile_tokens;        /* token tiles: tokens per tile (0: untiled, one tile of B*T rows) */
    floatX* whole_datty;    /* plan_own_attention_grads: whole-sequence (N,NH HD) gradient of attention's output, (N,QKV) of qkv */
    floatX* whole_dqkv;
    GpuTileGrads tile_grads; /* token tiles: the running layer's parameter gradients in fp32 (plan.h backward.tile_grads) */
    float* att_rowsum;      /* (B,NH,T) attention backward's D */
    float* column_partials; /* bias / LayerNorm parameter gradient partial sums */
    float* norm_partials;   /* gradient norm partial sums */
    int* token_buckets;     /* positions grouped by token, for the wte gradient */
    /* host, pinned */
    int* h_inputs;
    int* h_targets;
    float* h_losses;
    int* top1;          /* (B*T) device: forward_loss's top-1 tokens (the plan's "top1") */
    float* io_chunk;
    void* window; /* loader_token_bytes(V) per token */
    int* h_buckets;
    void* h_xfer;    /* io_chunk_floats floatX: parameter conversion staging */
    void* h_logits;  /* Vp floatX */
    int* bucket_count; /* V ints, plain host memory */
    TokenBuckets buckets; /* counts of h_buckets' lists */
    MatmulContext mm;
    cudaStream_t stream;
    int B, T; /* shape of the current call; at most the plan's (under context parallelism: this rank's tokens of each row) */
    RankParallel par;     /* context-parallel group, ring chunks, ZeRO-1 shard (llmc/run/rank_parallel.h) */
    TokenLayout layout;   /* where the current call's token rows sit in their sequences */
    GpuRing ring;         /* context parallelism: its buffers (llmc/cuda/ring.cuh) */
    uint64_t seed;
    /* reporting */
    double flops_per_step, peak_flops;
    size_t used_context, used_library, used_arena, used_peak; /* device memory in use after each setup stage */
    size_t used_nccl; /* NCCL's part of used_context (it connects first) */
    int memory_reported;
    MultiGpu* mg; /* NCCL (MULTI_GPU builds), else NULL */
    Profiler prof; /* REMAT_PROFILE (profile.cuh); inactive unless main sets it up */
    DropoutState train_dropout; /* set_dropout's: what forward_backward drops */
    const DropoutState* drop;   /* the running pass's: &train_dropout, or &dropout_off */
    Offload off;                /* offloaded checkpoints: pinned pool, copy stream, events (offload.cuh) */
    OptimizerOffload oo;        /* --offload-optimizer: master weights and moments in the pinned pool (optimizer_offload.cuh) */
    /* packed documents (llmc/core/documents.h): the device buffers are the plan's (documents.*), B*T ints each */
    DocumentOptions docs;
    int* h_doc_start;           /* pinned (B,T): the loader's starts (Backend.doc_start), or sampling's */
    int* doc_start;             /* device copy, uploaded with the tokens */
    int* h_counted_targets;     /* pinned (B,T): targets with -1 where the loss does not count */
    int* h_pos_runs;            /* pinned 3 B*T: encoder_position_runs of the current call */
    int* pos_runs;              /* device copy */
    int pos_run_count, pos_run_positions;
} GpuModel;

/* Site `kind` of layer l in the running pass (threshold 0: no dropout). */
static inline DropoutSite gpu_site(const GpuModel* m, DropoutSiteKind kind, int l) { return dropout_site(m->drop, kind, l); }

static inline floatX* gact(const GpuModel* m, int layer, int a) { return (floatX*)(m->arena + m->plan->layer_act[layer][a]); }
static inline float* gstat(const GpuModel* m, int layer, int a) { return (float*)(m->arena + m->plan->layer_act[layer][a]); }

/* Host waits on the training stream go through here: with NCCL it watches the
 * communicator for asynchronous errors meanwhile (multigpu_wait). */
static inline void gpu_wait(GpuModel* m) { multigpu_wait(m->mg, m->stream); }

/* Layer l's slice of the block tensors of `all` (the parameters or their
 * gradients), by name. */
static inline GpuBlockTensors gpu_layer_slice(const GpuModel* m, const GpuParamTensors* all, int l) {
    GpuBlockTensors b;
    for (int t = 0; t < NUM_BLOCK_TENSORS; t++)
        b.tensor[t] = all->tensor[FIRST_BLOCK_TENSOR + t] + (size_t)l * m->layer_stride[FIRST_BLOCK_TENSOR + t];
    return b;
}

/* A block tensor the switches leave out (a bias) is NULL, as on the CPU. */
static inline GpuBlockTensors gpu_absent_to_null(const GpuModel* m, GpuBlockTensors w) {
    for (int t = 0; t < NUM_BLOCK_TENSORS; t++)
        if (m->layer_stride[FIRST_BLOCK_TENSOR + t] == 0) w.tensor[t] = NULL;
    return w;
}

static inline GpuBlockTensors gpu_layer_params(const GpuModel* m, int l) { return gpu_absent_to_null(m, gpu_layer_slice(m, &m->p, l)); }

/* The slot holding layer l's block gradients (with slots). */
static inline int gpu_grad_slot_of(const GpuModel* m, int l) { return l % m->num_grad_slots; }
static inline floatX* gpu_grad_slot(const GpuModel* m, int l) {
    return m->grad_slots + (size_t)gpu_grad_slot_of(m, l) * m->grad_slot_count;
}

/* Element offset of layer l's slice of block tensor t (from 0) in its slot. */
static inline size_t gpu_slot_at(const GpuModel* m, int l, int t) {
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    return plan_grad_slot_at(&pl, m->cfg.num_layers, sizeof(floatX), m->slot_region, l, t);
}

/* Layer l's gradients by name: in the whole buffer, or in its slot. */
static inline GpuBlockTensors gpu_layer_grads(const GpuModel* m, int l) {
    if (!m->num_grad_slots) return gpu_absent_to_null(m, gpu_layer_slice(m, &m->g, l));
    GpuBlockTensors b;
    for (int t = 0; t < NUM_BLOCK_TENSORS; t++) b.tensor[t] = gpu_grad_slot(m, l) + gpu_slot_at(m, l, t);
    return gpu_absent_to_null(m, b);
}

/* Where parameter k's gradient is in grads (k outside the blocks with
 * slots): its own index, or past the blocks moved down by them. */
static inline size_t gpu_grad_index(const GpuModel* m, size_t k) {
    return k < (size_t)(m->p.tensor[FIRST_BLOCK_TENSOR] - m->params) ? k : k - m->block_grad_count;
}

/* The classifier's weights (Vp, C) and their gradient: wte, or the untied lm_head. */
static inline floatX* gpu_head_weights(const GpuModel* m) { return m->cfg.tied ? m->p.wte : m->p.lm_head; }
static inline floatX* gpu_head_grads(const GpuModel* m) { return m->cfg.tied ? m->g.wte : m->g.lm_head; }

static inline size_t gpu_used_memory(void) {
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return total_b - free_b;
}

static size_t plan_entry_offset(const MemoryPlan* plan, const char* name, size_t* bytes) {
    for (int i = 0; i < plan->num_entries; i++)
        if (strcmp(plan->entries[i].name, name) == 0) {
            *bytes = plan->entries[i].bytes;
            return plan->entries[i].offset;
        }
    *bytes = 0;
    return 0;
}

static void* pinned_alloc(size_t bytes, const char* what) {
    void* p = NULL;
    cudaError_t err = cudaMallocHost(&p, bytes ? bytes : 1);
    if (err != cudaSuccess) fail("cannot allocate %zu bytes of pinned host memory for %s: %s", bytes, what, cudaGetErrorString(err));
    return p;
}

/* The fp32 sum of parameters [offset, offset + count) in grads_fp32 when
 * the range covers all of them (grad_accum.cuh), else NULL. */
static float* gpu_grad_sum_at(const GpuModel* m, size_t offset, size_t count) {
    if (!m->grads_fp32 || offset < m->grads_fp32_first || offset + count > m->grads_fp32_first + m->grads_fp32_count) return NULL;
    return m->grads_fp32 + (offset - m->grads_fp32_first);
}

/* The gradients (TRAINER_CARVE_ARENA pointed them at the whole buffer):
 * with slots (plan.h, plan_grad_slots) grads holds the tensors outside the
 * blocks back to back, and the block tensors have no whole-model pointer
 * (gpu_layer_grads finds a layer's in its slot). */
static void gpu_carve_grads(GpuModel* m, const MemoryPlan* plan) {
    m->grad_count = plan->num_params;
    if (!plan->grad_slots) return;
    m->num_grad_slots = plan->grad_slots;
    m->grad_slot_count = plan->grad_slot_count;
    m->grad_slots = (floatX*)(m->arena + plan->off_grad_slots);
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    plan_grad_slot_layout(&pl, m->cfg.num_layers, sizeof(floatX), m->slot_region);
    m->block_grad_count = (size_t)m->cfg.num_layers * plan_layer_grad_count(&pl, m->cfg.num_layers);
    m->grad_count = plan->num_params - m->block_grad_count;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        int block = t >= FIRST_BLOCK_TENSOR && t < FIRST_BLOCK_TENSOR + NUM_BLOCK_TENSORS;
        m->g.tensor[t] = block ? NULL : m->grads + gpu_grad_index(m, pl.offset[t]);
    }
}

/* Token tiles: the whole-sequence gradients of atty and qkv, and the
 * layer's fp32 gradient sums (its 12 block tensors back to back, zeroed
 * before each layer's backward). cuBLASLt is told
 * the alignment every tile's rows share, so a tile's matmul finds the same
 * algorithm (and sums in the same order) whether its rows lie in a kept
 * tensor or at the start of a one-tile buffer: -r modes and offloading
 * then give the same bits. */
static void gpu_carve_tiles(GpuModel* m, const MemoryPlan* plan) {
    m->tile_tokens = (int)plan_tile_tokens(&plan->spec);
    if (plan_own_attention_grads(&plan->spec)) { /* also untiled when the slots they would go over are narrower (plan.h) */
        m->whole_datty = (floatX*)(m->arena + plan->off_whole_datty);
        m->whole_dqkv = (floatX*)(m->arena + plan->off_whole_dqkv);
    }
    if (!m->tile_tokens) return;
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    float* sums = (float*)(m->arena + plan->off_tile_grads);
    for (int t = 0; t < NUM_BLOCK_TENSORS; t++) {
        size_t per_layer = pl.count[FIRST_BLOCK_TENSOR + t] / (size_t)m->cfg.num_layers;
        m->tile_grads.tensor[t] = per_layer ? sums : NULL; /* an absent tensor (a bias the mask drops) has none */
        sums += per_layer;
    }
    /* the alignment a tile's start shares in every row width it is cut from: C, and the Llama block's NH HD, QKV, F
     * and 2F, which need not be multiples of C (GPT-2's 3C and 4C are, so C's decides) */
    const int widths[] = {m->cfg.channels, m->w.q_width, m->w.qkv_width, m->w.F, m->w.fc_width};
    m->mm.align_cap = 256;
    for (size_t i = 0; i < sizeof(widths) / sizeof(widths[0]); i++) {
        int a = pointer_alignment((const void*)((size_t)m->tile_tokens * widths[i] * sizeof(floatX)));
        if (a < m->mm.align_cap) m->mm.align_cap = a;
    }
}

/* The shape of the next pass: B rows of T tokens on this rank (under
 * context parallelism its two chunks of each sequence, N T long: those
 * ring_chunks gives it for the batch). */
static void gpu_set_shape(GpuModel* m, int B, int T) {
    m->B = B;
    m->T = T;
    m->layout = token_layout(T, m->par.cp.member, m->par.cp.group_size, m->par.ring_chunks);
}

/* What the GPU's block does not run, refused in one line: heads the
 * attention kernels do not take (K/V heads that do not divide the query
 * heads, head sizes past 128), query heads that do not span C (the block's
 * tests hold NH x HD = C only), LayerNorm without GPT-2's bias or epsilon
 * (its kernels hold both). */
static void gpu_check_config(const ModelConfig* cfg, const char* what) {
    ModelConfig c = config_resolved(cfg);
    BlockWidths w = block_widths(&c);
    attention_check_heads(w.NH, w.NKV, w.HD);
    if (c.head_size * c.num_heads != c.channels)
        fail("%s: the GPU's attention needs NH x HD = C (here %d x %d, C %d): train it with train_gpt_cpu", what, c.num_heads, c.head_size,
             c.channels);
    if (c.norm == NORM_LAYERNORM && (c.norm_eps != 1e-5f || !(c.bias & BIAS_NORM)))
        fail("%s: the GPU's LayerNorm has GPT-2's bias and epsilon 1e-5 only (here eps %g%s): train it with train_gpt_cpu", what,
             (double)c.norm_eps, c.bias & BIAS_NORM ? "" : ", no bias");
}

static void gpu_model_create(GpuModel* m, const MemoryPlan* plan, uint64_t seed) {
    memset(m, 0, sizeof(*m));
    gpu_check_config(&plan->spec.cfg, "the model");
    m->cfg = config_resolved(&plan->spec.cfg);
    m->w = block_widths(&m->cfg);
    if (m->cfg.positions == POS_ROPE) m->rope = rope_table(&m->cfg);
    m->plan = plan;
    m->seed = seed;
    m->stream = 0;
    m->drop = &dropout_off;
    if (plan->spec.elem_bytes != (int)sizeof(floatX) || plan->spec.stat_bytes != 4 || plan->spec.backend != BACKEND_GPU)
        fail("internal: the plan was not made for this GPU build (%d-byte storage, %s)", plan->spec.elem_bytes, PRECISION_NAME);
    CUDA_CHECK(cudaFree(0)); /* creates the context now, so that it is measured on its own */
    m->used_context = gpu_used_memory();
    gpu_matmul_init(&m->mm);
    m->used_library = gpu_used_memory();
    cudaError_t err = cudaMalloc((void**)&m->arena, plan->total_bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        plan_oom_report(plan, free_b, "device");
        fail("out of device memory: the plan needs %.1f MiB (%s)", mib(plan->total_bytes), cudaGetErrorString(err));
    }
    m->used_arena = gpu_used_memory();
    nvtx_register_plan(plan, m->arena);
    offload_create(&m->off, plan, m->arena, m->stream);
    optimizer_offload_create(&m->oo, plan, m->off.host);
    size_t ws_bytes = 0, ws_off = plan_entry_offset(plan, "library_workspace", &ws_bytes);
    gpu_matmul_set_workspace(&m->mm, ws_bytes ? m->arena + ws_off : NULL, ws_bytes);

    TRAINER_CARVE_ARENA(m, plan, floatX, float);
    m->master = plan->spec.master_weights && !m->oo.on ? (float*)(m->arena + plan->off_master) : NULL;
    if (m->oo.on) m->adam_m = m->adam_v = NULL; /* in the pinned pool: m->oo.m, m->oo.v */
    m->att_rowsum = (float*)(m->arena + plan->off_att_rowsum);
    m->column_partials = (float*)(m->arena + plan->off_column_partials);
    m->norm_partials = (float*)(m->arena + plan->off_norm_partials);
    m->token_buckets = (int*)(m->arena + plan->off_token_buckets);
    m->grads_fp32_first = plan->grads_fp32_first;
    m->grads_fp32_count = plan->grads_fp32_count;
    m->grads_fp32 = m->grads_fp32_count ? (float*)(m->arena + plan->off_grads_fp32) : NULL;
    gpu_carve_tiles(m, plan);
    gpu_carve_grads(m, plan);
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    m->wte_grad_fp32 = gpu_grad_sum_at(m, pl.offset[P_WTE], pl.count[P_WTE]) != NULL; /* tied and chunked, or micro-steps */
    int head = m->cfg.tied ? P_WTE : P_LMHEAD;
    m->head_grad_fp32 = gpu_grad_sum_at(m, pl.offset[head], pl.count[head]);
    CUDA_CHECK(cudaMemset(m->grads, 0, m->grad_count * sizeof(floatX)));
    if (m->grads_fp32) CUDA_CHECK(cudaMemset(m->grads_fp32, 0, m->grads_fp32_count * sizeof(float)));
    if (!m->oo.on) {
        CUDA_CHECK(cudaMemset(m->adam_m, 0, plan->shard_params * sizeof(float)));
        CUDA_CHECK(cudaMemset(m->adam_v, 0, plan->shard_params * sizeof(float)));
    }

    size_t N = (size_t)plan->spec.B * plan->spec.T, io = plan->spec.io_chunk_floats;
    m->h_inputs = (int*)pinned_alloc(N * sizeof(int), "input tokens");
    m->h_targets = (int*)pinned_alloc(N * sizeof(int), "target tokens");
    m->h_losses = (float*)pinned_alloc(N * sizeof(float), "losses");
    m->top1 = (int*)(m->arena + plan->off_top1);
    m->io_chunk = (float*)pinned_alloc(io * sizeof(float), "file staging");
    m->window = pinned_alloc((N + 1) * loader_token_bytes(m->cfg.vocab_size), "dataloader window");
    m->h_buckets = (int*)pinned_alloc((3 * (size_t)N + 1) * sizeof(int), "token buckets");
    m->h_xfer = pinned_alloc(io * sizeof(floatX), "parameter staging");
    m->h_logits = pinned_alloc((size_t)m->cfg.padded_vocab_size * sizeof(floatX), "logits row");
    m->bucket_count = (int*)malloc_check((size_t)m->cfg.vocab_size * sizeof(int), "token buckets");
    m->docs.eot_token = -1;
    m->h_doc_start = (int*)pinned_alloc(N * sizeof(int), "document starts");
    m->par = rank_parallel(plan, remat_proc.rank);
    if (m->par.cp.group_size > 1) {
        size_t block = plan_ring_kv_bytes(&plan->spec);
        m->ring.kv[0] = (floatX*)(m->arena + plan->off_ring_kv);
        m->ring.kv[1] = (floatX*)(m->arena + plan->off_ring_kv + block);
        m->ring.dkv[0] = (float*)(m->arena + plan->off_ring_dkv);
        m->ring.dkv[1] = (float*)(m->arena + plan->off_ring_dkv + plan_ring_dkv_bytes(&plan->spec));
        m->ring.acc = (float*)(m->arena + plan->off_ring_acc);
        m->ring.rowsum = m->att_rowsum;
    }
}

static void gpu_model_free(GpuModel* m) {
    CUDA_CHECK(cudaDeviceSynchronize());
    gpu_matmul_destroy(&m->mm);
    optimizer_offload_destroy(&m->oo);
    offload_destroy(&m->off);
    CUDA_CHECK(cudaFree(m->arena));
    void* pinned[] = {m->h_inputs, m->h_targets, m->h_losses, m->io_chunk, m->window, m->h_buckets, m->h_xfer, m->h_logits,
                      m->h_doc_start, m->h_counted_targets, m->h_pos_runs};
    for (size_t i = 0; i < sizeof(pinned) / sizeof(pinned[0]); i++)
        if (pinned[i]) CUDA_CHECK(cudaFreeHost(pinned[i]));
    rank_parallel_free(&m->par);
    free(m->bucket_count);
    memset(m, 0, sizeof(*m));
}

/* Rows [r0, ...) of layer l's activation a (plan_act_row_offset: a tiled
 * tensor the layer does not keep holds the current tile from its start). */
static inline floatX* gact_rows(const GpuModel* m, int l, int a, int r0) { return gact(m, l, a) + plan_act_row_offset(m->plan, l, a, r0); }
static inline float* gstat_rows(const GpuModel* m, int l, int a, int r0) { return gstat(m, l, a) + plan_act_row_offset(m->plan, l, a, r0); }

/* The tiles of the current call: rows per tile, all B*T rows untiled. */
static inline int gpu_tile_tokens(const GpuModel* m) { return call_tile_tokens((size_t)m->tile_tokens, m->B * m->T); }

/* The norms of the block and the final one, as the CPU's norm_forward,
 * norm_apply and norm_backward: LayerNorm (GPT-2's kernels) or RMSNorm
 * (whose bias is absent and whose mean slots get 0). */
static void gpu_norm_forward(GpuModel* m, floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w, const floatX* b, int n) {
    if (m->cfg.norm == NORM_RMSNORM) gpu_rmsnorm_forward(out, mean, rstd, x, w, n, m->cfg.channels, m->cfg.norm_eps, m->stream);
    else gpu_layernorm_forward(out, mean, rstd, x, w, b, n, m->cfg.channels, m->stream);
}

static void gpu_norm_apply(GpuModel* m, floatX* out, const float* mean, const float* rstd, const floatX* x, const floatX* w, const floatX* b,
                           int n) {
    if (m->cfg.norm == NORM_RMSNORM) gpu_rmsnorm_apply(out, rstd, x, w, n, m->cfg.channels, m->stream);
    else gpu_layernorm_apply(out, mean, rstd, x, w, b, n, m->cfg.channels, m->stream);
}

/* dx += input gradient; dw, db += parameter gradients (floatX, or a token tile's fp32 sums; db unused by RMSNorm). */
template <typename G>
static void gpu_norm_backward(GpuModel* m, floatX* dx, G* dw, G* db, const floatX* dout, const floatX* x, const floatX* w, const float* mean,
                              const float* rstd, int n) {
    int C = m->cfg.channels;
    if (m->cfg.norm == NORM_RMSNORM) gpu_rmsnorm_backward(dx, dw, m->column_partials, dout, x, w, rstd, n, C, m->stream);
    else gpu_layernorm_backward(dx, dw, db, m->column_partials, dout, x, w, mean, rstd, n, C, m->stream);
}

/* The device document starts positions restart at (NULL: none). */
static inline const int* gpu_position_doc_start(const GpuModel* m) { return m->docs.reset_position_ids ? m->doc_start : NULL; }

/* RoPE's rows of this rank's B*T tokens (table.half 0 with learned positions). */
static RopeRows gpu_rope_rows(const GpuModel* m) {
    RopeRows r;
    memset(&r, 0, sizeof(r));
    if (m->cfg.positions != POS_ROPE) return r;
    r.table = m->rope;
    r.lay = m->layout;
    r.pos_start = gpu_position_doc_start(m);
    return r;
}

/* RoPE on rows [r0, r0+n) of qkv (row r0 at x): the Q and K heads turned by
 * each token's position; nothing with learned positions. The backward's
 * turn back rides on attention's backward (gpu_layer_attention_backward). */
static void gpu_block_rope(GpuModel* m, floatX* x, int r0, int n) {
    if (m->cfg.positions != POS_ROPE) return;
    const RopeRows rope = gpu_rope_rows(m);
    gpu_rope_rotate(x, m->w.qkv_width, &rope, r0, n, m->w.NH + m->w.NKV, 1, m->stream);
}

/* Block l up to attention, rows [r0, r0+n): the first norm, the QKV matmul
 * and RoPE (qkv holds Q and K turned: attention reads them so), from its
 * stored input x. */
static void gpu_block_forward_qkv(GpuModel* m, int l, int r0, int n) {
    int C = m->cfg.channels;
    GpuBlockTensors w = gpu_layer_params(m, l);
    floatX* ln1 = gact_rows(m, l, ACT_LN1, r0);
    floatX* qkv = gact_rows(m, l, ACT_QKV, r0);
    gpu_norm_forward(m, ln1, gstat_rows(m, l, ACT_LN1_MEAN, r0), gstat_rows(m, l, ACT_LN1_RSTD, r0), gact_rows(m, l, ACT_X, r0), w.ln1w,
                     w.ln1b, n);
    gpu_matmul_forward(&m->mm, qkv, ln1, w.qkvw, w.qkvb, NULL, n, C, m->w.qkv_width, m->stream);
    gpu_block_rope(m, qkv, r0, n);
}

/* The MLP's activation, rows of fch (n, fc_width) into out (n, F): GELU, or SwiGLU's product. */
static void gpu_block_mlp_activation(GpuModel* m, floatX* out, const floatX* fch, int n) {
    if (m->cfg.mlp == MLP_SWIGLU) gpu_swiglu_forward(out, fch, (size_t)n, m->w.F, m->stream);
    else gpu_gelu_forward(out, fch, (size_t)n * m->w.F, m->stream);
}

/* Block l after attention, rows [r0, r0+n), from x and the attention
 * output: projection, LN2, FC and GELU; `out` (the next layer's x, all
 * rows) receives the block output, or with out == NULL it stops after the
 * GELU: that is the recomputation for backward, which needs nothing later
 * than that. The residual adds ride on the matmuls (C = residual, see
 * matmul.cuh); a branch with dropout is dropped first, by a kernel of its
 * own that adds the residual. */
static void gpu_block_forward_mlp(GpuModel* m, int l, int r0, int n, floatX* out) {
    int C = m->cfg.channels;
    size_t e0 = (size_t)r0 * C;
    GpuBlockTensors w = gpu_layer_params(m, l);
    cudaStream_t s = m->stream;
    floatX* x = gact_rows(m, l, ACT_X, r0);
    floatX* res2 = gact_rows(m, l, ACT_RES2, r0);
    floatX* ln2 = gact_rows(m, l, ACT_LN2, r0);
    floatX* fch = gact_rows(m, l, ACT_FCH, r0);
    floatX* fch_gelu = gact_rows(m, l, ACT_FCH_GELU, r0);
    DropoutSite resid_attn = gpu_site(m, DROPOUT_RESID_ATTN, l), resid_mlp = gpu_site(m, DROPOUT_RESID_MLP, l);
    gpu_matmul_forward(&m->mm, res2, gact_rows(m, l, ACT_ATTY, r0), w.attprojw, w.attprojb, resid_attn.threshold ? NULL : x, n, m->w.q_width,
                       C, s);
    if (resid_attn.threshold) gpu_dropout_residual(res2, res2, x, (size_t)r0, (size_t)n, C, &m->layout, &resid_attn, s);
    gpu_norm_forward(m, ln2, gstat_rows(m, l, ACT_LN2_MEAN, r0), gstat_rows(m, l, ACT_LN2_RSTD, r0), res2, w.ln2w, w.ln2b, n);
    gpu_matmul_forward(&m->mm, fch, ln2, w.fcw, w.fcb, NULL, n, C, m->w.fc_width, s);
    gpu_block_mlp_activation(m, fch_gelu, fch, n);
    if (!out) return;
    gpu_matmul_forward(&m->mm, out + e0, fch_gelu, w.fcprojw, w.fcprojb, resid_mlp.threshold ? NULL : res2, n, m->w.F, C, s);
    if (resid_mlp.threshold) gpu_dropout_residual(out + e0, out + e0, res2, (size_t)r0, (size_t)n, C, &m->layout, &resid_mlp, s);
}

/* The device document starts attention masks with (NULL: none). */
static inline const int* gpu_attention_doc_start(const GpuModel* m) { return m->docs.reset_attention_mask ? m->doc_start : NULL; }

/* The layer's attention heads: NH query heads, NKV K/V heads of HD (block_widths; GPT-2: NKV = NH, HD = C/NH). */
static inline RingHeads gpu_model_heads(const GpuModel* m) {
    const BlockWidths w = block_widths(&m->cfg);
    return RingHeads{m->cfg.channels, w.NH, w.NKV, w.HD};
}

/* Attention of layer l on this rank's tokens: the whole sequence here, or the ring. */
static void gpu_layer_attention_forward(GpuModel* m, int l) {
    DropoutSite site = gpu_site(m, DROPOUT_ATTENTION, l), *drop = &site;
    floatX *out = gact(m, l, ACT_ATTY), *qkv = gact(m, l, ACT_QKV);
    float* lse = gstat(m, l, ACT_ATT_LSE);
    const RingHeads h = gpu_model_heads(m);
    if (m->par.cp.group_size > 1) {
        RingDocStarts docs = {gpu_attention_doc_start(m), m->h_doc_start};
        gpu_ring_attention_forward(&m->ring, &m->par.cp, m->par.ring_chunks, m->B, m->T, &h, docs, out, lse, qkv, drop, m->mg, m->stream);
    }
    else gpu_attention_forward(out, lse, qkv, m->B, m->T, h.NH, h.NKV, h.HD, drop, m->stream, gpu_attention_doc_start(m));
}

/* dqkv: the gradient of qkv before RoPE (attention's kernels, or the
 * ring's store, turn dQ and dK back: rope.cuh). */
static void gpu_layer_attention_backward(GpuModel* m, int l, floatX* dqkv, const floatX* datty) {
    DropoutSite site = gpu_site(m, DROPOUT_ATTENTION, l), *drop = &site;
    const floatX *qkv = gact(m, l, ACT_QKV), *out = gact(m, l, ACT_ATTY);
    const float* lse = gstat(m, l, ACT_ATT_LSE);
    const RingHeads h = gpu_model_heads(m);
    const RopeRows rope = gpu_rope_rows(m);
    if (m->par.cp.group_size > 1) {
        RingDocStarts docs = {gpu_attention_doc_start(m), m->h_doc_start};
        gpu_ring_attention_backward(&m->ring, &m->par.cp, m->par.ring_chunks, m->B, m->T, &h, docs, dqkv, datty, qkv, out, lse, drop, &rope,
                                    m->mg, m->stream);
    }
    else gpu_attention_backward(dqkv, m->att_rowsum, datty, qkv, out, lse, m->B, m->T, h.NH, h.NKV, h.HD, drop, m->stream,
                                gpu_attention_doc_start(m), &rope);
}

/* Block l forward from its stored input x, tile by tile but for attention;
 * out as in gpu_block_forward_mlp. */
static void gpu_block_forward(GpuModel* m, int l, floatX* out) {
    int N = m->B * m->T, K = gpu_tile_tokens(m);
    ProfKind att = out ? PROF_ATT_FORWARD : PROF_ATT_RECOMPUTE;
    for (int r0 = 0; r0 < N; r0 += K) gpu_block_forward_qkv(m, l, r0, tile_len(r0, K, N));
    prof_begin(&m->prof, att, m->stream);
    gpu_layer_attention_forward(m, l);
    prof_end(&m->prof, att, m->stream);
    for (int r0 = 0; r0 < N; r0 += K) gpu_block_forward_mlp(m, l, r0, tile_len(r0, K, N), out);
}

/* What layer l did not keep of attention's inputs, before its backward
 * (docs/DESIGN.md, -r 1 and 3: qkv, tile by tile; -r 1: attention's output
 * too), with the forward pass's own kernels and launch configurations. */
static void gpu_block_recompute_attention_inputs(GpuModel* m, int l) {
    int mode = m->plan->spec.layer_mode[l], N = m->B * m->T, K = gpu_tile_tokens(m);
    if (layer_keeps(mode, ACT_QKV)) return;
    prof_begin(&m->prof, PROF_RECOMPUTE, m->stream);
    for (int r0 = 0; r0 < N; r0 += K) gpu_block_forward_qkv(m, l, r0, tile_len(r0, K, N));
    if (!layer_keeps(mode, ACT_ATTY)) {
        prof_begin(&m->prof, PROF_ATT_RECOMPUTE, m->stream);
        gpu_layer_attention_forward(m, l);
        prof_end(&m->prof, PROF_ATT_RECOMPUTE, m->stream);
    }
    prof_end(&m->prof, PROF_RECOMPUTE, m->stream);
}

/* What layer l did not keep of rows [r0, r0+n) after attention (-r 1, 3:
 * the block from the projection to the activation; -r 2: the second norm
 * and the activation, GELU or SwiGLU's product). */
static void gpu_block_recompute_mlp(GpuModel* m, int l, int r0, int n) {
    int mode = m->plan->spec.layer_mode[l];
    if (layer_keeps(mode, ACT_LN2) && layer_keeps(mode, ACT_FCH_GELU)) return;
    prof_begin(&m->prof, PROF_RECOMPUTE, m->stream);
    if (!layer_keeps(mode, ACT_RES2)) {
        gpu_block_forward_mlp(m, l, r0, n, NULL);
    } else {
        GpuBlockTensors w = gpu_layer_params(m, l);
        if (!layer_keeps(mode, ACT_LN2))
            gpu_norm_apply(m, gact_rows(m, l, ACT_LN2, r0), gstat_rows(m, l, ACT_LN2_MEAN, r0), gstat_rows(m, l, ACT_LN2_RSTD, r0),
                           gact_rows(m, l, ACT_RES2, r0), w.ln2w, w.ln2b, n);
        if (!layer_keeps(mode, ACT_FCH_GELU)) gpu_block_mlp_activation(m, gact_rows(m, l, ACT_FCH_GELU, r0), gact_rows(m, l, ACT_FCH, r0), n);
    }
    prof_end(&m->prof, PROF_RECOMPUTE, m->stream);
}

/* LN1's output of rows [r0, r0+n) where layer l did not keep it: -r 2 from
 * the kept statistics; -r 1 and 3 again from x when another tile has been
 * through the buffer since (else it still holds these rows). */
static void gpu_block_recompute_ln1(GpuModel* m, int l, int r0, int n, int tiles) {
    int mode = m->plan->spec.layer_mode[l];
    int stats_kept = layer_keeps(mode, ACT_LN1_MEAN);
    if (layer_keeps(mode, ACT_LN1) || (!stats_kept && tiles == 1)) return;
    GpuBlockTensors w = gpu_layer_params(m, l);
    floatX *ln1 = gact_rows(m, l, ACT_LN1, r0), *x = gact_rows(m, l, ACT_X, r0);
    float *mean = gstat_rows(m, l, ACT_LN1_MEAN, r0), *rstd = gstat_rows(m, l, ACT_LN1_RSTD, r0);
    prof_begin(&m->prof, PROF_RECOMPUTE, m->stream);
    if (stats_kept) gpu_norm_apply(m, ln1, mean, rstd, x, w.ln1w, w.ln1b, n);
    else gpu_norm_forward(m, ln1, mean, rstd, x, w.ln1w, w.ln1b, n);
    prof_end(&m->prof, PROF_RECOMPUTE, m->stream);
}

/* The gradient a dropped residual branch receives, rows [r0, r0+n): dres
 * itself without dropout, else dres masked and scaled into dln, which is
 * free then. */
static const floatX* gpu_branch_grad(GpuModel* m, const DropoutSite* s, int r0, int n) {
    size_t e0 = (size_t)r0 * m->cfg.channels;
    floatX* dres = m->grad_act[GRAD_DRES] + e0;
    if (!s->threshold) return dres;
    gpu_dropout_mask(m->grad_act[GRAD_DBRANCH] + e0, dres, (size_t)r0, (size_t)n, m->cfg.channels, &m->layout, s, m->stream);
    return m->grad_act[GRAD_DBRANCH] + e0;
}

/* Layer l's weight gradient dW += dout^T inp and bias gradient over n rows
 * (block tensors w and b, indices from FIRST_BLOCK_TENSOR): untiled into
 * the floatX gradients, each written once per micro-step; with token tiles
 * into the layer's fp32 sums, tile after tile, rounded once after the
 * layer (gpu_round_tile_grads). */
static void gpu_weight_grads(GpuModel* m, int l, int w, int b, const floatX* dout, const floatX* inp, int n, int IC, int OC) {
    if (m->tile_tokens) {
        gpu_matmul_backward_weight_fp32(&m->mm, m->tile_grads.tensor[w], m->tile_grads.tensor[b], m->column_partials, dout, inp, n, IC,
                                        OC, m->stream);
        return;
    }
    GpuBlockTensors dw = gpu_layer_grads(m, l);
    gpu_matmul_backward_weight(&m->mm, dw.tensor[w], dw.tensor[b], m->column_partials, dout, inp, n, IC, OC, m->stream);
}

/* The norm's backward over n rows: dx += input gradient, and layer l's
 * parameter gradients (block tensors w and b) as in gpu_weight_grads. */
static void gpu_norm_grads(GpuModel* m, int l, int w, int b, floatX* dx, const floatX* dout, const floatX* x, const floatX* weight,
                           const float* mean, const float* rstd, int n) {
    if (m->tile_tokens) {
        gpu_norm_backward(m, dx, m->tile_grads.tensor[w], m->tile_grads.tensor[b], dout, x, weight, mean, rstd, n);
        return;
    }
    GpuBlockTensors dw = gpu_layer_grads(m, l);
    gpu_norm_backward(m, dx, dw.tensor[w], dw.tensor[b], dout, x, weight, mean, rstd, n);
}
#define BT(t) ((t) - FIRST_BLOCK_TENSOR) /* a block tensor's index in GpuBlockTensors */

/* Rows [r0, r0+n) of the block's backward after its output (with what it
 * did not keep of them recomputed first): the MLP, LN2 and the attention
 * projection, down to the gradient of attention's output; dres (N,C) rows
 * go from the gradient w.r.t. the block output to that w.r.t. the
 * attention residual. */
static void gpu_block_backward_mlp(GpuModel* m, int l, int r0, int n, floatX* datty) {
    int C = m->cfg.channels;
    GpuBlockTensors w = gpu_layer_params(m, l);
    cudaStream_t s = m->stream;
    MatmulContext* mm = &m->mm;
    floatX* dres = m->grad_act[GRAD_DRES] + (size_t)r0 * C;
    floatX* dln = m->grad_act[GRAD_DLN] + (size_t)r0 * C;
    int F = m->w.F, FC = m->w.fc_width, Q = m->w.q_width;
    floatX* fch_gelu = gact_rows(m, l, ACT_FCH_GELU, r0);
    floatX* dact = gact_rows(m, l, ACT_DFCH, r0); /* over the activation's output, once its weight gradient has read it */
    /* the FC output's gradient: GELU's in place over dact; SwiGLU's (gate and up) over fch itself */
    floatX* dfch = m->cfg.mlp == MLP_SWIGLU ? gact_rows(m, l, ACT_FCH, r0) : dact;
    DropoutSite resid_attn = gpu_site(m, DROPOUT_RESID_ATTN, l), resid_mlp = gpu_site(m, DROPOUT_RESID_MLP, l);
    gpu_block_recompute_mlp(m, l, r0, n);
    const floatX* dbranch = gpu_branch_grad(m, &resid_mlp, r0, n);
    gpu_weight_grads(m, l, BT(P_FCPROJW), BT(P_FCPROJB), dbranch, fch_gelu, n, F, C);
    gpu_matmul_backward_input(mm, dact, dbranch, w.fcprojw, n, F, C, s);
    if (m->cfg.mlp == MLP_SWIGLU) gpu_swiglu_backward(dfch, dact, (size_t)n, F, s);
    else gpu_gelu_backward(dfch, gact_rows(m, l, ACT_FCH, r0), (size_t)n * F, s);
    gpu_matmul_backward_input(mm, dln, dfch, w.fcw, n, C, FC, s);
    gpu_weight_grads(m, l, BT(P_FCW), BT(P_FCB), dfch, gact_rows(m, l, ACT_LN2, r0), n, C, FC);
    gpu_norm_grads(m, l, BT(P_LN2W), BT(P_LN2B), dres, dln, gact_rows(m, l, ACT_RES2, r0), w.ln2w, gstat_rows(m, l, ACT_LN2_MEAN, r0),
                   gstat_rows(m, l, ACT_LN2_RSTD, r0), n);
    dbranch = gpu_branch_grad(m, &resid_attn, r0, n);
    gpu_matmul_backward_input(mm, datty + (size_t)r0 * Q, dbranch, w.attprojw, n, Q, C, s);
    gpu_weight_grads(m, l, BT(P_ATTPROJW), BT(P_ATTPROJB), dbranch, gact_rows(m, l, ACT_ATTY, r0), n, Q, C);
}

/* Rows [r0, r0+n) of the block's backward below attention (whose dqkv is
 * already the gradient before RoPE): the QKV matmul and the first norm;
 * dres rows become the gradient w.r.t. the block input x. */
static void gpu_block_backward_qkv(GpuModel* m, int l, int r0, int n, int tiles, floatX* dqkv) {
    int C = m->cfg.channels, QKV = m->w.qkv_width;
    GpuBlockTensors w = gpu_layer_params(m, l);
    floatX* dres = m->grad_act[GRAD_DRES] + (size_t)r0 * C;
    floatX* dln = m->grad_act[GRAD_DLN] + (size_t)r0 * C;
    dqkv += (size_t)r0 * QKV;
    gpu_block_recompute_ln1(m, l, r0, n, tiles);
    gpu_matmul_backward_input(&m->mm, dln, dqkv, w.qkvw, n, C, QKV, m->stream);
    gpu_weight_grads(m, l, BT(P_QKVW), BT(P_QKVB), dqkv, gact_rows(m, l, ACT_LN1, r0), n, C, QKV);
    gpu_norm_grads(m, l, BT(P_LN1W), BT(P_LN1B), dres, dln, gact_rows(m, l, ACT_X, r0), w.ln1w, gstat_rows(m, l, ACT_LN1_MEAN, r0),
                   gstat_rows(m, l, ACT_LN1_RSTD, r0), n);
}

/* The device gradients of one group, layer l's 12 tensors or with -1 those
 * outside the blocks (model.h's param_group_slices, in its order), those of
 * parameters [lo, hi) only, as slices of *base (llmc/cuda/grad_accum.cuh):
 * the whole buffer at the parameters' offsets, or with slots layer l's slot
 * (gpu_slot_at) and grads at gpu_grad_index. Empty slices are left out. */
static GradSlices gpu_grad_group(const GpuModel* m, int layer, size_t lo, size_t hi, floatX** base) {
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    size_t off[NUM_PARAM_TENSORS], cnt[NUM_PARAM_TENSORS];
    int n = param_group_slices(&pl, m->cfg.num_layers, layer, off, cnt), in_slot = m->num_grad_slots && layer >= 0;
    *base = in_slot ? gpu_grad_slot(m, layer) : m->grads;
    GradSlices s;
    memset(&s, 0, sizeof(s));
    for (int j = 0; j < n; j++) { /* a layer's slices are its block tensors in order: slice j is tensor j's */
        size_t a = off[j] > lo ? off[j] : lo, b = off[j] + cnt[j] < hi ? off[j] + cnt[j] : hi;
        if (a >= b) continue;
        s.offset[s.n] = in_slot ? gpu_slot_at(m, layer, j) + (a - off[j]) : gpu_grad_index(m, a);
        s.count[s.n++] = b - a;
    }
    return s;
}

/* Token tiles: layer l's fp32 gradient sums added into its floatX
 * gradients, one rounding per micro-step (grad_accum.cuh). */
static void gpu_round_tile_grads(GpuModel* m, int l) {
    if (!m->tile_tokens) return;
    floatX* base;
    GradSlices s = gpu_grad_group(m, l, 0, m->plan->num_params, &base);
    gpu_grad_round_layer(base, m->tile_grads.tensor[0], &s, m->stream);
}

/* Layer l's recompute and backward: attention's inputs whole (qkv, with -r 1
 * attention's output too), then tile by tile the MLP down to the gradient of
 * attention's output, attention's backward, and tile by tile QKV and LN1;
 * weight gradients add up over the tiles in row order in fp32. Untiled, the
 * gradients of attention's output and of qkv go over the layer's res2 and
 * fch (plan.h), whose last readers are done by then, where those are wide
 * enough (else into buffers of their own, as with tiles).
 * dres (N,C): gradient w.r.t. the block output on entry, w.r.t. x on exit. */
static void gpu_block_backward(GpuModel* m, int l) {
    int N = m->B * m->T, K = gpu_tile_tokens(m), tiles = (N + K - 1) / K;
    floatX* datty = m->whole_datty ? m->whole_datty : gact(m, l, ACT_DATTY);
    floatX* dqkv = m->whole_dqkv ? m->whole_dqkv : gact(m, l, ACT_DQKV);
    if (m->tile_tokens)
        CUDA_CHECK(cudaMemsetAsync(m->tile_grads.tensor[0], 0, m->plan->tile_grads_count * sizeof(float), m->stream));
    gpu_block_recompute_attention_inputs(m, l);
    for (int r0 = 0; r0 < N; r0 += K) gpu_block_backward_mlp(m, l, r0, tile_len(r0, K, N), datty);
    prof_begin(&m->prof, PROF_ATT_BACKWARD, m->stream);
    gpu_layer_attention_backward(m, l, dqkv, datty);
    prof_end(&m->prof, PROF_ATT_BACKWARD, m->stream);
    for (int r0 = 0; r0 < N; r0 += K) gpu_block_backward_qkv(m, l, r0, tile_len(r0, K, N), tiles, dqkv);
    gpu_round_tile_grads(m, l);
}

/* --offload-optimizer with one process: the last step's deferred update up
 * to group g (0: the embeddings, 1 + l: layer l, L + 1: the final norm and
 * head), before anything reads those parameters (optimizer_offload.cuh). */
static void gpu_offload_update_until(GpuModel* m, int g) {
    if (!m->oo.pending) return;
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    optimizer_offload_update_until(&m->oo, &pl, m->cfg.num_layers, g, m->params, m->par.shard_start,
                                   m->par.shard_start + m->par.shard_count, m->stream);
}

/* The whole deferred update, before the state is read or written other than
 * by a forward: checkpoints (the preemption's too), the model written or
 * checked for finite values at the end of training (all through gpu_transfer). */
static void gpu_offload_flush(GpuModel* m) { gpu_offload_update_until(m, optimizer_offload_groups(m->cfg.num_layers) - 1); }

/* Embeddings (dropped in place: layer 0's x holds the dropped sum), all
 * blocks, final LayerNorm, for the B*T tokens in inputs. An offloaded
 * layer's tensors go to the host on the copy stream after its block, and a
 * staging slot is written only once its last copy out is done. With the
 * optimizer offloaded, each group of the deferred update runs just before
 * the first forward that reads it (the step's, an evaluation's, a sample's):
 * this is the one place a layer's forward begins for the first time. */
static void gpu_model_forward(GpuModel* m) {
    int L = m->cfg.num_layers, C = m->cfg.channels, N = m->B * m->T;
    DropoutSite embd = gpu_site(m, DROPOUT_EMBEDDING, 0);
    nvtx_renew_dead_buffers(m->plan, m->arena); /* last pass's activations and scratch: unwritten again for a checker */
    prof_begin(&m->prof, PROF_FORWARD, m->stream);
    offload_acquire(&m->off, 0);
    gpu_offload_update_until(m, 0);
    gpu_encoder_forward(gact(m, 0, ACT_X), m->inputs, m->p.wte, m->cfg.positions == POS_LEARNED ? m->p.wpe : NULL, m->B, C, &m->layout,
                        m->stream, gpu_position_doc_start(m));
    if (embd.threshold) gpu_dropout_mask(gact(m, 0, ACT_X), gact(m, 0, ACT_X), 0, (size_t)N, C, &m->layout, &embd, m->stream);
    for (int l = 0; l < L; l++) {
        if (l + 1 < L) offload_acquire(&m->off, l + 1);
        gpu_offload_update_until(m, 1 + l);
        gpu_block_forward(m, l, l + 1 < L ? gact(m, l + 1, ACT_X) : m->final_res);
        offload_forward_done(&m->off, l, m->B, m->T);
    }
    gpu_offload_update_until(m, L + 1); /* the final norm and an untied head */
    gpu_norm_forward(m, m->lnf, m->lnf_mean, m->lnf_rstd, m->final_res, m->p.lnfw, m->cfg.bias & BIAS_NORM ? m->p.lnfb : NULL, N);
    prof_end(&m->prof, PROF_FORWARD, m->stream);
}

/* Logits, loss and (with dloss_per_token != 0) the classifier backward, a
 * chunk of rows at a time: logits (rows,Vp) = lnf @ head^T (wte, or the
 * untied lm_head), never all of
 * (N,Vp) at once. Writes per-token losses; dlnf goes to the dln buffer. */
static void gpu_classifier(GpuModel* m, float dloss_per_token) {
    int C = m->cfg.channels, V = m->cfg.vocab_size, Vp = m->cfg.padded_vocab_size, N = m->B * m->T;
    prof_begin(&m->prof, PROF_CLASSIFIER, m->stream);
    for (int r0 = 0; r0 < N; r0 += m->logits_rows) {
        int rows = r0 + m->logits_rows <= N ? m->logits_rows : N - r0;
        const floatX* lnf = m->lnf + (size_t)r0 * C;
        gpu_matmul_forward(&m->mm, m->logits, lnf, gpu_head_weights(m), NULL, NULL, rows, C, Vp, m->stream);
        gpu_classifier_fused(m->logits, m->losses + r0, m->targets + r0, rows, V, Vp, dloss_per_token, m->stream);
        if (dloss_per_token == 0.0f) { gpu_classifier_top1(m->logits, m->top1 + r0, rows, V, Vp, m->stream); continue; }
        gpu_matmul_backward_input(&m->mm, m->grad_act[GRAD_DLN] + (size_t)r0 * C, m->logits, gpu_head_weights(m), rows, C, Vp, m->stream);
        if (m->head_grad_fp32) gpu_matmul_backward_weight_fp32(&m->mm, m->head_grad_fp32, NULL, NULL, m->logits, lnf, rows, C, Vp, m->stream);
        else gpu_matmul_backward_weight(&m->mm, gpu_head_grads(m), NULL, NULL, m->logits, lnf, rows, C, Vp, m->stream);
    }
    prof_end(&m->prof, PROF_CLASSIFIER, m->stream);
}

/* Mean of the per-token losses over those that count (--eod-mask-loss:
 * not where the input is end of text; 0 when none does), summed on the host
 * in double like the CPU. */
static float gpu_mean_loss(GpuModel* m, const int* inputs) {
    int N = m->B * m->T, counted = 0;
    CUDA_CHECK(cudaMemcpyAsync(m->h_losses, m->losses, (size_t)N * sizeof(float), cudaMemcpyDeviceToHost, m->stream));
    gpu_wait(m);
    double sum = 0;
    for (int i = 0; i < N; i++) {
        if (m->docs.eod_mask_loss && inputs[i] == m->docs.eot_token) continue;
        sum += (double)m->h_losses[i];
        counted++;
    }
    return counted ? (float)(sum / counted) : 0.0f;
}

/* The fp32 sums of one group of gradients (layer l's, or with -1 the
 * embeddings' and the final LayerNorm's), once they are final for this
 * micro-step (grad_accum.cuh). With slots (one micro-step) only the
 * classifier's table, outside the blocks, has a sum: in grads at
 * gpu_grad_index, as its slices are. */
static void gpu_fold_grads(GpuModel* m, int layer) {
    if (!m->grads_fp32 || (m->num_grad_slots && layer >= 0)) return;
    floatX* base;
    GradSlices s = gpu_grad_group(m, layer, 0, m->plan->num_params, &base);
    gpu_grad_fold(m->grads_fp32, gpu_grad_index(m, m->grads_fp32_first), m->grads_fp32_count, base, &s, m->last_micro_step, m->stream);
}

/* Segment checkpointing (plan.h): layers first..last run forward again from
 * the segment's kept input with the forward's own block functions, so each
 * layer's slot holds what its mode keeps, bit for bit what the step's
 * forward wrote; the last layer stops once its kept tensors are written. */
static void gpu_segment_forward_again(GpuModel* m, int first, int last) {
    prof_begin(&m->prof, PROF_RECOMPUTE, m->stream);
    for (int l = first; l < last; l++) gpu_block_forward(m, l, gact(m, l + 1, ACT_X));
    int mode = m->plan->spec.layer_mode[last], N = m->B * m->T, K = gpu_tile_tokens(m);
    if (layer_keeps(mode, ACT_RES2)) gpu_block_forward(m, last, NULL); /* what it keeps runs through the MLP */
    else if (layer_keeps(mode, ACT_ATTY)) {                               /* -r 3: up to attention's output; -r 1 keeps x alone */
        for (int r0 = 0; r0 < N; r0 += K) gpu_block_forward_qkv(m, last, r0, tile_len(r0, K, N));
        gpu_layer_attention_forward(m, last);
    }
    prof_end(&m->prof, PROF_RECOMPUTE, m->stream);
}

/* Slots: before layer l's backward, its slot once the copy down of the
 * layer R above is done, zeroed (as the whole buffer is at the step's start). */
static void gpu_take_grad_slot(GpuModel* m, int l) {
    if (!m->num_grad_slots) return;
    optimizer_offload_slot_free(&m->oo, gpu_grad_slot_of(m, l), m->stream);
    CUDA_CHECK(cudaMemsetAsync(gpu_grad_slot(m, l), 0, m->grad_slot_count * sizeof(floatX), m->stream));
}

/* --offload-optimizer: layer l's final gradients (this rank's shard, once
 * reduced) down while the layers below run (optimizer_offload.cuh); with
 * slots, their squared norm first, while the slot holds them
 * (global_norm.cuh: layer l's group). */
static void gpu_offload_layer_grads(GpuModel* m, int l) {
    cudaStream_t final_on;
    if (!multigpu_grads_final_on(m->mg, m->stream, &final_on)) return; /* reduced at the update: all go down then */
    size_t lo = m->par.shard_start, hi = m->par.shard_start + m->par.shard_count;
    if (m->num_grad_slots) {
        floatX* base;
        GradSlices s = gpu_grad_group(m, l, lo, hi, &base);
        gpu_norm_group(m->norm_partials, l, base, &s, m->stream);
    }
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    GpuBlockTensors g = gpu_layer_grads(m, l);
    optimizer_offload_layer_down(&m->oo, &pl, m->cfg.num_layers, l, g.tensor, m->num_grad_slots ? gpu_grad_slot_of(m, l) : -1, lo, hi,
                                 final_on);
}

static void gpu_model_backward(GpuModel* m) {
    int C = m->cfg.channels, N = m->B * m->T;
    floatX* dres = m->grad_act[GRAD_DRES];
    prof_begin(&m->prof, PROF_BACKWARD, m->stream);
    CUDA_CHECK(cudaMemsetAsync(dres, 0, (size_t)N * C * sizeof(floatX), m->stream));
    gpu_norm_backward(m, dres, m->g.lnfw, m->cfg.bias & BIAS_NORM ? m->g.lnfb : NULL, m->grad_act[GRAD_DLN], m->final_res, m->p.lnfw,
                      m->lnf_mean, m->lnf_rstd, N);
    int L = m->cfg.num_layers, K = plan_segment_layers(&m->plan->spec);
    if (L > 0) offload_prefetch(&m->off, (L - 1) / K * K, m->B, m->T);
    for (int top = L - 1; top >= 0; top = top / K * K - 1) { /* segment by segment (K = 1: layer by layer) */
        int first = top / K * K;
        if (first > 0) offload_prefetch(&m->off, first - K, m->B, m->T); /* under this segment's recompute and backward */
        offload_ready(&m->off, first);
        if (K > 1 && top < L - 1) gpu_segment_forward_again(m, first, top);
        for (int l = top; l >= first; l--) {
            gpu_take_grad_slot(m, l);
            gpu_block_backward(m, l);
            if (l == first) offload_release(&m->off, first, m->B, m->T);
            gpu_fold_grads(m, l);
            multigpu_grads_ready(m->mg, m->grads, l, m->stream); /* last micro-step: layer l's gradients to NCCL now */
            if (m->last_micro_step) gpu_offload_layer_grads(m, l);
        }
    }
    DropoutSite embd = gpu_site(m, DROPOUT_EMBEDDING, 0);
    if (embd.threshold) gpu_dropout_mask(dres, dres, 0, (size_t)N, C, &m->layout, &embd, m->stream);
    /* the column partials are idle now: the wte gradient's hot-token segment sums go there */
    const int* runs = m->docs.reset_position_ids ? m->pos_runs : NULL;
    floatX* dwpe = m->cfg.positions == POS_LEARNED ? m->g.wpe : NULL; /* RoPE: no position table */
    if (m->wte_grad_fp32)
        gpu_encoder_backward(m->grads_fp32, dwpe, dres, m->token_buckets, &m->buckets, m->column_partials, m->B, C, &m->layout, m->stream,
                             runs, m->pos_run_count, m->pos_run_positions);
    else gpu_encoder_backward(m->g.wte, dwpe, dres, m->token_buckets, &m->buckets, m->column_partials, m->B, C, &m->layout, m->stream,
                              runs, m->pos_run_count, m->pos_run_positions);
    gpu_fold_grads(m, -1);
    multigpu_grads_ready(m->mg, m->grads, -1, m->stream); /* wte, wpe, lnf */
    offload_finish(&m->off);
    prof_end(&m->prof, PROF_BACKWARD, m->stream);
}

/* Copies the (B, T) host tokens of the current call to the device (targets
 * may be NULL: sampling has none). The host buffers are the Backend's pinned
 * inputs/targets, or anything the caller keeps alive until the stream has
 * read them. */
static void gpu_upload_tokens(GpuModel* m, const int* inputs, const int* targets) {
    size_t N = (size_t)m->B * m->T, bytes = N * sizeof(int);
    CUDA_CHECK(cudaMemcpyAsync(m->inputs, inputs, bytes, cudaMemcpyHostToDevice, m->stream));
    if (targets && m->docs.eod_mask_loss) { /* the classifier's mark of a row whose loss does not count: target -1 */
        for (size_t i = 0; i < N; i++) m->h_counted_targets[i] = inputs[i] == m->docs.eot_token ? -1 : targets[i];
        targets = m->h_counted_targets;
    }
    if (targets) CUDA_CHECK(cudaMemcpyAsync(m->targets, targets, bytes, cudaMemcpyHostToDevice, m->stream));
    if (!documents_need_starts(&m->docs)) return;
    CUDA_CHECK(cudaMemcpyAsync(m->doc_start, m->h_doc_start, bytes, cudaMemcpyHostToDevice, m->stream));
    if (!m->docs.reset_position_ids) return;
    m->pos_run_count = encoder_position_runs(m->h_pos_runs, m->h_doc_start, &m->layout, m->B, &m->pos_run_positions);
    CUDA_CHECK(cudaMemcpyAsync(m->pos_runs, m->h_pos_runs, (size_t)m->pos_run_count * 3 * sizeof(int), cudaMemcpyHostToDevice, m->stream));
}

/* Packed documents (llmc/core/documents.h): what the passes after it mask; the
 * host buffers are made on the first call that needs them; the device ones
 * are the plan's (spec.documents, from the same flags). */
static void gpu_set_documents(void* ctx, const DocumentOptions* d) {
    GpuModel* m = (GpuModel*)ctx;
    m->docs = *d;
    size_t N = (size_t)m->plan->spec.B * plan_local_T(&m->plan->spec);
    if (d->eod_mask_loss && !m->h_counted_targets) m->h_counted_targets = (int*)pinned_alloc(N * sizeof(int), "counted targets");
    const MemoryPlan* p = m->plan;
    if (documents_need_starts(d) && !m->doc_start) {
        if (!(p->spec.documents & PLAN_DOC_STARTS)) fail("internal: the plan has no device buffer for the document starts");
        m->doc_start = (int*)(m->arena + p->off_doc_start);
    }
    if (d->reset_position_ids && !m->pos_runs) {
        if (!(p->spec.documents & PLAN_DOC_POSITIONS)) fail("internal: the plan has no device buffer for the position runs");
        m->h_pos_runs = (int*)pinned_alloc(3 * (size_t)N * sizeof(int), "position runs");
        m->pos_runs = (int*)(m->arena + p->off_pos_runs);
    }
}

/* ------------------------------------------------------------------------ */
/* optimizer                                                                  */

/* Norm over this rank's shard (all parameters without ZeRO), summed across
 * ranks when the gradients are sharded (only the shard's are summed here):
 * group by group, layers 0..L-1 and then the tensors outside the blocks
 * (global_norm.cuh says why); with slots the layers' sums were taken during
 * the backward (gpu_offload_layer_grads). */
static float gpu_grad_norm(void* ctx) {
    GpuModel* m = (GpuModel*)ctx;
    int L = m->cfg.num_layers;
    size_t lo = m->par.shard_start, hi = m->par.shard_start + m->par.shard_count;
    prof_begin(&m->prof, PROF_UPDATE, m->stream);
    for (int g = m->num_grad_slots ? L : 0; g <= L; g++) {
        floatX* base;
        GradSlices s = gpu_grad_group(m, g < L ? g : -1, lo, hi, &base);
        gpu_norm_group(m->norm_partials, g, base, &s, m->stream);
    }
    gpu_norm_total(m->norm_partials, L + 1, m->stream);
    prof_end(&m->prof, PROF_UPDATE, m->stream);
    gpu_wait(m); /* first: a copy into pageable memory would block on the reduction without watching NCCL */
    float sumsq = 0.0f;
    CUDA_CHECK(cudaMemcpy(&sumsq, m->norm_partials + NORM_BLOCKS, sizeof(float), cudaMemcpyDeviceToHost));
    double total = (double)sumsq;
    if (m->par.zero) total = proc_sum(total, "the gradient norm sum");
    return (float)sqrt(total);
}

static void gpu_update(void* ctx, const AdamWStep* s) {
    GpuModel* m = (GpuModel*)ctx;
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    size_t lo = m->par.shard_start, hi = m->par.shard_start + m->par.shard_count; /* this rank's parameters */
    prof_begin(&m->prof, PROF_UPDATE, m->stream);
    if (m->oo.on) {
        optimizer_offload_grads_down(&m->oo, &pl, m->cfg.num_layers, m->g.tensor, lo, hi, m->stream);
        if (!optimizer_offload_defer(&m->oo, s, m->seed)) gpu_offload_flush(m); /* one process: the next forward runs it */
    }
    for (int t = 0; !m->oo.on && t < NUM_PARAM_TENSORS; t++) {
        size_t off, end;
        if (!shard_slice(&pl, t, lo, hi, &off, &end)) continue;
        float wd = param_is_decayed(t) ? s->weight_decay : 0.0f;
        size_t k = off - lo; /* index into this rank's master weights and moments */
        gpu_adamw(m->params + off, m->master ? m->master + k : NULL, m->grads + off, m->adam_m + k, m->adam_v + k,
                  end - off, off, s->lr, s->beta1, s->beta2, s->bias_corr1, s->bias_corr2, s->eps, wd, s->grad_scale, m->seed, s->t,
                  m->stream);
    }
    multigpu_gather_params(m->mg, m->params, m->stream); /* ZeRO-1: every rank's updated shard to every rank */
    prof_end(&m->prof, PROF_UPDATE, m->stream);
    gpu_wait(m); /* the step time printed includes the update (deferred: its copy down; the next step's forward the rest) */
}

/* ------------------------------------------------------------------------ */
/* backend                                                                    */

static float gpu_forward_backward(void* ctx, const MicroBatch* mb, float dloss_mean) {
    GpuModel* m = (GpuModel*)ctx;
    m->drop = &m->train_dropout;
    gpu_set_shape(m, m->plan->spec.B, plan_local_T(&m->plan->spec));
    int N = m->B * m->T;
    m->last_micro_step = mb->micro_step == mb->num_micro_steps - 1;
    if (m->last_micro_step) optimizer_offload_backward_begins(&m->oo);
    multigpu_micro_step(m->mg, m->last_micro_step); /* the last one reduces gradients during its backward */
    gpu_upload_tokens(m, mb->inputs, mb->targets);
    m->buckets = encoder_build_buckets(m->h_buckets, m->bucket_count, mb->inputs, N, m->cfg.vocab_size);
    CUDA_CHECK(cudaMemcpyAsync(m->token_buckets, m->h_buckets, (size_t)m->buckets.ints * sizeof(int),
                               cudaMemcpyHostToDevice, m->stream));
    gpu_model_forward(m);
    gpu_classifier(m, dloss_mean / (float)N);
    gpu_model_backward(m);
    float loss = gpu_mean_loss(m, mb->inputs); /* waits for the stream */
    prof_read_back(&m->prof);
    return loss;
}

static void gpu_set_dropout(void* ctx, const DropoutState* d) { ((GpuModel*)ctx)->train_dropout = *d; }

static float gpu_forward_loss(void* ctx, const int* inputs, const int* targets) {
    GpuModel* m = (GpuModel*)ctx;
    m->drop = &dropout_off;
    gpu_set_shape(m, m->plan->spec.B, plan_local_T(&m->plan->spec));
    gpu_upload_tokens(m, inputs, targets);
    gpu_model_forward(m);
    offload_finish(&m->off);
    gpu_classifier(m, 0.0f);
    return gpu_mean_loss(m, inputs);
}

/* The per-token losses gpu_mean_loss copied to the host. */
static void gpu_token_losses(void* ctx, float* out) {
    GpuModel* m = (GpuModel*)ctx;
    memcpy(out, m->h_losses, (size_t)m->B * m->T * sizeof(float));
}

/* The top-1 tokens of the last forward_loss, to the host. */
static void gpu_token_top1(void* ctx, int* out) {
    GpuModel* m = (GpuModel*)ctx;
    CUDA_CHECK(cudaMemcpyAsync(out, m->top1, (size_t)m->B * m->T * sizeof(int), cudaMemcpyDeviceToHost, m->stream));
    gpu_wait(m);
}

static size_t gpu_memory_bytes(void* ctx) {
    (void)ctx;
    return gpu_used_memory();
}

/* The sequence length a sampling forward of len tokens runs at: len rounded
 * up to a power of two (at least 64), at most the plan's T. Every distinct
 * length is a new set of matmul shapes for cuBLASLt's algorithm cache; with
 * buckets, sampling at every prefix length adds about log2(T/64) sets instead
 * of T, and training's entries stay cached. Causal attention makes the
 * padding invisible at position len-1. */
static int sampling_length(int len, int T_max) {
    int t = 64;
    while (t < len) t *= 2;
    return t < T_max ? t : T_max;
}

/* Softmax over V of the logits of local row `row` of the last forward. */
static void gpu_row_probs(GpuModel* m, int row, float* probs) {
    int C = m->cfg.channels, V = m->cfg.vocab_size, Vp = m->cfg.padded_vocab_size;
    gpu_matmul_forward(&m->mm, m->logits, m->lnf + (size_t)row * C, gpu_head_weights(m), NULL, NULL, 1, C, Vp, m->stream);
    CUDA_CHECK(cudaMemcpyAsync(m->h_logits, m->logits, (size_t)Vp * sizeof(floatX), cudaMemcpyDeviceToHost, m->stream));
    gpu_wait(m);
    float mx = host_floatX_load(m->h_logits, 0);
    for (int v = 1; v < V; v++) mx = fmaxf(mx, host_floatX_load(m->h_logits, (size_t)v));
    float sum = 0.0f;
    for (int v = 0; v < V; v++) {
        probs[v] = expf(host_floatX_load(m->h_logits, (size_t)v) - mx);
        sum += probs[v];
    }
    for (int v = 0; v < V; v++) probs[v] /= sum;
}

/* Runs the model on one sequence of len tokens (B=1, a prefix of the planned
 * buffers, padded with token 0 to sampling_length) and returns softmax
 * probabilities at position len-1. Under context parallelism every member of
 * the group calls it, as on the CPU: the padded sequence (also a multiple of
 * 2N tokens, which the plan's T is) is cut into chunks as in training, and
 * the member holding position len-1 sends the probabilities to the others. */
static void gpu_next_token_probs(void* ctx, const int* tokens, int len, float* probs) {
    GpuModel* m = (GpuModel*)ctx;
    int V = m->cfg.vocab_size, N = m->par.cp.group_size;
    int T = sampling_length(len, m->plan->spec.T);
    if (N > 1) T = ring_padded_length(T, N);
    gpu_set_shape(m, 1, T / N);
    sampling_rows(&m->layout, m->docs.reset_attention_mask ? m->par.ring_chunks : NULL, tokens, len, T,
                  documents_need_starts(&m->docs) ? m->docs.eot_token : -1, m->h_inputs, m->h_doc_start);
    int row = len - 1, owner = N > 1 ? ring_position_owner(len - 1, m->T, N, m->par.ring_chunks, &row) : 0;
    m->drop = &dropout_off;
    gpu_upload_tokens(m, m->h_inputs, NULL);
    gpu_model_forward(m);
    offload_finish(&m->off);
    if (owner == m->par.cp.member) gpu_row_probs(m, row, probs);
    else gpu_wait(m);
    proc_ring_broadcast(probs, (size_t)V * sizeof(float), owner);
}

static void gpu_zero_grads(void* ctx) {
    GpuModel* m = (GpuModel*)ctx;
    multigpu_new_step(m->mg);
    optimizer_offload_main_waits(&m->oo, m->stream);
    CUDA_CHECK(cudaMemsetAsync(m->grads, 0, m->grad_count * sizeof(floatX), m->stream)); /* slots: as each layer takes its own */
    if (m->grads_fp32) CUDA_CHECK(cudaMemsetAsync(m->grads_fp32, 0, m->grads_fp32_count * sizeof(float), m->stream));
}

/* --offload-optimizer: a state tensor other than the parameters is in the
 * pinned pool already: read or written there, no device round trip. */
static void gpu_transfer_host_optimizer(GpuModel* m, int tensor, size_t start, size_t n, float* host, int to_host) {
    float* src = tensor == TENSOR_MASTER ? m->oo.master : tensor == TENSOR_ADAM_M ? m->oo.m : m->oo.v;
    if (!src) fail("this run keeps no fp32 master weights (-w 0, or an FP32 build)");
    if (start < m->par.shard_start || start + n > m->par.shard_start + m->par.shard_count)
        fail("optimizer state range outside this rank's shard");
    src += start - m->par.shard_start;
    if (to_host) memcpy(host, src, n * sizeof(float));
    else memcpy(src, host, n * sizeof(float));
}

/* Moves n fp32 values of a state tensor between the host and the device.
 * Parameters are converted to and from floatX on the host (round to nearest
 * even); loading parameters also sets the master weights to the given fp32
 * values. Master weights and AdamW moments are fp32 on both sides. */
static void gpu_transfer(void* ctx, int tensor, size_t start, size_t n, float* host, int to_host) {
    GpuModel* m = (GpuModel*)ctx;
    if (n > m->plan->spec.io_chunk_floats) fail("internal: transfer of %zu values exceeds the staging buffer", n);
    cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    gpu_offload_flush(m); /* checkpoints (the preemption's too) read the state after the last step's update */
    gpu_wait(m);
    if (tensor == TENSOR_PARAMS) {
        floatX* dev = m->params + start;
        if (to_host) {
            CUDA_CHECK(cudaMemcpy(m->h_xfer, dev, n * sizeof(floatX), kind));
            for (size_t i = 0; i < n; i++) host[i] = host_floatX_load(m->h_xfer, i);
            return;
        }
        for (size_t i = 0; i < n; i++) host_floatX_store(m->h_xfer, i, host[i]);
        CUDA_CHECK(cudaMemcpy(dev, m->h_xfer, n * sizeof(floatX), kind));
        if (m->oo.on) optimizer_offload_load(&m->oo, m->par.shard_start, m->par.shard_start + m->par.shard_count, start, n, host);
        if (!m->master) return;
        size_t lo = start > m->par.shard_start ? start : m->par.shard_start; /* master weights: this rank's shard only */
        size_t hi = start + n < m->par.shard_start + m->par.shard_count ? start + n : m->par.shard_start + m->par.shard_count;
        if (lo < hi) CUDA_CHECK(cudaMemcpy(m->master + (lo - m->par.shard_start), host + (lo - start), (hi - lo) * sizeof(float), kind));
        return;
    }
    float* dev = NULL;
    if (m->oo.on) { gpu_transfer_host_optimizer(m, tensor, start, n, host, to_host); return; }
    if (tensor == TENSOR_MASTER) {
        if (!m->master) fail("this run keeps no fp32 master weights (-w 0, or an FP32 build)");
        dev = m->master;
    } else {
        dev = tensor == TENSOR_ADAM_M ? m->adam_m : m->adam_v;
    }
    /* `start` is a global parameter index inside this rank's shard */
    if (start < m->par.shard_start || start + n > m->par.shard_start + m->par.shard_count)
        fail("optimizer state range outside this rank's shard");
    dev += start - m->par.shard_start;
    if (to_host) CUDA_CHECK(cudaMemcpy(host, dev, n * sizeof(float), kind));
    else CUDA_CHECK(cudaMemcpy(dev, host, n * sizeof(float), kind));
}

/* After the last micro-step: every rank's gradients summed (or, ZeRO-1, each
 * shard's onto its rank), the per-layer reductions of the backward included. */
static void gpu_sync_grads(void* ctx) {
    GpuModel* m = (GpuModel*)ctx;
    prof_begin(&m->prof, PROF_SYNC, m->stream);
    multigpu_sync_grads(m->mg, m->grads, m->stream);
    prof_end(&m->prof, PROF_SYNC, m->stream);
}

/* Model FLOPs, PaLM convention (Chowdhery et al. 2022, appendix B): per token
 * 6*N + 12*L*C*T, with N the parameters minus the position table (the token
 * table counts: it is the LM head's weight too), 6*N for the matmuls of
 * forward (2N) and backward (4N), 12*L*C*T for attention's QK^T and PV over
 * the full T x T (no halving for the causal mask). Recomputation is not
 * counted: MFU measures useful model FLOPs, not hardware FLOPs. */
static double model_flops_per_token(const ModelConfig* c, size_t num_params, int T) {
    ParamLayout pl;
    param_layout(c, &pl);
    double N = (double)num_params - (double)pl.count[P_WPE];
    return 6.0 * N + 12.0 * c->num_layers * (double)c->channels * T;
}

/* Dense peak of the datatype the matmuls use (bf16 tensor cores; fp32 CUDA
 * cores in FP32 builds, TF32 being off), from the device name; 0 if unknown. */
static double device_peak_flops(const char* name) {
    double bf16 = 0, fp32 = 0;
    if (strstr(name, "H200") || strstr(name, "GH200")) { bf16 = 989e12; fp32 = 67e12; }
    else if (strstr(name, "H100") && strstr(name, "PCIe")) { bf16 = 756e12; fp32 = 51e12; }
    else if (strstr(name, "H100")) { bf16 = 989e12; fp32 = 67e12; }
    else if (strstr(name, "A100")) { bf16 = 312e12; fp32 = 19.5e12; }
    return PRECISION_IS_FP32 ? fp32 : bf16;
}

static void gpu_step_extras(void* ctx, int step, double step_ms, char* buf, size_t n) {
    GpuModel* m = (GpuModel*)ctx;
    size_t used = gpu_used_memory();
    if (used > m->used_peak) m->used_peak = used;
    char mfu[32] = "n/a";
    if (m->peak_flops > 0 && step_ms > 0)
        snprintf(mfu, sizeof(mfu), "%.1f%%", 100.0 * m->flops_per_step / (step_ms * 1e-3) / m->peak_flops);
    snprintf(buf, n, " | MFU %s | device memory %.0f MiB", mfu, mib(used));
    if (m->memory_reported) return;
    m->memory_reported = 1;
    size_t plan = m->plan->total_bytes;
    /* step 1 of a fresh run; the first step after a resume, or after FP16 steps skipped */
    char nccl[48] = "";
    if (m->mg) snprintf(nccl, sizeof(nccl), " + NCCL %.1f", mib(m->used_nccl));
    printf("device memory after step %d: %.1f MiB in use (cudaMemGetInfo; nothing is allocated inside the loop) vs plan %.1f MiB;\n"
           "  difference %+.1f MiB = CUDA context and other processes %.1f + cuBLASLt handle %.1f%s + allocation rounding %+.1f"
           " + kernels and library state loaded during the step %+.1f\n",
           step, mib(used), mib(plan), mib(used) - mib(plan), mib(m->used_context - m->used_nccl), mib(m->used_library - m->used_context), nccl,
           (double)((long long)m->used_arena - (long long)m->used_library - (long long)plan) / 1048576.0,
           (double)((long long)used - (long long)m->used_arena) / 1048576.0);
}

/* The GPU's name for the default cost model ("" without one). */
static char g_device_name[256] = "";
static const char* gpu_device_name(void) { return g_device_name; }

/* The attention kernel family this build runs at head size hs (for the time
 * model's attention rate); with documents or without, the same. */
static int gpu_attention_family(int hs) { return attention_family(ATTENTION_KIND, hs); }

/* REMAT_PROFILE_COST_MODEL=FILE with REMAT_PROFILE=N: the time model's rates
 * calibrated from step N's profile (cost_model_calibrate), written to FILE
 * for --cost-model; NULL when not asked for (cost_model_profile_request). */
static const char* profile_cost_model_path(void) {
    int step = 0;
    return cost_model_profile_request(&step);
}

static void gpu_write_profile_cost_model(GpuModel* m, int step) {
    const char* path = profile_cost_model_path();
    if (!path || step != m->prof.step) return;
    LinkTimes host = {0, 0, 0, 0, 0}, ring = {0, 0, 0, 0, 0};
    offload_timing_collect(&m->off, &host);
    if (m->par.cp.group_size > 1) { /* the ring's link (llmc/core/ring.h's timing messages) */
        size_t kv = plan_ring_kv_bytes(&m->plan->spec);
        for (int i = 0; i < RING_TIMING_MESSAGES; i++)
            multigpu_time_ring(m->mg, m->stream, m->ring.kv[0], m->ring.kv[1], ring_timing_bytes(kv, i), &ring);
    }
    if (remat_proc.rank != 0) return;
    const float* t = m->prof.total_ms;
    PhaseTimes pt = {t[PROF_FORWARD], t[PROF_CLASSIFIER], t[PROF_BACKWARD], t[PROF_UPDATE],
                     (double)t[PROF_ATT_FORWARD] + t[PROF_ATT_RECOMPUTE] + t[PROF_ATT_BACKWARD]};
    CostModel cm;
    char why[256];
    const PlanSpec* s = &m->plan->spec;
    if (cost_model_calibrate(s, &pt, &cm, why, sizeof(why)) != 0)
        fail("REMAT_PROFILE_COST_MODEL: step %d's profile does not calibrate the time model: %s", step, why);
    cost_model_add_links(s, &host, &ring, &cm);
    snprintf(cm.name, sizeof(cm.name), "%.120s %s, calibrated at B=%d T=%d", g_device_name[0] ? g_device_name : "GPU", PRECISION_NAME, s->B, s->T);
    char how[128];
    snprintf(how, sizeof(how), "from the profile of step %d (REMAT_PROFILE), see llmc/plan/cost_model.h", step);
    cost_model_write(&cm, path, how);
    printf("cost model: %s written to %s (matmul %.3g FLOP/s, attention %.3g FLOP/s, memory %.3g B/s, host link %.3g B/s from %.0f timed copy groups of %.0f bytes,"
           " ring %.3g B/s and %.3g s a message from %.0f timed messages)\n",
           cm.name, path, cm.matmul_flops_per_s, cm.attention_flops_per_s, cm.memory_bytes_per_s, cm.host_link_bytes_per_s, host.count, host.bytes,
           cm.ring_bytes_per_s, cm.ring_latency_s, ring.count);
}

static void gpu_step_begin(void* ctx, int step) {
    GpuModel* m = (GpuModel*)ctx;
    prof_step_begin(&m->prof, step, m->stream);
    if (step == m->prof.step && profile_cost_model_path()) offload_timing_start(&m->off); /* the host link, from this step's copies */
}
static void gpu_step_end(void* ctx, int step) {
    GpuModel* m = (GpuModel*)ctx;
    prof_step_end(&m->prof, step, remat_proc.rank == 0);
    gpu_write_profile_cost_model(m, step);
}

static void gpu_device_record(const GpuModel* m, DeviceRecord* d) {
    memset(d, 0, sizeof(*d));
    cudaDeviceProp prop;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    snprintf(d->name, sizeof(d->name), "%.63s", prop.name);
    d->sm_count = prop.multiProcessorCount;
    CUDA_CHECK(cudaRuntimeGetVersion(&d->cuda_runtime));
    d->cublaslt = (int)cublasLtGetVersion();
    d->nccl = m->mg ? m->mg->nccl_version : 0;
}

static Backend gpu_backend(GpuModel* m) {
    Backend be;
    memset(&be, 0, sizeof(be));
    be.ctx = m;
    be.inputs = m->h_inputs;
    be.targets = m->h_targets;
    be.io_chunk = m->io_chunk;
    be.window = m->window;
    be.model_file_version = MODEL_FILE_VERSION_FLOATX; /* 5 in BF16; 3 in FP16 (exact) and FP32 */
    be.loss_scaling = PRECISION_IS_FP16;                /* dynamic loss scaling in FP16 builds */
    gpu_device_record(m, &be.device);
    be.forward_backward = gpu_forward_backward;
    be.set_dropout = gpu_set_dropout;
    be.set_documents = gpu_set_documents;
    be.doc_start = m->h_doc_start;
    be.ring_chunks = m->par.ring_chunks;
    be.forward_loss = gpu_forward_loss;
    be.token_losses = gpu_token_losses;
    be.token_top1 = gpu_token_top1;
    be.memory_bytes = gpu_memory_bytes;
    be.next_token_probs = gpu_next_token_probs;
    be.zero_grads = gpu_zero_grads;
    be.sync_grads = m->mg ? gpu_sync_grads : NULL; /* MULTI_GPU builds, even with one rank */
    be.grad_norm = gpu_grad_norm;
    be.update = gpu_update;
    be.transfer = gpu_transfer;
    be.step_extras = gpu_step_extras;
    be.step_begin = gpu_step_begin;
    be.step_end = gpu_step_end;
    return be;
}

/* ------------------------------------------------------------------------ */
/* startup                                                                    */

/* What main learns about the device before the flags are read, and the
 * NCCL communicator, which the memory budget hook needs: one per process. */
typedef struct {
    int device;    /* this rank's device, -1 without one */
    int devices;   /* devices seen; GPU_BROKEN: present but unusable */
    char why[256]; /* why there is none */
    MultiGpu mg_state;
    MultiGpu* mg;  /* NCCL once connected (MULTI_GPU builds), else NULL */
    int connected;
} GpuStartup;
static GpuStartup gpu_startup;

/* Every rank checks its device together with the others (a missing one
 * stops all of them, none hangs), then joins NCCL; once per process. */
static MultiGpu* gpu_startup_connect(void) {
    GpuStartup* g = &gpu_startup;
    if (g->connected) return g->mg;
    multigpu_check_device(g->device, g->devices, g->why);
    g->mg = multigpu_connect(&g->mg_state);
    if (g->mg) multigpu_ring_connect_early(g->mg, remat_ring_degree_hint);
    if (g->mg) remat_nccl_device_bytes = g->mg->device_bytes;
    g->connected = 1;
    return g->mg;
}

/* The default budget of --plan and -r auto with a device: free memory once
 * the context and NCCL (with its connection buffers) exist; plan_report.h
 * keeps PLAN_DEVICE_HEADROOM_BYTES of it back. */
static size_t gpu_free_memory(void) {
    gpu_startup_connect();
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) { cudaGetLastError(); return 0; }
    return free_b;
}

/* Every buffer's bytes at T are at most T/(T/2) times its bytes at T/2:
 * affine sizes pass, anything growing like T^2 fails. */
static void check_no_quadratic_buffers(const MemoryPlan* plan) {
    int T = plan->spec.T, T2 = T / 2;
    const char* big = "";
    size_t largest = plan_largest_entry(plan, &big);
    if (T2 >= 1) {
        PlanSpec half = plan->spec;
        half.T = T2;
        MemoryPlan p2;
        plan_build(&p2, &half);
        for (int i = 0; i < plan->num_entries && i < p2.num_entries; i++) {
            const PlanEntry *a = &plan->entries[i], *b = &p2.entries[i];
            if (strcmp(a->name, b->name) != 0) continue;
            if ((double)a->bytes * T2 > (double)b->bytes * T * (1.0 + 1e-12))
                fail("memory plan: buffer %s grows faster than T (%zu bytes at T=%d, %zu at T=%d)", a->name, a->bytes, T, b->bytes, T2);
        }
        plan_free(&p2);
    }
    printf("  check: no buffer grows faster than T (plan at T=%d against T=%d); largest %s, %.1f MiB\n", T, T2, big, mib(largest));
}

static void print_device(const GpuModel* m, int master_weights) {
    cudaDeviceProp prop;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s (sm_%d%d, %d SMs, %.1f GiB), precision %s%s, matmuls cuBLASLt with fp32 accumulation%s\n", prop.name,
           prop.major, prop.minor, prop.multiProcessorCount, (double)prop.totalGlobalMem / (1 << 30), PRECISION_NAME,
           PRECISION_IS_FP32 ? "" : (master_weights ? " + fp32 master weights" : ", no master weights"),
           PRECISION_IS_FP32 ? " (TF32 off)" : "");
    printf("attention: %s\n", ATTENTION_KERNELS_NAME);
    if (*attention_kernels_note(m->cfg.channels / m->cfg.num_heads)) printf("%s\n", attention_kernels_note(m->cfg.channels / m->cfg.num_heads));
    if (m->peak_flops > 0)
        printf("MFU: model FLOPs (PaLM convention, 6N + 12LCT per token) over %.0f TFLOPS dense %s peak\n", m->peak_flops / 1e12, PRECISION_NAME);
    else
        printf("MFU: n/a (no peak FLOPS known for this device)\n");
}

#ifndef REMAT_NO_MAIN
int main(int argc, char** argv) {
    proc_init(&argc, &argv); /* MPI in MULTI_GPU builds; else a no-op */
    GpuStartup* g = &gpu_startup;
    g->devices = gpu_device_count(g->why, sizeof(g->why)); /* the first CUDA call; reported after the flags are read */
    g->device = multigpu_select_device(g->devices);       /* device local_rank, before any context exists */
    /* several ranks all take the hook, so that they check their devices together */
    if (g->device >= 0 || remat_proc.world > 1) remat_free_memory_hook = gpu_free_memory;
    if (g->device >= 0) {
        cudaDeviceProp dev_prop;
        if (cudaGetDeviceProperties(&dev_prop, g->device) == cudaSuccess) snprintf(g_device_name, sizeof(g_device_name), "%s", dev_prop.name);
        else cudaGetLastError();
    }
    remat_device_name_hook = gpu_device_name;
    remat_attention_family_hook = gpu_attention_family;
    profile_cost_model_path(); /* a bad setting stops the run now, not after step N */
    Run run;
    const TrainerTraits gpu_trainer = {FOR_GPU, (int)sizeof(floatX), 4, !PRECISION_IS_FP32, GPU_WORKSPACE_BYTES, GPU_LOGITS_CHUNK_ROWS};
    run_setup(&run, argc, argv, &gpu_trainer);
    /* --plan and --plan-json, which price both, have exited in run_setup */
    gpu_check_config(&run.cfg, run.model_desc);
    int master_weights = run.plan.spec.master_weights;
    MultiGpu* mg = gpu_startup_connect(); /* no or a broken device: every rank says so, then all stop */
    run_print_header(&run);
    check_no_quadratic_buffers(&run.plan);
    if (mg)
        multigpu_configure(mg, &run.plan.spec.cfg, run.plan.num_params, plan_zero_sharded(&run.plan.spec),
                           plan_context_parallel(&run.plan.spec));
    GpuModel m;
    gpu_model_create(&m, &run.plan, (uint64_t)run.opt.seed);
    m.mg = m.num_grad_slots ? NULL : mg; /* slots: one process, whose reductions (identities) would read the whole buffer */
    m.used_nccl = mg ? mg->device_bytes : 0;
    prof_init(&m.prof);
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, g->device));
    m.peak_flops = device_peak_flops(prop.name);
    /* this rank's tokens: T / N of each row under context parallelism */
    m.flops_per_step = model_flops_per_token(&run.cfg, run.plan.num_params, run.opt.T) * (double)run.grad_accum * run.opt.B * run.opt.T / run.cp.group_size;
    print_device(&m, master_weights);
    Backend be = gpu_backend(&m);
    train(&run, &be);
    if (m.used_peak)
        printf("device memory in use, the most at any step line: %.1f MiB (plan %.1f MiB)\n", mib(m.used_peak), mib(run.plan.total_bytes));
    multigpu_free(mg);
    prof_free(&m.prof);
    gpu_model_free(&m);
    plan_free(&run.plan);
    free(run.layer_mode);
    free(run.layer_offload);
    proc_finalize();
    return 0;
}
#endif
