"""The emulated cuBLASLt's refusals (dev/emu/runtime/emu_cublaslt.cpp) and the
trainer's answers to them (llmc/cuda/matmul.cuh): the real library can offer no
algorithm for a shape or an epilogue (returnedAlgoCount 0), offers only
algorithms that fit the workspace the caller allows, and refuses a workspace
that is not 256-byte aligned or smaller than its algorithm needs
(CUBLAS_STATUS_INVALID_VALUE). The emulator does each on request
(EMU_LT_NO_ALGO, EMU_LT_WORKSPACE); the trainer must run with its plan's
aligned workspace, fall back from the bias epilogue, and otherwise stop with
one line naming the shape."""
import re
import subprocess

import pytest

from conftest import REPO
from emu_support import OUT, build_trainers, emu_run, explain, platform_problem
from test_offload_emu import MODEL


@pytest.fixture(scope="module")
def train_exe():
    return build_trainers(REPO, OUT, ["bf16"])["bf16"]


@pytest.fixture(scope="module")
def selftest():
    why = platform_problem()
    if why:
        pytest.skip(why)
    exe = OUT / "emu_selftest"
    res = subprocess.run(["make", "-s", "-C", str(REPO / "dev" / "emu"), str(exe)], capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return exe


def train(exe, tiny_shards, tmp_path, **env):
    return emu_run([exe, *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32", "-x", "1", "-n", "0",
                    "-s", "0"], timeout=600, **env)


@pytest.mark.parametrize("case, why", [("lt_workspace_unaligned", "a workspace not 256-byte aligned"),
                                       ("lt_workspace_small", "a workspace smaller than the algorithm needs")])
def test_the_emulated_library_refuses_a_bad_workspace(selftest, case, why):
    res = emu_run([selftest, f"fail:{case}"], timeout=120, EMU_LT_WORKSPACE="1024")
    assert res.returncode == 1 and "NOT STOPPED" not in res.stdout and "NO ALGORITHM" not in res.stdout, explain(res)
    assert "CUBLAS_STATUS_INVALID_VALUE: " + why in res.stderr, explain(res)


def test_an_algorithm_needing_a_workspace_is_found(train_exe, tiny_shards, tmp_path):
    """Every algorithm needs 1 MiB of workspace: the trainer offers the heuristic its plan's 32 MiB
    library_workspace (256-byte aligned) and trains; one that allowed none would find no algorithm
    ('cuBLASLt offers no algorithm'), one with an unaligned workspace would be refused at every call."""
    res = train(train_exe, tiny_shards, tmp_path, EMU_LT_WORKSPACE=str(1 << 20))
    assert res.returncode == 0, explain(res)
    assert re.search(r"^step\s+1/1", res.stdout, re.M), res.stdout[-3000:]


def test_no_bias_epilogue_falls_back_to_the_bias_kernel(train_exe, tiny_shards, tmp_path):
    res = train(train_exe, tiny_shards, tmp_path, EMU_LT_NO_ALGO="all:bias")
    assert res.returncode == 0, explain(res)
    assert "cuBLASLt has no bias epilogue for some" in res.stdout, res.stdout[-3000:]


def test_no_algorithm_at_all_stops_with_one_line_naming_the_shape(train_exe, tiny_shards, tmp_path):
    # the QKV projection of B*T = 64 rows: D is 3C x BT = 96 x 64, k = C = 32
    res = train(train_exe, tiny_shards, tmp_path, EMU_LT_NO_ALGO="96x64x32")
    assert res.returncode != 0 and "Traceback" not in res.stderr, explain(res)
    lines = [l for l in res.stderr.splitlines() if "cuBLASLt offers no algorithm" in l]
    assert len(lines) == 1 and "m=96 n=64 k=32" in lines[0] and "with and without the bias epilogue" in lines[0], explain(res)
