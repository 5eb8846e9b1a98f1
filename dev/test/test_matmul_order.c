/*
 * The CPU matmuls sum every output element in the documented order, whatever
 * their tiling, chunking, packing or thread schedule: each kernel is compared
 * bit for bit with a plain loop that spells the order out, on shapes that are
 * not multiples of the tiles (4 rows, 2 vectors of columns: 16 or 32 of fp32,
 * the vector width) nor of the backward input pass's output chunk nor of the
 * backward weight pass's block of rows, with -0, zeros and mixed magnitudes
 * in the inputs. The orders are written out as the *_spec loops of
 * llmc/cpu/cpu_matmul.h, the oracle here.
 */
#define REMAT_NO_MAIN
#include "../../train_gpt.c"

static real test_value(uint64_t seed, size_t i) {
    switch (i % 11) {
    case 3: return (real)-0.0;
    case 7: return 0;
    default: return (real)(rand_normal(seed, 0, i) * (i % 5 == 1 ? 1e3 : 1.0));
    }
}

static real* test_array(size_t n, uint64_t seed) {
    real* x = (real*)malloc_check(n * sizeof(real), "test");
    for (size_t i = 0; i < n; i++) x[i] = test_value(seed, i);
    return x;
}

static int same_bits(const char* what, const real* got, const real* want, size_t n, int N, int IC, int OC) {
    if (memcmp(got, want, n * sizeof(real)) == 0) return 1;
    size_t i = 0;
    while (memcmp(got + i, want + i, sizeof(real)) == 0) i++;
    printf("FAIL %s N=%d IC=%d OC=%d: element %zu is %.9g, the documented order gives %.9g\n", what, N, IC, OC, i,
           (double)got[i], (double)want[i]);
    return 0;
}

/* One shape through all three kernels; returns the number of mismatches. */
static int check_shape(int N, int IC, int OC, uint64_t seed) {
    size_t n_in = (size_t)N * IC, n_out = (size_t)N * OC, n_w = (size_t)OC * IC;
    real *inp = test_array(n_in, seed), *W = test_array(n_w, seed + 1), *bias = test_array(OC, seed + 2);
    real *dout = test_array(n_out, seed + 3), *dW0 = test_array(n_w, seed + 4), *db0 = test_array(OC, seed + 5);
    real *got = test_array(n_out > n_w ? n_out : n_w, seed + 6), *want = test_array(n_out > n_w ? n_out : n_w, seed + 7);
    real *got_b = test_array(OC, seed + 8), *want_b = test_array(OC, seed + 8);
    int fails = 0;

    matmul_forward(got, inp, W, bias, N, IC, OC);
    matmul_forward_spec(want, inp, W, bias, N, IC, OC);
    fails += !same_bits("matmul_forward", got, want, n_out, N, IC, OC);
    matmul_forward(got, inp, W, NULL, N, IC, OC);
    matmul_forward_spec(want, inp, W, NULL, N, IC, OC);
    fails += !same_bits("matmul_forward (no bias)", got, want, n_out, N, IC, OC);

    matmul_backward_input(got, dout, W, N, IC, OC);
    matmul_backward_input_spec(want, dout, W, N, IC, OC);
    fails += !same_bits("matmul_backward_input", got, want, n_in, N, IC, OC);

    memcpy(got, dW0, n_w * sizeof(real));
    memcpy(want, dW0, n_w * sizeof(real));
    memcpy(got_b, db0, OC * sizeof(real));
    memcpy(want_b, db0, OC * sizeof(real));
    matmul_backward_weight(got, got_b, dout, inp, N, IC, OC);
    matmul_backward_weight_spec(want, want_b, dout, inp, N, IC, OC);
    fails += !same_bits("matmul_backward_weight dW", got, want, n_w, N, IC, OC);
    fails += !same_bits("matmul_backward_weight dbias", got_b, want_b, OC, N, IC, OC);

    free(inp); free(W); free(bias); free(dout); free(dW0); free(db0);
    free(got); free(want); free(got_b); free(want_b);
    return fails;
}

int main(void) {
    /* N, IC, OC: tails in every dimension, outputs below, at and above the
     * backward chunk, full tiles only, and one-element edges. */
    const int shapes[][3] = {
        {1, 1, 1}, {3, 5, 7}, {4, 16, 16}, {7, 37, 53}, {8, 32, 64}, {9, 67, 300},
        {13, 50, 1100}, {12, 48, 2053}, {5, 17, 4097}, {17, 129, 31}, {64, 96, 777},
    };
    int n_shapes = (int)(sizeof(shapes) / sizeof(shapes[0])), fails = 0;
    for (int s = 0; s < n_shapes; s++) fails += check_shape(shapes[s][0], shapes[s][1], shapes[s][2], 100 + 10 * (uint64_t)s);
    if (fails) {
        printf("%d mismatches\n", fails);
        return 1;
    }
    printf("PASS: matmul forward, backward input and backward weight equal the documented summation order bit for bit on %d shapes\n",
           n_shapes);
    return 0;
}
