/*
 * The context-parallel ring in the fp64 build, with two processes
 * (mpirun -np 2; make test-bins builds it with mpicc when MPI is there).
 * The two ranks form one group of N = 2 and share B = 2 sequences of T = 8
 * (4 chunks of 2 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2),
 * on a model of three layers in -r 1, 2 and 3 (the ring rerun in backward,
 * attention kept, attention kept with the rest recomputed). Checked:
 *  1. against one process on the whole sequences (a second model, N = 1, in
 *     the same process): the loss (the mean over every token of the group)
 *     to 1e-12 relative, and every parameter gradient (summed over the
 *     ranks) to 1e-9 of its tensor's largest: fp64 rounding of regrouped
 *     sums is ~1e-16, a missing block, a wrong position or a lost dK/dV
 *     contribution is ~1e-2;
 *  2. central differences of the loss the ring computes (h = 1e-5, every
 *     element of every tensor) against the summed gradients, to 1e-6
 *     relative (test_gradcheck.c says why that is tight);
 * once without dropout, once with dropout 0.3 at every site, and once more
 * with dropout and packed documents (--reset-attention-mask and
 * --reset-position-ids, llmc/core/documents.h): token 5 starts a document, so
 * documents begin inside the other rank's chunks and ring blocks hold
 * queries that see none of their keys. Then the dropout-and-documents check
 * on the configurable block (llama3-scaled RoPE, RMSNorm, 4 query heads on 2
 * K/V heads, SwiGLU, q/k/v bias, untied head): RoPE must turn each token by
 * its global position (and under documents its distance from its
 * document's start), and the ring carries the 2 K/V heads after RoPE.
 */
#define REMAT_NO_MAIN
#include "../../train_gpt.c"
#include "test_model.h"

#define RING_B 2
#define RING_T 8
#define RING_N 2

static void create(TestModel* tm, ModelConfig cfg, int world, int group_size, const unsigned char* modes) {
    PlanSpec s;
    memset(&s, 0, sizeof(s));
    s.cfg = cfg;
    s.B = RING_B;
    s.T = RING_T;
    s.backend = BACKEND_CPU;
    s.elem_bytes = (int)sizeof(real);
    s.stat_bytes = (int)sizeof(real);
    s.world_size = world;
    s.context_parallel = group_size;
    s.documents = PLAN_DOC_STARTS; /* the tests may pack documents into any model */
    s.layer_mode = modes;
    s.logits_chunk_rows = 3;
    s.io_chunk_floats = 1024;
    plan_build(&tm->plan, &s);
    cpu_model_create(&tm->m, &tm->plan);
    proc_context_init(&tm->m.par.cp);
}

