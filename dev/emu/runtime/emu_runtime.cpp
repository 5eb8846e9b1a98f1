/*
 * emu_runtime.cpp: the runtime of remat's CPU emulator of CUDA (dev/emu).
 * NOT a GPU: what it checks and what it cannot is in dev/emu/README.md.
 *
 * Why it exists: to run the trainer's CUDA kernels, unchanged, on a CPU so
 * that their indexing, tiling, masking and reductions are tested against the
 * CPU reference without a GPU. Contents:
 *   - thread blocks: each CUDA thread is a coroutine with its own stack
 *     (x86-64 context switch below); a block runs until every thread has
 *     finished, switching threads only at __syncthreads and warp operations;
 *     blocks run one after another. Undefined behaviour the CUDA
 *     documentation names (barriers in divergent code, warp operations not
 *     reached by the whole warp, partial masks, launches beyond the limits or
 *     the kernel's __launch_bounds__) stops the program with a message.
 *   - memory: cudaMalloc / cudaMallocHost blocks are separate mappings (the
 *     device ones inside initcheck's reserved range, emu_initcheck.cpp) with
 *     inaccessible guard pages on both sides and a canary in the slack after
 *     the requested size, filled with 0xff bytes (NaN in every float type) so
 *     that reading memory nobody wrote shows; freed blocks stay inaccessible.
 *     Copies and memsets are range-checked; kernel pointer arguments must
 *     point into device or pinned memory.
 *   - streams: kernels, async copies, memsets, matmuls and NCCL calls are
 *     queued per stream and run at the next synchronisation point, each
 *     stream in order, streams interleaved as their events allow
 *     (EMU_STREAM_ORDER), with vector clocks for streamcheck; copies involving
 *     pageable host memory follow the documented synchronisation rules (H2D
 *     staged at the call, D2H synchronous).
 *   - a SIGSEGV/SIGBUS handler that names the kernel, block and thread, and
 *     whether the address was a guard page, a freed block or a stack guard.
 */
#include <execinfo.h>
#include <signal.h>
#include <stdarg.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "emu_internal.h"

/* ------------------------------------------------------------------------ */
/* context switch (System V x86-64: rbx, rbp, r12-r15 are callee-saved)      */

extern "C" void emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch, .-emu_switch
)");

