/*
 * What the memory plan tells a user: --plan (a table), --plan-json (one JSON
 * object) and the post-mortem printed when an allocation fails anyway. The
 * budgets are budget.h's, -r auto and the suggestions plan_search.h's. All
 * of it only computes; none of it allocates or needs a GPU.
 */
#ifndef REMAT_PLAN_REPORT_H
#define REMAT_PLAN_REPORT_H

#include "budget.h"
#include "cost_model.h"
#include "plan.h"
#include "plan_search.h"
#include "../core/token_layout.h"

/* ---- --plan and --plan-json ---- */

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

/* The context-parallel ring: its buffers, its time in the step, and the
 * alternative of keeping the forward's K/V blocks for backward. */
static inline void plan_print_ring(const MemoryPlan* p, const CostModel* cm, FILE* out) {
    const PlanSpec* s = &p->spec;
    int N = plan_context_parallel(s), L = s->cfg.num_layers, micro = spec_grad_accum(s);
    size_t kv = plan_ring_kv_bytes(s), dkv = plan_ring_dkv_bytes(s);
    double fwd = ring_forward_seconds(s, cm), bwd = ring_backward_seconds(s, cm);
    double all = ring_step_seconds(s, cm, s->layer_mode);
    RingLink link = spec_ring_link(s);
    fprintf(out, "  ring (context parallel %d, link %s: %.3g B/s, %.3g s a message): K/V block %.1f MiB, dK/dV block %.1f MiB; "
                 "%d transfers of K/V and %d of dK/dV per layer and micro-step\n", N, link.name, link.bytes_per_s,
            link.latency_s, mib(kv), mib(dkv), 2 * (N - 1), N);
    fprintf(out, "  ring time not hidden by attention: forward %.3f ms, backward %.3f ms per layer; %.1f ms of the step\n",
            1e3 * fwd, 1e3 * bwd, 1e3 * all);
    double saved = (N - 1) * (ring_transfer_seconds(s, kv) - 2.5 * attention_forward_flops(s) / attention_backward_rate(cm) / N);
    fprintf(out, "  alternative, K/V kept from the forward instead of circulated again: +%.1f MiB per layer (%.1f MiB for %d layers), "
                 "saves at most %.1f ms per step\n", mib(size_mul_sat((size_t)(N - 1), kv)),
            mib(size_mul_sat(size_mul_sat((size_t)(N - 1), kv), (size_t)L)), L, saved > 0 ? 1e3 * saved * L * micro : 0.0);
}

/* --plan-doc-len under the ring: each member's share of the attended pairs
 * of documents of doc_len tokens packed from position 0, with the zigzag
 * chunks and with the chunks paired by their work as the loader pairs them
 * (spec_ring_pairing). */
static inline void plan_print_ring_shares(const PlanSpec* s, FILE* out) {
    int N = plan_context_parallel(s);
    int64_t* work;
    int* chunks;
    int moved = spec_ring_pairing(s, &work, &chunks);
    char zigzag[1024], paired[1024];
    double busiest_zigzag = ring_member_shares(work, NULL, N, zigzag, sizeof(zigzag));
    double busiest = ring_member_shares(work, chunks, N, paired, sizeof(paired));
    fprintf(out, "  ring members' shares of the attended pairs: %s with the zigzag chunks (the busiest %.3fx the mean)", zigzag, busiest_zigzag);
    if (moved) fprintf(out, ", %s paired by their work (%.3fx)\n", paired, busiest);
    else fprintf(out, ", no pairing does better\n");
    free(work);
}

/* The plan's own mix: its -r flag, predicted step time and extra time. */
/* --offload-optimizer's share of a step of t seconds: each part's time and
 * what the step does not hide of them (cost_model.h, optimizer_offload_seconds). */
static inline void plan_print_optimizer_time(const PlanSpec* s, const CostModel* cm, double t, FILE* out) {
    OptimizerOffloadSeconds o = optimizer_offload_seconds(s, cm);
    fprintf(out, "  optimizer offloaded: gradients down %.3g ms, host AdamW %.3g ms (host memory %.3g B/s), parameters up %.3g ms; "
            "%.3g ms not hidden (%.1f%% of the step)%s\n", 1e3 * o.down, 1e3 * o.adamw, cm->host_memory_bytes_per_s, 1e3 * o.up,
            1e3 * o.exposed, 100.0 * o.exposed / t,
            s->backend == BACKEND_CPU ? ": on the CPU trainer all of it runs in line"
            : s->world_size <= 1      ? ": the copy down behind the backward, AdamW and the copies up behind the next forward, layer by layer"
                                      : ": the copy down after the backward, then AdamW with the copies up behind it");
}

