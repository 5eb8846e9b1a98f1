/*
 * The memory plan against closed-form counts written out independently here
 * (docs/DESIGN.md's tables), for several shapes, precisions, recompute settings
 * and ZeRO ranks; and the CPU trainer's allocation against the plan.
 */
#include <malloc.h>
#define REMAT_NO_MAIN
#include "../../train_gpt.c"
#include "test_model.h"

static int failures = 0;

static void expect_eq(const char* what, size_t got, size_t want) {
    if (got != want) { printf("  FAIL %s: plan %zu, closed form %zu\n", what, got, want); failures++; }
}

static size_t align256(size_t b) { return (b + 255) / 256 * 256; }

/* Elements per token per layer kept by each mode (docs/DESIGN.md). */
static size_t closed_layer_bytes(int mode, size_t C, size_t NH, size_t E, size_t S) {
    if (mode == RECOMPUTE_FULL) return C * E;
    if (mode == RECOMPUTE_KEEP_ATTENTION) return 2 * C * E + NH * S; /* x, attention output, logsumexp */
    if (mode == RECOMPUTE_SELECTIVE) return 10 * C * E + (4 + NH) * S;
    return 16 * C * E + (4 + NH) * S;
}

static void check(const char* name, ModelConfig cfg, int B, int T, int E, int world, int zero, const unsigned char* modes) {
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    s.cfg = cfg; s.B = B; s.T = T; s.backend = BACKEND_CPU; s.elem_bytes = E; s.stat_bytes = 4;
    s.world_size = world; s.zero_stage = zero; s.layer_mode = modes; s.logits_chunk_rows = 256; s.io_chunk_floats = 1 << 18;
    MemoryPlan p;
    plan_build(&p, &s);
    size_t C = (size_t)cfg.channels, L = (size_t)cfg.num_layers, NH = (size_t)cfg.num_heads, BT = (size_t)B * T;
    size_t P = (size_t)cfg.padded_vocab_size * C + (size_t)cfg.max_seq_len * C + L * (12 * C * C + 13 * C) + 2 * C;
    size_t shard = zero ? (P + (size_t)world - 1) / (size_t)world : P;
    int any_full = 0, any_sel = 0, any_keep_att = 0;
    size_t layer_bytes = 0;
    for (size_t l = 0; l < L; l++) {
        int mode = modes ? modes[l] : 0;
        any_full |= mode == RECOMPUTE_FULL;
        any_sel |= mode == RECOMPUTE_SELECTIVE;
        any_keep_att |= mode == RECOMPUTE_KEEP_ATTENTION;
        layer_bytes += BT * closed_layer_bytes(mode, C, NH, (size_t)E, 4);
    }
    printf("%-34s P=%zu  layers %.1f MiB  total %.1f MiB\n", name, P, mib(layer_bytes), mib(p.total_bytes));
    expect_eq("parameter count", p.num_params, P);
    expect_eq("parameters", p.section_bytes[SEC_PARAMETERS], align256(P * (size_t)E));
    expect_eq("gradients", p.section_bytes[SEC_GRADIENTS], align256(P * (size_t)E));
    expect_eq("optimizer", p.section_bytes[SEC_OPTIMIZER], 2 * align256(shard * 4));
    expect_eq("per-layer activations", plan_layer_activation_bytes(&p), layer_bytes);
    for (int mode = 0; mode < 4; mode++)
        expect_eq("bytes per token per layer", plan_layer_bytes_per_token(&s, mode), closed_layer_bytes(mode, C, NH, (size_t)E, 4));
    size_t recompute_set = 0;
    if (any_full) recompute_set = BT * (15 * C * (size_t)E + (4 + NH) * 4);
    else if (any_keep_att) recompute_set = BT * (14 * C * (size_t)E + 4 * 4); /* all but x, atty, lse */
    else if (any_sel) recompute_set = BT * 6 * C * (size_t)E;
    size_t planned_set = 0, sections = 0;
    for (int i = 0; i < p.num_entries; i++)
        if (strncmp(p.entries[i].name, "recompute.", 10) == 0) planned_set += p.entries[i].bytes;
    for (int i = 0; i < NUM_SECTIONS; i++) sections += p.section_bytes[i];
    expect_eq("shared recompute set", planned_set, recompute_set);
    expect_eq("sections add up to the total", sections, p.total_bytes);
    plan_free(&p);
}

/* The CPU trainer allocates exactly the plan: one arena of total_bytes, and
 * every pointer it hands out lies inside it. */
static void check_allocation(void) {
    unsigned char modes[3] = {1, 0, 2};
    TestModel tm;
    test_model_create(&tm, test_config(3, 2, 32, 50, 16), 2, 16, modes);
    size_t usable = malloc_usable_size(tm.m.arena), total = tm.plan.total_bytes;
    printf("allocation: plan %zu bytes, arena usable %zu bytes\n", total, usable);
    if (usable < total || usable > total + 4096) { printf("  FAIL arena size\n"); failures++; }
    char* lo = tm.m.arena;
    char* hi = lo + total;
    for (int i = 0; i < tm.plan.num_entries; i++) {
        char* e = lo + tm.plan.entries[i].offset;
        if (e < lo || e + tm.plan.entries[i].bytes > hi) { printf("  FAIL entry %s outside arena\n", tm.plan.entries[i].name); failures++; }
        if (i > 0 && tm.plan.entries[i].offset < tm.plan.entries[i - 1].offset + tm.plan.entries[i - 1].bytes) {
            printf("  FAIL entry %s overlaps %s\n", tm.plan.entries[i].name, tm.plan.entries[i - 1].name);
            failures++;
        }
    }
    test_model_free(&tm);
}

/* The configurable block's widths in the plan, against numbers written out
 * here from Llama 3.1 8B's config.json (C 4096, 32 heads, 8 K/V heads of
 * 128, intermediate 14336, V 128256, untied): per token in bf16, qkv
 * (32 + 16) x 128, atty 32 x 128, fch 2 x 14336 (gate, up), the product
 * 14336; the ring's K/V block 2 x 8 x 128 per token (a quarter of
 * copying K/V to all 32 heads); 8,030,261,248 parameters. */
static void check_llama_widths(void) {
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    if (config_from_descriptor("llama3.1-8b", &s.cfg) != 0) { printf("  FAIL preset llama3.1-8b unknown\n"); failures++; return; }
    s.B = 1; s.T = 1024; s.backend = BACKEND_GPU; s.elem_bytes = 2; s.stat_bytes = 4; s.world_size = 2; s.context_parallel = 2;
    s.logits_chunk_rows = 64; s.io_chunk_floats = 1024;
    size_t tokens = 512; /* this rank's half of the sequence */
    expect_eq("llama3.1-8b qkv bytes", plan_act_bytes(&s, ACT_QKV), tokens * 48 * 128 * 2);
    expect_eq("llama3.1-8b atty bytes", plan_act_bytes(&s, ACT_ATTY), tokens * 4096 * 2);
    expect_eq("llama3.1-8b fch bytes", plan_act_bytes(&s, ACT_FCH), tokens * 2 * 14336 * 2);
    expect_eq("llama3.1-8b fch_gelu bytes", plan_act_bytes(&s, ACT_FCH_GELU), tokens * 14336 * 2);
    expect_eq("llama3.1-8b ring K/V block", plan_ring_kv_bytes(&s), tokens * 2 * 8 * 128 * 2);
    ParamLayout pl;
    param_layout(&s.cfg, &pl);
    expect_eq("llama3.1-8b parameters", pl.total, (size_t)8030261248ULL);
    expect_eq("llama3.1-8b has no position table", pl.count[P_WPE], 0);
    expect_eq("llama3.1-8b lm_head", pl.count[P_LMHEAD], (size_t)128256 * 4096);
}

static void expect_work(const char* what, double got, double want) {
    if (!(fabs(got - want) <= 1e-12 * fabs(want))) { printf("  FAIL %s: time model %.17g, by hand %.17g\n", what, got, want); failures++; }
}

/* The time model's work of one Llama 3.1 8B layer at T = 4096, B = 1 (bf16,
 * no context parallelism), counted here from the block: matmuls 2 C x (QKV
 * 48 x 128 + O 4096 + gate/up 2 x 14336 + down 14336) per token; attention
 * 4 x 32 query heads x 128 per causal pair (T(T+1)/2), the K/V heads shared,
 * backward 2.5x; bytes: two RMSNorms 4C forward and 8C backward, SwiGLU 3F
 * forward (2F read, F written) and 5F backward (2F and F read, 2F written),
 * at GELU's rate, RoPE's pass 2 x (32 + 8) x 128 forward (and on the CPU
 * backward too; the GPU's attention backward turns dQ and dK back in its
 * epilogues: no pass); -r 1 reruns the QKV, O and gate/up matmuls, RoPE,
 * both norms and SwiGLU, and attention. A mutant that counts attention for
 * the K/V heads, RoPE for Q only, a GPU backward pass of RoPE, or SwiGLU's
 * bytes as GELU's (F in, F out) fails here. */
static void check_llama_work(void) {
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    if (config_from_descriptor("llama3.1-8b", &s.cfg) != 0) { printf("  FAIL preset llama3.1-8b unknown\n"); failures++; return; }
    s.B = 1; s.T = 4096; s.backend = BACKEND_GPU; s.elem_bytes = 2; s.stat_bytes = 4; s.world_size = 1;
    double N = 4096, C = 4096, F = 14336, E = 2, pairs = 4096.0 * 4097.0 / 2.0, rope = 2.0 * (32 + 8) * 128;
    double matmul = 2.0 * C * (48 * 128 + 4096 + 2 * F + F) * N, attention = 4.0 * 32 * 128 * pairs;
    Work f = layer_work(&s, 0), b = layer_work(&s, 1), r = recompute_work(&s, RECOMPUTE_FULL);
    expect_work("llama3.1-8b forward matmul FLOPs", f.matmul_flops, matmul);
    expect_work("llama3.1-8b forward attention FLOPs (32 query heads)", f.attention_flops, attention);
    expect_work("llama3.1-8b forward bytes", f.memory_bytes, (4 * C + 3 * F + rope) * N * E);
    expect_work("llama3.1-8b forward SwiGLU bytes", f.gelu_bytes, 3 * F * N * E);
    expect_work("llama3.1-8b backward matmul FLOPs", b.matmul_backward_flops, 2 * matmul);
    expect_work("llama3.1-8b backward attention FLOPs", b.attention_backward_flops, 2.5 * attention);
    expect_work("llama3.1-8b backward bytes (GPU: no RoPE pass)", b.memory_bytes, (8 * C + 5 * F) * N * E);
    expect_work("llama3.1-8b backward SwiGLU bytes", b.gelu_bytes, 5 * F * N * E);
    expect_work("llama3.1-8b -r 1 recompute matmul FLOPs", r.matmul_flops, 2.0 * C * (48 * 128 + 4096 + 2 * F) * N);
    expect_work("llama3.1-8b -r 1 recompute attention FLOPs", r.attention_flops, attention);
    expect_work("llama3.1-8b -r 1 recompute bytes", r.memory_bytes, (4 * C + 3 * F + rope) * N * E);
    s.backend = BACKEND_CPU;
    s.elem_bytes = E = 4;
    expect_work("llama3.1-8b backward bytes (CPU: RoPE's pass)", layer_work(&s, 1).memory_bytes, (8 * C + 5 * F + rope) * N * E);
}

