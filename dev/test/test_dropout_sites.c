/*
 * Dropout where the CPU reference applies it, seen from its activations:
 *  - embedding: layer 0's x is the undropped sum times 1/keep, or exactly 0,
 *    and exactly where dropout_keep_flat says;
 *  - residual branches: a dropped branch element leaves the residual stream
 *    unchanged bit for bit (res2 == x after attention, the next x == res2
 *    after the MLP), and those elements are the ones the layout names;
 *  - attention probabilities: with q = k = 0 and v one-hot per position,
 *    out[t][u] = factor(t,u) / (t + 1), so each probability's mask shows;
 * each site's dropped fraction within 5 standard errors of p; the layers'
 * masks differ; and evaluation (forward_loss) and sampling
 * (next_token_probs) with dropout set give exactly what they give without.
 */
#define REMAT_NO_MAIN
#include "../../train_gpt.c"
#include "test_model.h"

#define P_TEST 0.25f

static int failures = 0;

/* Reports a site's dropped fraction and whether it lies within 5 standard errors of p. */
static void check_fraction(const char* site, size_t dropped, size_t n, size_t misplaced) {
    double frac = (double)dropped / (double)n, se = sqrt((double)P_TEST * (1.0 - P_TEST) / (double)n);
    int ok = fabs(frac - P_TEST) <= 5.0 * se && misplaced == 0;
    printf("%-28s dropped %6zu of %7zu = %.4f (p %.2f, 5 s.e. %.4f), %zu not where the layout says  %s\n", site, dropped, n, frac,
           (double)P_TEST, 5.0 * se, misplaced, ok ? "ok" : "FAIL");
    failures += !ok;
}

/* Compares `stream_after` with `stream_before` element by element: equal
 * means the branch was dropped there. */
static void check_residual_site(const char* name, const real* stream_after, const real* stream_before, size_t n, const DropoutSite* s) {
    size_t dropped = 0, misplaced = 0;
    for (size_t e = 0; e < n; e++) {
        int unchanged = stream_after[e] == stream_before[e];
        dropped += unchanged;
        misplaced += unchanged == dropout_keep_flat(s, e);
    }
    check_fraction(name, dropped, n, misplaced);
}

static void check_model_sites(void) {
    const int L = 2, B = 2, T = 64;
    TestModel tm;
    test_model_create(&tm, test_config(L, 2, 32, 50, 64), B, T, NULL);
    test_model_randomize(&tm, 3);
    test_model_tokens(&tm, 4);
    CpuModel* m = &tm.m;
    size_t n = (size_t)B * T * 32;
    real* x0 = (real*)malloc_check(n * sizeof(real), "test");
    m->drop = &dropout_off;
    model_forward(m, m->inputs);
    memcpy(x0, act(m, 0, ACT_X), n * sizeof(real));
    DropoutState drop = {{P_TEST, P_TEST, P_TEST, P_TEST}, 21, 0, 9, 2, 0, 0};
    m->drop = &drop;
    model_forward(m, m->inputs);
    DropoutSite embd = dropout_site(&drop, DROPOUT_EMBEDDING, 0);
    size_t dropped = 0, misplaced = 0, wrong_value = 0;
    for (size_t e = 0; e < n; e++) {
        real got = act(m, 0, ACT_X)[e];
        int keep = got != 0;
        dropped += !keep;
        misplaced += keep != dropout_keep_flat(&embd, e);
        wrong_value += keep && got != x0[e] * (real)embd.scale;
    }
    check_fraction("embedding", dropped, n, misplaced);
    if (wrong_value) { printf("embedding: %zu kept values not scaled by 1/keep\n", wrong_value); failures++; }
    for (int l = 0; l < L; l++) {
        char name[64];
        DropoutSite ra = dropout_site(&drop, DROPOUT_RESID_ATTN, l), rm = dropout_site(&drop, DROPOUT_RESID_MLP, l);
        snprintf(name, sizeof(name), "layer %d attention branch", l);
        check_residual_site(name, act(m, l, ACT_RES2), act(m, l, ACT_X), n, &ra);
        snprintf(name, sizeof(name), "layer %d MLP branch", l);
        check_residual_site(name, l + 1 < L ? act(m, l + 1, ACT_X) : m->final_res, act(m, l, ACT_RES2), n, &rm);
    }
    /* each layer and site has masks of its own: two independent masks agree on p^2 + (1-p)^2 of the elements */
    DropoutSite a0 = dropout_site(&drop, DROPOUT_RESID_ATTN, 0), a1 = dropout_site(&drop, DROPOUT_RESID_ATTN, 1);
    size_t same = 0;
    for (size_t e = 0; e < n; e++) same += dropout_keep_flat(&a0, e) == dropout_keep_flat(&a1, e);
    if ((double)same / (double)n > 0.7) { printf("layers 0 and 1 share %zu of %zu mask bits\n", same, n); failures++; }
    free(x0);
    test_model_free(&tm);
}

