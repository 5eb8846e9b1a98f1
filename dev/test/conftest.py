"""Shared fixtures for the test suite: paths, the built binaries, small data."""
import os
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