/* The searches' model: L layers of C=64, 4 heads, V=50, T=256 at B=2, bf16
 * with fp32 master weights on one GPU, two micro-steps, priced by `cm`;
 * with search_llama the configurable block instead (4 query heads on 2 K/V
 * heads of 16, SwiGLU of 160, RoPE), whose widths change every mode's bytes
 * and time. */
static int search_llama = 0;

static PlanSpec small_gpu_spec(int L, CostModel cm) {
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    s.cfg = search_llama ? test_llama_config(L, 4, 2, 16, 64, 160, 50, 256) : test_config(L, 4, 64, 50, 256);
    s.B = 2; s.T = 256; s.backend = BACKEND_GPU; s.elem_bytes = 2; s.stat_bytes = 4; s.master_weights = 1;
    s.world_size = 1; s.logits_chunk_rows = 64; s.io_chunk_floats = 1 << 10; s.grad_accum = 2;
    s.cost_model = cm;
    return s;
}

/* -r auto against an exhaustive search over all 4^L per-layer assignments
 * (L <= 5), each planned by plan_build and timed by the time model: at every
 * budget from below the smallest uniform total to above the largest, auto's
 * choice fits and its predicted time equals the least of the ones that fit
 * (to rounding), or both find nothing. */
static void check_auto_against_exhaustive(void) {
    CostModel slow_memory = {"slow memory", 1e14, 5e13, 1e10, 1e9, 0, 0, 0, 0, 0, 0, 0, 0};
    int checked = 0;
    for (int L = 1; L <= 5; L++)
        for (int c = 0; c <= NUM_COST_MODEL_DEFAULTS; c++) {
            PlanSpec s = small_gpu_spec(L, c < NUM_COST_MODEL_DEFAULTS ? cost_model_defaults[c] : slow_memory);
            int n = 1;
            for (int l = 0; l < L; l++) n *= 4;
            size_t* totals = (size_t*)malloc_check((size_t)n * sizeof(size_t), "test");
            double* secs = (double*)malloc_check((size_t)n * sizeof(double), "test");
            unsigned char modes[5], chosen[5];
            size_t lo = SIZE_MAX, hi = 0;
            for (int code = 0; code < n; code++) {
                for (int l = 0, k = code; l < L; l++, k /= 4) modes[l] = (unsigned char)(k % 4);
                s.layer_mode = modes;
                totals[code] = plan_total_for(&s, -1, s.B, s.T);
                secs[code] = plan_predicted_seconds(&s, modes, NULL);
                if (totals[code] < lo) lo = totals[code];
                if (totals[code] > hi) hi = totals[code];
            }
            for (int step = 0; step <= 40; step++) {
                size_t budget = lo - 1 + (hi + 1 - lo) / 40 * (size_t)step + (step == 40 ? 1 : 0);
                double best = -1.0;
                for (int code = 0; code < n; code++)
                    if (totals[code] <= budget && (best < 0 || secs[code] < best)) best = secs[code];
                s.layer_mode = NULL;
                int rc = recompute_auto(&s, budget, chosen);
                checked++;
                if (best < 0) {
                    if (rc == 0) { printf("  FAIL auto L=%d %s budget %zu: chose a plan, exhaustive found none fits\n", L, s.cost_model.name, budget); failures++; }
                    continue;
                }
                s.layer_mode = chosen;
                size_t t = plan_total_for(&s, -1, s.B, s.T);
                double secs_auto = plan_predicted_seconds(&s, chosen, NULL);
                if (rc != 0 || t > budget || secs_auto > best * (1 + 1e-12)) {
                    printf("  FAIL auto L=%d %s budget %zu: rc %d, %zu bytes, %.9g s; exhaustive best %.9g s\n", L, s.cost_model.name,
                           budget, rc, t, secs_auto, best);
                    failures++;
                }
            }
            free(totals);
            free(secs);
        }
    printf("auto against exhaustive search%s: %d (L, cost model, budget) cases\n", search_llama ? " (the configurable block)" : "", checked);
}

/* -r auto with offloading against an exhaustive search over all 6^L
 * per-layer choices (modes 0-3, 1o, 3o; L <= 4), each planned by plan_build
 * (device and host bytes) and timed by the time model, at device budgets
 * across the range and host budgets none, half the most any choice needs,
 * and unbounded; the links include a slow one, whose copies do not hide. */
static void check_auto_offload_against_exhaustive(void) {
    CostModel slow_link = {"slow link", 1e14, 5e13, 1e12, 1e8, 0, 0, 0, 0, 0, 0, 0, 0};
    int checked = 0;
    for (int L = 1; L <= 4; L++)
        for (int c = 0; c <= NUM_COST_MODEL_DEFAULTS; c++) {
            PlanSpec s = small_gpu_spec(L, c < NUM_COST_MODEL_DEFAULTS ? cost_model_defaults[c] : slow_link);
            static const int choice_mode[6] = {0, 1, 2, 3, 1, 3}, choice_off[6] = {0, 0, 0, 0, 1, 1};
            int n = 1;
            for (int l = 0; l < L; l++) n *= 6;
            size_t* totals = (size_t*)malloc_check((size_t)n * sizeof(size_t), "test");
            size_t* hosts = (size_t*)malloc_check((size_t)n * sizeof(size_t), "test");
            double* secs = (double*)malloc_check((size_t)n * sizeof(double), "test");
            unsigned char modes[4], offload[4], chosen[4], chosen_off[4];
            size_t lo = SIZE_MAX, hi = 0, host_hi = 0;
            for (int code = 0; code < n; code++) {
                for (int l = 0, k = code; l < L; l++, k /= 6) { modes[l] = (unsigned char)choice_mode[k % 6]; offload[l] = (unsigned char)choice_off[k % 6]; }
                s.layer_mode = modes;
                s.layer_offload = offload;
                totals[code] = plan_totals_for(&s, -1, s.B, s.T, &hosts[code]);
                secs[code] = plan_predicted_seconds_offload(&s, modes, offload, NULL);
                if (totals[code] < lo) lo = totals[code];
                if (totals[code] > hi) hi = totals[code];
                if (hosts[code] > host_hi) host_hi = hosts[code];
            }
            size_t host_budgets[3] = {0, host_hi / 2, SIZE_MAX};
            for (int h = 0; h < 3; h++)
                for (int step = 0; step <= 40; step++) {
                    size_t budget = lo - 1 + (hi + 1 - lo) / 40 * (size_t)step + (step == 40 ? 1 : 0);
                    double best = -1.0;
                    for (int code = 0; code < n; code++)
                        if (totals[code] <= budget && hosts[code] <= host_budgets[h] && (best < 0 || secs[code] < best)) best = secs[code];
                    s.layer_mode = NULL;
                    s.layer_offload = NULL;
                    int rc = recompute_auto_offload(&s, budget, host_budgets[h], chosen, chosen_off);
                    checked++;
                    if (best < 0) {
                        if (rc == 0) { printf("  FAIL auto offload L=%d %s budget %zu: chose a plan, exhaustive found none fits\n", L, s.cost_model.name, budget); failures++; }
                        continue;
                    }
                    s.layer_mode = chosen;
                    s.layer_offload = chosen_off;
                    size_t host = 0, t = plan_totals_for(&s, -1, s.B, s.T, &host);
                    double secs_auto = plan_predicted_seconds_offload(&s, chosen, chosen_off, NULL);
                    if (rc != 0 || t > budget || host > host_budgets[h] || secs_auto > best * (1 + 1e-12)) {
                        printf("  FAIL auto offload L=%d %s budget %zu host %zu: rc %d, %zu bytes, host %zu, %.9g s; exhaustive best %.9g s\n", L,
                               s.cost_model.name, budget, host_budgets[h], rc, t, host, secs_auto, best);
                        failures++;
                    }
                }
            free(totals);
            free(hosts);
            free(secs);
        }
    printf("auto with offloading against exhaustive search: %d (L, cost model, budget, host budget) cases\n", checked);
}

/* The bytes of device buffer `name` in p (0: none). */
static size_t entry_bytes(const MemoryPlan* p, const char* name) {
    for (int i = 0; i < p->num_entries; i++)
        if (strcmp(p->entries[i].name, name) == 0) return p->entries[i].bytes;
    return 0;
}

/* --offload-optimizer's plan against a count by hand: the device keeps the
 * parameters and gradients (and the fp32 sums of micro-steps), no master
 * weights and no moments; the host pool holds this rank's shard of the
 * master weights (fp32; without them the parameters in storage precision),
 * of the gradients in storage precision, and the two fp32 moments, each
 * entry aligned to 256 bytes; the rest of the device plan is unchanged but
 * for the gradients: with one process and one micro-step the device holds
 * those outside the blocks (wte 128 x C, wpe 256 x C, lnf 2C) and two slots
 * of a layer's block gradients in flight, else all of them. A slot gives each
 * of the layer's 12 tensors its bytes rounded up to 256, and 256 more (where
 * its layer's slice starts at the alignment it has in the whole buffer). */
