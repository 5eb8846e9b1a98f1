/*
 * Finite-difference check of every parameter gradient of the configurable
 * block (model.h's switches) in the fp64 build, as test_gradcheck.c does for
 * GPT-2: central differences with h = 1e-5 against the backward, 1e-6
 * relative. Tiny shapes with grouped-query attention (NKV < NH, NH x HD !=
 * C), RMSNorm, RoPE of each scaling type (default, linear, llama3 with
 * frequencies on both sides of its ramp and on it, yarn with its ramp and
 * attention factor), SwiGLU, q/k/v biases (Qwen2), an untied head and a
 * tied one; and one with GELU of F != 4C, learned positions and LayerNorm
 * without bias, so the switches mix. Recompute modes -r 1 and -r 2, and
 * once token tiles and segments, so recomputed RoPE and SwiGLU are in the
 * path too.
 */
#define REMAT_NO_MAIN
#include "../../train_gpt.c"
#include "test_model.h"

typedef struct {
    const char* name;
    ModelConfig cfg;
    int tile, segments;
} Case;

/* Checks every gradient element of one case; returns the tensors that failed. */
static int check_case(const Case* c) {
    unsigned char modes[3] = {RECOMPUTE_FULL, RECOMPUTE_SELECTIVE, RECOMPUTE_KEEP_ATTENTION};
    TestModel tm;
    test_segment_layers = c->segments;
    test_model_create_tiled(&tm, c->cfg, 2, 5, modes, NULL, c->tile);
    test_segment_layers = 0;
    test_model_randomize(&tm, 42);
    test_model_tokens(&tm, 43);
    CpuModel* m = &tm.m;
    cpu_zero_grads(m);
    MicroBatch mb = {m->inputs, m->targets, 0, 1};
    double loss = cpu_forward_backward(m, &mb, 1.0f);
    printf("\n%s: loss %.12f\n", c->name, loss);
    int failures = test_model_check_gradients(&tm, 1e-5, 1e-9, 1e-6);
    test_model_free(&tm);
    return failures;
}

int main(void) {
    if (sizeof(real) != 8) { fprintf(stderr, "build this test with -DREMAT_FP64\n"); return 2; }
    /* theta 10000, HD 8: inv_freq 1, 0.1, 0.01, 0.001 (wavelengths 6.3, 63, 628, 6283) */
    ModelConfig llama = test_llama_config(3, 4, 2, 8, 8, 12, 37, 8);
    ModelConfig linear = llama, llama3 = llama, yarn = llama, qwen = llama, gelu = llama;
    linear.rope_scaling = ROPE_LINEAR;
    linear.rope_factor = 2.0f;
    /* original 64, low 1, high 4: wavelength 6.3 below 16 (kept), 63 on the ramp, 628 and 6283 beyond 64 (slowed) */
    llama3.rope_scaling = ROPE_LLAMA3;
    llama3.rope_factor = 4.0f;
    llama3.rope_low = 1.0f;
    llama3.rope_high = 4.0f;
    llama3.rope_original_max = 64;
    /* original 64, beta_fast 32, beta_slow 1: correction range [0, 2], ramp 0, 0.5, 1, 1 */
    yarn.rope_scaling = ROPE_YARN;
    yarn.rope_factor = 4.0f;
    yarn.rope_low = 32.0f;
    yarn.rope_high = 1.0f;
    yarn.rope_original_max = 64;
    /* Qwen2: one K/V head for four query heads, q/k/v biases, tied, theta 1e6, eps 1e-6 */
    qwen.family = FAMILY_QWEN2;
    qwen.num_kv_heads = 1;
    qwen.head_size = 2; /* NH HD = C: attention's gradients in the aliases over res2 and fch */
    qwen.bias = BIAS_QKV;
    qwen.tied = 1;
    qwen.rope_theta = 1000000.0f;
    qwen.norm_eps = 1e-6f;
    /* the switches mixed: GELU of F = 12, learned positions, LayerNorm without bias, every other bias */
    gelu.mlp = MLP_GELU;
    gelu.positions = POS_LEARNED;
    gelu.norm = NORM_LAYERNORM;
    gelu.bias = BIAS_QKV | BIAS_ATTPROJ | BIAS_MLP;
    const Case cases[] = {
        {"llama: GQA 4/2 heads of 8 (NH HD 32 > C 8), RMSNorm, RoPE default, SwiGLU, untied", llama, 0, 0},
        {"RoPE linear, factor 2", linear, 0, 0},
        {"RoPE llama3, factor 4, low 1, high 4, original 64", llama3, 0, 0},
        {"RoPE yarn, factor 4, beta 32/1, original 64, attention factor 0.1 ln 4 + 1", yarn, 0, 0},
        {"qwen2: 4 query heads on 1 K/V head, q/k/v bias, tied, theta 1e6", qwen, 0, 0},
        {"GELU F 12, learned positions, LayerNorm without bias, biases 1|2|4, GQA", gelu, 0, 0},
        {"llama3 RoPE in token tiles of 3 rows", llama3, 3, 0},
        {"yarn RoPE, segments of 2 layers, tiles of 4", yarn, 4, 2},
    };
    int failures = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) failures += check_case(&cases[i]);
    printf("%s: configurable-block gradient check, %d tensor(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
