/*
 * The optimizer in host memory (--offload-optimizer) on the GPU: this rank's
 * shard of the master weights (fp32; without them a floatX copy of the
 * parameters), of AdamW's two moments and a floatX copy of its gradients
 * live in pinned host memory, the plan's host pool entries (plan.h,
 * plan_add_host_optimizer). The pool is offload.cuh's when offloaded
 * checkpoints allocated it, else allocated here, on the GPU's NUMA node.
 *
 * Each layer's gradients go down on the copy stream as the step's last
 * backward finishes them (after gpu_fold_grads: final), while the layers
 * below run; with several processes this rank's shard of the layer goes
 * down once the layer's reduction (issued per layer on the collectives'
 * stream, multigpu.cuh) has summed it, behind the same wait. With one
 * process and one micro-step the device holds the block tensors' gradients
 * of R layers only (plan.h, plan_grad_slots: layer l in slot l mod R): each
 * copy down records its slot's event, and the main stream waits for it
 * before the layer R below writes the slot (a stream wait, no host sync);
 * the slot's squared norm (global_norm.cuh, its layer's group) is taken
 * before, on the main stream. One update (after the driver's norm, clipping
 * and FP16 overflow decision; a skipped step never comes here, so it leaves
 * no update pending):
 *   1. the rest of the shard's gradients (the tensors outside the blocks; all
 *      of them with several processes, after the reductions) go down on the
 *      copy stream after the main stream's work, and the host waits for the
 *      copy stream;
 *   2. the host runs AdamW (adamw.cuh, host_adamw: the kernel's arithmetic,
 *      so the device's bits) slice by slice, writing each slice's updated
 *      floatX parameters over its gradient copy, and queues that slice's
 *      copy up at once, so the copies overlap the host's work after it;
 *   3. the main stream waits for the copies up before anything reads the
 *      parameters.
 * With several processes 2 and 3 run at once, group by group as below,
 * before the ZeRO-1 gather (which needs every parameter). With one they are deferred
 * (optimizer_offload_defer: the step's AdamWStep kept) to the next forward,
 * which runs them group by group in its order (the embeddings, each layer's
 * slices of the block tensors, the final norm and head): before launching a
 * group's kernels the host runs its AdamW, queues its copies up, records an
 * event and the main stream waits for it, so the GPU runs the previous
 * layer's forward meanwhile (optimizer_offload_update_until). Each group runs
 * once: the forward of a step's first micro-step, an evaluation's or a
 * sample's, whichever comes first; recompute passes and later micro-steps
 * find it done. Whatever reads or writes the state otherwise (checkpoints,
 * the preemption's too, and the end of training, through gpu_transfer) runs
 * the rest first.
 * Reading the pinned gradients before the copy's event has completed would
 * read the previous step's (or the NaN the pool starts with): the emulator
 * runs copies in stream order at synchronisation points, as a GPU may, so
 * such a read changes the bits and the tests comparing with the on-device
 * optimizer fail; a forward launched before its group's copy up reads the
 * parameters the copy stream writes: the emulator's stream-hazard check.
 *
 * Not built yet (issue 43): the layer slots with several processes or
 * micro-steps (the whole gradient buffer stays on the device there).
 * Unverified on GPU.
 */
#ifndef REMAT_OPTIMIZER_OFFLOAD_CUH
#define REMAT_OPTIMIZER_OFFLOAD_CUH

#include "cuda_common.cuh"
#include "adamw.cuh"
#include "host_numa.cuh"
#include "../core/optimizer.h"
#include "../plan/plan.h" /* where the host pool holds the optimizer */

