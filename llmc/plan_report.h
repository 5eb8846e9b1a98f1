/*
 * What the memory plan tells a user: --plan (a table), --plan-json (one JSON
 * object), -r auto (the cheapest per-layer recompute choice that fits a
 * budget), and the post-mortem printed when an allocation fails anyway.
 * All of it only computes; none of it allocates or needs a GPU.
 */
#ifndef REMAT_PLAN_REPORT_H
#define REMAT_PLAN_REPORT_H

#include "plan.h"
#include "cli.h"
#include <sys/resource.h>

/* Free device memory, set by the GPU trainer when a device is present; the
 * default budget for --plan and -r auto. NULL: use available host memory. */
static size_t (*remat_free_memory_hook)(void) = NULL;

/* Physical memory available now, or less when an address-space limit
 * (ulimit -v) leaves less room than that. */
static inline size_t available_host_memory(void) {
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    size_t avail = pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
    struct rlimit lim;
    if (getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
        size_t used = 0;
        FILE* f = fopen("/proc/self/statm", "r");
        unsigned long vm_pages = 0;
        if (f && fscanf(f, "%lu", &vm_pages) == 1 && page > 0) used = (size_t)vm_pages * (size_t)page;
        if (f) fclose(f);
        size_t room = (size_t)lim.rlim_cur > used ? (size_t)lim.rlim_cur - used : 0;
        if (room < avail) avail = room;
    }
    return avail;
}

/* --mem-budget if given, else free device memory (GPU), else available RAM. */
static inline size_t memory_budget(const char* flag_value, const char** source) {
    size_t b = parse_bytes("--mem-budget", flag_value);
    if (b) { *source = "--mem-budget"; return b; }
    if (remat_free_memory_hook) { *source = "free device memory"; return remat_free_memory_hook(); }
    *source = "available host memory";
    return available_host_memory();
}

/* The plan of `base` with every layer in `mode` (or base's own modes when
 * mode < 0), batch B and sequence length T. */
static inline size_t plan_total_for(const PlanSpec* base, int mode, int B, int T) {
    PlanSpec s = *base;
    unsigned char* modes = (unsigned char*)malloc_check((size_t)s.cfg.num_layers, "plan");
    for (int l = 0; l < s.cfg.num_layers; l++) modes[l] = (unsigned char)(mode < 0 ? plan_layer_mode(base, l) : mode);
    s.layer_mode = modes;
    s.B = B;
    s.T = T;
    MemoryPlan p;
    plan_build(&p, &s);
    size_t total = p.total_bytes;
    plan_free(&p);
    free(modes);
    return total;
}

/* Largest value in [1, hi] for which total(value) fits, by bisection (the
 * plan grows monotonically with B and with T); 0 when even 1 does not fit. */
