"""Every row of docs/context-parallel.md's H200 table runs as printed, as far as a machine without a GPU can tell:
the GPU trainer's --plan-json for the row's T, N, -r and -z (B = 1, 139 GiB) exits 0, fits, and gives the row's GiB.

The GPU trainer checks its limits before --plan exits, so a plan that passes is one the run does not refuse (T / N
tokens per rank are no longer limited beyond -t's 4,194,304: docs/DESIGN.md, "Index widths").
The binary: ./train_gpt or build/train_gpt_bf16 when nvcc built it, else the emulated build of the same source
(dev/emu: --plan allocates nothing and runs no kernel, so it is the same program's plan)."""
import json
import re

import pytest

from conftest import REPO, gpu_trainer, run

ROW = re.compile(r"^\| ([0-9,]+) \| (\d+) \| (\d) \| (\d) \| ([0-9.]+) \| (yes|no) \|", re.M)


def table_rows():
    text = (REPO / "docs/context-parallel.md").read_text()
    section = text.split("## What the plan predicts for GPT-2 1.5B on H200s", 1)[1].split("\n## ", 1)[0]
    rows = ROW.findall(section)
    assert len(rows) >= 6, section[:2000]
    return rows


@pytest.mark.parametrize("row", table_rows(), ids=lambda r: f"T{r[0]}-N{r[1]}-r{r[2]}-z{r[3]}")
def test_context_parallel_row_runs_as_printed(row):
    T, N, r, z, gib, fits = row
    T = int(T.replace(",", ""))
    flags = ["-e", "d48", "--max-seq-len", str(T), "-t", str(T), "-b", "1", "-r", r, "-z", z, "--mem-budget", "139GiB", "--plan-json"]
    if int(N) > 1:
        flags += ["--plan-processes", N, "--context-parallel", N]
    res = run([gpu_trainer(), *flags], env={"EMU_NO_REEXEC": "1", "OMP_WAIT_POLICY": "passive"})
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(res.stdout)
    assert fits == "yes" and d["total_bytes"] <= 139 * 2**30
    assert f"{d['total_bytes'] / 2**30:.1f}" == gib, (d["total_bytes"] / 2**30, gib)


def test_gpu_trainer_takes_the_longest_t_on_one_rank():
    """docs/DESIGN.md, "Index widths": the GPU trainer's offsets past 2^31 elements are 64-bit, so it plans (and would
    run) -t 4,194,304, -t's limit, on one rank; it refused more than 2^20 tokens per rank before."""
    flags = ["-e", "d12", "--max-seq-len", "4194304", "-t", "4194304", "-b", "1", "-r", "1", "--mem-budget", "4096GiB", "--plan-json"]
    res = run([gpu_trainer(), *flags], env={"EMU_NO_REEXEC": "1", "OMP_WAIT_POLICY": "passive"})
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(res.stdout)
    assert d["seq_len"] == 4194304 and d["total_bytes"] > 2**31, (d["seq_len"], d["total_bytes"])