static inline void plan_print_chosen_time(const MemoryPlan* p, FILE* out) {
    const PlanSpec* s = &p->spec;
    CostModel cm = spec_cost_model(s);
    char flag[8192];
    double extra = 0.0;
    format_recompute_flag(s->layer_mode, s->layer_offload, s->cfg.num_layers, flag, sizeof(flag));
    double t = plan_predicted_seconds(s, NULL, &extra);
    char tiles[96] = "";
    size_t used = 0;
    if (s->tile_tokens > 0) used = (size_t)snprintf(tiles, sizeof(tiles), " --tile-tokens %d", s->tile_tokens);
    if (plan_segment_layers(s) > 1) snprintf(tiles + used, sizeof(tiles) - used, " --segment-layers %d", plan_segment_layers(s));
    fprintf(out, "this run, -r %s%s: predicted %.1f ms per step (%d micro-step%s), +%.1f%% over -r 0\n", flag, tiles, 1e3 * t,
            spec_grad_accum(s), spec_grad_accum(s) == 1 ? "" : "s", 100.0 * extra);
    fprintf(out, "  cost model %s: matmul %.3g FLOP/s, attention %.3g FLOP/s, memory %.3g B/s, host link %.3g B/s\n", cm.name,
            cm.matmul_flops_per_s, cm.attention_flops_per_s, cm.memory_bytes_per_s, cm.host_link_bytes_per_s);
    if (s->offload_optimizer) plan_print_optimizer_time(s, &cm, t, out);
    if (matmul_backward_rate(&cm) != cm.matmul_flops_per_s || attention_backward_rate(&cm) != cm.attention_flops_per_s ||
        gelu_rate(&cm) != cm.memory_bytes_per_s)
        fprintf(out, "  rates of their own: backward matmuls %.3g FLOP/s, attention backward %.3g FLOP/s, GELU %.3g B/s\n",
                matmul_backward_rate(&cm), attention_backward_rate(&cm), gelu_rate(&cm));
    fprintf(out, "  token tiles: %.3g s per pass over a tile, matmuls at half rate at %.3g rows\n", cm.tile_pass_s, cm.matmul_half_rows);
    if (s->doc_len > 0 && s->doc_len < s->T)
        fprintf(out, "  packed documents of %d tokens (--plan-doc-len): attention attends %.3g%% of the causal pairs\n", s->doc_len,
                100.0 * spec_attended_pairs(s) / ((double)s->T * (s->T + 1.0) / 2.0));
    if (plan_context_parallel(s) > 1 && s->doc_len > 0) plan_print_ring_shares(s, out);
    if (plan_context_parallel(s) > 1) plan_print_ring(p, &cm, out);
}

/* The plan at each segment size K = 1 to L with the spec's own modes and
 * offloading: device and host bytes and predicted step time. */
typedef struct {
    int K;
    size_t total_bytes, host_bytes;
    double step_seconds, extra_time_fraction;
} SegmentFit;

static inline SegmentFit plan_segment_fit(const PlanSpec* spec, int K) {
    PlanSpec s = *spec;
    s.segment_layers = K;
    SegmentFit f = {K, 0, 0, 0.0, 0.0};
    f.total_bytes = plan_totals_for(&s, -1, s.B, s.T, &f.host_bytes);
    f.step_seconds = plan_predicted_seconds_offload(&s, NULL, NULL, &f.extra_time_fraction);
    return f;
}

