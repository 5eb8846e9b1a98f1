/*
 * Searching plans: the bytes of a plan with other settings, the largest
 * batch or length that fits, -r auto (the fastest per-layer recompute mix,
 * offloading, token tile and segment size that fit the budgets, by the time
 * model) and the flags suggested when nothing fits. All of it only computes.
 */
#ifndef REMAT_PLAN_SEARCH_H
#define REMAT_PLAN_SEARCH_H

#include "../core/multiproc.h"
#include "cost_model.h"
#include "plan.h"

/* A per-layer choice as one code: the mode, plus PLAN_CODE_OFFLOAD when the
 * layer offloads (modes 1 and 3 only). */
#define PLAN_CODE_OFFLOAD 4

/* The plan of `base` with every layer in `code` (or base's own modes and
 * offload flags when code < 0), batch B and sequence length T: device bytes,
 * and host bytes in *host (may be NULL). */
static inline size_t plan_totals_for(const PlanSpec* base, int code, int B, int T, size_t* host) {
    PlanSpec s = *base;
    int L = s.cfg.num_layers;
    unsigned char* modes = (unsigned char*)malloc_check((size_t)L, "plan");
    unsigned char* offload = (unsigned char*)malloc_check((size_t)L, "plan");
    for (int l = 0; l < L; l++) {
        modes[l] = (unsigned char)(code < 0 ? plan_layer_mode(base, l) : code % PLAN_CODE_OFFLOAD);
        offload[l] = (unsigned char)(code < 0 ? plan_layer_offload(base, l) : code >= PLAN_CODE_OFFLOAD);
    }
    s.layer_mode = modes;
    s.layer_offload = offload;
    s.B = B;
    s.T = T;
    MemoryPlan p;
    plan_build(&p, &s);
    size_t total = p.total_bytes;
    if (host) *host = p.host_total_bytes;
    plan_free(&p);
    free(modes);
    free(offload);
    return total;
}

static inline size_t plan_total_for(const PlanSpec* base, int code, int B, int T) { return plan_totals_for(base, code, B, T, NULL); }

/* Largest value in [1, hi] for which the plan with every layer in `code`
 * fits both budgets, by bisection (the plan grows monotonically with B and
 * with T); 0 when even 1 does not fit. The CPU trainer's host pool draws
 * on the plan's budget too (host_shares_budget). */
