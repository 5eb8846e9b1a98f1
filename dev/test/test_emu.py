"""The CUDA trainer's kernels under the CPU emulator of CUDA (dev/emu).

Why it exists: CI has no GPU, so this is where every change to the CUDA
sources is run at all: dev/emu compiles them with the host C++ compiler
against stand-in CUDA/cuBLASLt headers and runs each thread block as
coroutines on a CPU. A pass here means the kernels' logic (indexing, tiling,
masking, reductions, bitwise-equal recomputation) agrees with the CPU
reference under emulation. It is NOT GPU verification: warp scheduling, the
memory model, real cuBLASLt algorithms and performance are not tested
(dev/emu/README.md), and results must never be reported as GPU results. The
trainer's driver, emulated, is test_train_emu.py's.

Tests: the emulator's self-test and the misuse it must stop; test_gpt's
memory-bound kernels alone (vector and scalar paths, a hot token), and the
row-wise ones past element 2^31 (check_wide_offsets, with mutants); test_gpt's
own run_case on small shapes per precision (bf16, fp32, fp16), which together
cover head sizes 16/32/64 (and 48 through the padded template), T that is a
multiple of no tile, the padded vocabulary, every recompute mode's bitwise
equality and three AdamW steps, one case per precision with embedding and
residual dropout (the CPU's masks, regenerated bitwise by every recompute
setting), and test_gpt's non-finite gradient checks; the bias fallback for
shapes without a cuBLASLt bias epilogue; token tiles (run_case with tiled GPU
plans; tiled gradients within TOL_TILES of the untiled ones) and their
mutants; the ring's tile kernels; one long sequence through the attention
kernels; the launch report, the attention benchmark and misaligned biases.
The emulated runs go through a pool with one process per core. Skipped (with
the reason) without g++ or off x86-64 Linux. The default runs use a different
block/warp/lane order per precision (forward, reverse, shuffled). Extras:
REMAT_EMU_SLOW=1 adds larger shapes, T < one tile and T = 333, and every
order for every precision.
"""
import concurrent.futures
import functools
import re
import subprocess

import pytest

from conftest import REPO
from emu_support import EMU, JOBS, OUT, PRECISIONS, SLOW, assert_mutant_applies, emu_run, explain, mutant_sources, precision_param, slow

# NAME:C:NH:V:T per precision. V=300 pads to Vp=384 everywhere. The T values
# are multiples of no attention tile (64 query rows, 32 key rows, 16-key
# sub-tiles), and 2T vs test_gpt's 100-row logits chunks gives one partial
# chunk or a full one plus a partial one. C=48 leaves partial 32-column tiles
# (48, 144 columns) in the column-sum kernels; hs48 runs the 64 template with
# padding; NH=1 makes the head sizes cheap (C = hs).
# C=20 (bf16, fp16) and C=18 (fp32) are multiples of no 16-byte vector width
# (8 and 4 elements), so LayerNorm, the encoder and the C-wide bias gradients
# take their scalar paths inside the whole model (the other shapes take the
# vector paths), and AdamW gets tensors that start off 16-byte alignment.
# The Llama family (test_gpt's test_family_switches, by the name's prefix: llama untied without biases, qwen2 tied
# with Q/K/V biases; RMSNorm, SwiGLU of F = 3C/2, RoPE default or lin/l3/yarn): each scaling in some precision;
# fp32's C=18 gives F=27 and HD/2=9, SwiGLU's and RoPE's scalar paths inside the model. "_kvN": N K/V heads, grouped-
# query attention inside the model (groups of 2 and 3); bf16's _kv2 at T=61 takes two logits chunks (B*T = 122 past
# test_gpt's 100 rows), the untied lm_head's gradient summed in fp32 (plan.h's grads_fp32 range, lm_head alone).
LLAMA_CASES = {"bf16": ["llama_hs16:64:4:300:37", "qwen2yarn_hs32:64:2:300:37", "llama_kv2_hs16:64:4:300:61"],
               "fp32": ["llamal3_hs18:18:1:300:37", "qwen2lin_hs16:48:3:300:21", "qwen2l3_kv1_hs16:48:3:300:21"],
               "fp16": ["llamalin_hs64:64:1:300:21"]}
CASES = {
    "bf16": ["hs16:64:4:300:77", "hs32:64:2:300:37", "hs64:64:1:300:45", "hs20:20:1:300:37", *LLAMA_CASES["bf16"]],
    "fp32": ["hs16:48:3:300:70", "hs32:96:3:300:45", "hs64:64:1:300:37", "hs18:18:1:300:37", *LLAMA_CASES["fp32"]],
    "fp16": ["hs16:64:4:300:45", "hs32:32:1:300:70", "hs48:48:1:300:37", "hs64:64:1:300:21", "hs20:20:1:300:37", *LLAMA_CASES["fp16"]],
}
NONFINITE_CASE = "nonfinite:hs16:64:4:300:64"  # test_gpt's check_nonfinite (injected inf/NaN; FP16 overflow)
# test_gpt's check_grad_accumulation: 8 micro-steps, 8 logits chunks each, with and without fp32 gradient sums
ACCUM_CASE = "accum:hs16:64:4:300:64"
# test_gpt's check_attention: the attention kernels alone with a sharp softmax
# (tensor-core kernels in bf16/fp16, CUDA-core ones in fp32): two query blocks
# and a partial key tile at T=77, a padded head size (48) at T=70, every head
# size bucket up to 128, six query blocks at T=333, and a head size that is no
# multiple of 8 (20: the staging's 2-byte path instead of 16-byte chunks).
# About a second each.
ATTENTION_CASES = ["attention:hs32:64:2:300:77", "attention:hs48:96:2:300:70", "attention:hs16:64:4:300:45",
                   "attention:hs128:128:1:300:130", "attention:hs64:128:2:300:333", "attention:hs20:40:2:300:45"]
# test_gpt's run_case with dropout (model_dropout: 0.1 at the embedding, the
# attention probabilities and both residual branches): the GPU's masks must be
# the CPU's and every recompute setting must regenerate them. bf16's hs64 runs
# the mma kernels' dropout, hs16 the tc kernels'; fp32's C=18 leaves a partial
# last group of eight (one generator call).
MODEL_DROPOUT_CASES = {"bf16": ["dropmodel:hs16:64:4:300:77", "dropmodel:hs64:64:1:300:45", "dropmodel:llamayarn_hs16:64:4:300:37"],
                       "fp32": ["dropmodel:hs18:18:1:300:37"],
                       "fp16": ["dropmodel:hs32:32:1:300:45"]}
