/*
 * Host-only test of llmc/cuda/multigpu.cuh's collective schedule, with NCCL and the
 * CUDA event calls stubbed (no GPU, no libnccl): for world sizes 1, 2, 3, 7, 8
 * (ragged shards included), ZeRO 0 and 1, overlap on and off, 1 and 3
 * micro-steps, every rank issues the same collectives in the same order (NCCL
 * requires it), every gradient element is reduced exactly once per step and
 * never past the buffer, ZeRO-1 pieces land on their shard's owner, the
 * all-gather covers every parameter once, and the per-layer path issues L+1
 * groups. Also multigpu_wait, with the stream's progress and NCCL's async
 * error state stubbed: it returns once the stream is done, and with
 * `wait-error` as argument it stops with a message naming the NCCL error
 * after aborting the communicator (exit 1). With --collective-timeout (1 s
 * here): a GPU waiting on NCCL alone past it aborts and stops naming the
 * other rank (`wait-timeout`), a long compute with NCCL done does not, a
 * nonblocking call answering ncclInProgress is polled until it settles, or
 * aborts past the deadline (`settle-timeout`).
 * Run by dev/test/test_multigpu_schedule.py (`make test`); by hand:
 *   nvcc -std=c++17 -I. -DENABLE_BF16 -DUSE_MPI -DMULTI_GPU -DOMPI_SKIP_MPICXX $(mpicc --showme:compile) \
 *        -o build/test_multigpu dev/test/test_multigpu.cu $(mpicc --showme:link) && build/test_multigpu
 */
#include "llmc/cuda/cuda_common.cuh"
#include <nccl.h>
#include <vector>
#include <string>
static int stub_ok(void) { return 0; }
#define cudaEventRecord(e, s) ((void)(e), (void)(s), (cudaError_t)stub_ok())
#define cudaStreamWaitEvent(s, e, f) ((void)(s), (void)(e), (void)(f), (cudaError_t)stub_ok())
/* multigpu_wait's view of the GPU: the stream finishes after stream_busy_polls
 * queries; NCCL reports nccl_async_error from the nccl_error_after-th check on */
static int stream_busy_polls, stream_queries, nccl_error_after = -1, nccl_checks, nccl_aborts;
static ncclResult_t nccl_async_error = ncclSystemError;
/* --collective-timeout's view: the collective stream (COLLECTIVES) is busy
 * while nccl_busy; the compute stream busy until compute_busy_until_s on the
 * clock when set; ncclCommGetAsyncError answers ncclInProgress
 * nccl_in_progress_checks times (-1: forever) */
#define COLLECTIVES ((cudaStream_t)0x1)
static int nccl_busy, nccl_in_progress_checks;
static double compute_busy_until_s;
static double stub_clock_s(void);
static cudaError_t stub_stream_query(cudaStream_t s) {
    if (s == COLLECTIVES) return nccl_busy ? cudaErrorNotReady : cudaSuccess;
    if (compute_busy_until_s > 0) return stub_clock_s() < compute_busy_until_s ? cudaErrorNotReady : cudaSuccess;
    return stream_queries++ < stream_busy_polls ? cudaErrorNotReady : cudaSuccess;
}
#define cudaStreamQuery(s) stub_stream_query(s)
#define cudaEventQuery(e) ((void)(e), cudaSuccess)
#include "llmc/cuda/multigpu.cuh"
static double stub_clock_s(void) { return proc_clock_s(); }

struct Call { std::string op; size_t off, cnt; int root; };
static std::vector<Call> calls;
static floatX* base;
extern "C" {
const char* ncclGetLastError(ncclComm_t) { return "peer 3 unreachable"; }
const char* ncclGetErrorString(ncclResult_t) { return "stub"; }
ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t* err) {
    if (nccl_in_progress_checks != 0) {
        if (nccl_in_progress_checks > 0) nccl_in_progress_checks--;
        *err = ncclInProgress;
        return ncclSuccess;
    }
    *err = nccl_error_after >= 0 && nccl_checks++ >= nccl_error_after ? nccl_async_error : ncclSuccess;
    return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t) { nccl_aborts++; printf("stub: ncclCommAbort\n"); fflush(stdout); return ncclSuccess; }
ncclResult_t ncclGroupStart() { calls.push_back({"start", 0, 0, -1}); return ncclSuccess; }
ncclResult_t ncclGroupEnd() { calls.push_back({"end", 0, 0, -1}); return ncclSuccess; }
ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) {
    if (s != r) abort(); calls.push_back({"allreduce", (size_t)((floatX*)r - base), n, -1}); return ncclSuccess; }
