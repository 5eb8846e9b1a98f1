/*
 * Helpers for the C tests that build the CPU reference in (train_gpt.c is
 * included before this file): a small model from a shape, recompute modes
 * and batch, with random parameters and tokens, without the command line.
 */
#ifndef REMAT_TEST_MODEL_H
#define REMAT_TEST_MODEL_H

typedef struct {
    MemoryPlan plan;
    CpuModel m;
} TestModel;

static ModelConfig test_config(int L, int NH, int C, int V, int maxT) {
    ModelConfig c;
    memset(&c, 0, sizeof(c)); /* no switches set: GPT-2 */
    c.max_seq_len = maxT;
    c.vocab_size = V;
    c.padded_vocab_size = pad_vocab(V);
    c.num_layers = L;
    c.num_heads = NH;
    c.channels = C;
    return c;
}

/* A configurable-family shape (model.h's switches): Llama's block (RMSNorm
 * eps 1e-5, RoPE theta 10000 unscaled, SwiGLU of width F, no biases,
 * untied head); callers change the switches they test. */
static ModelConfig test_llama_config(int L, int NH, int NKV, int HD, int C, int F, int V, int maxT) {
    ModelConfig c = test_config(L, NH, C, V, maxT);
    c.family = FAMILY_LLAMA;
    c.num_kv_heads = NKV;
    c.head_size = HD;
    c.ffn = F;
    c.norm = NORM_RMSNORM;
    c.norm_eps = 1e-5f;
    c.positions = POS_ROPE;
    c.rope_theta = 10000.0f;
    c.rope_scaling = ROPE_DEFAULT;
    c.rope_factor = 1.0f;
    c.mlp = MLP_SWIGLU;
    c.bias = 0;
    c.tied = 0;
    c.bos = c.eos = -1;
    config_validate(&c, "test shape");
    return c;
}

/* Layers per segment of the next model created (plan.h; 0: no segments). */
static int test_segment_layers = 0;

/* offload: per layer, the -r 1 or -r 3 layer's kept tensors in the host pool
 * (NULL: none); tile: rows per token tile (0: untiled). */
static void test_model_create_tiled(TestModel* tm, ModelConfig cfg, int B, int T, const unsigned char* modes, const unsigned char* offload,
                                    int tile) {
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    s.cfg = cfg;
    s.B = B;
    s.T = T;
    s.backend = BACKEND_CPU;
    s.elem_bytes = (int)sizeof(real);
    s.stat_bytes = (int)sizeof(real);
    s.world_size = 1;
    s.layer_mode = modes;
    s.layer_offload = offload;
    s.tile_tokens = tile;
    s.segment_layers = test_segment_layers;
    s.documents = PLAN_DOC_STARTS; /* the tests may pack documents into any model */
    s.logits_chunk_rows = 3; /* several chunks, one partial, even in tiny tests */
    s.io_chunk_floats = 1024;
    plan_build(&tm->plan, &s);
    cpu_model_create(&tm->m, &tm->plan);
}

static void test_model_create(TestModel* tm, ModelConfig cfg, int B, int T, const unsigned char* modes) {
    test_model_create_tiled(tm, cfg, B, T, modes, NULL, 0);
}

/* Init as the trainer does, then perturb every parameter (LayerNorm weights
 * and biases included) so no gradient term hides behind a 0 or a 1. */
static void test_model_randomize(TestModel* tm, uint64_t seed) {
    ParamLayout pl;
    param_layout(&tm->m.cfg, &pl);
    float* chunk = (float*)malloc_check(pl.total * sizeof(float), "test");
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) param_init_chunk(&tm->m.cfg, seed, t, 0, pl.count[t], chunk + pl.offset[t]);
    size_t real_wte = (size_t)tm->m.cfg.vocab_size * tm->m.cfg.channels;
    for (size_t i = 0; i < pl.total; i++) {
        size_t in_head = i - pl.offset[P_LMHEAD]; /* the untied head's padded rows stay 0 too */
        int padded = (i < real_wte ? 0 : i < pl.count[P_WTE]) || (i >= pl.offset[P_LMHEAD] && in_head >= real_wte);
        tm->m.params[i] = padded ? 0 : (real)chunk[i] + (real)0.1 * (real)rand_normal(seed, 99, i);
    }
    free(chunk);
}

static void test_model_tokens(TestModel* tm, uint64_t seed) {
    size_t N = (size_t)tm->plan.spec.B * tm->plan.spec.T;
    for (size_t i = 0; i < N; i++) {
        tm->m.inputs[i] = (int)(rand_u64(seed, 7, i) % (uint64_t)tm->m.cfg.vocab_size);
        tm->m.targets[i] = (int)(rand_u64(seed, 8, i) % (uint64_t)tm->m.cfg.vocab_size);
    }
}

static void test_model_free(TestModel* tm) {
    cpu_model_free(&tm->m);
    plan_free(&tm->plan);
}

/* The loss in full precision (the Backend interface rounds it to float),
 * with the dropout forward_backward ran with. */
static double test_model_loss(TestModel* tm) {
    tm->m.drop = &tm->m.train_dropout;
    model_forward(&tm->m, tm->m.inputs);
    classifier(&tm->m, tm->m.inputs, tm->m.targets, 0);
    return (double)mean_loss(&tm->m, tm->m.inputs);
}

/* Central differences (step h) of the loss against every parameter element
 * the configuration has, beside the gradients a forward_backward left in
 * m->grads: one line per tensor; returns the tensors whose worst element
 * is off by more than tol_abs + tol_rel |numeric|, or whose gradient is all
 * zero. For the fp64 builds (REMAT_FP64). */
static int test_model_check_gradients(TestModel* tm, double h, double tol_abs, double tol_rel) {
    CpuModel* m = &tm->m;
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    int failures = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (pl.count[t] == 0) continue; /* left out by the switches (GPT-2 has no lm_head) */
        double worst = 0, max_grad = 0;
        size_t worst_i = 0;
        for (size_t k = 0; k < pl.count[t]; k++) {
            size_t i = pl.offset[t] + k;
            real saved = m->params[i];
            m->params[i] = saved + h;
            double up = test_model_loss(tm);
            m->params[i] = saved - h;
            double down = test_model_loss(tm);
            m->params[i] = saved;
            double numeric = (up - down) / (2 * h), analytic = m->grads[i];
            double excess = fabs(analytic - numeric) / (tol_abs + tol_rel * fabs(numeric));
            if (excess > worst) { worst = excess; worst_i = k; }
            if (fabs(analytic) > max_grad) max_grad = fabs(analytic);
        }
        int ok = worst <= 1.0 && max_grad > 0;
        printf("%-9s %6zu elements  max|grad| %.3e  worst error/tolerance %.3f at %zu  %s\n", param_tensor_names[t],
               pl.count[t], max_grad, worst, worst_i, ok ? "ok" : "FAIL");
        failures += !ok;
    }
    return failures;
}

#endif
