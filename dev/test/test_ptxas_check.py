"""dev/ptxas_check.py (the build's spill and register check, run by `make cuda-all` and dev/gpu_check.sh) on small
kernels compiled here with nvcc (no GPU needed): a kernel forced to spill fails naming it, the same kernel with its
registers fails when its register count is not the one asserted and passes when it is, fails above a register budget
and passes at it, a stack frame above the cap fails, and an asserted kernel missing from the report fails."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
if not Path(NVCC).exists():
    pytest.skip("nvcc not found (/usr/local/cuda/bin): the check compiles for sm_90", allow_module_level=True)

# 32 accumulators live across a loop: far more than 16 registers hold
KERNEL = """
__global__ void many_live_kernel(float* out, const float* in, int n) {
    float acc[32];
#pragma unroll
    for (int j = 0; j < 32; j++) acc[j] = in[j * n + threadIdx.x];
    for (int i = 0; i < n; i++) {
#pragma unroll
        for (int j = 0; j < 32; j++) acc[j] = acc[j] * in[i] + acc[(j + 1) % 32];
    }
#pragma unroll
    for (int j = 0; j < 32; j++) out[j * n + threadIdx.x] = acc[j];
}
"""


def check(tmp_path, *args):
    src = tmp_path / "k.cu"
    src.write_text(KERNEL)
    return subprocess.run([sys.executable, str(REPO / "dev/ptxas_check.py"), "--source", str(src), "--no-source-asserts", "--nvcc", NVCC,
                           *args], capture_output=True, text=True, timeout=300)


def test_a_kernel_forced_to_spill_fails(tmp_path):
    res = check(tmp_path, "--", "-maxrregcount=16")
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"ptxas_check: FAIL: many_live_kernel\(float\*, float const\*, int\): \d+ bytes spill stores", res.stdout), res.stdout
    assert "PASS" not in res.stdout


def test_register_counts_are_checked_against_the_assertion(tmp_path):
    probe = check(tmp_path, "--expect", "many_live_kernel=1")
    assert probe.returncode == 1 and "the code asserts 1" in probe.stdout, probe.stdout + probe.stderr
    regs = int(re.search(r"many_live_kernel\(float\*, float const\*, int\): (\d+) registers, the code asserts 1", probe.stdout).group(1))
    same = check(tmp_path, "--expect", f"many_live_kernel={regs}")
    assert same.returncode == 0 and "ptxas_check: PASS" in same.stdout, same.stdout + same.stderr


def test_an_asserted_kernel_missing_from_the_report_fails(tmp_path):
    res = check(tmp_path, "--expect", "renamed_kernel=64")
    assert res.returncode == 1 and "renamed_kernel: asserted at 64 registers, but no such kernel" in res.stdout, res.stdout


def test_a_kernel_above_its_register_budget_fails(tmp_path):
    """--budget (what `make cuda-all` applies to llmc/cuda/attention_mma.cuh's kernels): at most MAX registers."""
    probe = check(tmp_path, "--budget", "many_live_kernel=16")
    assert probe.returncode == 1, probe.stdout + probe.stderr
    m = re.search(r"many_live_kernel\(float\*, float const\*, int\): (\d+) registers, above its budget of 16", probe.stdout)
    assert m and int(m.group(1)) > 16, probe.stdout
    ok = check(tmp_path, "--budget", f"many_live_kernel={m.group(1)}")
    assert ok.returncode == 0 and "ptxas_check: PASS" in ok.stdout, ok.stdout + ok.stderr


STACK_KERNEL = """
__global__ void indexed_local_kernel(float* out, const int* idx) {
    float w[32];
    for (int j = 0; j < 32; j++) w[j] = out[j * 32 + threadIdx.x];
    w[idx[threadIdx.x] & 31] += 1.0f;
    out[threadIdx.x] = w[idx[threadIdx.x + 32] & 31];
}
"""


def test_a_budgeted_kernel_with_a_stack_frame_fails(tmp_path):
    """A local array indexed at run time lives on the stack (no spill): the budget's stack cap catches it."""
    src = tmp_path / "s.cu"
    src.write_text(STACK_KERNEL)
    run = lambda *a: subprocess.run([sys.executable, str(REPO / "dev/ptxas_check.py"), "--source", str(src), "--no-source-asserts", "--nvcc", NVCC,
                                     "--budget", "indexed_local_kernel=255", *a], capture_output=True, text=True, timeout=300)
    res = run()
    assert res.returncode == 1 and re.search(r"indexed_local_kernel\(float\*, int const\*\): (\d+) bytes stack frame, above", res.stdout), res.stdout
    assert run("--max-stack", "256").returncode == 0  # the 128-byte array fits


def test_the_source_budgets_are_found():
    """The real check reads llmc/cuda/attention_mma.cuh's budgets; a rename there must not silently drop the check."""
    sys.path.insert(0, str(REPO / "dev"))
    import ptxas_check
    got, max_stack = ptxas_check.source_budgets()
    kernels = ("attention_mma_forward_kernel", "attention_mma_backward_dkv_kernel", "attention_mma_backward_dq_kernel")
    assert set(got) == {f"{k}<{hs}, {b}" for k in kernels for hs in (64, 128) for b in ("false", "true")}, got
    # headroom below the hardware's 255, but for the hs64 dQ attention-tile kernel (grouped-query heads: 255, no spill;
    # llmc/cuda/attention_mma.cuh's AttMmaRegs says why)
    assert all(0 < r < 255 for k, r in got.items() if k != "attention_mma_backward_dq_kernel<64, true") and max_stack == 0, got
    assert got["attention_mma_backward_dq_kernel<64, true"] <= 255, got
    text = (REPO / "llmc" / "cuda" / "attention_mma.cuh").read_text()
    for field in ("FWD", "DKV", "DQ"):  # each kernel is compiled under its budget
        assert f"__maxnreg__((AttMmaRegs<HS, TILE>::{field}))" in text, field