namespace emu {

uint3 cur_thread_idx, cur_block_idx;
dim3 cur_block_dim, cur_grid_dim;
int g_cur = -1; /* running thread, -1 on the scheduler */

namespace {

const size_t PAGE = 4096;
const size_t STACK_BYTES = 256 * 1024; /* per CUDA thread, plus a guard page below */
const int MAX_THREADS = 1024;

/* ---- what is running, for messages ---- */
const Site* g_site = nullptr; /* kernel being run, or null */
std::string g_activity;       /* "cublasLtMatmul ..." etc. when not a kernel */

/* ---- settings from the environment ---- */
struct Settings {
    int device_count = 1;
    std::vector<size_t> device_memory{(size_t)80 << 30}; /* one size for every device, or one per device */
    bool sync = false;
    bool profile = false;
    int order = 0; /* 0 forward, 1 reverse, 2 shuffle */
    uint64_t seed = 1;
    int stream_order = 0; /* EMU_STREAM_ORDER: 0 earliest, 1 latest, 2 shuffle */
    uint64_t stream_seed = 1;
    std::string deleted_file; /* EMU_DELETE_SYNC=FILE:LINE: that barrier, cp.async wait or stream wait is skipped, as if deleted */
    int deleted_line = -1;
};

size_t parse_bytes(const char* s) {
    char* end = nullptr;
    double v = strtod(s, &end);
    std::string u = end ? end : "";
    double mul = 1;
    if (u == "" || u == "B") mul = 1;
    else if (u == "K" || u == "KiB") mul = 1024.0;
    else if (u == "M" || u == "MiB") mul = 1024.0 * 1024;
    else if (u == "G" || u == "GiB") mul = 1024.0 * 1024 * 1024;
    else fatal("EMU_DEVICE_MEMORY=%s: expected bytes with an optional K, M or G (KiB, MiB, GiB) suffix", s);
    return (size_t)(v * mul);
}

Settings& settings() {
    static Settings s;
    static bool init = false;
    if (!init) {
        init = true;
        if (const char* v = getenv("EMU_DEVICE_COUNT")) s.device_count = atoi(v);
        if (const char* v = getenv("EMU_DEVICE_MEMORY")) { /* "16MiB", or "139GiB,138GiB": device d gets entry d */
            s.device_memory.clear();
            std::string list = v;
            for (size_t at = 0; at <= list.size();) {
                size_t comma = list.find(',', at);
                if (comma == std::string::npos) comma = list.size();
                s.device_memory.push_back(parse_bytes(list.substr(at, comma - at).c_str()));
                at = comma + 1;
            }
            if (s.device_memory.size() > 1 && (int)s.device_memory.size() != s.device_count)
                fatal("EMU_DEVICE_MEMORY=%s: %zu sizes for %d devices (EMU_DEVICE_COUNT): give one size, or one per device", v,
                      s.device_memory.size(), s.device_count);
        }
        if (const char* v = getenv("EMU_SYNC")) s.sync = atoi(v) != 0;
        if (const char* v = getenv("EMU_PROFILE")) s.profile = atoi(v) != 0;
        if (const char* v = getenv("EMU_STREAM_ORDER")) {
            std::string o = v;
            if (o == "earliest") s.stream_order = 0;
            else if (o == "latest") s.stream_order = 1;
            else if (o.rfind("shuffle", 0) == 0) {
                s.stream_order = 2;
                if (o.size() > 8 && o[7] == ':') s.stream_seed = strtoull(o.c_str() + 8, nullptr, 10);
            } else fatal("EMU_STREAM_ORDER=%s: expected earliest, latest or shuffle[:seed]", v);
        }
        if (const char* v = getenv("EMU_ORDER")) {
            std::string o = v;
            if (o == "forward") s.order = 0;
            else if (o == "reverse") s.order = 1;
            else if (o.rfind("shuffle", 0) == 0) {
                s.order = 2;
                if (o.size() > 8 && o[7] == ':') s.seed = strtoull(o.c_str() + 8, nullptr, 10);
            } else fatal("EMU_ORDER=%s: expected forward, reverse or shuffle[:seed]", v);
        }
        if (const char* v = getenv("EMU_DELETE_SYNC")) {
            const char* colon = strrchr(v, ':');
            char* end = nullptr;
            if (colon) s.deleted_line = (int)strtol(colon + 1, &end, 10);
            if (!colon || colon == v || !end || *end || s.deleted_line <= 0)
                fatal("EMU_DELETE_SYNC=%s: expected FILE:LINE of a __syncthreads(), __syncwarp(), ptx_cp_async_wait or cudaStreamWaitEvent() call", v);
            s.deleted_file.assign(v, colon);
        }
    }
    return s;
}

/* Is the barrier at file:line the one EMU_DELETE_SYNC deletes (file: a suffix of the path)? */
bool sync_deleted(const char* file, int line) {
    const Settings& st = settings();
    if (line != st.deleted_line) return false;
    size_t n = strlen(file), m = st.deleted_file.size();
    return n >= m && strcmp(file + n - m, st.deleted_file.c_str()) == 0 && (n == m || file[n - m - 1] == '/');
}

/* ---- memory registry ---- */
enum Kind { DEVICE = 1, PINNED = 2 };
struct Alloc {
    char* base;    /* what the API returned */
    size_t size;   /* requested bytes */
    size_t data;   /* size rounded up to 256 */
    char* map;     /* the mapping: guard page, slack, data, guard page */
    size_t map_len;
    int kind;
};
std::map<uintptr_t, Alloc> g_allocs; /* by base */
struct Freed {
    uintptr_t lo, hi;
    int kind;
    size_t size;
};
std::vector<Freed> g_freed;
size_t g_device_bytes = 0;
bool pinned_reserve(int64_t delta); /* EMU_HOST_PINNED_LIMIT's node-wide ledger (below) */
const unsigned char CANARY = 0xa5;

const char* kind_name(int k) { return k == DEVICE ? "cudaMalloc" : "cudaMallocHost"; }

/* " (inside a freed N-byte cudaMalloc block at P: use after free)" or "" */
std::string freed_note(const void* p) {
    uintptr_t a = (uintptr_t)p;
    for (auto it = g_freed.rbegin(); it != g_freed.rend(); ++it)
        if (a >= it->lo && a <= it->hi) {
            char buf[160];
            snprintf(buf, sizeof(buf), " (inside a freed %zu-byte %s block at %p: use after free)", it->size, kind_name(it->kind),
                     (void*)it->lo);
            return buf;
        }
    return "";
}

/* The allocation whose [base, base+size] holds p (end inclusive), or null. */
const Alloc* find_alloc(const void* p) {
    uintptr_t a = (uintptr_t)p;
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin()) return nullptr;
    --it;
    const Alloc& al = it->second;
    return a <= (uintptr_t)al.base + al.size ? &al : nullptr;
}

const size_t HUGE_DEVICE_BLOCK = (size_t)1 << 30;

void* guarded_alloc(size_t n, int kind) {
    size_t data = (n + 255) / 256 * 256;
    size_t pages = (data + PAGE - 1) / PAGE * PAGE;
    size_t len = pages + 2 * PAGE;
    /* device blocks in initcheck's range (emu_initcheck.cpp), so that their bytes have a shadow */
    char* m = kind == DEVICE ? device_map(len)
                             : (char*)mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (!m || m == MAP_FAILED) return nullptr;
    mprotect(m, PAGE, PROT_NONE);
    mprotect(m + PAGE + pages, PAGE, PROT_NONE);
    char* p = m + PAGE + pages - data;
    /* A device block of 1 GiB or more is left unfilled under initcheck, which
     * stops every read of a byte nothing wrote, so the fill could never be
     * seen; its pages then cost memory only once written (a test's rows past
     * element 2^31 of a huge tensor, test_gpt.cu's check_wide_offsets). */
    if (kind != DEVICE || !g_initcheck || n < HUGE_DEVICE_BLOCK) memset(p, 0xff, n);
    memset(p + n, CANARY, data - n);
    g_allocs[(uintptr_t)p] = Alloc{p, n, data, m, len, kind};
    return p;
}

void guarded_free(const char* api, void* p, int kind) {
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end() || it->second.kind != kind) {
        const Alloc* in = find_alloc(p);
        if (in) fatal("%s(%p): not the start of a block (inside the %zu-byte %s block at %p)", api, p, in->size, kind_name(in->kind), in->base);
        fatal("%s(%p): not a pointer returned by %s (or freed already)", api, p, kind_name(kind));
    }
    Alloc a = it->second;
    g_allocs.erase(it);
    forget_heaps((uintptr_t)a.base, (uintptr_t)a.base + a.size);
    if (kind == DEVICE) g_device_bytes -= a.data;
    else pinned_reserve(-(int64_t)a.data);
    /* keep the addresses, drop the memory: a later access faults and is named */
    if (kind == DEVICE) device_unmap(a.map, a.map_len);
    else mmap(a.map, a.map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    g_freed.push_back(Freed{(uintptr_t)a.base, (uintptr_t)a.base + a.size, kind, a.size});
}

/* ---- EMU_HOST_PINNED_LIMIT: pinned host memory, one limit for a node ----
 * The processes mpirun starts on one machine (children of one launcher:
 * the same parent process) are one emulated node; their cudaMallocHost
 * bytes draw on one limit, as the pinned memory of a real node does (every
 * rank's pool takes the same RAM). The ledger is a file of (pid, bytes)
 * records under flock in /dev/shm (else /tmp), named by the parent's pid;
 * records of processes no longer alive are not counted (a rank that died
 * without cudaFreeHost frees its share). */
struct PinnedRecord {
    int64_t pid, bytes;
};
const int PINNED_RECORDS = 256;
size_t g_pinned_bytes = 0; /* this process's */

size_t pinned_limit(void) {
    static size_t limit = 0;
    static bool read = false;
    if (!read) {
        read = true;
        if (const char* v = getenv("EMU_HOST_PINNED_LIMIT")) limit = parse_bytes(v);
    }
    return limit;
}

/* Adds delta to this process's pinned bytes if the node's total stays within
 * the limit; returns false (nothing changed) when it would not. */
bool pinned_reserve(int64_t delta) {
    if (!pinned_limit()) { g_pinned_bytes += delta; return true; }
    char path[128];
    const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(path, sizeof(path), "%s/emu-pinned-node-%d", dir, (int)getppid());
    int fd = open(path, O_RDWR | O_CREAT, 0600);
    if (fd < 0) fatal("EMU_HOST_PINNED_LIMIT: cannot open the node's ledger %s: %s", path, strerror(errno));
    flock(fd, LOCK_EX);
    PinnedRecord rec[PINNED_RECORDS];
    memset(rec, 0, sizeof(rec));
    ssize_t got = pread(fd, rec, sizeof(rec), 0);
    (void)got;
    int64_t others = 0;
    int mine = -1, empty = -1;
    for (int i = 0; i < PINNED_RECORDS; i++) {
        if (rec[i].pid == (int64_t)getpid()) mine = i;
        else if (rec[i].pid > 0 && (kill((pid_t)rec[i].pid, 0) == 0 || errno != ESRCH)) others += rec[i].bytes;
        else if (empty < 0) empty = i;
    }
    int64_t next = (int64_t)g_pinned_bytes + delta;
    bool ok = delta <= 0 || (size_t)(others + next) <= pinned_limit();
    if (ok) {
        int at = mine >= 0 ? mine : empty;
        if (at < 0) fatal("EMU_HOST_PINNED_LIMIT: more than %d processes on the node's ledger %s", PINNED_RECORDS, path);
        rec[at] = PinnedRecord{(int64_t)getpid(), next};
        if (pwrite(fd, &rec[at], sizeof(rec[at]), (off_t)at * (off_t)sizeof(PinnedRecord)) != (ssize_t)sizeof(rec[at]))
            fatal("EMU_HOST_PINNED_LIMIT: cannot write the node's ledger %s", path);
        g_pinned_bytes = (size_t)next;
    }
    flock(fd, LOCK_UN);
    close(fd);
    return ok;
}

/* ---- streams ----
 * Every stream has its own queue. At a synchronisation point the scheduler
 * runs, one at a time, operations at the head of a queue that nothing holds
 * back (a stream wait whose event record has not run, an NCCL call still in
 * flight), choosing among them by EMU_STREAM_ORDER: the one issued earliest
 * (as one in-order queue would), the one issued latest (every stream as far
 * behind the others as its waits allow), or at random. Each stream carries a
 * vector clock (emu_streamcheck.cpp): its entry for stream s is the latest
 * epoch of s it is ordered after; an event record copies its stream's
 * clock, a wait joins it, the host's clock (joined by synchronisations)
 * is joined into every operation issued after. */
typedef std::vector<uint32_t> Clock;

void join(Clock& into, const Clock& from) {
    if (into.size() < from.size()) into.resize(from.size(), 0);
    for (size_t i = 0; i < from.size(); i++) into[i] = std::max(into[i], from[i]);
}

struct Recorded { /* one cudaEventRecord */
    Clock clock;
    double ms = 0;
    bool done = false;
};

struct Op {
    uint64_t seq;                          /* issue order */
    std::string what;                      /* for messages */
    std::function<void()> run;             /* the work (start, for an async op) */
    std::function<bool()> poll;            /* async (NCCL): done when it returns true */
    std::shared_ptr<Recorded> wait_for;    /* cudaStreamWaitEvent */
    std::shared_ptr<Recorded> record;      /* cudaEventRecord */
    Clock host;                            /* the host's clock at issue */
};

struct Stream {
    cudaStream_t handle;
    int index;
    bool blocking;    /* synchronises with the legacy default stream */
    bool alive = true;
    std::string name;
    std::deque<Op> queue;
    Clock clock;
    bool in_flight = false; /* the head is an async op that started */
    uint32_t op_id = 0;     /* its streamcheck id */
};

std::vector<Stream*> g_streams; /* by index; 0 the legacy default stream; destroyed ones stay (not alive) */
Clock g_host_clock;
uint64_t g_issued = 0;
uint64_t g_stream_rng = 0;
cudaError_t g_last_error = cudaSuccess;

cudaError_t set_error(cudaError_t e) {
    if (e != cudaSuccess) g_last_error = e;
    return e;
}

/* ---- coroutines ---- */
enum TState : uint8_t { T_NEW, T_RUN, T_WARP, T_BAR, T_DONE };
struct Thr {
    int stack;
    TState state;
    int line;
    const char* file;
    WarpOp op;
    const char* api;     /* the operation's name, for messages */
    WarpCollective coll; /* OP_COLLECTIVE: what runs once the warp is there */
    unsigned mask;
    int arg, width;
    uint64_t bits, result;
};
Thr g_thr[MAX_THREADS];
uint64_t g_resumes = 0;
void* g_sched_sp;
int g_nthreads;
const std::function<void()>* g_body;
struct Stack {
    char* map;
    char* top;
    void* sp; /* saved stack pointer of the coroutine on it */
};
std::vector<Stack> g_stacks;
std::vector<int> g_free_stacks;
std::vector<std::pair<void*, size_t>> g_shared; /* static __shared__ objects used by this launch */
char* g_dyn_smem = nullptr;
size_t g_dyn_smem_bytes = 0;
/* Static, so that it lies in .bss with the static __shared__ objects, where
 * racecheck watches; 128-byte aligned: transform.py drops the alignment an
 * extern __shared__ declaration asks for (which the GPU's compiler honours),
 * and WMMA needs 32. */
alignas(128) char g_dyn_buf[227 * 1024]; /* EMU_DYN_SMEM_MAX, below */
char* g_no_smem_page = nullptr;

uint64_t g_rng;
uint64_t next_rand() { /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A permutation of 0..n-1 in the configured order. */
void make_order(std::vector<int>& v, int n) {
    v.resize(n);
    for (int i = 0; i < n; i++) v[i] = i;
    int o = settings().order;
    if (o == 1) std::reverse(v.begin(), v.end());
    else if (o == 2)
        for (int i = n - 1; i > 0; i--) std::swap(v[i], v[next_rand() % (uint64_t)(i + 1)]);
}

void set_thread_index(int t) {
    if (cur_block_dim.y == 1 && cur_block_dim.z == 1) {
        cur_thread_idx.x = (unsigned)t;
        cur_thread_idx.y = cur_thread_idx.z = 0;
        return;
    }
    cur_thread_idx.x = t % cur_block_dim.x;
    cur_thread_idx.y = (t / cur_block_dim.x) % cur_block_dim.y;
    cur_thread_idx.z = t / (cur_block_dim.x * cur_block_dim.y);
}

/* Coroutines. A coroutine starts as a batch: it runs the not-yet-started
 * threads listed in g_batch one after another on its stack, each to
 * completion, until one of them blocks (at __syncthreads or a warp
 * operation). That thread then owns the coroutine (it is "detached" from the
 * batch) and the scheduler starts a new batch for the rest. A detached thread,
 * resumed later, ends its coroutine when it finishes. So threads that never
 * block cost a function call, not a context switch. */
std::vector<int> g_batch;
size_t g_batch_next;
int g_running_stack;      /* stack of the coroutine being switched into */
bool g_coroutine_ended;   /* set by a coroutine just before its last switch out */
bool g_detached[MAX_THREADS];

void thread_entry() {
    int stack = g_running_stack;
    while (g_batch_next < g_batch.size()) {
        int t = g_batch[g_batch_next++];
        Thr& th = g_thr[t];
        th.state = T_RUN;
        th.stack = stack;
        g_detached[t] = false;
        g_cur = t;
        g_resumes++;
        set_thread_index(t);
        (*g_body)();
        g_thr[t].state = T_DONE;
        if (g_detached[t]) break;
    }
    g_coroutine_ended = true;
    emu_switch(&g_stacks[stack].sp, g_sched_sp);
    abort(); /* an ended coroutine is never resumed */
}

int get_stack() {
    if (!g_free_stacks.empty()) {
        int s = g_free_stacks.back();
        g_free_stacks.pop_back();
        return s;
    }
    char* m = (char*)mmap(nullptr, STACK_BYTES + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) fatal("cannot map a %zu-byte thread stack", STACK_BYTES);
    mprotect(m, PAGE, PROT_NONE);
    /* stagger the tops so that the hot frames of different stacks do not share L1 sets */
    size_t stagger = (g_stacks.size() * 576) % 4096;
    g_stacks.push_back(Stack{m, m + PAGE + STACK_BYTES - stagger, nullptr});
    return (int)g_stacks.size() - 1;
}

/* Switches into a coroutine. Control comes back when the last coroutine
 * running (threads hand over to each other, see block_here) blocks or ends;
 * an ended one's stack is free again. */
void enter(int stack) {
    g_running_stack = stack;
    g_coroutine_ended = false;
    emu_switch(&g_sched_sp, g_stacks[stack].sp);
    g_cur = -1;
    if (g_coroutine_ended) g_free_stacks.push_back(g_running_stack);
}

/* Starts batches for the threads in g_batch until all have started. */
void run_batch() {
    g_batch_next = 0;
    while (g_batch_next < g_batch.size()) {
        int stack = get_stack();
        uintptr_t top = (uintptr_t)g_stacks[stack].top & ~(uintptr_t)15;
        void** sp = (void**)top;
        *--sp = nullptr;              /* alignment slot: entry sees rsp = 8 mod 16, as after a call */
        *--sp = (void*)thread_entry;  /* where emu_switch's ret goes */
        for (int r = 0; r < 6; r++) *--sp = nullptr; /* rbp rbx r12 r13 r14 r15 */
        g_stacks[stack].sp = sp;
        enter(stack);
    }
}

/* Resumes a blocked (now released) thread. */
void resume(int t) {
    Thr& th = g_thr[t];
    th.state = T_RUN;
    g_resumes++;
    g_cur = t;
    set_thread_index(t);
    enter(th.stack);
}

/* The lanes of the warp being run, in run order, and each lane's place in it. */
int g_warp_lanes[32];
int g_warp_n;
int g_lane_pos[MAX_THREADS];

/* Called by a thread to wait (at a barrier or warp operation): hands the CPU
 * straight to the next released lane of its warp if there is one (one
 * context switch instead of two through the scheduler), else to the scheduler. */
inline void block_here(int me) {
    g_detached[me] = true;
    void** save = &g_stacks[g_thr[me].stack].sp;
    for (int i = g_lane_pos[me] + 1; i < g_warp_n; i++) {
        int t = g_warp_lanes[i];
        if (g_thr[t].state == T_RUN) {
            g_resumes++;
            g_cur = t;
            set_thread_index(t);
            g_running_stack = g_thr[t].stack;
            emu_switch(save, g_stacks[g_running_stack].sp);
            return;
        }
    }
    emu_switch(save, g_sched_sp);
}

const char* op_name(WarpOp op) {
    switch (op) {
    case OP_SHFL_XOR: return "__shfl_xor_sync";
    case OP_SHFL_DOWN: return "__shfl_down_sync";
    case OP_SHFL_UP: return "__shfl_up_sync";
    case OP_SHFL_IDX: return "__shfl_sync";
    case OP_BALLOT: return "__ballot_sync";
    case OP_ANY: return "__any_sync";
    case OP_ALL: return "__all_sync";
    case OP_SYNCWARP: return "__syncwarp";
    case OP_COLLECTIVE: break; /* named by its caller (Thr::api) */
    }
    return "?";
}

void warp_exchange(int t0, int n) {
    const Thr& a = g_thr[t0];
    for (int l = 0; l < n; l++) {
        const Thr& b = g_thr[t0 + l];
        if (b.op != a.op || b.coll != a.coll || b.line != a.line || (b.file != a.file && strcmp(b.file, a.file) != 0)) {
            g_cur = t0 + l;
            set_thread_index(t0 + l);
            fatal("warp %d: lane 0 is at %s (%s:%d) while lane %d is at %s (%s:%d): a warp operation must be reached by all lanes "
                  "of its mask together",
                  t0 / 32, a.api, a.file, a.line, l, b.api, b.file, b.line);
        }
        if (b.mask != 0xffffffffu) {
            g_cur = t0 + l;
            set_thread_index(t0 + l);
            fatal("%s (%s:%d) with mask 0x%08x: only the full mask 0xffffffff is emulated", b.api, b.file, b.line, b.mask);
        }
    }
    if (n != 32) {
        g_cur = t0;
        set_thread_index(t0);
        fatal("%s (%s:%d) with the full mask in a partial warp of %d lanes (block of %d threads): undefined", a.api, a.file,
              a.line, n, g_nthreads);
    }
    if (a.op == OP_COLLECTIVE) {
        void* lanes[32];
        for (int l = 0; l < 32; l++) lanes[l] = (void*)(uintptr_t)g_thr[t0 + l].bits;
        g_cur = t0; /* its messages name the warp's lane 0 */
        set_thread_index(t0);
        a.coll(lanes);
        g_cur = -1;
        for (int l = 0; l < 32; l++) g_thr[t0 + l].state = T_RUN;
        return;
    }
    uint64_t vote = 0;
    for (int l = 0; l < 32; l++) vote |= (g_thr[t0 + l].bits & 1) << l;
    for (int l = 0; l < 32; l++) {
        Thr& b = g_thr[t0 + l];
        int w = b.width;
        if (a.op <= OP_SHFL_IDX && (w < 1 || w > 32 || (w & (w - 1)))) {
            g_cur = t0 + l;
            set_thread_index(t0 + l);
            fatal("%s (%s:%d): width %d is not a power of two in 1..32", b.api, b.file, b.line, w);
        }
        int seg = l & ~(w - 1), src = l;
        switch (a.op) {
        case OP_SHFL_XOR: src = l ^ b.arg; if (src >= seg + w || src < 0) src = l; break;
        case OP_SHFL_DOWN: src = (l - seg) + b.arg < w ? l + b.arg : l; break;
        case OP_SHFL_UP: src = (l - seg) >= b.arg ? l - b.arg : l; break;
        case OP_SHFL_IDX: src = seg + (((b.arg % w) + w) % w); break;
        default: break;
        }
        if (src < 0 || src > 31) src = l;
        switch (a.op) {
        case OP_BALLOT: b.result = vote; break;
        case OP_ANY: b.result = vote != 0; break;
        case OP_ALL: b.result = vote == 0xffffffffull; break;
        case OP_SYNCWARP: b.result = 0; break; /* the warp's epoch advances below */
        default: b.result = g_thr[t0 + src].bits; break;
        }
    }
    if (a.op == OP_SYNCWARP) race_warp_epoch(t0 / 32);
    for (int l = 0; l < 32; l++) g_thr[t0 + l].state = T_RUN;
}

/* Runs one warp's lanes until each is at __syncthreads or finished. */
void run_warp(int w, std::vector<int>& lane_order) {
    int t0 = w * 32, n = std::min(32, g_nthreads - t0);
    make_order(lane_order, n);
    g_warp_n = n;
    for (int i = 0; i < n; i++) {
        g_warp_lanes[i] = t0 + lane_order[i];
        g_lane_pos[t0 + lane_order[i]] = i;
    }
    for (;;) {
        g_batch.clear();
        for (int i = 0; i < n; i++)
            if (g_thr[t0 + lane_order[i]].state == T_NEW) g_batch.push_back(t0 + lane_order[i]);
        if (!g_batch.empty()) run_batch();
        for (int i = 0; i < n; i++) {
            int t = t0 + lane_order[i];
            if (g_thr[t].state == T_RUN) resume(t);
        }
        int at_warp = 0, first = -1;
        for (int l = 0; l < n; l++)
            if (g_thr[t0 + l].state == T_WARP) { at_warp++; if (first < 0) first = t0 + l; }
        if (!at_warp) return;
        if (at_warp != n) {
            int done = 0, bar = 0;
            for (int l = 0; l < n; l++) {
                done += g_thr[t0 + l].state == T_DONE;
                bar += g_thr[t0 + l].state == T_BAR;
            }
            const Thr& f = g_thr[first];
            g_cur = first;
            set_thread_index(first);
            fatal("warp %d: %s (%s:%d) reached by %d of %d lanes (%d finished, %d at __syncthreads): with mask 0x%08x every lane "
                  "must take part (divergent warp operation)",
                  w, f.api, f.file, f.line, at_warp, n, done, bar, f.mask);
        }
        warp_exchange(t0, n);
    }
}

void run_block(std::vector<int>& warp_order, std::vector<int>& lane_order) {
    for (int t = 0; t < g_nthreads; t++) { g_thr[t].state = T_NEW; g_thr[t].stack = -1; }
    for (auto& r : g_shared) memset(r.first, 0xff, r.second);
    if (g_dyn_smem_bytes) memset(g_dyn_smem, 0xff, g_dyn_smem_bytes);
    race_block_epoch(); /* shared memory is new: nothing before this block is a hazard */
    int nwarps = (g_nthreads + 31) / 32;
    for (;;) {
        make_order(warp_order, nwarps);
        for (int i = 0; i < nwarps; i++) run_warp(warp_order[i], lane_order);
        int bar = 0, done = 0, first = -1;
        for (int t = 0; t < g_nthreads; t++) {
            if (g_thr[t].state == T_BAR) { bar++; if (first < 0) first = t; }
            else done++;
        }
        if (!bar) return;
        const Thr& f = g_thr[first];
        if (done) {
            g_cur = first;
            set_thread_index(first);
            fatal("__syncthreads (%s:%d) reached by %d of %d threads, %d having finished: a barrier in divergent code is undefined",
                  f.file, f.line, bar, g_nthreads, done);
        }
        for (int t = 0; t < g_nthreads; t++) {
            const Thr& b = g_thr[t];
            if (b.line != f.line || (b.file != f.file && strcmp(b.file, f.file) != 0)) {
                g_cur = t;
                set_thread_index(t);
                fatal("threads of one block wait at different __syncthreads: thread %d at %s:%d, this one at %s:%d (divergent barrier)",
                      first, f.file, f.line, b.file, b.line);
            }
        }
        race_block_epoch();
        for (int t = 0; t < g_nthreads; t++) g_thr[t].state = T_RUN;
    }
}

/* ---- signals ---- */
char g_altstack[64 * 1024];

void describe_address(uintptr_t a, char* buf, size_t n) {
    for (const Stack& s : g_stacks)
        if (a >= (uintptr_t)s.map && a < (uintptr_t)s.map + PAGE) {
            snprintf(buf, n, "a thread stack's guard page: stack overflow (each CUDA thread has %zu KiB here)", STACK_BYTES / 1024);
            return;
        }
    for (auto& kv : g_allocs) {
        const Alloc& al = kv.second;
        if (a >= (uintptr_t)al.map && a < (uintptr_t)al.map + al.map_len) {
            long long off = (long long)(a - (uintptr_t)al.base);
            snprintf(buf, n, "%lld bytes %s the %zu-byte %s block at %p (guard page)", off < 0 ? -off : off - (long long)al.size,
                     off < 0 ? "before" : "past the end of", al.size, kind_name(al.kind), (void*)al.base);
            return;
        }
    }
    for (auto it = g_freed.rbegin(); it != g_freed.rend(); ++it)
        if (a >= it->lo - PAGE && a < it->hi + PAGE) {
            snprintf(buf, n, "inside or next to a freed %zu-byte %s block at %p (use after free)", it->size, kind_name(it->kind),
                     (void*)it->lo);
            return;
        }
    snprintf(buf, n, "not emulated device or pinned memory (a host pointer, or garbage)");
}

void on_fault(int sig, siginfo_t* si, void*) {
    char what[256];
    describe_address((uintptr_t)si->si_addr, what, sizeof(what));
    char ctx[512] = "";
    if (g_site && g_cur >= 0)
        snprintf(ctx, sizeof(ctx), " in kernel %s launched at %s:%d, block (%u,%u,%u) of (%u,%u,%u), thread (%u,%u,%u) of (%u,%u,%u)",
                 g_site->kernel, g_site->file, g_site->line, cur_block_idx.x, cur_block_idx.y, cur_block_idx.z, cur_grid_dim.x,
                 cur_grid_dim.y, cur_grid_dim.z, cur_thread_idx.x, cur_thread_idx.y, cur_thread_idx.z, cur_block_dim.x,
                 cur_block_dim.y, cur_block_dim.z);
    else if (!g_activity.empty())
        snprintf(ctx, sizeof(ctx), " in %s", g_activity.c_str());
    else
        snprintf(ctx, sizeof(ctx), " in host code");
    char msg[1024];
    int len = snprintf(msg, sizeof(msg), "emu: %s at address %p%s: %s\n", sig == SIGSEGV ? "invalid memory access (SIGSEGV)" : "bus error",
                       si->si_addr, ctx, what);
    if (write(2, msg, (size_t)std::min(len, (int)sizeof(msg) - 1)) < 0) {}
    signal(sig, SIG_DFL);
    raise(sig);
}

/* OpenMP workers that spin while the (single-threaded) emulation runs take
 * the cores it needs: on 2 cores a run is several times slower. libgomp reads
 * OMP_WAIT_POLICY before any constructor of ours runs, so set it and start
 * again, once, unless the caller chose a policy. */
__attribute__((constructor)) void passive_openmp() {
    if (getenv("OMP_WAIT_POLICY") || getenv("EMU_NO_REEXEC")) return;
    setenv("OMP_WAIT_POLICY", "passive", 1);
    setenv("EMU_NO_REEXEC", "1", 1);
    static char buf[1 << 16];
    FILE* f = fopen("/proc/self/cmdline", "rb");
    if (!f) return;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    std::vector<char*> args;
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1) args.push_back(buf + i);
    args.push_back(nullptr);
    execv("/proc/self/exe", args.data());
    /* exec failed: carry on with spinning workers */
}

__attribute__((constructor)) void install_handlers() {
    stack_t ss;
    ss.ss_sp = g_altstack;
    ss.ss_size = sizeof(g_altstack);
    ss.ss_flags = 0;
    sigaltstack(&ss, nullptr);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
}

struct Prof {
    uint64_t launches = 0, blocks = 0, threads = 0, resumes = 0;
    double ms = 0;
};
std::map<std::string, Prof> g_prof;

void print_profile() {
    std::vector<std::pair<std::string, Prof>> v(g_prof.begin(), g_prof.end());
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    fprintf(stderr, "emu profile (EMU_PROFILE=1): kernel, launches, blocks, threads, thread switches, ms\n");
    for (auto& e : v)
        fprintf(stderr, "  %-50s %8llu %10llu %12llu %12llu %10.1f\n", e.first.c_str(), (unsigned long long)e.second.launches,
                (unsigned long long)e.second.blocks, (unsigned long long)e.second.threads, (unsigned long long)e.second.resumes, e.second.ms);
}

double now_ms() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

}  // namespace

