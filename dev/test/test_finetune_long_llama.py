"""docs/finetune_long.md's Llama walk-through runs as printed: its shell block, taken from the document, runs
under bash -e in a scratch directory (dev/ and train_gpt_cpu linked from the repository; `make train_gpt_cpu`
finds the binary up to date) with STEPS and TUNE of a few steps; the three passkey reports appear, the
scaled evaluation differs from the unscaled one, and the fine-tuned model file holds the linear scaling
(slots 2, 16, 17, 20 of docs/FORMATS.md) over the original 16 positions. And scripts/finetune_long.sh lengthens
such a model with ROPE_SCALING, where it passed --wpe-init (refused for a RoPE file) before."""
import re
import shutil
import subprocess

import numpy as np
import pytest

from conftest import REPO, binary

HEADING = "### A Llama model, longer with `--rope-scaling`, on the CPU"


def walk_through():
    text = (REPO / "docs/finetune_long.md").read_text()
    assert HEADING in text
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


@pytest.mark.skipif(shutil.which("make") is None, reason="make not found: the block's first command needs it")
def test_llama_walk_through_runs_as_printed(tmp_path):
    (tmp_path / "dev").symlink_to(REPO / "dev")
    (tmp_path / "train_gpt_cpu").symlink_to(binary("train_gpt_cpu"))
    res = subprocess.run(["bash", "-e", "-c", walk_through()], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={"PATH": __import__("os").environ["PATH"], "STEPS": "3", "TUNE": "2"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    marker = "passkey retrieval at step 0 (88 samples of 64 tokens"
    reports = ["\n".join(part.splitlines()[1:6]) for part in res.stdout.split(marker)[1:]]
    assert len(reports) == 3 and all(len(r.splitlines()) == 5 for r in reports), res.stdout[-3000:]
    assert reports[0] != reports[1]  # --rope-scaling changed what the model computes
    raw = (tmp_path / "out" / "llama64" / "model_00000002.bin").read_bytes()[:1024]
    h, f = np.frombuffer(raw, np.int32), np.frombuffer(raw, np.float32)
    assert h[1] == 7 and h[2] == 64 and h[14] == 1 and h[16] == 1 and f[17] == 4.0 and h[20] == 16, h[:28]


def test_finetune_long_script_lengthens_a_rope_model_with_rope_scaling(tmp_path):
    """scripts/finetune_long.sh on a version-7 file (no table: --wpe-init would be refused) passes ROPE_SCALING
    as --rope-scaling; the checkpoint holds it over the file's 64 positions, and passkey runs before and after."""
    import os
    import sys
    from conftest import datafile
    from test_llama_reference import CASES, V, random_params, write_model
    cfg = CASES["llama3-untied"]
    cfg = dict(cfg, rope="default", factor=1.0, low=0.0, high=0.0, original=0)
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 31))
    datafile.write_shard(tmp_path / "t.bin", np.random.default_rng(32).integers(0, V, 2000))
    subprocess.run([sys.executable, REPO / "dev/data/passkey.py", "make", tmp_path / "pk", "--seq-len", "128",
                    "--samples-per-depth", "1", "--vocab", str(V)], check=True, capture_output=True)
    env = {**os.environ, "TRAINER": str(binary("train_gpt_cpu")), "TRAIN": str(tmp_path / "t.bin"), "VAL": "",
           "MEM_BUDGET": "256MiB", "OMP_NUM_THREADS": "1", "TOKENS_PER_STEP": "128", "PASSKEY": str(tmp_path / "pk"),
           "OUT_DIR": str(tmp_path / "out"), "ROPE_SCALING": "linear:2"}
    res = subprocess.run([REPO / "scripts/finetune_long.sh", tmp_path / "m.bin", "128", "-x", "2"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("passkey retrieval at step 0 (11 samples of 128 tokens") == 2, res.stdout[-3000:]
    raw = (tmp_path / "out" / "model_00000002.bin").read_bytes()[:1024]
    h, f = np.frombuffer(raw, np.int32), np.frombuffer(raw, np.float32)
    assert h[2] == 128 and h[16] == 1 and f[17] == 2.0 and h[20] == 64, h[:28]
