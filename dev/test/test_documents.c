/*
 * Packed documents on the CPU reference (llmc/core/documents.h): built in fp32
 * (build/test_documents) and in fp64 (build/test_documents_fp64, which adds
 * the finite differences). Rows of T = 24 tokens, end of text EOT = 36:
 *   row 0: a document cut by the packing (no end of text, 5 tokens), a
 *          document of one token (end of text alone), then documents of 7
 *          and 11 tokens;
 *   row 1: one document filling the row (T = one document), starting with
 *          end of text.
 * Token tiles of 4 rows (in the settings that tile) cut documents anywhere.
 * Checked:
 *  1. each document run on its own (B = 1, T = its length, no masking, the
 *     same weights): its per-token losses equal the packed run's (masked
 *     attention, positions reset) to 1e-6 relative, and the packed run's
 *     gradients (the per-token loss gradient 1) equal the sum of the solo
 *     runs' to 1e-5 (fp32; 1e-12 fp64) of each tensor's largest; also with
 *     token tiles;
 *  2. reordering the documents of row 0 (those that start with end of text)
 *     leaves the mean loss unchanged (1e-6 relative), and without masking
 *     it changes (the check can tell);
 *  3. every -r setting (0, 1, 2, 3, mixes, offloaded 1o/3o, token tiles),
 *     with dropout at every site, two micro-steps and --eod-mask-loss,
 *     bitwise equal to -r 0 (losses and gradients);
 *  4. --eod-mask-loss: the rows whose input is end of text have loss 0 and
 *     no gradient, the mean is over the others;
 *  5. (fp64) central differences of the mean over counted tokens, all
 *     three flags on, dropout at every site, token tiles of 3 rows: every
 *     element of the tensors of up to 96, about 96 spread over each larger
 *     one (an odd stride: every row and column of a matrix is met), so that
 *     the check takes seconds.
 */
#define REMAT_NO_MAIN
#include "../../train_gpt.c"
#include "test_model.h"

#define DOC_B 2
#define DOC_T 24
#define DOC_V 37
#define EOT 36
#define MAX_DOCS 8

#ifdef REMAT_FP64
#define GRAD_TOL 1e-12
#else
#define GRAD_TOL 1e-5
#endif

typedef struct { int row, start, len; } Doc;

static const DocumentOptions all_on = {1, 1, 1, EOT};
static const DocumentOptions mask_and_positions = {1, 1, 0, EOT};

/* Row 0: lengths 5 (cut, no end of text), 1, 7, 11 in the order `order`
 * (a permutation of the last three); row 1: one document. Tokens are random
 * words (0..EOT-1); each document but the cut one starts with EOT. */
static int make_rows(int* inputs, int* targets, const int order[3], Doc* docs) {
    static const int lens[3] = {1, 7, 11};
    int n = 0, p = 5;
    docs[n++] = (Doc){0, 0, 5};
    for (int k = 0; k < 3; k++) {
        docs[n++] = (Doc){0, p, lens[order[k]]};
        p += lens[order[k]];
    }
    docs[n++] = (Doc){1, 0, DOC_T};
    /* each document's words are a function of which document it is, not of where it sits */
    for (int d = 0; d < n; d++) {
        int id = d == 0 ? 0 : d == n - 1 ? 9 : 1 + order[d - 1];
        for (int i = 0; i < docs[d].len; i++) {
            int tok = (i == 0 && !(d == 0)) ? EOT : (int)(rand_u64(77, (uint64_t)id, (uint64_t)i) % EOT);
            int tgt = (int)(rand_u64(78, (uint64_t)id, (uint64_t)i) % DOC_V);
            inputs[docs[d].row * DOC_T + docs[d].start + i] = tok;
            targets[docs[d].row * DOC_T + docs[d].start + i] = tgt;
        }
    }
    return n;
}

static void set_documents(CpuModel* m, const DocumentOptions* d) {
    m->docs = *d;
    for (int b = 0; b < DOC_B; b++)
        document_starts_extend(m->doc_start + b * DOC_T, m->inputs + b * DOC_T, DOC_T, 0, 0, d->eot_token);
}

static const DocumentOptions docs_off = {0, 0, 0, -1};

static void create(TestModel* tm, const unsigned char* modes, const unsigned char* offload, int tile) {
    test_model_create_tiled(tm, test_config(2, 2, 8, DOC_V, DOC_T), DOC_B, DOC_T, modes, offload, tile);
    test_model_randomize(tm, 42);
}

static double max_abs(const real* a, size_t n) {
    double mx = 0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs((double)a[i]));
    return mx;
}