ncclResult_t ncclReduce(const void* s, void* r, size_t n, ncclDataType_t, ncclRedOp_t, int root, ncclComm_t, cudaStream_t) {
    if (s != r) abort(); calls.push_back({"reduce", (size_t)((floatX*)r - base), n, root}); return ncclSuccess; }
ncclResult_t ncclAllGather(const void* s, void* r, size_t n, ncclDataType_t, ncclComm_t, cudaStream_t) {
    calls.push_back({"allgather", (size_t)((const floatX*)s - (floatX*)r), n, -1}); if (r != base) abort(); return ncclSuccess; }
ncclResult_t ncclBroadcast(const void* s, void* r, size_t n, ncclDataType_t, int root, ncclComm_t, cudaStream_t) {
    if (s != r) abort(); calls.push_back({"bcast", (size_t)((floatX*)r - base), n, root}); return ncclSuccess; }
}

static std::vector<Call> simulate(ModelConfig cfg, int world, int rank, int zero, int overlap, int accum) {
    calls.clear();
    MultiGpu mg; memset(&mg, 0, sizeof(mg));
    mg.rank = rank; mg.world = world; mg.zero = zero; mg.overlap = overlap;
    param_layout(&cfg, &mg.layout); mg.num_params = mg.layout.total; mg.num_layers = cfg.num_layers;
    base = (floatX*)0x100000; // never dereferenced
    for (int step = 0; step < 2; step++) {
        multigpu_new_step(&mg);
        for (int a = 0; a < accum; a++) {
            multigpu_micro_step(&mg, a == accum - 1);
            for (int l = cfg.num_layers - 1; l >= 0; l--) multigpu_grads_ready(&mg, base, l, 0);
            multigpu_grads_ready(&mg, base, -1, 0);
        }
        multigpu_sync_grads(&mg, base, 0);
        multigpu_gather_params(&mg, base, 0);
    }
    return calls;
}

/* multigpu_wait on a healthy communicator: returns when the stream is done, having polled NCCL meanwhile. */
static int check_wait(void) {
    MultiGpu mg; memset(&mg, 0, sizeof(mg));
    stream_busy_polls = 5; stream_queries = 0; nccl_error_after = -1; nccl_checks = 0;
    multigpu_wait(&mg, 0);
    if (stream_queries != 6 || nccl_aborts != 0) { printf("FAIL multigpu_wait: %d queries, %d aborts\n", stream_queries, nccl_aborts); return 1; }
    return 0;
}

/* multigpu_wait when NCCL reports an error while the stream is still busy: must not return. */
static int wait_error(void) {
    MultiGpu mg; memset(&mg, 0, sizeof(mg));
    mg.rank = 2;
    stream_busy_polls = 1000000; stream_queries = 0; nccl_error_after = 3; nccl_checks = 0;
    multigpu_wait(&mg, 0);
    printf("FAIL multigpu_wait returned although NCCL reported an error\n");
    return 1;
}

/* A two-rank job with --collective-timeout 1 s, in the gradient all-reduce of step 7. */
static MultiGpu timed_job(void) {
    MultiGpu mg; memset(&mg, 0, sizeof(mg));
    remat_proc.world = 2;
    mg.rank = 0; mg.world = 2; mg.stream = COLLECTIVES; mg.nonblocking = 1;
    proc_timeout_s = 1;
    mg.phase.step = 7;
    snprintf(mg.phase.what, sizeof(mg.phase.what), "the gradient all-reduce");
    return mg;
}

/* The GPU waits on NCCL alone for longer than the timeout: must not return. */
static int wait_timeout(void) {
    MultiGpu mg = timed_job();
    nccl_busy = 1; stream_busy_polls = 1 << 30; stream_queries = 0;
    multigpu_wait(&mg, 0);
    printf("FAIL multigpu_wait returned although NCCL never finished\n");
    return 1;
}

/* A nonblocking call that never settles: must not return. */
static int settle_timeout(void) {
    MultiGpu mg = timed_job();
    nccl_in_progress_checks = -1;
    MG_CHECK(&mg, ncclInProgress);
    printf("FAIL MG_CHECK returned although NCCL stayed in progress\n");
    return 1;
}

/* With the timeout on: compute longer than the timeout while NCCL is done is
 * no timeout; a call answering ncclInProgress a few times settles. */