static inline void plan_print_segments(const PlanSpec* s, size_t budget, size_t host_budget, FILE* out) {
    int L = s->cfg.num_layers;
    char flag[8192];
    format_recompute_flag(s->layer_mode, NULL, L, flag, sizeof(flag));
    fprintf(out, "segments (--segment-layers K with -r %s%s):\n", flag, plan_segment_layers(s) > 1 && s->layer_offload[0] ? " --offload-checkpoints" : "");
    fprintf(out, "  %-6s %14s %12s %6s %12s %10s\n", "K", "total MiB", "host MiB", "fits", "step ms", "time");
    for (int K = 1; K <= L; K++) {
        SegmentFit f = plan_segment_fit(s, K);
        const char* fits = !budget ? "?" : f.total_bytes <= budget && (!f.host_bytes || f.host_bytes <= host_budget) ? "yes" : "no";
        fprintf(out, "  %-6d %14.1f %12.1f %6s %12.1f %+9.1f%%%s\n", K, mib(f.total_bytes), mib(f.host_bytes), fits, 1e3 * f.step_seconds,
                100.0 * f.extra_time_fraction, K == plan_segment_layers(s) ? "  <- this run" : "");
    }
}

static inline void plan_print_table(const MemoryPlan* p, size_t budget, const char* budget_source, size_t host_budget,
                                    const char* host_source, FILE* out) {
    const PlanSpec* s = &p->spec;
    plan_print_summary(p, out);
    if (remat_nccl_device_bytes)
        fprintf(out, "NCCL: %.1f MiB of device memory (communicators and their connection buffers, connected before the budget was "
                "measured), outside the plan and the budget\n", mib(remat_nccl_device_bytes));
    if (p->host_total_bytes) {
        char need[32], have[32];
        fprintf(out, "host memory for %s: %s of %s (%s): %s\n", plan_host_pool_contents(p), format_size(p->host_total_bytes, need, sizeof(need)),
                format_size(host_budget, have, sizeof(have)), host_source, p->host_total_bytes <= host_budget ? "fits" : "does not fit");
    }
    size_t by_act[NUM_LAYER_ACTS];
    plan_activation_by_tensor(p, by_act);
    fprintf(out, "activations by tensor (all layers):\n");
    for (int a = 0; a < NUM_LAYER_ACTS; a++)
        if (by_act[a]) fprintf(out, "  %-16s %12.1f MiB\n", layer_act_names[a], mib(by_act[a]));
    fprintf(out, "other buffers:\n");
    for (int i = 0; i < p->num_entries; i++)
        if (p->entries[i].layer < 0 && p->entries[i].section >= SEC_ACTIVATIONS)
            fprintf(out, "  %-24s %-11s %10.1f MiB\n", p->entries[i].name, plan_section_names[p->entries[i].section], mib(p->entries[i].bytes));
    ModeFit fits[NUM_RECOMPUTE_MODES];
    plan_mode_fits(s, budget, fits);
    if (budget) fprintf(out, "fit in %.1f MiB (%s), all layers in one mode:\n", mib(budget), budget_source);
    else fprintf(out, "all layers in one mode (no budget known: give --mem-budget):\n");
    fprintf(out, "  %-6s %14s %6s %10s %10s %12s %10s\n", "mode", "total MiB", "fits", "max -b", "max -t", "step ms", "time");
    for (int i = 0; i < NUM_RECOMPUTE_MODES; i++) {
        char fit[8] = "?", mb[16] = "?", mt[16] = "?";
        if (budget) {
            snprintf(fit, sizeof(fit), "%s", fits[i].total_bytes <= budget ? "yes" : "no");
            snprintf(mb, sizeof(mb), "%d", fits[i].max_batch);
            snprintf(mt, sizeof(mt), "%d", fits[i].max_seq_len);
        }
        fprintf(out, "  -r %-3d %14.1f %6s %10s %10s %12.1f %+9.1f%%\n", fits[i].mode, mib(fits[i].total_bytes), fit, mb, mt,
                1e3 * fits[i].step_seconds, 100.0 * fits[i].extra_time_fraction);
    }
    plan_print_segments(s, budget, host_budget, out);
    plan_print_chosen_time(p, out);
}

