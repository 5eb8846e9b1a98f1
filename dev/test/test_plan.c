/*
 * The memory plan against closed-form counts written out independently here
 * (DESIGN.md's tables), for several shapes, precisions, recompute settings
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

/* Elements per token per layer kept by each mode (DESIGN.md). */
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
    printf("%s: memory plan, %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