# The same with attention dropout 0.1 (check_attention's site): the kernels must draw the CPU reference's
# mask bit for bit (one element kept or dropped differently moves its row's output by a whole value), in
# the forward and again in the backward, for every head size bucket and partial tiles: in the 16-bit builds
# head sizes 64 and 128 run the mma kernels, the others the tc kernels; fp32 runs the simt kernels.
ATTENTION_DROPOUT_CASES = [c.replace("attention:", "dropout:", 1) for c in ATTENTION_CASES]
# The mma kernels with attention dropout in the other block orders (the slow set): the 16-bit builds'
# head sizes 64 and 128, T a multiple of no tile.
MMA_DROPOUT_CASES = {"bf16": ["dropout:hs64:128:2:300:333"], "fp16": ["dropout:hs64:64:1:300:70"], "fp32": []}
# test_gpt's check_attention_tiles: the ring attention tile kernels (llmc/cuda/attention.cuh's
# gpu_attention_tile_*) against the CPU reference's attention_tile_forward/backward on eight block sets
# (diagonal, diagonal with keys in other rows, full, a band, the first rows masked, bands at q0 and k0
# multiples of 16 and at q0 alone one, four blocks merged; the other offsets multiples of neither 16 nor
# 64; chunks of 37, 48 and 70 rows: ragged tiles), then a two-member ring (the N=2 chunk layout run block
# by block in ring order) against whole-sequence attention, with and without attention dropout (masks
# keyed by global position). In the 16-bit builds head sizes 64 and 128 run the mma family's block
# kernels, the others the simt ones (the tc family has none yet); fp32 the simt ones. About 13 s each.
BLOCK_CASES = ["blocks:hs32:64:2:300:37", "blocks:hs64:128:2:300:70", "blocks:hs128:128:1:300:37", "blocks:hs20:40:2:300:37",
               "blocksdrop:hs16:64:4:300:37", "blocksdrop:hs64:64:1:300:48", "blocksdrop:hs128:128:1:300:70", "blocksdrop:hs48:96:2:300:37"]


# test_gpt's grouped-query attention (NAME:NH:NKV:HD:T): NKV K/V heads shared by NH/NKV query heads, no copy
# per query head, against the CPU reference's attention_forward_heads/_backward_heads, every (row, head)
# slice; gqadrop adds documents and attention dropout (each query head's own masks), every case runs the
# backward twice for the same bits, and at head sizes 64 and 128 in the 16-bit builds again with the mma dK/dV
# kernel at blocks of 4, 2 and 1 warps (the launch's choice by SMs), bitwise equal to the launch's; gqaring2/3 are context parallelism's 2- and 3-member rings on the
# compact K/V (2 NKV HD a token, packed by the ring's gpu_ring_pack_kv) against whole-sequence attention.
# Groups of 2, 3 (smollm2-135m's 9/3 at hs64) and 4 (hs128: llama3.1-8b's group); hs64 and hs128 run the
# mma kernels in the 16-bit builds, hs32 the tc ones, fp32 the simt ones. Every case runs the backward again with
# RoPE's turn back of dQ and dK (llama3's scaling; yarn's with documents restarting positions) against the CPU's
# backward then rope_rotate: in the mma and simt kernels' epilogues (simt: where the head size is the template's),
# by the pass after them in the tc family (hs32 and hs48 here; hs48 is padded to 64); the rings turn back as their
# fp32 sums are stored. A few seconds each.
GQA_CASES = ["gqa:g2hs64:4:2:64:77", "gqadrop:g3hs64:9:3:64:70", "gqa:g4hs128:8:2:128:45", "gqadrop:g2hs32:4:2:32:45",
             "gqaring2:g2hs64:4:2:64:37", "gqaring3:g3hs32:6:2:32:24", "gqa:g2hs48:4:2:48:40"]
# The slow set: more groups (1, 3, 4, 7: qwen2.5-0.5b's 14/2), head sizes and T, and the rings at hs128.
GQA_SLOW_CASES = ["gqadrop:g1hs64:2:2:64:333", "gqadrop:g4hs128:8:2:128:130", "gqadrop:g7hs64:14:2:64:77", "gqa:g3hs16:6:2:16:333",
                  "gqaring2:g4hs128:8:2:128:37", "gqaring3:g3hs64:9:3:64:48"]

# Token tiles (--tile-tokens K) on the GPU side of test_gpt: run_case against the CPU reference and every
# recompute setting bitwise equal to -r 0 at the same K (K dividing no B*T here: a short last tile; tiles of
# 5 rows of 64 bf16 channels start at 128-byte offsets in kept tensors and at 256 in one-tile buffers, which
# cuBLASLt must not tell apart), with dropout too; fp32's C=18 starts tiles at 8-byte offsets. tilebound:
# the tiled gradients of one step within TOL_TILES of the untiled ones (tiles of 2 rows: summed in floatX
# instead of fp32 across tiles they are not).
# Llama tiles: llama_hs16's SwiGLU is 96 wide, qwen2l3_hs16 with dropout; fp32's llamal3_hs16:48 has F = 72, whose
# 5-row tiles start 32-byte aligned in kept tensors where C's start 64-byte aligned (cuBLASLt's alignment cap must
# take the narrowest, or the modes' matmuls differ).
TILE_CASES = {"bf16": ["tiles5:hs16:64:4:300:33", "tiles7:dropmodel:hs16:64:4:300:33", "tiles2:tilebound:hs16:64:4:300:77",
                       "tiles5:tilebound:hs16:64:4:300:77", "tiles5:llama_hs16:64:4:300:33", "tiles7:dropmodel:qwen2l3_hs16:64:4:300:33"],
              "fp32": ["tiles5:hs18:18:1:300:37", "tiles2:tilebound:hs16:48:3:300:70", "tiles5:llamal3_hs16:48:3:300:37"],
              "fp16": ["tiles5:hs32:32:1:300:45", "tiles2:tilebound:hs16:64:4:300:77"]}
NOBIAS_CASES = ["hs32:64:2:300:21"]  # cuBLASLt offering no bias epilogue: matmul.cuh's own bias kernel
SLOW_CASES = ["hs128:128:1:300:70", "hs48:96:2:300:333", "hs16:64:4:300:5", "hs64:128:2:300:130", "qwen2_hs128:128:1:300:21",
              "llamal3_hs20:20:1:300:37", "llamalin_hs64:64:1:300:45", "llama_kv2_hs32:128:4:300:45", "tiles5:qwen2_kv1_hs64:192:3:300:33"]
# Block/warp/lane order of the default runs, one per precision at no extra cost:
# a result that depends on it is a race between blocks or a missing barrier
# (e.g. a column-sum block writing past its columns into a slot another block
# fills later passes in forward order only).
DEFAULT_ORDER = {"bf16": "forward", "fp32": "reverse", "fp16": "shuffle:1"}
ORDERS = ["forward", "reverse", "shuffle:2"]
SETTINGS_COMPARED = 7  # test_gpt's settings after the -r 0 reference


# ---- build ----

@pytest.fixture(scope="session")
def pool(emu_build):
    """Runs the emulated jobs in the background, one per core; tests wait on their own."""
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=JOBS)
    yield ex
    ex.shutdown(wait=False, cancel_futures=True)


_futures = {}


def submit(pool, key, fn, *args):
    if key not in _futures:
        _futures[key] = pool.submit(fn, *args)
    return _futures[key]


def gpt_job(precision, cases, order=None, **env):
    if order:
        env["EMU_ORDER"] = order
    return emu_run([OUT / f"emu_test_gpt_{precision}", *cases], **env)


