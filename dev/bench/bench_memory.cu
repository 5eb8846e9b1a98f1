/*
 * bench_memory: the memory-bound kernels (llmc/cuda/layernorm.cuh, gelu.cuh,
 * classifier.cuh, adamw.cuh, encoder.cuh, matmul.cuh's bias gradient) on
 * their 16-byte vector path and, side by side in the same process on the
 * same data, on their scalar path (every buffer one element off 16-byte
 * alignment, which is what selects it). Prints ms per call and the bytes
 * each call must move divided by its time (GB/s), as a markdown table.
 * GPU only. Status: see the status table in README.md.
 *
 * usage: bench_memory_bf16 [B T C V]   default 16 1024 768 50257 (GPT-2 124M)
 */
#include <stdio.h>
#include <stdlib.h>
#include "llmc/cuda/layernorm.cuh"
#include "llmc/cuda/gelu.cuh"
#include "llmc/cuda/classifier.cuh"
#include "llmc/cuda/adamw.cuh"
#include "llmc/cuda/encoder.cuh"
#include "llmc/cuda/matmul.cuh"

static floatX* dev_floatX(size_t n) {
    floatX* p = NULL;
    CUDA_CHECK(cudaMalloc((void**)&p, (n + XVEC) * sizeof(floatX)));
    CUDA_CHECK(cudaMemset(p, 0, (n + XVEC) * sizeof(floatX))); /* zeros: finite everywhere */
    return p;
}

static float* dev_f32(size_t n) {
    float* p = NULL;
    CUDA_CHECK(cudaMalloc((void**)&p, (n + 4) * sizeof(float)));
    CUDA_CHECK(cudaMemset(p, 0, (n + 4) * sizeof(float)));
    return p;
}

/* ms per call of `run(shift)`: 3 warm-up calls, then 20 timed. */
template <typename F> static float time_ms(F run, int shift) {
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) run(shift);
    CUDA_CHECK(cudaEventRecord(a, 0));
    for (int i = 0; i < 20; i++) run(shift);
    CUDA_CHECK(cudaEventRecord(b, 0));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
    return ms / 20.0f;
}

template <typename F> static void row(const char* name, double bytes, F run) {
    float v = time_ms(run, 0), s = time_ms(run, 1);
    printf("| %-28s | %9.1f | %8.3f | %7.0f | %8.3f | %7.0f | %5.2fx |\n", name, bytes / 1e6, v, bytes / v / 1e6, s, bytes / s / 1e6, s / v);
}

