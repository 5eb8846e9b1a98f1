/*
 * Data parallelism on GPUs: one process per GPU, started by mpirun or srun
 * (llmc/core/multiproc.h holds the process side: MPI, ranks, the abort-on-error
 * hook), NCCL for the collectives on device buffers.
 *
 * Device choice: process `local_rank` of a node drives CUDA device
 * `local_rank`, set before anything creates a CUDA context (the context is
 * made on the current device, and a stray one on device 0 would cost every
 * rank memory there). multigpu_check_device reports a missing device on
 * every rank before any of them stops, so a job never hangs on it.
 *
 * NCCL: rank 0 makes the ncclUniqueId, MPI broadcasts it, every rank joins
 * with ncclCommInitRank. The collectives run on their own CUDA stream (high
 * priority, non-blocking with respect to the legacy default stream the
 * trainer computes on) and are ordered against the compute stream with
 * events only: "fork" (the collective waits for the compute work issued so
 * far) and "join" (later compute waits for every collective issued so far).
 *
 * Gradients (-z 0): summed in place with ncclAllReduce (ncclSum on floatX;
 * the driver already scaled dloss by 1/world, so the sum is the mean).
 * ZeRO-1 (-z 1): each rank updates the parameters of its shard (shard_range,
 * ceil(P/world) each, the last shorter), so each slice of gradients is
 * reduced with ncclReduce onto the rank owning it, clipped at shard edges:
 * the shards are ragged, so ncclReduceScatter (equal chunks) would read and
 * write past the P-element gradient buffer. After the update, parameters are
 * all-gathered: ncclAllGather in place when P divides evenly, else one
 * ncclBroadcast per rank from its shard, grouped.
 *
 * Overlap: in the last micro-step's backward, the trainer calls
 * multigpu_grads_ready after each layer (and once for the embeddings and the
 * final LayerNorm): that layer's gradients are final, so its 12 strided
 * slices (tensors are stacked per kind over layers) go to NCCL as one
 * ncclGroupStart/End group while the backward of the layers below runs.
 * multigpu_sync_grads makes the compute stream wait for all of them. With
 * REMAT_NCCL_OVERLAP=0 (rank 0's value counts) the whole buffer is reduced
 * after the backward instead, in one group: for comparison and debugging.
 *
 * Every rank issues the same collectives in the same order (everything here
 * depends only on the plan, world and rank), which NCCL requires.
 *
 * --collective-timeout (multiproc.h) covers NCCL too: each phase (the step's
 * gradient reduction, the ZeRO-1 all-gather) starts with the host arrival
 * exchange, so a rank stuck before it is named; the communicator is made
 * nonblocking (NCCL >= 2.14), so that no NCCL call blocks the host: a call
 * answering ncclInProgress is polled to its end against the deadline; and the
 * host's waits time how long the GPU has waited on NCCL alone (the inputs of
 * the collectives issued are ready, the collective stream is not done). Past
 * the deadline the communicator is aborted and the job stops with one line.
 *
 * Context parallelism (--context-parallel N, llmc/core/ring.h's ContextGroups):
 * each group of N consecutive ranks gets a second communicator, split from
 * the first (ncclCommSplit, NCCL 2.18+, color the group, key the member; a
 * nonblocking split completes when the parent is polled), and a ring
 * stream of its own; attention's K/V blocks and dK/dV sums go to member r+1
 * and come from r-1 as grouped ncclSend/ncclRecv pairs on it
 * (multigpu_ring_pass). Each transfer is ordered against compute by two
 * events of a small pool: "ready", recorded on compute before it (the
 * transfer waits for the compute work issued so far: the block it sends is
 * written, the buffer it receives into is no longer read), and "sent",
 * recorded on the ring stream after it, which multigpu_ring_join makes the
 * compute issued next wait for. Gradients are still summed over all ranks on
 * the first communicator. --collective-timeout: a host wait during which the
 * oldest unfinished transfer has had its inputs ready (the GPU waits on the
 * ring, not on compute) past the deadline aborts both communicators and
 * names the two neighbours; the pool bounds how far the host issues ahead
 * (it waits for the ring stream when every pair is in use).
 *
 * Built without MULTI_GPU, the device choice and check remain and the rest
 * is absent: the trainer's MultiGpu pointer is NULL and every call is a no-op.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_MULTIGPU_CUH
#define REMAT_MULTIGPU_CUH

#include "cuda_common.cuh"
#include "../core/multiproc.h"
#include "../core/ring.h"
#include "../core/model.h"
#include "../core/link_times.h"

#ifdef MULTI_GPU
#ifndef USE_MPI
#error "MULTI_GPU needs USE_MPI: the NCCL id travels over MPI"
#endif
#include <nccl.h>
#include <sched.h>

/* NCCL's element type for floatX, by build precision (PRECISION=BF16|FP16|FP32);
 * cuda_common.cuh names it next to floatX, this is the fallback. */
#ifndef NCCL_FLOATX
#if defined(ENABLE_FP32)
#define NCCL_FLOATX ncclFloat32
#elif defined(ENABLE_FP16)
#define NCCL_FLOATX ncclHalf
#else
#define NCCL_FLOATX ncclBfloat16
#endif
#endif
static_assert(sizeof(floatX) == ((NCCL_FLOATX) == ncclFloat32 ? 4 : 2) &&
                  ((NCCL_FLOATX) == ncclFloat32 || (NCCL_FLOATX) == ncclHalf || (NCCL_FLOATX) == ncclBfloat16),
              "NCCL_FLOATX does not match the storage type floatX");

