/*
 * bench_attention: the causal attention kernels alone on the GPU, all three
 * families side by side in one process on the same inputs: CUDA cores (simt,
 * llmc/cuda/attention.cuh), WMMA (tc, llmc/cuda/attention_tc.cuh) and inline-PTX
 * mma.sync/ldmatrix/cp.async (mma, llmc/cuda/attention_mma.cuh; head sizes 64 and
 * 128, other head sizes run tc and say so): forward and backward time,
 * TFLOP/s, and how far each one's outputs are from the CUDA-core ones (the
 * first family run: the reference); then
 * the same with attention dropout 0.1 (its time, and its distance to the
 * CUDA-core kernels drawing the same mask).
 *
 * usage: build/bench_attention_bf16 [B T NH HS]...   (groups of four; default:
 *        the d12 shape 16 1024 12 64, the 24x2048 shape 4 8192 16 128, and
 *        build/bench_attention_bf16 --long
 *        one long sequence: B=1, NH=16 at T = 32768 and 131072, hs 64 and
 *        128, tensor-core kernels only (the CUDA-core ones would take
 *        minutes a shape): tc first, the reference of the distance columns
 *        build/bench_attention_bf16 --launch B T NH HS [NKV]
 *        (NKV: grouped-query K/V heads, default NH; e.g. llama3.1-8b's
 *        1 T 32 128 8, where the dK/dV kernel's grid has B*NKV rows)
 *        the launch report: runs nothing, prints one line per kernel of the
 *        forward and the backward that the trainer's build runs for this
 *        shape, `kernel=NAME grid=X,Y,Z threads=N smem=BYTES blocks_per_sm=K
 *        resident=R` (blocks per SM from the occupancy API on a GPU; on the
 *        emulator or without a GPU from the recorded ptxas figures by
 *        sm_90's occupancy rules, "unknown" where none are recorded;
 *        resident: the blocks in flight at once, min(grid, K x SMs), with
 *        132 SMs for the sm_90 figures), then the scratch bytes.
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
#include "llmc/cuda/attention.cuh"
#include "llmc/core/rand.h"

#include "llmc/cuda/ptx.cuh"

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

typedef struct { floatX *qkv, *dout, *out, *dqkv; float *lse, *rowsum; } BenchBuffers;

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
    const AttHeads hd = att_heads(NH, NH, hs); /* GPT-2's heads: NKV = NH */
    BenchRun r;
    r.fwd_ms = time_ms([&] { attention_forward_launch<HS>(b.out, b.lse, b.qkv, B, T, hd, kind, drop, 0); });
    r.bwd_ms = time_ms([&] { attention_backward_launch<HS>(b.dqkv, b.rowsum, b.dout, b.qkv, b.out, b.lse, B, T, hd, kind, drop, 0); });
    attention_forward_launch<HS>(b.out, b.lse, b.qkv, B, T, hd, kind, drop, 0);
    attention_backward_launch<HS>(b.dqkv, b.rowsum, b.dout, b.qkv, b.out, b.lse, B, T, hd, kind, drop, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    r.out = fetch(b.out, (size_t)B * T * C);
    r.dqkv = fetch(b.dqkv, (size_t)B * T * 3 * C);
    return r;
}

static void bench_run_free(BenchRun* r) {
    free(r->out);
    free(r->dqkv);
}

