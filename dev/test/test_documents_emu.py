"""Packed documents on the GPU side, under the CPU emulator (dev/emu; NOT a
GPU): test_gpt's check_documents (the attention kernels with a document
mask, whole sequences and the two-member ring's blocks, the encoder with
restarting positions, the classifier's uncounted rows) against the CPU
reference, in FP32 (CUDA-core kernels) and BF16 (head sizes 64 and 128 on
the mma kernels, the others on the WMMA ones, their ring blocks on the
CUDA-core ones); the mma kernels alone in BF16 and FP16, with mutants of
their document mask; and train_gpt with the three flags against
train_gpt_cpu, every -r setting bitwise equal to -r 0."""
import re
import subprocess

import numpy as np
import pytest

from conftest import REPO, binary, run
from emu_support import EMU, OUT, assert_mutant_applies, emu_run, explain, mutant_sources, platform_problem, precision_param, slow
import datafile

CASES = ["docs:hs16:64:4:300:332", "docsdrop:hs64:128:2:300:200", "docs:hs20:80:4:300:100"]
TINY = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--eot-token", "63"]
STEP_RE = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr \S+ \| norm ([0-9.]+)", re.M)


def built(*names, emu=EMU, out=OUT):
    why = platform_problem()
    if why:
        pytest.skip(why)
    res = subprocess.run(["make", "-C", str(emu), "-j2", *[str(out / n) for n in names]], capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [out / n for n in names]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kernels_with_documents_emulated(precision):
    exe, = built(f"emu_test_gpt_{precision}")
    res = emu_run([exe, *CASES], timeout=1800)
    assert res.returncode == 0 and "PASS (emulated, not GPU verification)" in res.stdout, explain(res)
    for case in CASES:
        _, name, _, _, _, T = case.split(":")
        assert len(re.findall(rf"^PASS: documents, {name} T={T}$", res.stdout, re.M)) == 1, case


def test_train_gpt_with_documents_emulated(tmp_path):
    """Three steps, tokens 63 (end of text) at 8%: the emulated FP32
    trainer's losses and norms within 1e-5 of train_gpt_cpu's, and every
    -r setting, token tiles included, the -r 0 steps bit for bit."""
    exe, = built("emu_train_gpt_fp32")
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 63, 20000)
    tokens[rng.random(20000) < 0.08] = 63
    datafile.write_shard(tmp_path / "t.bin", tokens)
    common = [*TINY, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "32", "-x", "3", "-s", "0", *FLAGS]
    cpu = run([binary("train_gpt_cpu"), *common], env={"OMP_NUM_THREADS": "1"}, check=True)
    want = [tuple(map(float, s)) for s in STEP_RE.findall(cpu.stdout)]
    runs = {}
    for r in [["-r", "0"], ["-r", "1"], ["-r", "2"], ["-r", "3"], ["-r", "1:0/3:1"], ["-r", "1", "--tile-tokens", "16"]]:
        res = emu_run([exe, *common, *r])
        assert res.returncode == 0, explain(res)
        runs[" ".join(r)] = STEP_RE.findall(res.stdout)
    got = [tuple(map(float, s)) for s in runs["-r 0"]]
    assert len(got) == 3 and len(want) == 3
    for (s1, l1, n1), (s2, l2, n2) in zip(got, want):
        assert s1 == s2 and abs(l1 - l2) <= 1e-5 * l2 and abs(n1 - n2) <= 1e-5 * n2, (got, want)
    for name, steps in runs.items():
        assert steps == runs["-r 0"], name


# The mma kernels (head sizes 64 and 128 of the 16-bit builds) with documents: check_documents' rows (row 0
# documents of 31, 1, 32, 17, 46, 5, 130, 33 tokens: starts at a key tile's last key and first key, a 64-row
# block's first row and last row, a one-token document, documents across the 64-key (hs64) and 32-key
# (hs128) tiles and the forward's 128-row blocks; row 1 one document of T tokens), whole sequences row by row
# and the two-member ring's blocks (Tc = 66 and 50: blocks at offsets no tile divides), with dropout at hs128.
MMA_CASES = ["docs:hs64:128:2:300:264", "docsdrop:hs128:128:1:300:200"]
# (the whole-sequence dK/dV kernel's launch names its block width: attention_mma_dkv_launch_as)
MMA_KERNELS = {f"attention_mma_{k}_kernel<HS, {b}>" for k in ("forward", "backward_dq", "backward_dkv") for b in ("false", "true")
               if (k, b) != ("backward_dkv", "false")} | {"attention_mma_backward_dkv_kernel<HS, false, WARPS>"}