typedef struct {
    int on;
    char* own_pool;      /* the pinned pool when this allocated it, else NULL */
    float* master;       /* shard, fp32; NULL without master weights */
    floatX* host_params; /* shard, floatX, without master weights; else NULL */
    floatX* grads;       /* shard: the gradients down, then the updated parameters up */
    float* m;            /* shard moments (the plan's adam_m, adam_v) */
    float* v;
    int one_process;     /* no ZeRO-1 gather: the update may wait for the next forward */
    int layers_down;     /* layers whose gradients went down during this step's last backward */
    int unawaited;       /* copies down the main stream has not waited for (a step skipped after its backward) */
    /* one process: the update deferred to the next forward (optimizer_offload_defer), group by group */
    int pending;         /* 1 from the deferral until its last group has run */
    int next_group;      /* the first group not yet updated */
    AdamWStep deferred;  /* its step: lr, bias corrections, grad_scale, t */
    uint64_t seed;
    int slots;           /* the plan's grad_slots: layers whose gradients the device holds (0: all) */
    cudaStream_t copy;
    cudaEvent_t main_done, grads_down, params_up;
    cudaEvent_t slot_down[GRAD_SLOTS]; /* with slots: the last copy down out of each slot */
} OptimizerOffload;

/* pool: offload.cuh's pinned pool of plan->host_total_bytes, or NULL. */
static inline void optimizer_offload_create(OptimizerOffload* o, const MemoryPlan* plan, char* pool) {
    memset(o, 0, sizeof(*o));
    if (!plan->spec.offload_optimizer) return;
    o->on = 1;
    o->one_process = plan->spec.world_size == 1;
    if (!pool) {
        cudaError_t err = pinned_alloc_near_gpu((void**)&o->own_pool, plan->host_total_bytes, "the offloaded optimizer");
        if (err != cudaSuccess)
            fail("cannot allocate %.1f MiB of pinned host memory for the offloaded optimizer: %s", mib(plan->host_total_bytes),
                 cudaGetErrorString(err));
        pool = o->own_pool;
    }
    size_t n = plan->shard_params;
    if (plan->spec.master_weights) o->master = (float*)(pool + plan->off_master);
    else o->host_params = (floatX*)(pool + plan->off_master);
    o->grads = (floatX*)(pool + plan->off_host_grads);
    o->m = (float*)(pool + plan->off_adam_m);
    o->v = (float*)(pool + plan->off_adam_v);
    memset(o->m, 0, n * sizeof(float));
    memset(o->v, 0, n * sizeof(float));
    memset((void*)o->grads, 0xff, n * sizeof(floatX)); /* NaN: a read before the first copy down poisons the update */
    if (o->master) memset(o->master, 0xff, n * sizeof(float)); /* a load fills them (gpu_transfer) */
    else memset((void*)o->host_params, 0xff, n * sizeof(floatX));
    CUDA_CHECK(cudaStreamCreateWithFlags(&o->copy, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&o->main_done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&o->grads_down, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&o->params_up, cudaEventDisableTiming));
    o->slots = plan->grad_slots;
    for (int r = 0; r < o->slots; r++) CUDA_CHECK(cudaEventCreateWithFlags(&o->slot_down[r], cudaEventDisableTiming));
}

static inline void optimizer_offload_destroy(OptimizerOffload* o) {
    if (!o->on) return;
    CUDA_CHECK(cudaStreamSynchronize(o->copy));
    CUDA_CHECK(cudaEventDestroy(o->main_done));
    CUDA_CHECK(cudaEventDestroy(o->grads_down));
    CUDA_CHECK(cudaEventDestroy(o->params_up));
    for (int r = 0; r < o->slots; r++) CUDA_CHECK(cudaEventDestroy(o->slot_down[r]));
    CUDA_CHECK(cudaStreamDestroy(o->copy));
    if (o->own_pool) CUDA_CHECK(cudaFreeHost(o->own_pool));
    memset(o, 0, sizeof(*o));
}

/* Parameters [start, start + n) just loaded as fp32 values `values` (their
 * floatX rounding already on the device): the host's copy of this rank's
 * shard [lo, hi), master weights as given, or the floatX parameters. */
static inline void optimizer_offload_load(OptimizerOffload* o, size_t lo, size_t hi, size_t start, size_t n, const float* values) {
    size_t a = start > lo ? start : lo, b = start + n < hi ? start + n : hi;
    for (size_t i = a; i < b; i++) {
        if (o->master) o->master[i - lo] = values[i - start];
        else host_floatX_store(o->host_params, i - lo, values[i - start]);
    }
}

/* The gradients of parameters [a, b) (on the device at src, parameter a's
 * first), clipped to the shard [lo, hi), down on the copy stream. */