int main(int argc, char** argv) {
    int B = 16, T = 1024, C = 768, V = 50257;
    if (argc == 5) { B = atoi(argv[1]); T = atoi(argv[2]); C = atoi(argv[3]); V = atoi(argv[4]); }
    else if (argc != 1) { fprintf(stderr, "usage: %s [B T C V]\n", argv[0]); return 2; }
    if (B < 1 || T < 1 || C < 8 || V < 2) { fprintf(stderr, "error: B, T >= 1, C >= 8, V >= 2\n"); return 2; }
    char why[256];
    if (gpu_device_count(why, sizeof(why)) <= 0) { fprintf(stderr, "error: no usable CUDA device (%s)\n", why); return 1; }
    const int N = B * T, Vp = (V + 127) / 128 * 128, rows = N < 1024 ? N : 1024;
    const size_t P = (size_t)Vp * C + 12 * (12 * (size_t)C * C); /* about the parameter count of 12 layers */
    const size_t X = sizeof(floatX);
    floatX *x = dev_floatX((size_t)N * 4 * C), *y = dev_floatX((size_t)N * 4 * C), *z = dev_floatX((size_t)N * 4 * C);
    floatX *w = dev_floatX(4 * C), *bias = dev_floatX(4 * C), *wte = dev_floatX((size_t)Vp * C), *wpe = dev_floatX((size_t)T * C);
    floatX *logits = dev_floatX((size_t)rows * (Vp + 1)), *params = dev_floatX(P), *grads = dev_floatX(P);
    float *mean = dev_f32(N), *rstd = dev_f32(N), *part = dev_f32((size_t)COLUMN_SPLITS * 4 * C), *losses = dev_f32(rows);
    float *m = dev_f32(P), *v = dev_f32(P), *master = dev_f32(P);
    int* h_tok = (int*)malloc_check((size_t)N * sizeof(int), "tokens");
    for (int i = 0; i < N; i++) h_tok[i] = i % 2 ? 50256 % V : (int)((1103515245u * (unsigned)i + 12345u) % (unsigned)V); /* half one token */
    int *tok = NULL, *buckets = NULL, *h_buckets = (int*)malloc_check((3 * (size_t)N + 1) * sizeof(int), "buckets");
    int* count = (int*)malloc_check((size_t)V * sizeof(int), "buckets");
    TokenBuckets tb = encoder_build_buckets(h_buckets, count, h_tok, N, V);
    CUDA_CHECK(cudaMalloc((void**)&tok, (size_t)N * sizeof(int)));
    CUDA_CHECK(cudaMalloc((void**)&buckets, (3 * (size_t)N + 1) * sizeof(int)));
    CUDA_CHECK(cudaMemcpy(tok, h_tok, (size_t)N * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(buckets, h_buckets, (size_t)tb.ints * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(losses, h_tok, (size_t)rows * sizeof(int), cudaMemcpyHostToDevice)); /* targets: reuse as ints */
    const int* targets = (const int*)losses;
    float* loss_out = dev_f32(rows);
    printf("memory-bound kernels, %s, B=%d T=%d C=%d V=%d (Vp %d, %d logits rows, %zu AdamW elements; wte: %d of %d positions one token, %d segments)\n",
           PRECISION_NAME, B, T, C, V, Vp, rows, P, N / 2, N, tb.segments);
    printf("| kernel                       |   MB/call | vec ms   | vec GB/s | scalar ms | GB/s   | ratio |\n");
    printf("|---|---|---|---|---|---|---|\n");
    const double NC = (double)N * C;
    const TokenLayout whole = {T, 0, 1, 0, 0}; /* whole sequences */
    row("layernorm forward", 2 * NC * X + 8.0 * N, [&](int s) { gpu_layernorm_forward(y + s, mean, rstd, x + s, w + s, bias + s, N, C, 0); });
    row("layernorm backward", 4 * NC * X + 2.0 * COLUMN_SPLITS * C * 8 + 8.0 * N, [&](int s) {
        gpu_layernorm_backward(z + s, w, bias, part, y + s, x + s, w + s, mean, rstd, N, C, 0); });
    row("gelu forward (N x 4C)", 2 * 4 * NC * X, [&](int s) { gpu_gelu_forward(y + s, x + s, (size_t)N * 4 * C, 0); });
    row("gelu backward (N x 4C)", 3 * 4 * NC * X, [&](int s) { gpu_gelu_backward(y + s, x + s, (size_t)N * 4 * C, 0); });
    row("bias gradient (OC = 4C)", 4 * NC * X + COLUMN_SPLITS * 4.0 * C * 8, [&](int s) { gpu_bias_backward(w, part, x + s, N, 4 * C, 0); });
    row("encoder forward", 3 * NC * X, [&](int s) { gpu_encoder_forward(y + s, tok, wte + s, wpe + s, B, C, &whole, 0); });
    row("encoder backward (hot token)", 2 * NC * X, [&](int s) {
        gpu_encoder_backward(wte + s, wpe + s, x + s, buckets, &tb, part + (s ? 1 : 0), B, C, &whole, 0); });
    row("classifier (dlogits)", 2.0 * rows * Vp * X, [&](int s) {
        gpu_classifier_fused(logits + s, loss_out, targets, rows, V, Vp + s, 1e-3f, 0); });
    row("adamw (fp32 master)", (double)P * (2 * X + X + 24), [&](int s) {
        gpu_adamw(params + s, master + s, grads + s, m + s, v + s, P - 1, 0, 1e-4f, 0.9f, 0.95f, 0.5f, 0.5f, 1e-8f, 0.1f, 1.0f, 1, 1, 0); });
    CUDA_CHECK(cudaDeviceSynchronize());
    printf("(scalar: the same kernels with every buffer one element off 16-byte alignment; the classifier's rows Vp+1 long)\n");
    return 0;
}
