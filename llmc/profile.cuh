/*
 * Step profile: where the GPU time of one optimizer step goes, from CUDA
 * events recorded on the compute stream. train_gpt profiles step N when
 * REMAT_PROFILE=N is set and prints one line before that step's line:
 *
 *   profile of step 3: 45.10 ms on the stream | forward 12.30 (attention 4.10)
 *     | classifier 3.20 | backward 25.10, of which recompute 3.00 (attention
 *     1.00) and attention 9.00 | update 1.20 | gaps 3.30
 *
 * Spans are [begin, end) intervals of the stream; a kind's time is the sum of
 * its spans over all micro-steps. Forward, classifier, backward and update
 * follow one another; recompute spans lie inside backward, attention spans
 * inside forward, recompute and backward, and each is shown as part of its
 * phase. "gaps" is the first event to the last less the phases: token
 * uploads, host waits and launch gaps. Recording an event costs a few
 * microseconds, so the profiled step runs slightly slower than the others;
 * compare the phases with each other, not the total with other steps.
 *
 * Status: compiles, unverified on GPU.
 */
#ifndef REMAT_PROFILE_CUH
#define REMAT_PROFILE_CUH

#include "cuda_common.cuh"

typedef enum {
    PROF_FORWARD, PROF_CLASSIFIER, PROF_BACKWARD, PROF_UPDATE, /* phases, in the order they run */
    PROF_RECOMPUTE,                                           /* inside backward */
    PROF_ATT_FORWARD, PROF_ATT_RECOMPUTE, PROF_ATT_BACKWARD,  /* inside forward, recompute, backward */
    NUM_PROF_KINDS
} ProfKind;

#define PROF_MAX_SPANS 8192 /* a step of 48 layers with 16 micro-steps needs about 5000 */

typedef struct {
    int step;        /* the optimizer step to profile; 0: none */
    int active;      /* recording now */
    int spans, dropped;
    int open[NUM_PROF_KINDS]; /* the open span of each kind, or -1 */
    int kind[PROF_MAX_SPANS];
    cudaEvent_t* events;      /* 2 per span: begin, end */
} Profiler;

/* REMAT_PROFILE=N: profile step N (N >= 1); unset or empty: never. */
static inline void prof_init(Profiler* p) {
    memset(p, 0, sizeof(*p));
    const char* env = getenv("REMAT_PROFILE");
    if (!env || !env[0]) return;
    char* end = NULL;
    long step = strtol(env, &end, 10);
    if (*end != '\0' || step < 1 || step > INT_MAX) fail("REMAT_PROFILE: '%s' is not a step number (1 or more)", env);
    p->step = (int)step;
    p->events = (cudaEvent_t*)malloc_check(2 * PROF_MAX_SPANS * sizeof(cudaEvent_t), "profile events");
    for (int i = 0; i < 2 * PROF_MAX_SPANS; i++) CUDA_CHECK(cudaEventCreate(&p->events[i]));
}

static inline void prof_free(Profiler* p) {
    if (p->events)
        for (int i = 0; i < 2 * PROF_MAX_SPANS; i++) CUDA_CHECK(cudaEventDestroy(p->events[i]));
    free(p->events);
    memset(p, 0, sizeof(*p));
}

static inline void prof_step_begin(Profiler* p, int step) {
    if (step != p->step) return;
    p->active = 1;
    p->spans = p->dropped = 0;
    for (int k = 0; k < NUM_PROF_KINDS; k++) p->open[k] = -1;
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

/* After the step's last span: waits for the stream, sums the spans per kind
 * (ms) into total[] and returns the first event to the last. */
static inline float prof_collect(Profiler* p, float total[NUM_PROF_KINDS]) {
    for (int k = 0; k < NUM_PROF_KINDS; k++) {
        total[k] = 0.0f;
        if (p->open[k] >= 0) fail("internal: profile span of kind %d begun but not ended", k);
    }
    if (p->spans == 0) return 0.0f;
    CUDA_CHECK(cudaDeviceSynchronize());
    float first_to_last = 0.0f;
    for (int i = 0; i < p->spans; i++) {
        float ms = 0.0f, since_first = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, p->events[2 * i], p->events[2 * i + 1]));
        CUDA_CHECK(cudaEventElapsedTime(&since_first, p->events[0], p->events[2 * i + 1]));
        total[p->kind[i]] += ms;
        if (since_first > first_to_last) first_to_last = since_first;
    }
    return first_to_last;
}

static inline void prof_step_end(Profiler* p, int step, int print) {
    if (!p->active) return;
    p->active = 0;
    float t[NUM_PROF_KINDS];
    float all = prof_collect(p, t);
    if (!print) return;
    float phases = t[PROF_FORWARD] + t[PROF_CLASSIFIER] + t[PROF_BACKWARD] + t[PROF_UPDATE];
    printf("profile of step %d: %.2f ms on the stream | forward %.2f (attention %.2f) | classifier %.2f"
           " | backward %.2f, of which recompute %.2f (attention %.2f) and attention %.2f | update %.2f | gaps %.2f",
           step, (double)all, (double)t[PROF_FORWARD], (double)t[PROF_ATT_FORWARD], (double)t[PROF_CLASSIFIER],
           (double)t[PROF_BACKWARD], (double)t[PROF_RECOMPUTE], (double)t[PROF_ATT_RECOMPUTE], (double)t[PROF_ATT_BACKWARD],
           (double)t[PROF_UPDATE], (double)(all - phases));
    if (p->dropped) printf(" (%d spans beyond %d not timed)", p->dropped, PROF_MAX_SPANS);
    printf("\n");
}

#endif