@pytest.fixture(scope="session")
def default_jobs(pool):
    """Queues every default emulated run at once, so that they overlap."""
    built = set(subprocess.run(["make", "-s", "-C", str(EMU), "precisions"], capture_output=True, text=True).stdout.split())
    for p in PRECISIONS:
        if p in built:
            submit(pool, ("gpt", p), gpt_job, p, [NONFINITE_CASE, ACCUM_CASE, *ATTENTION_CASES, *ATTENTION_DROPOUT_CASES, *CASES[p],
                                                   *MODEL_DROPOUT_CASES[p]], DEFAULT_ORDER[p])
    for p in PRECISIONS:
        if p in built:
            submit(pool, ("gpt-tiles", p), gpt_job, p, TILE_CASES[p], DEFAULT_ORDER[p])
    if "bf16" in built:
        submit(pool, ("gpt-nobias", "bf16"), functools.partial(gpt_job, "bf16", NOBIAS_CASES, EMU_LT_NO_BIAS_EPILOGUE="1"))
    for p in PRECISIONS:
        if p in built:
            submit(pool, ("kernels", p), gpt_job, p, ["kernels"], DEFAULT_ORDER[p])
            submit(pool, ("wide", p), gpt_job, p, ["wide"], DEFAULT_ORDER[p])
    return built


# ---- the emulator itself ----

def test_emulator_selftest(default_jobs):  # default_jobs: the long runs start in the background now
    res = emu_run([OUT / "emu_selftest"], timeout=300)
    print(res.stdout)
    assert res.returncode == 0 and "emu selftest: PASS" in res.stdout, explain(res)


@pytest.mark.parametrize("case, message", [
    ("divergent_barrier", "a barrier in divergent code is undefined"),
    ("two_barriers", "wait at different __syncthreads"),
    ("divergent_shuffle", "reached by 20 of 32 lanes"),
    ("partial_mask", "only the full mask 0xffffffff is emulated"),
    ("launch_bounds", "above its __launch_bounds__(64)"),
    ("bad_block", "exceeds 1024 threads"),
    ("dyn_smem_limit", "65536 bytes of dynamic shared memory exceed the kernel's limit of 49152"),
    ("host_pointer", "points into no cudaMalloc or cudaMallocHost block"),
    ("write_past_end", "wrote 1 bytes past the end of the 4000-byte cudaMalloc block"),
    ("guard_page", "116 bytes past the end of the 4000-byte cudaMalloc block"),
    # stopped by UBSan's alignment check (dev/emu/Makefile), not by the emulator: no "emu: " prefix
    ("misaligned_vector", ("selftest.cu", "misaligned address", "which requires 16 byte alignment")),
    ("use_after_free", "use after free"),
    ("memcpy_past_end", "runs 4 bytes past the end"),
    ("memcpy_wrong_kind", "the destination"),
    ("stack_overflow", "stack overflow"),
    ("lt_epilogue", "epilogue 32 is not emulated"),
    ("lt_tf32", "compute type 77 is not emulated"),
    ("lt_algo_mismatch", "found for a different problem"),
    ("lt_alignment", "4-byte aligned, but the algorithm was found for a minimum alignment of 256"),
    # WMMA: the API named, then (after its call site) what is wrong
    ("wmma_misaligned", ("wmma::load_matrix_sync", "is not 256-bit (32-byte) aligned")),
    ("wmma_bad_ldm", ("wmma::load_matrix_sync", "ldm 12 is not a multiple of 8")),
    ("wmma_divergent", ("wmma::mma_sync", "reached by 16 of 32 lanes (16 finished")),
    ("wmma_args_differ", ("wmma::load_matrix_sync", "lane 5 passes mptr", "must be the same in every lane")),
    ("wmma_local_memory", ("wmma::load_matrix_sync", "is neither device memory")),
    ("wmma_past_end", ("wmma::store_matrix_sync", "run 32 bytes past the end of the 4000-byte cudaMalloc block")),
    ("wmma_half_copies", ("wmma::mma_sync", "is held twice", "the copies differ")),
    # racecheck: toy kernels each missing one barrier (which of the two accesses comes first follows the run order)
    ("race_across_warps", ("racecheck: write-after-read hazard on shared memory", "byte 128 of the 256-byte __shared__ object",
                           "thread 0 (warp 0, lane 0) read it at race_kernel", "thread 32 (warp 1, lane 0) writes it at race_kernel",
                           "selftest.cu:", "in kernel race_kernel")),
    ("race_in_warp", ("racecheck: read-after-write hazard", "thread 0 (warp 0, lane 0) wrote it",
                      "thread 1 (warp 0, lane 1) reads it")),
    ("race_same_address", ("racecheck: write-after-write hazard", "thread 0 (warp 0, lane 0) wrote it",
                           "thread 32 (warp 1, lane 0) writes it")),
    ("race_shuffle_no_fence", ("racecheck: read-after-write hazard", "thread 1 (warp 0, lane 1) wrote it",
                               "thread 0 (warp 0, lane 0) reads it")),
    ("race_wmma_store", ("racecheck: read-after-write hazard", "every lane of warp 0 (a WMMA operation) wrote it at",
                         "thread 0 (warp 0, lane 0) reads it")),
    ("race_wmma_load", ("racecheck: read-after-write hazard", "thread 0 (warp 0, lane 0) wrote it",
                        "every lane of warp 0 (a WMMA operation) reads it")),
    # memcheck of NVTX regions: two 400-byte buffers with guard zones in one cudaMalloc
    ("region_write", ("memcheck: invalid write of 4 bytes", "region_kernel", "selftest.cu:",
                      "a guard zone of heap 'selftest heap', 1 bytes past the end of buffer 'buffer_a' (400 bytes")),
    ("region_read", ("memcheck: invalid read of 4 bytes", "1 bytes past the end of buffer 'buffer_b' (400 bytes")),
    ("region_memset", ("cudaMemset: the destination (204 bytes at", "runs 4 bytes past the end of buffer 'buffer_a' (400 bytes")),
    # initcheck: reads of device memory nothing wrote since its allocation or since its NVTX region was registered anew
    ("uninit_read", ("initcheck: uninitialised read of 4 bytes at", "by a load at region_kernel", "selftest.cu:",
                     "byte 20 of the 4000-byte cudaMalloc block", "in kernel region_kernel", "thread (0,0,0)")),
    ("renewed_read", ("initcheck: uninitialised read of 4 bytes", "byte 28 of buffer 'buffer_a' (400 bytes at",
                      "in heap 'selftest heap'")),
    ("memcpy_uninit", ("initcheck: uninitialised read of 32 bytes", "by cudaMemcpy(cudaMemcpyDeviceToHost)",
                       "byte 28 of the 4000-byte cudaMalloc block")),
    ("lt_uninit", ("initcheck: uninitialised read of 32 bytes", "by cublasLtMatmul (m=8 n=8 k=8", "B column 7",
                   "byte 480 of the 4000-byte cudaMalloc block")),
    ("wmma_uninit", ("initcheck: uninitialised read of 32 bytes", "by the WMMA tile load at", "(tile row 0)",
                     "byte 512 of the 4000-byte cudaMalloc block", "in kernel wmma_misuse_kernel")),
    ("ptx_cp_async_uninit", ("initcheck: uninitialised read of 16 bytes", "by cp.async (global source) at",
                             "byte 0 of the 4000-byte cudaMalloc block", "in kernel ptx_misuse_kernel")),
    # streamcheck: accesses of two streams that no event wait, implicit synchronisation or host wait orders
    ("stream_no_wait", ("stream hazard: kernel region_kernel launched at", "on the legacy default stream reads byte 20 of the "
                        "4000-byte cudaMalloc block", "which cudaMemsetAsync on stream 1 (created cudaStreamNonBlocking, priority 0) wrote")),
    ("stream_stale_record", ("stream hazard: kernel region_kernel", "on the legacy default stream reads byte 20",
                             "which kernel region_kernel", "on stream 1 (created cudaStreamNonBlocking, priority 0) wrote")),
    ("stream_write_after_read", ("stream hazard: cudaMemsetAsync on the legacy default stream writes byte 20",
                                 "which kernel region_kernel", "on stream 1 (created cudaStreamNonBlocking, priority 0) read")),
    # inline PTX (emu/ptx.h)
    ("ptx_ldmatrix_misaligned", ("ldmatrix", "lane 3's row address", "is not 16-byte aligned")),
    ("ptx_mma_divergent", ("mma.sync.aligned.m16n8k16", "reached by 16 of 32 lanes")),
    ("ptx_cp_async_never_waited", ("cp.async", "copies pending from an earlier block", "never waited")),
])
def test_emulator_stops_misuse(emu_build, case, message):
    res = emu_run([OUT / "emu_selftest", f"fail:{case}"], timeout=120)
    assert res.returncode != 0 and "NOT STOPPED" not in res.stdout, explain(res)
    for part in message if isinstance(message, tuple) else (message,):
        assert part in res.stderr, explain(res)
    if case != "misaligned_vector":
        assert "emu: " in res.stderr


