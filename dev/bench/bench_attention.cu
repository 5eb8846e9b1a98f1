/*
 * bench_attention: the causal attention kernels alone on the GPU, all three
 * families side by side in one process on the same inputs: CUDA cores (simt,
 * llmc/attention.cuh), WMMA (tc, llmc/attention_tc.cuh) and inline-PTX
 * mma.sync/ldmatrix/cp.async (mma, llmc/attention_mma.cuh; head sizes 64 and
 * 128, other head sizes run tc and say so): forward and backward time,
 * TFLOP/s, and how far each one's outputs are from the CUDA-core ones; then
 * the same with attention dropout 0.1 (its time, and its distance to the
 * CUDA-core kernels drawing the same mask).
 *
 * usage: build/bench_attention_bf16 [B T NH HS]...   (groups of four; default:
 *        the d12 shape 16 1024 12 64 and the 24x2048 shape 4 8192 16 128)
 * Exit status: 0, 1 on bad arguments or a CUDA error (a GPU present but
 * unusable included), 77 where no NVIDIA GPU exists.
 *
 * FLOPs (causal, the products that are needed, half of the T x T square):
 * forward 2 products of B*NH*(T^2/2)*hs multiply-adds = 2*B*NH*T^2*hs;
 * backward 5 such products (dV, dP, dS-to-dQ, dS-to-dK, and the recomputed
 * scores) = 2.5x the forward. The kernels do more (backward computes scores
 * and dP in both of its passes), which this convention does not count.
 * Inputs: q, k, v uniform with standard deviation 1 (scaled scores of
 * standard deviation 1: a realistic, not a sharp, softmax), dout the same.
 * Timing: CUDA events around 10 launches after 2 warm-ups, per kernel.
 * Status: see the status table in README.md.
 */
#include <stdio.h>
#include <stdlib.h>
#include "llmc/attention.cuh"
#include "llmc/rand.h"

#if PRECISION_IS_FP32 || !ATTENTION_TENSOR_CORES
#error "bench_attention compares the tensor-core kernels with the CUDA-core ones: build it in BF16 or FP16, without ATTENTION=simt"
#endif

#define BENCH_WARMUP 2
#define BENCH_ITERS 10

/* x[i] uniform on [-sqrt(3), sqrt(3)) (standard deviation 1), from the counter-based generator. */
__global__ void bench_fill_kernel(floatX* x, size_t n, uint64_t stream) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double u = (double)(rand_u64(1234, stream, i) >> 11) * (1.0 / 9007199254740992.0);
    x[i] = from_f32<floatX>((float)((2.0 * u - 1.0) * 1.7320508075688772));
}

typedef struct { floatX *qkv, *dout, *out, *dqkv; float *lse, *rowsum, *dq_partials; } BenchBuffers;

/* One kernel family at one dropout site: times and outputs (host fp32, owned). */
typedef struct { float fwd_ms, bwd_ms, *out, *dqkv; } BenchRun;

#define BENCH_DROPOUT_P 0.1f

/* Mean milliseconds of one call of fn after warm-ups. */
template <typename F> static float time_ms(F fn) {
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    for (int i = 0; i < BENCH_WARMUP; i++) fn();
    CUDA_CHECK(cudaEventRecord(start));
    for (int i = 0; i < BENCH_ITERS; i++) fn();
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    return ms / BENCH_ITERS;
}

static float* fetch(const floatX* dev, size_t n) {
    void* tmp = malloc_check(n * sizeof(floatX), "bench");
    float* out = (float*)malloc_check(n * sizeof(float), "bench");
    CUDA_CHECK(cudaMemcpy(tmp, dev, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) out[i] = host_floatX_load(tmp, i);
    free(tmp);
    return out;
}

/* ||a - b|| / ||b|| */
static double norm_rel(const float* a, const float* b, size_t n) {
    double d2 = 0, b2 = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        d2 += d * d;
        b2 += (double)b[i] * b[i];
    }
    return b2 > 0 ? sqrt(d2 / b2) : sqrt(d2);
}