static inline void nccl_check_impl(ncclResult_t r, const char* call, const char* file, int line) {
    if (r == ncclSuccess) return;
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    const char* last = ncclGetLastError(NULL);
#else
    const char* last = "";
#endif
    fail("NCCL call %s failed at %s:%d: %s%s%s (NCCL_DEBUG=INFO tells more)", call, file, line, ncclGetErrorString(r),
         last && last[0] ? ": " : "", last ? last : "");
}
#define NCCL_CHECK(call) nccl_check_impl((call), #call, __FILE__, __LINE__)

/* API levels (NCCL release notes): ncclGetLastError 2.13, nonblocking
 * communicators (ncclConfig_t, blocking = 0) and ncclCommFinalize 2.14,
 * ncclCommSplit 2.18.1. Older headers still build: without nonblocking
 * communicators --collective-timeout times the host waits only, without
 * ncclCommSplit --context-parallel stops with a message. */
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
#define MULTIGPU_HAS_NONBLOCKING 1
#else
#define MULTIGPU_HAS_NONBLOCKING 0
#endif
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
#define MULTIGPU_HAS_SPLIT 1
#else
#define MULTIGPU_HAS_SPLIT 0
#endif
/* ring transfers the host may issue before their predecessors finish */
#define MULTIGPU_RING_EVENTS 64
#endif /* MULTI_GPU */

typedef struct MultiGpu {
    int rank, world;
    int zero;          /* ZeRO-1: gradients reduced onto the shard's owner, parameters all-gathered */
    int overlap;       /* 1: per-layer reduction during the last micro-step's backward */
    size_t num_params; /* P */
    int num_layers;
    ParamLayout layout;
    int armed;         /* the running backward is the last micro-step's */
    int issued;        /* gradient groups handed to NCCL in this step */
    size_t device_bytes; /* device memory NCCL holds (communicator, connection buffers) */
    int nccl_version;    /* ncclGetVersion's code */
#ifdef MULTI_GPU
    ncclComm_t comm;
    int nonblocking;     /* created with blocking=0 (--collective-timeout): calls may answer ncclInProgress */
    ProcArrival phase;   /* the NCCL phase issued last, named when the GPU waits on it too long */
    cudaStream_t stream; /* collectives */
    cudaEvent_t ready;   /* compute -> collectives */
    cudaEvent_t done;    /* collectives -> compute */
    /* context parallelism (ring_degree > 1): this rank's group as a ring */
    int ring_degree, ring_member, ring_prev, ring_next; /* N, place, and the neighbours' world ranks */
    ncclComm_t ring_comm;
    cudaStream_t ring_stream;
    cudaEvent_t ring_ready[MULTIGPU_RING_EVENTS]; /* compute -> ring, before transfer k (slot k % MULTIGPU_RING_EVENTS) */
    cudaEvent_t ring_sent[MULTIGPU_RING_EVENTS];  /* ring -> compute, after it */
    const char* ring_what[MULTIGPU_RING_EVENTS];  /* the phase each transfer belongs to, for a timeout's line */
    long long ring_issued, ring_done;              /* transfers issued; those known finished (in order) */
    cudaEvent_t order_event;     /* recorded after the latest NCCL issue on order_stream (multigpu_ring_order_launch) */
    cudaStream_t order_stream;   /* the stream of the latest NCCL issue; NULL before any */
#endif
} MultiGpu;

/* ---- device choice (every build) ---- */

/* Makes device `local_rank` current. Returns it, or -1 when this rank has no
 * device; that is reported by multigpu_check_device once the flags are read,
 * so --help and --plan work without a GPU. Call before anything else touches
 * a device (cudaGetDeviceCount does not). */
static inline int multigpu_select_device(int devices) {
#ifndef USE_MPI
    /* mpirun or srun started this single-process build several times: each copy
     * would train alone and all would write the same files */
    const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}; /* OpenMPI; MPICH and srun --mpi=pmi2 */
    for (int i = 0; i < 2; i++) {
        const char* v = getenv(vars[i]);
        if (v && atoi(v) > 1)
            fail("started as one of %s processes (%s), but this train_gpt was built without MPI and NCCL; "
                 "rebuild with both present (see `make cuda-info`)", v, vars[i]);
    }
#else
    /* one write per error line, so that lines of ranks failing together do not interleave */
    if (remat_proc.world > 1) setvbuf(stderr, NULL, _IOLBF, BUFSIZ);
#endif
    int d = remat_proc.local_rank;
    if (devices <= 0 || d < 0 || d >= devices) return -1;
    CUDA_CHECK(cudaSetDevice(d));
    return d;
}

#ifdef MULTI_GPU
/* fail() hook for a failure every rank reaches together: all ranks print
 * their line before the job ends (MPI_Abort from the first would cut the
 * others off). */
static inline void multigpu_fail_together(void) {
    fflush(stderr);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
}
#endif

/* After the flags: stops when this rank has no device, with one line per
 * rank. Collective with MPI: every rank must call it. */
