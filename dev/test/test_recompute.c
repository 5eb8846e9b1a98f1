/*
 * Losses, every gradient and the parameters after AdamW are bitwise equal
 * across recompute settings: -r 0, -r 1 on all layers and on subsets,
 * -r 2, -r 3 (attention kept) and mixes of all four, over several optimizer steps (docs/DESIGN.md: recompute
 * trades time for memory and nothing else). Then all again with dropout at
 * every site and two micro-steps per step: every recompute must draw the
 * masks its forward drew (the same step, micro-step, layer and site).
 * Offloaded checkpoints (1o, 3o) are in the same comparison: their tensors
 * go through the host pool and a staging ring of 3 slots, which 4 layers
 * wrap around, and a released slot holds NaN, so a missing copy shows.
 * And token tiles (the last number: rows per tile of the B*T = 32; 0
 * untiled): the token-wise work in tiles, weight gradients added up over
 * them in row order, so the same bits as untiled on the CPU.
 * All of it twice: on GPT-2's block, and on the configurable block (a
 * Llama shape: RMSNorm, llama3-scaled RoPE, 4 query heads on 2 K/V heads of
 * 12 (NH HD 48 > C 32), SwiGLU, q/k/v biases, untied head), where -r 2
 * recomputes the norms and SwiGLU's product, and segments of 2 layers join
 * the settings.
 */
#define REMAT_NO_MAIN
#include "../../train_gpt.c"
#include "test_model.h"

#define L_TEST 4
#define STEPS 4

typedef struct { const char* name; unsigned char modes[L_TEST], offload[L_TEST]; int tile, segments; } Setting;

/* The shape under test: GPT-2's, then the configurable block's (main). */
static ModelConfig test_shape;

/* Runs STEPS steps (with dropout, of two micro-steps each); records each
 * step's loss and gradients, and the final parameters. */
static void run_setting(const Setting* s, const DropoutState* drop, float* losses, real* grads, real* params, size_t np) {
    TestModel tm;
    test_segment_layers = s->segments;
    test_model_create_tiled(&tm, test_shape, 2, 16, s->modes, s->offload, s->tile);
    test_segment_layers = 0;
    test_model_randomize(&tm, 5);
    int micro_steps = dropout_active(drop) ? 2 : 1;
    for (int step = 0; step < STEPS; step++) {
        cpu_zero_grads(&tm.m);
        losses[step] = 0;
        for (int micro = 0; micro < micro_steps; micro++) {
            test_model_tokens(&tm, 100 + 10 * step + micro);
            tm.m.train_dropout = *drop;
            tm.m.train_dropout.step = (uint32_t)step + 1;
            tm.m.train_dropout.micro_step = (uint32_t)micro;
            MicroBatch mb = {tm.m.inputs, tm.m.targets, micro, micro_steps};
            losses[step] += cpu_forward_backward(&tm.m, &mb, 1.0f);
        }
        memcpy(grads + (size_t)step * np, tm.m.grads, np * sizeof(real));
        AdamWStep a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f, .grad_scale = 1.0f, .t = step + 1};
        adamw_bias_corrections(&a);
        cpu_update(&tm.m, &a);
    }
    memcpy(params, tm.m.params, np * sizeof(real));
    test_model_free(&tm);
}

