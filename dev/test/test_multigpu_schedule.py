"""The multi-GPU collective schedule (llmc/multigpu.cuh) on the host, with NCCL
and CUDA events stubbed (dev/test/test_multigpu.cu): same calls on every rank,
each gradient reduced once, ZeRO-1 pieces on their owners, full all-gather;
and multigpu_wait's handling of an asynchronous NCCL error (stop, never hang).
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
    # an asynchronous NCCL error while waiting: the communicator is aborted and the
    # rank stops with one line naming the error (fail() then ends every rank via MPI_Abort)
    res = run([exe, "wait-error"], check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "stub: ncclCommAbort" in res.stdout
    assert res.stderr.strip().splitlines()[-1] == ("error: NCCL reported an asynchronous error while rank 2 waited for its "
                                                   "step: stub: peer 3 unreachable (NCCL_DEBUG=INFO tells more)"), res.stderr
