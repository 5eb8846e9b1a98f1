"""The offload pool's pinned memory on the GPU's NUMA node (llmc/cuda/host_numa.cuh) under the CPU emulator: the
emulated device states its node with EMU_HOST_NUMA_NODE (cudaDevAttrHostNumaId); the trainer allocates the pool
under a preferred policy for that node and reads back where the pages landed; a node the system refuses, or a
device that does not say, gives one line and the OS's placement. The node read back is the kernel's answer
(get_mempolicy), not the trainer's request: on this machine's node 0 both agree."""
import os
import re

import pytest

from emu_support import emu_run, explain
from test_emu_cublaslt import train_exe  # noqa: F401 (the fixture: emu_train_gpt_bf16)
from test_offload_emu import MODEL


def offload_run(exe, tiny_shards, **env):
    return emu_run([exe, *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32", "-x", "1", "-n", "0", "-s", "0",
                    "-r", "1", "--offload-checkpoints"], timeout=600, **env)


def test_the_pool_lands_on_the_gpus_node(train_exe, tiny_shards):  # noqa: F811
    if not os.path.exists("/sys/devices/system/node/node0"):
        pytest.skip("no NUMA node 0 in sysfs")
    res = offload_run(train_exe, tiny_shards, EMU_HOST_NUMA_NODE="0")
    assert res.returncode == 0, explain(res)
    m = re.search(r"^pinned memory \(offloaded checkpoints\): [0-9.]+ MiB on NUMA node 0, the GPU's \(cudaDevAttrHostNumaId\); "
                  r"pages read back on nodes (-?\d+) and (-?\d+)", res.stdout, re.M)
    assert m and m.groups() == ("0", "0"), res.stdout[-3000:]


def test_a_device_that_does_not_say_leaves_the_pages_to_the_os(train_exe, tiny_shards):  # noqa: F811
    res = offload_run(train_exe, tiny_shards)
    assert res.returncode == 0, explain(res)
    lines = [l for l in res.stdout.splitlines() if l.startswith("pinned memory")]
    assert lines == ["pinned memory (offloaded checkpoints): the GPU's NUMA node is not known (no cudaDevAttrHostNumaId, no sysfs numa_node); "
                     "the OS places the pages"], res.stdout[-3000:]


def test_a_node_the_system_refuses_is_one_line(train_exe, tiny_shards):  # noqa: F811
    if os.path.exists("/sys/devices/system/node/node1000"):
        pytest.skip("this machine has a NUMA node 1000")
    res = offload_run(train_exe, tiny_shards, EMU_HOST_NUMA_NODE="1000")
    assert res.returncode == 0, explain(res)
    assert re.search(r"^pinned memory \(offloaded checkpoints\): NUMA node 1000 \(cudaDevAttrHostNumaId\) refused a memory policy \(.+\); "
                     r"the OS places the pages$", res.stdout, re.M), res.stdout[-3000:]
