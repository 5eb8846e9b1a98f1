/*
 * What a trainer supplies to the shared driver (llmc/run/trainer.h): a Backend,
 * the model's forward/backward, optimizer and parameter transfer on its own
 * device, and the run's resolved settings (Run). Also the macro that points
 * a trainer's model struct at the buffers the memory plan lays out.
 */
#ifndef REMAT_BACKEND_H
#define REMAT_BACKEND_H

#include <math.h>
#include <sys/resource.h>
#include <time.h>
#include "../core/utils.h"
#include "../core/model.h"
#include "../plan/plan.h"
#include "../core/cli.h"
#include "../core/dataloader.h"
#include "../core/tokenizer.h"
#include "schedule.h"
#include "sampler.h"
#include "logger.h"
#include "../core/checkpoint.h"
#include "loss_scaler.h"
#include "../core/multiproc.h"
#include "../core/optimizer.h"
#include "../core/ring.h"
#include "run_identity.h"
#include "preempt.h"
#include "../core/dropout.h"
#include "../core/documents.h"

/* The state of a pass that drops nothing: evaluation, sampling. */
static const DropoutState dropout_off = {{0.0f}, 0, 0, 0, 0, 0, 0};

/* The model's buffers.
 * Points a trainer's model struct `m` at the buffers both trainers keep inside
 * its arena (m->arena, laid out by `plan`), sets the per-layer strides of the
 * stacked parameter tensors, the logits chunk's rows and the plan's B, T.
 * A macro because it is generic over the storage type ELEM (real on the CPU,
 * floatX on the GPU) and STAT, the type of per-token losses and LayerNorm
 * statistics; `m` needs the members assigned here. Buffers only one trainer
 * has stay in that trainer. */
#define TRAINER_CARVE_ARENA(m, plan, ELEM, STAT)                                                         \
    do {                                                                                                 \
        const MemoryPlan* carve_plan_ = (plan);                                                          \
        char* carve_base_ = (m)->arena;                                                                  \
        (m)->params = (ELEM*)(carve_base_ + carve_plan_->off_params);                                    \
        (m)->grads = (ELEM*)(carve_base_ + carve_plan_->off_grads);                                      \
        (m)->adam_m = (float*)(carve_base_ + carve_plan_->off_adam_m);                                   \
        (m)->adam_v = (float*)(carve_base_ + carve_plan_->off_adam_v);                                   \
        ParamLayout carve_pl_;                                                                           \
        param_layout(&carve_plan_->spec.cfg, &carve_pl_);                                                \
        for (int carve_t_ = 0; carve_t_ < NUM_PARAM_TENSORS; carve_t_++) { /* each tensor, and its elements per layer */      \
            (m)->p.tensor[carve_t_] = (m)->params + carve_pl_.offset[carve_t_];                          \
            (m)->g.tensor[carve_t_] = (m)->grads + carve_pl_.offset[carve_t_];                           \
            (m)->layer_stride[carve_t_] = carve_pl_.count[carve_t_] / (size_t)carve_plan_->spec.cfg.num_layers; \
        }                                                                                                \
        (m)->inputs = (int*)(carve_base_ + carve_plan_->off_inputs);                                     \
        (m)->targets = (int*)(carve_base_ + carve_plan_->off_targets);                                   \
        (m)->losses = (STAT*)(carve_base_ + carve_plan_->off_losses);                                    \
        (m)->final_res = (ELEM*)(carve_base_ + carve_plan_->off_final_res);                              \
        (m)->lnf = (ELEM*)(carve_base_ + carve_plan_->off_lnf);                                          \
        (m)->lnf_mean = (STAT*)(carve_base_ + carve_plan_->off_lnf_mean);                                \
        (m)->lnf_rstd = (STAT*)(carve_base_ + carve_plan_->off_lnf_rstd);                                \
        (m)->logits = (ELEM*)(carve_base_ + carve_plan_->off_logits);                                    \
        for (int carve_g_ = 0; carve_g_ < NUM_GRAD_ACTS; carve_g_++)                                     \
            (m)->grad_act[carve_g_] = (ELEM*)(carve_base_ + carve_plan_->grad_act[carve_g_]);            \
        size_t carve_n_ = (size_t)carve_plan_->spec.B * plan_local_T(&carve_plan_->spec);                             \
        (m)->logits_rows = (size_t)carve_plan_->spec.logits_chunk_rows < carve_n_ ? carve_plan_->spec.logits_chunk_rows : (int)carve_n_; \
        (m)->B = carve_plan_->spec.B;                                                                    \
        (m)->T = plan_local_T(&carve_plan_->spec);                                                            \
    } while (0)

typedef enum { TENSOR_PARAMS, TENSOR_MASTER, TENSOR_ADAM_M, TENSOR_ADAM_V } StateTensor;

/* The part [*begin, *end) of parameter tensor t that lies in a rank's
 * parameter shard [lo, hi) (everything without ZeRO); 0 when they do not meet. */
static inline int shard_slice(const ParamLayout* pl, int t, size_t lo, size_t hi, size_t* begin, size_t* end) {
    *begin = pl->offset[t] > lo ? pl->offset[t] : lo;
    *end = pl->offset[t] + pl->count[t] < hi ? pl->offset[t] + pl->count[t] : hi;
    return *begin < *end;
}

/* One micro-batch as the driver hands it to forward_backward. */
typedef struct {
    const int* inputs;   /* (B, T) token ids, host memory (the Backend's inputs) */
    const int* targets;  /* (B, T) the token that follows each input */
    int micro_step;      /* 0 .. num_micro_steps-1 within the optimizer step */
    int num_micro_steps; /* micro-steps whose gradients one update sums (-d) */
} MicroBatch;

