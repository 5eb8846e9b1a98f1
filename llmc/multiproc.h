/*
 * Processes for data-parallel training: MPI starts them (mpirun or srun) and
 * carries the host-side collectives; the GPU trainer adds NCCL for device
 * buffers. Built without MPI (no -DUSE_MPI) everything here degrades to a
 * single process, so both trainers run unchanged without mpirun.
 *
 * An error on any rank must stop every rank rather than leave the others
 * waiting in a collective: proc_init installs a fail() hook that calls
 * MPI_Abort, and prefixes errors with the rank.
 */
#ifndef REMAT_MULTIPROC_H
#define REMAT_MULTIPROC_H

#include "utils.h"
#ifdef USE_MPI
#include <mpi.h>
#endif

typedef struct {
    int rank, world;             /* this process among all */
    int local_rank, local_world; /* among the processes of this machine (GPU choice) */
} ProcInfo;

/* The process identity; set once by proc_init, read by the driver. */
static ProcInfo remat_proc = {0, 1, 0, 1};

#ifdef USE_MPI
#define MPI_CHECK(call) do { int rc_ = (call); if (rc_ != MPI_SUCCESS) { char msg_[MPI_MAX_ERROR_STRING]; int len_ = 0; \
    MPI_Error_string(rc_, msg_, &len_); fail("MPI call %s failed at %s:%d: %s", #call, __FILE__, __LINE__, msg_); } } while (0)

static inline void proc_abort_all(void) { MPI_Abort(MPI_COMM_WORLD, 1); }

/* --help, --plan and other early exits leave through exit(0): finalize there
 * too, or mpirun reports the job as failed. */
static inline void proc_finalize_at_exit(void) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Finalize();
}

/* Local rank from the launcher's environment, else by grouping processes
 * that share a node (MPI_COMM_TYPE_SHARED). */
static inline void proc_find_local_rank(ProcInfo* p) {
    const char* vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"};
    const char* sizes[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "MPI_LOCALNRANKS"};
    for (int i = 0; i < 3; i++) {
        const char* r = getenv(vars[i]);
        const char* n = getenv(sizes[i]);
        if (r && n && atoi(n) > 0) { p->local_rank = atoi(r); p->local_world = atoi(n); return; }
    }
    MPI_Comm node;
    MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, p->rank, MPI_INFO_NULL, &node));
    MPI_CHECK(MPI_Comm_rank(node, &p->local_rank));
    MPI_CHECK(MPI_Comm_size(node, &p->local_world));
    MPI_CHECK(MPI_Comm_free(&node));
}
#endif

static inline void proc_init(int* argc, char*** argv) {
#ifdef USE_MPI
    MPI_CHECK(MPI_Init(argc, argv));
    atexit(proc_finalize_at_exit);
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &remat_proc.rank));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &remat_proc.world));
    proc_find_local_rank(&remat_proc);
    if (remat_proc.world > 1) {
        remat_fail_hook = proc_abort_all;
        remat_error_rank = remat_proc.rank;
        /* one voice: only rank 0 prints progress; errors still reach stderr from any rank */
        if (remat_proc.rank != 0 && !freopen("/dev/null", "w", stdout)) fail("cannot silence stdout of rank %d", remat_proc.rank);
    }
#else
    (void)argc;
    (void)argv;
#endif
}

static inline void proc_finalize(void) {
#ifdef USE_MPI
    proc_finalize_at_exit();
#endif
}

static inline void proc_barrier(void) {
#ifdef USE_MPI
    if (remat_proc.world > 1) MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
#endif
}

/* Mean of a double over all processes (identical on every rank). */
static inline double proc_mean(double v) {
#ifdef USE_MPI
    if (remat_proc.world > 1) {
        double sum = 0.0;
        MPI_CHECK(MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
        return sum / remat_proc.world;
    }
#endif
    return v;
}

static inline double proc_sum(double v) {
#ifdef USE_MPI
    if (remat_proc.world > 1) {
        double sum = 0.0;
        MPI_CHECK(MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
        return sum;
    }
#endif
    return v;
}

/* Broadcast bytes from rank 0 (the NCCL id, for one). */
static inline void proc_broadcast(void* buf, size_t bytes) {
#ifdef USE_MPI
    if (remat_proc.world > 1) MPI_CHECK(MPI_Bcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD));
#else
    (void)buf;
    (void)bytes;
#endif
}

/* Range [start, start+count) of n elements owned by `rank` when sharded
 * into equal ceil(n/world) pieces (the last one shorter). */
static inline void shard_range(size_t n, int world, int rank, size_t* start, size_t* count) {
    size_t per = ceil_div(n, (size_t)world);
    *start = per * (size_t)rank < n ? per * (size_t)rank : n;
    *count = *start + per <= n ? per : n - *start;
}

#endif
