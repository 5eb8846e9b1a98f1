/*
 * Memory budgets: how much a run may plan to use. --mem-budget as given, or
 * free device memory (GPU) or this process's share of the node's host memory
 * (cgroup limits, address-space limits, the node's ranks, a headroom for the
 * OS and the program), the least over all ranks so that every rank makes
 * the same automatic choices; the host budget for offloaded checkpoints.
 * It only reads the system; it allocates nothing.
 */
#ifndef REMAT_BUDGET_H
#define REMAT_BUDGET_H

#include <sys/resource.h>
#include "../core/cli.h"
#include "../core/multiproc.h"
#include "plan.h"

/* Free device memory, set by the GPU trainer when a device is present; the
 * default budget for --plan and -r auto. NULL: use available host memory. */
static size_t (*remat_free_memory_hook)(void) = NULL;

/* --context-parallel N as the flags give it, for the GPU trainer's budget
 * hook: it splits and connects the ring communicator before it measures free
 * memory, so that NCCL's memory is outside the budget (run_setup.h sets it). */
static int remat_ring_degree_hint = 1;

/* Device memory NCCL holds once connected (communicators, connection buffers),
 * set by the GPU trainer's budget hook: the plan prints it as its own line. */
static size_t remat_nccl_device_bytes = 0;

/* The GPU's name for the default cost model, set by the GPU trainer ("" when
 * it finds none); NULL on the CPU trainer. */
static const char* (*remat_device_name_hook)(void) = NULL;

/* The attention kernel family (cost_model.h's ATTENTION_FAMILY_*) the GPU
 * build runs at head size hs, for the default cost model's attention rate;
 * NULL on the CPU trainer. */
static int (*remat_attention_family_hook)(int hs) = NULL;

/* Kept out of a default device budget: what the plan does not hold (cuBLASLt
 * handle, kernels loaded lazily during the first step). */
#define PLAN_DEVICE_HEADROOM_BYTES ((size_t)256 << 20)

/* A number from a one-line file (cgroup memory.max and the like); `max` and
 * v1's "no limit" (about 2^63) read as SIZE_MAX. Returns 0 when unreadable. */
static inline int read_size_file(const char* path, size_t* out) {
    FILE* f = fopen(path, "r");
    if (!f) return 0;
    char buf[64] = "";
    int ok = fgets(buf, sizeof(buf), f) != NULL;
    fclose(f);
    if (!ok) return 0;
    if (strncmp(buf, "max", 3) == 0) { *out = SIZE_MAX; return 1; }
    char* end = NULL;
    unsigned long long v = strtoull(buf, &end, 10);
    if (end == buf) return 0;
    *out = v >= (1ULL << 62) ? SIZE_MAX : (size_t)v;
    return 1;
}

/* Value of `key` in a "key value" per line file (memory.stat, /proc/meminfo: kB). */
static inline int read_keyed_value(const char* path, const char* key, size_t* out) {
    FILE* f = fopen(path, "r");
    if (!f) return 0;
    char line[256];
    size_t klen = strlen(key);
    int found = 0;
    while (!found && fgets(line, sizeof(line), f))
        if (strncmp(line, key, klen) == 0 && (line[klen] == ' ' || line[klen] == ':')) {
            const char* v = line + klen + 1;
            *out = (size_t)strtoull(v + strspn(v, " \t"), NULL, 10);
            found = 1;
        }
    fclose(f);
    return found;
}

/* Room left under the memory limit of cgroup directory `dir` (v2 files, or
 * v1's with `v1`): limit less usage, page cache that can be dropped
 * (inactive file pages) not counted as used. SIZE_MAX without a limit. */
static inline size_t cgroup_dir_room(const char* dir, int v1) {
    char path[8500];
    size_t limit = SIZE_MAX, usage = 0, inactive = 0;
    snprintf(path, sizeof(path), "%s/%s", dir, v1 ? "memory.limit_in_bytes" : "memory.max");
    if (!read_size_file(path, &limit) || limit == SIZE_MAX) return SIZE_MAX;
    snprintf(path, sizeof(path), "%s/%s", dir, v1 ? "memory.usage_in_bytes" : "memory.current");
    if (!read_size_file(path, &usage)) usage = 0;
    snprintf(path, sizeof(path), "%s/memory.stat", dir);
    if (!read_keyed_value(path, v1 ? "total_inactive_file" : "inactive_file", &inactive) || inactive > usage) inactive = 0;
    usage -= inactive;
    return limit > usage ? limit - usage : 0;
}

/* The least room under the memory limits of this process's cgroup and its
 * ancestors, v2 or v1 (SIZE_MAX: no limit). The cgroup file system is at
 * /sys/fs/cgroup; REMAT_TEST_CGROUP_ROOT points at a fake one (tests only),
 * read as the process's own cgroup. */
