"""The CPU emulator (dev/emu) as a sanitizer: racecheck on the real kernels' barriers, memcheck on the plan's buffers,
initcheck on reads of device memory nothing wrote.

Why it exists: a missing __syncwarp() or __syncthreads() is a silent race on a
GPU, and an access one element past a plan buffer lands in the next buffer of
the one arena; a read of memory no kernel wrote shows only as NaN, if at
all; none of them changes the emulated results reliably. The emulator
records every shared-memory access (dev/emu/runtime/emu_racecheck.cpp),
every access to the plan's guard zones (emu_memcheck.cpp) and which bytes of
device memory were written (emu_initcheck.cpp); these tests show that it
stops such mutants of the current kernels with a message naming the hazard:
  - every __syncthreads()/__syncwarp() in llmc/cuda/*.cuh, deleted one at a time
    (EMU_DELETE_SYNC=FILE:LINE makes the emulator skip exactly that call, as
    if the line were gone), fails the kernel's emulated test with
    "racecheck: ... hazard", except the barriers listed in REDUNDANT, whose
    deletion is no race (another barrier orders the same accesses), which
    must then pass;
  - every cp.async wait (ptx_cp_async_wait) in llmc/cuda/*.cuh, deleted one at a
    time the same way, fails the kernel's emulated test: the copies land
    late (stale operands: a result off the CPU reference, or a hazard) or
    never (the emulator stops a thread whose copies pile up or outlive
    its block);
  - a mutated copy of the sources (a real deletion, a write moved one
    element past a buffer, and LayerNorm's parameter-gradient blocks skipping
    the partial sums of row slices they have no rows for), built in a
    temporary directory, fails naming the kernel's source line and the buffer.
Skipped like test_emu.py without g++ or off x86-64 Linux. NOT GPU verification.
"""
import re
import subprocess

import pytest

from conftest import REPO
from emu_support import OUT, emu_run, explain, mutant_sources, slow

ATTENTION_CASE = "attention:hs32:64:2:300:77"  # the attention kernels alone, forward and backward
GPT_CASE = "hs16:64:4:300:8"                   # every kernel of a training step
# The binary and case that run each file's kernels: tensor-core attention in
# the 16-bit builds, CUDA-core attention in fp32, the rest in every build.
# The mma kernels (head sizes 64 and 128; others fall back to tc) need T=333: six key tiles, so the
# double buffer is reused (a barrier before tile j + 2's copy is only needed from the third tile on),
# and six query blocks of the backward's dQ kernel and key blocks of its dK/dV kernel.
RUNS = {"llmc/cuda/attention_tc.cuh": ("bf16", ATTENTION_CASE), "llmc/cuda/attention.cuh": ("fp32", ATTENTION_CASE),
        "llmc/cuda/attention_mma.cuh": ("bf16", "attention:hs64:64:1:300:333"),
        # the Llama block's kernels run in a Llama model only (GPT_CASE has LayerNorm, learned positions)
        "llmc/cuda/rmsnorm.cuh": ("bf16", "llama_hs16:64:4:300:37"), "llmc/cuda/rope.cuh": ("bf16", "llama_hs16:64:4:300:37"),
        "llmc/cuda/swiglu.cuh": ("bf16", "llama_hs16:64:4:300:37")}
DEFAULT_RUN = ("bf16", GPT_CASE)

# (file, enclosing function, index of the barrier in it): why deleting it is no race.
REDUNDANT = {
    ("llmc/cuda/attention_tc.cuh", "att_tc_row_of", 1):
        "its only caller, the forward kernel, next writes the scratch (Sw) after the key loop's first __syncthreads",
    ("llmc/cuda/attention_tc.cuh", "attention_tc_backward_dq_kernel", 5):
        "dSw is next written after the __syncthreads that starts the next key tile; after the loop it is not written",
    ("llmc/cuda/attention_tc.cuh", "attention_tc_backward_dkv_kernel", 5):
        "Pw and dSw are next written after the __syncthreads that starts the next query tile",
    ("llmc/cuda/cuda_common.cuh", "block_sum", 0):
        "a previous call's reads of scratch[lane] are ordered by its second barrier, its reads of scratch[32] by this "
        "call's second barrier, before scratch[32] is rewritten",
}

SYNC_RE = re.compile(r"\b(__syncthreads|__syncwarp)\s*\(\s*\)")
WAIT_RE = re.compile(r"\bptx_cp_async_wait\s*<\s*\d+\s*>\s*\(\s*\)")


def code_only(line):
    return line.split("//")[0].split("/*")[0]


def call_sites(pattern):
    """(file, line, function, index in function) of every call matching pattern in llmc/cuda/*.cuh."""
    sites = []
    for path in sorted((REPO / "llmc" / "cuda").glob("*.cuh")):
        rel = f"llmc/cuda/{path.name}"
        func, count = None, {}
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"[A-Za-z_]", line) and "(" in line and not line.startswith(("template", "typedef", "struct")):
                names = [n for n in re.findall(r"([A-Za-z_]\w*)\s*\(", line) if n not in ("__launch_bounds__", "__align__")]
                if names:
                    func = names[0]
            if pattern.search(code_only(line)):
                k = count.get(func, 0)
                count[func] = k + 1
                sites.append((rel, no, func, k))
    return sites