bool call_deleted(const char* file, int line) { return sync_deleted(file, line); }

/* ------------------------------------------------------------------------ */
/* emu:: API                                                                  */

void fatal(const char* fmt, ...) {
    fflush(stdout);
    fprintf(stderr, "emu: ");
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (g_site && g_cur >= 0)
        fprintf(stderr, "\n  in kernel %s launched at %s:%d, block (%u,%u,%u) of (%u,%u,%u), thread (%u,%u,%u) of (%u,%u,%u)",
                g_site->kernel, g_site->file, g_site->line, cur_block_idx.x, cur_block_idx.y, cur_block_idx.z, cur_grid_dim.x,
                cur_grid_dim.y, cur_grid_dim.z, cur_thread_idx.x, cur_thread_idx.y, cur_thread_idx.z, cur_block_dim.x, cur_block_dim.y,
                cur_block_dim.z);
    else if (g_site)
        fprintf(stderr, "\n  in kernel %s launched at %s:%d", g_site->kernel, g_site->file, g_site->line);
    else if (!g_activity.empty())
        fprintf(stderr, "\n  in %s", g_activity.c_str());
    fprintf(stderr, "\n  host backtrace (addr2line -e BINARY -f ADDRESS for static functions):\n");
    fflush(stderr);
    void* frames[32];
    int nf = backtrace(frames, 32);
    backtrace_symbols_fd(frames, nf, 2);
    abort();
}

