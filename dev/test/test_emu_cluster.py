"""What a real cluster does that the emulator's ideal one hid (issue 35), under the CPU
emulator (dev/emu; NOT a GPU, NOT NCCL), each with the emulator capability that shows it:

- nonblocking NCCL: with --collective-timeout the communicators are nonblocking, and
  ncclCommSplit then answers ncclInProgress with the new communicator NULL until the
  parent is polled to completion (the emulated NCCL does as NCCL 2.18-2.30 do). The
  context-parallel ring must start and train the same bits as without the timeout.
- ranks that differ: EMU_DEVICE_MEMORY gives each emulated device its own size (real GPUs
  of a node differ by MiBs). -r auto must make one choice, from the least budget of all
  ranks (rank 0's, broadcast), and check before the first step that every rank built the
  same plan; else under context parallelism a rank with a full-recompute layer runs the
  ring again in its backward while its neighbour does not.
- NCCL's own memory: the emulated NCCL takes device memory per communicator (96 MiB) and at
  the first call of each family (collectives, sends/receives) in each size class (160 MiB;
  LL/LL128/Simple ranges), as NCCL 2.22+ connects at first use. The trainer must connect
  everything it will use (both communicators, every size range) before it measures the
  budget, and print NCCL's memory as its own line; else a plan that fills the budget runs
  out of memory inside a step.
- two communicators at once: the emulated NCCL stops a run in which operations of two
  communicators are in flight together on two streams (NCCL documents that this may
  deadlock unless ordered). The trainer orders each NCCL issue after the latest one on the
  other stream; deleting that wait (EMU_DELETE_SYNC) must be caught.
- one node's pinned memory: EMU_HOST_PINNED_LIMIT makes the cudaMallocHost bytes of all
  processes of one emulated node (mpirun's children) draw on one limit. The default host
  budget of offloading must be each process's share of the node (here a fake cgroup room
  through REMAT_TEST_CGROUP_ROOT, the node's memory), not the whole node for each.
"""
import json
import re

import pytest

from test_emu_multigpu import TINY, bins, data, env, explain, steps, train  # noqa: F401
from conftest import REPO
import subprocess

CP_AUTO = ["-b", "8", "--context-parallel", "2", "-r", "auto"]


def test_context_parallel_with_collective_timeout_starts(bins, data):
    """The ring communicator is split from a nonblocking parent: polled on the parent, it trains; the step lines equal
    those of the blocking communicators (a timeout changes how the host waits, not what is computed)."""
    flags = ["-b", "2", "-x", "2", "--context-parallel", "2"]
    blocking = train(bins, data, 2, "fp32", *flags)
    timed = train(bins, data, 2, "fp32", *flags, "--collective-timeout", "60")
    assert timed.returncode == 0, explain(timed)
    assert "context parallel: NCCL ring of 2 in each group" in timed.stdout, explain(timed)
    assert steps(timed) == steps(blocking) and len(steps(blocking)) == 2


def plan_json(bins, *flags, **extra):
    args = ["mpirun", "-np", "2", str(bins / "emu_train_gpt_mpi_fp32"), *TINY, "-t", "32", *flags, "--plan-json"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env(**extra), cwd=REPO)
    assert res.returncode == 0, explain(res)
    return json.loads(res.stdout)


def test_auto_recompute_same_plan_on_ranks_with_different_memory(bins, data):
    """Rank 0's device has room for -r 0, rank 1's exactly for -r 1 on every layer (the least plan; sizes derived from the
    plan itself, so the test follows the planner). The run must choose -r 1 on both (printed by rank 0), pass the
    equal-plan check and train the step lines of the uniform case (both devices at the smaller size); -r modes are
    bitwise equal to each other, so any difference is a mismatched ring."""
    big = plan_json(bins, "-b", "8", "--context-parallel", "2", "-r", "1", EMU_DEVICE_MEMORY="80GiB")
    overhead = 80 * 2**30 - big["budget_bytes"]  # device memory held before the plan, and the 256 MiB headroom
    r1 = big["total_bytes"]
    r3 = plan_json(bins, "-b", "8", "--context-parallel", "2", "-r", "3", EMU_DEVICE_MEMORY="80GiB")["total_bytes"]
    r0 = plan_json(bins, "-b", "8", "--context-parallel", "2", "-r", "0", EMU_DEVICE_MEMORY="80GiB")["total_bytes"]
    assert r0 > r3 > r1
    # -r 1 with a quarter of the way to the next smallest choice (one layer -r 3, one -r 1: halfway to -r 3) spare
    small, large = overhead + r1 + (r3 - r1) // 4, overhead + r0 + (4 << 20)
    uneven = train(bins, data, 2, "fp32", *CP_AUTO, "-x", "2", timeout=300, EMU_DEVICE_MEMORY=f"{large},{small}")
    assert uneven.returncode == 0, explain(uneven)
    assert re.search(r"^recompute auto: fits .*the least free device memory of the 2 ranks.*: -r 1[; ]", uneven.stdout, re.M), explain(uneven)
    uniform = train(bins, data, 2, "fp32", *CP_AUTO, "-x", "2", timeout=300, EMU_DEVICE_MEMORY=f"{small},{small}")
    assert steps(uneven) == steps(uniform) and len(steps(uniform)) == 2