SITES = call_sites(SYNC_RE)
WAIT_SITES = call_sites(WAIT_RE)


def test_the_sweep_sees_the_barriers():
    assert {(f, fn) for f, _, fn, _ in WAIT_SITES} >= {("llmc/cuda/attention_mma.cuh", k) for k in (
        "attention_mma_forward_kernel", "attention_mma_backward_dkv_kernel", "attention_mma_backward_dq_kernel")}, WAIT_SITES
    files = {s[0] for s in SITES}
    assert {"llmc/cuda/attention_tc.cuh", "llmc/cuda/attention.cuh", "llmc/cuda/layernorm.cuh", "llmc/cuda/cuda_common.cuh"} <= files, files
    listed = {(f, fn, k) for f, _, fn, k in SITES}
    assert set(REDUNDANT) <= listed, set(REDUNDANT) - listed  # a stale entry: the barrier moved or went


@pytest.mark.parametrize("site", SITES, ids=[f"{f}:{n}" for f, n, _, _ in SITES])
def test_deleting_a_barrier_is_caught(emu_build, site):
    rel, line, func, k = site
    precision, case = RUNS.get(rel, DEFAULT_RUN)
    res = emu_run([OUT / f"emu_test_gpt_{precision}", case], timeout=600, EMU_DELETE_SYNC=f"{rel}:{line}")
    why = REDUNDANT.get((rel, func, k))
    if why:
        assert res.returncode == 0 and "racecheck" not in res.stderr, f"listed as redundant ({why}) but:\n" + explain(res)
        return
    assert res.returncode != 0, f"deleting {rel}:{line} ({func}) went unnoticed\n" + explain(res)
    assert re.search(r"emu: racecheck: (read-after-write|write-after-read|write-after-write) hazard on shared memory", res.stderr), \
        explain(res)
    assert "in kernel " in res.stderr, explain(res)


@pytest.mark.parametrize("site", WAIT_SITES, ids=[f"{f}:{n}" for f, n, _, _ in WAIT_SITES])
def test_deleting_a_cp_async_wait_is_caught(emu_build, site):
    rel, line, func, _ = site
    precision, case = RUNS.get(rel, DEFAULT_RUN)
    res = emu_run([OUT / f"emu_test_gpt_{precision}", case], timeout=600, EMU_DELETE_SYNC=f"{rel}:{line}")
    assert res.returncode != 0, f"deleting the cp.async wait at {rel}:{line} ({func}) went unnoticed\n" + explain(res)
    late = re.search(r"^FAIL: attention alone", res.stdout, re.M) or "racecheck: " in res.stderr
    never = re.search(r"cp\.async \(\S*llmc/cuda/attention_mma\.cuh:\d+\): (more than 128 copies pending in one thread|thread \d+ has \d+ "
                      r"copies pending from an earlier block)", res.stderr)
    assert late or never, explain(res)


# The attention kernels' TILE instantiations (context parallelism's ring tiles) share every barrier and
# cp.async wait with the whole-sequence ones; the same deletions under check_attention_tiles' cases must
# fail too. hs128 (mma, 32-row tiles) and hs32 (simt, 32-row tiles) at Tc=70 give three tiles a side, so
# the double buffer is reused.
BLOCK_KERNELS = {"llmc/cuda/attention_mma.cuh": (("attention_mma_forward_kernel", "attention_mma_backward_dkv_kernel",
                                             "attention_mma_backward_dq_kernel"), "blocks:hs128:128:1:300:70"),
                 "llmc/cuda/attention.cuh": (("attention_forward_kernel", "attention_backward_dq_kernel", "attention_backward_dkv_kernel"),
                                        "blocks:hs32:64:2:300:70")}
BLOCK_SITES = [s for s in SITES + WAIT_SITES if s[0] in BLOCK_KERNELS and s[2] in BLOCK_KERNELS[s[0]][0]]


def test_the_block_sweep_sees_the_kernels():
    assert {(f, fn) for f, _, fn, _ in BLOCK_SITES} == {(f, k) for f, (ks, _) in BLOCK_KERNELS.items() for k in ks}, BLOCK_SITES


@slow
@pytest.mark.parametrize("site", BLOCK_SITES, ids=[f"{f}:{n}" for f, n, _, _ in BLOCK_SITES])
def test_deleting_a_barrier_or_wait_is_caught_in_attention_tiles(emu_build, site):
    rel, line, func, _ = site
    res = emu_run([OUT / "emu_test_gpt_bf16", BLOCK_KERNELS[rel][1]], timeout=900, EMU_DELETE_SYNC=f"{rel}:{line}")
    assert res.returncode != 0, f"deleting {rel}:{line} ({func}) went unnoticed in the block cases\n" + explain(res)
    assert re.search(r"^FAIL: attention tiles", res.stdout, re.M) or "racecheck: " in res.stderr or "cp.async (" in res.stderr, explain(res)


