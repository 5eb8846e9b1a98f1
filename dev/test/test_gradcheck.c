/*
 * Finite-difference check of every parameter gradient of the CPU reference,
 * built in fp64 (-DREMAT_FP64) so the check can be tight: central
 * differences with h = 1e-5 are accurate to ~1e-10 relative (truncation
 * ~h^2, rounding ~1e-16/h), so a gradient that is wrong by a missing term, a
 * transposed index or a factor cannot pass the 1e-6 tolerance. Every
 * element of every tensor is checked on a tiny model whose shape exercises
 * several heads, a padded vocabulary, T < maxT, B > 1, several logits chunks,
 * and both recompute paths; then again with dropout at every site (p 0.3,
 * so even this tiny model drops at each): the masks are functions of their
 * counters, so the loss is a smooth function of the parameters and the
 * backward must route each gradient through the same masks. And once more
 * with dropout in token tiles of 3 of the 10 rows (tiles that cross the
 * batch boundary, and a last one of 1 row). Last, through segments
 * (--segment-layers 2 on 3 layers, -r 2, 3 and 1): the backward runs the
 * lower segment's forward again, its last layer (-r 3) only up to what it keeps.
 */
#define REMAT_NO_MAIN
#include "../../train_gpt.c"
#include "test_model.h"

/* Checks every gradient element; returns the tensors that failed. *loss_out: the loss. */
static int check_gradients(const DropoutState* drop, int tile, int segments, double* loss_out) {
    ModelConfig cfg = test_config(segments ? 3 : 2, 2, 8, 37, 8);
    unsigned char modes[2] = {RECOMPUTE_FULL, RECOMPUTE_SELECTIVE};
    unsigned char segment_modes[3] = {RECOMPUTE_SELECTIVE, RECOMPUTE_KEEP_ATTENTION, RECOMPUTE_FULL};
    TestModel tm;
    test_segment_layers = segments;
    test_model_create_tiled(&tm, cfg, 2, 5, segments ? segment_modes : modes, NULL, tile);
    test_segment_layers = 0;
    test_model_randomize(&tm, 42);
    test_model_tokens(&tm, 43);
    CpuModel* m = &tm.m;
    m->train_dropout = *drop;
    cpu_zero_grads(m);
    MicroBatch mb = {m->inputs, m->targets, 0, 1};
    double loss = cpu_forward_backward(m, &mb, 1.0f);
    *loss_out = loss;
    printf("\n%s%s%s: loss %.12f (uniform would be %.6f)\n", dropout_active(drop) ? "dropout 0.3 at every site" : "no dropout",
           tile ? ", token tiles of 3 rows" : "", segments ? ", segments of 2 layers" : "", loss, log(37.0));
    int failures = test_model_check_gradients(&tm, 1e-5, 1e-9, 1e-6);
    /* padded vocabulary rows never receive gradient */
    for (size_t i = (size_t)cfg.vocab_size * cfg.channels; i < (size_t)cfg.padded_vocab_size * cfg.channels; i++)
        if (m->grads[i] != 0) { printf("padded wte row has gradient %g\n", (double)m->grads[i]); failures++; break; }
    test_model_free(&tm);
    return failures;
}

int main(void) {
    if (sizeof(real) != 8) { fprintf(stderr, "build this test with -DREMAT_FP64\n"); return 2; }
    double loss_off = 0, loss_on = 0;
    int failures = check_gradients(&dropout_off, 0, 0, &loss_off);
    DropoutState drop = {{0.3f, 0.3f, 0.3f, 0.3f}, 7, 0, 3, 1, 0, 0};
    failures += check_gradients(&drop, 0, 0, &loss_on);
    double loss_tiled = 0;
    failures += check_gradients(&drop, 3, 0, &loss_tiled);
    double loss_segments = 0;
    failures += check_gradients(&drop, 3, 2, &loss_segments);
    /* the second check must have had masks to get wrong */
    if (loss_on == loss_off) { printf("dropout did not change the loss\n"); failures++; }
    printf("%s: gradient check, %d tensor(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
