/*
 * The CPU reference's calibration of the time model (llmc/cost_model.h):
 * REMAT_PROFILE=N with REMAT_PROFILE_COST_MODEL=FILE times every offload
 * copy during step N (llmc/cpu_offload.h), after it the ring's messages
 * (cpu_ring_time) and the matmul's row efficiency, and writes the links
 * measured (cost_model_add_links) into FILE with the rest of the cost model
 * the run planned with. The GPU's twin is llmc/profile.cuh.
 */
#ifndef REMAT_CPU_CALIBRATE_H
#define REMAT_CPU_CALIBRATE_H

#include "cost_model.h"
#include "cpu_matmul.h"

typedef struct {
    int step, active;
    const char* path;
    LinkTimes host, ring;
} CpuLinkProfile;

/* matmul_half_rows timed: the (rows, C) x (4C, C)^T matmul of out = inp W^T
 * + b (layer 0's MLP, from its ln2 rows into its fch) at rows, a half, a
 * quarter and an eighth, three times each after one untimed call. The time
 * is a line in M, (M + h) 8 C^2 / rate (cost_model.h), so with FLOPs as the
 * bytes link_fit's intercept over its slope is h in rows; when the times do
 * not tell (link_fit returns 1), h stays `planned`. */
static double cpu_time_matmul_half_rows(real* out, const real* inp, const real* W, const real* b, int rows, int C, double planned) {
    double per_row = 8.0 * C * C, rate = 0.0, intercept = 0.0;
    LinkTimes t = {0, 0, 0, 0, 0};
    for (int i = -1; i < 12; i++) { /* i = -1: untimed, to warm the caches */
        int M = rows >> (i < 0 ? 0 : i % 4) > 0 ? rows >> (i < 0 ? 0 : i % 4) : 1;
        double t0 = now_ms();
        matmul_forward(out, inp, W, b, M, C, 4 * C);
        if (i >= 0) link_times_add(&t, M * per_row, 1e-3 * (now_ms() - t0));
    }
    return link_fit(&t, 0.0, &rate, &intercept) == 0 ? intercept * rate / per_row : planned;
}

/* Rank 0, after the profiled step: the cost model the run planned with, its
 * links and matmul_half_rows replaced by what was measured, into the
 * profile's file. */
static void cpu_calibration_write(const CpuLinkProfile* p, const PlanSpec* s, int step, double half_rows) {
    CostModel cm = spec_cost_model(s);
    cm.ring_bytes_per_s = cm.ring_latency_s = 0.0; /* only what this run measures */
    int measured = cost_model_add_links(s, &p->host, &p->ring, &cm);
    cm.matmul_half_rows = half_rows;
    size_t used = strlen(cm.name);
    snprintf(cm.name + used, sizeof(cm.name) - used, ", links measured at B=%d T=%d", s->B, s->T);
    char how[200];
    snprintf(how, sizeof(how), "links and matmul_half_rows timed in step %d (REMAT_PROFILE) of train_gpt_cpu; the other rates as planned", step);
    cost_model_write(&cm, p->path, how);
    printf("cost model: %d link%s measured in step %d, written to %s: host link %.3g B/s (%.0f copies), ring %.3g B/s and %.3g s a message (%.0f waits); "
           "matmuls at half rate at %.3g rows\n", measured, measured == 1 ? "" : "s", step, p->path, cm.host_link_bytes_per_s,
           p->host.count, cm.ring_bytes_per_s, cm.ring_latency_s, p->ring.count, cm.matmul_half_rows);
}

#endif
