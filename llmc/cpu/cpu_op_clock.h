/*
 * The clock the CPU reference's calibration (llmc/cpu/cpu_calibrate.h)
 * reads on the op families the time model prices at a rate of its own:
 * forward and backward matmuls (cpu_matmul.h's three), attention forward
 * and backward (train_gpt.c's layer_attention_*, where the whole sequence
 * and the ring part ways) and GELU (train_gpt.c's gelu_*). Each reads it on
 * entry and exit, and while a profiled step runs (cpu_op_clock.active) adds
 * its time to its family's: a clock read on each side, well under a
 * microsecond against calls of milliseconds; otherwise one branch. The
 * model's own lines know nothing of it.
 */
#ifndef REMAT_CPU_OP_CLOCK_H
#define REMAT_CPU_OP_CLOCK_H

#include <time.h>
#include "../core/utils.h"

typedef enum { OP_MATMUL_FORWARD, OP_MATMUL_BACKWARD, OP_ATTENTION_FORWARD, OP_ATTENTION_BACKWARD, OP_GELU, NUM_CPU_OPS } CpuOp;

typedef struct {
    int active;                /* a profiled step is running */
    int cpu_clock;             /* REMAT_PROFILE_CLOCK=cpu: the process's CPU time, not the wall clock */
    double op_ms[NUM_CPU_OPS]; /* the profiled step's calls of each family */
    int op_calls[NUM_CPU_OPS]; /* and how many (printed, so that a call left untimed shows) */
} CpuOpClock;

static CpuOpClock cpu_op_clock; /* the process's one profiled step */

/* The clock in ms: wall-clock, or with cpu_clock the process's CPU time. */
static inline double cpu_op_clock_ms(void) {
    if (!cpu_op_clock.cpu_clock) return now_ms();
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* On entry to an op: the time to hand cpu_op_end (0 outside the profiled step). */
static inline double cpu_op_begin(void) { return cpu_op_clock.active ? cpu_op_clock_ms() : 0.0; }

/* On exit: the call, begun at t0, into family `op`. */
static inline void cpu_op_end(CpuOp op, double t0) {
    if (!cpu_op_clock.active) return;
    cpu_op_clock.op_ms[op] += cpu_op_clock_ms() - t0;
    cpu_op_clock.op_calls[op]++;
}

#endif