static void check_offloaded_optimizer_sizes(void) {
    ModelConfig cfg = test_config(3, 4, 64, 50, 256);
    size_t C = 64, L = 3, layer = 12 * C * C + 13 * C, outside = 128 * C + 256 * C + 2 * C, P = outside + L * layer;
    static const int worlds[3] = {1, 2, 3}, masters[2] = {0, 1}, elems[2] = {2, 4};
    int checked = 0;
    for (int w = 0; w < 3; w++)
        for (int m = 0; m < 2; m++)
            for (int e = 0; e < 4; e++) {
                PlanSpec s = small_gpu_spec((int)L, cost_model_defaults[COST_MODEL_H100]);
                s.cfg = cfg;
                s.world_size = worlds[w]; s.zero_stage = 1; s.master_weights = masters[m]; s.elem_bytes = elems[e % 2];
                s.micro_steps = e < 2 ? 1 : 2;
                size_t E = (size_t)elems[e % 2], shard = (P + (size_t)worlds[w] - 1) / (size_t)worlds[w];
                int slots = worlds[w] == 1 && s.micro_steps == 1;
                static const size_t per_layer[12] = {1, 1, 3 * 64, 3, 64, 1, 1, 1, 4 * 64, 4, 4 * 64, 1}; /* times C */
                size_t slot = 0;
                for (int t = 0; t < 12; t++) slot += align256(per_layer[t] * C * E) + 256;
                size_t grads = slots ? align256(outside * E) + align256(2 * slot) : align256(P * E);
                MemoryPlan on, off;
                plan_build(&off, &s);
                s.offload_optimizer = 1;
                plan_build(&on, &s);
                expect_eq("offloaded optimizer: parameter count", on.num_params, P);
                expect_eq("offloaded optimizer: device parameters", on.section_bytes[SEC_PARAMETERS], align256(P * E));
                expect_eq("offloaded optimizer: device master weights", on.section_bytes[SEC_MASTER_WEIGHTS], 0);
                expect_eq("offloaded optimizer: device moments", on.section_bytes[SEC_OPTIMIZER], 0);
                expect_eq("offloaded optimizer: device gradients, plain", off.section_bytes[SEC_GRADIENTS], align256(P * E));
                expect_eq("offloaded optimizer: device gradients", on.section_bytes[SEC_GRADIENTS], grads);
                expect_eq("offloaded optimizer: layers in flight", (size_t)on.grad_slots, slots ? 2 : 0);
                expect_eq("offloaded optimizer: gradients outside the blocks", entry_bytes(&on, "grads_outside_blocks"),
                          slots ? outside * E : 0);
                expect_eq("offloaded optimizer: gradients in flight", entry_bytes(&on, "grads_in_flight"), slots ? 2 * slot : 0);
                expect_eq("offloaded optimizer: whole gradients", entry_bytes(&on, "grads"), slots ? 0 : P * E);
                expect_eq("offloaded optimizer: host master weights", on.host_section_bytes[SEC_MASTER_WEIGHTS],
                          align256(shard * (masters[m] ? 4 : E)));
                expect_eq("offloaded optimizer: host gradient copy", on.host_section_bytes[SEC_GRADIENTS], align256(shard * E));
                expect_eq("offloaded optimizer: host moments", on.host_section_bytes[SEC_OPTIMIZER], 2 * align256(shard * 4));
                expect_eq("offloaded optimizer: host pool", on.host_total_bytes,
                          align256(shard * (masters[m] ? 4 : E)) + align256(shard * E) + 2 * align256(shard * 4));
                expect_eq("offloaded optimizer: host bytes by formula", plan_host_optimizer_bytes(&on.spec), on.host_total_bytes);
                size_t moved = (masters[m] ? align256(shard * 4) : 0) + 2 * align256(shard * 4);
                expect_eq("offloaded optimizer: device total", on.total_bytes, off.total_bytes - moved - (align256(P * E) - grads));
                plan_free(&on);
                plan_free(&off);
                checked++;
            }
    printf("offloaded optimizer sizes against a count by hand: %d (ranks, master weights, precision, micro-steps) cases\n", checked);
}

/* The fp32 gradient sums' range (plan_grads_fp32_range, grad_accum.cuh)
 * against parameter counts by hand: a tied GPT-2 shape sums wte (index 0
 * on) once the logits take several chunks; an untied Llama shape sums its
 * lm_head alone, the last Vp x C parameters (the encoder writes wte's
 * gradient once); micro-steps sum every parameter; one chunk, or fp32
 * storage, none. The gradient section is the floatX gradients plus those
 * sums. Llama 3.1 8B's sums are lm_head's 128256 x 4096, not all 8.03 B. */
static void expect_fp32_sums(const char* what, ModelConfig cfg, int micro_steps, int chunk_rows, int E, size_t P, size_t first, size_t count) {
    PlanSpec s = small_gpu_spec(cfg.num_layers, cost_model_defaults[COST_MODEL_H100]);
    s.cfg = cfg; s.micro_steps = micro_steps; s.logits_chunk_rows = chunk_rows; s.elem_bytes = E; s.fp32_grad_sums = E < 4;
    MemoryPlan p;
    plan_build(&p, &s);
    char name[160];
    snprintf(name, sizeof(name), "%s: parameters", what);
    expect_eq(name, p.num_params, P);
    snprintf(name, sizeof(name), "%s: first summed parameter", what);
    expect_eq(name, p.grads_fp32_first, first);
    snprintf(name, sizeof(name), "%s: summed parameters", what);
    expect_eq(name, p.grads_fp32_count, count);
    snprintf(name, sizeof(name), "%s: gradient section", what);
    expect_eq(name, p.section_bytes[SEC_GRADIENTS], align256(P * (size_t)E) + (count ? align256(count * 4) : 0));
    plan_free(&p);
}

static void check_grads_fp32_range(void) {
    size_t L = 2, C = 64, Vp = 128, F = 160, q = 4 * 16, kv = 2 * 16; /* V = 50 pads to 128 */
    size_t gpt2 = Vp * C + 256 * C + L * (12 * C * C + 13 * C) + 2 * C;
    size_t llama_block = C + (q + 2 * kv) * C + q * C + C + 2 * F * C + F * C;
    size_t llama = Vp * C + L * llama_block + C + Vp * C;
    ModelConfig tied = test_config((int)L, 4, (int)C, 50, 256), untied = test_llama_config((int)L, 4, 2, 16, (int)C, (int)F, 50, 256);
    /* small_gpu_spec: B*T = 512 rows */
    expect_fp32_sums("tied, 8 logits chunks", tied, 1, 64, 2, gpt2, 0, Vp * C);
    expect_fp32_sums("untied, 8 logits chunks", untied, 1, 64, 2, llama, llama - Vp * C, Vp * C);
    expect_fp32_sums("tied, 2 micro-steps", tied, 2, 64, 2, gpt2, 0, gpt2);
    expect_fp32_sums("untied, 2 micro-steps", untied, 2, 64, 2, llama, 0, llama);
    expect_fp32_sums("tied, one chunk", tied, 1, 512, 2, gpt2, 0, 0);
    expect_fp32_sums("untied, one chunk", untied, 1, 512, 2, llama, 0, 0);
    expect_fp32_sums("untied, fp32 storage", untied, 2, 64, 4, llama, 0, 0);
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    if (config_from_descriptor("llama3.1-8b", &s.cfg) != 0) { printf("  FAIL preset llama3.1-8b unknown\n"); failures++; return; }
    s.B = 1; s.T = 4096; s.logits_chunk_rows = 2048; s.fp32_grad_sums = 1;
    ParamLayout pl;
    param_layout(&s.cfg, &pl);
    size_t first, count = plan_grads_fp32_range(&s, &pl, &first);
    expect_eq("llama3.1-8b fp32 sums: first", first, (size_t)8030261248ULL - (size_t)128256 * 4096);
    expect_eq("llama3.1-8b fp32 sums: count", count, (size_t)128256 * 4096);
    printf("fp32 gradient sums' range against counts by hand: tied and untied, chunks, micro-steps, llama3.1-8b\n");
}

/* -r auto choosing the optimizer's place with the per-layer modes and
 * offloading, against an exhaustive search over both places and all 6^L
 * per-layer choices (L <= 3), each planned by plan_build (device bytes, and
 * host bytes that include the optimizer's) and timed by the time model, at
 * device budgets across the range and host budgets none, half the most any
 * choice needs, and unbounded; with checkpoint offloading allowed and not;
 * the cost models include a slow host link and a slow host memory. */
static void check_auto_place_against_exhaustive(void) {
    CostModel slow_link = {"slow link", 1e14, 5e13, 1e12, 1e8, 0, 0, 0, 0, 0, 0, 0, 0};
    CostModel slow_host = {"slow host memory", 1e14, 5e13, 1e12, 5e10, 0, 0, 0, 0, 0, 0, 0, 1e8};
    int checked = 0, offloaded = 0, on_device = 0;
    for (int L = 1; L <= 3; L++)
        for (int c = 0; c < 3; c++) {
            PlanSpec s = small_gpu_spec(L, c == 0 ? cost_model_defaults[COST_MODEL_H100] : c == 1 ? slow_link : slow_host);
            static const int choice_mode[6] = {0, 1, 2, 3, 1, 3}, choice_off[6] = {0, 0, 0, 0, 1, 1};
            int n = 1;
            for (int l = 0; l < L; l++) n *= 6;
            size_t* totals = (size_t*)malloc_check(2 * (size_t)n * sizeof(size_t), "test");
            size_t* hosts = (size_t*)malloc_check(2 * (size_t)n * sizeof(size_t), "test");
            double* secs = (double*)malloc_check(2 * (size_t)n * sizeof(double), "test");
            unsigned char modes[3], offload[3], chosen[3], chosen_off[3];
            size_t lo = SIZE_MAX, hi = 0, host_hi = 0;
            for (int i = 0; i < 2 * n; i++) {
                int code = i % n;
                for (int l = 0, k = code; l < L; l++, k /= 6) { modes[l] = (unsigned char)choice_mode[k % 6]; offload[l] = (unsigned char)choice_off[k % 6]; }
                s.layer_mode = modes;
                s.layer_offload = offload;
                s.offload_optimizer = i >= n;
                totals[i] = plan_totals_for(&s, -1, s.B, s.T, &hosts[i]);
                secs[i] = plan_predicted_seconds_offload(&s, modes, offload, NULL);
                if (totals[i] < lo) lo = totals[i];
                if (totals[i] > hi) hi = totals[i];
                if (hosts[i] > host_hi) host_hi = hosts[i];
            }
            size_t host_budgets[3] = {0, host_hi / 2, SIZE_MAX};
            for (int ckpt = 0; ckpt < 2; ckpt++)
                for (int h = 0; h < 3; h++)
                    for (int step = 0; step <= 30; step++) {
                        size_t budget = lo - 1 + (hi + 1 - lo) / 30 * (size_t)step + (step == 30 ? 1 : 0);
                        double best = -1.0;
                        for (int i = 0; i < 2 * n; i++) {
                            int any_off = 0;
                            for (int l = 0, k = i % n; l < L; l++, k /= 6) any_off |= choice_off[k % 6];
                            if (any_off && !ckpt) continue;
                            if (totals[i] <= budget && hosts[i] <= host_budgets[h] && (best < 0 || secs[i] < best)) best = secs[i];
                        }
                        s.layer_mode = NULL;
                        s.layer_offload = NULL;
                        s.offload_optimizer = 0;
                        memset(chosen_off, 0, sizeof(chosen_off));
                        int rc = recompute_auto_place(&s, budget, host_budgets[h], ckpt, 1, 0, 0, chosen, chosen_off);
                        checked++;
                        if (best < 0) {
                            if (rc == 0) { printf("  FAIL auto place L=%d %s budget %zu: chose a plan, exhaustive found none fits\n", L, s.cost_model.name, budget); failures++; }
                            continue;
                        }
                        s.layer_mode = chosen;
                        s.layer_offload = chosen_off;
                        size_t host = 0, t = plan_totals_for(&s, -1, s.B, s.T, &host);
                        double secs_auto = plan_predicted_seconds_offload(&s, chosen, chosen_off, NULL);
                        if (rc != 0 || t > budget || host > host_budgets[h] || secs_auto > best * (1 + 1e-12)) {
                            printf("  FAIL auto place L=%d %s budget %zu host %zu ckpt %d: rc %d, optimizer %s, %zu bytes, host %zu, %.9g s; "
                                   "exhaustive best %.9g s\n", L, s.cost_model.name, budget, host_budgets[h], ckpt, rc,
                                   s.offload_optimizer ? "host" : "device", t, host, secs_auto, best);
                            failures++;
                        }
                        if (s.offload_optimizer) offloaded++;
                        else on_device++;
                    }
            free(totals);
            free(hosts);
            free(secs);
        }
    printf("auto choosing the optimizer's place against exhaustive search: %d cases, %d offloaded it, %d kept it on the device\n",
           checked, offloaded, on_device);
    if (!offloaded || !on_device) { printf("  FAIL auto place: every case chose the same place\n"); failures++; }
}