void set_activity(const char* what) { g_activity = what ? what : ""; }

void syncthreads(int line, const char* file) {
    if (g_cur < 0) fatal("__syncthreads (%s:%d) called outside a kernel", file, line);
    if (sync_deleted(file, line)) return;
    int me = g_cur;
    Thr& t = g_thr[me];
    t.state = T_BAR;
    t.line = line;
    t.file = file;
    block_here(me);
}

uint64_t warp_op(int line, const char* file, WarpOp op, unsigned mask, uint64_t bits, int arg, int width) {
    if (g_cur < 0) fatal("%s (%s:%d) called outside a kernel", op_name(op), file, line);
    if (op == OP_SYNCWARP && sync_deleted(file, line)) return 0;
    int me = g_cur;
    Thr& t = g_thr[me];
    t.state = T_WARP;
    t.line = line;
    t.file = file;
    t.op = op;
    t.api = op_name(op);
    t.coll = nullptr;
    t.mask = mask;
    t.bits = bits;
    t.arg = arg;
    t.width = width;
    block_here(me);
    return g_thr[me].result;
}

void warp_collective(int line, const char* file, const char* api, WarpCollective fn, void* mine) {
    if (g_cur < 0) fatal("%s (%s:%d) called outside a kernel", api, file, line);
    int me = g_cur;
    Thr& t = g_thr[me];
    t.state = T_WARP;
    t.line = line;
    t.file = file;
    t.op = OP_COLLECTIVE;
    t.api = api;
    t.coll = fn;
    t.mask = 0xffffffffu; /* the whole warp, as CUDA requires of these operations */
    t.bits = (uint64_t)(uintptr_t)mine;
    t.arg = 0;
    t.width = 32;
    block_here(me);
}