PROFILE_RE = re.compile(r"^  (\w+(?:<[^>]*>)?) +\d+ +\d+ +\d+ +\d+ +[0-9.]+$", re.M)


def check_mma_documents(res):
    assert res.returncode == 0 and "PASS (emulated, not GPU verification)" in res.stdout, explain(res)
    for case in MMA_CASES:
        _, name, _, _, _, T = case.split(":")
        assert len(re.findall(rf"^PASS: documents, {name} T={T}$", res.stdout, re.M)) == 1, case


@pytest.mark.parametrize("precision", [precision_param(p) for p in ["bf16", "fp16"]])
def test_mma_kernels_with_documents_emulated(precision):
    """MMA_CASES against the CPU reference; EMU_PROFILE's table shows that the mma kernels ran, whole-sequence
    and block instantiations, and no other attention family (no hand-over to the WMMA or CUDA-core ones)."""
    exe, = built(f"emu_test_gpt_{precision}")
    res = emu_run([exe, *MMA_CASES], timeout=900, EMU_PROFILE="1")
    check_mma_documents(res)
    kernels = set(PROFILE_RE.findall(res.stdout + res.stderr))
    assert MMA_KERNELS <= kernels, kernels
    others = {k for k in kernels if k.startswith("attention_") and "_mma_" not in k and "rowsum" not in k and "ring_store" not in k}
    assert not others, others


# Mutants of the mma kernels' document mask (llmc/cuda/attention_mma.cuh); each must fail MMA_CASES in BF16.
MMA_MUTANTS = {
    # the forward begins one key tile too late: the block's first rows lose their first keys
    "forward_tile_skipped_early": ("const int j0 = att_first_key(blk, sp, pk.first) / Cfg::BC;\n    const int ntiles = max(",
                                   "const int j0 = att_first_key(blk, sp, pk.first) / Cfg::BC + 1;\n    const int ntiles = max("),
    # the forward's warp skips the tile whose last key is its first row's start (row 128's, 127)
    "forward_warp_tile_skipped_early": ("sp.diag && k0 + Cfg::BC > kwarp) {", "sp.diag && k0 + Cfg::BC > kwarp + 1) {"),
    # the dQ kernel's warp the same
    "dq_warp_tile_skipped_early": ("15 + diag && k0 + Cfg::BC > kwarp) {", "15 + diag && k0 + Cfg::BC > kwarp + 1) {"),
    # the dK/dV kernel's warp skips a query tile one too early
    "dkv_warp_tile_skipped_early": ("t0 < tend_warp) {", "t0 + Cfg::BC < tend_warp) {"),
    # a document start off by one in the forward's per-element mask (each document's first key dropped)
    "forward_start_off_by_one": ("key < sp.nk && key >= kf[i >> 1])", "key < sp.nk && key > kf[i >> 1])"),
    # a key row's end off by one in the dK/dV kernel (the next document's first query sees the key)
    "dkv_end_off_by_one": ("t < tend_row[k >> 1])", "t <= tend_row[k >> 1])"),
    # no document mask inside the dQ kernel's partial tiles
    "dq_partial_tile_unmasked": ("key < nkr && key >= kf[hf])", "key < nkr)"),
    # no document mask inside the forward's partial tiles
    "forward_partial_tile_unmasked": ("key < sp.nk && key >= kf[i >> 1])", "key < sp.nk)"),
    # the forward reads its rows' starts in one tile too few (the last tile that crosses a start goes unmasked)
    "forward_starts_read_one_tile_short": ("if (k0 < kwarp_last) kf[0]", "if (k0 + Cfg::BC < kwarp_last) kf[0]"),
}


@pytest.mark.parametrize("what", list(MMA_MUTANTS))
def test_mma_document_mutants_apply(what):
    assert_mutant_applies((REPO / "llmc" / "cuda" / "attention_mma.cuh").read_text(), "llmc/cuda/attention_mma.cuh", MMA_MUTANTS[what][0])


@slow
@pytest.mark.parametrize("what", list(MMA_MUTANTS))
def test_mma_document_mutants_fail_emulated(tmp_path, what):
    built("emu_test_gpt_bf16")  # the runtime objects the mutant's build reuses
    root = mutant_sources(tmp_path, {"llmc/cuda/attention_mma.cuh": MMA_MUTANTS[what]})
    exe, = built("emu_test_gpt_bf16", emu=root / "dev" / "emu", out=root / "build" / "emu")
    res = emu_run([exe, *MMA_CASES], timeout=900)
    assert res.returncode == 1 and re.search(r"^FAIL: documents", res.stdout, re.M), f"mutant {what} passes\n" + explain(res)
