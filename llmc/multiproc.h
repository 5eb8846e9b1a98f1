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
#include <pthread.h>
#include <time.h>
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

/* --collective-timeout: a watchdog thread that stops this rank when one host
 * collective has waited too long (a peer stuck or gone); mpirun or srun then
 * ends the others. It makes no MPI call itself: it prints and _exits. */
static int proc_timeout_s = 0;
static volatile double proc_wait_since_s = 0.0; /* 0: not in a collective */
static const char* volatile proc_wait_what = "";

static inline double proc_clock_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void* proc_watchdog(void* unused) {
    (void)unused;
    for (;;) {
        sleep(1);
        double since = proc_wait_since_s;
        if (since > 0.0 && proc_clock_s() - since > proc_timeout_s) {
            char line[256];
            int n = snprintf(line, sizeof(line), "error: rank %d: waited more than %d s in %s for the other ranks "
                             "(--collective-timeout): one is stuck or gone; stopping the job\n",
                             remat_proc.rank, proc_timeout_s, proc_wait_what);
            if (write(STDERR_FILENO, line, (size_t)n) < 0) { /* exiting anyway */ }
            _exit(1);
        }
    }
    return NULL;
}

#define PROC_COLLECTIVE(call) do { proc_wait_what = #call; proc_wait_since_s = proc_clock_s(); MPI_CHECK(call); \
    proc_wait_since_s = 0.0; } while (0)

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

/* A binary without MPI that a launcher started as one of several processes
 * would run that many independent copies into the same -o: refuse. */
static inline void proc_refuse_launcher_without_mpi(void) {
    static const char* const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"};
    for (int i = 0; i < 3; i++) {
        const char* v = getenv(vars[i]);
        if (v && atol(v) > 1)
            fail("%s=%s: started as one of several processes, but this binary was built without MPI, so each would train alone "
                 "(install MPI and rebuild with make, or start one process)", vars[i], v);
    }
}

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
    proc_refuse_launcher_without_mpi();
#endif
}

static inline void proc_set_collective_timeout(int seconds) {
#ifdef USE_MPI
    if (seconds <= 0 || remat_proc.world == 1 || proc_timeout_s) return;
    proc_timeout_s = seconds;
    pthread_t t;
    if (pthread_create(&t, NULL, proc_watchdog, NULL) != 0) fail("--collective-timeout: cannot start the watchdog thread");
    pthread_detach(t);
#else
    (void)seconds;
#endif
}

static inline void proc_finalize(void) {
#ifdef USE_MPI
    proc_finalize_at_exit();
#endif
}

static inline void proc_barrier(void) {
#ifdef USE_MPI
    if (remat_proc.world > 1) PROC_COLLECTIVE(MPI_Barrier(MPI_COMM_WORLD));
#endif
}

/* Mean of a double over all processes (identical on every rank). */
static inline double proc_mean(double v) {
#ifdef USE_MPI
    if (remat_proc.world > 1) {
        double sum = 0.0;
        PROC_COLLECTIVE(MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
        return sum / remat_proc.world;
    }
#endif
    return v;
}

static inline double proc_sum(double v) {
#ifdef USE_MPI
    if (remat_proc.world > 1) {
        double sum = 0.0;
        PROC_COLLECTIVE(MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
        return sum;
    }
#endif
    return v;
}

/* Largest value of a double over all processes. */
static inline double proc_max(double v) {
#ifdef USE_MPI
    if (remat_proc.world > 1) {
        double m = v;
        PROC_COLLECTIVE(MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
        return m;
    }
#endif
    return v;
}

/* Broadcast bytes from rank 0 (the NCCL id, for one). */
static inline void proc_broadcast(void* buf, size_t bytes) {
#ifdef USE_MPI
    if (remat_proc.world > 1) PROC_COLLECTIVE(MPI_Bcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD));
#else
    (void)buf;
    (void)bytes;
#endif
}

/* The first of n values that differ between processes, or -1 when every
 * rank holds the same (compared by their minimum and maximum over ranks). */
static inline int proc_first_mismatch(const uint64_t* v, int n) {
#ifdef USE_MPI
    if (remat_proc.world > 1) {
        uint64_t* lo = (uint64_t*)malloc_check((size_t)n * 2 * sizeof(uint64_t), "rank comparison");
        uint64_t* hi = lo + n;
        PROC_COLLECTIVE(MPI_Allreduce(v, lo, n, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD));
        PROC_COLLECTIVE(MPI_Allreduce(v, hi, n, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD));
        int first = -1;
        for (int i = 0; i < n && first < 0; i++)
            if (lo[i] != hi[i]) first = i;
        free(lo);
        return first;
    }
#endif
    (void)v;
    (void)n;
    return -1;
}

/* Range [start, start+count) of n elements owned by `rank` when sharded
 * into equal ceil(n/world) pieces (the last one shorter). */
static inline void shard_range(size_t n, int world, int rank, size_t* start, size_t* count) {
    size_t per = ceil_div(n, (size_t)world);
    *start = per * (size_t)rank < n ? per * (size_t)rank : n;
    *count = *start + per <= n ? per : n - *start;
}

#endif