void check_kernel_range(const char* api, const CallSite& where, const void* p, size_t bytes) {
    uintptr_t lo = (uintptr_t)p, hi = lo + bytes;
    if (const Alloc* a = find_alloc(p)) {
        uintptr_t end = (uintptr_t)a->base + a->size;
        if (hi > end)
            fatal("%s (%s:%d): %zu bytes at %p run %zu bytes past the end of the %zu-byte %s block at %p", api, where.file, where.line,
                  bytes, p, (size_t)(hi - end), a->size, kind_name(a->kind), (void*)a->base);
        char what[300];
        snprintf(what, sizeof(what), "%s (%s:%d)", api, where.file, where.line);
        check_region_range(what, "the tile", p, bytes);
        return;
    }
    for (auto& r : g_shared) {
        uintptr_t base = (uintptr_t)r.first, end = base + r.second;
        if (lo >= base && lo < end) {
            if (hi > end)
                fatal("%s (%s:%d): %zu bytes at %p run %zu bytes past the end of the %zu-byte __shared__ object at %p", api, where.file,
                      where.line, bytes, p, (size_t)(hi - end), r.second, r.first);
            return;
        }
    }
    uintptr_t dyn = (uintptr_t)g_dyn_smem;
    if (g_dyn_smem && lo >= dyn && lo < dyn + g_dyn_smem_bytes) {
        if (hi > dyn + g_dyn_smem_bytes)
            fatal("%s (%s:%d): %zu bytes at %p run %zu bytes past the end of the launch's %zu bytes of dynamic shared memory", api,
                  where.file, where.line, bytes, p, (size_t)(hi - dyn - g_dyn_smem_bytes), g_dyn_smem_bytes);
        return;
    }
    std::string freed = freed_note(p);
    fatal("%s (%s:%d): %p is neither device memory (cudaMalloc, cudaMallocHost) nor this block's shared memory%s", api, where.file,
          where.line, p, freed.empty() ? " (a local array or a host pointer?)" : freed.c_str());
}

std::string describe_device_byte(uintptr_t a) {
    std::string r = describe_region_byte(a);
    if (!r.empty()) return r;
    const Alloc* al = find_alloc((const void*)a);
    char buf[200];
    if (al)
        snprintf(buf, sizeof(buf), "byte %zu of the %zu-byte %s block at %p", (size_t)(a - (uintptr_t)al->base), al->size,
                 kind_name(al->kind), al->base);
    else snprintf(buf, sizeof(buf), "the byte at %p", (void*)a);
    return buf;
}

std::string describe_shared(uintptr_t a) {
    char buf[200];
    for (auto& r : g_shared) {
        uintptr_t base = (uintptr_t)r.first;
        if (a >= base && a < base + r.second) {
            snprintf(buf, sizeof(buf), "byte %zu of the %zu-byte __shared__ object at %p", (size_t)(a - base), r.second, r.first);
            return buf;
        }
    }
    uintptr_t dyn = (uintptr_t)g_dyn_smem;
    if (g_dyn_smem && a >= dyn && a < dyn + g_dyn_smem_bytes) {
        snprintf(buf, sizeof(buf), "byte %zu of the launch's %zu bytes of dynamic shared memory", (size_t)(a - dyn), g_dyn_smem_bytes);
        return buf;
    }
    return "shared memory of an earlier launch";
}

Stream* find_stream(const char* api, cudaStream_t stream) {
    if (g_streams.empty()) g_streams.push_back(new Stream{nullptr, 0, true, true, "the legacy default stream", {}, {}, false, 0});
    if (!stream) return g_streams[0];
    for (Stream* s : g_streams)
        if (s->handle == stream && s->alive) return s;
    fatal("%s: stream %p was not created by cudaStreamCreate (or was destroyed)", api, (void*)stream);
}

void check_stream(const char* api, cudaStream_t stream) { find_stream(api, stream); }

int stream_index(const char* api, cudaStream_t stream) { return find_stream(api, stream)->index; }

std::string stream_name(int stream) { return g_streams[stream]->name; }

/* Per kernel: the dynamic shared memory limit raised by cudaFuncSetAttribute (48 KiB otherwise). */
static std::map<const void*, size_t>& dyn_smem_limits() {
    static std::map<const void*, size_t> limits;
    return limits;
}
#define EMU_DYN_SMEM_DEFAULT (48 * 1024)
#define EMU_DYN_SMEM_MAX (227 * 1024) /* sm_90's opt-in maximum per block */

void check_launch(const Site& site, const void* kernel, dim3 grid, dim3 block, size_t dyn_smem, cudaStream_t stream) {
    const char* why = nullptr;
    char buf[200];
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (!block.x || !block.y || !block.z || !grid.x || !grid.y || !grid.z) why = "a zero grid or block dimension";
    else if (block.x > 1024 || block.y > 1024 || block.z > 64 || threads > 1024) {
        snprintf(buf, sizeof(buf), "block (%u,%u,%u) exceeds 1024 threads or the per-dimension limits (1024,1024,64)", block.x, block.y,
                 block.z);
        why = buf;
    } else if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
        snprintf(buf, sizeof(buf), "grid (%u,%u,%u) exceeds the limits (2^31-1,65535,65535)", grid.x, grid.y, grid.z);
        why = buf;
    } else if (dyn_smem > EMU_DYN_SMEM_DEFAULT) {
        auto it = dyn_smem_limits().find(kernel);
        size_t limit = it == dyn_smem_limits().end() ? EMU_DYN_SMEM_DEFAULT : it->second;
        if (dyn_smem > limit) {
            snprintf(buf, sizeof(buf), "%zu bytes of dynamic shared memory exceed the kernel's limit of %zu (48 KiB unless raised by "
                     "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize))", dyn_smem, limit);
            why = buf;
        }
    }
    if (why) fatal("invalid launch of %s at %s:%d: %s (the launch fails on a GPU)", site.kernel, site.file, site.line, why);
    check_stream("kernel launch", stream);
}

void check_kernel_pointer(const Site& site, int i, const void* p) {
    if (!p) return;
    if (!find_alloc(p))
        fatal("launch of %s at %s:%d: pointer argument %d (%p) points into no cudaMalloc or cudaMallocHost block%s (invalid on a GPU)",
              site.kernel, site.file, site.line, i, p, freed_note(p).c_str()[0] ? freed_note(p).c_str() : " (a pageable host pointer?)");
}

