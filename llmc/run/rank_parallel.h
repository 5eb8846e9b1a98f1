/*
 * One process's part in a run of several, set up the same way by both
 * trainers before their first step: its context-parallel group and the
 * ring's chunk pairing (llmc/core/ring.h), and the parameters whose
 * optimizer state it holds. ZeRO-1 (-z 1) shards that state only over more
 * than one process (plan_zero_sharded, the rule the plan counts its bytes
 * by); with one process the shard is every parameter and nothing is summed
 * or gathered for it.
 */
#ifndef REMAT_RANK_PARALLEL_H
#define REMAT_RANK_PARALLEL_H

#include "../core/ring.h"
#include "../plan/plan.h"

typedef struct {
    ContextGroups cp;                /* context parallelism: this rank's place in its group (group_size 1: off) */
    int* ring_chunks;                /* host (2N): which chunks each member of the group holds in the current call
                                      * (the zigzag until Backend.ring_chunks rebalances it for a batch's documents) */
    int zero;                        /* ZeRO-1: optimizer state sharded over the ranks */
    size_t shard_start, shard_count; /* the parameters this rank updates */
} RankParallel;

/* Rank `rank`'s part in the plan's run (world_size processes). */
static inline RankParallel rank_parallel(const MemoryPlan* plan, int rank) {
    RankParallel p;
    int world = plan->spec.world_size;
    p.cp = context_groups(plan_context_parallel(&plan->spec), rank, world);
    p.ring_chunks = (int*)malloc_check(2 * (size_t)p.cp.group_size * sizeof(int), "the ring's chunks");
    for (int c = 0; c < 2 * p.cp.group_size; c++) p.ring_chunks[c] = ring_chunk(NULL, p.cp.group_size, c / 2, c % 2);
    p.zero = plan_zero_sharded(&plan->spec);
    p.shard_start = 0;
    p.shard_count = plan->num_params;
    if (p.zero) shard_range(plan->num_params, world, rank, &p.shard_start, &p.shard_count);
    if (p.shard_count > plan->shard_params) fail("internal: shard of %zu parameters exceeds the plan's %zu", p.shard_count, plan->shard_params);
    return p;
}

static inline void rank_parallel_free(RankParallel* p) {
    free(p->ring_chunks);
    p->ring_chunks = NULL;
}

#endif
