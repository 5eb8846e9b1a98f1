/*
 * The optimizer in host memory (--offload-optimizer) on the GPU: this rank's
 * shard of the master weights (fp32; without them a floatX copy of the
 * parameters), of AdamW's two moments and a floatX copy of its gradients
 * live in pinned host memory, the plan's host pool entries (plan.h,
 * plan_add_host_optimizer). The pool is offload.cuh's when offloaded
 * checkpoints allocated it, else allocated here, on the GPU's NUMA node.
 *
 * One update (after the driver's norm, clipping and FP16 overflow decision;
 * a skipped step never comes here):
 *   1. the shard's gradients go down on the copy stream, after the main
 *      stream's backward and reductions (an event orders them);
 *   2. the host waits for that copy, then runs AdamW tensor by tensor
 *      (adamw.cuh, host_adamw: the kernel's arithmetic, so the device's bits),
 *      writing each tensor's updated floatX parameters over its gradient
 *      copy, and queues that tensor's copy up at once, so the copies overlap
 *      the host's work on the tensors after it;
 *   3. the main stream waits for the last copy up before anything reads the
 *      parameters (the ZeRO-1 gather, the next forward).
 * Reading the pinned gradients before the copy's event has completed would
 * read the previous step's (or the NaN the pool starts with): the emulator
 * runs copies in stream order at synchronisation points, as a GPU may, so
 * such a read changes the bits and the tests comparing with the on-device
 * optimizer fail.
 *
 * Not built yet (issue 43): the per-layer gradient copies during the
 * backward, with their squared norms and finite checks, and the device
 * keeping only the gradients of layers in flight; the update overlapping
 * the next forward layer by layer. Unverified on GPU.
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
    cudaStream_t copy;
    cudaEvent_t main_done, grads_down, params_up;
} OptimizerOffload;

/* pool: offload.cuh's pinned pool of plan->host_total_bytes, or NULL. */
static inline void optimizer_offload_create(OptimizerOffload* o, const MemoryPlan* plan, char* pool) {
    memset(o, 0, sizeof(*o));
    if (!plan->spec.offload_optimizer) return;
    o->on = 1;
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
    memset(o->grads, 0xff, n * sizeof(floatX)); /* NaN: a read before the first copy down poisons the update */
    if (o->master) memset(o->master, 0xff, n * sizeof(float)); /* a load fills them (gpu_transfer) */
    else memset(o->host_params, 0xff, n * sizeof(floatX));
    CUDA_CHECK(cudaStreamCreateWithFlags(&o->copy, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&o->main_done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&o->grads_down, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&o->params_up, cudaEventDisableTiming));
}

static inline void optimizer_offload_destroy(OptimizerOffload* o) {
    if (!o->on) return;
    CUDA_CHECK(cudaStreamSynchronize(o->copy));
    CUDA_CHECK(cudaEventDestroy(o->main_done));
    CUDA_CHECK(cudaEventDestroy(o->grads_down));
    CUDA_CHECK(cudaEventDestroy(o->params_up));
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

/* Step 1 of the update (see the top): the shard [lo, hi) of the device's
 * gradients down, after the main stream's work; returns once they are. */
static inline void optimizer_offload_grads_down(OptimizerOffload* o, const floatX* grads, size_t lo, size_t hi, cudaStream_t main) {
    CUDA_CHECK(cudaEventRecord(o->main_done, main));
    CUDA_CHECK(cudaStreamWaitEvent(o->copy, o->main_done, 0));
    CUDA_CHECK(cudaMemcpyAsync(o->grads, grads + lo, (hi - lo) * sizeof(floatX), cudaMemcpyDeviceToHost, o->copy));
    CUDA_CHECK(cudaEventRecord(o->grads_down, o->copy));
    CUDA_CHECK(cudaEventSynchronize(o->grads_down)); /* the host reads the gradients only once they are down */
}

/* Step 2 for one tensor's slice: parameters [off, off + n) of the model, at
 * index k of the shard; AdamW on the host, then the slice's copy up queued. */
static inline void optimizer_offload_update_slice(OptimizerOffload* o, floatX* params, size_t off, size_t k, size_t n, float wd,
                                                  const AdamWStep* s, uint64_t seed) {
    host_adamw(o->grads + k, o->master ? o->master + k : NULL, o->host_params ? o->host_params + k : NULL, o->m + k, o->v + k, n, off,
               s->lr, s->beta1, s->beta2, s->bias_corr1, s->bias_corr2, s->eps, wd, s->grad_scale, seed, s->t);
    CUDA_CHECK(cudaMemcpyAsync(params + off, o->grads + k, n * sizeof(floatX), cudaMemcpyHostToDevice, o->copy));
}

/* Step 3: the main stream waits for every copy up. */
static inline void optimizer_offload_params_up(OptimizerOffload* o, cudaStream_t main) {
    CUDA_CHECK(cudaEventRecord(o->params_up, o->copy));
    CUDA_CHECK(cudaStreamWaitEvent(main, o->params_up, 0));
}

#endif