# ---- test_gpt under emulation ----

def check_gpt_output(res, cases):
    assert res.returncode == 0, explain(res)
    out = res.stdout
    assert "NOT a GPU" in out and "PASS (emulated, not GPU verification)" in out
    if NONFINITE_CASE in cases:
        assert re.search(r"^PASS: non-finite gradients$", out, re.M), out[-3000:]
        cases = [c for c in cases if c != NONFINITE_CASE]
    if ACCUM_CASE in cases:
        assert re.search(r"^PASS: gradient sums, hs16 T=64$", out, re.M), out[-3000:]
        cases = [c for c in cases if c != ACCUM_CASE]
    for case in [c for c in cases if c.startswith(("blocks:", "blocksdrop:"))]:
        kind, name, _, _, _, Tcs = case.split(":")
        what = "attention tiles" if kind == "blocks" else "attention tiles with dropout 0.1"
        for Tc in Tcs.split(","):
            assert re.search(rf"^PASS: {what}, {name} Tc={Tc}$", out, re.M), f"{what} {name} Tc={Tc} missing\n" + out[-3000:]
        cases = [c for c in cases if c != case]
    for case in [c for c in cases if c.startswith(("attention:", "dropout:"))]:
        kind, name, _, _, _, Ts = case.split(":")
        what = "attention alone" if kind == "attention" else "attention alone with dropout 0.1"
        for T in Ts.split(","):
            assert re.search(rf"^PASS: {what}, {name} T={T}$", out, re.M), f"{what} {name} T={T} missing\n" + out[-3000:]
        cases = [c for c in cases if c != case]
    dropped = [(c.split(":")[1], t) for c in cases if c.startswith("dropmodel:") for t in c.split(":")[5].split(",")]
    for name, T in dropped:
        assert re.search(rf"^PASS: {name} T={T}, dropout embedding 0\.1 attention 0\.1 residual 0\.1$", out, re.M), \
            f"{name} T={T} with dropout missing\n" + out[-3000:]
    cases = [c for c in cases if not c.startswith("dropmodel:")]
    expected = [(c.split(":")[0], t) for c in cases for t in c.split(":")[4].split(",")]
    for name, T in expected:
        assert re.search(rf"^PASS: {name} T={T}$", out, re.M), f"{name} T={T} missing\n" + out[-3000:]
    expected += dropped
    bitwise = re.findall(r"bitwise identical to -r 0 in every step", out)
    assert len(bitwise) == SETTINGS_COMPARED * len(expected), out[-3000:]
    assert "FAIL" not in out and "DIFFERS" not in out


@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_gpt_matches_cpu_reference_emulated(default_jobs, precision):
    if precision not in default_jobs:
        pytest.skip(f"{precision} not built (make -C dev/emu precisions)")
    res = _futures[("gpt", precision)].result()
    print(res.stdout[-6000:])
    check_gpt_output(res, [NONFINITE_CASE, ACCUM_CASE, *ATTENTION_CASES, *ATTENTION_DROPOUT_CASES, *CASES[precision],
                           *MODEL_DROPOUT_CASES[precision]])


@pytest.fixture(scope="session")
def other_kernel_builds(emu_build):
    """emu_test_gpt_bf16 built with ATTENTION=tc and ATTENTION=simt (build/emu-tc, build/emu-simt)."""
    built = {}
    for kind in ("tc", "simt"):
        out = REPO / "build" / f"emu-{kind}"
        res = subprocess.run(["make", "-C", str(EMU), f"-j{JOBS}", f"ATTENTION={kind}", f"EMU_OUT={out}", str(out / "emu_test_gpt_bf16")],
                             capture_output=True, text=True, timeout=1200)
        if res.returncode != 0:
            pytest.fail(f"building the emulator with ATTENTION={kind} failed:\n" + res.stdout[-3000:] + res.stderr[-6000:])
        built[kind] = out / "emu_test_gpt_bf16"
    return built


@pytest.mark.parametrize("kind", ["tc", "simt"])
def test_gpt_other_attention_kernels_emulated(other_kernel_builds, kind):
    """ATTENTION=tc and ATTENTION=simt stay selectable and correct: the attention cases with and without dropout
    (head sizes 64 and 128 included, which the default build runs on the mma kernels without dropout) and one
    run_case (recompute settings bitwise equal)."""
    cases = [*ATTENTION_CASES, *ATTENTION_DROPOUT_CASES, "hs64:64:1:300:45", BLOCK_CASES[1], BLOCK_CASES[-1]]
    res = emu_run([other_kernel_builds[kind], *cases], EMU_PROFILE="1")
    check_gpt_output(res, cases)
    launched = res.stdout + res.stderr  # EMU_PROFILE's table names every kernel run
    assert "attention_mma_" not in launched, launched[-3000:]
    assert ("attention_tc_forward_kernel" in launched) == (kind == "tc"), launched[-3000:]


@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_attention_tiles_emulated(emu_build, precision):
    """The ring attention tile kernels (BLOCK_CASES) against the CPU reference, in each precision's default family."""
    exe = OUT / f"emu_test_gpt_{precision}"
    if not exe.exists():
        pytest.skip(f"{precision} not built (make -C dev/emu precisions)")
    res = emu_run([exe, *BLOCK_CASES], timeout=1800, EMU_PROFILE="1")
    print(res.stdout[-6000:])
    assert res.returncode == 0, explain(res)
    check_gpt_output(res, BLOCK_CASES)
    slices = re.findall(r"slices of every row, worst error/tolerance [0-9.]+ .*ok$", res.stdout, re.M)
    assert len(slices) == len(BLOCK_CASES) * (8 * 4 + 3), res.stdout[-3000:]  # eight sets' four slice checks, the ring's three