void check_device_range(const char* api, const char* operand, const void* p, size_t bytes) {
    if (bytes == 0) return;
    const Alloc* a = find_alloc(p);
    if (!a || a->kind != DEVICE)
        fatal("%s: %s (%p, %zu bytes) is not device memory from cudaMalloc%s", api, operand, p, bytes,
              a ? " (it is pinned host memory)" : freed_note(p).c_str());
    uintptr_t end = (uintptr_t)p + bytes, aend = (uintptr_t)a->base + a->size;
    if (end > aend)
        fatal("%s: %s (%zu bytes at %p) runs %zu bytes past the end of its %zu-byte cudaMalloc block at %p", api, operand, bytes, p,
              (size_t)(end - aend), a->size, (void*)a->base);
    check_region_range(api, operand, p, bytes);
}

void check_canaries(const char* after_what) {
    check_guard_canaries(after_what);
    for (auto& kv : g_allocs) {
        const Alloc& a = kv.second;
        for (size_t i = a.size; i < a.data; i++)
            if ((unsigned char)a.base[i] != CANARY)
                fatal("%s wrote %zu bytes past the end of the %zu-byte %s block at %p", after_what, i - a.size + 1, a.size,
                      kind_name(a.kind), (void*)a.base);
    }
}

namespace {

void push(Stream* s, Op op) {
    op.seq = ++g_issued;
    op.host = g_host_clock;
    s->queue.push_back(std::move(op));
}

/* The legacy default stream waits for the work issued before on every
 * blocking stream, and such a stream for the default stream's (CUDA's
 * implicit synchronisation): an internal record and wait. */
void legacy_sync(Stream* s) {
    auto link = [](Stream* from, Stream* to) {
        if (from->queue.empty() && from->clock.empty()) return; /* never used */
        auto rec = std::make_shared<Recorded>();
        Op r;
        r.what = "the implicit synchronisation with the legacy default stream";
        r.record = rec;
        push(from, std::move(r));
        Op w;
        w.what = r.what;
        w.wait_for = rec;
        push(to, std::move(w));
    };
    if (s->index == 0) {
        for (Stream* t : g_streams)
            if (t->index && t->alive && t->blocking) link(t, s);
    } else if (s->blocking) {
        link(g_streams[0], s);
    }
}

bool runnable(Stream* s) {
    if (s->queue.empty()) return false;
    if (s->in_flight) return true; /* to be polled */
    const Op& op = s->queue.front();
    return !op.wait_for || op.wait_for->done;
}

void finish_head(Stream* s) {
    Op& op = s->queue.front();
    if (op.record) {
        op.record->clock = s->clock;
        op.record->ms = now_ms();
        op.record->done = true;
    }
    s->queue.pop_front();
    s->in_flight = false;
}

/* Starts or polls the head of s; false if it is an async op still in flight. */
bool step(Stream* s) {
    Op& op = s->queue.front();
    if (s->in_flight) {
        stream_op_resume(s->op_id, s->index, &s->clock);
        bool done = op.poll();
        stream_op_end();
        if (done) finish_head(s);
        return done;
    }
    join(s->clock, op.host);
    if (op.wait_for) join(s->clock, op.wait_for->clock);
    if (op.run) {
        if (s->clock.size() <= (size_t)s->index) s->clock.resize(s->index + 1, 0);
        uint32_t epoch = ++s->clock[s->index];
        s->op_id = stream_op_begin(s->index, epoch, &s->clock, std::move(op.what));
        op.run();
        stream_op_end();
        if (op.poll) {
            s->in_flight = true;
            return step(s);
        }
    }
    finish_head(s);
    return true;
}

/* Completes the NCCL calls in flight that can, else runs one operation
 * chosen by EMU_STREAM_ORDER; false if nothing could. */
bool step_any(void) {
    bool any = false;
    for (Stream* s : g_streams)
        if (s->in_flight && step(s)) any = true;
    if (any) return true;
    Stream* pick = nullptr;
    int n = 0, order = settings().stream_order;
    for (Stream* s : g_streams) {
        if (s->in_flight || !runnable(s)) continue;
        n++;
        uint64_t seq = s->queue.front().seq;
        if (!pick) pick = s;
        else if (order == 0 && seq < pick->queue.front().seq) pick = s;
        else if (order == 1 && seq > pick->queue.front().seq) pick = s;
        else if (order == 2) {
            g_stream_rng = g_stream_rng * 6364136223846793005ull + settings().stream_seed * 2 + 1;
            if ((g_stream_rng >> 33) % (uint64_t)n == 0) pick = s; /* reservoir choice: each runnable stream equally likely */
        }
    }
    if (!pick) return false;
    step(pick);
    return true;
}

bool anything_queued(void) {
    for (Stream* s : g_streams)
        if (!s->queue.empty()) return true;
    return false;
}

/* Runs until done() holds; when only NCCL calls waiting for other processes are left, polls them. */
void run_until(const std::function<bool()>& done) {
    while (!done()) {
        if (step_any()) continue;
        bool waiting = false;
        for (Stream* s : g_streams) waiting = waiting || s->in_flight;
        if (!waiting) {
            std::string heads;
            for (Stream* s : g_streams)
                if (!s->queue.empty()) heads += "\n  " + s->name + ": " + s->queue.front().what;
            fatal("streams deadlocked: nothing can run (waits on event records that cannot run):%s", heads.c_str());
        }
        usleep(50);
    }
}

/* After the host waited for s: everything s ran is ordered before what the host issues next. */
void host_waited(Stream* s) { join(g_host_clock, s->clock); }

void device_sync(void) {
    flush();
    for (Stream* s : g_streams) host_waited(s);
}

}  // namespace

void enqueue_named(cudaStream_t stream, std::string what, std::function<void()> run) {
    Stream* s = find_stream("enqueue", stream);
    legacy_sync(s);
    Op op;
    op.what = std::move(what);
    op.run = std::move(run);
    push(s, std::move(op));
    if (settings().sync) flush();
}

void enqueue_async(cudaStream_t stream, std::string what, std::function<void()> start, std::function<bool()> poll) {
    Stream* s = find_stream("enqueue", stream);
    legacy_sync(s);
    Op op;
    op.what = std::move(what);
    op.run = std::move(start);
    op.poll = std::move(poll);
    push(s, std::move(op));
    if (settings().sync) flush();
}

bool stream_check_on(void) { return g_stream_check; }

bool progress(void) {
    while (step_any()) {}
    return anything_queued();
}

void flush(void) { run_until([]() { return !anything_queued(); }); }

namespace {
uint64_t g_window_lo = 0, g_window_hi = UINT64_MAX;
}  // namespace

void block_window(uint64_t* x_lo, uint64_t* x_hi) {
    *x_lo = g_window_lo;
    *x_hi = g_window_hi;
}

void run_grid(const Site& site, dim3 grid, dim3 block, size_t dyn_smem, const std::function<void()>& body, uint64_t x_lo,
              uint64_t x_hi) {
    g_site = &site;
    cur_grid_dim = grid;
    cur_block_dim = block;
    g_nthreads = (int)(block.x * block.y * block.z);
    g_body = &body;
    g_shared.clear();
    race_init();
    g_dyn_smem = dyn_smem ? g_dyn_buf : nullptr;
    g_dyn_smem_bytes = dyn_smem;
    if (dyn_smem) race_track(g_dyn_buf, dyn_smem);
    race_kernel(true);
    g_rng = settings().seed * 0x2545f4914f6cdd1dull + (uint64_t)site.line;
    uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
    int order = settings().order;
    /* shuffle: block i runs as (i * mul + off) mod nblocks, mul a unit mod nblocks (a bijection) */
    uint64_t mul = 1, off = 0;
    if (order == 2 && nblocks > 1) {
        auto gcd = [](uint64_t x, uint64_t y) { while (y) { uint64_t r = x % y; x = y; y = r; } return x; };
        mul = next_rand() % nblocks;
        while (gcd(mul, nblocks) != 1) mul = (mul + 1) % nblocks;
        off = next_rand() % nblocks;
    }
    std::vector<int> warp_order, lane_order;
    double t0 = settings().profile ? now_ms() : 0;
    uint64_t r0 = g_resumes;
    for (uint64_t i = 0; i < nblocks; i++) {
        uint64_t b = order == 1 ? nblocks - 1 - i : order == 2 ? (uint64_t)(((unsigned __int128)i * mul + off) % nblocks) : i;
        cur_block_idx.x = (unsigned)(b % grid.x);
        if (cur_block_idx.x < x_lo || cur_block_idx.x >= x_hi) continue;
        cur_block_idx.y = (unsigned)((b / grid.x) % grid.y);
        cur_block_idx.z = (unsigned)(b / ((uint64_t)grid.x * grid.y));
        run_block(warp_order, lane_order);
    }
    if (settings().profile) {
        static bool registered = false;
        if (!registered) { registered = true; atexit(print_profile); }
        Prof& pr = g_prof[site.kernel];
        pr.launches++;
        pr.blocks += nblocks;
        pr.threads += nblocks * (uint64_t)g_nthreads;
        pr.resumes += g_resumes - r0;
        pr.ms += now_ms() - t0;
    }
    char what[300];
    snprintf(what, sizeof(what), "kernel %s launched at %s:%d", site.kernel, site.file, site.line);
    race_kernel(false);
    g_site = nullptr;
    g_dyn_smem = nullptr;
    g_dyn_smem_bytes = 0;
    check_canaries(what);
}

}  // namespace emu