static inline size_t cgroup_memory_room(void) {
    const char* fake = getenv("REMAT_TEST_CGROUP_ROOT");
    const char* root = fake && fake[0] ? fake : "/sys/fs/cgroup";
    char rel[4096] = "/", line[4200], dir[8400];
    int v1 = 0;
    FILE* f = fake && fake[0] ? NULL : fopen("/proc/self/cgroup", "r");
    while (f && fgets(line, sizeof(line), f)) { /* "0::/path" (v2) or "N:memory:/path" (v1) */
        line[strcspn(line, "\n")] = '\0';
        char* c1 = strchr(line, ':');
        char* c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        int is_v2 = strncmp(line, "0::", 3) == 0, is_v1 = strncmp(c1 + 1, "memory:", 7) == 0 || strstr(c1 + 1, ",memory:") != NULL;
        if (is_v2 || is_v1) { snprintf(rel, sizeof(rel), "%s", c2 + 1); v1 = is_v1; }
        if (is_v1) break; /* a v1 memory controller wins over the v2 unified line */
    }
    if (f) fclose(f);
    snprintf(dir, sizeof(dir), "%s/memory", root);
    if (!v1 && fake && fake[0] && access(dir, F_OK) == 0) v1 = 1; /* a fake v1 tree */
    size_t room = SIZE_MAX;
    for (;;) { /* from the process's cgroup up to the root */
        snprintf(dir, sizeof(dir), "%s%s%s", root, v1 ? "/memory" : "", strcmp(rel, "/") == 0 ? "" : rel);
        size_t r = cgroup_dir_room(dir, v1);
        if (r < room) room = r;
        char* slash = strrchr(rel, '/');
        if (!slash || slash == rel) { if (strcmp(rel, "/") == 0) break; strcpy(rel, "/"); continue; }
        *slash = '\0';
    }
    return room;
}

/* Room under this process's address-space limit (ulimit -v) less what it
 * maps now; SIZE_MAX without a limit. Per process, unlike the node's memory. */
