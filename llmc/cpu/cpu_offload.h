/*
 * Offloaded checkpoints on the CPU reference: what llmc/cuda/offload.cuh does on
 * the GPU (a layer's kept tensors copied from their staging slot to the host
 * pool after its forward, back before its backward), done in place with
 * memcpy, so that the plan's staging slots and host pool (plan.h) are
 * exercised bit for bit by the CPU's tests. A slot released (after the copy
 * out, or after the layer's backward) is filled with NaN, as a GPU slot
 * would hold another layer's tensors by then: a read without its prefetch
 * poisons the result instead of passing. Needs `real` (cpu_real.h).
 */
#ifndef REMAT_CPU_OFFLOAD_H
#define REMAT_CPU_OFFLOAD_H

#include <math.h>
#include <string.h>
#include "../core/link_times.h"
#include "cpu_real.h"
#include "../plan/plan.h"

typedef struct {
    const MemoryPlan* plan;
    char* arena;      /* the plan's buffers: the staging slots */
    char* host_pool;  /* plan->host_total_bytes: stands in for the GPU's pinned pool */
    LinkTimes* timed; /* each copy's bytes and time added here (REMAT_PROFILE's step), or NULL */
} CpuOffload;

/* Bytes of layer activation `a` for a call of `tokens` tokens. */
static inline size_t cpu_offload_bytes(const CpuOffload* o, int a, size_t tokens) {
    int is_stat;
    return tokens * layer_act_per_token(a, &o->plan->spec.cfg, &is_stat) * sizeof(real);
}

/* Layer l's offloaded tensors from the staging slot to the host pool
 * (to_host) or back. */
static inline void cpu_offload_copy(const CpuOffload* o, int l, size_t tokens, int to_host) {
    for (int a = 0; a < NUM_LAYER_ACTS; a++) {
        if (!plan_act_offloads(&o->plan->spec, l, a)) continue;
        char* slot = o->arena + o->plan->layer_act[l][a];
        char* host = o->host_pool + o->plan->host_act[l][a];
        size_t bytes = cpu_offload_bytes(o, a, tokens);
        double t0 = o->timed ? now_ms() : 0.0;
        memcpy(to_host ? host : slot, to_host ? slot : host, bytes);
        if (o->timed) link_times_add(o->timed, (double)bytes, 1e-3 * (now_ms() - t0));
    }
}

/* Layer l's staging slots given up: filled with NaN. */
static inline void cpu_offload_release(const CpuOffload* o, int l, size_t tokens) {
    for (int a = 0; a < NUM_LAYER_ACTS; a++) {
        if (!plan_act_offloads(&o->plan->spec, l, a)) continue;
        real* slot = (real*)(o->arena + o->plan->layer_act[l][a]);
        size_t n = cpu_offload_bytes(o, a, tokens) / sizeof(real);
        for (size_t i = 0; i < n; i++) slot[i] = (real)NAN;
    }
}

#endif
