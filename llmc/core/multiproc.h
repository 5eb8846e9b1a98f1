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
#include <signal.h>
#ifdef USE_MPI
#include <mpi.h>
#include <sched.h>
#include <time.h>
#endif

/* Whether this build can run several processes (ZeRO-1 needs them). */
#ifdef USE_MPI
#define MULTIPROC_BUILT 1
#else
#define MULTIPROC_BUILT 0
#endif

typedef struct {
    int rank, world;             /* this process among all */
    int local_rank, local_world; /* among the processes of this machine (GPU choice) */
    int uses_mpi;                /* MPI was initialised (a launcher started this process) */
} ProcInfo;

/* The process identity; set once by proc_init, read by the driver. */
static ProcInfo remat_proc = {0, 1, 0, 1, 0};

/* Whether a launcher (mpirun/mpiexec of OpenMPI, MPICH or Intel MPI, srun)
 * started this process. Only then does a build with MPI initialise it: a
 * process started alone is one rank of one, and MPI_Init's singleton start
 * would only cost (it starts a PMIx server, creates shared-memory files,
 * which a file size limit refuses, and holds 12-16 MiB more memory). */
static inline int proc_launched(void) {
    static const char* const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
        if (getenv(vars[i])) return 1;
    return 0;
}

#ifdef USE_MPI
#define MPI_CHECK(call) do { int rc_ = (call); if (rc_ != MPI_SUCCESS) { char msg_[MPI_MAX_ERROR_STRING]; int len_ = 0; \
    MPI_Error_string(rc_, msg_, &len_); fail("MPI call %s failed at %s:%d: %s", #call, __FILE__, __LINE__, msg_); } } while (0)

static inline void proc_abort_all(void) { MPI_Abort(MPI_COMM_WORLD, 1); }

/* ---- --collective-timeout ----
 * Off (0, the default), every collective below is the plain blocking MPI
 * call. On, each one is numbered (proc_seq, the same on every rank) and
 * starts with an arrival exchange: every rank sends a small "arrived at #k,
 * doing <what> at step N" message to every other and receives theirs, then
 * runs the collective's nonblocking form; both waits poll MPI_Test against
 * one deadline, on the main thread (no watchdog thread, no threaded MPI).
 * When the deadline passes, the ranks whose arrival at #k is missing are the
 * ones this rank waits for: named, with the collective each was last seen at,
 * then MPI_Abort stops the job. Past the arrival exchange (every rank
 * arrived, one stopped inside the transfer) only "one of the others" is
 * known, which with two ranks is a name too. An arrival naming another
 * collective than this rank's is a divergence of the ranks' control flow and
 * stops the job at once. Cost with the flag on: 2(N-1) messages of 64 bytes
 * per rank and collective, a handful per step. */
enum { PROC_WHAT_CHARS = 48 };
typedef struct {
    int64_t seq; /* collectives entered so far, this one included */
    int32_t step; /* proc_step on entry; -1: setup */
    char what[PROC_WHAT_CHARS];
} ProcArrival;

static int proc_timeout_s = 0;
static int proc_step = -1;       /* the training step the trainer is in; -1 before the first */
static int64_t proc_seq = 0;
static MPI_Comm proc_arrival_comm;
static ProcArrival proc_mine;    /* this rank's arrival at the current collective */
static ProcArrival* proc_seen;   /* [world]: each rank's latest arrival received */
static ProcArrival* proc_inbox;  /* [world]: receive buffers of the exchange */
static MPI_Request* proc_exchange; /* [2 world]: receives, then sends */
static MPI_Request* proc_pending; /* the current collective's nonblocking calls */
static int proc_num_pending, proc_pending_cap;
static double proc_deadline_s;

static inline double proc_clock_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int proc_timed(void) { return proc_timeout_s > 0; }

/* "the loss mean (step 12)" or "... (setup)"; in a parenthesis already,
 * "the loss mean, step 12" or "..., setup". */
static inline void proc_describe(char* out, size_t size, const ProcArrival* a, int nested) {
    if (a->step >= 0) snprintf(out, size, nested ? "%s, step %d" : "%s (step %d)", a->what, (int)a->step);
    else snprintf(out, size, nested ? "%s, setup" : "%s (setup)", a->what);
}

/* Between polls: yields at first (most waits end within microseconds), then
 * sleeps briefly so that a long wait does not hold a core. Returns the time
 * after the pause; a gap far beyond the pause is time this process did not
 * run (stopped, suspended), which moves the deadline on: a stopped rank,
 * resumed, must not blame the others for its own stop. */
static inline double proc_pause(double since_s, double last_s) {
    if (last_s - since_s < 1e-3) {
        sched_yield();
    } else {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    double now = proc_clock_s();
    if (now - last_s > 0.5) proc_deadline_s += now - last_s;
    return now;
}

/* The one line of a timeout: what this rank was doing (`at`), whom it waited for. */
static inline void proc_timeout_fail(const ProcArrival* at, const char* whom, const char* why) {
    char doing[PROC_WHAT_CHARS + 32];
    proc_describe(doing, sizeof(doing), at, 0);
    fail("waited more than %d s in %s for %s: %s; stopping the job (--collective-timeout)", proc_timeout_s, doing, whom, why);
}

/* Timed out once every rank had arrived: with two ranks the other is named. */
static inline void proc_fail_inside(const ProcArrival* at, const char* why) {
    char who[160];
    if (remat_proc.world == 2) snprintf(who, sizeof(who), "rank %d, which arrived at it but did not finish it", 1 - remat_proc.rank);
    else snprintf(who, sizeof(who), "one of the other %d ranks, which all arrived at it", remat_proc.world - 1);
    proc_timeout_fail(at, who, why);
}

/* Timed out in the exchange: names the ranks not yet arrived (up to eight),
 * and where the first of them was last seen. */
static inline void proc_fail_missing(void) {
    char whom[256] = "";
    size_t used = 0;
    int missing = 0, first = -1;
    for (int p = 0; p < remat_proc.world; p++) {
        int arrived = 1;
        if (proc_exchange[p] != MPI_REQUEST_NULL) MPI_CHECK(MPI_Test(&proc_exchange[p], &arrived, MPI_STATUS_IGNORE));
        if (arrived) continue;
        if (first < 0) first = p;
        if (missing++ < 8) used += (size_t)snprintf(whom + used, sizeof(whom) - used, "%s%d", missing > 1 ? ", " : "", p);
    }
    if (missing > 8) snprintf(whom + used, sizeof(whom) - used, " and %d more", missing - 8);
    if (first < 0) { /* every rank's arrival is here; this rank's has not reached some of them */
        for (int p = 0; p < remat_proc.world; p++) {
            int sent = 1;
            if (proc_exchange[remat_proc.world + p] != MPI_REQUEST_NULL)
                MPI_CHECK(MPI_Test(&proc_exchange[remat_proc.world + p], &sent, MPI_STATUS_IGNORE));
            if (sent) continue;
            if (first < 0) first = p;
            if (missing++ < 8) used += (size_t)snprintf(whom + used, sizeof(whom) - used, "%s%d", missing > 1 ? ", " : "", p);
        }
        if (missing > 8) snprintf(whom + used, sizeof(whom) - used, " and %d more", missing - 8);
        char who[400];
        snprintf(who, sizeof(who), "rank%s %s to take this rank's arrival (%s sent %s own)", missing == 1 ? "" : "s", whom,
                 missing == 1 ? "it" : "they", missing == 1 ? "its" : "their");
        if (first < 0) proc_fail_inside(&proc_mine, "the network failed");
        proc_timeout_fail(&proc_mine, who, missing == 1 ? "it is stuck, stopped or gone" : "they are stuck, stopped or gone");
    }
    char last[PROC_WHAT_CHARS + 32] = "no collective yet";
    if (proc_seen[first].seq > 0) proc_describe(last, sizeof(last), &proc_seen[first], 1);
    char who[400];
    if (missing == 1) snprintf(who, sizeof(who), "rank %s (last seen at %s)", whom, last);
    else snprintf(who, sizeof(who), "ranks %s (rank %d last seen at %s)", whom, first, last);
    proc_timeout_fail(&proc_mine, who, missing == 1 ? "it is stuck, stopped or gone" : "they are stuck, stopped or gone");
}

/* Rank p arrived at another collective than this rank: says which rank is
 * where and what differs (the step, the collective, or how many collectives
 * each has run). */
static inline void proc_fail_diverged(int p, const ProcArrival* a) {
    int me = remat_proc.rank;
    if (strncmp(a->what, proc_mine.what, PROC_WHAT_CHARS) == 0 && a->seq == proc_mine.seq)
        fail("the ranks are at different steps: rank %d at step %d, rank %d at step %d, both in %s (collective #%lld): they "
             "started from different steps or count them differently; stopping the job (--collective-timeout)", me,
             (int)proc_mine.step, p, (int)a->step, proc_mine.what, (long long)proc_mine.seq);
    char mine[PROC_WHAT_CHARS + 32], theirs[PROC_WHAT_CHARS + 32];
    proc_describe(mine, sizeof(mine), &proc_mine, 0);
    proc_describe(theirs, sizeof(theirs), a, 0);
    if (a->seq != proc_mine.seq)
        fail("the ranks run different collectives: rank %d is in %s, its collective #%lld; rank %d in %s, its #%lld; stopping "
             "the job (--collective-timeout)", me, mine, (long long)proc_mine.seq, p, theirs, (long long)a->seq);
    fail("the ranks run different collectives: rank %d is in %s, rank %d in %s (collective #%lld); stopping the job "
         "(--collective-timeout)", me, mine, p, theirs, (long long)proc_mine.seq);
}

/* Arrival at the next collective: exchanged with every rank, then checked
 * to be the same collective everywhere. */
static inline void proc_collective_begin(const char* what) {
    proc_num_pending = 0;
    if (!proc_timed()) return;
    int world = remat_proc.world, me = remat_proc.rank;
    memset(&proc_mine, 0, sizeof(proc_mine));
    proc_mine.seq = ++proc_seq;
    proc_mine.step = proc_step;
    snprintf(proc_mine.what, sizeof(proc_mine.what), "%s", what);
    double start = proc_clock_s(), now = start;
    proc_deadline_s = start + proc_timeout_s;
    for (int p = 0; p < world; p++) {
        proc_exchange[p] = proc_exchange[world + p] = MPI_REQUEST_NULL;
        if (p == me) continue;
        MPI_CHECK(MPI_Irecv(&proc_inbox[p], (int)sizeof(ProcArrival), MPI_BYTE, p, 0, proc_arrival_comm, &proc_exchange[p]));
        MPI_CHECK(MPI_Isend(&proc_mine, (int)sizeof(ProcArrival), MPI_BYTE, p, 0, proc_arrival_comm, &proc_exchange[world + p]));
    }
    for (;;) {
        int done = 0;
        MPI_CHECK(MPI_Testall(2 * world, proc_exchange, &done, MPI_STATUSES_IGNORE));
        if (done) break;
        if (now > proc_deadline_s) proc_fail_missing();
        now = proc_pause(start, now);
    }
    for (int p = 0; p < world; p++) {
        if (p == me) continue;
        const ProcArrival* a = &proc_inbox[p];
        if (a->seq != proc_mine.seq || a->step != proc_mine.step || strncmp(a->what, proc_mine.what, PROC_WHAT_CHARS) != 0)
            proc_fail_diverged(p, a);
        proc_seen[p] = *a;
    }
    proc_seen[me] = proc_mine;
}

/* A slot for one of the current collective's nonblocking calls. */
static inline MPI_Request* proc_new_request(void) {
    if (proc_num_pending == proc_pending_cap) {
        proc_pending_cap = proc_pending_cap ? 2 * proc_pending_cap : 8;
        proc_pending = (MPI_Request*)realloc(proc_pending, (size_t)proc_pending_cap * sizeof(MPI_Request));
        if (!proc_pending) fail("out of host memory for --collective-timeout's requests");
    }
    return &proc_pending[proc_num_pending++];
}

/* Waits for the current collective's nonblocking calls (the deadline runs on
 * from its arrival). */
static inline void proc_collective_end(void) {
    if (!proc_timed() || proc_num_pending == 0) return;
    double start = proc_clock_s(), now = start;
    for (;;) {
        int done = 0;
        MPI_CHECK(MPI_Testall(proc_num_pending, proc_pending, &done, MPI_STATUSES_IGNORE));
        if (done) break;
        if (now > proc_deadline_s) proc_fail_inside(&proc_mine, "one stopped inside it or the network failed");
        now = proc_pause(start, now);
    }
    proc_num_pending = 0;
}

/* One call of a collective: the blocking MPI function, or with the timeout
 * on its nonblocking twin (same arguments plus the request). */
#define PROC_CALL(blocking, nonblocking, ...) do { if (proc_timed()) MPI_CHECK(nonblocking(__VA_ARGS__, proc_new_request())); \
    else MPI_CHECK(blocking(__VA_ARGS__)); } while (0)

/* A whole collective of one call, described by `what` ("the loss mean"). */
#define PROC_COLLECTIVE(what, blocking, nonblocking, ...) do { proc_collective_begin(what); \
    PROC_CALL(blocking, nonblocking, __VA_ARGS__); proc_collective_end(); } while (0)