/* --offload-optimizer's time by hand: the shard's gradients down and its
 * parameters up, 2 bytes each in BF16 over the host link; the host AdamW's
 * 28 bytes a parameter (gradient 2, master weights 4 + 4, moments 16,
 * parameter 2) at the host's memory rate; exposed on the GPU what of the copy
 * down the backward does not hide (at least the last layer's and the
 * embeddings' and final norm's) and what the next forward waits for the
 * update, on the CPU (4-byte storage, no master weights: 32 bytes; copies at
 * the memory rate) all of it. The next forward runs the update group by group
 * (embeddings, each layer, final norm): with a slow host (each layer's AdamW
 * longer than its forward and than any copy) the forward waits for all of the
 * AdamW and the last layer's copy, and hides L - 1 layers' forward; with a
 * fast host and link (a layer's AdamW and copy within a layer's forward) only
 * the embeddings' AdamW and the first layer's AdamW and copy show. The step's
 * prediction moves by that less the device update it no longer runs. */
static void check_optimizer_offload_time(void) {
    CostModel slow_host = {"slow host", 1e14, 5e13, 1e12, 2e10, 0, 0, 0, 0, 0, 0, 0, 4e10};
    CostModel fast_host = {"fast host", 1e14, 5e13, 1e12, 1e13, 0, 0, 0, 0, 0, 0, 0, 1e14};
    for (int backend = 0; backend < 3; backend++) {
        PlanSpec s = small_gpu_spec(3, backend == 1 ? fast_host : slow_host);
        s.backend = backend < 2 ? BACKEND_GPU : BACKEND_CPU;
        if (s.backend == BACKEND_CPU) { s.elem_bytes = 4; s.master_weights = 0; }
        double P = 128.0 * 64 + 256.0 * 64 + 3 * (12.0 * 64 * 64 + 13.0 * 64) + 2.0 * 64, E = s.elem_bytes;
        CostModel r = spec_cost_model(&s);
        double link = s.backend == BACKEND_CPU ? r.memory_bytes_per_s : r.host_link_bytes_per_s;
        double down = P * E / link, adamw = P * (s.backend == BACKEND_CPU ? 32.0 : 28.0) / r.host_memory_bytes_per_s;
        /* on the GPU (one process) the copy down hides behind the backward but for the last layer's and the rest's */
        double block = 3 * (12.0 * 64 * 64 + 13.0 * 64), tail = down * (P - block + block / 3) / P;
        double bwd = 3 * work_seconds(layer_work(&s, 1), &r), down_seen = down > bwd + tail ? down - bwd : tail;
        double emb = 128.0 * 64 + 256.0 * 64, a_emb = adamw * emb / P, a_layer = adamw * block / 3 / P, u_layer = down * block / 3 / P;
        double u_emb = down * emb / P, u_final = down * 128 / P, a_final = adamw * 128 / P, f = work_seconds(layer_work(&s, 0), &r);
        double update_seen = -1.0;
        if (a_layer >= f && a_layer >= u_layer && a_layer >= u_emb && f >= u_final && u_layer >= a_final)
            update_seen = a_emb + 3 * a_layer + u_layer + f - 3 * f; /* slow host: the forward waits for every layer's AdamW */
        else if (f >= a_layer + u_layer && a_layer >= u_emb && f >= 2 * a_layer + u_final)
            update_seen = a_emb + a_layer + u_layer; /* fast host: the later layers' hide behind the forward before them */
        if (s.backend == BACKEND_GPU && update_seen < 0) {
            printf("  FAIL optimizer offload time: cost model %s fits neither hand count's assumptions\n", s.cost_model.name);
            failures++;
        }
        double want = s.backend == BACKEND_CPU ? 2 * down + adamw : down_seen + update_seen;
        double before = plan_predicted_seconds_offload(&s, NULL, NULL, NULL);
        s.offload_optimizer = 1;
        OptimizerOffloadSeconds o = optimizer_offload_seconds(&s, &r);
        double after = plan_predicted_seconds_offload(&s, NULL, NULL, NULL);
        double device_update = P * (3.0 * E + 16.0 + (s.master_weights ? 8.0 : 0.0)) - P * E; /* the bytes the device no longer moves */
        double want_step = before + want - device_update / r.memory_bytes_per_s;
        if (fabs(o.exposed - want) > 1e-9 * want || fabs(after - want_step) > 1e-9 * want_step) {
            printf("  FAIL optimizer offload time (%s, %s): exposed %.9g s, by hand %.9g; step %.9g s, by hand %.9g\n",
                   s.backend == BACKEND_CPU ? "cpu" : "gpu", s.cost_model.name, o.exposed, want, after, want_step);
            failures++;
        }
    }
    printf("offloaded optimizer's time against a count by hand: GPU (slow and fast host) and CPU\n");
}

/* -r auto choosing the tile size too, against an exhaustive search over
 * every per-layer choice (modes 0-3, and 1o, 3o with a host budget) at
 * every tile size it may take (untiled, and the powers of two from 256 down
 * to 1 of 512 rows: plan_tile_candidates, counted here), each
 * planned by plan_build and timed by the time model: at device budgets
 * across the range of all of them, auto's choice fits both budgets and its
 * predicted time is the least, or both find nothing. The cost models
 * include one whose tiles are dear and one whose tiles are nearly free. */
static void check_auto_tiles_against_exhaustive(void) {
    CostModel cheap_tiles = {"cheap tiles", 1e14, 5e13, 1e12, 1e9, 1e-9, 1.0, 0, 0, 0, 0, 0, 0};
    CostModel dear_tiles = {"dear tiles", 1e14, 5e13, 1e12, 1e11, 1e-3, 4096.0, 0, 0, 0, 0, 0, 0};
    static const int choice_mode[6] = {0, 1, 2, 3, 1, 3}, choice_off[6] = {0, 0, 0, 0, 1, 1};
    static const int tiles[10] = {0, 256, 128, 64, 32, 16, 8, 4, 2, 1};
    int checked = 0, tiled_choices = 0;
    for (int L = 1; L <= 3; L++)
        for (int c = 0; c < NUM_COST_MODEL_DEFAULTS + 2; c++)
            for (int with_offload = 0; with_offload <= 1; with_offload++) {
                PlanSpec s = small_gpu_spec(L, c < NUM_COST_MODEL_DEFAULTS ? cost_model_defaults[c] : c == NUM_COST_MODEL_DEFAULTS ? cheap_tiles : dear_tiles);
                int choices = with_offload ? 6 : 4, n = 1;
                for (int l = 0; l < L; l++) n *= choices;
                int all = 10 * n;
                size_t* totals = (size_t*)malloc_check((size_t)all * sizeof(size_t), "test");
                size_t* hosts = (size_t*)malloc_check((size_t)all * sizeof(size_t), "test");
                double* secs = (double*)malloc_check((size_t)all * sizeof(double), "test");
                unsigned char modes[3], offload[3], chosen[3], chosen_off[3];
                size_t lo = SIZE_MAX, hi = 0, host_hi = 0;
                for (int k = 0; k < 10; k++)
                    for (int code = 0; code < n; code++) {
                        int i = k * n + code;
                        for (int l = 0, r = code; l < L; l++, r /= choices) {
                            modes[l] = (unsigned char)choice_mode[r % choices];
                            offload[l] = (unsigned char)choice_off[r % choices];
                        }
                        s.layer_mode = modes; s.layer_offload = offload; s.tile_tokens = tiles[k];
                        totals[i] = plan_totals_for(&s, -1, s.B, s.T, &hosts[i]);
                        secs[i] = plan_predicted_seconds_offload(&s, modes, offload, NULL);
                        if (totals[i] < lo) lo = totals[i];
                        if (totals[i] > hi) hi = totals[i];
                        if (hosts[i] > host_hi) host_hi = hosts[i];
                    }
                size_t host_budget = with_offload ? host_hi / 2 : 0;
                for (int step = 0; step <= 40; step++) {
                    size_t budget = lo - 1 + (hi + 1 - lo) / 40 * (size_t)step + (step == 40 ? 1 : 0);
                    double best = -1.0;
                    for (int i = 0; i < all; i++)
                        if (totals[i] <= budget && hosts[i] <= host_budget && (best < 0 || secs[i] < best)) best = secs[i];
                    s.layer_mode = NULL; s.layer_offload = NULL; s.tile_tokens = 0;
                    int rc = recompute_auto_tiles(&s, budget, host_budget, 1, chosen, with_offload ? chosen_off : NULL);
                    if (!with_offload) memset(chosen_off, 0, sizeof(chosen_off));
                    checked++;
                    if (best < 0) {
                        if (rc == 0) { printf("  FAIL auto tiles L=%d %s budget %zu: chose a plan, exhaustive found none fits\n", L, s.cost_model.name, budget); failures++; }
                        continue;
                    }
                    s.layer_mode = chosen; s.layer_offload = chosen_off;
                    size_t host = 0, t = plan_totals_for(&s, -1, s.B, s.T, &host);
                    double secs_auto = plan_predicted_seconds_offload(&s, chosen, chosen_off, NULL);
                    tiled_choices += rc == 0 && s.tile_tokens > 0;
                    if (rc != 0 || t > budget || host > host_budget || secs_auto > best * (1 + 1e-12)) {
                        printf("  FAIL auto tiles L=%d %s offload %d budget %zu: rc %d, K %d, %zu bytes, host %zu, %.9g s; exhaustive best %.9g s\n", L,
                               s.cost_model.name, with_offload, budget, rc, s.tile_tokens, t, host, secs_auto, best);
                        failures++;
                    }
                }
                free(totals);
                free(hosts);
                free(secs);
            }
    if (tiled_choices == 0) { printf("  FAIL auto tiles: no case chose a tile, so the tile dimension went untested\n"); failures++; }
    printf("auto with tiles against exhaustive search: %d (L, cost model, offloading, budget) cases, %d chose tiles\n", checked, tiled_choices);
}