def test_delete_sync_needs_file_and_line(emu_build):
    res = emu_run([OUT / "emu_selftest"], EMU_DELETE_SYNC="llmc/cuda/attention_tc.cuh")
    assert res.returncode != 0 and "EMU_DELETE_SYNC=llmc/cuda/attention_tc.cuh: expected FILE:LINE" in res.stderr, explain(res)


# ---- mutants of the real sources, built in a temporary tree ----

FORWARD_SYNC = "        att_tc_scores<HS>(Sw, q, Ks);\n        __syncwarp();\n"
ENCODER_WRITE = "    vstore<VEC>(x + i, o);\n"
LN_PARTIALS_ROWS = "    const int r0 = blockIdx.y * rps, r1 = min(N, r0 + rps);\n"


def mutant_tree(tmp, edits):
    """emu_test_gpt_bf16 built from a copy of the sources with edits {file: (old, new)}."""
    mutant_sources(tmp, edits)
    exe = tmp / "build" / "emu" / "emu_test_gpt_bf16"
    res = subprocess.run(["make", "-s", "-C", str(tmp / "dev" / "emu"), str(exe)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return exe


def test_source_mutants_are_caught(emu_build, tmp_path):
    """The issue's race (the forward kernel's __syncwarp between the WMMA store of the scores and the lanes' reads, deleted),
    a write one element past the embedding output and a read of partial sums nobody wrote, in one mutated build
    (the cp.async waits: test_deleting_a_cp_async_wait_is_caught)."""
    exe = mutant_tree(tmp_path, {
        "llmc/cuda/attention_tc.cuh": (FORWARD_SYNC, FORWARD_SYNC.replace("__syncwarp();", "")),
        "llmc/cuda/encoder.cuh": (ENCODER_WRITE, ENCODER_WRITE.replace("x + i", "x + i + VEC")),  # one (vector) element past
        # an early exit for the row slices beyond N (11 rows in 32 slices here): their partial sums are never written, and
        # column_finish_kernel adds them up. On a GPU that reads stale data; the emulator's NaN bytes show only in the result.
        "llmc/cuda/layernorm.cuh": (LN_PARTIALS_ROWS, LN_PARTIALS_ROWS + "    if (r0 >= N) return;\n"),
    })
    race = emu_run([exe, ATTENTION_CASE], timeout=600)
    assert race.returncode != 0, explain(race)
    assert re.search(r"racecheck: read-after-write hazard on shared memory .*every lane of warp \d+ \(a WMMA operation\) wrote it at "
                     r"\S*llmc/cuda/attention_tc\.cuh:\d+ and thread \d+ .* reads it at .*llmc/cuda/attention_tc\.cuh:\d+", race.stderr), explain(race)
    assert "in kernel attention_tc_forward_kernel" in race.stderr, explain(race)
    bounds = emu_run([exe, GPT_CASE], timeout=600)
    assert bounds.returncode != 0, explain(bounds)
    # the access's line: encoder.cuh's kernel, or cuda_common.cuh's vstore inlined into it
    assert re.search(r"memcheck: invalid write of \d+ bytes at \S+ at .*llmc/cuda/\w+\.cuh:\d+.*: a guard zone of heap 'remat memory plan', "
                     r"1 bytes past the end of buffer 'layer0\.\w+'", bounds.stderr), explain(bounds)
    assert "in kernel encoder_forward_kernel" in bounds.stderr, explain(bounds)
    # the memory-bound kernels alone (LayerNorm first, N=11 rows of C=20, on test_gpt's own cudaMalloc blocks): stopped at the
    # first read of slice 11's partial sums (32 slices x 2 x 20 floats: 5120 bytes; slice 11, column 0 at byte 11*20*4 = 880),
    # naming the reader's line, the byte and the thread
    uninit = emu_run([exe, "kernels"], timeout=600)
    assert uninit.returncode != 0, explain(uninit)
    assert re.search(r"emu: initcheck: uninitialised read of 4 bytes at \S+ by a load at (void )?column_finish_kernel(<[^>]*>)?\(.*?\) at "
                     r"\S*llmc/cuda/cuda_common\.cuh:\d+.*: byte 880 of the 5120-byte cudaMalloc block at \S+ was not written",
                     uninit.stderr), explain(uninit)
    assert re.search(r"in kernel column_finish_kernel(<\w+>)? launched at \S*llmc/cuda/cuda_common\.cuh:\d+, block \(0,0,0\) of \(1,1,1\), "
                     r"thread \(0,0,0\)", uninit.stderr), explain(uninit)
    # without initcheck the same mutant is only a wrong (NaN) gradient, reported without a culprit
    blind = emu_run([exe, "kernels"], timeout=600, EMU_INITCHECK="0")
    assert blind.returncode != 0 and "initcheck" not in blind.stderr, explain(blind)
    assert re.search(r"^\s*\d+\s+dw\s.*\bnan\s+FAIL\b", blind.stdout, re.M), explain(blind)