/* Check 1 with token tiles of `tile` rows (0: untiled). */
static int check_against_solo(int tile) {
    static const unsigned char modes[2] = {RECOMPUTE_FULL, RECOMPUTE_SELECTIVE};
    TestModel packed, solo;
    create(&packed, modes, NULL, tile);
    create(&solo, modes, NULL, 0);
    static const int order[3] = {0, 1, 2};
    Doc docs[MAX_DOCS];
    int nd = make_rows(packed.m.inputs, packed.m.targets, order, docs);
    set_documents(&packed.m, &mask_and_positions);
    CpuModel* m = &packed.m;
    cpu_zero_grads(m);
    MicroBatch mb = {m->inputs, m->targets, 0, 1};
    cpu_forward_backward(m, &mb, (float)(DOC_B * DOC_T)); /* the gradient of the sum of the losses */
    CpuModel* s = &solo.m;
    cpu_zero_grads(s);
    double worst_loss = 0;
    for (int d = 0; d < nd; d++) {
        const Doc* dc = &docs[d];
        memcpy(s->inputs, m->inputs + dc->row * DOC_T + dc->start, (size_t)dc->len * sizeof(int));
        memcpy(s->targets, m->targets + dc->row * DOC_T + dc->start, (size_t)dc->len * sizeof(int));
        cpu_set_shape(s, 1, dc->len);
        s->drop = &dropout_off;
        model_forward(s, s->inputs);
        classifier(s, s->inputs, s->targets, 1);
        model_backward(s, s->inputs);
        for (int i = 0; i < dc->len; i++) {
            double a = (double)m->losses[dc->row * DOC_T + dc->start + i], b = (double)s->losses[i];
            worst_loss = fmax(worst_loss, fabs(a - b) / fabs(b));
        }
    }
    int failures = worst_loss > 1e-6;
    printf("tiles %d: per-token losses of %d documents against each run alone: worst relative difference %.3g %s\n", tile, nd,
           worst_loss, worst_loss > 1e-6 ? "FAIL" : "ok");
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        const real* g = m->grads + pl.offset[t];
        const real* want = s->grads + pl.offset[t];
        double mx = max_abs(want, pl.count[t]), worst = 0;
        for (size_t k = 0; k < pl.count[t]; k++) worst = fmax(worst, fabs((double)g[k] - (double)want[k]));
        int ok = worst <= GRAD_TOL * mx;
        failures += !ok;
        if (!ok || t == P_WPE || t == P_QKVW)
            printf("  %-9s gradient against the solo runs' sum: %.3g of its largest %.3g %s\n", param_tensor_names[t], worst / (mx + 1e-300),
                   mx, ok ? "ok" : "FAIL");
    }
    test_model_free(&packed);
    test_model_free(&solo);
    return failures;
}

/* Mean loss of row 0 with its documents in `order`. */
static double row_loss(const int order[3], const DocumentOptions* d) {
    static const unsigned char modes[2] = {0, 0};
    TestModel tm;
    create(&tm, modes, NULL, 0);
    Doc docs[MAX_DOCS];
    make_rows(tm.m.inputs, tm.m.targets, order, docs);
    set_documents(&tm.m, d);
    if (!d->reset_attention_mask) tm.m.docs = docs_off;
    double loss = cpu_forward_loss(&tm.m, tm.m.inputs, tm.m.targets);
    test_model_free(&tm);
    return loss;
}

static int check_reorder(void) {
    static const int a[3] = {0, 1, 2}, b[3] = {2, 0, 1};
    double masked_a = row_loss(a, &mask_and_positions), masked_b = row_loss(b, &mask_and_positions);
    double plain_a = row_loss(a, &docs_off), plain_b = row_loss(b, &docs_off);
    double masked = fabs(masked_a - masked_b) / masked_a, plain = fabs(plain_a - plain_b) / plain_a;
    int failures = masked > 1e-6 || plain < 1e-4;
    printf("documents reordered: masked loss %.9f -> %.9f (%.2g), unmasked %.9f -> %.9f (%.2g) %s\n", masked_a, masked_b, masked, plain_a,
           plain_b, plain, failures ? "FAIL" : "ok");
    return failures;
}

/* Check 3: two micro-steps of one setting; losses and gradients. */
typedef struct { const char* name; unsigned char modes[2], offload[2]; int tile; } Setting;

static void run_setting(const Setting* st, const DropoutState* drop, float* losses, real* grads, size_t np) {
    TestModel tm;
    create(&tm, st->modes, st->offload, st->tile);
    cpu_zero_grads(&tm.m);
    for (int micro = 0; micro < 2; micro++) {
        static const int order[2][3] = {{0, 1, 2}, {1, 2, 0}};
        Doc docs[MAX_DOCS];
        make_rows(tm.m.inputs, tm.m.targets, order[micro], docs);
        set_documents(&tm.m, &all_on);
        tm.m.train_dropout = *drop;
        tm.m.train_dropout.step = 1;
        tm.m.train_dropout.micro_step = (uint32_t)micro;
        MicroBatch mb = {tm.m.inputs, tm.m.targets, micro, 2};
        losses[micro] = cpu_forward_backward(&tm.m, &mb, 0.5f);
    }
    memcpy(grads, tm.m.grads, np * sizeof(real));
    test_model_free(&tm);
}