static inline int plan_max_fitting(const PlanSpec* base, int mode, int vary_T, int hi, size_t budget) {
    int lo = 0;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        size_t t = vary_T ? plan_total_for(base, mode, base->B, mid) : plan_total_for(base, mode, mid, base->T);
        if (t <= budget) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

#define PLAN_MAX_BATCH (1 << 16)

typedef struct {
    int mode;
    size_t total_bytes;
    int max_batch, max_seq_len;
} ModeFit;

static inline void plan_mode_fits(const PlanSpec* spec, size_t budget, ModeFit fits[3]) {
    static const int order[3] = {RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL};
    for (int i = 0; i < 3; i++) {
        fits[i].mode = order[i];
        fits[i].total_bytes = plan_total_for(spec, order[i], spec->B, spec->T);
        fits[i].max_batch = budget ? plan_max_fitting(spec, order[i], 0, PLAN_MAX_BATCH, budget) : -1;
        fits[i].max_seq_len = budget ? plan_max_fitting(spec, order[i], 1, spec->cfg.max_seq_len, budget) : -1;
    }
}

/* ---- compute cost of recomputation (FLOP counts per token) ---- */

/* Forward FLOPs of one block per token at sequence length T: the four
 * matmuls (2 x 12 C^2) plus causal attention (QK^T and PV, 2 T C on average). */
static inline double block_forward_flops(const ModelConfig* c, int T) {
    double C = c->channels;
    return 24.0 * C * C + 2.0 * (double)T * C;
}

/* Extra FLOPs per token of a layer in `mode`: -r 1 reruns the block up to
 * the GELU (all but the last matmul), -r 2 only LayerNorm and GELU
 * elementwise work (about 30 FLOPs per channel). */
static inline double recompute_extra_flops(const ModelConfig* c, int T, int mode) {
    double C = c->channels;
    if (mode == RECOMPUTE_FULL) return block_forward_flops(c, T) - 8.0 * C * C;
    if (mode == RECOMPUTE_SELECTIVE) return 30.0 * 6.0 * C;
    return 0.0;
}

/* Forward + backward FLOPs per token of the whole model without recompute (3x forward). */
static inline double step_flops_per_token(const ModelConfig* c, int T) {
    return 3.0 * ((double)c->num_layers * block_forward_flops(c, T) + 2.0 * c->channels * (double)c->padded_vocab_size);
}

static inline double recompute_cost_fraction(const ModelConfig* c, int T, const unsigned char* modes) {
    double extra = 0.0;
    for (int l = 0; l < c->num_layers; l++) extra += recompute_extra_flops(c, T, modes[l]);
    return extra / step_flops_per_token(c, T);
}

/* ---- -r auto ---- */

/* Chooses per-layer modes for spec (B, T fixed) that fit budget with the
 * fewest extra FLOPs: layers switch to -r 2 first (it saves 6C elements per
 * token for almost no compute), then from -r 2 to -r 1, from layer 0 up,
 * one layer at a time, until the plan fits. Returns 0 and fills modes, or -1. */
static inline int recompute_auto(const PlanSpec* spec, size_t budget, unsigned char* modes) {
    int L = spec->cfg.num_layers;
    PlanSpec s = *spec;
    s.layer_mode = modes;
    memset(modes, RECOMPUTE_NONE, (size_t)L);
    if (plan_total_for(&s, -1, s.B, s.T) <= budget) return 0;
    for (int target = RECOMPUTE_SELECTIVE; target >= RECOMPUTE_FULL; target--)
        for (int l = 0; l < L; l++) {
            modes[l] = (unsigned char)target;
            if (plan_total_for(&s, -1, s.B, s.T) <= budget) return 0;
        }
    return -1;
}

/* Fewest ranks (up to 4096) with which ZeRO-1 and full recompute fit, or 0. */
static inline int plan_min_zero_ranks(const PlanSpec* spec, size_t budget) {
    PlanSpec s = *spec;
    s.zero_stage = 1;
    for (int n = 2; n <= 4096; n *= 2) {
        s.world_size = n;
        if (plan_total_for(&s, RECOMPUTE_FULL, s.B, s.T) <= budget) return n;
    }
    return 0;
}

/* What would fit instead, as flags; printed when the plan does not fit. */
static inline void plan_print_suggestions(const PlanSpec* spec, size_t budget, FILE* out) {
    fprintf(out, "what would fit in %.1f MiB:\n", mib(budget));
    size_t full = plan_total_for(spec, RECOMPUTE_FULL, spec->B, spec->T);
    if (full <= budget) {
        fprintf(out, "  -r auto (the cheapest recompute that fits), or -r 1 on every layer: %.1f MiB\n", mib(full));
        return;
    }
    int b = plan_max_fitting(spec, RECOMPUTE_FULL, 0, spec->B, budget);
    int t = plan_max_fitting(spec, RECOMPUTE_FULL, 1, spec->T, budget);
    int ranks = plan_min_zero_ranks(spec, budget);
    if (b >= 1) fprintf(out, "  -r 1 -b %d (keep the tokens per step with -d: gradient accumulation)\n", b);
    if (t >= 1) fprintf(out, "  -r 1 -t %d\n", t);
    if (ranks) fprintf(out, "  -r 1 -z 1 across %d processes (ZeRO-1 shards the optimizer state)\n", ranks);
    if (b < 1 && t < 1 && !ranks) fprintf(out, "  nothing at this model size: the parameters alone need more\n");
}

/* ---- --plan and --plan-json ---- */

static inline const char* mode_flag(int mode) { return mode == RECOMPUTE_FULL ? "1" : mode == RECOMPUTE_SELECTIVE ? "2" : "0"; }

/* Activation bytes summed over layers for each tensor kind. */
static inline void plan_activation_by_tensor(const MemoryPlan* p, size_t by_act[NUM_LAYER_ACTS]) {
    memset(by_act, 0, NUM_LAYER_ACTS * sizeof(size_t));
    for (int i = 0; i < p->num_entries; i++) {
        const PlanEntry* e = &p->entries[i];
        if (e->section != SEC_ACTIVATIONS || e->layer < 0) continue;
        const char* dot = strchr(e->name, '.');
        for (int a = 0; dot && a < NUM_LAYER_ACTS; a++)
            if (strcmp(dot + 1, layer_act_names[a]) == 0) by_act[a] += e->bytes;
    }
}

static inline void plan_print_table(const MemoryPlan* p, size_t budget, const char* budget_source, FILE* out) {
    const PlanSpec* s = &p->spec;
    plan_print_summary(p, out);
    size_t by_act[NUM_LAYER_ACTS];
    plan_activation_by_tensor(p, by_act);
    fprintf(out, "activations by tensor (all layers):\n");
    for (int a = 0; a < NUM_LAYER_ACTS; a++)
        if (by_act[a]) fprintf(out, "  %-16s %12.1f MiB\n", layer_act_names[a], mib(by_act[a]));
    fprintf(out, "other buffers:\n");
    for (int i = 0; i < p->num_entries; i++)
        if (p->entries[i].layer < 0 && p->entries[i].section >= SEC_ACTIVATIONS)
            fprintf(out, "  %-24s %-11s %10.1f MiB\n", p->entries[i].name, plan_section_names[p->entries[i].section], mib(p->entries[i].bytes));
    ModeFit fits[3];
    plan_mode_fits(s, budget, fits);
    if (budget) fprintf(out, "fit in %.1f MiB (%s), all layers in one mode:\n", mib(budget), budget_source);
    else fprintf(out, "all layers in one mode (no budget known: give --mem-budget):\n");
    fprintf(out, "  %-6s %14s %6s %10s %10s\n", "mode", "total MiB", "fits", "max -b", "max -t");
    for (int i = 0; i < 3; i++) {
        double cost = 0.0;
        unsigned char* m = (unsigned char*)malloc_check((size_t)s->cfg.num_layers, "plan");
        memset(m, fits[i].mode, (size_t)s->cfg.num_layers);
        cost = recompute_cost_fraction(&s->cfg, s->T, m);
        free(m);
        if (budget)
            fprintf(out, "  -r %-3s %14.1f %6s %10d %10d   +%.0f%% compute\n", mode_flag(fits[i].mode), mib(fits[i].total_bytes),
                    fits[i].total_bytes <= budget ? "yes" : "no", fits[i].max_batch, fits[i].max_seq_len, 100.0 * cost);
        else
            fprintf(out, "  -r %-3s %14.1f %6s %10s %10s   +%.0f%% compute\n", mode_flag(fits[i].mode), mib(fits[i].total_bytes), "?", "?", "?", 100.0 * cost);
    }
}

static inline void plan_print_json(const MemoryPlan* p, size_t budget, FILE* out) {
    const PlanSpec* s = &p->spec;
    const ModelConfig* c = &s->cfg;
    fprintf(out, "{\"config\": {\"num_layers\": %d, \"num_heads\": %d, \"channels\": %d, \"vocab_size\": %d, "
                 "\"padded_vocab_size\": %d, \"max_seq_len\": %d, \"num_parameters\": %zu}, ",
            c->num_layers, c->num_heads, c->channels, c->vocab_size, c->padded_vocab_size, c->max_seq_len, p->num_params);
    fprintf(out, "\"batch\": %d, \"seq_len\": %d, \"elem_bytes\": %d, \"world_size\": %d, \"zero_stage\": %d, ",
            s->B, s->T, s->elem_bytes, s->world_size, s->zero_stage);
    fprintf(out, "\"layer_modes\": [");
    for (int l = 0; l < c->num_layers; l++) fprintf(out, "%s%d", l ? ", " : "", s->layer_mode[l]);
    fprintf(out, "], \"total_bytes\": %zu, \"components\": {", p->total_bytes);
    for (int i = 0; i < NUM_SECTIONS; i++) fprintf(out, "%s\"%s\": %zu", i ? ", " : "", plan_section_names[i], p->section_bytes[i]);
    size_t by_act[NUM_LAYER_ACTS];
    plan_activation_by_tensor(p, by_act);
    fprintf(out, "}, \"activations_by_tensor\": {");
    for (int a = 0, first = 1; a < NUM_LAYER_ACTS; a++)
        if (by_act[a]) { fprintf(out, "%s\"%s\": %zu", first ? "" : ", ", layer_act_names[a], by_act[a]); first = 0; }
    fprintf(out, "}, \"activation_bytes_per_token_per_layer\": {\"0\": %zu, \"2\": %zu, \"1\": %zu}, ",
            plan_layer_bytes_per_token(s, RECOMPUTE_NONE), plan_layer_bytes_per_token(s, RECOMPUTE_SELECTIVE),
            plan_layer_bytes_per_token(s, RECOMPUTE_FULL));
    fprintf(out, "\"buffers\": [");
    for (int i = 0; i < p->num_entries; i++)
        fprintf(out, "%s{\"name\": \"%s\", \"section\": \"%s\", \"bytes\": %zu}", i ? ", " : "", p->entries[i].name,
                plan_section_names[p->entries[i].section], p->entries[i].bytes);
    ModeFit fits[3];
    plan_mode_fits(s, budget, fits);
    fprintf(out, "], \"budget_bytes\": %zu, \"modes\": [", budget);
    for (int i = 0; i < 3; i++) {
        fprintf(out, "%s{\"recompute\": \"%s\", \"total_bytes\": %zu, ", i ? ", " : "", mode_flag(fits[i].mode), fits[i].total_bytes);
        if (budget) fprintf(out, "\"fits\": %s, \"max_batch\": %d, \"max_seq_len\": %d}", fits[i].total_bytes <= budget ? "true" : "false",
                            fits[i].max_batch, fits[i].max_seq_len);
        else fprintf(out, "\"fits\": null, \"max_batch\": null, \"max_seq_len\": null}");
    }
    fprintf(out, "]}\n");
}

/* Printed when allocating the plan fails: the plan, what was free, what would fit. */
static inline void plan_oom_report(const MemoryPlan* p, size_t free_bytes, const char* where) {
    fflush(stdout);
    fprintf(stderr, "out of memory on the %s: the plan needs %.1f MiB, %.1f MiB free\n", where, mib(p->total_bytes), mib(free_bytes));
    plan_print_summary(p, stderr);
    plan_print_suggestions(&p->spec, free_bytes, stderr);
}

#endif
