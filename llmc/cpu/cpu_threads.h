/*
 * OpenMP defaults that hold up when other jobs share the cores.
 *
 * At the end of every parallel region libgomp's threads spin (by default
 * some 300,000 polls, a good fraction of a millisecond) before they sleep.
 * Alone that saves a wake-up; when another busy process holds a core, the
 * region waits for a thread that is not running, and a step of a small
 * model takes several times as long (dev/bench/RESULTS.md, "OpenMP on
 * shared cores"). So, unless the environment says otherwise:
 *
 *  - the wait policy is passive (OMP_WAIT_POLICY=passive: threads sleep at
 *    once), unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set. libgomp reads
 *    its environment once, when it is loaded, before main: the trainer sets
 *    the variable and executes itself again (/proc/self/exe, the same
 *    arguments; a few milliseconds), the only way to reach a runtime that
 *    has already started.
 *  - the threads are the CPUs this process may run on (sched_getaffinity),
 *    at most the cgroup's CPU quota rounded up (cpu.max in v2, cfs_quota_us
 *    over cfs_period_us in v1; a container limited to 2 CPUs of 16 runs 2
 *    threads, not 16), unless OMP_NUM_THREADS is set.
 *
 * Under an MPI launcher neither is changed: the launcher binds each rank
 * (one core each on a small node, so one thread), and a rank must not
 * execute itself again under it. The thread count never changes the bits
 * (every sum's order is fixed by the code, train_gpt.c).
 */
#ifndef REMAT_CPU_THREADS_H
#define REMAT_CPU_THREADS_H

#include <stdio.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "../core/multiproc.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Set in the environment of the second execution, so that it knows the
 * wait policy is the trainer's default, not the user's, and does not
 * execute itself a third time. */
#define CPU_THREADS_REEXEC_MARK "REMAT_OMP_DEFAULTS"

/* CPUs from a cgroup v2 cpu.max line "QUOTA PERIOD" (or "max PERIOD": no
 * limit, 0), rounded up: a quota of 1.5 CPUs keeps 2 threads busy. */
static inline int cpu_quota_from_cpu_max(const char* line) {
    long long quota = 0, period = 0;
    if (strncmp(line, "max", 3) == 0 || sscanf(line, "%lld %lld", &quota, &period) != 2 || quota <= 0 || period <= 0) return 0;
    return (int)((quota + period - 1) / period);
}

/* The same from v1's cfs_quota_us and cfs_period_us (quota -1: no limit). */
static inline int cpu_quota_from_v1(long long quota, long long period) {
    return quota > 0 && period > 0 ? (int)((quota + period - 1) / period) : 0;
}

static inline int read_first_line(const char* path, char* buf, size_t n) {
    FILE* f = fopen(path, "r");
    if (!f) return 0;
    int ok = fgets(buf, (int)n, f) != NULL;
    fclose(f);
    return ok;
}

/* The least CPU quota of this process's cgroup and its ancestors, in
 * whole CPUs (0: none). /sys/fs/cgroup, or REMAT_TEST_CGROUP_ROOT (tests:
 * a fake tree read as the process's own cgroup, as budget.h reads it). */
static inline int cgroup_cpu_quota(void) {
    const char* fake = getenv("REMAT_TEST_CGROUP_ROOT");
    const char* root = fake && fake[0] ? fake : "/sys/fs/cgroup";
    char rel[4096] = "/", line[4200], dir[8400], path[8600];
    int v1 = 0;
    FILE* f = fake && fake[0] ? NULL : fopen("/proc/self/cgroup", "r");
    while (f && fgets(line, sizeof(line), f)) { /* "0::/path" (v2) or "N:cpu,cpuacct:/path" (v1) */
        line[strcspn(line, "\n")] = '\0';
        char* c1 = strchr(line, ':');
        char* c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        int is_v2 = strncmp(line, "0::", 3) == 0, is_v1 = strncmp(c1 + 1, "cpu,", 4) == 0 || strncmp(c1 + 1, "cpu:", 4) == 0 ||
                                                          strstr(c1 + 1, ",cpu,") != NULL || strstr(c1 + 1, ",cpu:") != NULL;
        if (is_v2 || is_v1) { snprintf(rel, sizeof(rel), "%s", c2 + 1); v1 = is_v1; }
        if (is_v1) break; /* a v1 cpu controller wins over the v2 unified line */
    }
    if (f) fclose(f);
    snprintf(dir, sizeof(dir), "%s/cpu", root);
    if (!v1 && fake && fake[0] && access(dir, F_OK) == 0) v1 = 1; /* a fake v1 tree */
    int least = 0;
    for (;;) { /* from the process's cgroup up to the root */
        snprintf(dir, sizeof(dir), "%s%s%s", root, v1 ? "/cpu" : "", strcmp(rel, "/") == 0 ? "" : rel);
        int q = 0;
        if (!v1) {
            snprintf(path, sizeof(path), "%s/cpu.max", dir);
            if (read_first_line(path, line, sizeof(line))) q = cpu_quota_from_cpu_max(line);
        } else {
            long long quota = 0, period = 0;
            snprintf(path, sizeof(path), "%s/cpu.cfs_quota_us", dir);
            if (read_first_line(path, line, sizeof(line))) quota = atoll(line);
            snprintf(path, sizeof(path), "%s/cpu.cfs_period_us", dir);
            if (read_first_line(path, line, sizeof(line))) period = atoll(line);
            q = cpu_quota_from_v1(quota, period);
        }
        if (q > 0 && (least == 0 || q < least)) least = q;
        char* slash = strrchr(rel, '/');
        if (!slash || slash == rel) { if (strcmp(rel, "/") == 0) break; strcpy(rel, "/"); continue; }
        *slash = '\0';
    }
    return least;
}