static int check_recompute_bitwise(void) {
    static const Setting settings[] = {
        {"-r 0", {0, 0}, {0, 0}, 0},          {"-r 1", {1, 1}, {0, 0}, 0},          {"-r 2", {2, 2}, {0, 0}, 0},
        {"-r 3", {3, 3}, {0, 0}, 0},          {"mix 1/3", {1, 3}, {0, 0}, 0},       {"mix 2/0", {2, 0}, {0, 0}, 0},
        {"1o/3o", {1, 3}, {1, 1}, 0},         {"-r 1 tiles 4", {1, 1}, {0, 0}, 4},  {"-r 0 tiles 5", {0, 0}, {0, 0}, 5},
        {"-r 3 tiles 7", {3, 3}, {0, 0}, 7},  {"1o tiles 4", {1, 0}, {1, 0}, 4},
    };
    int n = (int)(sizeof(settings) / sizeof(settings[0])), failures = 0;
    DropoutState drop = {{0.2f, 0.2f, 0.2f, 0.2f}, 11, 0, 0, 0, 0, 0};
    TestModel probe;
    create(&probe, settings[0].modes, NULL, 0);
    size_t np = probe.plan.num_params;
    test_model_free(&probe);
    real* want = (real*)malloc_check(np * sizeof(real), "test");
    real* got = (real*)malloc_check(np * sizeof(real), "test");
    float want_loss[2], got_loss[2];
    run_setting(&settings[0], &drop, want_loss, want, np);
    for (int i = 1; i < n; i++) {
        run_setting(&settings[i], &drop, got_loss, got, np);
        int same = memcmp(want_loss, got_loss, sizeof(want_loss)) == 0 && memcmp(want, got, np * sizeof(real)) == 0;
        failures += !same;
        printf("documents, dropout, 2 micro-steps: %-14s against -r 0: %s\n", settings[i].name, same ? "bitwise equal" : "DIFFERENT: FAIL");
    }
    free(want);
    free(got);
    return failures;
}

/* Check 4. */
static int check_loss_mask(void) {
    static const unsigned char modes[2] = {0, 0};
    static const int order[3] = {0, 1, 2};
    TestModel tm;
    create(&tm, modes, NULL, 0);
    Doc docs[MAX_DOCS];
    make_rows(tm.m.inputs, tm.m.targets, order, docs);
    CpuModel* m = &tm.m;
    set_documents(m, &mask_and_positions);
    double unmasked = cpu_forward_loss(m, m->inputs, m->targets);
    double sum = 0;
    int counted = 0, N = DOC_B * DOC_T;
    for (int i = 0; i < N; i++)
        if (m->inputs[i] != EOT) { sum += (double)m->losses[i]; counted++; }
    set_documents(m, &all_on);
    double masked = cpu_forward_loss(m, m->inputs, m->targets);
    int failures = fabs(masked - sum / counted) > 1e-6 * masked;
    for (int i = 0; i < N; i++) failures += m->inputs[i] == EOT && m->losses[i] != 0;
    classifier(m, m->inputs, m->targets, 1); /* the classifier's input gradient of an end-of-text row is zero */
    for (int i = 0; i < N; i++)
        for (int c = 0; m->inputs[i] == EOT && c < m->cfg.channels; c++) failures += m->grad_act[GRAD_DLN][(size_t)i * m->cfg.channels + c] != 0;
    printf("--eod-mask-loss: mean over %d of %d tokens %.9f (all tokens %.9f) %s\n", counted, N, masked, unmasked, failures ? "FAIL" : "ok");
    test_model_free(&tm);
    return failures;
}

#ifdef REMAT_FP64
/* Check 5: the mean over counted tokens, times counted / all (what the
 * gradient of forward_backward with dloss_mean 1 is of). */
static double scaled_loss(TestModel* tm, double counted) {
    tm->m.drop = &tm->m.train_dropout;
    model_forward(&tm->m, tm->m.inputs);
    classifier(&tm->m, tm->m.inputs, tm->m.targets, 0);
    return (double)mean_loss(&tm->m, tm->m.inputs) * counted / (DOC_B * DOC_T);
}