def test_two_ranks_share_the_nodes_pinned_memory(bins, data, tmp_path):
    """The node has 192 KiB for offloaded checkpoints (its cgroup room) and pins at most that beyond the trainer's own
    staging buffers (2 MiB and under 8 KiB a rank at this shape: measured by bisecting EMU_HOST_PINNED_LIMIT). A
    device budget where offloading all 4 layers (32 KiB each) is the fastest choice: a rank that plans with the whole
    node pins 128 KiB, and two of them exceed the node. Each plans with its half (96 KiB): the run trains."""
    from test_plan_cli import write_fake_cgroup
    write_fake_cgroup(tmp_path, "v2", 192 << 10, 0, 0)
    staging = (2 << 20) + (8 << 10)
    shape = ["--layers", "4", "-b", "8", "-x", "2", "-r", "auto", "--offload-checkpoints", "--mem-budget", "35400000",
             "--host-link", "1e15", "--tile-tokens", "0"]
    res = train(bins, data, 2, "fp32", *shape, timeout=300, REMAT_TEST_CGROUP_ROOT=str(tmp_path),
                EMU_HOST_PINNED_LIMIT=str(2 * staging + (224 << 10)))
    assert res.returncode == 0, explain(res)
    assert "cannot allocate" not in res.stderr
    assert re.search(r"^recompute auto: host memory [0-9.]+ (MiB|KiB|bytes) of [0-9.]+ KiB \(the least of the ranks: cgroup memory limit less its usage, "
                     r"divided among the 2 processes of this node\)", res.stdout, re.M), explain(res)
    assert len(steps(res)) == 2


def test_tight_budget_with_nccls_memory_counted_runs(bins, data):
    """Context parallelism (two communicators) with -r auto at a device size that leaves the least plan barely room.
    Communicators of 200 MiB (EMU_NCCL_COMM_BYTES): what a run connected lazily (the ring's split and its first
    send, 360 MiB here) would exceed the 256 MiB headroom and run out of memory inside step 1. The plan names NCCL's
    memory: 2 communicators x 200 MiB, collectives and sends/receives each connected in 3 size classes x 160 MiB."""
    nccl = {"EMU_NCCL_COMM_BYTES": "200MiB"}
    big = plan_json(bins, "-b", "8", "--context-parallel", "2", "-r", "1", EMU_DEVICE_MEMORY="80GiB", **nccl)
    overhead, r1 = 80 * 2**30 - big["budget_bytes"], big["total_bytes"]
    r3 = plan_json(bins, "-b", "8", "--context-parallel", "2", "-r", "3", EMU_DEVICE_MEMORY="80GiB", **nccl)["total_bytes"]
    small = overhead + r1 + (r3 - r1) // 4
    args = ["mpirun", "-np", "2", str(bins / "emu_train_gpt_mpi_fp32"), *TINY, "-t", "32", *CP_AUTO, "--plan"]
    table = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env(EMU_DEVICE_MEMORY=str(small), **nccl), cwd=REPO)
    assert re.search(r"^NCCL: 1360\.0 MiB of device memory", table.stdout, re.M), explain(table)
    res = train(bins, data, 2, "fp32", *CP_AUTO, "-x", "2", timeout=300, EMU_DEVICE_MEMORY=str(small), **nccl)
    assert res.returncode == 0, explain(res)
    assert "-r 1" in res.stdout and len(steps(res)) == 2


def order_wait_line():
    lines, inside = [], None
    for i, ln in enumerate((REPO / "llmc" / "cuda" / "multigpu.cuh").read_text().splitlines(), 1):
        m = re.match(r"static inline \w+ (\w+)\(", ln)
        if m:
            inside = m.group(1)
        if inside == "multigpu_ring_order_launch" and "cudaStreamWaitEvent(" in ln:
            lines.append(i)
    assert len(lines) == 1, "llmc/cuda/multigpu.cuh: expected one stream wait in multigpu_ring_order_launch"
    return lines[0]


def test_the_two_communicators_launch_in_one_order(bins, data):
    """Context parallelism, 2 steps: the data-parallel sums and the ring's transfers never in flight together; with the
    ordering wait deleted the emulator finds them so (the per-layer sum of layer l issued while the ring of layer l-1
    waits). The stream order that delays the collective stream most (latest) makes the overlap likely."""
    flags = ["-b", "2", "-x", "2", "--context-parallel", "2"]
    ordered = train(bins, data, 2, "fp32", *flags, timeout=300, EMU_STREAM_ORDER="latest")
    assert ordered.returncode == 0 and len(steps(ordered)) == 2, explain(ordered)
    mutant = train(bins, data, 2, "fp32", *flags, timeout=300, EMU_STREAM_ORDER="latest",
                   EMU_DELETE_SYNC=f"llmc/cuda/multigpu.cuh:{order_wait_line()}")
    assert mutant.returncode != 0 and "while an operation of another communicator of this process is in flight" in mutant.stderr, \
        explain(mutant)