def check_gqa_output(res, cases):
    assert res.returncode == 0, explain(res)
    out = res.stdout
    assert "NOT a GPU" in out and "PASS (emulated, not GPU verification)" in out
    for case in cases:
        kind, name, _, _, _, Ts = case.split(":")
        for T in Ts.split(","):
            if kind.startswith("gqaring"):
                what = rf"grouped-query ring of {kind[-1]}, {name} Tc={T} dropout 0\.1{' documents' if kind == 'gqaring3' else ''}"
            else:
                what = rf"grouped-query attention, {name} T={T} dropout {'0.1 documents' if kind == 'gqadrop' else '0'}"
            assert re.search(rf"^PASS: {what}$", out, re.M), f"{case} missing\n" + out[-3000:]
    assert "FAIL" not in out


@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_grouped_query_attention_emulated(emu_build, precision):
    """Grouped-query attention (GQA_CASES; the slow set adds GQA_SLOW_CASES) in each precision's default
    family, whole sequences and the 2- and 3-member rings on compact K/V, against the CPU reference."""
    exe = OUT / f"emu_test_gpt_{precision}"
    if not exe.exists():
        pytest.skip(f"{precision} not built (make -C dev/emu precisions)")
    cases = [*GQA_CASES, *(GQA_SLOW_CASES if SLOW else [])]
    res = emu_run([exe, *cases], timeout=1800, EMU_PROFILE="1")
    print(res.stdout[-6000:])
    check_gqa_output(res, cases)
    launched = res.stdout + res.stderr
    if precision != "fp32":
        assert "attention_mma_backward_dkv_kernel" in launched and "attention_tc_backward_dkv_kernel" in launched, launched[-3000:]


@pytest.mark.parametrize("kind", ["tc", "simt"])
def test_grouped_query_attention_other_kernels_emulated(other_kernel_builds, kind):
    """Grouped-query attention in the ATTENTION=tc and ATTENTION=simt builds (head sizes 64 and 128 included)."""
    cases = GQA_CASES[:4] + GQA_CASES[5:]
    res = emu_run([other_kernel_builds[kind], *cases], EMU_PROFILE="1")
    check_gqa_output(res, cases)
    assert "attention_mma_" not in res.stdout + res.stderr


@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_gpt_token_tiles_emulated(default_jobs, precision):
    """GPU token tiles: against the CPU reference, bitwise across recompute settings at the same tile size
    (with dropout too), and within TOL_TILES of the untiled gradients."""
    if precision not in default_jobs:
        pytest.skip(f"{precision} not built (make -C dev/emu precisions)")
    res = _futures[("gpt-tiles", precision)].result()
    print(res.stdout[-6000:])
    cases = TILE_CASES[precision]
    bounds = [c for c in cases if ":tilebound:" in c]
    for case in bounds:
        k, _, name, _, _, _, T = case.split(":")
        assert re.search(rf"^PASS: token tiles of {k[5:]} rows within TOL_TILES of none, {name} T={T}$", res.stdout, re.M), \
            f"{case} missing\n" + res.stdout[-3000:]
    check_gpt_output(res, [untiled_name(c) for c in cases if c not in bounds])


def untiled_name(case):
    """A case as check_gpt_output names its runs: without the tilesK: prefix that sets its tile size."""
    return case.split(":", 1)[1] if re.match(r"tiles\d+:", case) else case


# Mutants of GPU token tiles (train_gpt.cu), each with the test_gpt case that must fail: the weight
# gradients summed in floatX across tiles instead of fp32 (the tile bound), the short last tile's bias
# partial dropped (the bound), a tile's dqkv rows shifted by one (the CPU comparison), and no alignment
# cap for cuBLASLt (recompute settings no longer bitwise equal; FP32, whose sums round in any order).
TILE_MUTANTS = {
    "floatX sums across tiles": ("bf16", "tiles2:tilebound:hs16:64:4:300:77",
                                 "const floatX* inp, int n, int IC, int OC) {\n    if (m->tile_tokens) {",
                                 "const floatX* inp, int n, int IC, int OC) {\n    if (0) {"),
    "last tile's bias partial dropped": ("bf16", "tiles5:tilebound:hs16:64:4:300:77",
                                         "m->tile_grads.tensor[w], m->tile_grads.tensor[b], m->column_partials, dout, inp",
                                         "m->tile_grads.tensor[w], n == m->tile_tokens ? m->tile_grads.tensor[b] : NULL, m->column_partials, dout, inp"),
    "dqkv rows shifted": ("bf16", "tiles5:hs16:64:4:300:33", "    dqkv += (size_t)r0 * QKV;",
                          "    dqkv += (size_t)(r0 > 0 ? r0 - 1 : 0) * QKV;"),
    "no alignment cap": ("fp32", "tiles5:hs18:18:1:300:37", "        if (a < m->mm.align_cap) m->mm.align_cap = a;\n    }",
                         "        if (a < m->mm.align_cap) m->mm.align_cap = a;\n    }\n    m->mm.align_cap = 0;"),
}


@pytest.mark.parametrize("what", list(TILE_MUTANTS))
def test_token_tile_mutants_apply(what):
    assert_mutant_applies((REPO / "train_gpt.cu").read_text(), "train_gpt.cu", TILE_MUTANTS[what][2])


