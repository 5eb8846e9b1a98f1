"""The multi-GPU collective schedule (llmc/multigpu.cuh) on the host, with NCCL
and CUDA events stubbed (dev/test/test_multigpu.cu): same calls on every rank,
each gradient reduced once, ZeRO-1 pieces on their owners, full all-gather.
This checks bookkeeping, not NCCL or a GPU."""
import shlex
import shutil
import subprocess

import pytest

from conftest import BUILD, REPO, run


def test_collective_schedule():
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not shutil.which(nvcc) or not shutil.which("mpicc"):
        pytest.skip("needs nvcc and mpicc")
    compile_flags = shlex.split(subprocess.run(["mpicc", "--showme:compile"], capture_output=True, text=True).stdout)
    link_flags = shlex.split(subprocess.run(["mpicc", "--showme:link"], capture_output=True, text=True).stdout)
    link = [f if not f.startswith("-Wl,") else "-Xlinker=" + f[4:] for f in link_flags]
    BUILD.mkdir(exist_ok=True)
    exe = BUILD / "test_multigpu"
    run([nvcc, "-std=c++17", "-I.", "-DENABLE_BF16", "-DUSE_MPI", "-DMULTI_GPU", "-DOMPI_SKIP_MPICXX", *compile_flags,
         "-o", exe, REPO / "dev/test/test_multigpu.cu", *link], check=True, timeout=600)
    res = run([exe], check=True)
    print(res.stdout)
    assert "all ok (0 failures)" in res.stdout