/* rank_parallel (both trainers' setup): with -z 1 over W > 1 processes the
 * ranks' shards are ceil(P/W) parameters each (the last the rest), in rank
 * order, together every parameter once, none beyond the plan's shard_params;
 * with -z 1 and one process, or -z 0, every rank holds all P and nothing is
 * sharded. The context-parallel group and the zigzag come with it. */
/* (noinline, here and below: inlined into main they change GCC's inlining of
 * ring_link_resolve there, whose constant name then trips -Wstring-compare.) */
static __attribute__((noinline)) void check_rank_parallel(void) {
    ModelConfig cfg = test_config(3, 4, 64, 50, 256);
    for (int W = 1; W <= 4; W++)
        for (int z = 0; z <= 1; z++) {
            PlanSpec s = small_gpu_spec(3, cost_model_defaults[0]);
            s.cfg = cfg; s.world_size = W; s.zero_stage = z;
            s.context_parallel = W % 2 == 0 ? 2 : 1;
            MemoryPlan p;
            plan_build(&p, &s);
            size_t P = p.num_params, next = 0, per = (P + (size_t)W - 1) / (size_t)W;
            for (int r = 0; r < W; r++) {
                RankParallel rp = rank_parallel(&p, r);
                int sharded = z == 1 && W > 1;
                size_t want_start = sharded ? next : 0, want_count = sharded ? (r < W - 1 ? per : P - next) : P;
                if (rp.zero != sharded || rp.shard_start != want_start || rp.shard_count != want_count || rp.shard_count > p.shard_params) {
                    printf("  FAIL rank_parallel W=%d -z %d rank %d: zero %d, shard [%zu, +%zu), want %d [%zu, +%zu), plan's shard %zu\n", W, z, r,
                           rp.zero, rp.shard_start, rp.shard_count, sharded, want_start, want_count, p.shard_params);
                    failures++;
                }
                int N = s.context_parallel;
                if (rp.cp.group_size != N || rp.cp.member != r % N || rp.ring_chunks[0] != 0 || rp.ring_chunks[2 * N - 1] != N) {
                    printf("  FAIL rank_parallel W=%d rank %d: group of %d, member %d, chunks %d..%d\n", W, r, rp.cp.group_size, rp.cp.member,
                           rp.ring_chunks[0], rp.ring_chunks[2 * N - 1]);
                    failures++;
                }
                next += sharded ? want_count : 0;
                rank_parallel_free(&rp);
            }
            if (z == 1 && W > 1 && next != P) { printf("  FAIL rank_parallel W=%d: the shards cover %zu of %zu parameters\n", W, next, P); failures++; }
            plan_free(&p);
        }
    printf("rank_parallel: ZeRO-1 shards over 2 to 4 processes, none over one\n");
}

/* recompute_auto_segments_at on its own, at each segment size K = 2..L,
 * against an exhaustive search over every per-layer mode with the segment
 * inputs offloaded or not, each planned by plan_build and timed by the time
 * model, at device budgets across the range and host budgets of none, less
 * than the segment inputs and all: its choice fits both budgets and its
 * predicted time is the least (to rounding), or both find nothing. L = 3..5
 * at every K, and L = 7 at K = 2 (four segments: the staging ring's three
 * slots save memory over keeping the inputs only from four on). On the
 * GPU's separate memories and on the CPU's one (host_shares_budget: the
 * pool draws on the plan's budget). Every mode and offloaded inputs must be
 * chosen somewhere, and some case must give a segment's last layers two
 * modes (below the top segment and in it). */
static __attribute__((noinline)) void check_segments_at_against_exhaustive(void) {
    CostModel slow_memory = {"slow memory", 1e14, 5e13, 1e10, 1e9, 0, 0, 0, 0, 0, 0, 0, 0};
    CostModel slow_link = {"slow link", 1e14, 5e13, 1e12, 1e8, 0, 0, 0, 0, 0, 0, 0, 0};
    int checked = 0, chose_mode[NUM_RECOMPUTE_MODES] = {0}, chose_offload = 0, split_last = 0;
    for (int L = 3; L <= 7; L += L == 5 ? 2 : 1)
        for (int c = 0; c < (L == 7 ? 1 : NUM_COST_MODEL_DEFAULTS + 2); c++)
            for (int one_memory = 0; one_memory <= 1; one_memory++)
                for (int K = 2; K <= (L == 7 ? 2 : L); K++) {
                    PlanSpec s = small_gpu_spec(L, c < NUM_COST_MODEL_DEFAULTS ? cost_model_defaults[c] : c == NUM_COST_MODEL_DEFAULTS ? slow_memory : slow_link);
                    s.host_shares_budget = one_memory;
                    s.segment_layers = K;
                    int n4 = 1;
                    for (int l = 0; l < L; l++) n4 *= 4;
                    int all = 2 * n4;
                    size_t* totals = (size_t*)malloc_check((size_t)all * sizeof(size_t), "test");
                    size_t* hosts = (size_t*)malloc_check((size_t)all * sizeof(size_t), "test");
                    double* secs = (double*)malloc_check((size_t)all * sizeof(double), "test");
                    unsigned char modes[7], offload[7], chosen[7], chosen_off[7];
                    size_t lo = SIZE_MAX, hi = 0;
                    for (int i = 0; i < all; i++) {
                        for (int l = 0, r = i % n4; l < L; l++, r /= 4) { modes[l] = (unsigned char)(r % 4); offload[l] = (unsigned char)(i >= n4); }
                        s.layer_mode = modes; s.layer_offload = offload;
                        totals[i] = plan_totals_for(&s, -1, s.B, s.T, &hosts[i]);
                        if (one_memory) totals[i] = size_add_sat(totals[i], hosts[i]); /* one memory holds both */
                        secs[i] = plan_predicted_seconds_offload(&s, modes, offload, NULL);
                        if (totals[i] < lo) lo = totals[i];
                        if (totals[i] > hi) hi = totals[i];
                    }
                    size_t inputs = (size_t)plan_num_segments(&s) * plan_aligned(plan_act_bytes(&s, ACT_X));
                    size_t host_budgets[3] = {0, inputs - 1, SIZE_MAX};
                    for (int h = 0; h < 3; h++)
                        for (int step = 0; step <= 30; step++) {
                            size_t budget = lo - 1 + (hi + 1 - lo) / 30 * (size_t)step + (step == 30 ? 1 : 0);
                            double best = -1.0;
                            for (int j = 0; j < all; j++)
                                if (totals[j] <= budget && hosts[j] <= host_budgets[h] && (best < 0 || secs[j] < best)) best = secs[j];
                            s.layer_mode = NULL; s.layer_offload = NULL;
                            int rc = recompute_auto_segments_at(&s, budget, host_budgets[h], chosen, chosen_off);
                            checked++;
                            if (best < 0) {
                                if (rc == 0) { printf("  FAIL segments at K=%d L=%d %s budget %zu: chose a plan, exhaustive found none fits\n", K, L, s.cost_model.name, budget); failures++; }
                                continue;
                            }
                            s.layer_mode = chosen; s.layer_offload = chosen_off;
                            size_t host = 0, t = plan_totals_for(&s, -1, s.B, s.T, &host);
                            if (one_memory) t = size_add_sat(t, host);
                            double secs_at = plan_predicted_seconds_offload(&s, chosen, chosen_off, NULL);
                            if (rc != 0 || t > budget || host > host_budgets[h] || secs_at > best * (1 + 1e-12)) {
                                printf("  FAIL segments at K=%d L=%d %s one memory %d budget %zu host %zu: rc %d, %zu bytes, host %zu, %.9g s; "
                                       "exhaustive best %.9g s\n", K, L, s.cost_model.name, one_memory, budget, host_budgets[h], rc, t, host, secs_at, best);
                                failures++;
                                continue;
                            }
                            for (int l = 0; l < L; l++) chose_mode[chosen[l]]++;
                            chose_offload += chosen_off[0];
                            split_last += L >= 2 * K && chosen[K - 1] != chosen[L - 1] && L % K == 0;
                        }
                    free(totals);
                    free(hosts);
                    free(secs);
                }
    for (int m = 0; m < NUM_RECOMPUTE_MODES; m++)
        if (!chose_mode[m]) { printf("  FAIL segments at: no case chose -r %d, so it went untested\n", m); failures++; }
    if (!chose_offload) { printf("  FAIL segments at: no case offloaded the segment inputs, so it went untested\n"); failures++; }
    if (!split_last) { printf("  FAIL segments at: no case gave a segment's last layers two modes, so it went untested\n"); failures++; }
    printf("segments at each K against exhaustive search: %d (L, K, cost model, memories, budgets) cases, %d offloaded the inputs, "
           "%d split the last slot\n", checked, chose_offload, split_last);
}

/* -r auto choosing the segment size too (recompute_auto_plan), against an
 * exhaustive search over K = 1 to L, every per-layer mode (and without
 * segments 1o and 3o, with them the segment inputs offloaded or not, with a
 * host budget), at every tile size it may take (untiled, and 256 down to 1
 * of 512 rows), each planned by
 * plan_build and timed by the time model: at device budgets across the
 * range, auto's choice fits both budgets and its predicted time is the
 * least, or both find nothing. The cost models include one whose memory is
 * slow (a segment's forward again is dear against -r 2) and one whose host
 * link is slow; some case must choose segments. */