static inline void optimizer_offload_copy_down(OptimizerOffload* o, const floatX* src, size_t a, size_t b, size_t lo, size_t hi) {
    size_t from = a > lo ? a : lo, to = b < hi ? b : hi;
    if (from < to)
        CUDA_CHECK(cudaMemcpyAsync(o->grads + (from - lo), src + (from - a), (to - from) * sizeof(floatX), cudaMemcpyDeviceToHost, o->copy));
}

/* The step's last backward begins: no layer's gradients are down yet. */
static inline void optimizer_offload_backward_begins(OptimizerOffload* o) { o->layers_down = 0; }

/* The last backward has finished layer l (of L) of layout pl, its gradients
 * final once the work issued so far on `final_on` is done (the main stream,
 * or the collectives' after the layer's reduction): the shard [lo, hi) of
 * each block tensor's slice (src[t]: block tensor t's slice on the device)
 * down on the copy stream after that work, while the layers below run their
 * backward; with slots, then the event that frees its slot. */
static inline void optimizer_offload_layer_down(OptimizerOffload* o, const ParamLayout* pl, int L, int l, const floatX* const* src, int slot,
                                                size_t lo, size_t hi, cudaStream_t final_on) {
    if (!o->on) return;
    CUDA_CHECK(cudaEventRecord(o->main_done, final_on));
    CUDA_CHECK(cudaStreamWaitEvent(o->copy, o->main_done, 0));
    for (int t = FIRST_BLOCK_TENSOR; t < FIRST_BLOCK_TENSOR + NUM_BLOCK_TENSORS; t++) {
        size_t per_layer = pl->count[t] / (size_t)L, a = pl->offset[t] + (size_t)l * per_layer;
        optimizer_offload_copy_down(o, src[t - FIRST_BLOCK_TENSOR], a, a + per_layer, lo, hi);
    }
    if (o->slots) CUDA_CHECK(cudaEventRecord(o->slot_down[slot], o->copy));
    o->layers_down++;
    o->unawaited = 1;
}

/* With slots: before a layer writes slot `slot`, the main stream waits for
 * the copy down of the layer that wrote it before (an event never recorded,
 * the step's first use, waits for nothing). */
static inline void optimizer_offload_slot_free(OptimizerOffload* o, int slot, cudaStream_t main) {
    CUDA_CHECK(cudaStreamWaitEvent(main, o->slot_down[slot], 0));
}

/* Step 1 of the update (see the top): the shard [lo, hi) of the device's
 * gradients (tensor t's at grads[t]) down, after the main stream's work
 * (only the tensors outside the blocks when every layer's went down during
 * the backward, as they must have with slots); returns once they are. */
static inline void optimizer_offload_grads_down(OptimizerOffload* o, const ParamLayout* pl, int L, const floatX* const* grads, size_t lo,
                                                size_t hi, cudaStream_t main) {
    CUDA_CHECK(cudaEventRecord(o->main_done, main));
    CUDA_CHECK(cudaStreamWaitEvent(o->copy, o->main_done, 0));
    int layers_went = o->layers_down == L;
    if (o->slots && !layers_went) fail("internal: %d of %d layers' gradients went down from their slots", o->layers_down, L);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        int block = t >= FIRST_BLOCK_TENSOR && t < FIRST_BLOCK_TENSOR + NUM_BLOCK_TENSORS;
        if (!(block && layers_went)) optimizer_offload_copy_down(o, grads[t], pl->offset[t], pl->offset[t] + pl->count[t], lo, hi);
    }
    o->layers_down = 0;
    CUDA_CHECK(cudaEventRecord(o->grads_down, o->copy));
    CUDA_CHECK(cudaEventSynchronize(o->grads_down)); /* the host reads the gradients only once they are down */
}

/* Step 2 for one slice: parameters [off, off + n) of the model, at index k
 * of the shard; AdamW on the host, then the slice's copy up queued. */