static void check_attention_site(void) {
    const int B = 2, NH = 2, T = 64, C = NH * T, hs = T; /* hs >= T: one channel per key */
    DropoutState drop = {{0, P_TEST, 0, 0}, 5, 0, 3, 0, 0, 0};
    DropoutSite s = dropout_site(&drop, DROPOUT_ATTENTION, 1);
    real* qkv = (real*)calloc((size_t)B * T * 3 * C, sizeof(real));
    real* out = (real*)malloc((size_t)B * T * C * sizeof(real));
    real* lse = (real*)malloc((size_t)B * NH * T * sizeof(real));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH; h++) qkv[((size_t)b * T + t) * 3 * C + 2 * C + h * hs + t] = 1; /* v[u] = e_u */
    attention_forward(out, lse, qkv, B, T, C, NH, NULL, &s);
    size_t dropped = 0, misplaced = 0, wrong_value = 0, n = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++)
                for (int u = 0; u <= t; u++) {
                    real got = out[((size_t)b * T + t) * C + h * hs + u];
                    int keep = got != 0;
                    n++;
                    dropped += !keep;
                    misplaced += keep != dropout_keep_attention(&s, b * NH + h, T, t, u);
                    wrong_value += keep && fabs((double)got - (double)s.scale / (t + 1)) > 1e-6 / (t + 1);
                }
    check_fraction("attention probabilities", dropped, n, misplaced);
    if (wrong_value) { printf("attention: %zu kept probabilities not scaled by 1/keep\n", wrong_value); failures++; }
    free(qkv);
    free(out);
    free(lse);
}

/* forward_loss and next_token_probs ignore the dropout set for training. */
static void check_evaluation_never_drops(void) {
    TestModel tm;
    test_model_create(&tm, test_config(2, 2, 32, 50, 16), 2, 16, NULL);
    test_model_randomize(&tm, 6);
    test_model_tokens(&tm, 7);
    CpuModel* m = &tm.m;
    float probs_off[50], probs_on[50];
    float loss_off = cpu_forward_loss(m, m->inputs, m->targets);
    cpu_next_token_probs(m, m->targets, 9, probs_off);
    DropoutState drop = {{0.5f, 0.5f, 0.5f, 0.5f}, 1, 0, 1, 0, 0, 0};
    cpu_set_dropout(m, &drop);
    cpu_zero_grads(m);
    test_model_tokens(&tm, 7);
    MicroBatch mb = {m->inputs, m->targets, 0, 1};
    float loss_train = cpu_forward_backward(m, &mb, 1.0f);
    float loss_on = cpu_forward_loss(m, m->inputs, m->targets);
    cpu_next_token_probs(m, m->targets, 9, probs_on);
    int ok = loss_on == loss_off && memcmp(probs_on, probs_off, sizeof(probs_on)) == 0 && loss_train != loss_off;
    printf("evaluation loss %.6f without dropout, %.6f with dropout set (training forward %.6f); sampling probabilities %s  %s\n",
           (double)loss_off, (double)loss_on, (double)loss_train, memcmp(probs_on, probs_off, sizeof(probs_on)) ? "differ" : "equal",
           ok ? "ok" : "FAIL");
    failures += !ok;
    test_model_free(&tm);
}

int main(void) {
    check_model_sites();
    check_attention_site();
    check_evaluation_never_drops();
    printf("%s: dropout sites, %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