static inline int plan_max_fitting_host(const PlanSpec* base, int code, int vary_T, int hi, size_t budget, size_t host_budget) {
    int lo = 0;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        size_t host = 0;
        size_t t = vary_T ? plan_totals_for(base, code, base->B, mid, &host) : plan_totals_for(base, code, mid, base->T, &host);
        if (base->host_shares_budget) t = size_add_sat(t, host);
        if (t <= budget && host <= host_budget) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static inline int plan_max_fitting(const PlanSpec* base, int mode, int vary_T, int hi, size_t budget) {
    return plan_max_fitting_host(base, mode, vary_T, hi, budget, SIZE_MAX);
}

#define PLAN_MAX_BATCH (1 << 16)

/* Predicted time of a step with modes and offload flags (modes NULL: the
 * spec's own, offload included), and the extra time over untiled -r 0 as a
 * fraction of its time. */
static inline double plan_predicted_seconds_offload(const PlanSpec* s, const unsigned char* modes, const unsigned char* offload,
                                                    double* extra_fraction) {
    CostModel cm = spec_cost_model(s);
    if (!modes) { modes = s->layer_mode; offload = s->layer_offload; }
    PlanSpec untiled = *s; /* -r 0: untiled, no segments */
    untiled.tile_tokens = 0;
    untiled.segment_layers = 0;
    double t = predicted_step_seconds(s, &cm, modes, offload), base = predicted_step_seconds(&untiled, &cm, NULL, NULL);
    if (extra_fraction) *extra_fraction = (t - base) / base;
    return t;
}

/* The same without offloading when modes are given. */
static inline double plan_predicted_seconds(const PlanSpec* s, const unsigned char* modes, double* extra_fraction) {
    return plan_predicted_seconds_offload(s, modes, NULL, extra_fraction);
}

/* All layers in one mode, from most memory to least. */
static const int mode_order[NUM_RECOMPUTE_MODES] = {RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_KEEP_ATTENTION, RECOMPUTE_FULL};

typedef struct {
    int mode;
    size_t total_bytes;
    int max_batch, max_seq_len;
    double step_seconds, extra_time_fraction;
} ModeFit;

static inline void plan_mode_fits(const PlanSpec* spec, size_t budget, ModeFit fits[NUM_RECOMPUTE_MODES]) {
    int L = spec->cfg.num_layers;
    unsigned char* modes = (unsigned char*)malloc_check((size_t)L, "plan");
    for (int i = 0; i < NUM_RECOMPUTE_MODES; i++) {
        fits[i].mode = mode_order[i];
        fits[i].total_bytes = plan_total_for(spec, mode_order[i], spec->B, spec->T);
        fits[i].max_batch = budget ? plan_max_fitting(spec, mode_order[i], 0, PLAN_MAX_BATCH, budget) : -1;
        fits[i].max_seq_len = budget ? plan_max_fitting(spec, mode_order[i], 1, spec->cfg.max_seq_len, budget) : -1;
        memset(modes, mode_order[i], (size_t)L);
        fits[i].step_seconds = plan_predicted_seconds(spec, modes, &fits[i].extra_time_fraction);
    }
    free(modes);
}

/* ---- -r auto ---- */

/* Bytes of one layer's kept activations in `mode`, as the plan aligns them,
 * and of the shared recompute set when the modes in `present` (a bit per
 * mode) occur: the plan's total is a constant plus the sum of these. */
static inline size_t plan_kept_aligned_bytes(const PlanSpec* s, int mode) {
    size_t b = 0;
    for (int a = 0; a < NUM_LAYER_ACTS; a++)
        if (layer_keeps(mode, a)) b += ceil_div(plan_act_bytes(s, a), PLAN_ALIGN) * PLAN_ALIGN;
    return b;
}

static inline size_t plan_shared_set_bytes(const PlanSpec* s, unsigned present) {
    size_t b = 0;
    for (int a = 0; a < NUM_LAYER_ACTS; a++) {
        int needed = 0;
        for (int m = 0; m < NUM_RECOMPUTE_MODES; m++) needed |= (present >> m & 1) && !layer_keeps(m, a);
        if (needed) b += ceil_div(plan_shared_act_bytes(s, a), PLAN_ALIGN) * PLAN_ALIGN;
    }
    return b;
}

/* Aligned bytes one offloaded layer in `mode` keeps in the host pool, and
 * the staging ring's device bytes for o1 offloaded -r 1 and o3 -r 3 layers. */
static inline size_t plan_offloaded_aligned_bytes(const PlanSpec* s, int mode) {
    size_t b = 0;
    for (int a = 0; a < NUM_LAYER_ACTS; a++)
        if (layer_offloads(mode, 1, a)) b += ceil_div(plan_act_bytes(s, a), PLAN_ALIGN) * PLAN_ALIGN;
    return b;
}

static inline size_t plan_staging_bytes(const PlanSpec* s, int o1, int o3) {
    if (!o1 && !o3) return 0;
    int L = s->cfg.num_layers, R = L < OFFLOAD_STAGING_SLOTS ? L : OFFLOAD_STAGING_SLOTS;
    return (size_t)R * plan_offloaded_aligned_bytes(s, o3 ? RECOMPUTE_KEEP_ATTENTION : RECOMPUTE_FULL);
}

/* One -r auto candidate: layers per code (mode + PLAN_CODE_OFFLOAD when offloaded). */
typedef struct {
    int count[2 * NUM_RECOMPUTE_MODES];
    double secs;
    size_t bytes;
} AutoChoice;

/* The candidate with n1 -r 1 layers (o1 of them offloaded), n3 -r 3 (o3),
 * and the fewest -r 2 layers that make it fit (with2: at least one, or
 * none): 0, or -1 when it does not fit. */
static inline int auto_candidate(const PlanSpec* spec, size_t budget, size_t fixed, const size_t kept[NUM_RECOMPUTE_MODES],
                                 const double secs[2 * NUM_RECOMPUTE_MODES], int n1, int o1, int n3, int o3, int with2, AutoChoice* c) {
    int L = spec->cfg.num_layers, rest = L - n1 - n3; /* layers in -r 0 or -r 2 */
    if (with2 && !rest) return -1;
    unsigned present = (n1 ? 1u << RECOMPUTE_FULL : 0) | (n3 ? 1u << RECOMPUTE_KEEP_ATTENTION : 0) | (with2 ? 1u << RECOMPUTE_SELECTIVE : 0);
    size_t all_zero = fixed + (size_t)(n1 - o1) * kept[1] + (size_t)(n3 - o3) * kept[3] + (size_t)rest * kept[0] +
                      plan_staging_bytes(spec, o1, o3) + plan_shared_set_bytes(spec, present);
    size_t saving2 = kept[0] - kept[2];
    int n2 = 0; /* with n2 >= 1 layers in -r 2 the total is all_zero - n2 * saving2 */
    if (with2) n2 = all_zero > budget ? (int)ceil_div(all_zero - budget, saving2) : 1;
    if (n2 > rest) return -1;
    size_t bytes = all_zero - (size_t)n2 * saving2;
    if (bytes > budget) return -1;
    memset(c, 0, sizeof(*c));
    c->count[RECOMPUTE_NONE] = rest - n2;
    c->count[RECOMPUTE_SELECTIVE] = n2;
    c->count[RECOMPUTE_FULL] = n1 - o1;
    c->count[RECOMPUTE_KEEP_ATTENTION] = n3 - o3;
    c->count[PLAN_CODE_OFFLOAD + RECOMPUTE_FULL] = o1;
    c->count[PLAN_CODE_OFFLOAD + RECOMPUTE_KEEP_ATTENTION] = o3;
    c->secs = 0.0;
    for (int k = 0; k < 2 * NUM_RECOMPUTE_MODES; k++) c->secs += c->count[k] * secs[k];
    c->bytes = bytes;
    return 0;
}

/* Chooses per-layer modes and offload flags for spec (B, T fixed) that fit
 * the device budget and the host budget (0: no offloading; offload may then
 * be NULL) with the least predicted step time. Every layer has the same
 * shape, so a choice is how many layers take each mode, offloaded or not:
 * the device total is a constant, plus each layer's kept bytes (none for an
 * offloaded one), plus the shared recompute set of the modes present, plus
 * the staging ring when some layer offloads; the host total is the
 * offloaded layers' kept bytes; the time is -r 0's plus each layer's
 * recompute time plus each offloaded layer's unhidden copy time. For each
 * count of -r 1 and -r 3 layers, offloaded or not, the fewest -r 2 layers
 * that fit is the fastest (-r 2 costs time and saves memory over -r 0), so
 * the search is exact, in O(L^4) with offloading (O(L^2) without). Ties go
 * to less device memory. Layers get 1o first, then 1, 3o, 3, 2, 0, from
 * layer 0 up. Returns 0 and fills modes (and offload), or -1 when nothing fits. */
static inline int recompute_auto_offload(const PlanSpec* spec, size_t budget, size_t host_budget, unsigned char* modes,
                                         unsigned char* offload) {
    int L = spec->cfg.num_layers;
    memset(modes, RECOMPUTE_NONE, (size_t)L);
    if (offload) memset(offload, 0, (size_t)L);
    else host_budget = 0;
    /* the CPU trainer's "device" is the host: its offloaded pool draws on the
     * same memory as the plan, so both must fit the one budget together */
    int one_memory = spec->host_shares_budget;
    CostModel cm = spec_cost_model(spec);
    size_t kept[NUM_RECOMPUTE_MODES], hosted[NUM_RECOMPUTE_MODES];
    double secs[2 * NUM_RECOMPUTE_MODES];
    for (int m = 0; m < NUM_RECOMPUTE_MODES; m++) {
        kept[m] = plan_kept_aligned_bytes(spec, m);
        hosted[m] = plan_offloaded_aligned_bytes(spec, m);
        secs[m] = recompute_seconds(spec, &cm, m);
        secs[PLAN_CODE_OFFLOAD + m] = secs[m] + offload_seconds(spec, &cm, m);
    }
    size_t fixed = plan_total_for(spec, RECOMPUTE_NONE, spec->B, spec->T) - (size_t)L * kept[0];
    AutoChoice best = {{0}, 0.0, 0}, c;
    int found = 0;
    for (int n1 = 0; n1 <= L; n1++)
        for (int n3 = 0; n1 + n3 <= L; n3++)
            for (int o1 = 0; o1 <= (host_budget ? n1 : 0); o1++)
                for (int o3 = 0; o3 <= (host_budget ? n3 : 0); o3++) {
                    size_t device_budget = budget;
                    if (o1 || o3) {
                        size_t host = size_add_sat(size_mul_sat((size_t)o1, hosted[1]), size_mul_sat((size_t)o3, hosted[3]));
                        if (host > host_budget) break;
                        if (one_memory) device_budget = host < budget ? budget - host : 0;
                    }
                    for (int with2 = 0; with2 <= 1; with2++) {
                        if (auto_candidate(spec, device_budget, fixed, kept, secs, n1, o1, n3, o3, with2, &c) != 0) continue;
                        if (!found || c.secs < best.secs || (c.secs == best.secs && c.bytes < best.bytes)) best = c;
                        found = 1;
                    }
                }
    if (!found) return -1;
    static const int fill_order[2 * NUM_RECOMPUTE_MODES - 2] = {PLAN_CODE_OFFLOAD + RECOMPUTE_FULL, RECOMPUTE_FULL,
                                                                PLAN_CODE_OFFLOAD + RECOMPUTE_KEEP_ATTENTION, RECOMPUTE_KEEP_ATTENTION,
                                                                RECOMPUTE_SELECTIVE, RECOMPUTE_NONE};
    int l = 0;
    for (int i = 0; i < 2 * NUM_RECOMPUTE_MODES - 2; i++)
        for (int k = 0; k < best.count[fill_order[i]]; k++, l++) {
            modes[l] = (unsigned char)(fill_order[i] % PLAN_CODE_OFFLOAD);
            if (offload) offload[l] = (unsigned char)(fill_order[i] >= PLAN_CODE_OFFLOAD);
        }
    return 0;
}

/* ---- token tiles: -r auto and --tile-tokens auto ---- */

/* The smallest tile the trainers accept, and so the searches' smallest:
 * one row. Small tiles cost time (a pass per tile, matmuls of few rows),
 * which the time model prices, so a search takes them only where nothing
 * larger fits. */
#define PLAN_TILE_MIN_ROWS 1
#define PLAN_MAX_TILE_CANDIDATES 40

/* Tile sizes the searches try: untiled (0), then the powers of two below
 * this rank's B*T/N rows, halving down to PLAN_TILE_MIN_ROWS. A plan
 * shrinks with its tile, so where a tile of any size fits, the power of two
 * at or below it fits too. */
static inline int plan_tile_candidates(const PlanSpec* s, int out[PLAN_MAX_TILE_CANDIDATES]) {
    size_t rows = (size_t)s->B * (size_t)plan_local_T(s), k = 1;
    int n = 0;
    out[n++] = 0;
    while (2 * k < rows) k *= 2;
    for (; k >= PLAN_TILE_MIN_ROWS && k < rows && n < PLAN_MAX_TILE_CANDIDATES; k /= 2) out[n++] = (int)k;
    return n;
}

/* ---- segments: -r auto over --segment-layers ---- */

/* Modes in the order of what they keep, each a superset of the one before. */
static inline int mode_keeps_rank(int mode) {
    return mode == RECOMPUTE_FULL ? 0 : mode == RECOMPUTE_KEEP_ATTENTION ? 1 : mode == RECOMPUTE_SELECTIVE ? 2 : 3;
}

/* Time of `count` slots' layers in modes given per slot in order of least
 * time first, the first `big` slots with S layers, the others S - 1. */
static inline double segment_group_seconds(const int order[NUM_RECOMPUTE_MODES], const int count[NUM_RECOMPUTE_MODES], const double rec[NUM_RECOMPUTE_MODES],
                                           int big, int S) {
    double t = 0.0;
    for (int i = 0; i < NUM_RECOMPUTE_MODES; i++) {
        int m = order[i], b = count[m] < big ? count[m] : big;
        t += (double)b * S * rec[m] + (double)(count[m] - b) * (S - 1) * rec[m];
        big -= b;
    }
    return t;
}

/* -r auto at one segment size K > 1: what the search knows before it
 * chooses. Layer l sits in slot l % K of its segment; slot i's bytes are the
 * union of what its layers keep (the plan keeps one slot per position, as
 * wide as its widest layer). */
typedef struct {
    int K, segments;              /* layers per segment, and segments (the top one may be short) */
    int top_full;                 /* the top segment has all K layers, so slot K-1 has a top-segment layer */
    int middle;                   /* slots 1..K-2: neither the segment inputs' slot nor the last */
    int middle_big;               /* how many of them (from slot 1 up) hold a layer of the top segment too */
    int staging;                  /* staging slots of offloaded segment inputs */
    size_t x_bytes;               /* one layer's input x, as the plan aligns it */
    size_t kept[NUM_RECOMPUTE_MODES];
    size_t fixed;                 /* the plan's bytes less every slot's and segment input's and the shared recompute set */
    double rerun[NUM_RECOMPUTE_MODES]; /* a layer's extra time in a mode, run forward once more for its segment */
    double last[NUM_RECOMPUTE_MODES];  /* the same for a segment's last layer, which reruns only up to what it keeps */
    double input_offload;         /* unhidden copy time of one offloaded segment input */
    int by_time[NUM_RECOMPUTE_MODES]; /* modes by rerun time, least first (ties: the one keeping less) */
} SegmentSearch;

/* One choice: a mode for slot 0 (the segment inputs' layers), two for slot
 * K-1 (its layers below the top segment, and the top segment's own), how
 * many middle slots take each mode, and whether the segment inputs go to
 * the host. */
typedef struct {
    int input_mode, last_mode_low, last_mode_top;
    int middle_count[NUM_RECOMPUTE_MODES];
    int offload_inputs;
    double secs;
    size_t bytes;
} SegmentChoice;

static inline int mode_present(unsigned present, int mode) { return present >> mode & 1; }

/* Whether mode a comes before mode b in by_time: it reruns faster, or as fast keeping less. */
static inline int segment_mode_before(const SegmentSearch* ss, int a, int b) {
    return ss->rerun[a] < ss->rerun[b] || (ss->rerun[a] == ss->rerun[b] && ss->kept[a] < ss->kept[b]);
}

static inline SegmentSearch segment_search_new(const PlanSpec* spec) {
    SegmentSearch ss;
    int L = spec->cfg.num_layers, top_layers;
    CostModel cm = spec_cost_model(spec);
    ss.K = plan_segment_layers(spec);
    ss.segments = plan_num_segments(spec);
    top_layers = L - (ss.segments - 1) * ss.K;
    ss.top_full = top_layers == ss.K;
    ss.middle = ss.K - 2;
    ss.middle_big = ss.top_full ? ss.K - 2 : top_layers - 1;
    ss.staging = ss.segments < OFFLOAD_STAGING_SLOTS ? ss.segments : OFFLOAD_STAGING_SLOTS;
    ss.x_bytes = plan_aligned(plan_act_bytes(spec, ACT_X));
    ss.input_offload = segment_offload_seconds(spec, &cm);
    for (int m = 0; m < NUM_RECOMPUTE_MODES; m++) {
        ss.kept[m] = plan_kept_aligned_bytes(spec, m);
        ss.rerun[m] = layer_extra_seconds(spec, &cm, m, 0);
        ss.last[m] = layer_extra_seconds(spec, &cm, m, 2);
        ss.by_time[m] = m;
    }
    int* o = ss.by_time;
    for (int i = 1; i < NUM_RECOMPUTE_MODES; i++) /* insertion sort */
        for (int j = i; j > 0 && segment_mode_before(&ss, o[j], o[j - 1]); j--) {
            int t = o[j]; o[j] = o[j - 1]; o[j - 1] = t;
        }
    ss.fixed = plan_total_for(spec, RECOMPUTE_FULL, spec->B, spec->T) - (size_t)(ss.segments + ss.K - 1) * ss.x_bytes -
               plan_shared_set_bytes(spec, 1u << RECOMPUTE_FULL);
    return ss;
}

/* Slot K-1 in `slot_mode`: its layers may take any present mode keeping no
 * more (the slot is as wide as slot_mode either way); below the top segment
 * the one whose partial rerun is fastest, in the top segment the one whose
 * recompute is. */
static inline void segment_last_slot_modes(const SegmentSearch* ss, unsigned present, int slot_mode, int* low, int* top) {
    *low = *top = slot_mode;
    for (int m = 0; m < NUM_RECOMPUTE_MODES; m++) {
        if (!mode_present(present, m) || mode_keeps_rank(m) > mode_keeps_rank(slot_mode)) continue;
        if (ss->last[m] < ss->last[*low]) *low = m;
        if (ss->rerun[m] < ss->rerun[*top]) *top = m;
    }
}

/* The middle slots with n_full in -r 1 and n_keep_att in -r 3: the others
 * in -r 0 or -r 2, as many -r 2 as make `bytes` (everything else counted)
 * fit `cap` and no more (-r 2 saves memory and costs time over -r 0).
 * Returns 0 and fills c->middle_count and c->bytes, or -1 when it cannot fit. */
static inline int segment_middle_fit(const SegmentSearch* ss, unsigned present, int n_full, int n_keep_att, size_t bytes, size_t cap,
                                     SegmentChoice* c) {
    int rest = ss->middle - n_full - n_keep_att;
    int has_none = mode_present(present, RECOMPUTE_NONE), has_selective = mode_present(present, RECOMPUTE_SELECTIVE);
    if (rest && !has_none && !has_selective) return -1;
    const size_t* kept = ss->kept;
    bytes += (size_t)n_full * kept[RECOMPUTE_FULL] + (size_t)n_keep_att * kept[RECOMPUTE_KEEP_ATTENTION] +
             (size_t)rest * kept[has_none ? RECOMPUTE_NONE : RECOMPUTE_SELECTIVE];
    int n_selective = has_none ? 0 : rest;
    if (has_none && has_selective && bytes > cap) {
        size_t saving = kept[RECOMPUTE_NONE] - kept[RECOMPUTE_SELECTIVE];
        n_selective = (int)ceil_div(bytes - cap, saving);
        if (n_selective > rest) return -1;
        bytes -= (size_t)n_selective * saving;
    }
    if (bytes > cap) return -1;
    c->middle_count[RECOMPUTE_NONE] = rest - n_selective;
    c->middle_count[RECOMPUTE_FULL] = n_full;
    c->middle_count[RECOMPUTE_SELECTIVE] = n_selective;
    c->middle_count[RECOMPUTE_KEEP_ATTENTION] = n_keep_att;
    c->bytes = bytes;
    return 0;
}

/* The middle slots' time: their fastest modes go to the middle_big slots with a layer more. */
static inline double segment_middle_seconds(const SegmentSearch* ss, const int count[NUM_RECOMPUTE_MODES]) {
    return segment_group_seconds(ss->by_time, count, ss->rerun, ss->middle_big, ss->segments);
}

/* The mode of middle slot i (1..K-2): the counts laid out by time, fastest first. */
static inline int segment_middle_slot_mode(const SegmentSearch* ss, const int count[NUM_RECOMPUTE_MODES], int i) {
    int k = 1;
    for (int j = 0; j < NUM_RECOMPUTE_MODES; j++) {
        k += count[ss->by_time[j]];
        if (i < k) return ss->by_time[j];
    }
    return ss->by_time[NUM_RECOMPUTE_MODES - 1]; /* not reached: the counts fill every middle slot */
}

/* -r auto at the spec's segment size K > 1 (B, T and tiles fixed): per-layer
 * modes and the offloading of the segment inputs (all or none) with the
 * least predicted time that fits both budgets. Every layer of a slot takes
 * the slot's mode (keeping more only saves time), except in slot K-1 where
 * a segment's last layer reruns up to what it keeps: its layers below the
 * top segment take the fastest mode within the slot's. With the modes
 * present fixed (an outer loop, which sizes the shared recompute set), slot
 * 0 (no x of its own: the segment inputs) and slot K-1 chosen, the middle
 * slots are a count per mode, their fastest modes going to the slots with
 * one layer more; for each count of -r 1 and -r 3 slots the fewest -r 2
 * slots that fit are the fastest, as in recompute_auto_offload. Exact over
 * that space, in O(K^2). Ties go to fewer bytes. Returns 0 and fills modes
 * and offload (NULL: none), or -1. */
static inline int recompute_auto_segments_at(const PlanSpec* spec, size_t budget, size_t host_budget, unsigned char* modes,
                                             unsigned char* offload) {
    const SegmentSearch ss = segment_search_new(spec);
    const int S = ss.segments;
    const size_t inputs_bytes = (size_t)S * ss.x_bytes; /* one x per segment */
    const int may_offload = offload && host_budget && inputs_bytes <= host_budget;
    /* the CPU trainer's pool draws on the same memory as its plan (host_shares_budget) */
    const size_t offload_cap = spec->host_shares_budget ? (inputs_bytes < budget ? budget - inputs_bytes : 0) : budget;
    SegmentChoice best, c;
    memset(&best, 0, sizeof(best));
    memset(&c, 0, sizeof(c));
    int found = 0;
    for (unsigned present = 1; present < (1u << NUM_RECOMPUTE_MODES); present++) {
        size_t shared = plan_shared_set_bytes(spec, present);
        for (c.input_mode = 0; c.input_mode < NUM_RECOMPUTE_MODES; c.input_mode++) {
            if (!mode_present(present, c.input_mode)) continue;
            for (int last_slot = 0; last_slot < NUM_RECOMPUTE_MODES; last_slot++) {
                if (!mode_present(present, last_slot)) continue;
                segment_last_slot_modes(&ss, present, last_slot, &c.last_mode_low, &c.last_mode_top);
                double ends_secs = S * ss.rerun[c.input_mode] + (S - 1) * ss.last[c.last_mode_low] +
                                   (ss.top_full ? ss.rerun[c.last_mode_top] : 0.0);
                size_t ends_bytes = ss.fixed + ss.kept[c.input_mode] - ss.x_bytes + ss.kept[last_slot] + shared;
                int max_full = mode_present(present, RECOMPUTE_FULL) ? ss.middle : 0;
                int max_keep_att = mode_present(present, RECOMPUTE_KEEP_ATTENTION) ? ss.middle : 0;
                for (int n_full = 0; n_full <= max_full; n_full++)
                    for (int n_keep_att = 0; n_full + n_keep_att <= ss.middle && n_keep_att <= max_keep_att; n_keep_att++)
                        for (c.offload_inputs = 0; c.offload_inputs <= may_offload; c.offload_inputs++) {
                            size_t inputs = c.offload_inputs ? (size_t)ss.staging * ss.x_bytes : inputs_bytes;
                            size_t cap = c.offload_inputs ? offload_cap : budget;
                            if (segment_middle_fit(&ss, present, n_full, n_keep_att, ends_bytes + inputs, cap, &c) != 0) continue;
                            c.secs = ends_secs + segment_middle_seconds(&ss, c.middle_count) +
                                     (c.offload_inputs ? S * ss.input_offload : 0.0);
                            if (found && !(c.secs < best.secs || (c.secs == best.secs && c.bytes < best.bytes))) continue;
                            found = 1;
                            best = c;
                        }
            }
        }
    }
    if (!found) return -1;
    for (int l = 0; l < spec->cfg.num_layers; l++) {
        int slot = l % ss.K, below_top = l / ss.K < S - 1;
        int mode = slot == 0 ? best.input_mode : slot < ss.K - 1 ? segment_middle_slot_mode(&ss, best.middle_count, slot)
                 : below_top ? best.last_mode_low : best.last_mode_top;
        modes[l] = (unsigned char)mode;
        if (offload) offload[l] = (unsigned char)best.offload_inputs;
    }
    return 0;
}

/* -r auto over tile sizes (search_tiles; else spec->tile_tokens) and
 * segment sizes (search_segments: 1 to L; else spec->segment_layers): for
 * each pair the exact choice (recompute_auto_offload without segments,
 * recompute_auto_segments_at with them), and of those the least predicted
 * step time, ties to fewer tiles and then to fewer layers per segment. Sets
 * spec->tile_tokens and spec->segment_layers; returns 0, or -1 when nothing fits. */
static inline int recompute_auto_plan(PlanSpec* spec, size_t budget, size_t host_budget, int search_tiles, int search_segments,
                                      unsigned char* modes, unsigned char* offload) {
    int L = spec->cfg.num_layers, cand[PLAN_MAX_TILE_CANDIDATES], n = 1, found = 0;
    cand[0] = spec->tile_tokens;
    if (search_tiles) n = plan_tile_candidates(spec, cand);
    int k_lo = search_segments ? 1 : plan_segment_layers(spec), k_hi = search_segments ? (L > 1 ? L : 1) : k_lo;
    unsigned char* try_modes = (unsigned char*)malloc_check((size_t)L, "plan");
    unsigned char* try_offload = (unsigned char*)malloc_check((size_t)L, "plan");
    double best = 0.0;
    int best_tile = cand[0], best_k = k_lo;
    for (int i = 0; i < n; i++)
        for (int K = k_lo; K <= k_hi; K++) {
            PlanSpec s = *spec;
            s.tile_tokens = cand[i];
            s.segment_layers = K;
            int rc = K == 1 ? recompute_auto_offload(&s, budget, host_budget, try_modes, offload ? try_offload : NULL)
                            : recompute_auto_segments_at(&s, budget, host_budget, try_modes, offload ? try_offload : NULL);
            if (rc != 0) continue;
            double t = plan_predicted_seconds_offload(&s, try_modes, offload ? try_offload : NULL, NULL);
            if (found && !(t < best)) continue;
            found = 1;
            best = t;
            best_tile = cand[i];
            best_k = K;
            memcpy(modes, try_modes, (size_t)L);
            if (offload) memcpy(offload, try_offload, (size_t)L);
        }
    free(try_modes);
    free(try_offload);
    spec->tile_tokens = best_tile;
    spec->segment_layers = best_k;
    return found ? 0 : -1;
}

/* -r auto with the optimizer's place as one more choice (choose_place;
 * else where spec->offload_optimizer says): on the device, or in the host
 * pool (--offload-optimizer), whose bytes then come off the host budget
 * first (off the one budget too where the pool shares it). For each place
 * the exact choice of recompute_auto_plan, checkpoint offloading only with
 * offload_checkpoints; of the two the least predicted step time, ties to the
 * device (offloading adds copies and a host update; on the CPU it saves no
 * memory). host_budget: the host pool's, 0 when nothing may go there. Sets
 * spec->offload_optimizer, tile_tokens and segment_layers; returns 0, or -1. */
static inline int recompute_auto_place(PlanSpec* spec, size_t budget, size_t host_budget, int offload_checkpoints, int choose_place,
                                       int search_tiles, int search_segments, unsigned char* modes, unsigned char* offload) {
    int L = spec->cfg.num_layers, found = 0, given = spec->offload_optimizer;
    unsigned char* try_modes = (unsigned char*)malloc_check((size_t)L, "plan");
    unsigned char* try_offload = (unsigned char*)calloc_check((size_t)L, 1, "plan");
    PlanSpec best = *spec;
    double best_t = 0.0;
    for (int place = choose_place ? 0 : given; place <= (choose_place ? 1 : given); place++) {
        PlanSpec s = *spec;
        s.offload_optimizer = place;
        size_t opt = plan_host_optimizer_bytes(&s);
        if (opt > host_budget || (s.host_shares_budget && opt > budget)) continue;
        size_t b = s.host_shares_budget ? budget - opt : budget, hb = offload_checkpoints ? host_budget - opt : 0;
        if (s.host_shares_budget && hb > b) hb = b;
        memset(try_offload, 0, (size_t)L);
        if (recompute_auto_plan(&s, b, hb, search_tiles, search_segments, try_modes, offload ? try_offload : NULL) != 0) continue;
        double t = plan_predicted_seconds_offload(&s, try_modes, offload ? try_offload : NULL, NULL);
        if (found && !(t < best_t)) continue;
        found = 1;
        best_t = t;
        best = s;
        memcpy(modes, try_modes, (size_t)L);
        if (offload) memcpy(offload, try_offload, (size_t)L);
    }
    free(try_modes);
    free(try_offload);
    spec->offload_optimizer = found ? best.offload_optimizer : given;
    spec->tile_tokens = best.tile_tokens;
    spec->segment_layers = best.segment_layers;
    return found ? 0 : -1;
}

/* -r auto with the tile size as a third choice (search_tiles; else at
 * spec->tile_tokens), at the spec's segment size: for each candidate tile
 * K the exact per-K choice (recompute_auto_plan), and of those the least predicted step time, ties
 * to the earlier candidate (fewer tiles). Exact over modes, offloading and
 * the candidates: at a fixed K every layer pays the same tile costs in its
 * forward and backward, so the per-K search's ranking holds, and the
 * outer minimum compares whole predicted steps. The tile is one size for
 * the run because the shared recompute set it shrinks is one buffer for
 * every layer: "per layer" reduces to per run. Sets spec->tile_tokens;
 * returns 0, or -1 when nothing fits. */
static inline int recompute_auto_tiles(PlanSpec* spec, size_t budget, size_t host_budget, int search_tiles, unsigned char* modes,
                                       unsigned char* offload) {
    return recompute_auto_plan(spec, budget, host_budget, search_tiles, 0, modes, offload);
}

/* --tile-tokens auto with the spec's own modes: of the candidates whose
 * plan fits the device budget, the least predicted time (untiled when it
 * fits: a tile only adds time); the smallest candidate when none fits. */
static inline int plan_auto_tile(const PlanSpec* spec, size_t budget) {
    int cand[PLAN_MAX_TILE_CANDIDATES], n = plan_tile_candidates(spec, cand), best_k = cand[n - 1], found = 0;
    double best = 0.0;
    for (int i = 0; i < n; i++) {
        PlanSpec s = *spec;
        s.tile_tokens = cand[i];
        if (plan_total_for(&s, -1, s.B, s.T) > budget) continue;
        double t = plan_predicted_seconds_offload(&s, NULL, NULL, NULL);
        if (found && !(t < best)) continue;
        found = 1;
        best = t;
        best_k = cand[i];
    }
    return best_k;
}

/* Without offloading. */
static inline int recompute_auto(const PlanSpec* spec, size_t budget, unsigned char* modes) {
    return recompute_auto_offload(spec, budget, 0, modes, NULL);
}

/* ---- what would fit: the suggestions printed when a plan does not ---- */

/* Device bytes of s's plan with modes (NULL: s's own), counting the host
 * pool where it is the same memory (host_shares_budget): what a budget must hold. */
static inline size_t plan_budget_bytes(const PlanSpec* s, unsigned char* modes) {
    PlanSpec p = *s;
    if (modes) { p.layer_mode = modes; p.layer_offload = NULL; }
    size_t host = 0, device = plan_totals_for(&p, -1, p.B, p.T, &host);
    return p.host_shares_budget ? size_add_sat(device, host) : device;
}

/* " --segment-layers K --tile-tokens k" as far as s segments and tiles. */
static inline const char* plan_layout_flags(const PlanSpec* s, char* buf, size_t n) {
    size_t used = 0;
    buf[0] = '\0';
    if (plan_segment_layers(s) > 1) used = (size_t)snprintf(buf, n, " --segment-layers %d", plan_segment_layers(s));
    if (s->tile_tokens > 0 && used < n) snprintf(buf + used, n - used, " --tile-tokens %d", s->tile_tokens);
    return buf;
}

/* s at batch B over `world` processes, `N` sharing each sequence, keeping
 * `tokens` per step: the micro-steps follow (0 when B*T*groups does not
 * divide the tokens). */
static inline int plan_respread(PlanSpec* s, int B, int T, int world, int N, long long tokens) {
    s->B = B;
    s->T = T;
    s->world_size = world;
    s->context_parallel = N;
    long long micro = (long long)B * T * (world / N);
    if (micro <= 0 || tokens % micro != 0) return 0;
    s->grad_accum = s->micro_steps = (int)(tokens / micro);
    return 1;
}

/* The least device memory the levers reach at s's batch and length: -r 1
 * on every layer (it keeps the least), untiled or at the smallest tile
 * (a plan shrinks with its tile; tiles add buffers of their own, so
 * untiled may be less), at the segment size of least memory. Sets s's
 * tile and segment size to that plan's; returns its bytes (plan_budget_bytes). */
static inline size_t plan_least_layout(PlanSpec* s) {
    int cand[PLAN_MAX_TILE_CANDIDATES], n = plan_tile_candidates(s, cand), L = s->cfg.num_layers;
    int tiles[2] = {0, cand[n - 1]}, best_tile = 0, best_k = 1;
    size_t least = SIZE_MAX;
    unsigned char* full = (unsigned char*)malloc_check((size_t)L, "plan");
    memset(full, RECOMPUTE_FULL, (size_t)L);
    for (int i = 0; i < 2; i++)
        for (int K = 1; K <= L; K++) {
            s->tile_tokens = tiles[i];
            s->segment_layers = K;
            size_t b = plan_budget_bytes(s, full);
            if (b < least) { least = b; best_tile = tiles[i]; best_k = K; }
        }
    free(full);
    s->tile_tokens = best_tile;
    s->segment_layers = best_k;
    return least;
}

/* The plan to suggest at s (batch, length, processes as set): -r auto's
 * choice, with the tile and segment size searched too (search) or s's,
 * as flags ("-r MIX --segment-layers K --tile-tokens k") and its predicted
 * extra time. Every suggestion is checked by plan_build against the budget
 * (the plan that would run); with search, when -r auto's choice did not
 * check out, the least plan (plan_least_layout) stands in. Returns 0, or -1
 * when nothing fits. */
static inline int plan_suggest(const PlanSpec* base, size_t budget, int search, char* flag, size_t n, double* extra) {
    PlanSpec s = *base;
    int L = s.cfg.num_layers, rc = -1;
    unsigned char* modes = (unsigned char*)malloc_check((size_t)L, "plan");
    if (recompute_auto_plan(&s, budget, 0, search, search, modes, NULL) == 0 && plan_budget_bytes(&s, modes) <= budget) rc = 0;
    if (rc != 0 && search && plan_least_layout(&s) <= budget) {
        memset(modes, RECOMPUTE_FULL, (size_t)L);
        rc = 0;
    }
    if (rc == 0) {
        char layout[96];
        size_t used = (size_t)snprintf(flag, n, "-r ");
        format_recompute_flag(modes, NULL, L, flag + used, n - used);
        used = strlen(flag);
        snprintf(flag + used, n - used, "%s", plan_layout_flags(&s, layout, sizeof(layout)));
        s.layer_mode = modes;
        s.layer_offload = NULL;
        plan_predicted_seconds(&s, modes, extra);
    }
    free(modes);
    return rc;
}

/* Tokens of one micro-step of B sequences of T over `world` processes: one
 * batch per data-parallel group (world / --context-parallel N), as -d counts. */
static inline long long plan_micro_step_tokens(const PlanSpec* spec, int B, int world) {
    return (long long)B * spec->T * (world / plan_context_parallel(spec));
}

/* The largest batch B' <= B with which s's least plan (plan_least_layout)
 * fits over `world` processes and the tokens per step stay `tokens` (B' *
 * T * groups divides them, so -d keeps them with more micro-steps); 0 when
 * none. Sets s to that batch. */
static inline int plan_fitting_batch_keeping_tokens(PlanSpec* s, int world, long long tokens, size_t budget) {
    PlanSpec probe = *s;
    int lo = 0, hi = s->B, N = plan_context_parallel(s);
    while (lo < hi) { /* the least plan grows with B */
        int mid = lo + (hi - lo + 1) / 2;
        long long micro = (long long)mid * s->T * (world / N);
        probe.B = mid;
        probe.world_size = world;
        probe.grad_accum = probe.micro_steps = (int)((tokens + micro - 1) / micro); /* a GPU sums several in fp32 */
        if (plan_least_layout(&probe) <= budget) lo = mid;
        else hi = mid - 1;
    }
    for (int b = lo; b >= 1; b--)
        if (plan_respread(s, b, s->T, world, N, tokens)) return b;
    return 0;
}

/* The longest T' <= s's T, a multiple of 2N under context parallelism, with
 * which s's least plan fits; 0 when none. Sets s to that length. */
static inline int plan_fitting_length(PlanSpec* s, size_t budget) {
    PlanSpec probe = *s;
    int N = plan_context_parallel(s), t_step = N > 1 ? 2 * N : 1, lo = 0, hi = s->T / t_step;
    while (lo < hi) { /* in steps of 2N; the least plan grows with T */
        int mid = lo + (hi - lo + 1) / 2;
        probe.T = mid * t_step;
        if (plan_least_layout(&probe) <= budget) lo = mid;
        else hi = mid - 1;
    }
    s->T = lo * t_step;
    return s->T;
}

/* What would fit instead, as flags; printed when the plan does not fit.
 * Every line is a plan that plan_build says fits (plan_suggest). First
 * -r auto's mix at the run's tile and segment size (and the modes on every
 * layer that fit), -w 0 where there are master weights. When no mix fits,
 * the levers that keep the batch and the sequence, on this run's processes:
 * token tiles and segments, ZeRO-1, more members in each context-parallel
 * ring; only when none of them fits, what changes the run's shape: a smaller
 * batch keeping the tokens per step (-d), ZeRO-1 over more processes (only
 * where this build runs several), a shorter sequence, each with the levers. */
static inline void plan_print_suggestions(const PlanSpec* spec, size_t budget, FILE* out) {
    char size[32], flag[8192], layout[96];
    double extra = 0.0;
    fprintf(out, "what would fit in %s:\n", format_size(budget, size, sizeof(size)));
    int fits = plan_suggest(spec, budget, 0, flag, sizeof(flag), &extra) == 0;
    if (fits) {
        fprintf(out, "  -r auto: the fastest predicted mix that fits, here %s (+%.1f%% predicted time)\n", flag, 100.0 * extra);
        ModeFit fit[NUM_RECOMPUTE_MODES];
        plan_mode_fits(spec, 0, fit);
        for (int i = 1; i < NUM_RECOMPUTE_MODES; i++)
            if (fit[i].total_bytes <= budget)
                fprintf(out, "  -r %d%s on every layer: %.1f MiB (+%.1f%% predicted time)\n", fit[i].mode,
                        plan_layout_flags(spec, layout, sizeof(layout)), mib(fit[i].total_bytes), 100.0 * fit[i].extra_time_fraction);
    }
    if (spec->master_weights) {
        PlanSpec w0 = *spec;
        w0.master_weights = 0;
        if (plan_suggest(&w0, budget, 0, flag, sizeof(flag), &extra) == 0)
            fprintf(out, "  -w 0 %s: no fp32 master weights (%.1f MiB less; updates round to the storage precision), "
                    "+%.1f%% predicted time\n", flag, mib(plan_total_for(spec, -1, spec->B, spec->T) - plan_total_for(&w0, -1, spec->B, spec->T)), 100.0 * extra);
    }
    if (fits) return;
    int world = spec->world_size, N = plan_context_parallel(spec), any = 0;
    long long tokens = spec_grad_accum(spec) * plan_micro_step_tokens(spec, spec->B, world);
    /* the levers: this batch, this sequence, these processes */
    if (plan_suggest(spec, budget, 1, flag, sizeof(flag), &extra) == 0) {
        fprintf(out, "  %s: token tiles and segment checkpointing, keeping the batch and the sequence length (+%.1f%% predicted time)\n", flag, 100.0 * extra);
        any = 1;
    }
    if (world > 1 && spec->zero_stage == 0) {
        PlanSpec z = *spec;
        z.zero_stage = 1;
        if (plan_suggest(&z, budget, 1, flag, sizeof(flag), &extra) == 0) {
            fprintf(out, "  %s -z 1: ZeRO-1 shards the optimizer state over this run's %d processes (+%.1f%% predicted time)\n", flag,
                    world, 100.0 * extra);
            any = 1;
        }
    }
    for (int n = 2 * N; n <= world && !any; n *= 2) { /* more ring members: each holds T/n of a row */
        if (world % n || spec->T % (2 * n)) continue;
        for (int z = spec->zero_stage; z <= 1 && !any; z++) {
            PlanSpec ring = *spec;
            ring.zero_stage = z;
            plan_respread(&ring, spec->B, spec->T, world, n, tokens);
            if (plan_suggest(&ring, budget, 1, flag, sizeof(flag), &extra) != 0) continue;
            fprintf(out, "  %s --context-parallel %d%s -d %lld: each sequence shared by %d of this run's %d processes "
                    "(the same %lld tokens per step; +%.1f%% predicted time)\n", flag, n, z > spec->zero_stage ? " -z 1" : "", tokens, n,
                    world, tokens, 100.0 * extra);
            any = 1;
        }
    }
    if (any) return;
    /* what changes the run's shape: a smaller batch (the same tokens per
     * step), more processes, a shorter sequence */
    PlanSpec s = *spec;
    int b = plan_fitting_batch_keeping_tokens(&s, world, tokens, budget);
    if (b >= 1 && plan_suggest(&s, budget, 1, flag, sizeof(flag), &extra) == 0) {
        fprintf(out, "  %s -b %d -d %lld (the same %lld tokens per step, in more micro-steps)\n", flag, b, tokens, tokens);
        any = 1;
    }
    s = *spec;
    if (plan_fitting_length(&s, budget) >= 1 && plan_suggest(&s, budget, 1, flag, sizeof(flag), &extra) == 0) {
        fprintf(out, "  %s -t %d\n", flag, s.T);
        any = 1;
    }
    for (int n = 2 * world, sharded = 0; MULTIPROC_BUILT && n <= 4096 && !sharded; n *= 2) {
        int best_b = 0, best_ring = N; /* of the ring sizes on n processes, the one that keeps the largest batch */
        for (int ring = N; ring <= n; ring *= 2) {
            if (n % ring || (ring > 1 && spec->T % (2 * ring))) continue;
            s = *spec;
            s.zero_stage = 1;
            s.context_parallel = ring;
            int bn = plan_fitting_batch_keeping_tokens(&s, n, tokens, budget);
            if (bn > best_b && plan_suggest(&s, budget, 1, flag, sizeof(flag), &extra) == 0) { best_b = bn; best_ring = ring; }
        }
        if (!best_b) continue;
        s = *spec;
        s.zero_stage = 1;
        s.context_parallel = best_ring;
        plan_fitting_batch_keeping_tokens(&s, n, tokens, budget);
        plan_suggest(&s, budget, 1, flag, sizeof(flag), &extra);
        char batch[32] = "", ring[48] = "";
        if (best_b < spec->B) snprintf(batch, sizeof(batch), " -b %d", best_b);
        if (best_ring != N) snprintf(ring, sizeof(ring), " --context-parallel %d", best_ring);
        fprintf(out, "  %s%s%s -d %lld -z 1 across %d processes (ZeRO-1 shards the optimizer state%s)\n", flag, batch, ring, tokens, n,
                best_ring != N ? "; more processes share each sequence" : "");
        any = sharded = 1;
    }
    for (int n = 2 * world; !any && MULTIPROC_BUILT && n <= 4096; n *= 2) { /* shorter and sharded */
        s = *spec;
        s.world_size = n;
        s.zero_stage = 1;
        s.B = 1;
        if (plan_fitting_length(&s, budget) < 1 || plan_suggest(&s, budget, 1, flag, sizeof(flag), &extra) != 0) continue;
        fprintf(out, "  %s -b 1 -t %d -z 1 across %d processes (ZeRO-1 shards the optimizer state)\n", flag, s.T, n);
        any = 1;
    }
    if (!any) {
        int t_step = N > 1 ? 2 * N : 1; /* -t a multiple of 2N under CP */
        s = *spec;
        if (MULTIPROC_BUILT) { s.world_size = 4096; s.zero_stage = 1; }
        s.B = 1;
        s.T = t_step;
        size_t least = plan_least_layout(&s);
        fprintf(out, "  nothing at this model size: with -r 1%s -b 1 -t %d%s it still needs %s\n", plan_layout_flags(&s, layout, sizeof(layout)),
                t_step, MULTIPROC_BUILT ? " -z 1 across 4096 processes" : " (this build runs one process: no ZeRO-1)",
                format_size(least, size, sizeof(size)));
    }
}

#endif
