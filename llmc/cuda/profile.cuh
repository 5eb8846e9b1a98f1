/*
 * Step profile: where the GPU time of one optimizer step goes, from CUDA
 * events recorded on the compute stream. train_gpt profiles step N when
 * REMAT_PROFILE=N is set (0 or unset: never) and prints one line before that
 * step's line:
 *
 *   profile of step 3: 45.10 ms on the stream | forward 12.30 (attention 4.10)
 *     | classifier 3.20 | backward 25.10, of which recompute 3.00 (attention
 *     1.00) and attention 9.00 | grad sync 0.00 | update 1.20 | gaps 3.30
 *
 * Spans are [begin, end) intervals of the stream; a kind's time is the sum of
 * its spans over all micro-steps. Forward, classifier, backward, grad sync
 * and update follow one another; recompute spans lie inside backward,
 * attention spans inside forward, recompute and backward, and each is shown
 * as part of its phase. "grad sync" is the stream's wait for the gradient
 * reduction across GPUs that the backward did not hide (0 on one GPU without
 * NCCL). "gaps" is the step's start to its last event less the phases: token
 * uploads and host work between micro-steps. Idle time inside a phase (the
 * host launching slower than the GPU runs) counts to that phase.
 *
 * Recording an event costs a few microseconds, so the profiled step runs
 * slightly slower than the others: benchmarks time other steps. The spans of
 * each micro-step are read back when it ends (the trainer waits for the
 * stream there anyway), so any number of micro-steps fits.
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_PROFILE_CUH
#define REMAT_PROFILE_CUH

#include "cuda_common.cuh"

typedef enum {
    PROF_FORWARD, PROF_CLASSIFIER, PROF_BACKWARD, PROF_SYNC, PROF_UPDATE, /* phases, in the order they run */
    PROF_RECOMPUTE,                                                      /* inside backward */
    PROF_ATT_FORWARD, PROF_ATT_RECOMPUTE, PROF_ATT_BACKWARD,             /* inside forward, recompute, backward */
    NUM_PROF_KINDS
} ProfKind;

/* spans between two read-backs: one micro-step has 4 per layer and 3 more */
#define PROF_MAX_SPANS 4096

typedef struct {
    int step;        /* the optimizer step to profile; 0: none */
    int active;      /* recording now */
    int spans, dropped;
    int open[NUM_PROF_KINDS]; /* the open span of each kind, or -1 */
    int kind[PROF_MAX_SPANS];
    cudaEvent_t* events;      /* 2 per span: begin, end */
    cudaEvent_t start;        /* the step's start on the stream */
    float total_ms[NUM_PROF_KINDS];
    float last_ms;            /* the latest span end, from start */
} Profiler;

/* REMAT_PROFILE=N: profile step N; unset, empty or 0: never. */
static inline void prof_init(Profiler* p) {
    memset(p, 0, sizeof(*p));
    const char* env = getenv("REMAT_PROFILE");
    if (!env || !env[0]) return;
    char* end = NULL;
    long step = strtol(env, &end, 10);
    if (*end != '\0' || step < 0 || step > INT_MAX) fail("REMAT_PROFILE: '%s' is not a step number (0: off)", env);
    if (step == 0) return;
    p->step = (int)step;
    p->events = (cudaEvent_t*)malloc_check(2 * PROF_MAX_SPANS * sizeof(cudaEvent_t), "profile events");
    for (int i = 0; i < 2 * PROF_MAX_SPANS; i++) CUDA_CHECK(cudaEventCreate(&p->events[i]));
    CUDA_CHECK(cudaEventCreate(&p->start));
}

static inline void prof_free(Profiler* p) {
    if (p->events) {
        for (int i = 0; i < 2 * PROF_MAX_SPANS; i++) CUDA_CHECK(cudaEventDestroy(p->events[i]));
        CUDA_CHECK(cudaEventDestroy(p->start));
    }
    free(p->events);
    memset(p, 0, sizeof(*p));
}

static inline void prof_step_begin(Profiler* p, int step, cudaStream_t s) {
    if (step != p->step) return;
    p->active = 1;
    p->spans = p->dropped = 0;
    p->last_ms = 0.0f;
    for (int k = 0; k < NUM_PROF_KINDS; k++) {
        p->open[k] = -1;
        p->total_ms[k] = 0.0f;
    }
    CUDA_CHECK(cudaEventRecord(p->start, s));
}

static inline void prof_begin(Profiler* p, ProfKind k, cudaStream_t s) {
    if (!p->active) return;
    if (p->spans == PROF_MAX_SPANS) { p->dropped++; return; }
    int i = p->spans++;
    p->kind[i] = k;
    p->open[k] = i;
    CUDA_CHECK(cudaEventRecord(p->events[2 * i], s));
}

static inline void prof_end(Profiler* p, ProfKind k, cudaStream_t s) {
    if (!p->active || p->open[k] < 0) return;
    CUDA_CHECK(cudaEventRecord(p->events[2 * p->open[k] + 1], s));
    p->open[k] = -1;
}

/* Adds the recorded spans to the totals and frees their events for reuse.
 * Every span must be closed. Called where the trainer has waited for the
 * stream (watching NCCL for errors meanwhile), so the event waits here return
 * at once; they only wait on the compute stream, never on the device. */
static inline void prof_read_back(Profiler* p) {
    if (!p->active || p->spans == 0) return;
    for (int k = 0; k < NUM_PROF_KINDS; k++)
        if (p->open[k] >= 0) fail("internal: profile span of kind %d begun but not ended", k);
    for (int i = 0; i < p->spans; i++) {
        float ms = 0.0f, since_start = 0.0f;
        CUDA_CHECK(cudaEventSynchronize(p->events[2 * i + 1]));
        CUDA_CHECK(cudaEventElapsedTime(&ms, p->events[2 * i], p->events[2 * i + 1]));
        CUDA_CHECK(cudaEventElapsedTime(&since_start, p->start, p->events[2 * i + 1]));
        p->total_ms[p->kind[i]] += ms;
        if (since_start > p->last_ms) p->last_ms = since_start;
    }
    p->spans = 0;
}

static inline void prof_step_end(Profiler* p, int step, int print) {
    if (!p->active) return;
    prof_read_back(p);
    p->active = 0;
    if (!print) return;
    const float* t = p->total_ms;
    float phases = t[PROF_FORWARD] + t[PROF_CLASSIFIER] + t[PROF_BACKWARD] + t[PROF_SYNC] + t[PROF_UPDATE];
    printf("profile of step %d: %.2f ms on the stream | forward %.2f (attention %.2f) | classifier %.2f"
           " | backward %.2f, of which recompute %.2f (attention %.2f) and attention %.2f | grad sync %.2f"
           " | update %.2f | gaps %.2f",
           step, (double)p->last_ms, (double)t[PROF_FORWARD], (double)t[PROF_ATT_FORWARD], (double)t[PROF_CLASSIFIER],
           (double)t[PROF_BACKWARD], (double)t[PROF_RECOMPUTE], (double)t[PROF_ATT_RECOMPUTE], (double)t[PROF_ATT_BACKWARD],
           (double)t[PROF_SYNC], (double)t[PROF_UPDATE], (double)(p->last_ms - phases));
    if (p->dropped) printf(" (%d spans beyond %d per micro-step not timed)", p->dropped, PROF_MAX_SPANS);
    printf("\n");
}

#endif