static inline void multigpu_check_device(int device, int devices, const char* why) {
    char err[600] = "";
    if (devices == GPU_BROKEN)
        snprintf(err, sizeof(err), "CUDA device unusable (%.255s)", why);
    else if (devices <= 0)
        snprintf(err, sizeof(err), "no CUDA device (%.255s); the CPU reference trainer is train_gpt_cpu", why);
    else if (device < 0) {
        const char* vis = getenv("CUDA_VISIBLE_DEVICES");
        snprintf(err, sizeof(err),
                 "no CUDA device for local rank %d: this node shows %d (CUDA_VISIBLE_DEVICES=%s); "
                 "start at most %d process%s per node, each seeing all of the node's GPUs",
                 remat_proc.local_rank, devices, vis ? vis : "unset", devices, devices == 1 ? "" : "es");
    }
#ifdef MULTI_GPU
    if (remat_proc.world > 1) {
        int bad = err[0] != '\0';
        int nbad = (int)proc_sum((double)bad, "the device check");
        if (nbad == 0) return;
        remat_fail_hook = multigpu_fail_together;
        if (bad) fail("%s", err);
        fail("stopping: %d of %d ranks have no usable CUDA device (their errors are above)", nbad, remat_proc.world);
    }
#else
    if (remat_proc.world > 1) fail("this CUDA trainer was built without NCCL: it runs as one process (%d started)", remat_proc.world);
#endif
    if (err[0]) fail("%s", err);
}

#ifdef MULTI_GPU

/* ---- waiting on the host ---- */

static inline const char* multigpu_last_error(MultiGpu* mg) {
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    const char* last = ncclGetLastError(mg->comm);
    return last ? last : "";
#else
    (void)mg;
    return "";
#endif
}

/* Both communicators (their pending work ends), before stopping the job. */
static inline void multigpu_abort_all(MultiGpu* mg) {
    if (mg->ring_comm) ncclCommAbort(mg->ring_comm);
    mg->ring_comm = NULL;
    ncclCommAbort(mg->comm); /* NULL (already aborted): NCCL returns at once */
    mg->comm = NULL;
}

/* An asynchronous error (a peer gone, a network failure): the stream would
 * never finish, so the communicator is aborted (which ends its pending work)
 * and fail() stops every rank (MPI_Abort) with the message. */
static inline void multigpu_fail_async(MultiGpu* mg, ncclResult_t async) {
    char why[512];
    const char* last = multigpu_last_error(mg);
    snprintf(why, sizeof(why), "%s%s%s", ncclGetErrorString(async), last[0] ? ": " : "", last);
    multigpu_abort_all(mg);
    fail("NCCL reported an asynchronous error while rank %d waited for its step: %s (NCCL_DEBUG=INFO tells more)", mg->rank, why);
}

/* --collective-timeout passed while this rank waited on NCCL. */
static inline void multigpu_fail_timeout(MultiGpu* mg, const char* why) {
    multigpu_abort_all(mg);
    proc_fail_inside(&mg->phase, why);
}

/* --collective-timeout passed while the GPU waited on the ring: one of the
 * two neighbours did not send or did not receive (ring_wait's words). */
static inline void multigpu_fail_ring_timeout(MultiGpu* mg) {
    multigpu_abort_all(mg);
    char whom[160];
    if (mg->ring_prev == mg->ring_next) snprintf(whom, sizeof(whom), "rank %d, the other member of this rank's context-parallel ring", mg->ring_prev);
    else snprintf(whom, sizeof(whom), "rank %d or rank %d, the previous and the next of this rank's context-parallel ring", mg->ring_prev, mg->ring_next);
    fail("waited more than %d s in %s (step %d) for %s: it is stuck, stopped or gone; communicators aborted, stopping the job "
         "(--collective-timeout)", proc_timeout_s, mg->ring_what[mg->ring_done % MULTIGPU_RING_EVENTS], proc_step, whom);
}

/* A call on a nonblocking communicator that answered ncclInProgress: polled
 * until NCCL settles (another call before that is not allowed), within
 * --collective-timeout. Returns the final result. */
static inline ncclResult_t multigpu_settle_on(MultiGpu* mg, ncclComm_t comm, ncclResult_t r) {
    double start = proc_clock_s();
    while (r == ncclInProgress) {
        if (proc_timed() && proc_clock_s() - start > proc_timeout_s)
            multigpu_fail_timeout(mg, "NCCL did not finish posting its work (a peer never joined it, or the network failed); communicator aborted");
        sched_yield();
        NCCL_CHECK(ncclCommGetAsyncError(comm, &r));
    }
    return r;
}
#define MG_CHECK(mg, call) nccl_check_impl(multigpu_settle_on((mg), (mg)->comm, (call)), #call, __FILE__, __LINE__)
#define MG_RING_CHECK(mg, call) nccl_check_impl(multigpu_settle_on((mg), (mg)->ring_comm, (call)), #call, __FILE__, __LINE__)

/* The GPU waits on NCCL alone on `stream`: the inputs of the work issued
 * there are ready (its last fork event is done), the stream is not. */
static inline int multigpu_waits_on(cudaEvent_t fork, cudaStream_t stream) {
    cudaError_t ready = cudaEventQuery(fork);
    if (ready == cudaErrorNotReady) return 0;
    CUDA_CHECK(ready);
    cudaError_t busy = cudaStreamQuery(stream);
    if (busy == cudaSuccess) return 0;
    if (busy != cudaErrorNotReady) CUDA_CHECK(busy);
    return 1;
}

/* The GPU waits on the ring: the oldest unfinished transfer (ring_done
 * moves past the finished ones) has its inputs ready. */
static inline int multigpu_waits_on_ring(MultiGpu* mg) {
    while (mg->ring_done < mg->ring_issued) {
        cudaError_t e = cudaEventQuery(mg->ring_sent[mg->ring_done % MULTIGPU_RING_EVENTS]);
        if (e == cudaErrorNotReady) break;
        CUDA_CHECK(e);
        mg->ring_done++;
    }
    if (mg->ring_done == mg->ring_issued) return 0;
    cudaError_t ready = cudaEventQuery(mg->ring_ready[mg->ring_done % MULTIGPU_RING_EVENTS]);
    if (ready == cudaErrorNotReady) return 0;
    CUDA_CHECK(ready);
    return 1;
}