/* Every setting against -r 0 under one dropout state; returns the failures. */
static int compare_settings(const DropoutState* drop) {
    const Setting settings[] = {
        {"-r 0", {0, 0, 0, 0}, {0}, 0, 0},
        {"-r 1 all layers", {1, 1, 1, 1}, {0}, 0, 0},
        {"-r 1 first layer", {1, 0, 0, 0}, {0}, 0, 0},
        {"-r 1 every:2", {1, 0, 1, 0}, {0}, 0, 0},
        {"-r 1 last layer", {0, 0, 0, 1}, {0}, 0, 0},
        {"-r 2", {2, 2, 2, 2}, {0}, 0, 0},
        {"mixed 0/1/2", {2, 1, 0, 1}, {0}, 0, 0},
        {"-r 3", {3, 3, 3, 3}, {0}, 0, 0},
        {"-r 3 last layers", {0, 0, 3, 3}, {0}, 0, 0},
        {"mixed 0/1/2/3", {3, 1, 0, 2}, {0}, 0, 0},
        {"mixed 3/1", {1, 3, 1, 3}, {0}, 0, 0},
        {"-r 1 offloaded", {1, 1, 1, 1}, {1, 1, 1, 1}, 0, 0},
        {"-r 3 offloaded", {3, 3, 3, 3}, {1, 1, 1, 1}, 0, 0},
        {"mixed 1o/3/3o/0", {1, 3, 3, 0}, {1, 0, 1, 0}, 0, 0},
        {"mixed 2/1o/0/3o", {2, 1, 0, 3}, {0, 1, 0, 1}, 0, 0},
        {"1o last layer", {0, 0, 0, 1}, {0, 0, 0, 1}, 0, 0},
        {"3o/1/3o/1o", {3, 1, 3, 1}, {1, 0, 1, 1}, 0, 0},
        {"-r 0 tiles of 5", {0, 0, 0, 0}, {0}, 5, 0},
        {"-r 1 tiles of 5", {1, 1, 1, 1}, {0}, 5, 0},
        {"-r 2 tiles of 7", {2, 2, 2, 2}, {0}, 7, 0},
        {"-r 3 tiles of 16", {3, 3, 3, 3}, {0}, 16, 0},
        {"mix tiles of 1", {3, 1, 0, 2}, {0}, 1, 0},
        {"1o/3o tiles of 32", {1, 3, 1, 3}, {1, 1, 0, 1}, 32, 0},
        {"2/1o/0/3o tiles 9", {2, 1, 0, 3}, {0, 1, 0, 1}, 9, 0},
        {"segments of 2, -r 1", {1, 1, 1, 1}, {0}, 0, 2},
        {"segments 2, 2/3/0/1", {2, 3, 0, 1}, {0}, 0, 2},
        {"segments 2o, tiles 5", {1, 1, 1, 1}, {1, 0, 1, 0}, 5, 2},
    };
    int n_settings = (int)(sizeof(settings) / sizeof(settings[0]));
    ParamLayout pl;
    param_layout(&test_shape, &pl);
    size_t np = pl.total;
    float ref_losses[STEPS], losses[STEPS];
    real* ref_grads = (real*)malloc_check(STEPS * np * sizeof(real), "test");
    real* grads = (real*)malloc_check(STEPS * np * sizeof(real), "test");
    real* ref_params = (real*)malloc_check(np * sizeof(real), "test");
    real* params = (real*)malloc_check(np * sizeof(real), "test");
    printf("\n%s\n", dropout_active(drop) ? "dropout 0.2 at every site, 2 micro-steps per step" : "no dropout");
    run_setting(&settings[0], drop, ref_losses, ref_grads, ref_params, np);
    int failures = 0;
    for (int i = 1; i < n_settings; i++) {
        run_setting(&settings[i], drop, losses, grads, params, np);
        int same_loss = memcmp(losses, ref_losses, sizeof(losses)) == 0;
        int same_grads = memcmp(grads, ref_grads, STEPS * np * sizeof(real)) == 0;
        int same_params = memcmp(params, ref_params, np * sizeof(real)) == 0;
        int ok = same_loss && same_grads && same_params;
        printf("%-18s losses %s, gradients %s, parameters %s  %s\n", settings[i].name, same_loss ? "equal" : "DIFFER",
               same_grads ? "equal" : "DIFFER", same_params ? "equal" : "DIFFER", ok ? "ok" : "FAIL");
        failures += !ok;
    }
    printf("losses by step (reference):");
    for (int s = 0; s < STEPS; s++) printf(" %.6f", (double)ref_losses[s]);
    printf("\n");
    /* the comparison must be able to fail: the steps really changed the model */
    int moved = ref_losses[STEPS - 1] != ref_losses[0];
    if (!moved) { printf("losses did not change over the steps\n"); failures++; }
    free(ref_grads); free(grads); free(ref_params); free(params);
    return failures;
}

int main(void) {
    DropoutState drop = {{0.2f, 0.2f, 0.2f, 0.2f}, 11, 0, 0, 0, 0, 0};
    test_shape = test_config(L_TEST, 2, 32, 50, 16);
    int failures = compare_settings(&dropout_off) + compare_settings(&drop);
    test_shape = test_llama_config(L_TEST, 4, 2, 12, 32, 40, 50, 16);
    test_shape.rope_scaling = ROPE_LLAMA3;
    test_shape.rope_factor = 8.0f;
    test_shape.rope_low = 1.0f;
    test_shape.rope_high = 4.0f;
    test_shape.rope_original_max = 32;
    test_shape.bias = BIAS_QKV;
    printf("\nthe configurable block: llama3 RoPE, RMSNorm, GQA 4/2 heads of 12, SwiGLU 40, q/k/v bias, untied head\n");
    failures += compare_settings(&dropout_off) + compare_settings(&drop);
    printf("%s: recompute bitwise equality, %d setting(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
