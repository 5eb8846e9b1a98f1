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
 *        132 SMs for the sm_90 figures; the mma dK/dV kernel's threads
 *        are its block's warps, 4, 2 or 1, as the launch picks them for
 *        the SMs: attention_mma_dkv_warps), then the scratch bytes.
 *        build/bench_attention_bf16 --fill
 *        the fill report: runs nothing, prints for GPT-2 124M (d12),
 *        llama3.1-8b, smollm2-135m and qwen2.5-0.5b at B=1 (the GPU's SMs,
 *        or 132) `fill model=NAME NH= NKV= hs= dq_fills_from_T=
 *        dkv_wide_fills_from_T= dkv_wide_every_sm_from_T=
 *        dkv_every_sm_from_T= dkv_block_warps=`: the least T from which
 *        the dQ and the 4-warp dK/dV grids have 2 blocks (8 warps) per SM,
 *        and from which the dK/dV grid, 4-warp and as launched (narrower
 *        blocks where the 4-warp grid leaves SMs idle: the warps it then
 *        has a block), has a block on every SM. Narrow blocks spread the
 *        same warps over more SMs; they add none.
 *        build/bench_attention_bf16 --rope B T NH NKV HS
 *        RoPE beside attention, the build's family, grouped-query heads
 *        (e.g. llama3.1-8b's 1 32768 32 8 128), llama3.1-8b's frequencies:
 *        one line `rope B= T= NH= NKV= hs= kernels= pass_ms= pass_GBps=
 *        fwd_ms= bwd_ms= bwd_fused_ms= bwd_then_pass_ms= saved_ms=
 *        bwd_fused_vs_pass_rel=`: the forward's pass over Q and K
 *        (llmc/cuda/rope.cuh; its bytes read and written a second), the
 *        attention forward, its backward without RoPE, with dQ and dK
 *        turned back in the epilogues, and without them followed by the
 *        pass turning them back (what the epilogues replace), the time
 *        that saves, and how far the two results are apart (norm of the
 *        difference over the norm: the epilogues round once, the pass
 *        rounds twice).
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
#include "llmc/core/model.h"

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

/* The buffers of n_qkv (qkv, dqkv), n_out (out, dout) and n_stat (lse, rowsum) elements; qkv and dout filled. */
static BenchBuffers bench_buffers(size_t n_qkv, size_t n_out, size_t n_stat) {
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
    return b;
}

static void bench_buffers_free(BenchBuffers* b) {
    CUDA_CHECK(cudaFree(b->qkv));
    CUDA_CHECK(cudaFree(b->dqkv));
    CUDA_CHECK(cudaFree(b->dout));
    CUDA_CHECK(cudaFree(b->out));
    CUDA_CHECK(cudaFree(b->lse));
    CUDA_CHECK(cudaFree(b->rowsum));
}

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
    BenchBuffers b = bench_buffers(n_qkv, n_out, n_stat);
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
    bench_buffers_free(&b);
}

static int parse_positive(const char* s, const char* what) {
    char* end = NULL;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v <= 0 || v > (1 << 20)) fail("bench_attention: %s '%s' is not a positive integer up to 2^20", what, s);
    return (int)v;
}