/* Every rank agrees on the timeout before the exchange protocol starts (a
 * rank with it off would wait in plain collectives for messages). */
static inline void proc_enable_timeout(int seconds) {
    int range[2] = {seconds, -seconds}, max[2] = {0, 0};
    MPI_CHECK(MPI_Allreduce(range, max, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    if (max[0] != -max[1]) {
        if (remat_proc.rank == 0)
            fail("flag --collective-timeout differs between the processes of this run: every rank must be started with the "
                 "same flags and data");
        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD)); /* rank 0's abort ends the wait */
    }
    if (seconds <= 0) return;
    int world = remat_proc.world;
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &proc_arrival_comm));
    proc_seen = (ProcArrival*)calloc_check((size_t)world, 2 * sizeof(ProcArrival), "--collective-timeout");
    proc_inbox = proc_seen + world;
    proc_exchange = (MPI_Request*)malloc_check((size_t)world * 2 * sizeof(MPI_Request), "--collective-timeout");
    proc_timeout_s = seconds;
}

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
    ignore_file_size_signal();
#ifdef USE_MPI
    if (!proc_launched()) return;
    remat_proc.uses_mpi = 1;
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

/* --collective-timeout: collective; every rank calls it once, before any
 * other collective of the run. */
static inline void proc_set_collective_timeout(int seconds) {
#ifdef USE_MPI
    if (remat_proc.world > 1 && !proc_timeout_s) proc_enable_timeout(seconds);
#else
    if (seconds > 0)
        fail("flag --collective-timeout: this binary was built without MPI, so it runs one process and has no collective to "
             "time out (install MPI and rebuild with make)");
#endif
}