static void check_auto_segments_against_exhaustive(void) {
    CostModel slow_memory = {"slow memory", 1e14, 5e13, 1e10, 1e9, 0, 0, 0, 0, 0, 0, 0, 0};
    CostModel slow_link = {"slow link", 1e14, 5e13, 1e12, 1e8, 0, 0, 0, 0, 0, 0, 0, 0};
    static const int choice_mode[6] = {0, 1, 2, 3, 1, 3}, choice_off[6] = {0, 0, 0, 0, 1, 1};
    static const int tiles[10] = {0, 256, 128, 64, 32, 16, 8, 4, 2, 1};
    int checked = 0, segment_choices = 0, offloaded_segments = 0;
    for (int L = 2; L <= 5; L++)
        for (int c = 0; c < NUM_COST_MODEL_DEFAULTS + 2; c++)
            for (int with_offload = 0; with_offload <= (L < 5); with_offload++) {
                PlanSpec s = small_gpu_spec(L, c < NUM_COST_MODEL_DEFAULTS ? cost_model_defaults[c] : c == NUM_COST_MODEL_DEFAULTS ? slow_memory : slow_link);
                int n4 = 1, n6 = 1;
                for (int l = 0; l < L; l++) { n4 *= 4; n6 *= 6; }
                if (!with_offload) n6 = n4;
                int per_tile = (with_offload ? n6 : n4) + (L - 1) * n4 * (with_offload ? 2 : 1), all = 10 * per_tile;
                size_t* totals = (size_t*)malloc_check((size_t)all * sizeof(size_t), "test");
                size_t* hosts = (size_t*)malloc_check((size_t)all * sizeof(size_t), "test");
                double* secs = (double*)malloc_check((size_t)all * sizeof(double), "test");
                unsigned char modes[5], offload[5], chosen[5], chosen_off[5];
                size_t lo = SIZE_MAX, hi = 0, host_hi = 0;
                int i = 0;
                for (int k = 0; k < 10; k++)
                    for (int K = 1; K <= L; K++) {
                        int choices = K == 1 && with_offload ? 6 : 4, n = K == 1 ? (with_offload ? n6 : n4) : n4;
                        for (int off = 0; off <= (K > 1 && with_offload ? 1 : 0); off++)
                            for (int code = 0; code < n; code++, i++) {
                                for (int l = 0, r = code; l < L; l++, r /= choices) {
                                    modes[l] = (unsigned char)choice_mode[r % choices];
                                    offload[l] = (unsigned char)(K == 1 ? choice_off[r % choices] : off);
                                }
                                s.layer_mode = modes; s.layer_offload = offload; s.tile_tokens = tiles[k]; s.segment_layers = K;
                                totals[i] = plan_totals_for(&s, -1, s.B, s.T, &hosts[i]);
                                secs[i] = plan_predicted_seconds_offload(&s, modes, offload, NULL);
                                if (totals[i] < lo) lo = totals[i];
                                if (totals[i] > hi) hi = totals[i];
                                if (hosts[i] > host_hi) host_hi = hosts[i];
                            }
                    }
                if (i != all) { printf("  FAIL auto segments: counted %d plans of %d\n", i, all); failures++; }
                size_t host_budgets[2] = {with_offload ? host_hi / 2 : 0, with_offload ? SIZE_MAX : 0};
                for (int h = 0; h < 1 + with_offload; h++)
                    for (int step = 0; step <= 40; step++) {
                        size_t budget = lo - 1 + (hi + 1 - lo) / 40 * (size_t)step + (step == 40 ? 1 : 0);
                        double best = -1.0;
                        for (int j = 0; j < all; j++)
                            if (totals[j] <= budget && hosts[j] <= host_budgets[h] && (best < 0 || secs[j] < best)) best = secs[j];
                        s.layer_mode = NULL; s.layer_offload = NULL; s.tile_tokens = 0; s.segment_layers = 0;
                        int rc = recompute_auto_plan(&s, budget, host_budgets[h], 1, 1, chosen, with_offload ? chosen_off : NULL);
                        if (!with_offload) memset(chosen_off, 0, sizeof(chosen_off));
                        checked++;
                        if (best < 0) {
                            if (rc == 0) { printf("  FAIL auto segments L=%d %s budget %zu: chose a plan, exhaustive found none fits\n", L, s.cost_model.name, budget); failures++; }
                            continue;
                        }
                        s.layer_mode = chosen; s.layer_offload = chosen_off;
                        size_t host = 0, t = plan_totals_for(&s, -1, s.B, s.T, &host);
                        double secs_auto = plan_predicted_seconds_offload(&s, chosen, chosen_off, NULL);
                        segment_choices += rc == 0 && plan_segment_layers(&s) > 1;
                        offloaded_segments += rc == 0 && plan_segment_layers(&s) > 1 && host > 0;
                        if (rc != 0 || t > budget || host > host_budgets[h] || secs_auto > best * (1 + 1e-12)) {
                            printf("  FAIL auto segments L=%d %s offload %d budget %zu host %zu: rc %d, K %d, tile %d, %zu bytes, host %zu, %.9g s; "
                                   "exhaustive best %.9g s\n", L, s.cost_model.name, with_offload, budget, host_budgets[h], rc, s.segment_layers,
                                   s.tile_tokens, t, host, secs_auto, best);
                            failures++;
                        }
                    }
                free(totals);
                free(hosts);
                free(secs);
            }
    /* Offloaded segment inputs save device memory from four segments on (the
     * staging ring holds three): 8 layers at each fixed K, against every
     * per-layer mode of 0, 1 and 3 (a subspace: auto may only do better),
     * the segment inputs offloaded or not (K = 2: four segments; K = 3:
     * three, where offloading saves nothing), host memory for all of them. */
    for (int c = 0; c < NUM_COST_MODEL_DEFAULTS + 2; c++)
        for (int K = 2; K <= 3; K++) {
            enum { L8 = 8 };
            PlanSpec s = small_gpu_spec(L8, c < NUM_COST_MODEL_DEFAULTS ? cost_model_defaults[c] : c == NUM_COST_MODEL_DEFAULTS ? slow_memory : slow_link);
            s.segment_layers = K;
            static const int sub[3] = {0, 1, 3};
            int n = 2 * 6561;
            size_t* totals = (size_t*)malloc_check((size_t)n * sizeof(size_t), "test");
            size_t* hosts = (size_t*)malloc_check((size_t)n * sizeof(size_t), "test");
            double* secs = (double*)malloc_check((size_t)n * sizeof(double), "test");
            unsigned char modes[L8], offload[L8], chosen[L8], chosen_off[L8];
            size_t lo = SIZE_MAX, hi = 0, host_hi = 0;
            for (int i = 0; i < n; i++) {
                for (int l = 0, r = i % 6561; l < L8; l++, r /= 3) { modes[l] = (unsigned char)sub[r % 3]; offload[l] = (unsigned char)(i >= 6561); }
                s.layer_mode = modes; s.layer_offload = offload;
                totals[i] = plan_totals_for(&s, -1, s.B, s.T, &hosts[i]);
                secs[i] = plan_predicted_seconds_offload(&s, modes, offload, NULL);
                if (totals[i] < lo) lo = totals[i];
                if (totals[i] > hi) hi = totals[i];
                if (hosts[i] > host_hi) host_hi = hosts[i];
            }
            for (int step = 0; step <= 20; step++) {
                size_t budget = lo + (hi - lo) / 20 * (size_t)step, host_budget = host_hi;
                double best = -1.0;
                for (int j = 0; j < n; j++)
                    if (totals[j] <= budget && hosts[j] <= host_budget && (best < 0 || secs[j] < best)) best = secs[j];
                s.layer_mode = NULL; s.layer_offload = NULL; s.segment_layers = K;
                int rc = recompute_auto_plan(&s, budget, host_budget, 0, 0, chosen, chosen_off);
                checked++;
                if (rc != 0 && best < 0) continue;
                s.layer_mode = chosen; s.layer_offload = chosen_off;
                size_t host = 0, t = plan_totals_for(&s, -1, s.B, s.T, &host);
                double secs_auto = plan_predicted_seconds_offload(&s, chosen, chosen_off, NULL);
                offloaded_segments += rc == 0 && host > 0;
                if (rc != 0 || t > budget || host > host_budget || (best >= 0 && secs_auto > best * (1 + 1e-12))) {
                    printf("  FAIL auto segments L=8 K=%d %s budget %zu host %zu: rc %d, %zu bytes, host %zu, %.9g s; exhaustive best %.9g s\n", K,
                           s.cost_model.name, budget, host_budget, rc, t, host, secs_auto, best);
                    failures++;
                }
            }
            free(totals);
            free(hosts);
            free(secs);
        }
    if (segment_choices == 0 || offloaded_segments == 0) {
        printf("  FAIL auto segments: %d cases chose segments, %d offloaded their inputs: a dimension went untested\n", segment_choices, offloaded_segments);
        failures++;
    }
    printf("auto with segments against exhaustive search: %d (L, cost model, offloading, budget) cases, %d chose segments, %d offloaded them\n",
           checked, segment_choices, offloaded_segments);
}

/* The CPU trainer's plans (one memory: host_shares_budget) of tiny models,
 * B*T = 48 rows (not a power of two): an exhaustive search over every
 * per-layer mode, K = 1 to L and every tile size the trainer accepts (0 and
 * 1 to 48 rows, not only the candidates), each planned by plan_build. At
 * budgets from below the least total found to above it, -r auto with tiles
 * and segments searched (recompute_auto_plan) finds a plan exactly when the
 * exhaustive search does, and plan_build says its plan fits; the
 * suggestions' least plan (plan_least_layout) is the exhaustive least. */
static void check_auto_finds_whatever_fits_on_the_cpu(void) {
    int checked = 0;
    for (int L = 1; L <= 4; L++)
        for (int shape = 0; shape < 2; shape++) {
            PlanSpec s;
            memset(&s, 0, sizeof(s));
            s.cfg = test_config(L, 2, shape ? 48 : 32, 50, 48);
            s.B = shape ? 1 : 2; s.T = shape ? 48 : 24; s.backend = BACKEND_CPU; s.elem_bytes = 4; s.stat_bytes = 4;
            s.world_size = 1; s.logits_chunk_rows = 16; s.io_chunk_floats = 1 << 10; s.host_shares_budget = 1;
            s.cost_model = cost_model_defaults[0];
            int cand[PLAN_MAX_TILE_CANDIDATES], n = plan_tile_candidates(&s, cand), want[7] = {0, 32, 16, 8, 4, 2, 1};
            if (n != 7 || memcmp(cand, want, sizeof(want)) != 0) {
                printf("  FAIL tile candidates of 48 rows: %d of them, not untiled and 32 down to 1\n", n);
                failures++;
            }
            int codes = 1;
            for (int l = 0; l < L; l++) codes *= 4;
            unsigned char modes[4], chosen[4];
            size_t least = SIZE_MAX;
            for (int tile = 0; tile <= 48; tile++)
                for (int K = 1; K <= L; K++)
                    for (int code = 0; code < codes; code++) {
                        for (int l = 0, r = code; l < L; l++, r /= 4) modes[l] = (unsigned char)(r % 4);
                        s.layer_mode = modes; s.tile_tokens = tile; s.segment_layers = K;
                        size_t t = plan_total_for(&s, -1, s.B, s.T);
                        if (t < least) least = t;
                    }
            PlanSpec probe = s;
            probe.layer_mode = NULL;
            expect_eq("the suggestions' least plan against the exhaustive least", plan_least_layout(&probe), least);
            size_t budgets[5] = {least - 4096, least - 1, least, least + 1, least + least / 8};
            for (int i = 0; i < 5; i++) {
                s.layer_mode = NULL; s.tile_tokens = 0; s.segment_layers = 1;
                int rc = recompute_auto_plan(&s, budgets[i], 0, 1, 1, chosen, NULL);
                checked++;
                int exhaustive = budgets[i] >= least;
                s.layer_mode = chosen;
                size_t t = rc == 0 ? plan_total_for(&s, -1, s.B, s.T) : 0;
                if ((rc == 0) != exhaustive || t > budgets[i]) {
                    printf("  FAIL auto on the cpu L=%d shape %d budget %zu: rc %d (K %d, tile %d, %zu bytes); exhaustive least %zu\n", L,
                           shape, budgets[i], rc, s.segment_layers, s.tile_tokens, t, least);
                    failures++;
                }
            }
        }
    printf("auto on the cpu finds a plan whenever an exhaustive search over modes, segments and every tile does: %d cases\n", checked);
}

