/*
 * Data parallelism on the CPU reference over MPI (llmc/core/multiproc.h): the
 * gradient sum after the backward and, under ZeRO-1, the gather of the
 * updated shards. The GPU's twin is llmc/cuda/multigpu.cuh (NCCL).
 */
#ifndef REMAT_CPU_DATA_PARALLEL_H
#define REMAT_CPU_DATA_PARALLEL_H

#include "cpu_real.h"
#include "../core/multiproc.h"

#ifdef USE_MPI
#define MPI_REAL_TYPE (sizeof(real) == 8 ? MPI_DOUBLE : MPI_FLOAT)
#define MPI_CHUNK ((size_t)1 << 30) /* MPI counts are int */

/* Sums the n gradients across ranks: all of them (all-reduce), or under
 * ZeRO-1 (zero) only each rank's shard, reduced onto that rank. */
static void cpu_sum_grads(real* grads, size_t n, int zero) {
    int world = remat_proc.world, rank = remat_proc.rank;
    if (world == 1) return;
    proc_collective_begin(zero ? "the gradient reduction onto shards" : "the gradient all-reduce");
    if (!zero) {
        for (size_t s = 0; s < n; s += MPI_CHUNK) {
            int k = (int)(n - s < MPI_CHUNK ? n - s : MPI_CHUNK);
            PROC_CALL(MPI_Allreduce, MPI_Iallreduce, MPI_IN_PLACE, grads + s, k, MPI_REAL_TYPE, MPI_SUM, MPI_COMM_WORLD);
        }
        proc_collective_end();
        return;
    }
    for (int r = 0; r < world; r++) {
        size_t start, count;
        shard_range(n, world, r, &start, &count);
        for (size_t s = 0; s < count; s += MPI_CHUNK) {
            int k = (int)(count - s < MPI_CHUNK ? count - s : MPI_CHUNK);
            real* buf = grads + start + s;
            if (r == rank) PROC_CALL(MPI_Reduce, MPI_Ireduce, MPI_IN_PLACE, buf, k, MPI_REAL_TYPE, MPI_SUM, r, MPI_COMM_WORLD);
            else PROC_CALL(MPI_Reduce, MPI_Ireduce, buf, NULL, k, MPI_REAL_TYPE, MPI_SUM, r, MPI_COMM_WORLD);
        }
    }
    proc_collective_end();
}

/* ZeRO-1: each rank updated its shard of the n parameters; every shard is
 * gathered to every rank. */
static void cpu_allgather_params(real* params, size_t n) {
    int world = remat_proc.world;
    if (n > (size_t)INT_MAX) fail("ZeRO-1 on the CPU supports at most %d parameters", INT_MAX);
    int* counts = (int*)malloc_check((size_t)world * sizeof(int), "allgather");
    int* displs = (int*)malloc_check((size_t)world * sizeof(int), "allgather");
    for (int r = 0; r < world; r++) {
        size_t start, count;
        shard_range(n, world, r, &start, &count);
        counts[r] = (int)count;
        displs[r] = (int)start;
    }
    PROC_COLLECTIVE("the parameter all-gather", MPI_Allgatherv, MPI_Iallgatherv, MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, params, counts,
                    displs, MPI_REAL_TYPE, MPI_COMM_WORLD);
    free(counts);
    free(displs);
}
#else
static void cpu_sum_grads(real* grads, size_t n, int zero) { (void)grads; (void)n; (void)zero; }
static void cpu_allgather_params(real* params, size_t n) { (void)params; (void)n; }
#endif

#endif