/* The training step the trainer is at, for --collective-timeout's messages. */
static inline void proc_set_step(int step) {
#ifdef USE_MPI
    proc_step = step;
#else
    (void)step;
#endif
}

/* REMAT_TEST_STALL=R:S (tests of --collective-timeout only): rank R stops
 * itself (SIGSTOP) as step S begins, like a process the system stopped. */
static inline void test_hook_stall(int step) {
    static int rank = -2, at_step = -1;
    if (rank == -2) {
        const char* v = getenv("REMAT_TEST_STALL");
        if (!v || sscanf(v, "%d:%d", &rank, &at_step) != 2) rank = -1;
    }
    if (rank == remat_proc.rank && step == at_step) raise(SIGSTOP);
}

static inline void proc_finalize(void) {
#ifdef USE_MPI
    proc_finalize_at_exit();
#endif
}

/* --collective-timeout's arrival exchange alone, before work that another
 * library synchronizes (NCCL); nothing when the timeout is off. */
static inline void proc_arrive(const char* what) {
#ifdef USE_MPI
    if (remat_proc.world > 1 && proc_timed()) proc_collective_begin(what);
#else
    (void)what;
#endif
}

/* With the timeout on, the arrival exchange is the barrier. */
static inline void proc_barrier(const char* what) {
#ifdef USE_MPI
    if (remat_proc.world == 1) return;
    if (proc_timed()) proc_collective_begin(what);
    else MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
#else
    (void)what;
#endif
}

