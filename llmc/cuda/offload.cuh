/*
 * Offloaded checkpoints on the GPU (plan.h): what -r 1 and -r 3 layers keep
 * lives in pinned host memory, and each such layer's tensors pass through
 * slot l mod R of a device staging ring on their way out and back in. With
 * segments (--segment-layers K) the offloaded tensors are the segment
 * inputs, x of layers sK, in slot s mod R; "layer l" below is then segment
 * s, whose prefetch runs under segment s+1's forward again and backward.
 *
 * A second, non-blocking stream copies. Events order every use:
 *   forward   block l done (main)  -> copy stream: D2H of layer l's slot,
 *             then out_done[slot]; before main writes a slot again (x of
 *             layer l+R by block l+R-1, or the encoder) it waits out_done.
 *   backward  at the start of layer l's iteration (main's mark: every
 *             earlier use of slot l-1 mod R is done, layer l-1+R's backward
 *             included) -> copy stream: H2D of layer l-1, then in_done[slot];
 *             main waits in_done before layer l-1's recompute, so the copy
 *             runs under layer l's recompute and backward. After a layer's
 *             backward main fills its slot with NaN (0xFF bytes, in every
 *             precision): a read of a slot whose prefetch has not landed
 *             poisons the result instead of passing unnoticed.
 *   end       offload_finish: main waits for the copy stream to drain.
 *
 * Link timing (REMAT_PROFILE=N with REMAT_PROFILE_COST_MODEL=FILE): during
 * step N a start and a stop event (timing events, on the copy stream)
 * bracket each layer's copies; offload_timing_collect adds their times up
 * (LinkTimes, cost_model.h) once the step is done: the host link's rate is
 * measured from the run's own copies, as the CPU trainer measures its own.
 *
 * Under the emulator (dev/emu: one in-order queue serves every stream, so a
 * missing wait could never show), the copy stream's work is issued as late
 * as its events allow: held back until main waits on an event recorded
 * after it (or offload_finish), then queued. A use of a slot without the
 * wait on in_done or out_done then runs before the copy, on poisoned or
 * overwritten data, and the run's results change. Waits of the copy stream
 * on main are not covered that way (a late copy always follows main's
 * work): dev/emu's cross-stream hazard check is what sees those.
 *
 * Status: compiles, unverified on GPU.
 */
#ifndef REMAT_OFFLOAD_CUH
#define REMAT_OFFLOAD_CUH

#include "cuda_common.cuh"
#include "host_numa.cuh"
#include "../plan/plan.h" /* which layers go to the host, and its staging slots */

#ifdef REMAT_EMU_CUDA_RUNTIME_H /* the emulator's cuda_runtime.h */
#define OFFLOAD_LATE_COPIES 1
#else
#define OFFLOAD_LATE_COPIES 0
#endif

/* One piece of copy-stream work held back (emulator): a copy, or with
 * dst == NULL the record of `event`. */
typedef struct {
    void* dst;
    const void* src;
    size_t bytes;
    cudaMemcpyKind kind;
    cudaEvent_t event;
} OffloadOp;

typedef struct {
    const MemoryPlan* plan; /* NULL: no layer offloads, every call is a no-op */
    char* arena;
    char* host;             /* pinned pool of plan->host_total_bytes */
    cudaStream_t main, copy;
    cudaEvent_t main_mark;  /* main's progress, for the copy stream to wait on */
    cudaEvent_t copy_idle;
    cudaEvent_t out_done[OFFLOAD_STAGING_SLOTS], in_done[OFFLOAD_STAGING_SLOTS];
    int out_pending[OFFLOAD_STAGING_SLOTS]; /* a copy out of the slot main has not waited for */
    OffloadOp* late;
    int num_late, cap_late;
    /* link timing: 2 events per timed copy group, the group's bytes */
    cudaEvent_t* timing_events;
    size_t* timing_bytes;
    int timing_cap, timing_used, timing_on;
} Offload;

/* Copy groups a timed step holds at most: each offloaded layer's out and in,
 * for up to 8 passes (micro-steps, a forward_loss); later ones go untimed. */
#define OFFLOAD_TIMED_PASSES 8

