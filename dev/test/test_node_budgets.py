"""Default memory budgets per node, not per process (issue 35 item 5, issue 33 item 6).

The host memory a process may plan with is its share of the node: the node's bound (a
cgroup limit the node's processes share, here a fake one through REMAT_TEST_CGROUP_ROOT,
or MemAvailable less 1 GiB for the OS) divided among the node's processes
(MPI_COMM_TYPE_SHARED or the launcher's local size), the least over all ranks. Two ranks
under mpirun on this machine are two processes of one node: each plans half.

On the CPU trainer the "device" is the host: -r auto --offload-checkpoints must fit the plan
and the offloaded pool in the one budget together, not each in its own copy of the same RAM.
Plans only (--plan-json): the fake cgroup bounds what is planned, not what is used.
"""
import json
import shutil

import pytest

from conftest import BUILD, binary, run
from test_plan_cli import write_fake_cgroup

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
# llmc/plan/budget.h: kept for the program (and in an MPI build its library), and under a launcher for MPI's state
PROGRAM_BYTES = (6 if (BUILD / ".mpi-cpu-on").exists() else 4) << 20
MPI_PROGRAM_BYTES = 16 << 20


def plan(args, env, ranks=0):
    cmd = ([ "mpirun", "-np", str(ranks)] if ranks else []) + [str(binary("train_gpt_cpu")), *args, "--plan-json"]
    res = run(cmd, env=env)
    return res, (json.loads(res.stdout) if res.returncode == 0 else None)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found (apt-get install openmpi-bin libopenmpi-dev)")
def test_two_ranks_of_one_node_each_plan_half_of_it(tmp_path):
    room = 2 << 30
    write_fake_cgroup(tmp_path, "v2", room, 0, 0)
    env = {**MPI_ENV, "REMAT_TEST_CGROUP_ROOT": str(tmp_path)}
    res, d = plan(["-e", "d12", "--offload-checkpoints", "-r", "1"], env, ranks=2)
    assert d, res.stderr[-2000:]
    assert d["budget_bytes"] == room // 2 - PROGRAM_BYTES - MPI_PROGRAM_BYTES
    assert d["host_budget_bytes"] == room // 2
    text = run(["mpirun", "-np", "2", str(binary("train_gpt_cpu")), "-e", "d12", "--plan"], env=env)
    assert "cgroup memory limit less its usage, divided among the 2 processes of this node" in text.stdout, text.stdout[-2000:]


def test_one_process_without_a_limit_keeps_headroom_for_the_os(tmp_path):
    (tmp_path / "memory.max").write_text("max\n")
    res = run([binary("train_gpt_cpu"), "-e", "d12", "--plan"], env={"REMAT_TEST_CGROUP_ROOT": str(tmp_path)}, check=True)
    assert f"(available host memory less 1024 MiB for the OS less {PROGRAM_BYTES >> 20} MiB for the program)" in res.stdout


def test_cpu_auto_offload_fits_plan_and_pool_in_one_memory(tmp_path):
    """A budget between the plan of -r 1 with every layer offloaded (device part) and -r 1 kept: counting host memory
    twice, -r auto would offload (the device part fits, and so does the pool, each alone) and then need both at once.
    Whatever -r auto chooses must fit plan and pool together, or it must say nothing fits."""
    shape = ["-e", "d12", "-b", "4", "-t", "1024"]
    free = ["--mem-budget", "80GiB", "--host-mem-budget", "80GiB"]
    _, kept = plan([*shape, "-r", "1", *free], {})
    _, off = plan([*shape, "-r", "1", "--offload-checkpoints", *free], {})
    assert off["total_bytes"] < kept["total_bytes"] < off["total_bytes"] + off["host_total_bytes"]
    budget = (off["total_bytes"] + kept["total_bytes"]) // 2
    write_fake_cgroup(tmp_path, "v2", budget + PROGRAM_BYTES, 0, 0)
    res, d = plan([*shape, "-r", "auto", "--offload-checkpoints", "--tile-tokens", "0"], {"REMAT_TEST_CGROUP_ROOT": str(tmp_path)})
    if d is None:
        assert res.returncode == 1 and "nothing fits" in res.stderr, res.stderr[-2000:]
    else:
        assert d["budget_bytes"] == budget
        assert d["total_bytes"] + d["host_total_bytes"] <= budget, (d["total_bytes"], d["host_total_bytes"], budget)
