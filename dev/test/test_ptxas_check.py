"""dev/ptxas_check.py (the build's spill and register check, run by dev/gpu_check.sh) on small kernels compiled here
with nvcc (no GPU needed): a kernel forced to spill fails naming it, the same kernel with its registers fails when its
register count is not the one asserted and passes when it is, and an asserted kernel missing from the report fails."""
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


def test_the_source_assertions_are_found():
    """The real check reads llmc/attention_mma.cuh's AttMmaResources; a rename there must not silently drop the check."""
    sys.path.insert(0, str(REPO / "dev"))
    import ptxas_check
    got = ptxas_check.source_asserts()
    kernels = ("attention_mma_forward_kernel", "attention_mma_backward_dkv_kernel", "attention_mma_backward_dq_kernel")
    assert set(got) == {f"{k}<{hs}, {b}>" for k in kernels for hs in (64, 128) for b in ("false", "true")}, got
    assert all(0 < r <= 255 for r in got.values()), got
