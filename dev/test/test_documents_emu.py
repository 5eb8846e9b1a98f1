"""Packed documents on the GPU side, under the CPU emulator (dev/emu; NOT a
GPU): test_gpt's check_documents (the attention kernels with a document
mask, whole sequences and the two-member ring's blocks, the encoder with
restarting positions, the classifier's uncounted rows) against the CPU
reference, in FP32 (CUDA-core kernels) and BF16 (whose default mma family
hands documents to the CUDA-core kernels); and train_gpt with the three
flags against train_gpt_cpu, every -r setting bitwise equal to -r 0."""
import re
import subprocess

import numpy as np
import pytest

from conftest import REPO, binary, run
from emu_support import EMU, OUT, emu_run, explain, platform_problem
import datafile

CASES = ["docs:hs16:64:4:300:332", "docsdrop:hs64:128:2:300:200", "docs:hs20:80:4:300:100"]
TINY = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--eot-token", "63"]
STEP_RE = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr \S+ \| norm ([0-9.]+)", re.M)


def built(*names):
    why = platform_problem()
    if why:
        pytest.skip(why)
    res = subprocess.run(["make", "-C", str(EMU), "-j2", *[str(OUT / n) for n in names]], capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [OUT / n for n in names]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kernels_with_documents_emulated(precision):
    exe, = built(f"emu_test_gpt_{precision}")
    res = emu_run([exe, *CASES], timeout=1800)
    assert res.returncode == 0 and "PASS (emulated, not GPU verification)" in res.stdout, explain(res)
    for case in CASES:
        _, name, _, _, _, T = case.split(":")
        assert len(re.findall(rf"^PASS: documents, {name} T={T}$", res.stdout, re.M)) == 1, case


def test_train_gpt_with_documents_emulated(tmp_path):
    """Three steps, tokens 63 (end of text) at 8%: the emulated FP32
    trainer's losses and norms within 1e-5 of train_gpt_cpu's, and every
    -r setting, token tiles included, the -r 0 steps bit for bit."""
    exe, = built("emu_train_gpt_fp32")
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 63, 20000)
    tokens[rng.random(20000) < 0.08] = 63
    datafile.write_shard(tmp_path / "t.bin", tokens)
    common = [*TINY, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "32", "-x", "3", "-s", "0", *FLAGS]
    cpu = run([binary("train_gpt_cpu"), *common], env={"OMP_NUM_THREADS": "1"}, check=True)
    want = [tuple(map(float, s)) for s in STEP_RE.findall(cpu.stdout)]
    runs = {}
    for r in [["-r", "0"], ["-r", "1"], ["-r", "2"], ["-r", "3"], ["-r", "1:0/3:1"], ["-r", "1", "--tile-tokens", "16"]]:
        res = emu_run([exe, *common, *r])
        assert res.returncode == 0, explain(res)
        runs[" ".join(r)] = STEP_RE.findall(res.stdout)
    got = [tuple(map(float, s)) for s in runs["-r 0"]]
    assert len(got) == 3 and len(want) == 3
    for (s1, l1, n1), (s2, l2, n2) in zip(got, want):
        assert s1 == s2 and abs(l1 - l2) <= 1e-5 * l2 and abs(n1 - n2) <= 1e-5 * n2, (got, want)
    for name, steps in runs.items():
        assert steps == runs["-r 0"], name