/* host_budget 0: not asked for (no offloading in sight), printed as null. */
static inline void plan_print_json(const MemoryPlan* p, size_t budget, size_t host_budget, FILE* out) {
    const PlanSpec* s = &p->spec;
    const ModelConfig* c = &s->cfg;
    fprintf(out, "{\"config\": {\"num_layers\": %d, \"num_heads\": %d, \"channels\": %d, \"vocab_size\": %d, "
                 "\"padded_vocab_size\": %d, \"max_seq_len\": %d, \"num_parameters\": %zu}, ",
            c->num_layers, c->num_heads, c->channels, c->vocab_size, c->padded_vocab_size, c->max_seq_len, p->num_params);
    fprintf(out, "\"batch\": %d, \"seq_len\": %d, \"elem_bytes\": %d, \"world_size\": %d, \"zero_stage\": %d, \"grad_accum\": %d, ",
            s->B, s->T, s->elem_bytes, s->world_size, s->zero_stage, spec_grad_accum(s));
    char flag[8192];
    format_recompute_flag(s->layer_mode, s->layer_offload, c->num_layers, flag, sizeof(flag));
    /* with the run's other flags, these reproduce the plan: what -r auto chose, or what was given */
    fprintf(out, "\"flags\": \"-r %s --tile-tokens %d --segment-layers %d%s\", ", flag, s->tile_tokens, plan_segment_layers(s),
            s->offload_optimizer ? " --offload-optimizer" : "");
    CostModel ocm = spec_cost_model(s);
    OptimizerOffloadSeconds oo = optimizer_offload_seconds(s, &ocm);
    fprintf(out, "\"offload_optimizer\": %d, \"optimizer_offload_seconds\": {\"down\": %.9g, \"adamw\": %.9g, \"up\": %.9g, "
                 "\"exposed\": %.9g}, \"host_components\": {", s->offload_optimizer, oo.down, oo.adamw, oo.up, oo.exposed);
    for (int i = 0; i < NUM_SECTIONS; i++) fprintf(out, "%s\"%s\": %zu", i ? ", " : "", plan_section_names[i], p->host_section_bytes[i]);
    fprintf(out, "}, ");
    fprintf(out, "\"recompute\": \"%s\", \"layer_modes\": [", flag);
    for (int l = 0; l < c->num_layers; l++) fprintf(out, "%s%d", l ? ", " : "", s->layer_mode[l]);
    fprintf(out, "], \"layer_offload\": [");
    for (int l = 0; l < c->num_layers; l++) fprintf(out, "%s%d", l ? ", " : "", s->layer_offload[l]);
    fprintf(out, "], \"tile_tokens\": %d, \"segment_layers\": %d, \"segments\": [", s->tile_tokens, plan_segment_layers(s));
    for (int K = 1; K <= c->num_layers; K++) {
        SegmentFit f = plan_segment_fit(s, K);
        fprintf(out, "%s{\"segment_layers\": %d, \"total_bytes\": %zu, \"host_total_bytes\": %zu, \"predicted_step_seconds\": %.9g, "
                     "\"predicted_extra_time_fraction\": %.9g}", K > 1 ? ", " : "", K, f.total_bytes, f.host_bytes, f.step_seconds,
                f.extra_time_fraction);
    }
    fprintf(out, "], \"host_total_bytes\": %zu, \"host_budget_bytes\": ", p->host_total_bytes);
    if (host_budget) fprintf(out, "%zu", host_budget);
    else fprintf(out, "null");
    fprintf(out, ", \"staging_slots\": %d, \"staging_bytes\": %zu, \"host_buffers\": [", p->staging_slots, p->staging_bytes);
    for (int i = 0; i < p->num_host_entries; i++)
        fprintf(out, "%s{\"name\": \"%s\", \"bytes\": %zu}", i ? ", " : "", p->host_entries[i].name, p->host_entries[i].bytes);
    fprintf(out, "], \"total_bytes\": %zu, \"components\": {", p->total_bytes);
    for (int i = 0; i < NUM_SECTIONS; i++) fprintf(out, "%s\"%s\": %zu", i ? ", " : "", plan_section_names[i], p->section_bytes[i]);
    size_t by_act[NUM_LAYER_ACTS];
    plan_activation_by_tensor(p, by_act);
    fprintf(out, "}, \"activations_by_tensor\": {");
    for (int a = 0, first = 1; a < NUM_LAYER_ACTS; a++)
        if (by_act[a]) { fprintf(out, "%s\"%s\": %zu", first ? "" : ", ", layer_act_names[a], by_act[a]); first = 0; }
    fprintf(out, "}, \"activation_bytes_per_token_per_layer\": {");
    for (int i = 0; i < NUM_RECOMPUTE_MODES; i++)
        fprintf(out, "%s\"%d\": %zu", i ? ", " : "", mode_order[i], plan_layer_bytes_per_token(s, mode_order[i]));
    fprintf(out, "}, \"buffers\": [");
    for (int i = 0; i < p->num_entries; i++)
        fprintf(out, "%s{\"name\": \"%s\", \"section\": \"%s\", \"bytes\": %zu}", i ? ", " : "", p->entries[i].name,
                plan_section_names[p->entries[i].section], p->entries[i].bytes);
    CostModel cm = spec_cost_model(s);
    double extra = 0.0, secs = plan_predicted_seconds(s, NULL, &extra);
    fprintf(out, "], \"cost_model\": {\"name\": \"");
    for (const char* q = cm.name; *q; q++) fprintf(out, *q == '"' || *q == '\\' ? "\\%c" : "%c", *q);
    fprintf(out, "\", \"matmul_flops_per_s\": %.6g, \"attention_flops_per_s\": %.6g, \"memory_bytes_per_s\": %.6g, \"host_link_bytes_per_s\": %.6g, "
                 "\"tile_pass_s\": %.6g, \"matmul_half_rows\": %.6g, \"matmul_backward_flops_per_s\": %.6g, \"attention_backward_flops_per_s\": %.6g, "
                 "\"gelu_bytes_per_s\": %.6g, \"host_memory_bytes_per_s\": %.6g}, ", cm.matmul_flops_per_s, cm.attention_flops_per_s, cm.memory_bytes_per_s,
            cm.host_link_bytes_per_s, cm.tile_pass_s, cm.matmul_half_rows, matmul_backward_rate(&cm), attention_backward_rate(&cm), gelu_rate(&cm),
            cm.host_memory_bytes_per_s);
    fprintf(out, "\"predicted_step_seconds\": %.9g, \"predicted_extra_time_fraction\": %.9g, ", secs, extra);
    RingLink link = spec_ring_link(s);
    fprintf(out, "\"context_parallel\": %d, \"ring_link\": \"%s\", \"ring_link_bytes_per_s\": %.6g, \"ring_link_latency_s\": %.6g, "
                 "\"ring_forward_seconds_per_layer\": %.9g, \"ring_backward_seconds_per_layer\": %.9g, \"predicted_ring_seconds\": %.9g, ",
            plan_context_parallel(s), link.name, link.bytes_per_s, link.latency_s, ring_forward_seconds(s, &cm), ring_backward_seconds(s, &cm),
            ring_step_seconds(s, &cm, s->layer_mode));
    ModeFit fits[NUM_RECOMPUTE_MODES];
    plan_mode_fits(s, budget, fits);
    fprintf(out, "\"budget_bytes\": %zu, \"modes\": [", budget);
    for (int i = 0; i < NUM_RECOMPUTE_MODES; i++) {
        fprintf(out, "%s{\"recompute\": \"%d\", \"total_bytes\": %zu, \"predicted_step_seconds\": %.9g, "
                     "\"predicted_extra_time_fraction\": %.9g, ", i ? ", " : "", fits[i].mode, fits[i].total_bytes,
                fits[i].step_seconds, fits[i].extra_time_fraction);
        if (budget) fprintf(out, "\"fits\": %s, \"max_batch\": %d, \"max_seq_len\": %d}", fits[i].total_bytes <= budget ? "true" : "false",
                            fits[i].max_batch, fits[i].max_seq_len);
        else fprintf(out, "\"fits\": null, \"max_batch\": null, \"max_seq_len\": null}");
    }
    fprintf(out, "]}\n");
}

/* Printed when allocating the plan fails: the plan, what was free, what would fit. */
static inline void plan_oom_report(const MemoryPlan* p, size_t free_bytes, const char* where) {
    fflush(stdout);
    char need[32], have[32];
    fprintf(stderr, "out of memory on the %s: the plan needs %s, %s free\n", where, format_size(p->total_bytes, need, sizeof(need)),
            format_size(free_bytes, have, sizeof(have)));
    plan_print_summary(p, stderr);
    plan_print_suggestions(&p->spec, free_bytes, stderr);
}

#endif
