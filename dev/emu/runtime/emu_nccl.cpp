/*
 * emu_nccl.cpp: NCCL for remat's CPU emulator of CUDA (dev/emu; NOT NCCL,
 * not a GPU), over MPI: every emulated rank is one process started by
 * mpirun, and communicator rank r is MPI_COMM_WORLD rank r (ncclCommSplit
 * makes communicators of some of them, over MPI_Comm_split).
 *
 * Why it exists: llmc/cuda/multigpu.cuh (gradients summed per layer on a
 * collective stream during the backward, ZeRO-1's reduce and all-gather,
 * the nonblocking communicator behind --collective-timeout) runs nowhere
 * without GPUs; here `mpirun -np 2 emu_train_gpt_mpi_bf16 ...` runs it.
 *
 * Semantics (NCCL's documentation): a call only checks its arguments and
 * enqueues one operation on its stream (inside ncclGroupStart/End, the calls
 * of the group become one operation, posted together, so that grouped sends
 * and receives cannot deadlock each other). The operation runs in the
 * stream's order (emu_runtime.cpp): when it reaches the head it reads its
 * inputs (through streamcheck), posts nonblocking MPI sends and receives on
 * the communicator's own MPI communicator, and holds its stream until they
 * complete; then it writes its outputs. In place is sendbuff == recvbuff
 * (all-gather: sendbuff == recvbuff + rank * sendcount; reduce-scatter:
 * recvbuff == sendbuff + rank * recvcount); any other overlap stops the run.
 * Reductions combine the ranks' values in rank order 0, 1, ..., n-1 on every
 * rank, each step in float (double for 64-bit types) rounded to the element
 * type, so every rank gets the same bits (README: how that differs from
 * NCCL). A communicator created with blocking = 0 answers ncclInProgress
 * from ncclCommInitRankConfig until its MPI communicator exists
 * (MPI_Comm_idup), which ncclCommGetAsyncError polls; ncclCommSplit of a
 * nonblocking parent answers ncclInProgress and leaves the new communicator
 * NULL until ncclCommGetAsyncError on the parent sees it complete (NCCL's
 * behaviour, which an ideal split done inside the call would hide);
 * ncclCommAbort ends the communicator's pending operations without their
 * results.
 *
 * Progress: a process runs its streams only at synchronisation points, so a
 * process blocked in a host MPI call could leave its peers' NCCL operations
 * waiting for data it has not sent, and they would never reach that call.
 * The blocking and polling MPI calls the trainer makes (MPI_Allreduce,
 * MPI_Bcast, MPI_Barrier, MPI_Test, MPI_Testall, MPI_Finalize) are therefore
 * wrapped here (the MPI profiling interface) to first run whatever device
 * work can run without waiting.
 */
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "emu_internal.h"
#include "nccl.h"

struct ncclComm {
    MPI_Comm mpi = MPI_COMM_NULL;
    MPI_Request init = MPI_REQUEST_NULL; /* the pending MPI_Comm_idup of a nonblocking communicator */
    int rank = 0, nranks = 0;
    bool blocking = true, ready = false, aborted = false;
    /* a nonblocking ncclCommSplit of this communicator in progress: its result
     * reaches *split_target only when ncclCommGetAsyncError on this (the
     * parent) sees it complete, after split_polls more polls */
    bool split_pending = false;
    ncclComm_t* split_target = nullptr;
    ncclComm* split_result = nullptr;
    int split_polls = 0;
    /* device memory NCCL holds for this communicator (NCCL memory, below) */
    std::vector<void*> device_blocks;
    bool connected[2][3] = {{false, false, false}, {false, false, false}}; /* [collective, p2p][size class] */
};