static int check_timed(void) {
    MultiGpu mg = timed_job();
    int fails = 0;
    nccl_busy = 0; compute_busy_until_s = proc_clock_s() + 1.5;
    multigpu_wait(&mg, 0);
    compute_busy_until_s = 0;
    nccl_in_progress_checks = 5;
    MG_CHECK(&mg, ncclInProgress);
    if (nccl_in_progress_checks != 0 || nccl_aborts != 0) { printf("FAIL timed waits: %d checks left, %d aborts\n", nccl_in_progress_checks, nccl_aborts); fails++; }
    remat_proc.world = 1; proc_timeout_s = 0;
    return fails;
}

int main(int argc, char** argv) {
    if (argc > 1 && strcmp(argv[1], "wait-error") == 0) return wait_error();
    if (argc > 1 && strcmp(argv[1], "wait-timeout") == 0) return wait_timeout();
    if (argc > 1 && strcmp(argv[1], "settle-timeout") == 0) return settle_timeout();
    int fails = check_wait() + check_timed();
    int Ls[] = {1, 2, 3};
    int worlds[] = {1, 2, 3, 7, 8};
    for (int L : Ls) for (int world : worlds) for (int zero = 0; zero < 2; zero++) for (int overlap = 0; overlap < 2; overlap++) for (int accum = 1; accum <= 3; accum += 2) {
        ModelConfig cfg; memset(&cfg, 0, sizeof(cfg));
        cfg.num_layers = L; cfg.channels = 8 * (world == 7 ? 3 : 1); cfg.num_heads = 2; cfg.max_seq_len = 5; cfg.vocab_size = 13; cfg.padded_vocab_size = 128;
        ParamLayout pl; param_layout(&cfg, &pl); size_t P = pl.total;
        std::vector<Call> ref = simulate(cfg, world, 0, zero, overlap, accum);
        for (int r = 1; r < world; r++) {
            std::vector<Call> c = simulate(cfg, world, r, zero, overlap, accum);
            bool same = c.size() == ref.size();
            for (size_t i = 0; same && i < c.size(); i++) same = c[i].op == ref[i].op && c[i].cnt == ref[i].cnt && c[i].root == ref[i].root && (c[i].op == "allgather" || c[i].off == ref[i].off);
            if (!same) { printf("FAIL order differs: L=%d world=%d zero=%d overlap=%d rank %d\n", L, world, zero, overlap, r); fails++; }
        }
        for (int r = 0; r < world; r++) {
            std::vector<Call> c = simulate(cfg, world, r, zero, overlap, accum);
            // first step only: until the first allgather or, without zero, half the calls
            std::vector<int> red(P, 0), gat(P, 0);
            int groups = 0, depth = 0; size_t half = c.size() / 2;
            for (size_t i = 0; i < half; i++) {
                const Call& k = c[i];
                if (k.op == "start") { if (depth++) { printf("FAIL nested group\n"); fails++; } groups++; continue; }
                if (k.op == "end") { depth--; continue; }
                if (k.op == "allgather") { if (k.off != (size_t)r * k.cnt || k.cnt * world != P) { printf("FAIL allgather\n"); fails++; } for (size_t j = 0; j < P; j++) gat[j]++; continue; }
                if (k.off + k.cnt > P || k.cnt == 0) { printf("FAIL range past buffer\n"); fails++; continue; }
                if (k.op == "bcast") { size_t s, n; shard_range(P, world, k.root, &s, &n); if (k.off != s || k.cnt != n) { printf("FAIL bcast shard\n"); fails++; } for (size_t j = k.off; j < k.off + k.cnt; j++) gat[j]++; continue; }
                if (k.op == "reduce") { size_t s, n; shard_range(P, world, k.root, &s, &n); if (k.off < s || k.off + k.cnt > s + n) { printf("FAIL reduce outside root shard\n"); fails++; } }
                if ((k.op == "reduce") != (zero == 1)) { printf("FAIL op kind\n"); fails++; }
                for (size_t j = k.off; j < k.off + k.cnt; j++) red[j]++;
            }
            for (size_t j = 0; j < P; j++) if (red[j] != 1 || gat[j] != (zero ? 1 : 0)) { printf("FAIL coverage L=%d world=%d zero=%d overlap=%d elem %zu red %d gat %d\n", L, world, zero, overlap, j, red[j], gat[j]); fails++; break; }
            int want_groups = (overlap ? L + 1 : 1) + (zero && P % world ? 1 : 0);
            if (groups != want_groups) { printf("FAIL groups %d want %d (L=%d world=%d zero=%d overlap=%d)\n", groups, want_groups, L, world, zero, overlap); fails++; }
        }
    }
    printf("%s (%d failures)\n", fails ? "FAILED" : "all ok", fails);
    return fails != 0;
}