static inline void offload_create(Offload* o, const MemoryPlan* plan, char* arena, cudaStream_t main) {
    memset(o, 0, sizeof(*o));
    if (!plan->staging_slots) return;
    o->plan = plan;
    o->arena = arena;
    o->main = main;
    cudaError_t err = pinned_alloc_near_gpu((void**)&o->host, plan->host_total_bytes, "offloaded checkpoints");
    if (err != cudaSuccess)
        fail("cannot allocate %.1f MiB of pinned host memory for offloaded checkpoints: %s", mib(plan->host_total_bytes),
             cudaGetErrorString(err));
    CUDA_CHECK(cudaStreamCreateWithFlags(&o->copy, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&o->main_mark, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&o->copy_idle, cudaEventDisableTiming));
    for (int s = 0; s < plan->staging_slots; s++) {
        CUDA_CHECK(cudaEventCreateWithFlags(&o->out_done[s], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&o->in_done[s], cudaEventDisableTiming));
    }
    int profiled_step = 0;
    if (!cost_model_profile_request(&profiled_step)) return;
    o->timing_cap = 2 * OFFLOAD_TIMED_PASSES * plan->spec.cfg.num_layers;
    o->timing_events = (cudaEvent_t*)malloc_check((size_t)o->timing_cap * 2 * sizeof(cudaEvent_t), "offload timing events");
    o->timing_bytes = (size_t*)malloc_check((size_t)o->timing_cap * sizeof(size_t), "offload timing");
    for (int i = 0; i < 2 * o->timing_cap; i++) CUDA_CHECK(cudaEventCreate(&o->timing_events[i]));
}

static inline void offload_destroy(Offload* o) {
    if (!o->plan) return;
    CUDA_CHECK(cudaStreamSynchronize(o->copy));
    for (int s = 0; s < o->plan->staging_slots; s++) {
        CUDA_CHECK(cudaEventDestroy(o->out_done[s]));
        CUDA_CHECK(cudaEventDestroy(o->in_done[s]));
    }
    for (int i = 0; i < 2 * o->timing_cap; i++) CUDA_CHECK(cudaEventDestroy(o->timing_events[i]));
    free(o->timing_events);
    free(o->timing_bytes);
    CUDA_CHECK(cudaEventDestroy(o->main_mark));
    CUDA_CHECK(cudaEventDestroy(o->copy_idle));
    CUDA_CHECK(cudaStreamDestroy(o->copy));
    CUDA_CHECK(cudaFreeHost(o->host));
    free(o->late);
    memset(o, 0, sizeof(*o));
}

static inline void offload_issue(Offload* o, const OffloadOp* op) {
    if (op->dst) CUDA_CHECK(cudaMemcpyAsync(op->dst, op->src, op->bytes, op->kind, o->copy));
    else CUDA_CHECK(cudaEventRecord(op->event, o->copy));
}

/* Copy-stream work: issued now, or under the emulator held back. */
static inline void offload_enqueue(Offload* o, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaEvent_t event) {
    OffloadOp op = {dst, src, bytes, kind, event};
    if (!OFFLOAD_LATE_COPIES) { offload_issue(o, &op); return; }
    if (o->num_late == o->cap_late) {
        o->cap_late = o->cap_late ? 2 * o->cap_late : 64;
        o->late = (OffloadOp*)realloc(o->late, (size_t)o->cap_late * sizeof(OffloadOp));
        if (!o->late) fail("out of host memory for the offload queue");
    }
    o->late[o->num_late++] = op;
}

/* Issues held-back work up to the first record of `event` (all of it for NULL). */
static inline void offload_issue_until(Offload* o, cudaEvent_t event) {
    int n = 0;
    while (n < o->num_late) {
        const OffloadOp* op = &o->late[n++];
        offload_issue(o, op);
        if (event && !op->dst && op->event == event) break;
    }
    memmove(o->late, o->late + n, (size_t)(o->num_late - n) * sizeof(OffloadOp));
    o->num_late -= n;
}

static inline void offload_main_waits(Offload* o, cudaEvent_t event) {
    if (OFFLOAD_LATE_COPIES) offload_issue_until(o, event);
    CUDA_CHECK(cudaStreamWaitEvent(o->main, event, 0));
}

/* The copy stream's next work starts after everything main has been given so far. */
static inline void offload_copy_waits_main(Offload* o) {
    CUDA_CHECK(cudaEventRecord(o->main_mark, o->main));
    CUDA_CHECK(cudaStreamWaitEvent(o->copy, o->main_mark, 0));
}

static inline int offload_layer(const Offload* o, int l) { return o->plan && o->plan->spec.layer_offload[l]; }
static inline int offload_slot(const Offload* o, int l) { return plan_staging_unit(&o->plan->spec, l) % o->plan->staging_slots; }

/* Bytes of activation a for B*T tokens (a call may run fewer than the plan's). */
static inline size_t offload_act_bytes(const Offload* o, int a, int B, int T) {
    const PlanSpec* s = &o->plan->spec;
    int is_stat;
    size_t per_token = layer_act_per_token(a, &s->cfg, &is_stat);
    return (size_t)B * (size_t)T * per_token * (size_t)(is_stat ? s->stat_bytes : s->elem_bytes);
}