/* first: the first kernel family run, the reference of the distance columns. */
template <int HS> static void bench_shape(int B, int T, int NH, int hs, int first) {
    const int C = NH * hs;
    const size_t n_qkv = (size_t)B * T * 3 * C, n_out = (size_t)B * T * C, n_stat = (size_t)B * NH * T;
    BenchBuffers b;
    CUDA_CHECK(cudaMalloc((void**)&b.qkv, n_qkv * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc((void**)&b.dqkv, n_qkv * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc((void**)&b.dout, n_out * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc((void**)&b.out, n_out * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc((void**)&b.lse, n_stat * sizeof(float)));
    CUDA_CHECK(cudaMalloc((void**)&b.rowsum, n_stat * sizeof(float)));
    bench_fill_kernel<<<grid_for(n_qkv, 256), 256>>>(b.qkv, n_qkv, 1);
    bench_fill_kernel<<<grid_for(n_out, 256), 256>>>(b.dout, n_out, 2);
    CUDA_CHECK_LAUNCH();
    const double fwd_flops = 2.0 * B * NH * (double)T * T * hs, bwd_flops = 2.5 * fwd_flops;
    const DropoutSite none = attention_no_dropout();
    DropoutState drop_state = {{0}, 1234, 0, 1, 0, 0, 0};
    drop_state.p[DROPOUT_ATTENTION] = BENCH_DROPOUT_P;
    const DropoutSite drop = dropout_site(&drop_state, DROPOUT_ATTENTION, 0);
    BenchRun ref = {}, ref_drop = {};
    for (int kind = first; kind <= ATT_KIND_MMA; kind++) { /* the first family: the reference for the distance columns */
        BenchRun r = bench_run<HS>(b, B, T, NH, hs, kind, none), rd = bench_run<HS>(b, B, T, NH, hs, kind, drop);
        char dist[64] = "(reference)", dist_drop[64] = "(reference)";
        if (kind != first) {
            snprintf(dist, sizeof(dist), "%.2e / %.2e", norm_rel(r.out, ref.out, n_out), norm_rel(r.dqkv, ref.dqkv, n_qkv));
            snprintf(dist_drop, sizeof(dist_drop), "%.2e / %.2e", norm_rel(rd.out, ref_drop.out, n_out), norm_rel(rd.dqkv, ref_drop.dqkv, n_qkv));
        }
        const char* name = kind == ATT_KIND_SIMT ? "simt (CUDA cores)"
                           : kind == ATT_KIND_TC ? "tc (tensor cores, WMMA)"
                           : attention_mma_fits(kind, HS, hs, b.out, b.qkv, b.dqkv) ? "mma (tensor cores, mma.sync)"
                                                                               : "mma (tensor cores; hs not 64/128: runs tc)";
        printf("| %d %d %d %d | %s | %.3f | %.1f | %.3f | %.1f | %.3f | %.3f | %s | %s |\n", B, T, NH, hs, name, r.fwd_ms,
               fwd_flops / (r.fwd_ms * 1e-3) / 1e12, r.bwd_ms, bwd_flops / (r.bwd_ms * 1e-3) / 1e12, rd.fwd_ms, rd.bwd_ms, dist_drop, dist);
        fflush(stdout);
        if (kind != first) {
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
}

static int parse_positive(const char* s, const char* what) {
    char* end = NULL;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v <= 0 || v > (1 << 20)) fail("bench_attention: %s '%s' is not a positive integer up to 2^20", what, s);
    return (int)v;
}

/* SMs of the device the sm_90 figures describe (an H100 SXM has 132, as has an H200). */
#define LAUNCH_SM90_SMS 132

/* Blocks of launch l per SM of device 0 by the occupancy API, and its SMs
 * (a GPU's answer; the emulator has none to give: 0). */
static int occupancy_blocks_per_sm(const AttLaunch& l, bool dynamic_smem, int* sms) {
#if PTX_EMULATED
    (void)l; (void)dynamic_smem; (void)sms;
    return 0;
#else
    const size_t dyn = dynamic_smem ? l.smem : 0;
    if (dyn) CUDA_CHECK(cudaFuncSetAttribute(l.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, l.fn, l.threads, dyn));
    CUDA_CHECK(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, 0));
    return per_sm;
#endif
}

/* The launch report of one shape (usage above). */
template <int HS> static void launch_report(int B, int T, int NH, int NKV, int hs, int devices) {
    AttLaunch l[4];
    int forward = 0;
    const int n = attention_launches<HS>(l, &forward, B, T, NH, NKV, hs, ATTENTION_KIND);
    const bool measured = devices > 0 && !PTX_EMULATED;
    int sms = LAUNCH_SM90_SMS;
    if (measured) occupancy_blocks_per_sm(l[0], false, &sms);
    printf("launch report: B=%d T=%d NH=%d NKV=%d hs=%d, %s; blocks per SM %s, %d SMs\n", B, T, NH, NKV, hs, ATTENTION_KERNELS_NAME,
           measured ? "from the occupancy API" : "from the recorded ptxas figures (sm_90 occupancy rules; predicted)", sms);
    for (int i = 0; i < n; i++) {
        int per_sm = 0;
        if (measured) {
            per_sm = occupancy_blocks_per_sm(l[i], l[i].dynamic_smem, &sms);
        } else if (l[i].regs) {
            per_sm = att_sm90_blocks_per_sm(l[i].regs, l[i].threads, l[i].smem);
        }
        const size_t blocks = (size_t)l[i].grid.x * l[i].grid.y * l[i].grid.z;
        char per_sm_s[32] = "unknown", resident[32] = "unknown";
        if (measured || l[i].regs) {
            snprintf(per_sm_s, sizeof(per_sm_s), "%d", per_sm);
            const size_t slots = (size_t)per_sm * sms;
            snprintf(resident, sizeof(resident), "%zu", blocks < slots ? blocks : slots);
        }
        printf("%s kernel=%s grid=%u,%u,%u threads=%d smem=%zu blocks_per_sm=%s resident=%s\n", i < forward ? "fwd" : "bwd", l[i].name,
               l[i].grid.x, l[i].grid.y, l[i].grid.z, l[i].threads, l[i].smem, per_sm_s, resident);
    }
    printf("scratch: %zu bytes (attention_rowsum: B*NH*T fp32; the backward keeps no other scratch)\n", attention_scratch_bytes(B, T, NH));
}

int main(int argc, char** argv) {
    static const int defaults[] = {16, 1024, 12, 64, 4, 8192, 16, 128};
    static const int long_shapes[] = {1, 32768, 16, 64, 1, 32768, 16, 128, 1, 131072, 16, 64, 1, 131072, 16, 128};
    const bool launch = argc > 1 && strcmp(argv[1], "--launch") == 0, long_set = argc == 2 && strcmp(argv[1], "--long") == 0;
    if (launch && argc != 6 && argc != 7) fail("bench_attention: --launch takes one shape: B T NH HS [NKV]");
    if (!launch && !long_set && (argc - 1) % 4) fail("bench_attention: arguments come in groups of four: B T NH HS");
    const int* preset = long_set ? long_shapes : defaults;
    const bool own_shapes = argc > 1 && !long_set;
    int nshapes = own_shapes ? (argc - 1) / 4 : long_set ? 4 : 2;
    char why[256] = "";
    int devices = gpu_device_count(why, sizeof(why));
    if (launch) {
        const int B = parse_positive(argv[2], "B"), T = parse_positive(argv[3], "T"), NH = parse_positive(argv[4], "NH");
        const int hs = parse_positive(argv[5], "HS"), NKV = argc == 7 ? parse_positive(argv[6], "NKV") : NH;
        if (NH % NKV) fail("bench_attention: NKV %d does not divide NH %d", NKV, NH);
        if (devices == GPU_BROKEN) devices = 0; /* the report needs no GPU: the recorded figures then */
        if ((long long)B * NH > 65535) fail("bench_attention: B*NH = %lld exceeds the grid limit 65535", (long long)B * NH);
        switch (attention_head_bucket(hs)) {
        case 16: launch_report<16>(B, T, NH, NKV, hs, devices); break;
        case 32: launch_report<32>(B, T, NH, NKV, hs, devices); break;
        case 64: launch_report<64>(B, T, NH, NKV, hs, devices); break;
        case 128: launch_report<128>(B, T, NH, NKV, hs, devices); break;
        default: fail("bench_attention: head size %d is above the 128 the kernels support", hs);
        }
        return 0;
    }
    if (devices == GPU_BROKEN) fail("bench_attention: CUDA device unusable (%s)", why);
    if (devices == 0) {
        printf("SKIP: no CUDA device (%s)\n", why);
        return 77;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("bench_attention: %s, %s storage; causal; FLOPs 2*B*NH*T^2*hs forward, 2.5x that backward\n\n", prop.name, PRECISION_NAME);
    printf("| B T NH hs | kernels | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd ms, dropout %g | bwd ms, dropout %g "
           "| rel. distance to the reference, dropout %g (out / dqkv) | rel. distance to the reference (out / dqkv) |\n",
           BENCH_DROPOUT_P, BENCH_DROPOUT_P, BENCH_DROPOUT_P);
    printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (int s = 0; s < nshapes; s++) {
        const char* const* a = (const char* const*)argv + 1 + 4 * s;
        int B = own_shapes ? parse_positive(a[0], "B") : preset[4 * s];
        int T = own_shapes ? parse_positive(a[1], "T") : preset[4 * s + 1];
        int NH = own_shapes ? parse_positive(a[2], "NH") : preset[4 * s + 2];
        int hs = own_shapes ? parse_positive(a[3], "HS") : preset[4 * s + 3];
        const int first = long_set ? ATT_KIND_TC : ATT_KIND_SIMT;
        if ((long long)B * NH > 65535) fail("bench_attention: B*NH = %lld exceeds the grid limit 65535", (long long)B * NH);
        switch (attention_head_bucket(hs)) {
        case 16: bench_shape<16>(B, T, NH, hs, first); break;
        case 32: bench_shape<32>(B, T, NH, hs, first); break;
        case 64: bench_shape<64>(B, T, NH, hs, first); break;
        case 128: bench_shape<128>(B, T, NH, hs, first); break;
        default: fail("bench_attention: head size %d is above the 128 the kernels support", hs);
        }
    }
    return 0;
}