/* The tile costs against the formula of llmc/plan/cost_model.h written out
 * here: -r 0 and -r 1 at K rows over untiled, per micro-step and layer,
 * 4 (n-1) passes (-r 1: 5) and the block matmuls' 72 N C^2 (-r 1: 88)
 * FLOPs at h / K of the matmul rate more, and -r 1's LN1 again (2 N C E). */
static void check_tile_cost_formula(void) {
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    s.cfg = test_config(3, 4, 64, 50, 256);
    s.B = 2; s.T = 250; s.backend = BACKEND_GPU; s.elem_bytes = 2; s.stat_bytes = 4; s.world_size = 1;
    s.logits_chunk_rows = 64; s.io_chunk_floats = 1 << 10; s.grad_accum = 3;
    s.cost_model = cost_model_defaults[COST_MODEL_H100];
    const CostModel* cm = &s.cost_model;
    double N = 500, C = 64, E = 2, L = 3, K = 64, n = 8; /* ceil(500 / 64) */
    unsigned char r1[3] = {1, 1, 1};
    double untiled0 = plan_predicted_seconds(&s, NULL, NULL), untiled1 = plan_predicted_seconds(&s, r1, NULL);
    s.tile_tokens = 64;
    double tiled0 = plan_predicted_seconds(&s, NULL, NULL), tiled1 = plan_predicted_seconds(&s, r1, NULL);
    double want0 = 3 * L * (4 * (n - 1) * cm->tile_pass_s + 72 * N * C * C / K * cm->matmul_half_rows / cm->matmul_flops_per_s);
    double want1 = 3 * L * (5 * (n - 1) * cm->tile_pass_s + 88 * N * C * C / K * cm->matmul_half_rows / cm->matmul_flops_per_s +
                            2 * N * C * E / cm->memory_bytes_per_s);
    if (fabs((tiled0 - untiled0) - want0) > 1e-9 * want0 || fabs((tiled1 - untiled1) - want1) > 1e-9 * want1) {
        printf("  FAIL tile cost: -r 0 %.9g s (formula %.9g), -r 1 %.9g s (formula %.9g)\n", tiled0 - untiled0, want0, tiled1 - untiled1, want1);
        failures++;
    }
    printf("tile costs: -r 0 and -r 1 at 64 of 500 rows equal the formula\n");
}

/* The least over all pairings of 2N chunks into N members of the busiest
 * member's work (chunks a bitmask of those not yet paired). */
static int64_t least_busiest(const int64_t* work, int n, unsigned chunks) {
    if (!chunks) return 0;
    int a = __builtin_ctz(chunks);
    int64_t best = INT64_MAX;
    for (int b = a + 1; b < n; b++) {
        if (!(chunks >> b & 1)) continue;
        int64_t rest = least_busiest(work, n, chunks & ~(1u << a) & ~(1u << b)), pair = work[a] + work[b];
        int64_t most = rest > pair ? rest : pair;
        best = most < best ? most : best;
    }
    return best;
}

/* Under context parallelism the time model prices the busiest member's
 * attention (the ring's steps wait for it): 4 C per pair of that member,
 * whose pairs are here counted query by query for packed documents and
 * minimised over every pairing of the chunks, as the loader pairs them. */
static void check_ring_busiest_member_pricing(void) {
    static const int Ns[] = {2, 3, 4}, docs[] = {0, 5, 17, 40, 96, 500};
    int checked = 0;
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 6; j++) {
            int N = Ns[i], T = 24 * N * 2, Tc = T / (2 * N), L = docs[j] > 0 && docs[j] < T ? docs[j] : T;
            PlanSpec s;
            memset(&s, 0, sizeof(s));
            s.cfg = test_config(2, 2, 16, 50, T);
            s.B = 3; s.T = T; s.doc_len = docs[j]; s.context_parallel = N; s.world_size = N; s.backend = BACKEND_CPU;
            int64_t work[8];
            for (int c = 0; c < 2 * N; c++) {
                work[c] = 0;
                for (int p = c * Tc; p < (c + 1) * Tc; p++) work[c] += p % L + 1;
            }
            double want = 4.0 * 3 * 16 * (double)least_busiest(work, 2 * N, (1u << 2 * N) - 1), got = attention_forward_flops(&s);
            if (got != want) {
                printf("  FAIL ring pricing N=%d T=%d documents of %d: %.17g FLOPs, the busiest member's %.17g\n", N, T, docs[j], got, want);
                failures++;
            }
            checked++;
        }
    printf("ring pricing: %d settings priced at the busiest member's attention\n", checked);
}

/* Timed transfers from a known link fit back to it: two sizes give
 * bandwidth and latency, one size the bandwidth around the assumed
 * latency; the host link is bytes over seconds. */
static void check_link_calibration(void) {
    double bw = 3.3e9, lat = 7e-6, got_bw = 0, got_lat = 0;
    LinkTimes two = {0}, one = {0}, none = {0};
    for (int i = 0; i < 6; i++) {
        double b = i % 2 ? 4.0e6 : 8.0e6;
        link_times_add(&two, b, lat + b / bw);
        link_times_add(&one, 4.0e6, lat + 4.0e6 / bw);
    }
    if (link_fit(&two, 1e-3, &got_bw, &got_lat) != 0 || fabs(got_bw - bw) > 1e-9 * bw || fabs(got_lat - lat) > 1e-9 * lat) {
        printf("  FAIL ring link from two sizes: %.9g B/s %.9g s, want %.9g %.9g\n", got_bw, got_lat, bw, lat);
        failures++;
    }
    if (link_fit(&one, lat, &got_bw, &got_lat) != 1 || fabs(got_bw - bw) > 1e-9 * bw || got_lat != lat) {
        printf("  FAIL ring link from one size: %.9g B/s %.9g s\n", got_bw, got_lat);
        failures++;
    }
    if (link_fit(&none, lat, &got_bw, &got_lat) >= 0) { printf("  FAIL ring link fitted from no transfers\n"); failures++; }
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    s.backend = BACKEND_CPU;
    LinkTimes host = {0};
    link_times_add(&host, 3.0e6, 3.0e6 / 2.5e9);
    link_times_add(&host, 5.0e5, 5.0e5 / 2.5e9);
    CostModel cm = cost_model_defaults[COST_MODEL_CPU];
    int measured = cost_model_add_links(&s, &host, &two, &cm);
    if (measured != 2 || fabs(cm.host_link_bytes_per_s - 2.5e9) > 1e-9 * 2.5e9 || fabs(cm.ring_bytes_per_s - bw) > 1e-9 * bw) {
        printf("  FAIL links into the cost model: %d measured, host %.9g B/s, ring %.9g B/s\n", measured, cm.host_link_bytes_per_s,
               cm.ring_bytes_per_s);
        failures++;
    }
    printf("link calibration: bandwidth and latency recovered from synthetic transfer times\n");
}

/* Phase times made from known rates calibrate back to those rates (a
 * tiled run: the tiles' costs, at the spec's tile rates, come out before
 * the matmul rate), and a written calibration file reads back equal (to its
 * 6 significant digits) in every rate, the links' and tiles' included. */
/* Calibration from synthetic phase times of a step of `preset` (modes per
 * layer, 3 micro-steps, tiles of 1024, B = 4, T = 1024) recovers the rates
 * the times were made with; the attention FLOPs are counted here, 4 x the
 * query heads' width (NH HD, passed by hand) per causal pair: 3.5x that
 * forward with backward, 4.5x when -r 1 recomputes it. Returns the spec
 * (with `times` and the calibrated model) for the caller's further checks. */
static PlanSpec calibration_recovers(const char* preset, const unsigned char* modes, double q_width, PhaseTimes* t, CostModel* got) {
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    config_from_descriptor(preset, &s.cfg);
    s.B = 4; s.T = 1024; s.backend = BACKEND_GPU; s.elem_bytes = 2; s.stat_bytes = 4; s.master_weights = 1;
    s.world_size = 1; s.grad_accum = 3; s.layer_mode = modes; s.tile_tokens = 1024;
    CostModel truth = {"truth", 4.1e14, 1.7e14, 2.2e12, 5e10, 2e-5, 300.0, 4e9, 3e-6, 0, 0, 0, 0};
    s.cost_model = truth;
    double att = 0.0;
    for (int l = 0; l < s.cfg.num_layers; l++) att += (modes[l] == 1 ? 4.5 : 3.5) * 2.0 * 4 * 1024.0 * 1025.0 * q_width;
    att *= 3;
    Work all = step_work(&s, modes), upd = update_work(&s);
    if (fabs(all.attention_flops - att) > 1e-9 * att) { printf("  FAIL %s attention FLOPs %.6g, counted %.6g\n", preset, all.attention_flops, att); failures++; }
    double compute_ms = 1e3 * (work_seconds(all, &truth) - work_seconds(upd, &truth));
    t->attention_ms = 1e3 * att / truth.attention_flops_per_s;
    t->update_ms = 1e3 * upd.memory_bytes / truth.memory_bytes_per_s;
    t->forward_ms = 0.3 * compute_ms; t->classifier_ms = 0.1 * compute_ms; t->backward_ms = 0.6 * compute_ms;
    char why[200];
    memset(got, 0, sizeof(*got));
    if (cost_model_calibrate(&s, t, got, why, sizeof(why)) != 0) { printf("  FAIL %s calibrate: %s\n", preset, why); failures++; return s; }
    double want[3] = {truth.matmul_flops_per_s, truth.attention_flops_per_s, truth.memory_bytes_per_s};
    double have[3] = {got->matmul_flops_per_s, got->attention_flops_per_s, got->memory_bytes_per_s};
    for (int k = 0; k < 3; k++)
        if (fabs(have[k] - want[k]) > 1e-9 * want[k]) { printf("  FAIL %s calibrated rate %d: %.9g, want %.9g\n", preset, k, have[k], want[k]); failures++; }
    return s;
}