namespace {

const char ID_MAGIC[] = "remat-emu-nccl";
const int TAG_COLLECTIVE = 7001, TAG_P2P = 7002;
std::string g_last_error;

ncclResult_t error(ncclResult_t r, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t error(ncclResult_t r, const char* fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    g_last_error = buf;
    return r;
}

/* ---- NCCL's device memory ----
 * Real NCCL takes device memory a plan must leave room for: the
 * communicator's own structures at init or split, and (since 2.22,
 * NCCL_RUNTIME_CONNECT=1) the connection buffers of an algorithm and
 * protocol at their first use, per channel and peer; users measure about
 * 1.6 GB per fully connected communicator (NVIDIA/nccl#864). Emulated:
 * EMU_NCCL_COMM_BYTES (default 96 MiB) at init and split, and
 * EMU_NCCL_CONNECT_BYTES (default 160 MiB) at the first call of each family
 * (collectives share their ring buffers; sends and receives have their own)
 * in each size class of the message (protocols by size: up to 64 KiB as
 * NCCL's LL, up to 4 MiB as LL128, larger as Simple), counted against the
 * emulated device. A call that cannot get it fails with
 * ncclUnhandledCudaError, as NCCL's does when cudaMalloc fails. */
size_t nccl_bytes_setting(const char* name, size_t fallback) {
    const char* v = getenv(name);
    if (!v) return fallback;
    char* end = nullptr;
    double x = strtod(v, &end);
    std::string u = end ? end : "";
    double mul = u == "" ? 1 : u == "KiB" ? 1024.0 : u == "MiB" ? 1048576.0 : u == "GiB" ? 1073741824.0 : -1;
    if (mul < 0 || x < 0) emu::fatal("%s=%s: expected bytes with an optional KiB, MiB or GiB suffix", name, v);
    return (size_t)(x * mul);
}

ncclResult_t take_device_memory(ncclComm* c, size_t bytes, const char* what) {
    if (!bytes) return ncclSuccess;
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cudaGetLastError();
        return error(ncclUnhandledCudaError, "%s: cudaMalloc of %zu bytes (%.1f MiB) failed: out of device memory", what, bytes,
                     (double)bytes / 1048576.0);
    }
    c->device_blocks.push_back(p);
    return ncclSuccess;
}

int size_class(size_t bytes) { return bytes <= ((size_t)64 << 10) ? 0 : bytes <= ((size_t)4 << 20) ? 1 : 2; }

/* The first call of a family in a size class connects it. */
ncclResult_t connect_for(ncclComm* c, bool p2p, size_t bytes, const char* api) {
    int k = size_class(bytes);
    if (c->connected[p2p][k]) return ncclSuccess;
    static const char* const proto[] = {"LL", "LL128", "Simple"};
    char what[160];
    snprintf(what, sizeof(what), "%s: connecting the %s buffers (%s protocol)", api, p2p ? "send/receive" : "collective", proto[k]);
    ncclResult_t r = take_device_memory(c, nccl_bytes_setting("EMU_NCCL_CONNECT_BYTES", (size_t)160 << 20), what);
    if (r == ncclSuccess) c->connected[p2p][k] = true;
    return r;
}

size_t type_bytes(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

const char* type_name(ncclDataType_t t) {
    static const char* names[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64",
                                  "ncclUint64", "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16"};
    return (unsigned)t < ncclNumTypes ? names[t] : "an unknown ncclDataType_t";
}

/* ---- reductions in rank order ---- */

template <typename T, typename A>
void combine_as(void* acc, const void* x, size_t n, ncclRedOp_t op) {
    T* a = (T*)acc;
    const T* b = (const T*)x;
    for (size_t i = 0; i < n; i++) {
        A u = (A)a[i], v = (A)b[i], r;
        switch (op) {
        case ncclProd: r = u * v; break;
        case ncclMax: r = u > v ? u : v; break;
        case ncclMin: r = u < v ? u : v; break;
        default: r = u + v; break; /* ncclSum, ncclAvg (divided at the end) */
        }
        a[i] = (T)r;
    }
}

template <typename T, float (*TO)(T), T (*FROM)(float)>
void combine_16(void* acc, const void* x, size_t n, ncclRedOp_t op) {
    T* a = (T*)acc;
    const T* b = (const T*)x;
    for (size_t i = 0; i < n; i++) {
        float u = TO(a[i]), v = TO(b[i]), r;
        switch (op) {
        case ncclProd: r = u * v; break;
        case ncclMax: r = u > v ? u : v; break;
        case ncclMin: r = u < v ? u : v; break;
        default: r = u + v; break;
        }
        a[i] = FROM(r); /* rounded to nearest even after every step */
    }
}

void combine(ncclDataType_t t, void* acc, const void* x, size_t n, ncclRedOp_t op) {
    switch (t) {
    case ncclInt8: combine_as<int8_t, int64_t>(acc, x, n, op); break;
    case ncclUint8: combine_as<uint8_t, uint64_t>(acc, x, n, op); break;
    case ncclInt32: combine_as<int32_t, int64_t>(acc, x, n, op); break;
    case ncclUint32: combine_as<uint32_t, uint64_t>(acc, x, n, op); break;
    case ncclInt64: combine_as<int64_t, int64_t>(acc, x, n, op); break;
    case ncclUint64: combine_as<uint64_t, uint64_t>(acc, x, n, op); break;
    case ncclFloat32: combine_as<float, float>(acc, x, n, op); break;
    case ncclFloat64: combine_as<double, double>(acc, x, n, op); break;
    case ncclFloat16: combine_16<__half, __half2float, __float2half>(acc, x, n, op); break;
    case ncclBfloat16: combine_16<__nv_bfloat16, __bfloat162float, __float2bfloat16>(acc, x, n, op); break;
    default: emu::fatal("NCCL: %s is not emulated", type_name(t));
    }
}

/* ncclAvg: the rank-order sum, divided by the count of ranks (in float, rounded to the type) */
void average(ncclDataType_t t, void* acc, size_t n, int nranks) {
    switch (t) {
    case ncclFloat32: for (size_t i = 0; i < n; i++) ((float*)acc)[i] /= (float)nranks; break;
    case ncclFloat64: for (size_t i = 0; i < n; i++) ((double*)acc)[i] /= (double)nranks; break;
    case ncclFloat16: for (size_t i = 0; i < n; i++) ((__half*)acc)[i] = __float2half(__half2float(((__half*)acc)[i]) / nranks); break;
    case ncclBfloat16:
        for (size_t i = 0; i < n; i++) ((__nv_bfloat16*)acc)[i] = __float2bfloat16(__bfloat162float(((__nv_bfloat16*)acc)[i]) / nranks);
        break;
    default: emu::fatal("NCCL: ncclAvg on %s is not emulated (NCCL: floating-point types)", type_name(t));
    }
}

/* ---- operations ---- */

enum Kind { ALL_REDUCE, REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, SEND, RECV };
const char* kind_name(Kind k) {
    static const char* names[] = {"ncclAllReduce", "ncclReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast", "ncclSend", "ncclRecv"};
    return names[k];
}

struct Task {
    Kind kind;
    const void* send;
    void* recv;
    size_t count; /* per rank: recvcount (reduce-scatter), sendcount (all-gather), else the buffer's */
    ncclDataType_t type;
    ncclRedOp_t op;
    int root_or_peer;
    ncclComm_t comm;
    cudaStream_t stream;
    /* while it runs */
    std::vector<char> staged;                 /* this rank's input, read when the operation starts */
    std::vector<std::vector<char>> from;      /* [rank]: what each peer sent */
};

/* One stream operation: a call, or the calls of a group. */
struct Batch {
    std::vector<Task> tasks;
    std::vector<MPI_Request> requests;
    ncclComm_t comm;
};

int mpi_count(size_t bytes) {
    if (bytes > (size_t)INT32_MAX) emu::fatal("NCCL: a message of %zu bytes (more than 2 GiB) is not emulated", bytes);
    return (int)bytes;
}

void post_send(Batch& b, const void* p, size_t bytes, int to, int tag) {
    b.requests.emplace_back();
    MPI_Request* r = &b.requests.back();
    PMPI_Isend(p, mpi_count(bytes), MPI_BYTE, to, tag, b.comm->mpi, r);
}

void post_recv(Batch& b, std::vector<char>& into, size_t bytes, int from, int tag) {
    into.resize(bytes);
    b.requests.emplace_back();
    PMPI_Irecv(into.data(), mpi_count(bytes), MPI_BYTE, from, tag, b.comm->mpi, &b.requests.back());
}

void stage(Task& t, const void* p, size_t bytes) {
    emu::stream_access(p, bytes, false);
    emu::init_check(kind_name(t.kind), p, bytes);
    t.staged.assign((const char*)p, (const char*)p + bytes);
}

/* Reads the inputs and posts the transfers of one task. Requests are
 * reserved up front so that pointers into the vector stay valid. */
void start_task(Batch& b, Task& t) {
    int n = t.comm->nranks, me = t.comm->rank;
    size_t bytes = t.count * type_bytes(t.type);
    t.from.assign(n, {});
    switch (t.kind) {
    case ALL_REDUCE:
    case ALL_GATHER:
        stage(t, t.send, bytes);
        for (int p = 0; p < n; p++)
            if (p != me) post_send(b, t.staged.data(), bytes, p, TAG_COLLECTIVE);
        for (int p = 0; p < n; p++)
            if (p != me) post_recv(b, t.from[p], bytes, p, TAG_COLLECTIVE);
        break;
    case REDUCE:
        stage(t, t.send, bytes);
        if (me != t.root_or_peer) post_send(b, t.staged.data(), bytes, t.root_or_peer, TAG_COLLECTIVE);
        else
            for (int p = 0; p < n; p++)
                if (p != me) post_recv(b, t.from[p], bytes, p, TAG_COLLECTIVE);
        break;
    case REDUCE_SCATTER:
        stage(t, t.send, bytes * n);
        for (int p = 0; p < n; p++)
            if (p != me) post_send(b, t.staged.data() + p * bytes, bytes, p, TAG_COLLECTIVE);
        for (int p = 0; p < n; p++)
            if (p != me) post_recv(b, t.from[p], bytes, p, TAG_COLLECTIVE);
        break;
    case BROADCAST:
        if (me == t.root_or_peer) {
            stage(t, t.send, bytes);
            for (int p = 0; p < n; p++)
                if (p != me) post_send(b, t.staged.data(), bytes, p, TAG_COLLECTIVE);
        } else {
            post_recv(b, t.from[t.root_or_peer], bytes, t.root_or_peer, TAG_COLLECTIVE);
        }
        break;
    case SEND:
        stage(t, t.send, bytes);
        post_send(b, t.staged.data(), bytes, t.root_or_peer, TAG_P2P);
        break;
    case RECV: post_recv(b, t.from[t.root_or_peer], bytes, t.root_or_peer, TAG_P2P); break;
    }
}

void write_out(void* dst, const void* src, size_t bytes) {
    emu::stream_access(dst, bytes, true);
    memcpy(dst, src, bytes);
    emu::init_set(dst, bytes, true);
}

/* The rank-order reduction of the chunk each rank contributed: own is this rank's. */
std::vector<char> reduce_in_rank_order(Task& t, const char* own) {
    size_t bytes = t.count * type_bytes(t.type);
    int n = t.comm->nranks, me = t.comm->rank;
    auto part = [&](int r) { return r == me ? own : t.from[r].data(); };
    std::vector<char> acc(part(0), part(0) + bytes);
    for (int r = 1; r < n; r++) combine(t.type, acc.data(), part(r), t.count, t.op);
    if (t.op == ncclAvg) average(t.type, acc.data(), t.count, n);
    return acc;
}

void finish_task(Task& t) {
    int n = t.comm->nranks, me = t.comm->rank;
    size_t bytes = t.count * type_bytes(t.type);
    switch (t.kind) {
    case ALL_REDUCE: write_out(t.recv, reduce_in_rank_order(t, t.staged.data()).data(), bytes); break;
    case REDUCE:
        if (me == t.root_or_peer) write_out(t.recv, reduce_in_rank_order(t, t.staged.data()).data(), bytes);
        break;
    case REDUCE_SCATTER: write_out(t.recv, reduce_in_rank_order(t, t.staged.data() + me * bytes).data(), bytes); break;
    case ALL_GATHER:
        for (int p = 0; p < n; p++) write_out((char*)t.recv + p * bytes, p == me ? t.staged.data() : t.from[p].data(), bytes);
        break;
    case BROADCAST: write_out(t.recv, me == t.root_or_peer ? t.staged.data() : t.from[t.root_or_peer].data(), bytes); break;
    case SEND: break;
    case RECV: write_out(t.recv, t.from[t.root_or_peer].data(), bytes); break;
    }
    t.staged.clear();
    t.from.clear();
}

/* "ncclAllReduce", or "the NCCL group of 12 calls (ncclAllReduce x12)" */
std::string describe(const Batch& b) {
    if (b.tasks.size() == 1) return kind_name(b.tasks[0].kind);
    std::string s;
    for (size_t i = 0; i < b.tasks.size();) {
        size_t j = i;
        while (j < b.tasks.size() && b.tasks[j].kind == b.tasks[i].kind) j++;
        s += std::string(s.empty() ? "" : ", ") + kind_name(b.tasks[i].kind) + (j - i > 1 ? " x" + std::to_string(j - i) : "");
        i = j;
    }
    return "the NCCL group of " + std::to_string(b.tasks.size()) + " calls (" + s + ")";
}

/* Operations of two communicators of this process in flight at once (on two
 * streams): NCCL's documentation says such concurrent use "could break at
 * any time" (each kernel waits on its peers while holding SMs, and ranks
 * whose GPUs run them in different orders deadlock) unless the launches are
 * ordered: by the program (stream dependencies in one order on every rank),
 * or since NCCL 2.26 by NCCL_LAUNCH_ORDER_IMPLICIT=1. Unless that variable is
 * 1, an operation that starts while another communicator's is in flight
 * stops the run. */
ncclComm* g_in_flight_comm = nullptr;
int g_in_flight = 0;

void start_in_flight(const Batch& b) {
    const char* implicit = getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
    if (g_in_flight > 0 && g_in_flight_comm != b.comm && !(implicit && strcmp(implicit, "1") == 0))
        emu::fatal("NCCL: %s starts on one communicator while an operation of another communicator of this process is in flight on "
                   "another stream, in no order: NCCL documents that concurrent communicators may deadlock unless their launches are "
                   "ordered (stream dependencies, or NCCL_LAUNCH_ORDER_IMPLICIT=1 from NCCL 2.26)", describe(b).c_str());
    g_in_flight_comm = b.comm;
    g_in_flight++;
}

void enqueue_batch(std::shared_ptr<Batch> b) {
    cudaStream_t stream = b->tasks[0].stream;
    emu::enqueue_async(
        stream, describe(*b),
        [b]() {
            if (b->comm->aborted) return;
            start_in_flight(*b);
            size_t most = 0;
            for (const Task& t : b->tasks) most += 2 * (size_t)t.comm->nranks;
            b->requests.reserve(most); /* post_send/post_recv keep pointers into it */
            for (Task& t : b->tasks) start_task(*b, t);
        },
        [b]() {
            if (b->comm->aborted) { g_in_flight = 0; return true; } /* NCCL ends an aborted communicator's work; its results are undefined */
            int done = 0;
            if (!b->requests.empty()) PMPI_Testall((int)b->requests.size(), b->requests.data(), &done, MPI_STATUSES_IGNORE);
            else done = 1;
            if (!done) return false;
            for (Task& t : b->tasks) finish_task(t);
            g_in_flight--;
            return true;
        });
}

/* ---- groups ---- */
int g_group_depth = 0;
std::shared_ptr<Batch> g_group;

ncclResult_t submit(Task t) {
    if (g_group_depth > 0) {
        if (!g_group) {
            g_group = std::make_shared<Batch>();
            g_group->comm = t.comm;
        }
        if (g_group->comm != t.comm || (!g_group->tasks.empty() && g_group->tasks[0].stream != t.stream))
            emu::fatal("NCCL: a group with calls on several communicators or streams is not emulated");
        g_group->tasks.push_back(std::move(t));
        return ncclSuccess;
    }
    auto b = std::make_shared<Batch>();
    b->comm = t.comm;
    b->tasks.push_back(std::move(t));
    enqueue_batch(b);
    return ncclSuccess;
}

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
    return (uintptr_t)a < (uintptr_t)b + bn && (uintptr_t)b < (uintptr_t)a + an;
}

ncclResult_t check_comm(const char* api, ncclComm_t comm) {
    if (!comm) return error(ncclInvalidArgument, "%s: comm is NULL", api);
    if (comm->aborted) emu::fatal("%s: the communicator was aborted (ncclCommAbort)", api);
    if (!comm->ready)
        emu::fatal("%s: the communicator's nonblocking initialisation has not completed (ncclCommGetAsyncError answers ncclInProgress)", api);
    if (comm->split_pending)
        emu::fatal("%s: the communicator's nonblocking ncclCommSplit has not completed (poll ncclCommGetAsyncError on it, the parent, "
                   "until it answers ncclSuccess)", api);
    return ncclSuccess;
}

/* Arguments of a collective: device buffers of the right size, the documented in-place forms only. */
ncclResult_t make_task(Kind kind, const void* send, size_t send_count, void* recv, size_t recv_count, size_t count, ncclDataType_t type,
                       ncclRedOp_t op, int root_or_peer, ncclComm_t comm, cudaStream_t stream, const void* in_place_send) {
    const char* api = kind_name(kind);
    if (ncclResult_t r = check_comm(api, comm)) return r;
    size_t es = type_bytes(type);
    if (!es) return error(ncclInvalidArgument, "%s: datatype %d is not an ncclDataType_t", api, (int)type);
    if ((unsigned)op >= ncclNumOps) return error(ncclInvalidArgument, "%s: op %d is not an ncclRedOp_t", api, (int)op);
    if (root_or_peer < 0 || root_or_peer >= comm->nranks)
        return error(ncclInvalidArgument, "%s: root or peer %d outside 0..%d", api, root_or_peer, comm->nranks - 1);
    emu::stream_index(api, stream);
    if (count == 0) return ncclSuccess;
    size_t sb = send_count * es, rb = recv_count * es;
    if (sb) emu::check_device_range(api, "sendbuff", send, sb);
    if (rb) emu::check_device_range(api, "recvbuff", recv, rb);
    if (sb && rb && send != in_place_send && overlaps(send, sb, recv, rb))
        emu::fatal("%s: sendbuff (%zu bytes at %p) and recvbuff (%zu bytes at %p) overlap without being the in-place form", api, sb, send, rb,
                   recv);
    if (ncclResult_t r = connect_for(comm, kind == SEND || kind == RECV, count * es, api)) return r;
    return submit(Task{kind, send, recv, count, type, op, root_or_peer, comm, stream, {}, {}});
}

}  // namespace

