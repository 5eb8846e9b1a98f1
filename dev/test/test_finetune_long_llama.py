"""docs/finetune_long.md's Llama walk-through runs as printed: its shell block, taken from the document, runs
under bash -e in a scratch directory (dev/ and train_gpt_cpu linked from the repository; `make train_gpt_cpu`
finds the binary up to date) with STEPS and TUNE of a few steps; the three passkey reports appear, the
scaled evaluation differs from the unscaled one, and the fine-tuned model file holds the linear scaling
(slots 2, 16, 17, 20 of docs/FORMATS.md) over the original 16 positions."""
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