static inline size_t address_space_room(void) {
    struct rlimit lim;
    if (getrlimit(RLIMIT_AS, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
    size_t used = 0;
    long page = sysconf(_SC_PAGESIZE);
    FILE* f = fopen("/proc/self/statm", "r");
    unsigned long vm_pages = 0;
    if (f && fscanf(f, "%lu", &vm_pages) == 1 && page > 0) used = (size_t)vm_pages * (size_t)page;
    if (f) fclose(f);
    return (size_t)lim.rlim_cur > used ? (size_t)lim.rlim_cur - used : 0;
}

/* The node's available memory: MemAvailable (free memory plus what the
 * kernel can reclaim, not just free pages). */
static inline size_t node_available_memory(void) {
    size_t kib = 0;
    if (read_keyed_value("/proc/meminfo", "MemAvailable", &kib)) return kib * 1024;
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
}

/* Host memory this process can use now: MemAvailable, less when a cgroup
 * limit or an address-space limit (ulimit -v) leaves less room. Names the
 * bound in *why. */
static inline size_t available_host_memory_why(const char** why) {
    *why = "available host memory";
    size_t avail = node_available_memory();
    size_t cg = cgroup_memory_room();
    if (cg < avail) { avail = cg; *why = "cgroup memory limit less its usage"; }
    size_t room = address_space_room();
    if (room < avail) { avail = room; *why = "address-space limit (ulimit -v) less its usage"; }
    return avail;
}

/* Kept for the operating system out of a default host budget drawn from the
 * node's MemAvailable (daemons, page cache for the data files, the kernel's
 * own growth): what MemAvailable counts as reclaimable is not all free for a
 * training job to pin. A cgroup limit is the job's own, kept whole. */
#define PLAN_HOST_OS_HEADROOM_BYTES ((size_t)1 << 30)

/* Processes of this node (MPI_COMM_TYPE_SHARED or the launcher's count),
 * which share its memory: 1 without MPI. */
static inline int node_processes(void) { return remat_proc.local_world > 1 ? remat_proc.local_world : 1; }

/* This process's share of host memory: the node's bound (MemAvailable less
 * PLAN_HOST_OS_HEADROOM_BYTES, or the cgroup room the node's processes
 * share) divided among the node's processes, less when the process's own
 * address-space limit leaves less. With 8 ranks a node, each plans an
 * eighth, not the whole node. Names the bound in *why. */
static inline size_t host_memory_share_why(const char** why) {
    static char buf[240];
    const char* bound = "available host memory less 1024 MiB for the OS";
    size_t node = node_available_memory();
    node = node > PLAN_HOST_OS_HEADROOM_BYTES ? node - PLAN_HOST_OS_HEADROOM_BYTES : 0;
    size_t cg = cgroup_memory_room();
    if (cg < node) { node = cg; bound = "cgroup memory limit less its usage"; }
    int n = node_processes();
    size_t share = node / (size_t)n, room = address_space_room();
    if (room < share) {
        *why = "address-space limit (ulimit -v) less its usage";
        return room;
    }
    if (n > 1) snprintf(buf, sizeof(buf), "%s, divided among the %d processes of this node", bound, n);
    else snprintf(buf, sizeof(buf), "%s", bound);
    *why = buf;
    return share;
}

/* The least of a size over all processes (collective when several run): a
 * choice made from it fits every rank, and every rank makes the same one. */
static inline size_t proc_least_size(size_t v, const char* what) {
    double least = -proc_max(-(double)v, what);
    return least >= 18446744073709551615.0 ? SIZE_MAX : (size_t)least;
}

static inline size_t available_host_memory(void) {
    const char* why;
    return available_host_memory_why(&why);
}

/* Host memory the CPU trainer holds beyond the plan: code, libraries, the
 * tokenizer table, OpenMP's threads (measured: under 3 MiB); in a build
 * with MPI, started alone, the MPI library's resident code and data (the
 * quick start's model, plan 12.2 MiB: peak 15.2 MiB without MPI, 16.3 MiB
 * in an MPI build: 1.1 MiB more); and when a launcher started it under
 * MPI, MPI's state and shared-memory segments (measured with OpenMPI 4.1 on
 * a model whose plan is 13.2 MiB: 10.8 MiB over the plan under mpirun -np 1,
 * 11.8 MiB with -np 2). The shares are upper bounds. */
#define PLAN_PROGRAM_BYTES ((size_t)4 << 20)
#define PLAN_MPI_LIBRARY_BYTES ((size_t)2 << 20)
#define PLAN_MPI_PROGRAM_BYTES ((size_t)16 << 20)
static inline size_t plan_program_bytes(void) {
    return PLAN_PROGRAM_BYTES + (MULTIPROC_BUILT ? PLAN_MPI_LIBRARY_BYTES : 0) + (remat_proc.uses_mpi ? PLAN_MPI_PROGRAM_BYTES : 0);
}

/* --mem-budget if given (as given: no headroom kept), else free device
 * memory less PLAN_DEVICE_HEADROOM_BYTES (GPU), else this process's share of
 * host memory (host_memory_share_why) less the program's share
 * (plan_program_bytes). The defaults are the least over all ranks (a
 * collective: every rank calls it), so that every automatic choice is made
 * from the smallest budget and is the same on every rank. */
static inline size_t memory_budget(const char* flag_value, const char** source) {
    size_t b = parse_bytes("--mem-budget", flag_value);
    if (b) {
        *source = remat_device_name_hook ? "--mem-budget, as given: no headroom kept for the CUDA context or libraries"
                                         : "--mem-budget, as given: no headroom kept for the program";
        return b;
    }
    int several = remat_proc.world > 1;
    static char why[300];
    if (remat_free_memory_hook) {
        size_t free_b = proc_least_size(remat_free_memory_hook(), "the least free device memory of the ranks");
        if (several) snprintf(why, sizeof(why), "the least free device memory of the %d ranks less 256 MiB headroom", remat_proc.world);
        *source = several ? why : "free device memory less 256 MiB headroom";
        return free_b > PLAN_DEVICE_HEADROOM_BYTES ? free_b - PLAN_DEVICE_HEADROOM_BYTES : 0;
    }
    const char* bound = "";
    size_t avail = proc_least_size(host_memory_share_why(&bound), "the least host memory of the ranks"), program = plan_program_bytes();
    snprintf(why, sizeof(why), "%s%s less %.0f MiB for the program%s", several ? "the least of the ranks: " : "", bound, mib(program),
             remat_proc.uses_mpi ? " and MPI" : "");
    *source = why;
    return avail > program ? avail - program : 0;
}

/* --host-mem-budget if given, else this process's share of host memory
 * (host_memory_share_why: the node's divided among its processes, cgroup and
 * ulimit -v limits included), the least over all ranks (collective): the
 * room for the host pool of offloaded checkpoints. */
static inline size_t host_memory_budget(const char* flag_value, const char** source) {
    size_t b = parse_bytes("--host-mem-budget", flag_value);
    if (b) { *source = "--host-mem-budget"; return b; }
    const char* bound = "";
    size_t share = proc_least_size(host_memory_share_why(&bound), "the least host memory of the ranks");
    static char why[300];
    snprintf(why, sizeof(why), "%s%s", remat_proc.world > 1 ? "the least of the ranks: " : "", bound);
    *source = why;
    return share;
}

#endif
