/*
 * The CPU reference's calibration of the time model (llmc/plan/cost_model.h):
 * REMAT_PROFILE=N with REMAT_PROFILE_COST_MODEL=FILE times step N whole and,
 * call by call, each op family the model prices at a rate of its own
 * (cpu_op_clock.h: forward and backward matmuls, attention forward and
 * backward, GELU) and every offload copy (llmc/cpu/cpu_offload.h); after the step the
 * ring's messages (cpu_ring_time) and the matmul's row efficiency. Every rate
 * is written into FILE: the compute rates from the step
 * (cost_model_calibrate_ops), the links measured (cost_model_add_links),
 * matmul_half_rows; only the tiles' pass cost o stays the planned one. The
 * GPU's twin is llmc/cuda/profile.cuh.
 *
 * REMAT_PROFILE_CLOCK=cpu (one thread only) times the step and the op
 * families in the process's CPU time instead of wall-clock time: on a
 * machine shared with other work, the time this process was descheduled
 * then counts nowhere, so the rates are those of the machine to itself
 * (dev/bench/predict_vs_measure.py --clock cpu compares them with per-step
 * CPU time). The copies are timed on the wall clock either way.
 */
#ifndef REMAT_CPU_CALIBRATE_H
#define REMAT_CPU_CALIBRATE_H

#include "../plan/cost_model.h"
#include "cpu_op_clock.h"
#include "cpu_matmul.h"
#ifdef _OPENMP
#include <omp.h>
#endif

static int cpu_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* The profiled step: which, where its rates go, and what it timed besides
 * the op families (cpu_op_clock): the copies and, after it, the ring. */
typedef struct {
    int step, active;
    const char* path;
    LinkTimes host, ring;
    double step_start_ms;
} CpuStepProfile;

/* REMAT_PROFILE_COST_MODEL's step and file (cost_model_profile_request) and
 * REMAT_PROFILE_CLOCK: unset or wall, or cpu with one thread. */
static void cpu_profile_init(CpuStepProfile* p) {
    memset(p, 0, sizeof(*p));
    memset(&cpu_op_clock, 0, sizeof(cpu_op_clock));
    p->path = cost_model_profile_request(&p->step);
    const char* clock = getenv("REMAT_PROFILE_CLOCK");
    if (!clock || !clock[0] || strcmp(clock, "wall") == 0) return;
    if (strcmp(clock, "cpu") != 0) fail("REMAT_PROFILE_CLOCK: '%s' is neither wall nor cpu", clock);
    if (cpu_threads() != 1) fail("REMAT_PROFILE_CLOCK=cpu times one thread's CPU time: run with OMP_NUM_THREADS=1, not %d threads", cpu_threads());
    cpu_op_clock.cpu_clock = 1;
}

static void cpu_profile_step_begin(CpuStepProfile* p, int step) {
    p->active = cpu_op_clock.active = p->path && step == p->step;
    if (!p->active) return;
    for (int k = 0; k < NUM_CPU_OPS; k++) { cpu_op_clock.op_ms[k] = 0.0; cpu_op_clock.op_calls[k] = 0; }
    p->step_start_ms = cpu_op_clock_ms();
}

/* The profiled step's time in ms, the op clock stopped. */
static double cpu_profile_step_end(CpuStepProfile* p) {
    double ms = cpu_op_clock_ms() - p->step_start_ms;
    p->active = cpu_op_clock.active = 0;
    return ms;
}

/* matmul_half_rows timed: the (rows, C) x (OC, C)^T matmul of out = inp W^T
 * + b (layer 0's MLP, from its ln2 rows into its fch) at rows, a half, a
 * quarter and an eighth, three times each after one untimed call. The time
 * is a line in M, (M + h) 2 C OC / rate (cost_model.h), so with FLOPs as the
 * bytes link_fit's intercept over its slope is h in rows; when the times do
 * not tell (link_fit returns 1), h stays `planned`. */