@slow
@pytest.mark.parametrize("what", list(TILE_MUTANTS))
def test_gpt_token_tile_mutants_fail_emulated(emu_build, tmp_path, what):
    precision, case, old, new = TILE_MUTANTS[what]
    src = mutant_sources(tmp_path, {"train_gpt.cu": (old, new)})
    exe = src / "build" / "emu" / f"emu_test_gpt_{precision}"
    res = subprocess.run(["make", "-s", "-C", str(src / "dev" / "emu"), str(exe)], capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    res = emu_run([exe, case])
    assert res.returncode == 1 and re.search(r"^FAIL", res.stdout, re.M), f"{what}: the mutant passes {case}\n" + explain(res)


# Mutants of RoPE's turn back in the attention backward (llmc/cuda/rope.cuh's RopeRows in the kernels' epilogues), each
# with the grouped-query case that must fail (check_attention_gqa_rope and the ring's store against the CPU): the mma
# dK/dV kernel's dK not turned, the mma epilogues' position taken from the warp's first row instead of each row's,
# the simt dQ kernel's dQ not turned (FP32), the simt dK/dV kernel pairing element e with e + CH/2 + 1 (FP32), the
# ring's store turning dV too.
ROPE_MUTANTS = {
    "mma dK not turned back": ("bf16", "gqa:g2hs64:4:2:64:45", "llmc/cuda/attention_mma.cuh",
                               "        if (rope.table.half) att_mma_rope_back<HS>(dk, rope, b, r0, T);\n", ""),
    "mma position of the warp's first row": ("bf16", "gqa:g4hs128:8:2:128:45", "llmc/cuda/attention_mma.cuh",
                                             "const double pos = rope_position_at(rope, b, t);\n#pragma unroll\n        for (int ot = 0;",
                                             "const double pos = rope_position_at(rope, b, r0);\n#pragma unroll\n        for (int ot = 0;"),
    "simt pair's neighbour": ("fp32", "gqa:g4hs128:8:2:128:45", "llmc/cuda/attention.cuh",
                              "rope_turn(&x[e], &x[e + CH / 2], co, si);", "rope_turn(&x[e], &x[(e + CH / 2 + 1) % CH], co, si);"),
    "simt dQ not turned back": ("fp32", "gqa:g2hs64:4:2:64:45", "llmc/cuda/attention.cuh",
                                "        if (rope.table.half) att_rope_back_row<HS>(dq, rope, b, t, g);\n", ""),
    "ring store turns dV": ("bf16", "gqaring2:g2hs64:4:2:64:37", "llmc/cuda/attention.cuh",
                            "        if (h < NH + NKV) rope_turn(&a, &b, co, si);", "        rope_turn(&a, &b, co, si);"),
}


@pytest.mark.parametrize("what", list(ROPE_MUTANTS))
def test_rope_backward_mutants_apply(what):
    _, _, rel, old, _ = ROPE_MUTANTS[what]
    assert_mutant_applies((REPO / rel).read_text(), rel, old)


@slow
@pytest.mark.parametrize("what", list(ROPE_MUTANTS))
def test_rope_backward_mutants_fail_emulated(emu_build, tmp_path, what):
    precision, case, rel, old, new = ROPE_MUTANTS[what]
    src = mutant_sources(tmp_path, {rel: (old, new)})
    exe = src / "build" / "emu" / f"emu_test_gpt_{precision}"
    res = subprocess.run(["make", "-s", "-C", str(src / "dev" / "emu"), str(exe)], capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    res = emu_run([exe, case])
    assert res.returncode == 1 and re.search(r"^FAIL: grouped-query", res.stdout, re.M), f"{what}: the mutant passes {case}\n" + explain(res)


def test_gpt_bias_epilogue_fallback_emulated(default_jobs):
    """Where cuBLASLt has no bias epilogue for a shape, matmul.cuh adds the bias with its own kernel."""
    if "bf16" not in default_jobs:
        pytest.skip("bf16 not built")
    res = _futures[("gpt-nobias", "bf16")].result()
    check_gpt_output(res, NOBIAS_CASES)
    assert "note: cuBLASLt has no bias epilogue" in res.stdout


@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_memory_bound_kernels_emulated(default_jobs, precision):
    """test_gpt's check_memory_kernels: LayerNorm, GELU, bias gradient, encoder
    (a hot token split into segments), classifier and AdamW alone against the
    CPU reference, on both the 16-byte vector path and the scalar path of each
    (row lengths that are multiples of 8, of 4 only, of neither; pointers off
    16-byte alignment; partial last groups). Under UBSan's alignment check a
    vector access at a misaligned address stops the run."""
    if precision not in default_jobs:
        pytest.skip(f"{precision} not built")
    res = _futures[("kernels", precision)].result()
    assert res.returncode == 0, explain(res)
    assert re.search(r"^PASS: memory-bound kernels$", res.stdout, re.M) and "FAIL" not in res.stdout, res.stdout[-4000:]
    assert len(re.findall(r" ok$", res.stdout, re.M)) >= 90, res.stdout[-4000:]  # every comparison printed and passed


@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_wide_offsets_emulated(default_jobs, precision):
    """test_gpt's check_wide_offsets: LayerNorm, GELU (vector and scalar), the
    encoder (forward, dwpe, dwte), dropout, the classifier (loss, dlogits,
    top-1) and AdamW on tensors of more than 2^31 elements, the rows of each
    grid's last blocks (past element 2^31) against the CPU reference; the
    emulator runs only those blocks (emu_block_window) and backs the huge
    cudaMalloc blocks only where written, so this takes about a second and
    some 100 MB. A 32-bit row x width product there reads outside the tensor."""
    if precision not in default_jobs:
        pytest.skip(f"{precision} not built")
    res = _futures[("wide", precision)].result()
    assert res.returncode == 0, explain(res)
    assert re.search(r"^PASS: offsets past element 2\^31$", res.stdout, re.M) and "FAIL" not in res.stdout, res.stdout[-4000:]
    assert len(re.findall(r" ok$", res.stdout, re.M)) == 19, res.stdout[-4000:]  # every comparison printed and passed


# Offsets left in 32 bits, each of which check_wide_offsets must catch: in a kernel (LayerNorm's and
# the classifier's row x width) and in a host wrapper (the encoder's element count, hence its grid).
WIDE_MUTANTS = {
    "layernorm row offset": ("llmc/cuda/layernorm.cuh",
                             "    if (row >= N) return; /* whole warps leave together: no block-wide sync below */\n"
                             "    const floatX* xr = x + (size_t)row * C;",
                             "    if (row >= N) return; /* whole warps leave together: no block-wide sync below */\n"
                             "    const floatX* xr = x + row * C;"),
    "classifier row offset": ("llmc/cuda/classifier.cuh", "    floatX* x = logits + (size_t)row * Vp;", "    floatX* x = logits + row * Vp;"),
    "encoder element count": ("llmc/cuda/encoder.cuh", "    size_t n = (size_t)N * C;\n    if (C % XVEC == 0 && all_aligned16(x, wte, wpe))",
                              "    size_t n = N * C;\n    if (C % XVEC == 0 && all_aligned16(x, wte, wpe))"),
}


@pytest.mark.parametrize("what", list(WIDE_MUTANTS))
def test_wide_offset_mutants_apply(what):
    rel, old, _ = WIDE_MUTANTS[what]
    assert_mutant_applies((REPO / rel).read_text(), rel, old)


@slow
@pytest.mark.parametrize("what", list(WIDE_MUTANTS))
def test_wide_offset_mutants_fail_emulated(emu_build, tmp_path, what):
    rel, old, new = WIDE_MUTANTS[what]
    src = mutant_sources(tmp_path, {rel: (old, new)})
    exe = src / "build" / "emu" / "emu_test_gpt_bf16"
    res = subprocess.run(["make", "-s", "-C", str(src / "dev" / "emu"), str(exe)], capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    res = emu_run([exe, "wide"])
    assert res.returncode != 0 and "PASS: offsets past element 2^31" not in res.stdout, f"{what}: the mutant passes\n" + explain(res)


@pytest.fixture(scope="session")
def slow_jobs(pool, default_jobs):
    for p in PRECISIONS:
        if p in default_jobs:
            submit(pool, ("gpt-slow", p), gpt_job, p, SLOW_CASES)
            for order in ORDERS:
                submit(pool, ("gpt-order", p, order), gpt_job, p, order_cases(p), order)
    return default_jobs


def order_cases(precision):
    """Two run_cases and the mma kernels with dropout (their backward's blocks share no memory: no order may matter)."""
    return [*CASES[precision][:2], *MMA_DROPOUT_CASES[precision][:1]]


@slow
@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_gpt_extra_shapes_emulated(slow_jobs, precision):
    if precision not in slow_jobs:
        pytest.skip(f"{precision} not built")
    check_gpt_output(_futures[("gpt-slow", precision)].result(), [untiled_name(c) for c in SLOW_CASES])


@slow
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_gpt_other_block_orders_emulated(slow_jobs, precision, order):
    """Blocks, warps and lanes in another order: a result that depends on it is a race or a missing barrier."""
    if precision not in slow_jobs:
        pytest.skip(f"{precision} not built")
    check_gpt_output(_futures[("gpt-order", precision, order)].result(), order_cases(precision))


# ---- the kernels alone, at lengths and through paths test_gpt's cases do not reach ----


# One long sequence (B=1) through the attention kernels alone, with and without dropout: the mma backward's
# dK/dV and dQ kernels, one block per 64-row tile, across 16 (hs64, T=1000) and 11 (hs128, T=700) tiles of
# each side, T a multiple of no tile; check_attention compares the boundary rows of every tile on their own.
LONG_CASES = ["long:hs64:64:1:300:1000", "long:hs128:128:1:300:700", "longdrop:hs64:64:1:300:1000", "longdrop:hs128:128:1:300:700"]


def test_attention_one_long_sequence_emulated(emu_build):
    res = emu_run([OUT / "emu_test_gpt_bf16", *LONG_CASES], timeout=1800, EMU_PROFILE="1")
    assert res.returncode == 0, explain(res)
    for case in LONG_CASES:
        kind, name, _, _, _, T = case.split(":")
        what = "attention alone" if kind == "long" else "attention alone with dropout 0.1"
        assert re.search(rf"^PASS: {what}, {name} B=1 T={T}$", res.stdout, re.M), f"{case} missing\n" + res.stdout[-3000:]
    assert len(re.findall(r"boundary rows, worst error/tolerance [0-9.]+ .*ok$", res.stdout, re.M)) == 3 * len(LONG_CASES), res.stdout
    launched = res.stdout + res.stderr  # EMU_PROFILE's table names every kernel run
    assert "attention_mma_backward_dkv_kernel" in launched and "attention_mma_backward_dq_kernel" in launched, launched[-3000:]
    assert "FAIL" not in res.stdout


def test_attention_launch_report_emulated(emu_build):
    """bench_attention --launch at B=1, T=131072, NH=16, hs=128 (issue 25's shape): one line per kernel, from the
    recorded sm_90 figures under the emulator; the backward's kernels keep 264 blocks (2 per SM of 132) in flight.
    The expected grids are written out from the tiling (64 rows a block, 256 threads a rowsum block)."""
    exe = OUT / "emu_bench_attention_bf16"
    res = emu_run([exe, "--launch", 1, 131072, 16, 128], timeout=120)
    assert res.returncode == 0, explain(res)
    lines = re.findall(r"^(fwd|bwd) kernel=(\w+) grid=(\d+),(\d+),(\d+) threads=(\d+) smem=(\d+) blocks_per_sm=(\w+) resident=(\w+)$",
                       res.stdout, re.M)
    got = {name: (side, int(x), int(y), int(z), int(th), int(sm), bps, r) for side, name, x, y, z, th, sm, bps, r in lines}
    assert list(got) == ["attention_mma_forward_kernel", "attention_mma_rowsum_kernel", "attention_mma_backward_dkv_kernel",
                         "attention_mma_backward_dq_kernel"], res.stdout
    assert got["attention_mma_forward_kernel"][:5] == ("fwd", 2048, 16, 1, 128), res.stdout
    assert got["attention_mma_rowsum_kernel"][:5] == ("bwd", 131072 * 16 // 256, 1, 1, 256), res.stdout
    for k in ("attention_mma_backward_dkv_kernel", "attention_mma_backward_dq_kernel"):
        side, x, y, z, th, smem, bps, resident = got[k]
        assert (side, x, y, z, th) == ("bwd", 2048, 16, 1, 128) and int(bps) >= 2 and int(resident) >= 264, res.stdout
    assert re.search(r"^scratch: %d bytes" % (131072 * 16 * 4), res.stdout, re.M), res.stdout
    assert "recorded ptxas figures" in res.stdout
    bad = emu_run([exe, "--launch", 1, 2, 3])
    assert bad.returncode == 1 and "--launch takes one shape" in bad.stderr, explain(bad)


def test_attention_launch_report_gqa_emulated(emu_build):
    """bench_attention --launch for llama3.1-8b's heads (NH 32, NKV 8, hs 128) at B=1, T=32768: every kernel's
    grid has B*NKV rows (a block serves a K/V head's group of 4): the forward's and dQ's blocks take packed rows,
    4 warps of 16 rows each of the group's 4 query heads (ceil(4 * T/16 / 4) = 2048 blocks a K/V head, as many
    as 64-row blocks of each of 4 heads), and every backward kernel still keeps 264 blocks (2 per SM of 132) in
    flight."""
    exe = OUT / "emu_bench_attention_bf16"
    res = emu_run([exe, "--launch", 1, 32768, 32, 128, 8], timeout=120)
    assert res.returncode == 0, explain(res)
    lines = re.findall(r"^(fwd|bwd) kernel=(\w+) grid=(\d+),(\d+),(\d+) threads=(\d+) smem=(\d+) blocks_per_sm=(\w+) resident=(\w+)$",
                       res.stdout, re.M)
    got = {name: (side, int(x), int(y), int(z), int(th), int(sm), bps, r) for side, name, x, y, z, th, sm, bps, r in lines}
    assert got["attention_mma_forward_kernel"][:5] == ("fwd", 2048, 8, 1, 128), res.stdout
    assert got["attention_mma_backward_dkv_kernel"][:5] == ("bwd", 512, 8, 1, 128), res.stdout
    assert got["attention_mma_backward_dq_kernel"][:5] == ("bwd", 2048, 8, 1, 128), res.stdout
    for k in ("attention_mma_backward_dkv_kernel", "attention_mma_backward_dq_kernel"):
        assert int(got[k][6]) >= 2 and int(got[k][7]) >= 264, res.stdout
    bad = emu_run([exe, "--launch", 1, 64, 32, 128, 5])
    assert bad.returncode == 1 and "does not divide" in bad.stderr, explain(bad)


# Published heads (config.json / GPT-2 124M): NH, NKV. The fill report's figures, computed here from the tiling
# alone (a block per 64 keys in the 4-warp grids, 16 in the 1-warp one) against 132 SMs of 2 blocks each.
FILL_MODELS = {"d12": (12, 12), "llama3.1-8b": (32, 8), "smollm2-135m": (9, 3), "qwen2.5-0.5b": (14, 2)}


def least_t(rows_per_block, heads, blocks):
    """The least T with ceil(T / rows_per_block) * heads >= blocks."""
    return (-(-blocks // heads) - 1) * rows_per_block + 1


def test_attention_fill_report_emulated(emu_build):
    """bench_attention --fill at B=1 on 132 SMs: the least T from which the dQ and 4-warp dK/dV grids have 2
    blocks per SM and from which the dK/dV grid has a block on every SM, 4-warp and as launched (the launch
    narrows the blocks to 1 warp there), each against the closed form; docs/attention_kernels.md's table holds
    the same figures. --launch shows the width the launch picks for llama3.1-8b as T grows: 1, 2 and 4 warps."""
    exe = OUT / "emu_bench_attention_bf16"
    res = emu_run([exe, "--fill"], timeout=120)
    assert res.returncode == 0, explain(res)
    lines = re.findall(r"^fill model=(\S+) NH=(\d+) NKV=(\d+) hs=\d+ dq_fills_from_T=(\d+) dkv_wide_fills_from_T=(\d+) "
                       r"dkv_wide_every_sm_from_T=(\d+) dkv_every_sm_from_T=(\d+) dkv_block_warps=(\d+)$", res.stdout, re.M)
    got = {m: tuple(int(v) for v in rest) for m, *rest in lines}
    assert list(got) == list(FILL_MODELS), res.stdout
    doc = (REPO / "docs/attention_kernels.md").read_text()
    for (model, (nh, nkv)), name in zip(FILL_MODELS.items(), ["GPT-2 124M", "llama3.1-8b", "smollm2-135m", "qwen2.5-0.5b"]):
        want = (nh, nkv, least_t(64, nh, 264), least_t(64, nkv, 264), least_t(64, nkv, 132), least_t(16, nkv, 132), 1)
        assert got[model] == want, (model, got[model], want)
        row = f"| {name} | {nh} / {nkv} | {want[2]:,} | {want[3]:,} | {want[4]:,} | {want[5]:,} (1"
        assert row in doc, f"docs/attention_kernels.md lacks the row {row!r}"
    for T, threads in ((512, 32), (1024, 64), (1025, 128)):
        res = emu_run([exe, "--launch", 1, T, 32, 128, 8], timeout=120)
        assert res.returncode == 0, explain(res)
        m = re.search(r"^bwd kernel=attention_mma_backward_dkv_kernel grid=(\d+),8,1 threads=(\d+) ", res.stdout, re.M)
        assert m and (int(m.group(1)), int(m.group(2))) == (-(-T // (threads // 2)), threads), (T, res.stdout)
    bad = emu_run([exe, "--fill", "1"])
    assert bad.returncode == 1 and "--fill takes no arguments" in bad.stderr, explain(bad)


def test_bench_attention_emulated(emu_build):
    """dev/bench/bench_attention.cu runs all three kernel families, and the tensor-core ones agree with the CUDA-core ones,
    with and without attention dropout (a mask drawn differently by two families moves whole values).

    Shapes: two query blocks and a partial tile (T=70) at head size 32 (mma
    falls back to tc) and 64 (mma), the largest head size (128, mma), a padded
    head size (48) with B=2. All kernel families round their outputs to bf16
    (relative error up to 2^-9 each) and the tensor-core ones also the
    probabilities and dS, so they are about 2e-3 apart; 1e-2 leaves 5x
    headroom while a masking or rescaling error gives O(0.1..1) (see
    test_gpt's check_attention, which compares each with the CPU reference)."""
    exe = OUT / "emu_bench_attention_bf16"
    assert exe.exists(), "the emulator build succeeded but left out emu_bench_attention_bf16"
    res = emu_run([exe, 1, 70, 2, 32, 1, 70, 1, 64, 1, 40, 1, 128, 2, 33, 3, 48], timeout=300)
    assert res.returncode == 0, explain(res)
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "(tensor cores" in line]
    assert len(rows) == 8, res.stdout
    assert sum("mma (tensor cores, mma.sync)" in row for row in rows) == 2, res.stdout
    for row in rows:
        for dist in row.rstrip(" |").split("|")[-2:]:  # with attention dropout 0.1 (the same mask in every family), without
            out_dist, dqkv_dist = (float(x) for x in dist.split("/"))
            assert out_dist < 1e-2 and dqkv_dist < 1e-2, row
    bad = emu_run([exe, 1, 2, 3])
    assert bad.returncode == 1 and "groups of four" in bad.stderr, explain(bad)


def test_bench_attention_rope_emulated(emu_build):
    """bench_attention --rope: one line per shape with the forward's RoPE pass, the backward without RoPE, with dQ and dK
    turned back in its epilogues, and followed by the pass instead. At hs64 the mma epilogues turn in fp32 and round
    once, the pass after them rounds twice: apart by about bf16's rounding, far below a wrong turn's O(1). At hs48 (tc,
    padded to 64) the backward itself takes the pass after its kernels (attention_rope_in_kernels): the same bits."""
    exe = OUT / "emu_bench_attention_bf16"
    assert exe.exists(), "the emulator build succeeded but left out emu_bench_attention_bf16"
    fields = {}
    for shape, kernels in (("1 70 4 2 64", "mma"), ("1 40 4 2 48", "tc+pass")):
        res = emu_run([exe, "--rope", *shape.split()], timeout=300)
        assert res.returncode == 0, explain(res)
        line = [x for x in res.stdout.splitlines() if x.startswith("rope ")]
        assert len(line) == 1, res.stdout
        fields[kernels] = dict(kv.split("=", 1) for kv in line[0].split()[1:])
        assert fields[kernels]["kernels"] == kernels, line
        for key in ("pass_ms", "pass_GBps", "fwd_ms", "bwd_ms", "bwd_fused_ms", "bwd_then_pass_ms", "saved_ms"):
            float(fields[kernels][key])
    assert 0 < float(fields["mma"]["bwd_fused_vs_pass_rel"]) < 1e-2, fields["mma"]
    assert float(fields["tc+pass"]["bwd_fused_vs_pass_rel"]) == 0.0, fields["tc+pass"]
    bad = emu_run([exe, "--rope", "1", "2", "3"])
    assert bad.returncode == 1 and "--rope takes one shape" in bad.stderr, explain(bad)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_misaligned_bias_takes_the_bias_kernel(emu_build, precision):
    """test_gpt's check_bias_fallback: the path a GPU takes for a bias cuBLASLt's epilogue cannot read."""
    if not (OUT / f"emu_test_gpt_{precision}").exists():
        pytest.skip(f"{precision} not built")
    res = emu_run([OUT / f"emu_test_gpt_{precision}", "bias"])
    assert res.returncode == 0 and "PASS: bias kernel" in res.stdout and "FAIL" not in res.stdout, explain(res)


@slow
def test_gpu_check_sanitizer_cases_emulated(emu_build):
    """What dev/gpu_check.sh's compute-sanitizer stages run (test_gpt --sanitize: head sizes 16, 64 and 128 at T=77, the
    default attention alone and in the model, with and without dropout) under the emulator's own racecheck, synccheck,
    initcheck and memcheck: every check passes and nothing is stopped (about 5 minutes on a loaded 2-core machine)."""
    res = emu_run([OUT / "emu_test_gpt_bf16", "--sanitize"], timeout=1800)
    assert res.returncode == 0, explain(res)
    for name in ["attention alone, hs64 T=77", "attention alone with dropout 0.1, hs64 T=77", "attention alone, hs128 T=77",
                 "attention alone with dropout 0.1, hs128 T=77", "hs64 T=77", "hs64 T=77, dropout embedding 0.1"]:
        assert re.search(rf"^PASS: {re.escape(name)}", res.stdout, re.M), name + "\n" + explain(res)
