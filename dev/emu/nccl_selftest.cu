/*
 * nccl_selftest.cu: the emulated NCCL (runtime/emu_nccl.cpp) against its
 * documented semantics, under mpirun (any number of ranks; the test runs 3).
 * dev/emu; NOT NCCL, not a GPU.
 *
 * Every expected value is computed here on the host from the inputs each
 * rank generates (rank r's element i is a function of r and i, so every rank
 * knows every rank's input): all-reduce in place and out of place (fp32,
 * bf16 and fp16: the rank-order sum rounded after each step; int32: exact;
 * max and avg), reduce onto each root, reduce-scatter in place and out of
 * place, all-gather in place and out of place, broadcast from each root, a
 * ring of grouped sends and receives on a second stream, the stream order
 * (a collective after a kernel on its stream sees the kernel's output),
 * ncclCommSplit (ranks of one color, ordered by key; an all-reduce and a
 * send/receive ring inside each part; NCCL_SPLIT_NOCOLOR gives NULL), a
 * nonblocking communicator (ncclInProgress until ncclCommGetAsyncError says
 * otherwise) and its split (ncclInProgress, the new communicator NULL until
 * the parent is polled to completion), version and error strings. Prints "nccl selftest: PASS" on
 * rank 0 when every rank passed; `fail:NAME` runs one misuse that must stop:
 * overlap (sendbuff and recvbuff overlap without being in place),
 * before_ready (a collective on a nonblocking communicator before
 * ncclCommGetAsyncError said it is ready).
 */
#include <mpi.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_fp16.h"

static int g_fail = 0, g_rank = 0, g_world = 1;

#define CHECK(cond, ...)                                      \
    do {                                                      \
        if (!(cond)) {                                        \
            g_fail++;                                         \
            fprintf(stderr, "rank %d: FAIL: ", g_rank);       \
            fprintf(stderr, __VA_ARGS__);                     \
            fprintf(stderr, "\n");                            \
        }                                                     \
    } while (0)
#define NC(call) CHECK((call) == ncclSuccess, "%s", #call)
#define CK(call) CHECK((call) == cudaSuccess, "%s", #call)

/* rank r's input element i: small values whose sums round differently by order in 16-bit types */
static float input(int r, size_t i) { return (float)((int)((i * 7 + (size_t)r * 13) % 29) - 14) * 0.37f + (float)r * 1e-3f; }

template <typename T> static T to(float f);
template <> float to<float>(float f) { return f; }
template <> __nv_bfloat16 to<__nv_bfloat16>(float f) { return __float2bfloat16(f); }
template <> __half to<__half>(float f) { return __float2half(f); }
static float from(float x) { return x; }
static float from(__nv_bfloat16 x) { return __bfloat162float(x); }
static float from(__half x) { return __half2float(x); }

template <typename T> static bool same_bits(T a, T b) { return memcmp(&a, &b, sizeof(T)) == 0; }

/* the rank-order sum ((x0 + x1) + x2) ..., rounded to T after each step */
template <typename T> static T rank_order_sum(size_t i, int offset_ranks_by = 0) {
    T acc = to<T>(input(0, i + offset_ranks_by));
    for (int r = 1; r < g_world; r++) acc = to<T>(from(acc) + from(to<T>(input(r, i + offset_ranks_by))));
    return acc;
}