/* A double reduced over all processes with MPI's op (MPI_SUM, MPI_MAX, ...);
 * v itself on one process or without MPI. */
#ifdef USE_MPI
typedef MPI_Op ProcOp;
#define PROC_SUM MPI_SUM
#define PROC_MAX MPI_MAX
#else
typedef int ProcOp;
#define PROC_SUM 0
#define PROC_MAX 1
#endif
static inline double proc_reduce(double v, ProcOp op, const char* what) {
#ifdef USE_MPI
    if (remat_proc.world > 1) {
        double r = v;
        PROC_COLLECTIVE(what, MPI_Allreduce, MPI_Iallreduce, &v, &r, 1, MPI_DOUBLE, op, MPI_COMM_WORLD);
        return r;
    }
#endif
    (void)op;
    (void)what;
    return v;
}

static inline double proc_sum(double v, const char* what) { return proc_reduce(v, PROC_SUM, what); }
static inline double proc_max(double v, const char* what) { return proc_reduce(v, PROC_MAX, what); }
static inline double proc_mean(double v, const char* what) { return proc_sum(v, what) / remat_proc.world; }

/* Broadcast bytes from rank 0 (the NCCL id, for one). */
static inline void proc_broadcast(void* buf, size_t bytes, const char* what) {
#ifdef USE_MPI
    if (remat_proc.world > 1) PROC_COLLECTIVE(what, MPI_Bcast, MPI_Ibcast, buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
#else
    (void)buf;
    (void)bytes;
    (void)what;
#endif
}

/* The first of n values that differ between processes, or -1 when every
 * rank holds the same (compared by their minimum and maximum over ranks). */
static inline int proc_first_mismatch(const uint64_t* v, int n, const char* what) {
#ifdef USE_MPI
    if (remat_proc.world > 1) {
        uint64_t* lo = (uint64_t*)malloc_check((size_t)n * 2 * sizeof(uint64_t), "rank comparison");
        uint64_t* hi = lo + n;
        proc_collective_begin(what);
        PROC_CALL(MPI_Allreduce, MPI_Iallreduce, v, lo, n, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
        PROC_CALL(MPI_Allreduce, MPI_Iallreduce, v, hi, n, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
        proc_collective_end();
        int first = -1;
        for (int i = 0; i < n && first < 0; i++)
            if (lo[i] != hi[i]) first = i;
        free(lo);
        return first;
    }
#endif
    (void)v;
    (void)n;
    (void)what;
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