static inline void multigpu_check_async(MultiGpu* mg, ncclComm_t comm) {
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm, &async));
    if (async != ncclSuccess && async != ncclInProgress) multigpu_fail_async(mg, async);
}

/* Waits until `stream` (whose work may wait on the collectives) is done while
 * watching the communicator for asynchronous errors, and with
 * --collective-timeout how long the GPU has waited on NCCL alone. A gap
 * between polls far beyond the yield is time this process did not run
 * (stopped, then resumed): it restarts the count. */
static inline void multigpu_wait(MultiGpu* mg, cudaStream_t stream) {
    if (!mg) {
        CUDA_CHECK(cudaStreamSynchronize(stream));
        return;
    }
    double on_nccl_since = 0.0, on_ring_since = 0.0, last = proc_clock_s();
    long long ring_waited = -1; /* the transfer on_ring_since times */
    for (;;) {
        cudaError_t e = cudaStreamQuery(stream);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) CUDA_CHECK(e);
        multigpu_check_async(mg, mg->comm);
        if (mg->ring_comm) multigpu_check_async(mg, mg->ring_comm);
        if (proc_timed()) {
            double now = proc_clock_s();
            int resumed = now - last > 0.5; /* this process did not run meanwhile: the count restarts */
            if (resumed || !multigpu_waits_on(mg->ready, mg->stream)) on_nccl_since = 0.0;
            else if (on_nccl_since == 0.0) on_nccl_since = now;
            else if (now - on_nccl_since > proc_timeout_s)
                multigpu_fail_timeout(mg, "this GPU waited on NCCL all that time (a peer stopped inside the collective, or the network failed); communicator aborted");
            if (resumed || !mg->ring_comm || !multigpu_waits_on_ring(mg)) on_ring_since = 0.0;
            else if (on_ring_since == 0.0 || ring_waited != mg->ring_done) { on_ring_since = now; ring_waited = mg->ring_done; }
            else if (now - on_ring_since > proc_timeout_s) multigpu_fail_ring_timeout(mg);
            last = now;
        }
        sched_yield();
    }
}

/* The host side of an NCCL phase: the arrival exchange of
 * --collective-timeout (nothing when off), and what to name if the GPU then
 * waits on it too long. */
static inline void multigpu_phase(MultiGpu* mg, const char* what) {
    proc_arrive(what);
    memset(&mg->phase, 0, sizeof(mg->phase));
    mg->phase.step = proc_step;
    snprintf(mg->phase.what, sizeof(mg->phase.what), "%s", what);
}

/* ---- setup and teardown ---- */

/* Device memory in use now (the context first, so that it is not counted as NCCL's). */
static inline size_t multigpu_device_used(void) {
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return total_b - free_b;
}

/* Message sizes of the warm-ups, in bytes: one in each of NCCL's protocol
 * ranges (LL below about 64 KiB, LL128 to a few MiB, Simple beyond), so
 * that every connection the run's collectives will make is made now. */
static const size_t multigpu_warm_bytes[3] = {512, (size_t)1 << 20, (size_t)16 << 20};

/* Every collective the trainer issues (all-reduce; ZeRO-1's reduce,
 * broadcast and all-gather), once at each warm-up size: since NCCL 2.22
 * (NCCL_RUNTIME_CONNECT=1) an algorithm's buffers are connected at its
 * first use, so without this they would be allocated inside the first
 * step, after the budget of -r auto and --plan was measured. */
static inline void multigpu_warm_collectives(MultiGpu* mg) {
    size_t most = multigpu_warm_bytes[2];
    char* warm = NULL;
    CUDA_CHECK(cudaMalloc((void**)&warm, most));
    CUDA_CHECK(cudaMemsetAsync(warm, 0, most, mg->stream));
    multigpu_phase(mg, "the NCCL warm-up collectives");
    for (int i = 0; i < 3; i++) {
        size_t n = multigpu_warm_bytes[i] / sizeof(floatX), per = n / (size_t)mg->world;
        MG_CHECK(mg, ncclAllReduce(warm, warm, n, NCCL_FLOATX, ncclSum, mg->comm, mg->stream));
        MG_CHECK(mg, ncclReduce(warm, warm, n, NCCL_FLOATX, ncclSum, 0, mg->comm, mg->stream));
        MG_CHECK(mg, ncclBroadcast(warm, warm, n, NCCL_FLOATX, 0, mg->comm, mg->stream));
        if (per) MG_CHECK(mg, ncclAllGather(warm + (size_t)mg->rank * per * sizeof(floatX), warm, per, NCCL_FLOATX, mg->comm, mg->stream));
    }
    multigpu_wait(mg, mg->stream);
    CUDA_CHECK(cudaFree(warm));
}

/* Joins every rank into one NCCL communicator (all ranks, even alone, so the
 * NCCL path is the one that runs) and warms up every collective at every
 * size range (multigpu_warm_collectives). Before the plan is made, so that
 * the budget is what is left beside NCCL; device_bytes is what NCCL took.
 * Every rank must call it (after multigpu_check_device). Returns mg. */
