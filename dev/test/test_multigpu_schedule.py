"""The multi-GPU collective schedule (llmc/cuda/multigpu.cuh) on the host, with NCCL
and CUDA events stubbed (dev/test/test_multigpu.cu): same calls on every rank,
each gradient reduced once, ZeRO-1 pieces on their owners, full all-gather;
multigpu_wait's handling of an asynchronous NCCL error (stop, never hang), and
--collective-timeout's NCCL part: the GPU waiting on NCCL alone past the
deadline, a nonblocking call that never settles.
This checks bookkeeping, not NCCL or a GPU."""
import shlex
import shutil
import subprocess
import time

import pytest

from conftest import BUILD, REPO, run


@pytest.fixture(scope="module")
def exe():
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not shutil.which(nvcc) or not shutil.which("mpicc"):
        pytest.skip("needs nvcc and mpicc")
    compile_flags = shlex.split(subprocess.run(["mpicc", "--showme:compile"], capture_output=True, text=True).stdout)
    link_flags = shlex.split(subprocess.run(["mpicc", "--showme:link"], capture_output=True, text=True).stdout)
    link = [f if not f.startswith("-Wl,") else "-Xlinker=" + f[4:] for f in link_flags]
    BUILD.mkdir(exist_ok=True)
    path = BUILD / "test_multigpu"
    run([nvcc, "-std=c++17", "-I.", "-DENABLE_BF16", "-DUSE_MPI", "-DMULTI_GPU", "-DOMPI_SKIP_MPICXX", *compile_flags,
         "-o", path, REPO / "dev/test/test_multigpu.cu", *link], check=True, timeout=600)
    return path


def test_collective_schedule(exe):
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


@pytest.mark.parametrize("case, why", [
    ("wait-timeout", "this GPU waited on NCCL all that time (a peer stopped inside the collective, or the network failed)"),
    ("settle-timeout", "NCCL did not finish posting its work (a peer never joined it, or the network failed)")])
def test_collective_timeout_aborts_nccl(exe, case, why):
    """Stubbed two-rank job, --collective-timeout 1: the communicator is
    aborted and the line names the phase, its step and the other rank. (The
    healthy cases, a compute longer than the timeout and a call settling after
    ncclInProgress, run in test_collective_schedule.)"""
    t0 = time.time()
    res = run([exe, case], check=False, timeout=30)
    assert res.returncode == 1 and time.time() - t0 < 10, res.stdout + res.stderr
    assert "stub: ncclCommAbort" in res.stdout
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: waited more than 1 s in the gradient all-reduce (step 7) for rank 1, which arrived at it but did not finish "
        f"it: {why}; communicator aborted; stopping the job (--collective-timeout)"), res.stderr