typedef struct {
    void* ctx;
    int* inputs;            /* B*T host tokens the data loader fills (pinned on the GPU) */
    int* targets;
    int model_file_version; /* 3 (fp32) or 5 (bf16) when writing checkpoints */
    int loss_scaling;       /* 1: dynamic loss scaling (FP16 builds) */
    DeviceRecord device;    /* what it computes on, recorded in checkpoints */
    float* io_chunk;        /* host staging for files, Run.io_chunk_floats floats */
    void* window;           /* host B*T+1 tokens for the dataloader, loader_token_bytes(V) bytes each */
    int* doc_start;         /* host B*T: the data loader's document starts for inputs (llmc/core/documents.h) */
    int* ring_chunks;       /* host 2N (context parallelism): which chunks each member holds in the current batch, written by
                             * the loader (with --reset-attention-mask) and the sampler, read by every pass (llmc/core/token_layout.h) */
    /* forward and backward of one micro-batch; gradients accumulate (the
     * last micro-step finishes them: fp32 sums, the overlapped reduction);
     * dloss_mean scales the gradient of the micro-batch's mean loss over all
     * its B*T tokens (with --eod-mask-loss the tokens not counted add
     * nothing, and train_step rescales the sums to the mean over the tokens
     * counted); returns the mean loss over the tokens counted (0: none) */
    float (*forward_backward)(void* ctx, const MicroBatch* mb, float dloss_mean);
    /* the dropout of the forward_backward calls that follow (their step and
     * micro-step fix the masks); forward_loss and next_token_probs never drop */
    void (*set_dropout)(void* ctx, const DropoutState* d);
    /* packed documents: what the passes after it mask (llmc/core/documents.h);
     * forward_backward and forward_loss read the starts from doc_start,
     * next_token_probs builds its own */
    void (*set_documents)(void* ctx, const DocumentOptions* d);
    /* the mean loss of a (B, T) batch, without gradients (over the tokens
     * counted: with --eod-mask-loss those whose input is not end of text; 0
     * when none is) */
    float (*forward_loss)(void* ctx, const int* inputs, const int* targets);
    /* after forward_loss: its B*T per-token losses, row-major (b, t), to host */
    void (*token_losses)(void* ctx, float* out);
    /* after forward_loss: its B*T top-1 tokens (the argmax over the V real
     * logits, the lowest id of a tie), row-major (b, t), to host */
    void (*token_top1)(void* ctx, int* out);
    /* memory in use for the log (device memory on the GPU); NULL: peak resident memory */
    size_t (*memory_bytes)(void* ctx);
    /* probabilities over V of the token after tokens[0..len) */
    void (*next_token_probs)(void* ctx, const int* tokens, int len, float* probs);
    void (*zero_grads)(void* ctx);
    /* after the last micro-step: sum gradients across processes (all-reduce, or
     * reduce-scatter to each rank's shard under ZeRO-1); NULL or a no-op alone */
    void (*sync_grads)(void* ctx);
    /* global gradient norm (across processes when gradients are sharded) */
    float (*grad_norm)(void* ctx);
    void (*update)(void* ctx, const AdamWStep* s);
    /* moves n fp32 values of a state tensor between device and host, from element `start` */
    void (*transfer)(void* ctx, int tensor, size_t start, size_t n, float* host, int to_host);
    /* extra text for the line of step `step` (MFU, device memory); may be NULL */
    void (*step_extras)(void* ctx, int step, double step_ms, char* buf, size_t n);
    /* around each optimizer step (the GPU's step profile); may be NULL */
    void (*step_begin)(void* ctx, int step);
    void (*step_end)(void* ctx, int step);
} Backend;

typedef struct {
    TrainOptions opt;
    ModelConfig cfg;
    char model_desc[4200];    /* for the printout */
    const char* model_path;   /* NULL: random init */
    int resume_step;          /* -1: fresh run */
    int rank, world;
    ContextGroups cp;         /* context parallelism: groups of cp.group_size ranks share each sequence */
    int grad_accum;
    unsigned char* layer_mode;
    unsigned char* layer_offload; /* per layer: kept tensors in host memory (plan.h) */
    MemoryPlan plan;
    size_t io_chunk_floats;   /* size of Backend.io_chunk */
    LossScaler scaler;
    int updates;              /* optimizer updates applied (skipped FP16 steps excluded) */
    uint64_t run_id;          /* written into every checkpoint file (llmc/run/run_identity.h) */
    DropoutState dropout;     /* the sites' probabilities, seed and rank; train_step sets the step */
    char dropout_desc[400];   /* where each probability came from, for the printout ("" when none) */
    HparamContext hp;         /* what the state's hyperparameters record besides the flags */
    DataRecord data;          /* the training data, as the state records it */
    DocumentOptions docs;     /* packed documents, resolved when the tokenizer is loaded */
} Run;

/* What a trainer is, for the setup (run/trainer.h's run_setup): which flags
 * apply, what its buffers store, what its plan holds besides activations. */
typedef struct {
    int trainer;              /* FOR_CPU or FOR_GPU (core/cli.h) */
    int elem_bytes;           /* parameters, gradients and activations: bytes an element */
    int stat_bytes;           /* per-token losses and normalization statistics: bytes an element */
    int master_weights;       /* keeps fp32 master weights when --master-weights asks */
    size_t workspace_bytes;   /* the matmul library's workspace */
    int logits_chunk_rows;    /* rows of logits computed at once */
} TrainerTraits;

/* Tokens of one optimizer step, every data-parallel group's (a context-parallel group shares its B x T). */
static inline int run_tokens_per_step(const Run* run) { return run->grad_accum * run->opt.B * run->opt.T * run->cp.groups; }

#endif