using namespace emu;

void emu_block_window(uint64_t x_lo, uint64_t x_hi) {
    bool whole = x_lo == 0 && x_hi == 0;
    if (!whole && x_lo >= x_hi) fatal("emu_block_window(%llu, %llu): an empty window (0, 0 restores whole grids)", (unsigned long long)x_lo,
                                      (unsigned long long)x_hi);
    g_window_lo = whole ? 0 : x_lo;
    g_window_hi = whole ? UINT64_MAX : x_hi;
}

/* ------------------------------------------------------------------------ */
/* checks inserted by transform.py                                            */

void emu_launch_bounds(long max_threads) {
    if (g_nthreads > max_threads)
        fatal("kernel launched with %d threads per block, above its __launch_bounds__(%ld): the launch fails on a GPU", g_nthreads,
              max_threads);
}

void emu_shared_use(void* p, size_t bytes) {
    if (g_cur < 0) fatal("__shared__ object at %p used outside a kernel", p);
    for (auto& r : g_shared)
        if (r.first == p) return;
    g_shared.push_back({p, bytes});
    race_track(p, bytes);
    memset(p, 0xff, bytes); /* first use in this launch: uninitialised, as on a GPU */
}

void* emu_dynamic_shared(void) {
    if (g_dyn_smem) return g_dyn_smem;
    if (!g_no_smem_page) {
        g_no_smem_page = (char*)mmap(nullptr, PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    return g_no_smem_page; /* launched with 0 bytes of dynamic shared memory: any access faults */
}

/* ------------------------------------------------------------------------ */
/* runtime API                                                                */

const char* cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorSystemNotReady: return "cudaErrorSystemNotReady";
    }
    return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected (emulator: EMU_DEVICE_COUNT=0)";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotReady: return "device not ready";
    default: return cudaGetErrorName(e);
    }
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = g_last_error;
    g_last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return g_last_error; }

static int g_device = 0;

cudaError_t cudaGetDeviceCount(int* count) {
    *count = settings().device_count;
    return *count > 0 ? cudaSuccess : set_error(cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int* device) {
    if (settings().device_count <= 0) return set_error(cudaErrorNoDevice);
    *device = g_device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    if (settings().device_count <= 0) return set_error(cudaErrorNoDevice);
    if (device < 0 || device >= settings().device_count) return set_error(cudaErrorInvalidDevice);
    g_device = device;
    return cudaSuccess;
}

/* Memory of device d: EMU_DEVICE_MEMORY's one size, or its entry d (real GPUs of one node differ by MiBs). */
static size_t device_memory_of(int d) {
    const std::vector<size_t>& m = settings().device_memory;
    return m.size() == 1 ? m[0] : m[(size_t)d];
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
    if (device < 0 || device >= settings().device_count) return set_error(cudaErrorInvalidDevice);
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "EMU (CPU emulation of CUDA, not a GPU)");
    p->totalGlobalMem = device_memory_of(device);
    p->sharedMemPerBlock = 48 * 1024;
    p->sharedMemPerBlockOptin = 227 * 1024;
    p->regsPerBlock = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = 1024; p->maxThreadsDim[1] = 1024; p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 0x7fffffff; p->maxGridSize[1] = 65535; p->maxGridSize[2] = 65535;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 1;
    p->maxThreadsPerMultiProcessor = 2048;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
    if (!value) fatal("cudaDeviceGetAttribute: NULL value");
    if (device < 0 || device >= settings().device_count) return set_error(cudaErrorInvalidDevice);
    if (attr == cudaDevAttrMultiProcessorCount) {
        *value = 1; /* cudaGetDeviceProperties' multiProcessorCount */
        return cudaSuccess;
    }
    if (attr != cudaDevAttrHostNumaId) fatal("cudaDeviceGetAttribute: attribute %d is not emulated", (int)attr);
    const char* env = getenv("EMU_HOST_NUMA_NODE");
    char* end = nullptr;
    long node = env && *env ? strtol(env, &end, 10) : -1;
    if (env && *env && (*end || node < -1 || node > 1023)) fatal("EMU_HOST_NUMA_NODE=%s: expected a NUMA node number (or -1)", env);
    *value = (int)node;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device) {
    if (!bus_id || len < 1) fatal("cudaDeviceGetPCIBusId: NULL or empty buffer");
    (void)device;
    bus_id[0] = 0;
    return set_error(cudaErrorInvalidValue);
}

cudaError_t cudaDeviceSynchronize(void) { device_sync(); return cudaSuccess; }
cudaError_t cudaDeviceReset(void) { device_sync(); return cudaSuccess; }

cudaError_t cudaRuntimeGetVersion(int* version) {
    *version = 0;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    size_t total = device_memory_of(g_device);
    *total_bytes = total;
    *free_bytes = g_device_bytes < total ? total - g_device_bytes : 0;
    return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
    if (settings().device_count <= 0) return set_error(cudaErrorNoDevice);
    if (bytes == 0) fatal("cudaMalloc of 0 bytes: not emulated (what a GPU returns is not relied upon here)");
    size_t rounded = (bytes + 255) / 256 * 256;
    if (g_device_bytes + rounded > device_memory_of(g_device)) { *ptr = nullptr; return set_error(cudaErrorMemoryAllocation); }
    void* p = guarded_alloc(bytes, DEVICE);
    if (!p) { *ptr = nullptr; return set_error(cudaErrorMemoryAllocation); }
    g_device_bytes += rounded;
    *ptr = p;
    return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
    if (settings().device_count <= 0) return set_error(cudaErrorNoDevice);
    device_sync(); /* cudaFree synchronises the device */
    if (ptr) guarded_free("cudaFree", ptr, DEVICE);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
    if (settings().device_count <= 0) return set_error(cudaErrorNoDevice);
    size_t rounded = ((bytes ? bytes : 1) + 255) / 256 * 256;
    if (!pinned_reserve((int64_t)rounded)) { *ptr = nullptr; return set_error(cudaErrorMemoryAllocation); }
    void* p = guarded_alloc(bytes ? bytes : 1, PINNED);
    if (!p) { pinned_reserve(-(int64_t)rounded); *ptr = nullptr; return set_error(cudaErrorMemoryAllocation); }
    *ptr = p;
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
    device_sync();
    if (ptr) guarded_free("cudaFreeHost", ptr, PINNED);
    return cudaSuccess;
}

