/*
 * The CPU reference's three matmuls alone at the shapes of one d12 step at
 * B=4, T=64 (N=256 rows: qkv, attention projection, fc, fc projection per
 * layer, and the classifier), as thread CPU time, the minimum of REPS calls:
 * descheduling on a shared machine does not count, so run it with
 * OMP_NUM_THREADS=1 for figures that compare across builds.
 *
 *     make build/bench_cpu_matmul && OMP_NUM_THREADS=1 build/bench_cpu_matmul [REPS]
 *
 * Build it against another train_gpt.c (e.g. the previous commit's) with
 * -DTRAINER_SOURCE='"/path/to/train_gpt.c"' to compare kernels side by side.
 */
#define REMAT_NO_MAIN
#ifndef TRAINER_SOURCE
#define TRAINER_SOURCE "../../train_gpt.c"
#endif
#include TRAINER_SOURCE
#include <time.h>

static double thread_cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static real* normal_array(size_t n, uint64_t seed, float scale) {
    real* x = (real*)malloc_check(n * sizeof(real), "bench");
    for (size_t i = 0; i < n; i++) x[i] = rand_normal(seed, 0, i) * scale;
    return x;
}

int main(int argc, char** argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 3;
    if (reps < 1) fail("REPS must be a positive integer, not '%s'", argv[1]);
    const int N = 256, C = 768, L = 12, Vp = 50304;
    const struct { const char* name; int IC, OC, per_step; } shapes[] = {
        {"qkv", C, 3 * C, L}, {"attproj", C, C, L}, {"fc", C, 4 * C, L}, {"fcproj", 4 * C, C, L}, {"classifier", C, Vp, 1},
    };
    double step_ms[3] = {0, 0, 0};
    printf("| matmul | IC | OC | forward ms | backward input ms | backward weight ms | per step |\n");
    printf("| --- | --- | --- | --- | --- | --- | --- |\n");
    for (int s = 0; s < (int)(sizeof(shapes) / sizeof(shapes[0])); s++) {
        int IC = shapes[s].IC, OC = shapes[s].OC;
        real* inp = normal_array((size_t)N * IC, 1, 1.0f);
        real* W = normal_array((size_t)OC * IC, 2, 0.02f);
        real* dout = normal_array((size_t)N * OC, 3, 1.0f);
        real* out = normal_array((size_t)N * OC, 4, 1.0f);
        real* dinp = normal_array((size_t)N * IC, 5, 1.0f);
        real* dW = normal_array((size_t)OC * IC, 6, 0.0f);
        real* dbias = normal_array(OC, 7, 0.0f);
        double best[3] = {1e30, 1e30, 1e30};
        for (int r = 0; r < reps; r++) {
            double t0 = thread_cpu_ms();
            matmul_forward(out, inp, W, NULL, N, IC, OC);
            double t1 = thread_cpu_ms();
            matmul_backward_input(dinp, dout, W, N, IC, OC);
            double t2 = thread_cpu_ms();
            matmul_backward_weight(dW, dbias, dout, inp, N, IC, OC);
            double t3 = thread_cpu_ms();
            double ms[3] = {t1 - t0, t2 - t1, t3 - t2};
            for (int k = 0; k < 3; k++) best[k] = ms[k] < best[k] ? ms[k] : best[k];
        }
        printf("| %s | %d | %d | %.1f | %.1f | %.1f | x%d |\n", shapes[s].name, IC, OC, best[0], best[1], best[2], shapes[s].per_step);
        for (int k = 0; k < 3; k++) step_ms[k] += best[k] * shapes[s].per_step;
        free(inp); free(W); free(dout); free(out); free(dinp); free(dW); free(dbias);
    }
    printf("| one step | | | %.0f | %.0f | %.0f | total %.0f ms |\n", step_ms[0], step_ms[1], step_ms[2],
           step_ms[0] + step_ms[1] + step_ms[2]);
    return 0;
}