static void check_calibration_round_trip(void) {
    unsigned char modes[30] = {1, 1, 3, 3, 3, 2, 2, 0, 0, 0, 0, 0};
    PhaseTimes t;
    CostModel got;
    char why[200];
    /* the Llama block's calibration (REMAT_PROFILE on a smollm2-135m run): 9 query heads of 64 on 3 K/V heads */
    unsigned char llama_modes[30];
    for (int l = 0; l < 30; l++) llama_modes[l] = (unsigned char)"1320"[l % 4] - '0';
    calibration_recovers("smollm2-135m", llama_modes, 9 * 64, &t, &got);
    PlanSpec s = calibration_recovers("d12", modes, 768, &t, &got);
    char path[] = "/tmp/remat_cost_model_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) { printf("  FAIL mkstemp\n"); failures++; return; }
    close(fd);
    snprintf(got.name, sizeof(got.name), "round trip");
    cost_model_write(&got, path, "test");
    CostModel back;
    cost_model_read(path, &back);
    unlink(path);
    for (int k = 0; k < NUM_COST_MODEL_KEYS; k++) {
        double r = *cost_model_field(&back, k), w = *cost_model_field(&got, k);
        if (!(w > 0) || fabs(r - w) > 1e-5 * w) { printf("  FAIL file round trip %s: %.9g, wrote %.9g\n", cost_model_keys[k].key, r, w); failures++; }
    }
    if (strcmp(back.name, "round trip") != 0) { printf("  FAIL file round trip name '%s'\n", back.name); failures++; }
    t.forward_ms = t.classifier_ms = t.backward_ms = 0.2 * t.attention_ms;
    if (cost_model_calibrate(&s, &t, &got, why, sizeof(why)) == 0) { printf("  FAIL calibrate accepted times with no room for matmuls\n"); failures++; }
    printf("calibration: rates recovered from synthetic phase times; file round trip\n");
}

/* What an out-of-memory report suggests, on a GPU spec with master
 * weights: between -r 3's and -r 0's totals, -r auto's mix, -r 3 and -r 1
 * on every layer, and -w 0; below -r 1's total but above the least plan
 * with tiles and segments, those at this -b and -t and no shorter -t; below
 * the least plan, a shorter -t; under context parallelism the levers of the
 * run's own processes (ZeRO-1) before a smaller batch. */
static void expect_contains(const char* text, const char* needle) {
    if (!strstr(text, needle)) { printf("  FAIL suggestions lack '%s':\n%s", needle, text); failures++; }
}

static void expect_lacks(const char* text, const char* needle) {
    if (strstr(text, needle)) { printf("  FAIL suggestions have '%s':\n%s", needle, text); failures++; }
}

static char* suggestions_at(const PlanSpec* s, size_t budget) {
    char* text = NULL;
    size_t len = 0;
    FILE* f = open_memstream(&text, &len);
    plan_print_suggestions(s, budget, f);
    fclose(f);
    return text;
}

static void check_suggestions(void) {
    ModelConfig wide;
    config_from_descriptor("d24", &wide);
    wide.channels = 2048; wide.num_heads = 16; wide.max_seq_len = 8192;
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    s.cfg = wide; s.B = 1; s.T = 8192; s.backend = BACKEND_GPU; s.elem_bytes = 2; s.stat_bytes = 4; s.master_weights = 1;
    s.world_size = 1; s.logits_chunk_rows = 2048; s.io_chunk_floats = 1 << 18;
    size_t t3 = plan_total_for(&s, RECOMPUTE_KEEP_ATTENTION, 1, 8192), t1 = plan_total_for(&s, RECOMPUTE_FULL, 1, 8192);
    PlanSpec probe = s;
    size_t least = plan_least_layout(&probe);
    if (!(least < t1)) { printf("  FAIL the least plan with tiles and segments (%zu) is not below -r 1's (%zu)\n", least, t1); failures++; }
    char* text = suggestions_at(&s, t3 + 1);
    expect_contains(text, "-r auto: the fastest predicted mix that fits, here -r ");
    expect_contains(text, "-r 3 on every layer");
    expect_contains(text, "-r 1 on every layer");
    expect_contains(text, "-w 0 -r ");
    free(text);
    text = suggestions_at(&s, (least + t1) / 2);
    expect_contains(text, "token tiles and segment checkpointing, keeping the batch and the sequence length");
    expect_lacks(text, " -t ");
    expect_lacks(text, " -b ");
    expect_lacks(text, "-r auto");
    free(text);
    text = suggestions_at(&s, least - 1);
    expect_contains(text, " -t ");
    expect_lacks(text, "-r auto");
    expect_lacks(text, "keeping the batch");
    free(text);
    /* context parallelism: 2 processes share each sequence, one group of B=4,
     * so a step is 4 x 8192 tokens (not x processes), which -d must keep;
     * ZeRO-1 over the two is the lever where it fits, else a smaller -b */
    s.B = 4; s.world_size = 2; s.context_parallel = 2;
    probe = s;
    probe.zero_stage = 1;
    size_t least_z1 = plan_least_layout(&probe);
    text = suggestions_at(&s, least_z1);
    expect_contains(text, " -z 1: ZeRO-1 shards the optimizer state over this run's 2 processes");
    expect_lacks(text, " -b ");
    free(text);
    s.zero_stage = 1; /* sharded already: a smaller batch is what is left */
    probe = s;
    probe.B = 2;
    text = suggestions_at(&s, plan_least_layout(&probe));
    expect_contains(text, " -b 2 -d 32768 (the same 32768 tokens per step");
    if (strstr(text, " -b 4 ")) { printf("  FAIL suggested this run's -b 4 (ZeRO-1 it does not say):\n%s", text); failures++; }
    free(text);
    printf("out-of-memory suggestions: -r auto, -r 3, -r 1, -w 0; tiles and segments before a shorter -t; ZeRO-1, then -d, under context parallelism\n");
}

/* Row offsets past 2^31 elements: GPT-2 1.5B's widths (C = 1600, QKV 4800,
 * MLP 6400) at T = 4,194,304 (-t's limit), the last row of each activation,
 * against the products in 64 bits written out here; with token tiles, what a
 * layer does not keep lives in a one-tile buffer (offset 0). */
static void check_wide_row_offsets(void) {
    ModelConfig d48;
    config_from_descriptor("d48", &d48);
    d48.max_seq_len = 4194304;
    unsigned char all1[48];
    memset(all1, 1, sizeof(all1));
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    s.cfg = d48; s.B = 1; s.T = 4194304; s.backend = BACKEND_GPU; s.elem_bytes = 2; s.stat_bytes = 4; s.master_weights = 1;
    s.world_size = 1; s.logits_chunk_rows = 1024; s.io_chunk_floats = 1 << 18; s.layer_mode = NULL;
    MemoryPlan p;
    plan_build(&p, &s);
    const int r0 = 4194303;
    const size_t C = 1600, r = (size_t)r0;
    expect_eq("row offset of x past 2^31", plan_act_row_offset(&p, 3, ACT_X, r0), r * C);
    expect_eq("row offset of qkv past 2^31", plan_act_row_offset(&p, 3, ACT_QKV, r0), r * 3 * C);
    expect_eq("row offset of fch past 2^31", plan_act_row_offset(&p, 3, ACT_FCH, r0), r * 4 * C);
    expect_eq("row offset of the attention lse", plan_act_row_offset(&p, 3, ACT_ATT_LSE, r0), r * 25);
    expect_eq("row offset of a norm's mean", plan_act_row_offset(&p, 3, ACT_LN2_MEAN, r0), r);
    s.tile_tokens = 4096; s.layer_mode = all1;
    plan_build(&p, &s);
    const int tile_r0 = r0 / 4096 * 4096;
    expect_eq("tiles: x kept, row offset past 2^31", plan_act_row_offset(&p, 3, ACT_X, tile_r0), (size_t)tile_r0 * C);
    expect_eq("tiles: fch in a one-tile buffer", plan_act_row_offset(&p, 3, ACT_FCH, tile_r0), 0);
    printf("row offsets past 2^31 elements (d48 at T = 4194304)%s\n", failures ? "" : ": ok");
}

int main(void) {
    ModelConfig d12, d48, wide, tiny;
    config_from_descriptor("d12", &d12);
    config_from_descriptor("d48", &d48);
    wide = d12; wide.num_layers = 24; wide.channels = 2048; wide.num_heads = 16; wide.max_seq_len = 32768;
    tiny = test_config(3, 2, 32, 50, 16);
    unsigned char all1[48], all2[48], all3[48], mixed[48], mixed4[48], first5[48], sel_keep_att[48];
    memset(all1, 1, 48); memset(all2, 2, 48); memset(all3, 3, 48); memset(first5, 0, 48); memset(first5, 1, 5);
    for (int i = 0; i < 48; i++) {
        mixed[i] = (unsigned char)(i % 3);
        mixed4[i] = (unsigned char)(i % 4);
        sel_keep_att[i] = (unsigned char)(i % 2 ? 3 : 2);
    }
    check("d12 fp32 B=4 T=1024 -r 0", d12, 4, 1024, 4, 1, 0, NULL);
    check("d12 bf16 B=4 T=1024 -r 1", d12, 4, 1024, 2, 1, 0, all1);
    check("d12 bf16 B=4 T=1024 -r 2", d12, 4, 1024, 2, 1, 0, all2);
    check("d12 bf16 -r 1 first 5 layers", d12, 4, 1024, 2, 1, 0, first5);
    check("d48 bf16 B=1 T=1024 mixed, ZeRO-1 x8", d48, 1, 1024, 2, 8, 1, mixed);
    check("24x2048 fp16 B=4 T=8192 -r 1", wide, 4, 8192, 2, 1, 0, all1);
    check("24x2048 fp16 B=4 T=2048 -r 0", wide, 4, 2048, 2, 1, 0, NULL);
    check("tiny fp32 ZeRO-1 x3 -r 2", tiny, 2, 16, 4, 3, 1, all2);
    check("d12 bf16 B=4 T=1024 -r 3", d12, 4, 1024, 2, 1, 0, all3);
    check("24x2048 bf16 B=1 T=32768 -r 3", wide, 1, 32768, 2, 1, 0, all3);
    check("d48 bf16 mixed 0/1/2/3", d48, 1, 1024, 2, 1, 0, mixed4);
    check("d12 fp32 mixed 2/3", d12, 2, 512, 4, 1, 0, sel_keep_att);
    check_allocation();
    check_llama_widths();
    check_wide_row_offsets();
    check_llama_work();
    check_auto_against_exhaustive();
    search_llama = 1;
    check_auto_against_exhaustive();
    search_llama = 0;
    check_auto_offload_against_exhaustive();
    check_offloaded_optimizer_sizes();
    check_grads_fp32_range();
    check_auto_place_against_exhaustive();
    check_optimizer_offload_time();
    check_auto_tiles_against_exhaustive();
    check_rank_parallel();
    check_segments_at_against_exhaustive();
    check_auto_segments_against_exhaustive();
    check_auto_finds_whatever_fits_on_the_cpu();
    check_tile_cost_formula();
    check_ring_busiest_member_pricing();
    check_link_calibration();
    check_calibration_round_trip();
    check_suggestions();
    printf("%s: memory plan, %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