/* The --rope report of one shape (usage above). */
template <int HS> static void rope_report(int B, int T, int NH, int NKV, int hs) {
    const AttHeads hd = att_heads(NH, NKV, hs);
    const size_t rows = (size_t)B * T, n_qkv = rows * hd.q_ld, n_out = rows * hd.out_ld, n_stat = rows * NH;
    BenchBuffers b = bench_buffers(n_qkv, n_out, n_stat);
    ModelConfig cfg;
    if (config_from_descriptor("llama3.1-8b", &cfg) != 0) fail("bench_attention: the llama3.1-8b preset is missing");
    cfg.head_size = hs;
    RopeRows rope;
    memset(&rope, 0, sizeof(rope));
    rope.table = rope_table(&cfg);
    rope.lay = TokenLayout{T, 0, 1, 0, 1};
    const DropoutSite none = attention_no_dropout();
    const int kind = ATTENTION_KIND, heads = NH + NKV;
    const float pass_ms = time_ms([&] { gpu_rope_rotate(b.qkv, hd.q_ld, &rope, 0, (int)rows, heads, 1, 0); });
    const float fwd_ms = time_ms([&] { attention_forward_launch<HS>(b.out, b.lse, b.qkv, B, T, hd, kind, none, 0); });
    const float bwd_ms = time_ms([&] { attention_backward_launch<HS>(b.dqkv, b.rowsum, b.dout, b.qkv, b.out, b.lse, B, T, hd, kind, none, 0); });
    const float fused_ms = time_ms([&] {
        attention_backward_launch<HS>(b.dqkv, b.rowsum, b.dout, b.qkv, b.out, b.lse, B, T, hd, kind, none, 0, nullptr, &rope);
    });
    CUDA_CHECK(cudaDeviceSynchronize());
    float* fused_out = fetch(b.dqkv, n_qkv);
    const float then_pass_ms = time_ms([&] {
        attention_backward_launch<HS>(b.dqkv, b.rowsum, b.dout, b.qkv, b.out, b.lse, B, T, hd, kind, none, 0);
        gpu_rope_rotate(b.dqkv, hd.q_ld, &rope, 0, (int)rows, heads, -1, 0);
    });
    CUDA_CHECK(cudaDeviceSynchronize());
    float* pass_out = fetch(b.dqkv, n_qkv);
    const double pass_bytes = 2.0 * rows * heads * hs * sizeof(floatX); /* Q and K read and written */
    int family = attention_family(kind, hs);
    if (family == ATT_KIND_MMA && !attention_mma_fits(kind, HS, hs, b.out, b.qkv, b.dqkv)) family = ATT_KIND_TC;
    const char* name = family == ATT_KIND_SIMT ? "simt" : family == ATT_KIND_MMA ? "mma" : "tc";
    printf("rope B=%d T=%d NH=%d NKV=%d hs=%d kernels=%s%s pass_ms=%.4f pass_GBps=%.1f fwd_ms=%.3f bwd_ms=%.3f bwd_fused_ms=%.3f "
           "bwd_then_pass_ms=%.3f saved_ms=%.4f bwd_fused_vs_pass_rel=%.2e\n",
           B, T, NH, NKV, hs, name, attention_rope_in_kernels(family, HS, hs) ? "" : "+pass", pass_ms,
           pass_bytes / (pass_ms * 1e-3) / 1e9, fwd_ms, bwd_ms, fused_ms, then_pass_ms, then_pass_ms - fused_ms,
           norm_rel(fused_out, pass_out, n_qkv));
    free(fused_out);
    free(pass_out);
    bench_buffers_free(&b);
}

/* SMs of the device the sm_90 figures describe (an H100 SXM has 132, as has an H200). */
#define LAUNCH_SM90_SMS 132

/* Blocks of launch l per SM of device 0 by the occupancy API (a GPU's
 * answer; the emulator has none to give: 0). */
static int occupancy_blocks_per_sm(const AttLaunch& l, bool dynamic_smem) {
#if PTX_EMULATED
    (void)l; (void)dynamic_smem;
    return 0;
#else
    const size_t dyn = dynamic_smem ? l.smem : 0;
    if (dyn) CUDA_CHECK(cudaFuncSetAttribute(l.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, l.fn, l.threads, dyn));
    return per_sm;
#endif
}

/* SMs the launch report describes: the GPU's, or the sm_90 figures' 132. */
static int launch_sms(bool measured) {
#if !PTX_EMULATED
    if (measured) return attention_device_sms();
#else
    (void)measured;
#endif
    return LAUNCH_SM90_SMS;
}