static inline void optimizer_offload_update_slice(OptimizerOffload* o, floatX* params, size_t off, size_t k, size_t n, float wd,
                                                  const AdamWStep* s, uint64_t seed) {
    host_adamw(o->grads + k, o->master ? o->master + k : NULL, o->host_params ? o->host_params + k : NULL, o->m + k, o->v + k, n, off,
               s->lr, s->beta1, s->beta2, s->bias_corr1, s->bias_corr2, s->eps, wd, s->grad_scale, seed, s->t);
    CUDA_CHECK(cudaMemcpyAsync(params + off, o->grads + k, n * sizeof(floatX), cudaMemcpyHostToDevice, o->copy));
}

/* Before the device writes the gradients again (a new step): where copies
 * down went unawaited (a step skipped on FP16 overflow has no update, whose
 * wait for the copies up would order them), the main stream waits for them. */
static inline void optimizer_offload_main_waits(OptimizerOffload* o, cudaStream_t main) {
    if (!o->on || !o->unawaited) return;
    CUDA_CHECK(cudaEventRecord(o->params_up, o->copy));
    CUDA_CHECK(cudaStreamWaitEvent(main, o->params_up, 0));
    o->unawaited = 0;
}

/* The deferred update's groups, in the order the forward reads them: 0 the
 * embeddings (wte, wpe), 1 + l layer l's slices of the block tensors, L + 1
 * the final norm and an untied head. */
static inline int optimizer_offload_groups(int L) { return L + 2; }

/* The group of a tensor outside the blocks. */
static inline int optimizer_offload_tensor_group(int t, int L) { return t == P_WTE || t == P_WPE ? 0 : L + 1; }

/* After step 1 (the gradients are down) the update is left pending with its
 * step's values; optimizer_offload_update_until runs it group by group: the
 * next forward with one process, at once with several (the ZeRO-1 gather
 * needs every parameter at the step's end). Returns whether it may wait. */
static inline int optimizer_offload_defer(OptimizerOffload* o, const AdamWStep* s, uint64_t seed) {
    o->deferred = *s;
    o->seed = seed;
    o->pending = 1;
    o->next_group = 0;
    return o->one_process;
}

/* Group g of the deferred update: AdamW on each of its slices in this
 * rank's shard [lo, hi), each slice's copy up queued at once. */
static inline void optimizer_offload_update_group(OptimizerOffload* o, const ParamLayout* pl, int L, int g, floatX* params, size_t lo,
                                                  size_t hi) {
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        size_t a = pl->offset[t], n = pl->count[t];
        if (t >= FIRST_BLOCK_TENSOR && t < FIRST_BLOCK_TENSOR + NUM_BLOCK_TENSORS) {
            if (g == 0 || g == L + 1) continue;
            n /= (size_t)L;
            a += (size_t)(g - 1) * n;
        } else if (optimizer_offload_tensor_group(t, L) != g) {
            continue;
        }
        size_t b = a > lo ? a : lo, e = a + n < hi ? a + n : hi;
        if (b >= e) continue;
        float wd = param_is_decayed(t) ? o->deferred.weight_decay : 0.0f;
        optimizer_offload_update_slice(o, params, b, b - lo, e - b, wd, &o->deferred, o->seed);
    }
}

/* Before the forward reads group g: the deferred update's groups up to g
 * that have not run run now on the host, their copies up queued, and the
 * main stream waits for them (the kernels launched before keep the GPU busy
 * meanwhile: the previous layer's forward hides this layer's AdamW). Each
 * group runs once a step: recompute passes and later micro-steps find it
 * done. With g = L + 1, the whole update (the flush before anything else
 * reads the parameters or the optimizer state). */
static inline void optimizer_offload_update_until(OptimizerOffload* o, const ParamLayout* pl, int L, int g, floatX* params, size_t lo,
                                                  size_t hi, cudaStream_t main) {
    if (!o->pending || o->next_group > g) return;
    for (; o->next_group <= g; o->next_group++) optimizer_offload_update_group(o, pl, L, o->next_group, params, lo, hi);
    o->pending = o->next_group < optimizer_offload_groups(L);
    CUDA_CHECK(cudaEventRecord(o->params_up, o->copy));
    CUDA_CHECK(cudaStreamWaitEvent(main, o->params_up, 0)); /* the forward of group g reads them */
    o->unawaited = 0; /* that wait orders every copy down before it too */
}

#endif