static double cpu_time_matmul_half_rows(real* out, const real* inp, const real* W, const real* b, int rows, int C, int OC, double planned) {
    double per_row = 2.0 * C * OC, rate = 0.0, intercept = 0.0;
    LinkTimes t = {0, 0, 0, 0, 0};
    for (int i = -1; i < 12; i++) { /* i = -1: untimed, to warm the caches */
        int M = rows >> (i < 0 ? 0 : i % 4) > 0 ? rows >> (i < 0 ? 0 : i % 4) : 1;
        double t0 = now_ms();
        matmul_forward(out, inp, W, b, M, C, OC);
        if (i >= 0) link_times_add(&t, M * per_row, 1e-3 * (now_ms() - t0));
    }
    return link_fit(&t, 0.0, &rate, &intercept) == 0 ? intercept * rate / per_row : planned;
}

/* Rank 0, after the profiled step that took `step_ms` (its end read before
 * the links and h were timed): every rate measured, into the profile's file;
 * the tiles' pass cost o stays the planned one. */
static void cpu_calibration_write(const CpuStepProfile* p, const PlanSpec* s, int step, double step_ms, double half_rows) {
    CostModel cm = spec_cost_model(s);
    cm.ring_bytes_per_s = cm.ring_latency_s = 0.0; /* only what this run measures */
    int measured = cost_model_add_links(s, &p->host, &p->ring, &cm);
    cm.matmul_half_rows = half_rows;
    const double* ms = cpu_op_clock.op_ms;
    OpTimes t = {1e-3 * step_ms, 1e-3 * ms[OP_MATMUL_FORWARD], 1e-3 * ms[OP_MATMUL_BACKWARD], 1e-3 * ms[OP_ATTENTION_FORWARD],
                 1e-3 * ms[OP_ATTENTION_BACKWARD], 1e-3 * ms[OP_GELU], p->host.seconds};
    char why[200];
    if (cost_model_calibrate_ops(s, &t, &cm, why, sizeof(why)) != 0)
        fail("REMAT_PROFILE_COST_MODEL: step %d does not calibrate the time model: %s", step, why);
    snprintf(cm.name, sizeof(cm.name), "train_gpt_cpu, %d thread%s%s, calibrated at B=%d T=%d", cpu_threads(), cpu_threads() == 1 ? "" : "s",
             cpu_op_clock.cpu_clock ? " (CPU time)" : "", s->B, s->T);
    char how[200];
    snprintf(how, sizeof(how), "every rate timed in step %d (REMAT_PROFILE) of train_gpt_cpu but tile_pass_s (planned), see llmc/cpu/cpu_calibrate.h", step);
    cost_model_write(&cm, p->path, how);
    printf("cost model: step %d (%.1f ms) calibrated, written to %s: matmul %.3g FLOP/s forward and %.3g backward, attention %.3g and %.3g, "
           "GELU %.3g B/s, memory %.3g B/s; %d link%s measured: host link %.3g B/s (%.0f copies), ring %.3g B/s and %.3g s a message "
           "(%.0f waits); matmuls at half rate at %.3g rows\n", step, step_ms, p->path, cm.matmul_flops_per_s, cm.matmul_backward_flops_per_s,
           cm.attention_flops_per_s, cm.attention_backward_flops_per_s, cm.gelu_bytes_per_s, cm.memory_bytes_per_s, measured,
           measured == 1 ? "" : "s", cm.host_link_bytes_per_s, p->host.count, cm.ring_bytes_per_s, cm.ring_latency_s, p->ring.count,
           cm.matmul_half_rows);
    const int* n = cpu_op_clock.op_calls;
    printf("cost model: step %d timed %d forward and %d backward matmuls, %d forward and %d backward attention calls, %d GELU calls\n", step,
           n[OP_MATMUL_FORWARD], n[OP_MATMUL_BACKWARD], n[OP_ATTENTION_FORWARD], n[OP_ATTENTION_BACKWARD], n[OP_GELU]);
}

#endif