template <int HS>
static BenchRun bench_run(const BenchBuffers& b, int B, int T, int NH, int hs, int kind, const DropoutSite& drop) {
    const int C = NH * hs;
    BenchRun r;
    r.fwd_ms = time_ms([&] { attention_forward_launch<HS>(b.out, b.lse, b.qkv, B, T, C, NH, kind, drop, 0); });
    r.bwd_ms = time_ms([&] { attention_backward_launch<HS>(b.dqkv, b.rowsum, b.dq_partials, b.dout, b.qkv, b.out, b.lse, B, T, C, NH, kind, drop, 0); });
    attention_forward_launch<HS>(b.out, b.lse, b.qkv, B, T, C, NH, kind, drop, 0);
    attention_backward_launch<HS>(b.dqkv, b.rowsum, b.dq_partials, b.dout, b.qkv, b.out, b.lse, B, T, C, NH, kind, drop, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    r.out = fetch(b.out, (size_t)B * T * C);
    r.dqkv = fetch(b.dqkv, (size_t)B * T * 3 * C);
    return r;
}

static void bench_run_free(BenchRun* r) {
    free(r->out);
    free(r->dqkv);
}

template <int HS> static void bench_shape(int B, int T, int NH, int hs) {
    const int C = NH * hs;
    const size_t n_qkv = (size_t)B * T * 3 * C, n_out = (size_t)B * T * C, n_stat = (size_t)B * NH * T;
    BenchBuffers b;
    CUDA_CHECK(cudaMalloc((void**)&b.qkv, n_qkv * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc((void**)&b.dqkv, n_qkv * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc((void**)&b.dout, n_out * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc((void**)&b.out, n_out * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc((void**)&b.lse, n_stat * sizeof(float)));
    CUDA_CHECK(cudaMalloc((void**)&b.rowsum, n_stat * sizeof(float)));
    CUDA_CHECK(cudaMalloc((void**)&b.dq_partials, attention_dq_partials_bytes(B, T, C, NH)));
    bench_fill_kernel<<<grid_for(n_qkv, 256), 256>>>(b.qkv, n_qkv, 1);
    bench_fill_kernel<<<grid_for(n_out, 256), 256>>>(b.dout, n_out, 2);
    CUDA_CHECK_LAUNCH();
    const double fwd_flops = 2.0 * B * NH * (double)T * T * hs, bwd_flops = 2.5 * fwd_flops;
    const DropoutSite none = attention_no_dropout();
    DropoutState drop_state = {{0}, 1234, 0, 1, 0};
    drop_state.p[DROPOUT_ATTENTION] = BENCH_DROPOUT_P;
    const DropoutSite drop = dropout_site(&drop_state, DROPOUT_ATTENTION, 0);
    BenchRun ref = {}, ref_drop = {};
    for (int kind = ATT_KIND_SIMT; kind <= ATT_KIND_MMA; kind++) { /* CUDA cores first: the reference for the distance columns */
        BenchRun r = bench_run<HS>(b, B, T, NH, hs, kind, none), rd = bench_run<HS>(b, B, T, NH, hs, kind, drop);
        char dist[64] = "(reference)", dist_drop[64] = "(reference)";
        if (kind != ATT_KIND_SIMT) {
            snprintf(dist, sizeof(dist), "%.2e / %.2e", norm_rel(r.out, ref.out, n_out), norm_rel(r.dqkv, ref.dqkv, n_qkv));
            snprintf(dist_drop, sizeof(dist_drop), "%.2e / %.2e", norm_rel(rd.out, ref_drop.out, n_out), norm_rel(rd.dqkv, ref_drop.dqkv, n_qkv));
        }
        const char* name = kind == ATT_KIND_SIMT ? "simt (CUDA cores)"
                           : kind == ATT_KIND_TC ? "tc (tensor cores, WMMA)"
                           : attention_mma_fits(HS, hs, b.out, b.qkv, b.dqkv) ? "mma (tensor cores, mma.sync)"
                                                                               : "mma (tensor cores; hs not 64/128: runs tc)";
        printf("| %d %d %d %d | %s | %.3f | %.1f | %.3f | %.1f | %.3f | %.3f | %s | %s |\n", B, T, NH, hs, name, r.fwd_ms,
               fwd_flops / (r.fwd_ms * 1e-3) / 1e12, r.bwd_ms, bwd_flops / (r.bwd_ms * 1e-3) / 1e12, rd.fwd_ms, rd.bwd_ms, dist_drop, dist);
        fflush(stdout);
        if (kind != ATT_KIND_SIMT) {
            bench_run_free(&r);
            bench_run_free(&rd);
        } else {
            ref = r;
            ref_drop = rd;
        }
    }
    bench_run_free(&ref);
    bench_run_free(&ref_drop);
    CUDA_CHECK(cudaFree(b.qkv));
    CUDA_CHECK(cudaFree(b.dqkv));
    CUDA_CHECK(cudaFree(b.dout));
    CUDA_CHECK(cudaFree(b.out));
    CUDA_CHECK(cudaFree(b.lse));
    CUDA_CHECK(cudaFree(b.rowsum));
    CUDA_CHECK(cudaFree(b.dq_partials));
}

static int parse_positive(const char* s, const char* what) {
    char* end = NULL;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v <= 0 || v > (1 << 20)) fail("bench_attention: %s '%s' is not a positive integer up to 2^20", what, s);
    return (int)v;
}

int main(int argc, char** argv) {
    static const int defaults[] = {16, 1024, 12, 64, 4, 8192, 16, 128};
    if ((argc - 1) % 4) fail("bench_attention: arguments come in groups of four: B T NH HS");
    int nshapes = argc > 1 ? (argc - 1) / 4 : 2;
    char why[256] = "";
    int devices = gpu_device_count(why, sizeof(why));
    if (devices == GPU_BROKEN) fail("bench_attention: CUDA device unusable (%s)", why);
    if (devices == 0) {
        printf("SKIP: no CUDA device (%s)\n", why);
        return 77;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("bench_attention: %s, %s storage; causal; FLOPs 2*B*NH*T^2*hs forward, 2.5x that backward\n\n", prop.name, PRECISION_NAME);
    printf("| B T NH hs | kernels | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd ms, dropout %g | bwd ms, dropout %g "
           "| rel. distance to CUDA cores, dropout %g (out / dqkv) | rel. distance to CUDA cores (out / dqkv) |\n",
           BENCH_DROPOUT_P, BENCH_DROPOUT_P, BENCH_DROPOUT_P);
    printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (int s = 0; s < nshapes; s++) {
        const char* const* a = (const char* const*)argv + 1 + 4 * s;
        int B = argc > 1 ? parse_positive(a[0], "B") : defaults[4 * s];
        int T = argc > 1 ? parse_positive(a[1], "T") : defaults[4 * s + 1];
        int NH = argc > 1 ? parse_positive(a[2], "NH") : defaults[4 * s + 2];
        int hs = argc > 1 ? parse_positive(a[3], "HS") : defaults[4 * s + 3];
        if ((long long)B * NH > 65535) fail("bench_attention: B*NH = %lld exceeds the grid limit 65535", (long long)B * NH);
        switch (attention_head_bucket(hs)) {
        case 16: bench_shape<16>(B, T, NH, hs); break;
        case 32: bench_shape<32>(B, T, NH, hs); break;
        case 64: bench_shape<64>(B, T, NH, hs); break;
        case 128: bench_shape<128>(B, T, NH, hs); break;
        default: fail("bench_attention: head size %d is above the 128 the kernels support", hs);
        }
    }
    return 0;
}