static double group_sum(double v) {
    double sum = 0;
    MPI_CHECK(MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
    return sum;
}

/* The group's loss: every rank's mean over its tokens, averaged (equal counts). */
static double ring_loss(CpuModel* m) {
    m->drop = &m->train_dropout;
    cpu_set_shape(m, RING_B, RING_T / RING_N);
    model_forward(m, m->inputs);
    classifier(m, m->inputs, m->targets, 0);
    return group_sum((double)mean_loss(m, m->inputs)) / RING_N;
}

/* Packed documents on both models: token 5 starts one; the ring's rows take
 * the starts of their global positions, as the data loader gives them. */
static void set_documents(TestModel* one, TestModel* ring) {
    static const DocumentOptions d = {1, 1, 0, 5};
    one->m.docs = ring->m.docs = d;
    for (int b = 0; b < RING_B; b++) {
        for (int t = 0; t < RING_T; t++) one->m.inputs[b * RING_T + t] = t % 3 == 1 ? 5 : one->m.inputs[b * RING_T + t] % 5;
        document_starts_extend(one->m.doc_start + b * RING_T, one->m.inputs + b * RING_T, RING_T, 0, 0, 5);
    }
    int Tl = RING_T / RING_N;
    for (int b = 0; b < RING_B; b++)
        for (int i = 0; i < Tl; i++)
            ring->m.doc_start[b * Tl + i] = one->m.doc_start[b * RING_T + context_position(i, Tl, ring->m.par.cp.member, RING_N)];
}

static int check_shape(ModelConfig cfg, const DropoutState* drop, int documents) {
    unsigned char modes[3] = {RECOMPUTE_FULL, RECOMPUTE_SELECTIVE, RECOMPUTE_KEEP_ATTENTION};
    TestModel one, ring;
    create(&one, cfg, 1, 1, modes);
    create(&ring, cfg, RING_N, RING_N, modes);
    test_model_randomize(&one, 42);
    test_model_randomize(&ring, 42);
    test_model_tokens(&one, 43);
    if (documents) set_documents(&one, &ring);
    CpuModel* m = &ring.m;
    int Tl = RING_T / RING_N;
    for (int b = 0; b < RING_B; b++)
        for (int i = 0; i < Tl; i++) {
            int pos = context_position(i, Tl, m->par.cp.member, RING_N);
            m->inputs[b * Tl + i] = one.m.inputs[b * RING_T + pos];
            m->targets[b * Tl + i] = one.m.targets[b * RING_T + pos];
        }
    one.m.train_dropout = m->train_dropout = *drop;
    cpu_zero_grads(&one.m);
    MicroBatch whole = {one.m.inputs, one.m.targets, 0, 1};
    cpu_forward_backward(&one.m, &whole, 1.0f);
    double loss_one = (double)mean_loss(&one.m, one.m.inputs);
    cpu_zero_grads(m);
    MicroBatch mine = {m->inputs, m->targets, 0, 1};
    cpu_forward_backward(m, &mine, 1.0f / RING_N);
    double loss_ring = group_sum((double)mean_loss(m, m->inputs)) / RING_N;
    size_t n = ring.plan.num_params;
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, m->grads, (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
    printf("\n%s%s: loss %.15f on the ring, %.15f on one process\n", dropout_active(drop) ? "dropout 0.3 at every site" : "no dropout",
           documents ? ", packed documents" : "", loss_ring, loss_one);
    int failures = fabs(loss_ring - loss_one) > 1e-12 * fabs(loss_one);
    ParamLayout pl;
    param_layout(&cfg, &pl);
    const double h = 1e-5, tol_abs = 1e-9, tol_rel = 1e-6;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        double max_grad = 0, worst_one = 0, worst_fd = 0;
        for (size_t k = 0; k < pl.count[t]; k++) max_grad = fmax(max_grad, fabs((double)one.m.grads[pl.offset[t] + k]));
        for (size_t k = 0; k < pl.count[t]; k++) {
            size_t i = pl.offset[t] + k;
            worst_one = fmax(worst_one, fabs((double)m->grads[i] - (double)one.m.grads[i]) / (1e-9 * max_grad + 1e-300));
            real saved = m->params[i];
            m->params[i] = saved + h;
            double up = ring_loss(m);
            m->params[i] = saved - h;
            double down = ring_loss(m);
            m->params[i] = saved;
            double numeric = (up - down) / (2 * h);
            worst_fd = fmax(worst_fd, fabs((double)m->grads[i] - numeric) / (tol_abs + tol_rel * fabs(numeric)));
        }
        int ok = worst_one <= 1.0 && worst_fd <= 1.0;
        failures += !ok;
        printf("%-10s %6zu elements  max|grad| %.3e  vs one process %.2e  vs differences %.3f (of tolerance)  %s\n",
               param_tensor_names[t], pl.count[t], max_grad, worst_one, worst_fd, ok ? "ok" : "FAIL");
    }
    test_model_free(&one);
    test_model_free(&ring);
    return failures;
}

int main(int argc, char** argv) {
    proc_init(&argc, &argv);
    if (remat_proc.world != RING_N) fail("run with mpirun -np %d (found %d processes)", RING_N, remat_proc.world);
    DropoutState none, drop;
    memset(&none, 0, sizeof(none));
    drop = none;
    for (int k = 0; k < DROPOUT_NUM_SITES; k++) drop.p[k] = 0.3f;
    drop.seed = 7;
    drop.step = 1;
    ModelConfig gpt2 = test_config(3, 2, 8, 37, RING_T);
    int failures = check_shape(gpt2, &none, 0) + check_shape(gpt2, &drop, 0) + check_shape(gpt2, &drop, 1);
    ModelConfig llama = test_llama_config(3, 4, 2, 4, 8, 12, 37, RING_T);
    llama.rope_scaling = ROPE_LLAMA3;
    llama.rope_factor = 4.0f;
    llama.rope_low = 1.0f;
    llama.rope_high = 4.0f;
    llama.rope_original_max = 16;
    llama.rope_theta = 100.0f; /* HD 4: wavelengths 6.3 (kept) and 63 (slowed) against original 16 */
    llama.bias = BIAS_QKV;
    printf("\nthe configurable block: llama3 RoPE, RMSNorm, GQA 4/2, SwiGLU, q/k/v bias, untied head\n");
    failures += check_shape(llama, &none, 0) + check_shape(llama, &drop, 1);
    printf("%s: ring gradient check, %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
    proc_finalize();
    return failures ? 1 : 0;
}