static inline MultiGpu* multigpu_connect(MultiGpu* mg) {
    memset(mg, 0, sizeof(*mg));
    mg->rank = remat_proc.rank;
    mg->world = remat_proc.world;
    CUDA_CHECK(cudaFree(0)); /* the context first, so that it is not counted as NCCL's */
    size_t used_before = multigpu_device_used();
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    if (mg->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    proc_broadcast(&id, sizeof(id), "the NCCL id broadcast");
#if MULTIGPU_HAS_NONBLOCKING
    if (proc_timed()) {
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        mg->nonblocking = 1;
        multigpu_phase(mg, "the NCCL communicator setup");
        MG_CHECK(mg, ncclCommInitRankConfig(&mg->comm, mg->world, id, mg->rank, &config));
    } else
#endif
        NCCL_CHECK(ncclCommInitRank(&mg->comm, mg->world, id, mg->rank));
    int least = 0, greatest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CUDA_CHECK(cudaStreamCreateWithPriority(&mg->stream, cudaStreamNonBlocking, greatest));
    CUDA_CHECK(cudaEventCreateWithFlags(&mg->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&mg->done, cudaEventDisableTiming));
    multigpu_warm_collectives(mg);
    size_t used = multigpu_device_used();
    mg->device_bytes = used > used_before ? used - used_before : 0;
    NCCL_CHECK(ncclGetVersion(&mg->nccl_version));
    return mg;
}

/* Context parallelism: this rank's group of N as a ring (collective over all
 * ranks, N > 1 only). The ring communicator inherits the first one's
 * configuration (nonblocking with --collective-timeout). */
static inline void multigpu_ring_connect(MultiGpu* mg, const ContextGroups* g) {
    mg->ring_degree = g->group_size;
    mg->ring_member = g->member;
    int base = g->group * g->group_size;
    mg->ring_prev = base + (g->member + g->group_size - 1) % g->group_size;
    mg->ring_next = base + (g->member + 1) % g->group_size;
    multigpu_phase(mg, "the NCCL ring communicator setup");
#if MULTIGPU_HAS_SPLIT
    /* A nonblocking parent (--collective-timeout) answers ncclInProgress and
     * leaves ring_comm NULL until the split completes (NCCL's src/init.cc),
     * so the parent is what is polled, as NCCL's user guide does; polling
     * the NULL new communicator answers ncclInvalidArgument. */
    MG_CHECK(mg, ncclCommSplit(mg->comm, g->group, g->member, &mg->ring_comm, NULL));
    if (!mg->ring_comm) fail("internal: ncclCommSplit completed without a ring communicator for rank %d", mg->rank);
#else
    fail("--context-parallel needs NCCL 2.18 or newer (ncclCommSplit); this build's nccl.h is %d.%d.%d", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
#endif
    int n = 0, me = -1;
    NCCL_CHECK(ncclCommCount(mg->ring_comm, &n));
    NCCL_CHECK(ncclCommUserRank(mg->ring_comm, &me));
    if (n != g->group_size || me != g->member) fail("internal: the ring communicator has rank %d of %d, not member %d of %d", me, n, g->member, g->group_size);
    int least = 0, greatest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CUDA_CHECK(cudaStreamCreateWithPriority(&mg->ring_stream, cudaStreamNonBlocking, greatest));
    for (int i = 0; i < MULTIGPU_RING_EVENTS; i++) {
        CUDA_CHECK(cudaEventCreateWithFlags(&mg->ring_ready[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&mg->ring_sent[i], cudaEventDisableTiming));
    }
    CUDA_CHECK(cudaEventCreateWithFlags(&mg->order_event, cudaEventDisableTiming));
}


/* The plan's part: which gradients go where (num_params of the model cfg,
 * sharded under ZeRO-1 when `zero`), and the ring of `context_parallel`
 * members. After multigpu_connect. The trainer reads these off its plan, so
 * that the transport does not include the planner. */
static inline void multigpu_configure(MultiGpu* mg, const ModelConfig* cfg, size_t num_params, int zero, int context_parallel) {
    mg->zero = zero;
    mg->num_params = num_params;
    mg->num_layers = cfg->num_layers;
    param_layout(cfg, &mg->layout);
    if (mg->layout.total != mg->num_params) fail("internal: parameter layout and plan disagree");
    const char* ov = getenv("REMAT_NCCL_OVERLAP");
    mg->overlap = !(ov && strcmp(ov, "0") == 0);
    proc_broadcast(&mg->overlap, sizeof(mg->overlap), "the REMAT_NCCL_OVERLAP broadcast"); /* the same collectives on every rank */
    int v = mg->nccl_version;
    printf("data parallel: %d process%s, NCCL %d.%d.%d (%.1f MiB of device memory), %s; gradients %s %s\n", mg->world,
           mg->world == 1 ? "" : "es", v / 10000, (v % 10000) / 100, v % 100, mib(mg->device_bytes),
           mg->zero ? "ZeRO-1 (optimizer state and master weights sharded, parameters all-gathered)" : "no sharding",
           mg->zero ? "reduced onto their shard's rank" : "all-reduced",
           mg->overlap ? "per layer during the last micro-step's backward" : "after the backward (REMAT_NCCL_OVERLAP=0)");
    int N = context_parallel;
    if (N == 1) return;
    ContextGroups g = context_groups(N, mg->rank, mg->world);
    if (!mg->ring_comm) multigpu_ring_connect(mg, &g); /* else connected before the budget (multigpu_ring_connect_early) */
    printf("context parallel: NCCL ring of %d in each group (a communicator split from the first), its own stream\n", N);
}

static inline void multigpu_free(MultiGpu* mg) {
    if (!mg) return;
    multigpu_wait(mg, mg->stream);
    if (mg->ring_comm) {
        multigpu_wait(mg, mg->ring_stream);
#if MULTIGPU_HAS_NONBLOCKING
        if (mg->nonblocking) MG_RING_CHECK(mg, ncclCommFinalize(mg->ring_comm));
#endif
        NCCL_CHECK(ncclCommDestroy(mg->ring_comm));
        for (int i = 0; i < MULTIGPU_RING_EVENTS; i++) {
            CUDA_CHECK(cudaEventDestroy(mg->ring_ready[i]));
            CUDA_CHECK(cudaEventDestroy(mg->ring_sent[i]));
        }
        CUDA_CHECK(cudaStreamDestroy(mg->ring_stream));
        CUDA_CHECK(cudaEventDestroy(mg->order_event));
    }
#if MULTIGPU_HAS_NONBLOCKING
    if (mg->nonblocking) MG_CHECK(mg, ncclCommFinalize(mg->comm)); /* then destroy frees without blocking */
#endif
    NCCL_CHECK(ncclCommDestroy(mg->comm));
    CUDA_CHECK(cudaEventDestroy(mg->ready));
    CUDA_CHECK(cudaEventDestroy(mg->done));
    CUDA_CHECK(cudaStreamDestroy(mg->stream));
    memset(mg, 0, sizeof(*mg));
}

/* ---- ordering between the compute stream and the collectives ---- */

static inline void multigpu_fork(MultiGpu* mg, cudaStream_t compute) {
    CUDA_CHECK(cudaEventRecord(mg->ready, compute));
    CUDA_CHECK(cudaStreamWaitEvent(mg->stream, mg->ready, 0));
}

static inline void multigpu_join(MultiGpu* mg, cudaStream_t compute) {
    CUDA_CHECK(cudaEventRecord(mg->done, mg->stream));
    CUDA_CHECK(cudaStreamWaitEvent(compute, mg->done, 0));
}

/* ---- the two communicators' launches in one order ----
 * With context parallelism two communicators issue work on two streams (the
 * data-parallel sum of layer l while the ring runs for layer l-1). NCCL's
 * kernels wait on their peers while occupying the GPU, and NCCL documents
 * concurrent communicators as able to deadlock unless their operations are
 * ordered: a GPU may run the two in a different order than its peers do.
 * Each NCCL issue waits for the previous issue on the other stream (an event
 * recorded after it), so every rank's GPU runs them in the host's order,
 * which is the same on every rank (the same plan, the same program). It
 * costs the overlap of the two communicators' transfers with each other,
 * not their overlap with compute. NCCL 2.26's NCCL_LAUNCH_ORDER_IMPLICIT=1
 * would do the same inside NCCL; this works on every version. One
 * communicator (no ring): nothing to order. */
static inline void multigpu_ring_order_launch(MultiGpu* mg, cudaStream_t s) {
    if (!mg->ring_comm) return;
    if (mg->order_stream && mg->order_stream != s) CUDA_CHECK(cudaStreamWaitEvent(s, mg->order_event, 0));
}

static inline void multigpu_ring_order_issued(MultiGpu* mg, cudaStream_t s) {
    if (!mg->ring_comm) return;
    CUDA_CHECK(cudaEventRecord(mg->order_event, s));
    mg->order_stream = s;
}

/* ---- gradients ---- */

/* Sums n slices [off[i], off[i] + cnt[i]) of the gradient buffer across
 * ranks, as one NCCL group: in place everywhere, or (ZeRO-1) onto the rank
 * whose shard holds each piece. */
static inline void multigpu_reduce_slices(MultiGpu* mg, floatX* grads, const size_t* off, const size_t* cnt, int n) {
    multigpu_ring_order_launch(mg, mg->stream);
    NCCL_CHECK(ncclGroupStart());
    for (int i = 0; i < n; i++) {
        if (cnt[i] == 0) continue;
        if (off[i] + cnt[i] > mg->num_params) fail("internal: gradient slice past the buffer");
        if (!mg->zero) {
            floatX* g = grads + off[i];
            MG_CHECK(mg, ncclAllReduce(g, g, cnt[i], NCCL_FLOATX, ncclSum, mg->comm, mg->stream));
            continue;
        }
        for (int r = 0; r < mg->world; r++) {
            size_t s, c;
            shard_range(mg->num_params, mg->world, r, &s, &c);
            size_t lo = s > off[i] ? s : off[i];
            size_t hi = s + c < off[i] + cnt[i] ? s + c : off[i] + cnt[i];
            if (lo >= hi) continue;
            MG_CHECK(mg, ncclReduce(grads + lo, grads + lo, hi - lo, NCCL_FLOATX, ncclSum, r, mg->comm, mg->stream));
        }
    }
    MG_CHECK(mg, ncclGroupEnd());
    multigpu_ring_order_issued(mg, mg->stream);
}

/* The same words as the CPU trainer's MPI collectives. */
static inline const char* multigpu_reduction_name(const MultiGpu* mg) {
    return mg->zero ? "the gradient reduction onto shards" : "the gradient all-reduce";
}

/* Start of each step (the driver zeroes the gradients first). */
static inline void multigpu_new_step(MultiGpu* mg) {
    if (!mg) return;
    mg->armed = 0;
    mg->issued = 0;
}

/* Start of each micro-step's forward and backward: arms the per-layer hook
 * for the step's last one. */
static inline void multigpu_micro_step(MultiGpu* mg, int last_micro_step) {
    if (!mg) return;
    mg->armed = mg->overlap && last_micro_step;
}

/* In the armed backward: the gradients of `layer` (0..L-1), or with layer -1
 * of the tensors outside the blocks (wte, wpe, lnfw, lnfb), are final. */
static inline void multigpu_grads_ready(MultiGpu* mg, floatX* grads, int layer, cudaStream_t compute) {
    if (!mg || !mg->armed) return;
    size_t off[NUM_PARAM_TENSORS], cnt[NUM_PARAM_TENSORS];
    int n = param_group_slices(&mg->layout, mg->num_layers, layer, off, cnt);
    if (mg->issued == 0) multigpu_phase(mg, multigpu_reduction_name(mg));
    multigpu_fork(mg, compute);
    multigpu_reduce_slices(mg, grads, off, cnt, n);
    mg->issued++;
}

/* Whether the gradients of the group multigpu_grads_ready was last given are
 * final once the work issued so far on *on is done: the collectives' stream
 * when it issued their reduction (the armed backward); without NCCL the
 * compute stream itself (which may be the legacy default stream, 0). 0 when
 * the reductions wait for multigpu_sync_grads (REMAT_NCCL_OVERLAP=0, an
 * earlier micro-step). The offloaded optimizer copies each layer's shard
 * down after it (optimizer_offload.cuh). */
static inline int multigpu_grads_final_on(const MultiGpu* mg, cudaStream_t compute, cudaStream_t* on) {
    *on = mg ? mg->stream : compute;
    return !mg || mg->armed;
}

/* After the last micro-step: the reductions not yet issued (all of them
 * without overlap), then later compute waits for them all. */
static inline void multigpu_sync_grads(MultiGpu* mg, floatX* grads, cudaStream_t compute) {
    if (!mg) return;
    if (mg->issued == 0) {
        size_t off = 0, cnt = mg->num_params;
        multigpu_phase(mg, multigpu_reduction_name(mg));
        multigpu_fork(mg, compute);
        multigpu_reduce_slices(mg, grads, &off, &cnt, 1);
    } else if (mg->issued != mg->num_layers + 1) {
        fail("internal: %d of %d gradient groups reduced before sync_grads", mg->issued, mg->num_layers + 1);
    }
    multigpu_join(mg, compute);
    mg->armed = 0;
    mg->issued = 0;
}

/* ---- the context-parallel ring ---- */

/* `bytes` of send to member r+1 and as many from member r-1 into recv, one
 * group (posted together: every member sends and receives at once, so none
 * waits in its send), on the ring stream, after the compute work issued so
 * far on `compute`. `what` names the phase for a timeout. */
static inline void multigpu_ring_pass(MultiGpu* mg, cudaStream_t compute, const void* send, void* recv, size_t bytes, const char* what) {
    if (mg->ring_issued - mg->ring_done == MULTIGPU_RING_EVENTS) { /* every event pair in use: the oldest transfer must finish */
        multigpu_wait(mg, mg->ring_stream);
        mg->ring_done = mg->ring_issued;
    }
    int k = (int)(mg->ring_issued % MULTIGPU_RING_EVENTS);
    CUDA_CHECK(cudaEventRecord(mg->ring_ready[k], compute));
    CUDA_CHECK(cudaStreamWaitEvent(mg->ring_stream, mg->ring_ready[k], 0));
    int next = (mg->ring_member + 1) % mg->ring_degree, prev = (mg->ring_member + mg->ring_degree - 1) % mg->ring_degree;
    multigpu_ring_order_launch(mg, mg->ring_stream);
    NCCL_CHECK(ncclGroupStart());
    MG_RING_CHECK(mg, ncclSend(send, bytes, ncclUint8, next, mg->ring_comm, mg->ring_stream));
    MG_RING_CHECK(mg, ncclRecv(recv, bytes, ncclUint8, prev, mg->ring_comm, mg->ring_stream));
    MG_RING_CHECK(mg, ncclGroupEnd());
    multigpu_ring_order_issued(mg, mg->ring_stream);
    CUDA_CHECK(cudaEventRecord(mg->ring_sent[k], mg->ring_stream));
    mg->ring_what[k] = what;
    mg->ring_issued++;
}

/* Compute issued next waits for every transfer issued so far. */
static inline void multigpu_ring_join(MultiGpu* mg, cudaStream_t compute) {
    if (mg->ring_issued == 0) return;
    CUDA_CHECK(cudaStreamWaitEvent(compute, mg->ring_sent[(mg->ring_issued - 1) % MULTIGPU_RING_EVENTS], 0));
}

/* The ring's link from a message of its own (REMAT_PROFILE_COST_MODEL, after
 * the profiled step, compute idle): a one-byte exchange lines the members up,
 * then `bytes` go to the next member while as many arrive from the previous
 * one, timed between two events on the ring stream; added to *t. Timing the
 * step's own transfers would measure how late a neighbour was as much as the
 * link. Every member of the group calls it with the same bytes. */
static inline void multigpu_time_ring(MultiGpu* mg, cudaStream_t compute, const void* send, void* recv, size_t bytes, LinkTimes* t) {
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    multigpu_ring_pass(mg, compute, send, recv, 1, "the ring's link timing");
    multigpu_wait(mg, mg->ring_stream);
    CUDA_CHECK(cudaEventRecord(start, mg->ring_stream));
    multigpu_ring_pass(mg, compute, send, recv, bytes, "the ring's link timing");
    CUDA_CHECK(cudaEventRecord(stop, mg->ring_stream));
    multigpu_wait(mg, mg->ring_stream);
    mg->ring_done = mg->ring_issued;
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ms > 0.0f) link_times_add(t, (double)bytes, 1e-3 * (double)ms);
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
}

/* The ring before the budget is measured (the GPU trainer's budget hook,
 * with --context-parallel N > 1): split, then one send/receive pass at each
 * warm-up size, so that its communicator and connection buffers are in
 * device_bytes and outside the budget. Collective over all ranks. */
static inline void multigpu_ring_connect_early(MultiGpu* mg, int group_size) {
    if (group_size <= 1 || mg->ring_comm || mg->world % group_size != 0) return;
    size_t used_before = multigpu_device_used();
    ContextGroups g = context_groups(group_size, mg->rank, mg->world);
    multigpu_ring_connect(mg, &g);
    size_t most = multigpu_warm_bytes[2];
    char* warm = NULL;
    CUDA_CHECK(cudaMalloc((void**)&warm, 2 * most));
    CUDA_CHECK(cudaMemsetAsync(warm, 0, 2 * most, mg->ring_stream)); /* on the ring's stream: no compute involved */
    for (int i = 0; i < 3; i++) multigpu_ring_pass(mg, 0, warm, warm + most, multigpu_warm_bytes[i], "the NCCL ring warm-up");
    multigpu_wait(mg, mg->ring_stream);
    mg->ring_done = mg->ring_issued;
    CUDA_CHECK(cudaFree(warm));
    size_t used = multigpu_device_used();
    mg->device_bytes += used > used_before ? used - used_before : 0;
}

/* ---- parameters (ZeRO-1) ---- */

/* After each rank updated its shard of params: every shard to every rank. */
static inline void multigpu_gather_params(MultiGpu* mg, floatX* params, cudaStream_t compute) {
    if (!mg || !mg->zero) return;
    size_t P = mg->num_params, per = ceil_div(P, (size_t)mg->world);
    multigpu_phase(mg, "the parameter all-gather");
    multigpu_fork(mg, compute);
    multigpu_ring_order_launch(mg, mg->stream);
    if (per * (size_t)mg->world == P) {
        MG_CHECK(mg, ncclAllGather(params + (size_t)mg->rank * per, params, per, NCCL_FLOATX, mg->comm, mg->stream));
    } else {
        NCCL_CHECK(ncclGroupStart());
        for (int r = 0; r < mg->world; r++) {
            size_t s, c;
            shard_range(P, mg->world, r, &s, &c);
            if (c) MG_CHECK(mg, ncclBroadcast(params + s, params + s, c, NCCL_FLOATX, r, mg->comm, mg->stream));
        }
        MG_CHECK(mg, ncclGroupEnd());
    }
    multigpu_ring_order_issued(mg, mg->stream);
    multigpu_join(mg, compute);
}

#else /* !MULTI_GPU: one process, nothing to do */

static inline MultiGpu* multigpu_connect(MultiGpu* mg) {
    (void)mg;
    return NULL;
}
static inline void multigpu_configure(MultiGpu* mg, const ModelConfig* cfg, size_t num_params, int zero, int context_parallel) {
    (void)mg;
    (void)cfg;
    (void)num_params;
    (void)zero;
    (void)context_parallel;
}
static inline void multigpu_free(MultiGpu* mg) { (void)mg; }
static inline void multigpu_ring_connect_early(MultiGpu* mg, int group_size) { (void)mg; (void)group_size; }
static inline void multigpu_wait(MultiGpu* mg, cudaStream_t stream) {
    (void)mg;
    CUDA_CHECK(cudaStreamSynchronize(stream));
}
static inline void multigpu_new_step(MultiGpu* mg) { (void)mg; }
static inline void multigpu_micro_step(MultiGpu* mg, int last_micro_step) { (void)mg; (void)last_micro_step; }
static inline void multigpu_grads_ready(MultiGpu* mg, floatX* grads, int layer, cudaStream_t compute) {
    (void)mg;
    (void)grads;
    (void)layer;
    (void)compute;
}
static inline void multigpu_sync_grads(MultiGpu* mg, floatX* grads, cudaStream_t compute) {
    (void)mg;
    (void)grads;
    (void)compute;
}
static inline int multigpu_grads_final_on(const MultiGpu* mg, cudaStream_t compute, cudaStream_t* on) {
    (void)mg;
    *on = compute;
    return 1;
}
static inline void multigpu_gather_params(MultiGpu* mg, floatX* params, cudaStream_t compute) {
    (void)mg;
    (void)params;
    (void)compute;
}
/* context parallelism needs N > 1 processes, which a build without MULTI_GPU refuses (multigpu_check_device) */
static inline void multigpu_ring_join(MultiGpu* mg, cudaStream_t compute) {
    (void)mg;
    (void)compute;
    fail("internal: the context-parallel ring needs a MULTI_GPU build");
}
static inline void multigpu_ring_pass(MultiGpu* mg, cudaStream_t compute, const void* send, void* recv, size_t bytes, const char* what) {
    (void)send;
    (void)recv;
    (void)bytes;
    (void)what;
    multigpu_ring_join(mg, compute);
}
static inline void multigpu_time_ring(MultiGpu* mg, cudaStream_t compute, const void* send, void* recv, size_t bytes, LinkTimes* t) {
    (void)send; (void)recv; (void)bytes; (void)t;
    multigpu_ring_join(mg, compute);
}

#endif /* MULTI_GPU */

#endif