/* ---- the API ---- */

ncclResult_t ncclGetVersion(int* version) {
    if (!version) return error(ncclInvalidArgument, "ncclGetVersion: version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return error(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    memset(id, 0, sizeof(*id));
    snprintf(id->internal, sizeof(id->internal), "%s %d %ld", ID_MAGIC, (int)getpid(), (long)time(NULL));
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
    const char* api = "ncclCommInitRank";
    if (!comm) return error(ncclInvalidArgument, "%s: comm is NULL", api);
    int initialized = 0, world = 0, me = 0;
    MPI_Initialized(&initialized);
    if (!initialized) emu::fatal("%s: the emulated NCCL runs over MPI: call MPI_Init first (and start the ranks with mpirun)", api);
    if (strncmp(id.internal, ID_MAGIC, strlen(ID_MAGIC)) != 0)
        return error(ncclInvalidArgument, "%s: the ncclUniqueId did not come from ncclGetUniqueId (was it broadcast?)", api);
    PMPI_Comm_size(MPI_COMM_WORLD, &world);
    PMPI_Comm_rank(MPI_COMM_WORLD, &me);
    if (nranks != world || rank != me)
        emu::fatal("%s(nranks %d, rank %d): the emulated NCCL maps rank r to MPI_COMM_WORLD rank r of a %d-process job (this is rank %d)",
                   api, nranks, rank, world, me);
    ncclComm* c = new ncclComm;
    c->rank = rank;
    c->nranks = nranks;
    c->blocking = !config || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
    PMPI_Comm_idup(MPI_COMM_WORLD, &c->mpi, &c->init);
    *comm = c;
    if (ncclResult_t r = take_device_memory(c, nccl_bytes_setting("EMU_NCCL_COMM_BYTES", (size_t)96 << 20), api)) return r;
    if (c->blocking) {
        PMPI_Wait(&c->init, MPI_STATUS_IGNORE);
        c->ready = true;
        return ncclSuccess;
    }
    return ncclInProgress;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

/* NCCL's documented semantics: collective over every rank of comm; the ranks
 * passing one color form a communicator, ranked by key and then by their rank
 * in comm (MPI_Comm_split's order too); NCCL_SPLIT_NOCOLOR gives NULL; a NULL
 * config inherits comm's (blocking or not). A blocking parent: done when the
 * call returns. A nonblocking parent (blocking = 0), as NCCL 2.18 to 2.30 do
 * it (src/init.cc: newcomm stays NULL until the split fully completes): the
 * call answers ncclInProgress with *newcomm NULL, and the new communicator
 * appears in *newcomm when ncclCommGetAsyncError on the parent answers
 * ncclSuccess (EMU_NCCL_SPLIT_POLLS polls later, default 3); polling the NULL
 * new communicator answers ncclInvalidArgument, as NCCL's does. */
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
    const char* api = "ncclCommSplit";
    if (ncclResult_t r = check_comm(api, comm)) return r;
    if (!newcomm) return error(ncclInvalidArgument, "%s: newcomm is NULL", api);
    if (color < NCCL_SPLIT_NOCOLOR) return error(ncclInvalidArgument, "%s: color %d is negative and not NCCL_SPLIT_NOCOLOR", api, color);
    emu::progress(); /* a blocking MPI call: the peers may wait for device work of this process first */
    MPI_Comm split = MPI_COMM_NULL;
    PMPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &split);
    ncclComm* c = nullptr;
    if (split != MPI_COMM_NULL) {
        c = new ncclComm;
        PMPI_Comm_rank(split, &c->rank);
        PMPI_Comm_size(split, &c->nranks);
        c->mpi = split;
        c->blocking = config ? config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0 : comm->blocking;
        c->ready = true;
        if (ncclResult_t r = take_device_memory(c, nccl_bytes_setting("EMU_NCCL_COMM_BYTES", (size_t)96 << 20), api)) return r;
    }
    if (comm->blocking) {
        *newcomm = c;
        return ncclSuccess;
    }
    *newcomm = nullptr;
    comm->split_pending = true;
    comm->split_target = newcomm;
    comm->split_result = c;
    const char* polls = getenv("EMU_NCCL_SPLIT_POLLS");
    comm->split_polls = polls ? atoi(polls) : 3;
    return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async) {
    if (!comm || !async) return error(ncclInvalidArgument, "ncclCommGetAsyncError: comm or asyncError is NULL");
    if (!comm->ready && !comm->aborted) {
        int done = 0;
        PMPI_Test(&comm->init, &done, MPI_STATUS_IGNORE);
        comm->ready = done != 0;
    }
    if (comm->split_pending && !comm->aborted && comm->split_polls-- <= 0) {
        *comm->split_target = comm->split_result; /* the split completes: the new communicator appears */
        comm->split_pending = false;
    }
    *async = (comm->ready && !comm->split_pending) || comm->aborted ? ncclSuccess : ncclInProgress;
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    if (ncclResult_t r = check_comm("ncclCommFinalize", comm)) return r;
    emu::flush(); /* its operations complete (every stream: the emulator does not track which carry this communicator) */
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    if (comm->mpi != MPI_COMM_NULL && comm->ready && !comm->aborted) PMPI_Comm_free(&comm->mpi);
    for (void* p : comm->device_blocks) cudaFree(p);
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    comm->aborted = true; /* pending operations end at their next poll; the MPI communicator is left to MPI_Finalize or MPI_Abort */
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
    if (!comm || !count) return error(ncclInvalidArgument, "ncclCommCount: NULL argument");
    *count = comm->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
    if (!comm || !rank) return error(ncclInvalidArgument, "ncclCommUserRank: NULL argument");
    *rank = comm->rank;
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

const char* ncclGetLastError(ncclComm_t) { return g_last_error.c_str(); }

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
    return make_task(ALL_REDUCE, send, count, recv, count, count, type, op, 0, comm, stream, recv);
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm,
                        cudaStream_t stream) {
    bool root_here = comm && comm->rank == root;
    return make_task(REDUCE, send, count, recv, root_here ? count : 0, count, type, op, root, comm, stream, recv);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
    int n = comm ? comm->nranks : 1, me = comm ? comm->rank : 0;
    const void* in_place = (const char*)recv - (size_t)me * recvcount * type_bytes(type);
    return make_task(REDUCE_SCATTER, send, recvcount * n, recv, recvcount, recvcount, type, op, 0, comm, stream, in_place);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
    int n = comm ? comm->nranks : 1, me = comm ? comm->rank : 0;
    const void* in_place = (const char*)recv + (size_t)me * sendcount * type_bytes(type);
    return make_task(ALL_GATHER, send, sendcount, recv, sendcount * n, sendcount, type, ncclSum, 0, comm, stream, in_place);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                           cudaStream_t stream) {
    bool root_here = comm && comm->rank == root;
    return make_task(BROADCAST, send, root_here ? count : 0, recv, count, count, type, ncclSum, root, comm, stream, recv);
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
    return make_task(SEND, send, count, nullptr, 0, count, type, ncclSum, peer, comm, stream, nullptr);
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
    return make_task(RECV, nullptr, 0, recv, count, count, type, ncclSum, peer, comm, stream, nullptr);
}

ncclResult_t ncclGroupStart(void) {
    g_group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (g_group_depth == 0) return error(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--g_group_depth > 0 || !g_group) return ncclSuccess;
    std::shared_ptr<Batch> b = std::move(g_group);
    g_group = nullptr;
    enqueue_batch(b);
    return ncclSuccess;
}

/* ---- host MPI calls run the device's runnable work first (see the top) ---- */
extern "C" {
int MPI_Allreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm c) {
    emu::progress();
    return PMPI_Allreduce(s, r, n, t, op, c);
}
int MPI_Bcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c) {
    emu::progress();
    return PMPI_Bcast(b, n, t, root, c);
}
int MPI_Barrier(MPI_Comm c) {
    emu::progress();
    return PMPI_Barrier(c);
}
int MPI_Test(MPI_Request* r, int* flag, MPI_Status* st) {
    emu::progress();
    return PMPI_Test(r, flag, st);
}
int MPI_Testall(int n, MPI_Request rs[], int* flag, MPI_Status sts[]) {
    emu::progress();
    return PMPI_Testall(n, rs, flag, sts);
}
int MPI_Finalize(void) {
    emu::progress();
    return PMPI_Finalize();
}
}