/* Copies layer l's offloaded tensors, B*T tokens, out to the host pool or
 * back in; timed between two events while timing is on and events last. */
static inline void offload_copy_layer(Offload* o, int l, int B, int T, int to_host) {
    int timed = o->timing_on && o->timing_used < o->timing_cap, k = o->timing_used;
    size_t total = 0;
    if (timed) offload_enqueue(o, NULL, NULL, 0, cudaMemcpyDefault, o->timing_events[2 * k]);
    for (int a = 0; a < NUM_LAYER_ACTS; a++) {
        if (!plan_act_offloads(&o->plan->spec, l, a)) continue;
        size_t bytes = offload_act_bytes(o, a, B, T);
        char* slot = o->arena + o->plan->layer_act[l][a];
        char* host = o->host + o->plan->host_act[l][a];
        if (to_host) offload_enqueue(o, host, slot, bytes, cudaMemcpyDeviceToHost, NULL);
        else offload_enqueue(o, slot, host, bytes, cudaMemcpyHostToDevice, NULL);
        total += bytes;
    }
    if (!timed) return;
    offload_enqueue(o, NULL, NULL, 0, cudaMemcpyDefault, o->timing_events[2 * k + 1]);
    o->timing_bytes[k] = total;
    o->timing_used++;
}

/* Times the copy groups from now on (the profiled step); a no-op without a
 * timing request or without offloaded layers. */
static inline void offload_timing_start(Offload* o) {
    o->timing_on = o->timing_cap > 0;
    o->timing_used = 0;
}

/* After the timed step (the stream done with it): the timed groups' bytes
 * and seconds added to *t; timing off. */
static inline void offload_timing_collect(Offload* o, LinkTimes* t) {
    if (!o->timing_on) return;
    o->timing_on = 0;
    if (OFFLOAD_LATE_COPIES) offload_issue_until(o, NULL);
    CUDA_CHECK(cudaStreamSynchronize(o->copy));
    for (int k = 0; k < o->timing_used; k++) {
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, o->timing_events[2 * k], o->timing_events[2 * k + 1]));
        if (ms > 0.0f) link_times_add(t, (double)o->timing_bytes[k], 1e-3 * (double)ms);
    }
    o->timing_used = 0;
}

/* Before main writes into layer l's slot (its x, by the block before or the
 * encoder; its attention output): the slot's last copy out has finished. */
static inline void offload_acquire(Offload* o, int l) {
    if (!offload_layer(o, l)) return;
    int s = offload_slot(o, l);
    if (!o->out_pending[s]) return;
    offload_main_waits(o, o->out_done[s]);
    o->out_pending[s] = 0;
}

/* After block l's forward: its tensors to the host pool. */
static inline void offload_forward_done(Offload* o, int l, int B, int T) {
    if (!offload_layer(o, l)) return;
    int s = offload_slot(o, l);
    offload_copy_waits_main(o);
    offload_copy_layer(o, l, B, T, 1);
    offload_enqueue(o, NULL, NULL, 0, cudaMemcpyDefault, o->out_done[s]);
    o->out_pending[s] = 1;
}

/* Layer l's tensors back into its slot, after main's work so far. */
static inline void offload_prefetch(Offload* o, int l, int B, int T) {
    if (!offload_layer(o, l)) return;
    offload_copy_waits_main(o);
    offload_copy_layer(o, l, B, T, 0);
    offload_enqueue(o, NULL, NULL, 0, cudaMemcpyDefault, o->in_done[offload_slot(o, l)]);
}

/* Before layer l's recompute: its prefetch has landed. */
static inline void offload_ready(Offload* o, int l) {
    if (offload_layer(o, l)) offload_main_waits(o, o->in_done[offload_slot(o, l)]);
}

/* After layer l's backward: its slot is poisoned (see the top of the file). */
static inline void offload_release(Offload* o, int l, int B, int T) {
    if (!offload_layer(o, l)) return;
    for (int a = 0; a < NUM_LAYER_ACTS; a++)
        if (plan_act_offloads(&o->plan->spec, l, a))
            CUDA_CHECK(cudaMemsetAsync(o->arena + o->plan->layer_act[l][a], 0xFF, offload_act_bytes(o, a, B, T), o->main));
}

/* End of a pass: main continues only after every copy (the next pass reuses
 * the slots and the host pool). */
static inline void offload_finish(Offload* o) {
    if (!o->plan) return;
    offload_enqueue(o, NULL, NULL, 0, cudaMemcpyDefault, o->copy_idle);
    offload_main_waits(o, o->copy_idle);
    for (int s = 0; s < o->plan->staging_slots; s++) o->out_pending[s] = 0;
}

#endif