/* CPUs this process may run on (its affinity mask, by the system call:
 * glibc's wrapper wants _GNU_SOURCE); 0 when unknown. */
static inline int cpu_affinity_count(void) {
    unsigned long mask[1024 / (8 * sizeof(unsigned long))];
    memset(mask, 0, sizeof(mask));
    long bytes = syscall(SYS_sched_getaffinity, 0, sizeof(mask), mask);
    int count = 0;
    for (long i = 0; bytes > 0 && i < bytes / (long)sizeof(unsigned long); i++) count += __builtin_popcountl(mask[i]);
    return count;
}

/* First thing in main, before any OpenMP region: the passive wait policy
 * (by executing the trainer again with it in the environment) unless the
 * user set one, or an MPI launcher started the process. Returns only when
 * nothing is to be done, or when the second execution failed (then the
 * runtime's own default stands). */
static inline void cpu_threads_wait_policy(char** argv) {
#ifndef _OPENMP
    (void)argv; /* no OpenMP runtime to tell */
    return;
#endif
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT") || getenv(CPU_THREADS_REEXEC_MARK) || proc_launched()) return;
    if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0 || setenv(CPU_THREADS_REEXEC_MARK, "1", 1) != 0) return;
    fflush(NULL);
    execv("/proc/self/exe", argv);
    unsetenv("OMP_WAIT_POLICY"); /* not executed: say nothing false about the policy */
    unsetenv(CPU_THREADS_REEXEC_MARK);
}

/* The thread count (unless OMP_NUM_THREADS or an MPI launcher sets it) and
 * a line saying where threads and wait policy came from. */
static inline void cpu_threads_setup(char* why, size_t n) {
#ifdef _OPENMP
    const char* policy = getenv("OMP_WAIT_POLICY");
    const char* spin = getenv("GOMP_SPINCOUNT");
    int ours = getenv(CPU_THREADS_REEXEC_MARK) && policy && strcmp(policy, "passive") == 0 && !spin; /* set by cpu_threads_wait_policy */
    char wait[160];
    if (ours) snprintf(wait, sizeof(wait), "wait policy passive, the trainer's default (OMP_WAIT_POLICY=active to spin)");
    else if (policy) snprintf(wait, sizeof(wait), "wait policy %.40s (OMP_WAIT_POLICY)", policy);
    else if (spin) snprintf(wait, sizeof(wait), "spin count %.40s (GOMP_SPINCOUNT)", spin);
    else snprintf(wait, sizeof(wait), "the OpenMP runtime's wait policy%s", proc_launched() ? " (started by an MPI launcher)" : "");
    if (getenv("OMP_NUM_THREADS") || proc_launched()) {
        snprintf(why, n, "%s; %s", getenv("OMP_NUM_THREADS") ? "OMP_NUM_THREADS" : "as the MPI launcher placed the rank", wait);
        return;
    }
    int cpus = cpu_affinity_count(), quota = cgroup_cpu_quota(), threads = cpus > 0 ? cpus : omp_get_max_threads();
    const char* from = "the CPUs this process may run on";
    if (quota > 0 && quota < threads) { threads = quota; from = "the cgroup's CPU quota"; }
    omp_set_num_threads(threads);
    snprintf(why, n, "%s, OMP_NUM_THREADS=N sets them; %s", from, wait);
#else
    snprintf(why, n, "built without OpenMP");
#endif
}

#endif
