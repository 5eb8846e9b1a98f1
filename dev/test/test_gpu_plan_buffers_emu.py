"""The GPU trainer's evaluation top-1 buffer and packed documents' device
buffers are the plan's (llmc/plan/plan.h: top1, documents.starts,
documents.position_runs), under the CPU emulator (dev/emu; NOT a GPU):
--plan-json names them with their sizes (this rank's tokens, 4 bytes each;
the position runs 12), only with the flags that need them, and a run on an
emulated device of exactly the plan's bytes trains, evaluates by position
and samples with all three document flags: any device allocation beside
the plan's arena would find no memory left."""
import json
import re
import subprocess

import numpy as np

from emu_support import emu_run, explain
from test_documents_emu import built
import datafile

TINY = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--eot-token", "63"]


def plan(exe, *flags):
    res = subprocess.run([str(exe), *TINY, "-b", "2", "-t", "32", "--plan-json", *flags], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, explain(res)
    return json.loads(res.stdout)


def test_plan_counts_top1_and_document_buffers():
    exe, = built("emu_train_gpt_bf16")
    tokens = 2 * 32
    buffers = lambda d: {b["name"]: b["bytes"] for b in d["buffers"]}  # noqa: E731
    none, mask, positions = plan(exe), plan(exe, "--reset-attention-mask", "--eot-token", "63"), plan(exe, *DOCS)
    assert buffers(none)["top1"] == tokens * 4 and not any(n.startswith("documents.") for n in buffers(none))
    assert buffers(mask)["documents.starts"] == tokens * 4 and "documents.position_runs" not in buffers(mask)
    assert buffers(positions)["documents.starts"] == tokens * 4 and buffers(positions)["documents.position_runs"] == tokens * 12
    assert none["total_bytes"] + tokens * 16 <= positions["total_bytes"]
    ring = buffers(plan(exe, *DOCS, "--plan-processes", "2", "--context-parallel", "2"))
    assert ring["top1"] == ring["documents.starts"] == tokens // 2 * 4 and ring["documents.position_runs"] == tokens // 2 * 12
    text = subprocess.run([str(exe), *TINY, "-b", "2", "-t", "32", "--plan", *DOCS], capture_output=True, text=True, timeout=120)
    assert all(re.search(rf"^\s+{re.escape(n)}\s", text.stdout, re.M) for n in ["top1", "documents.starts", "documents.position_runs"]), \
        text.stdout[-3000:]


def test_run_fits_a_device_of_exactly_the_plan(tmp_path):
    exe, = built("emu_train_gpt_fp32")
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 63, 4000)
    tokens[rng.random(4000) < 0.1] = 63
    datafile.write_shard(tmp_path / "t.bin", tokens)
    flags = [*TINY, "-i", tmp_path / "t.bin", "-j", tmp_path / "t.bin", "-b", "2", "-t", "32", "-x", "1", "-v", "1", "-m", "1",
             "-s", "1", "-g", "3", "--eval-by-position", "8", *DOCS, "--mem-budget", "1GiB"]
    total = plan(exe, *[str(f) for f in flags])["total_bytes"]
    res = emu_run([exe, *flags], EMU_DEVICE_MEMORY=str(total))
    assert res.returncode == 0 and "val loss by position at step 1" in res.stdout and "sample at step 1" in res.stdout, explain(res)
    short = emu_run([exe, *flags], EMU_DEVICE_MEMORY=str(total - 4096))  # the check can tell: a plan that does not fit fails
    assert short.returncode == 1 and "out of device memory" in short.stderr, explain(short)
