"""Shared fixtures for the test suite: paths, the built binaries, small data."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build"
sys.path.insert(0, str(REPO / "dev" / "data"))

import datafile  # noqa: E402


def binary(name):
    """A built binary; a missing one is a failure (make test builds them all)."""
    path = REPO / name
    if not path.exists():
        pytest.fail(f"{path} is not built: run 'make test-bins' (make test does)")
    return path


def run(args, timeout=600, env=None, check=False):
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "2")
    if env:
        full_env.update(env)
    res = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    if check and res.returncode != 0:
        raise AssertionError(f"{args[0]} exited {res.returncode}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}")
    return res


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """A small synthetic Markov dataset (dev/data/synthetic.py) and its meta."""
    out = tmp_path_factory.mktemp("synthetic")
    run([sys.executable, REPO / "dev/data/synthetic.py", "--output-dir", out, "--train-tokens", "600000",
         "--val-tokens", "40000"], check=True)
    import json
    meta = json.loads((out / "synthetic_meta.json").read_text())
    return out, meta


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    """Random-token train/val shards for a vocabulary of 64."""
    out = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(0)
    datafile.write_shard(out / "tiny_train.bin", rng.integers(0, 64, 20000))
    datafile.write_shard(out / "tiny_val.bin", rng.integers(0, 64, 4000))
    return out


# ---- a tiny CPU training run, as the reliability and hostile-input tests use it ----

# 8,896 parameters: Vp*C + maxT*C + L*(12*C*C + 13*C) + 2*C with Vp 128, C 16, L 2, maxT 16
TINY_MODEL = ["-e", "d6", "--layers", "2", "--channels", "16", "--heads", "2", "--vocab-size", "64", "--max-seq-len", "16"]
STEP_RE = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr (\S+) \| norm ([0-9.]+)", re.M)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # a model this small only waits on a second thread


def tiny_trainer(train_bin, *extra, exe="train_gpt_cpu", env=None, **kw):
    """TINY_MODEL on train_bin, 2 x 8 tokens a step, no validation or sampling, one thread."""
    return run([binary(exe), *TINY_MODEL, "-i", train_bin, "-j", "", "-b", "2", "-t", "8", "-s", "0", "-l", "1e-3", *extra],
               env={**ONE_THREAD, **(env or {})}, **kw)


def machine_has_gpu():
    """Whether this machine has an NVIDIA GPU, asked of the driver, not of
    the program under test: nvidia-smi lists one, or a device node exists."""
    import glob
    import shutil
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.startswith("GPU ")


def steps(stdout):
    """(step, loss, lr, norm) strings of every step line."""
    return [m.groups() for m in STEP_RE.finditer(stdout)]


def snapshot(d):
    """Every file of a directory, name to bytes."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def log_lines(d):
    """The entries of a run's log.jsonl, every line whole."""
    text = (d / "log.jsonl").read_text()
    assert text.endswith("\n") or not text
    return [json.loads(line) for line in text.splitlines()]


def one_error(res):
    """The single 'error: ' line of a run that failed with exit status 1."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (res.returncode, res.stdout[-1500:], res.stderr)
    return lines[0]


# ---- the CUDA emulator (dev/emu; helpers in emu_support.py) ----

@pytest.fixture(scope="session")
def emu_build():
    """The emulator and its binaries (make -C dev/emu), once a session; skips
    where the emulator cannot run (emu_support.platform_problem)."""
    from emu_support import EMU, JOBS, OUT, platform_problem
    why = platform_problem()
    if why:
        pytest.skip(why)
    res = subprocess.run(["make", "-C", str(EMU), f"-j{JOBS}"], capture_output=True, text=True, timeout=1200)
    if res.returncode != 0:
        pytest.fail("building the emulator failed (make -C dev/emu):\n" + res.stdout[-3000:] + res.stderr[-6000:])
    return OUT


# The end-to-end CPU trainer tests' model: 3 layers of 32 channels on
# tiny_shards, 2 x 32 tokens a step.
TINY_RUN_MODEL = ["-e", "d6", "--layers", "3", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]


def tiny_run(tiny_shards, *extra, exe="train_gpt_cpu"):
    return run([binary(exe), *TINY_RUN_MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", tiny_shards / "tiny_val.bin",
                "-b", "2", "-t", "32", "-v", "0", "-s", "0", "-l", "1e-3", *extra], check=True)


def copy_checkpoint(src, dst, step):
    """The files of one complete single-process checkpoint of step `step` into a new directory."""
    dst.mkdir()
    for name in [f"model_{step:08d}.bin", f"state_{step:08d}_00000.bin", f"DONE_{step:08d}"]:
        shutil.copy(src / name, dst / name)


def gpu_trainer():
    """The GPU trainer for plans (--plan-json allocates nothing and runs no kernel): ./train_gpt or
    build/train_gpt_bf16 when nvcc built it, else the emulated build of the same source."""
    for p in (REPO / "train_gpt", REPO / "build" / "train_gpt_bf16", REPO / "build" / "emu" / "emu_train_gpt_bf16"):
        if p.exists():
            return p
    pytest.skip("no GPU trainer built (make train_gpt, or make -C dev/emu)")