namespace {

const char* memcpy_kind_name(cudaMemcpyKind k) {
    switch (k) {
    case cudaMemcpyHostToHost: return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice: return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost: return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice: return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault: return "cudaMemcpyDefault";
    }
    return "an unknown cudaMemcpyKind";
}

bool is_device(const void* p) {
    const Alloc* a = find_alloc(p);
    return a && a->kind == DEVICE;
}

bool is_pinned_range(const void* p, size_t n) {
    const Alloc* a = find_alloc(p);
    return a && a->kind == PINNED && (uintptr_t)p + n <= (uintptr_t)a->base + a->size;
}

/* "cudaMemcpy(cudaMemcpyDeviceToHost)", for messages (static storage) */
const char* copy_name(const char* api, cudaMemcpyKind kind) {
    static std::map<std::pair<std::string, int>, std::string> names;
    std::string& s = names[{api, (int)kind}];
    if (s.empty()) s = std::string(api) + "(" + memcpy_kind_name(kind) + ")";
    return s.c_str();
}

/* Checks a copy against its kind; returns the kind (cudaMemcpyDefault resolved). */
cudaMemcpyKind check_copy(const char* api, void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
    bool dd = is_device(dst), sd = is_device(src);
    if (kind == cudaMemcpyDefault)
        kind = dd && sd ? cudaMemcpyDeviceToDevice : dd ? cudaMemcpyHostToDevice : sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
    switch (kind) {
    case cudaMemcpyHostToDevice:
        if (sd) fatal("%s(%s): the source %p is device memory", api, memcpy_kind_name(kind), src);
        check_device_range(api, "the destination", dst, n);
        break;
    case cudaMemcpyDeviceToHost:
        if (dd) fatal("%s(%s): the destination %p is device memory", api, memcpy_kind_name(kind), dst);
        check_device_range(api, "the source", src, n);
        break;
    case cudaMemcpyDeviceToDevice:
        check_device_range(api, "the destination", dst, n);
        check_device_range(api, "the source", src, n);
        break;
    case cudaMemcpyHostToHost:
        if (dd || sd) fatal("%s(%s): an operand is device memory", api, memcpy_kind_name(kind));
        break;
    default: fatal("%s: %s (%d) is not emulated", api, memcpy_kind_name(kind), (int)kind);
    }
    if (n && ((uintptr_t)dst < (uintptr_t)src + n && (uintptr_t)src < (uintptr_t)dst + n))
        fatal("%s: source and destination overlap (%zu bytes at %p and %p)", api, n, src, dst);
    return kind;
}

}  // namespace

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
    kind = check_copy("cudaMemcpy", dst, src, n, kind);
    if (!n) return cudaSuccess;
    /* on the legacy default stream; returns once it is done (pageable host memory is read or written at the call) */
    const char* api = copy_name("cudaMemcpy", kind);
    enqueue_named(0, api, [api, dst, src, n]() { init_copy(api, dst, src, n); });
    cudaStreamSynchronize(0);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t stream) {
    kind = check_copy("cudaMemcpyAsync", dst, src, n, kind);
    check_stream("cudaMemcpyAsync", stream);
    if (!n) return cudaSuccess;
    const char* api = copy_name("cudaMemcpyAsync", kind);
    if (kind == cudaMemcpyHostToDevice && !is_pinned_range(src, n)) {
        /* pageable source: staged now (the caller may reuse it at once), copied in stream order */
        std::vector<char> staged((const char*)src, (const char*)src + n);
        enqueue_named(stream, api, [api, dst, staged = std::move(staged)]() { init_copy(api, dst, staged.data(), staged.size()); });
    } else if ((kind == cudaMemcpyDeviceToHost && !is_pinned_range(dst, n)) || kind == cudaMemcpyHostToHost) {
        /* to pageable memory: returns once the copy is done */
        enqueue_named(stream, api, [api, dst, src, n]() { init_copy(api, dst, src, n); });
        cudaStreamSynchronize(stream);
    } else {
        enqueue_named(stream, api, [api, dst, src, n]() { init_copy(api, dst, src, n); });
    }
    return cudaSuccess;
}

/* The CUDA documentation's rules: width at most either pitch, the two areas
 * not overlapping; each area is the span from its first row's start to its
 * last row's end, which must lie inside one device allocation. */
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
    const char* api = "cudaMemcpy2DAsync";
    check_stream(api, stream);
    if (width > dpitch || width > spitch) fatal("%s: width %zu exceeds dpitch %zu or spitch %zu", api, width, dpitch, spitch);
    if (!width || !height) return cudaSuccess;
    size_t dspan = dpitch * (height - 1) + width, sspan = spitch * (height - 1) + width;
    bool dd = is_device(dst), sd = is_device(src);
    if (kind == cudaMemcpyDefault && dd && sd) kind = cudaMemcpyDeviceToDevice;
    if (kind != cudaMemcpyDeviceToDevice || !dd || !sd)
        fatal("%s: only device-to-device copies between device buffers are emulated (%s, %p to %p)", api, memcpy_kind_name(kind), src, dst);
    check_device_range(api, "the destination", dst, dspan);
    check_device_range(api, "the source", src, sspan);
    if ((uintptr_t)dst < (uintptr_t)src + sspan && (uintptr_t)src < (uintptr_t)dst + dspan)
        fatal("%s: source and destination areas overlap (%zu bytes at %p and %zu at %p)", api, sspan, src, dspan, dst);
    enqueue_named(stream, api, [api, dst, dpitch, src, spitch, width, height]() {
        for (size_t i = 0; i < height; i++) init_copy(api, (char*)dst + i * dpitch, (const char*)src + i * spitch, width);
    });
    return cudaSuccess;
}

cudaError_t cudaMemset(void* dst, int value, size_t n) { return cudaMemsetAsync(dst, value, n, 0); }

cudaError_t cudaMemsetAsync(void* dst, int value, size_t n, cudaStream_t stream) {
    check_device_range("cudaMemset", "the destination", dst, n);
    check_stream("cudaMemsetAsync", stream);
    if (n) enqueue_named(stream, "cudaMemsetAsync", [dst, value, n]() {
        stream_access(dst, n, true);
        memset(dst, value, n);
        init_set(dst, n, true);
    });
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }

namespace {
cudaError_t create_stream(cudaStream_t* stream, unsigned int flags, int priority) {
    if (flags & ~1u) fatal("cudaStreamCreateWithFlags: flags 0x%x are not emulated", flags);
    find_stream("cudaStreamCreate", 0); /* the default stream exists first */
    static uintptr_t next = 0x1000;
    *stream = (cudaStream_t)(next += 16);
    int index = (int)g_streams.size();
    char name[160];
    snprintf(name, sizeof(name), "stream %d (created %s%s, priority %d)", index, flags ? "cudaStreamNonBlocking" : "blocking",
             flags ? "" : ": synchronises with the legacy default stream", priority);
    g_streams.push_back(new Stream{*stream, index, !(flags & cudaStreamNonBlocking), true, name, {}, {}, false, 0});
    g_stream_check = true; /* from now on accesses are checked across streams */
    return cudaSuccess;
}
}  // namespace

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) { return create_stream(stream, flags, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    Stream* s = find_stream("cudaStreamDestroy", stream);
    if (!stream) fatal("cudaStreamDestroy of the default stream");
    run_until([s]() { return s->queue.empty(); }); /* its work completes; the host is not synchronised */
    s->alive = false;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    Stream* s = find_stream("cudaStreamSynchronize", stream);
    run_until([s]() { return s->queue.empty(); });
    host_waited(s);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
    if (priority > 0 || priority < -5) fatal("cudaStreamCreateWithPriority: priority %d outside the range [-5, 0]", priority);
    return create_stream(stream, flags, priority);
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    Stream* s = find_stream("cudaStreamQuery", stream);
    progress();
    if (!s->queue.empty()) return cudaErrorNotReady;
    host_waited(s);
    return cudaSuccess;
}

struct cudaEvent_st {
    std::shared_ptr<Recorded> last; /* the latest cudaEventRecord, null before the first */
    bool timing;
};

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
    if (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming))
        fatal("cudaEventCreateWithFlags: flags 0x%x are not emulated", flags);
    *event = new cudaEvent_st{nullptr, !(flags & cudaEventDisableTiming)};
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    if (!event) fatal("cudaEventQuery: NULL event");
    if (!event->last) return cudaSuccess; /* never recorded */
    progress();
    if (!event->last->done) return cudaErrorNotReady;
    join(g_host_clock, event->last->clock);
    return cudaSuccess;
}

cudaError_t emu_stream_wait_event(cudaStream_t stream, cudaEvent_t event, unsigned int flags, const char* file, int line) {
    Stream* s = find_stream("cudaStreamWaitEvent", stream);
    if (sync_deleted(file, line)) return cudaSuccess; /* EMU_DELETE_SYNC: as if the line were deleted */
    if (!event) fatal("cudaStreamWaitEvent: NULL event");
    if (flags) fatal("cudaStreamWaitEvent: flags 0x%x are not emulated", flags);
    if (!event->last) return cudaSuccess; /* an event never recorded: the wait is a no-op */
    legacy_sync(s);
    Op w;
    w.what = "cudaStreamWaitEvent";
    w.wait_for = event->last; /* the record issued last, not any later one */
    push(s, std::move(w));
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
    if (!event) fatal("cudaEventDestroy: NULL event");
    delete event; /* waits already issued keep their record */
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    Stream* s = find_stream("cudaEventRecord", stream);
    if (!event) fatal("cudaEventRecord: NULL event");
    event->last = std::make_shared<Recorded>();
    legacy_sync(s);
    Op r;
    r.what = "cudaEventRecord";
    r.record = event->last;
    push(s, std::move(r));
    if (settings().sync) flush();
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    if (!event) fatal("cudaEventSynchronize: NULL event");
    if (!event->last) return cudaSuccess;
    std::shared_ptr<Recorded> rec = event->last;
    run_until([rec]() { return rec->done; });
    join(g_host_clock, rec->clock);
    return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    if (!start->timing || !end->timing) return set_error(cudaErrorInvalidResourceHandle); /* created with cudaEventDisableTiming */
    if (!start->last || !end->last) return set_error(cudaErrorInvalidResourceHandle);
    if (!start->last->done || !end->last->done) return set_error(cudaErrorNotReady);
    *ms = (float)(end->last->ms - start->last->ms);
    return cudaSuccess;
}

cudaError_t emu_func_set_attribute(const void* func, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) fatal("cudaFuncSetAttribute(attribute %d, value %d): not emulated", (int)attr, value);
    if (value < 0 || value > EMU_DYN_SMEM_MAX) return set_error(cudaErrorInvalidValue);
    dyn_smem_limits()[func] = (size_t)value;
    return cudaSuccess;
}
