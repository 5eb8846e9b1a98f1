"""The CUDA trainer (train_gpt.cu, under the CPU emulator of CUDA: no GPU
verification) on llm.c's llama-3 shards (version 7, uint32 tokens) with a
vocabulary of 70,000: its pinned window holds 4-byte tokens. Its steps match
the CPU trainer's (fp32 build), and the same tokens in a version-1 shard train
to the same steps. Skipped (with the reason) where the emulator cannot run."""
import re

import numpy as np

from conftest import binary, datafile, run
from emu_support import OUT, emu_run, explain

BIG_V = 70_000
MODEL = ["-e", "d6", "--layers", "1", "--channels", "32", "--heads", "4", "--vocab-size", BIG_V, "--max-seq-len", "16"]
STEP_RE = re.compile(r"^step +\d+/\d+ \| loss ([0-9.]+)", re.M)


def losses(stdout):
    return [float(x) for x in STEP_RE.findall(stdout)]


def test_emulated_gpu_trainer_reads_uint32_tokens(emu_build, tmp_path):
    rng = np.random.default_rng(1)
    toks = rng.integers(0, BIG_V, 2000)
    toks[::2] = rng.integers(65_536, BIG_V, 1000)
    datafile.write_shard(tmp_path / "v7.bin", toks, version=7)
    small = rng.integers(0, 1000, 2000)
    datafile.write_shard(tmp_path / "small_v1.bin", small)
    datafile.write_shard(tmp_path / "small_v7.bin", small, version=7)
    common = [*MODEL, "-b", 2, "-t", 16, "-x", 3, "-s", 0, "-j", "", "-l", "1e-3", "--seed", 5]
    exe = emu_build / "emu_train_gpt_fp32"
    gpu = emu_run([exe, *common, "-i", tmp_path / "v7.bin"])
    assert gpu.returncode == 0, explain(gpu)
    cpu = run([binary("train_gpt_cpu"), *common, "-i", tmp_path / "v7.bin"], env={"OMP_NUM_THREADS": "1"}, check=True)
    g, c = losses(gpu.stdout), losses(cpu.stdout)
    assert len(g) == 3 and np.allclose(g, c, rtol=1e-5, atol=0), (g, c)
    outs = [emu_run([exe, *common, "-i", tmp_path / name]) for name in ("small_v1.bin", "small_v7.bin")]
    assert all(o.returncode == 0 for o in outs), [explain(o) for o in outs]
    assert losses(outs[0].stdout) == losses(outs[1].stdout) and len(losses(outs[0].stdout)) == 3