static int check_differences(void) {
    static const unsigned char modes[2] = {RECOMPUTE_FULL, RECOMPUTE_KEEP_ATTENTION};
    static const int order[3] = {2, 0, 1};
    TestModel tm;
    create(&tm, modes, NULL, 3);
    Doc docs[MAX_DOCS];
    make_rows(tm.m.inputs, tm.m.targets, order, docs);
    CpuModel* m = &tm.m;
    set_documents(m, &all_on);
    DropoutState drop = {{0.3f, 0.3f, 0.3f, 0.3f}, 5, 0, 3, 1, 0, 0};
    m->train_dropout = drop;
    double counted = (double)documents_counted(&all_on, m->inputs, DOC_B * DOC_T);
    cpu_zero_grads(m);
    MicroBatch mb = {m->inputs, m->targets, 0, 1};
    cpu_forward_backward(m, &mb, 1.0f);
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    const double h = 1e-5, tol_abs = 1e-9, tol_rel = 1e-6;
    int failures = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        double worst = 0;
        size_t stride = pl.count[t] > 96 ? pl.count[t] / 96 | 1 : 1; /* odd: every row and column meets it */
        for (size_t k = 0; k < pl.count[t]; k += stride) {
            size_t i = pl.offset[t] + k;
            real saved = m->params[i];
            m->params[i] = saved + h;
            double up = scaled_loss(&tm, counted);
            m->params[i] = saved - h;
            double down = scaled_loss(&tm, counted);
            m->params[i] = saved;
            double numeric = (up - down) / (2 * h);
            worst = fmax(worst, fabs((double)m->grads[i] - numeric) / (tol_abs + tol_rel * fabs(numeric)));
        }
        failures += worst > 1.0;
        printf("  finite differences %-9s %.3f of tolerance %s\n", param_tensor_names[t], worst, worst > 1.0 ? "FAIL" : "ok");
    }
    test_model_free(&tm);
    return failures;
}
#endif

/* The smallest busiest-member work over every pairing of 2N chunks into N
 * pairs (brute force: fix the lowest unpaired chunk, try each partner). */
static int64_t best_pairing(const int64_t* work, int* used, int n) {
    int first = 0;
    while (first < n && used[first]) first++;
    if (first == n) return 0;
    int64_t best = INT64_MAX;
    used[first] = 1;
    for (int c = first + 1; c < n; c++) {
        if (used[c]) continue;
        used[c] = 1;
        int64_t rest = best_pairing(work, used, n), pair = work[first] + work[c];
        int64_t worst = rest > pair ? rest : pair;
        best = worst < best ? worst : best;
        used[c] = 0;
    }
    used[first] = 0;
    return best;
}

/* ring_chunks_balance against the brute force on random chunk work (N = 2
 * to 5): as small a busiest member as any pairing; every chunk held once,
 * the first of each member's below its second; the zigzag kept when it is
 * as good (work rising with the position: no documents). */
static int check_ring_pairing(void) {
    int failures = 0;
    uint64_t x = 88172645463325252ull;
    for (int trial = 0; trial < 400; trial++) {
        int N = 2 + trial % 4, n = 2 * N, chunks[10], order[10], used[10] = {0}, seen[10] = {0};
        int64_t work[10];
        for (int c = 0; c < n; c++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            work[c] = trial % 5 == 0 ? 10 * c + 5 : (int64_t)(x % 1000);
        }
        int moved = ring_chunks_balance(chunks, order, work, N);
        int64_t got = ring_busiest_work(work, chunks, N), best = best_pairing(work, used, n), zigzag = ring_busiest_work(work, NULL, N);
        int ok = got == best && (moved ? got < zigzag : got == zigzag);
        for (int m = 0; m < N; m++) {
            ok &= chunks[2 * m] < chunks[2 * m + 1];
            seen[chunks[2 * m]]++;
            seen[chunks[2 * m + 1]]++;
            if (!moved) ok &= chunks[2 * m] == m && chunks[2 * m + 1] == n - 1 - m;
        }
        for (int c = 0; c < n; c++) ok &= seen[c] == 1;
        if (trial % 5 == 0) ok &= !moved;
        if (!ok) {
            printf("  ring pairing N=%d trial %d: busiest %lld, best %lld, zigzag %lld FAIL\n", N, trial, (long long)got, (long long)best,
                   (long long)zigzag);
            failures++;
        }
    }
    printf("  ring pairing against every pairing (400 trials, N = 2 to 5): %s\n", failures ? "FAIL" : "ok");
    return failures;
}

int main(void) {
    int failures = 0;
    failures += check_ring_pairing();
    failures += check_against_solo(0);
    failures += check_against_solo(4);
    failures += check_reorder();
    failures += check_recompute_bitwise();
    failures += check_loss_mask();
#ifdef REMAT_FP64
    failures += check_differences();
#endif
    printf("%s: %d failure%s\n", failures ? "FAILED" : "passed", failures, failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