template <typename T> static T* device_input(size_t n, int r) {
    std::vector<T> h(n);
    for (size_t i = 0; i < n; i++) h[i] = to<T>(input(r, i));
    T* d;
    CK(cudaMalloc((void**)&d, n * sizeof(T)));
    CK(cudaMemcpy(d, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

template <typename T> static std::vector<T> host(const T* d, size_t n) {
    std::vector<T> h(n);
    CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

template <typename T> static void all_reduce(ncclComm_t comm, ncclDataType_t type, const char* name) {
    const size_t n = 1000;
    T* a = device_input<T>(n, g_rank);
    T* b = device_input<T>(n, g_rank);
    T* out;
    CK(cudaMalloc((void**)&out, n * sizeof(T)));
    NC(ncclAllReduce(a, a, n, type, ncclSum, comm, 0));   /* in place */
    NC(ncclAllReduce(b, out, n, type, ncclSum, comm, 0)); /* out of place */
    std::vector<T> ha = host(a, n), ho = host(out, n), hb = host(b, n);
    int bad = 0, bad_input = 0;
    for (size_t i = 0; i < n; i++) {
        bad += !same_bits(ha[i], rank_order_sum<T>(i)) || !same_bits(ho[i], rank_order_sum<T>(i));
        bad_input += !same_bits(hb[i], to<T>(input(g_rank, i)));
    }
    CHECK(bad == 0, "ncclAllReduce %s: %d of %zu elements are not the rank-order sum", name, bad, n);
    CHECK(bad_input == 0, "ncclAllReduce %s out of place changed its input (%d elements)", name, bad_input);
    for (T* p : {a, b, out}) CK(cudaFree(p));
}

static void reductions(ncclComm_t comm) {
    all_reduce<float>(comm, ncclFloat32, "fp32");
    all_reduce<__nv_bfloat16>(comm, ncclBfloat16, "bf16");
    all_reduce<__half>(comm, ncclFloat16, "fp16");
    /* int32 exact, max and avg in fp32 */
    const size_t n = 64;
    std::vector<int> hi(n);
    for (size_t i = 0; i < n; i++) hi[i] = (int)i * (g_rank + 1);
    int* di;
    CK(cudaMalloc((void**)&di, n * sizeof(int)));
    CK(cudaMemcpy(di, hi.data(), n * sizeof(int), cudaMemcpyHostToDevice));
    NC(ncclAllReduce(di, di, n, ncclInt32, ncclSum, comm, 0));
    std::vector<int> gi = host(di, n);
    int want_factor = g_world * (g_world + 1) / 2, bad = 0;
    for (size_t i = 0; i < n; i++) bad += gi[i] != (int)i * want_factor;
    CHECK(bad == 0, "ncclAllReduce int32: %d wrong", bad);
    float* f = device_input<float>(n, g_rank);
    float* g = device_input<float>(n, g_rank);
    NC(ncclAllReduce(f, f, n, ncclFloat32, ncclMax, comm, 0));
    NC(ncclAllReduce(g, g, n, ncclFloat32, ncclAvg, comm, 0));
    std::vector<float> hf = host(f, n), hg = host(g, n);
    int bad_max = 0, bad_avg = 0;
    for (size_t i = 0; i < n; i++) {
        float m = input(0, i);
        for (int r = 1; r < g_world; r++) m = input(r, i) > m ? input(r, i) : m;
        bad_max += hf[i] != m;
        bad_avg += hg[i] != rank_order_sum<float>(i) / (float)g_world;
    }
    CHECK(bad_max == 0 && bad_avg == 0, "ncclMax: %d wrong, ncclAvg: %d wrong", bad_max, bad_avg);
    CK(cudaFree(di));
    CK(cudaFree(f));
    CK(cudaFree(g));
}

static void reduce_and_broadcast(ncclComm_t comm) {
    const size_t n = 100;
    for (int root = 0; root < g_world; root++) {
        float* a = device_input<float>(n, g_rank);
        float* out;
        CK(cudaMalloc((void**)&out, n * sizeof(float)));
        CK(cudaMemset(out, 0, n * sizeof(float)));
        NC(ncclReduce(a, out, n, ncclFloat32, ncclSum, root, comm, 0));
        std::vector<float> h = host(out, n);
        int bad = 0;
        for (size_t i = 0; i < n; i++) bad += g_rank == root ? h[i] != rank_order_sum<float>(i) : h[i] != 0.0f;
        CHECK(bad == 0, "ncclReduce onto %d: %d wrong (off the root recvbuff is untouched)", root, bad);
        NC(ncclBroadcast(a, a, n, ncclFloat32, root, comm, 0)); /* in place */
        h = host(a, n);
        bad = 0;
        for (size_t i = 0; i < n; i++) bad += h[i] != input(root, i);
        CHECK(bad == 0, "ncclBroadcast from %d: %d wrong", root, bad);
        CK(cudaFree(a));
        CK(cudaFree(out));
    }
}

static void scatter_and_gather(ncclComm_t comm) {
    const size_t per = 50, n = per * g_world;
    /* reduce-scatter: out of place, then in place (recvbuff = sendbuff + rank * per) */
    float* a = device_input<float>(n, g_rank);
    float* out;
    CK(cudaMalloc((void**)&out, per * sizeof(float)));
    NC(ncclReduceScatter(a, out, per, ncclFloat32, ncclSum, comm, 0));
    NC(ncclReduceScatter(a, a + g_rank * per, per, ncclFloat32, ncclSum, comm, 0));
    std::vector<float> ho = host(out, per), ha = host(a + g_rank * per, per);
    int bad = 0;
    for (size_t i = 0; i < per; i++) {
        float want = rank_order_sum<float>(i, (int)(g_rank * per));
        bad += ho[i] != want || ha[i] != want;
    }
    CHECK(bad == 0, "ncclReduceScatter: %d wrong", bad);
    /* all-gather: out of place, then in place (sendbuff = recvbuff + rank * per) */
    float* mine = device_input<float>(per, g_rank);
    float* all;
    CK(cudaMalloc((void**)&all, n * sizeof(float)));
    NC(ncclAllGather(mine, all, per, ncclFloat32, comm, 0));
    std::vector<float> h = host(all, n);
    float* b = device_input<float>(n, g_rank); /* own chunk at rank * per holds input(rank, rank*per + i): fill it first */
    CK(cudaMemcpy(b + g_rank * per, mine, per * sizeof(float), cudaMemcpyDeviceToDevice));
    NC(ncclAllGather(b + g_rank * per, b, per, ncclFloat32, comm, 0));
    std::vector<float> hb = host(b, n);
    bad = 0;
    for (int r = 0; r < g_world; r++)
        for (size_t i = 0; i < per; i++) bad += h[r * per + i] != input(r, i) || hb[r * per + i] != input(r, i);
    CHECK(bad == 0, "ncclAllGather: %d wrong", bad);
    for (float* p : {a, out, mine, all, b}) CK(cudaFree(p));
}

/* A ring on a second stream: each rank sends its buffer to the next and receives the previous rank's, grouped (sends and
 * receives posted together, else every rank would wait in its send), after a kernel-free copy on that stream. */
static void ring(ncclComm_t comm) {
    const size_t n = 4096;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float* mine = device_input<float>(n, g_rank);
    float *staged, *got;
    CK(cudaMalloc((void**)&staged, n * sizeof(float)));
    CK(cudaMalloc((void**)&got, n * sizeof(float)));
    CK(cudaMemcpyAsync(staged, mine, n * sizeof(float), cudaMemcpyDeviceToDevice, s)); /* stream order: the send sees it */
    int next = (g_rank + 1) % g_world, prev = (g_rank + g_world - 1) % g_world;
    NC(ncclGroupStart());
    NC(ncclSend(staged, n, ncclFloat32, next, comm, s));
    NC(ncclRecv(got, n, ncclFloat32, prev, comm, s));
    NC(ncclGroupEnd());
    CK(cudaStreamSynchronize(s));
    std::vector<float> h(n);
    CK(cudaMemcpy(h.data(), got, n * sizeof(float), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad += h[i] != input(prev, i);
    CHECK(bad == 0, "grouped ncclSend/ncclRecv ring: %d of %zu wrong", bad, n);
    for (float* p : {mine, staged, got}) CK(cudaFree(p));
    CK(cudaStreamDestroy(s));
}

/* ncclCommSplit into pairs of consecutive ranks (color rank / 2), keyed in reverse (the higher world rank becomes rank 0
 * of its pair); in an odd world of 3 or more the last rank passes NCCL_SPLIT_NOCOLOR. Inside a part: the all-reduce sums the members' inputs in the
 * new rank order, and a grouped send/receive ring reaches the neighbours by new rank. */
static void split(ncclComm_t comm, bool nonblocking) {
    int last_out = g_world >= 3 && g_world % 2 == 1;
    bool out = last_out && g_rank == g_world - 1;
    ncclComm_t part = NULL;
    ncclResult_t r = ncclCommSplit(comm, out ? NCCL_SPLIT_NOCOLOR : g_rank / 2, g_world - g_rank, &part, NULL);
    if (nonblocking) { /* NCCL: in progress, the new communicator NULL until the parent is polled to completion */
        CHECK(r == ncclInProgress && part == NULL, "nonblocking ncclCommSplit: %s, newcomm %p", ncclGetErrorString(r), (void*)part);
        ncclResult_t state = ncclInProgress, on_new = ncclSuccess;
        if (!out) CHECK(ncclCommGetAsyncError(part, &on_new) == ncclInvalidArgument, "ncclCommGetAsyncError on the NULL new communicator");
        while (state == ncclInProgress) NC(ncclCommGetAsyncError(comm, &state));
        CHECK(state == ncclSuccess, "nonblocking ncclCommSplit settled with %s", ncclGetErrorString(state));
    } else {
        NC(r);
    }
    if (out) {
        CHECK(part == NULL, "ncclCommSplit with NCCL_SPLIT_NOCOLOR gave a communicator");
        return;
    }
    std::vector<int> members; /* world ranks, in the part's rank order */
    for (int r = g_world - 1; r >= 0; r--)
        if (r / 2 == g_rank / 2 && !(last_out && r == g_world - 1)) members.push_back(r);
    int n = 0, me = -1;
    NC(ncclCommCount(part, &n));
    NC(ncclCommUserRank(part, &me));
    int want_me = 0;
    while (members[want_me] != g_rank) want_me++;
    CHECK(n == (int)members.size() && me == want_me, "ncclCommSplit: rank %d of %d, expected %d of %zu", me, n, want_me, members.size());
    const size_t k = 300;
    float* a = device_input<float>(k, g_rank);
    float* got;
    CK(cudaMalloc((void**)&got, k * sizeof(float)));
    NC(ncclAllReduce(a, a, k, ncclFloat32, ncclSum, part, 0));
    NC(ncclGroupStart());
    NC(ncclSend(a, k, ncclFloat32, (me + 1) % n, part, 0));
    NC(ncclRecv(got, k, ncclFloat32, (me + n - 1) % n, part, 0));
    NC(ncclGroupEnd());
    std::vector<float> ha = host(a, k), hg = host(got, k);
    int bad = 0;
    for (size_t i = 0; i < k; i++) {
        float sum = input(members[0], i);
        for (size_t j = 1; j < members.size(); j++) sum += input(members[j], i);
        bad += ha[i] != sum || hg[i] != sum; /* every member holds the same sum, so the ring delivers it too */
    }
    CHECK(bad == 0, "ncclCommSplit part of %d: %d of %zu elements wrong", n, bad, k);
    CK(cudaFree(a));
    CK(cudaFree(got));
    NC(ncclCommDestroy(part));
}

static void strings_and_version(void) {
    int v = 0;
    NC(ncclGetVersion(&v));
    CHECK(v == NCCL_VERSION_CODE && v == 22105, "ncclGetVersion: %d", v);
    CHECK(strcmp(ncclGetErrorString(ncclSuccess), "no error") == 0, "ncclGetErrorString(ncclSuccess)");
    CHECK(strstr(ncclGetErrorString(ncclInProgress), "in progress") != NULL, "ncclGetErrorString(ncclInProgress)");
    CHECK(ncclGroupEnd() == ncclInvalidUsage && strstr(ncclGetLastError(NULL), "ncclGroupEnd without ncclGroupStart"),
          "ncclGroupEnd without a start: ncclInvalidUsage and a last error");
}

static ncclComm_t nonblocking_comm(ncclUniqueId id) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&comm, g_world, id, g_rank, &config);
    CHECK(r == ncclInProgress || r == ncclSuccess, "nonblocking ncclCommInitRankConfig: %s", ncclGetErrorString(r));
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) NC(ncclCommGetAsyncError(comm, &state));
    CHECK(state == ncclSuccess, "nonblocking communicator settled with %s", ncclGetErrorString(state));
    return comm;
}

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    ncclUniqueId id;
    if (g_rank == 0) NC(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    if (argc == 2 && strncmp(argv[1], "fail:", 5) == 0) {
        std::string n = argv[1] + 5;
        ncclComm_t comm;
        float* d;
        CK(cudaMalloc((void**)&d, 400));
        if (n == "overlap") {
            NC(ncclCommInitRank(&comm, g_world, id, g_rank));
            ncclAllReduce(d, d + 1, 50, ncclFloat32, ncclSum, comm, 0);
        } else if (n == "before_ready") {
            ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
            config.blocking = 0;
            ncclCommInitRankConfig(&comm, g_world, id, g_rank, &config);
            ncclAllReduce(d, d, 50, ncclFloat32, ncclSum, comm, 0); /* without polling ncclCommGetAsyncError first */
        }
        cudaDeviceSynchronize();
        printf("NOT STOPPED: %s\n", n.c_str());
        MPI_Finalize();
        return 0;
    }
    ncclComm_t comm;
    NC(ncclCommInitRank(&comm, g_world, id, g_rank));
    strings_and_version();
    reductions(comm);
    reduce_and_broadcast(comm);
    scatter_and_gather(comm);
    ring(comm);
    split(comm, false);
    ncclComm_t nb = nonblocking_comm(id);
    reductions(nb);
    split(nb, true);
    NC(ncclCommFinalize(nb));
    NC(ncclCommDestroy(nb));
    NC(ncclCommDestroy(comm));
    int failures = 0;
    MPI_Allreduce(&g_fail, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) printf("nccl selftest (%d ranks): %s\n", g_world, failures ? "FAIL" : "PASS");
    MPI_Finalize();
    return failures ? 1 : 0;
}
