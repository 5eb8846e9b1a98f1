"""The state file records what a run computed on (checkpoint.h's device
record, slots 200-219: name, SM count, CUDA runtime, cuBLASLt and NCCL
versions), and a resume on anything else warns that the run is no longer
bitwise the one that did not stop (it still resumes)."""
import shutil
import struct

from conftest import TINY_RUN_MODEL, binary, run

DEVICE_NAME_SLOT, SMS_SLOT = 200, 216


def header(path):
    return list(struct.unpack("<256i", path.read_bytes()[:1024]))


def train(tiny_shards, out, *extra):
    return run([binary("train_gpt_cpu"), *TINY_RUN_MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32",
                "-v", "0", "-s", "0", "-o", out, *extra], check=True)


def test_state_records_the_device_and_resume_elsewhere_warns(tiny_shards, tmp_path):
    train(tiny_shards, tmp_path, "-x", "2", "-n", "2")
    state = tmp_path / "state_00000002_00000.bin"
    h = header(state)
    name = struct.pack("<16i", *h[DEVICE_NAME_SLOT:DEVICE_NAME_SLOT + 16]).rstrip(b"\0")
    assert name == b"CPU reference (fp32)" and h[SMS_SLOT] == 0
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy)
    same = train(tiny_shards, copy, "-x", "3", "-y", "1")
    assert "resumed: step 2" in same.stdout and "warning" not in same.stderr, same.stderr
    data = bytearray(state.read_bytes())
    data[4 * DEVICE_NAME_SLOT:4 * DEVICE_NAME_SLOT + 64] = b"NVIDIA H200".ljust(64, b"\0")
    struct.pack_into("<i", data, 4 * SMS_SLOT, 132)
    state.write_bytes(bytes(data))
    other = train(tiny_shards, tmp_path, "-x", "3", "-y", "1")
    assert "resumed: step 2" in other.stdout
    warn = [line for line in other.stderr.splitlines() if line.startswith("warning:")]
    assert len(warn) == 1 and "NVIDIA H200, 132 SMs" in warn[0] and "CPU reference (fp32)" in warn[0], other.stderr