/* The launch report of one shape (usage above). */
template <int HS> static void launch_report(int B, int T, int NH, int NKV, int hs, int devices) {
    AttLaunch l[4];
    int forward = 0;
    const bool measured = devices > 0 && !PTX_EMULATED;
    const int sms = launch_sms(measured);
    const int n = attention_launches<HS>(l, &forward, B, T, NH, NKV, hs, ATTENTION_KIND, sms);
    printf("launch report: B=%d T=%d NH=%d NKV=%d hs=%d, %s; blocks per SM %s, %d SMs\n", B, T, NH, NKV, hs, ATTENTION_KERNELS_NAME,
           measured ? "from the occupancy API" : "from the recorded ptxas figures (sm_90 occupancy rules; predicted)", sms);
    for (int i = 0; i < n; i++) {
        int per_sm = 0;
        if (measured) {
            per_sm = occupancy_blocks_per_sm(l[i], l[i].dynamic_smem);
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

/* The least T at which blocks_at(T) reaches want (0: not up to 2^20). */
template <typename F> static int fill_from(F blocks_at, size_t want) {
    for (int T = 1; T <= (1 << 20); T++)
        if (blocks_at(T) >= want) return T;
    return 0;
}

/* The fill report (usage above): for each model at B = 1 on the device's
 * SMs (132 where the sm_90 figures answer), the least T from which the
 * mma backward's grids fill the device (ATT_MMA_BWD_MIN_BLOCKS_PER_SM
 * blocks, 8 warps, per SM: dQ, the wide dK/dV kernel) and from which the
 * dK/dV kernel has a block on every SM (wide, and as launched:
 * attention_mma_dkv_warps, with its block's warps there). */
static void fill_report(int devices) {
    static const char* models[] = {"d12", "llama3.1-8b", "smollm2-135m", "qwen2.5-0.5b"};
    const bool measured = devices > 0 && !PTX_EMULATED;
    const int sms = launch_sms(measured);
    const size_t full = (size_t)ATT_MMA_BWD_MIN_BLOCKS_PER_SM * sms;
    printf("fill report: B=1, %d SMs (%s); *_fills_from_T: the least T whose grid has %d blocks (%d warps) per SM, %zu; "
           "*_every_sm_from_T: a block on every SM; dkv: the dK/dV kernel as launched (attention_mma_dkv_warps), its block's warps there\n",
           sms, measured ? "this GPU" : "sm_90's count", ATT_MMA_BWD_MIN_BLOCKS_PER_SM, ATT_MMA_BWD_MIN_BLOCKS_PER_SM * ATT_MMA_WARPS, full);
    for (size_t m = 0; m < sizeof(models) / sizeof(models[0]); m++) {
        ModelConfig cfg;
        if (config_from_descriptor(models[m], &cfg)) fail("bench_attention: no model %s", models[m]);
        const BlockWidths w = block_widths(&cfg);
        auto blocks = [](dim3 g) { return (size_t)g.x * g.y * g.z; };
        auto dq = [&](int T) { return blocks(attention_grid(1, T, w.NH, ATT_MMA_ROWS)); };
        auto wide = [&](int T) { return blocks(attention_mma_dkv_grid(1, T, w.NKV)); };
        auto launched = [&](int T) { return blocks(attention_mma_dkv_grid(1, T, w.NKV, attention_mma_dkv_warps(1, T, w.NKV, sms))); };
        const int every = fill_from(launched, (size_t)sms);
        printf("fill model=%s NH=%d NKV=%d hs=%d dq_fills_from_T=%d dkv_wide_fills_from_T=%d dkv_wide_every_sm_from_T=%d dkv_every_sm_from_T=%d "
               "dkv_block_warps=%d\n", models[m], w.NH, w.NKV, w.HD, fill_from(dq, full), fill_from(wide, full), fill_from(wide, (size_t)sms), every,
               every ? attention_mma_dkv_warps(1, every, w.NKV, sms) : 0);
    }
}

int main(int argc, char** argv) {
    static const int defaults[] = {16, 1024, 12, 64, 4, 8192, 16, 128};
    static const int long_shapes[] = {1, 32768, 16, 64, 1, 32768, 16, 128, 1, 131072, 16, 64, 1, 131072, 16, 128};
    const bool launch = argc > 1 && strcmp(argv[1], "--launch") == 0, long_set = argc == 2 && strcmp(argv[1], "--long") == 0;
    const bool fill = argc > 1 && strcmp(argv[1], "--fill") == 0, rope = argc > 1 && strcmp(argv[1], "--rope") == 0;
    if (rope && argc != 7) fail("bench_attention: --rope takes one shape: B T NH NKV HS");
    if (launch && argc != 6 && argc != 7) fail("bench_attention: --launch takes one shape: B T NH HS [NKV]");
    if (fill && argc != 2) fail("bench_attention: --fill takes no arguments");
    if (!launch && !long_set && !fill && !rope && (argc - 1) % 4) fail("bench_attention: arguments come in groups of four: B T NH HS");
    const int* preset = long_set ? long_shapes : defaults;
    const bool own_shapes = argc > 1 && !long_set;
    int nshapes = own_shapes ? (argc - 1) / 4 : long_set ? 4 : 2;
    char why[256] = "";
    int devices = gpu_device_count(why, sizeof(why));
    if (fill) {
        fill_report(devices == GPU_BROKEN ? 0 : devices); /* the report needs no GPU: sm_90's SMs then */
        return 0;
    }
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
    if (rope) {
        const int B = parse_positive(argv[2], "B"), T = parse_positive(argv[3], "T"), NH = parse_positive(argv[4], "NH");
        const int NKV = parse_positive(argv[5], "NKV"), hs = parse_positive(argv[6], "HS");
        if (NH % NKV) fail("bench_attention: NKV %d does not divide NH %d", NKV, NH);
        if (hs % 2) fail("bench_attention: RoPE turns pairs of channels: head size %d is odd", hs);
        if ((long long)B * NH > 65535) fail("bench_attention: B*NH = %lld exceeds the grid limit 65535", (long long)B * NH);
        switch (attention_head_bucket(hs)) {
        case 16: rope_report<16>(B, T, NH, NKV, hs); break;
        case 32: rope_report<32>(B, T, NH, NKV, hs); break;
        case 64: rope_report<64>(B, T, NH, NKV, hs); break;
        case 128: rope_report<128>(B, T, NH, NKV, hs); break;
        default: fail("bench_attention: head size %d is above the 128 the kernels support", hs);
        }
        return 0;
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
