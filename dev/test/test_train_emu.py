"""The CUDA trainer's driver (train_gpt.cu) under the CPU emulator of CUDA (dev/emu).

test_emu.py checks the kernels through test_gpt; this file runs the trainer
itself, emulated: the loss falls on a repeated batch, a checkpoint resume is
bitwise identical, every recompute setting prints the same steps with
gradient accumulation and with dropout; dev/bench/sweep_recompute.py reads its
output; REMAT_PROFILE's step breakdown and calibration; the no-device and
out-of-memory paths; sampling a prompt and evaluating by position. Like
test_emu.py it is no GPU verification (dev/emu/README.md). Skipped (with the
reason) without g++ or off x86-64 Linux.
"""
import concurrent.futures
import importlib.util
import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from conftest import REPO, datafile
from emu_support import EMU, JOBS, OUT, PRECISIONS, emu_run, explain, precision_param


RECOMPUTE_FLAGS = [["-r", "0"], ["-r", "1"], ["-r", "2"], ["-r", "1", "--recompute-layers", "1"], ["-r", "3"],
                   ["-r", "1:0/3:1"]]


DROPOUT_FLAGS = ["--embd-dropout", "0.1", "--resid-dropout", "0.1", "--attn-dropout", "0.1"]


DROPOUT_RECOMPUTE_FLAGS = [["-r", "0"], ["-r", "1"], ["-r", "1:0/3:1"]]


TINY = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]


STEP_RE = re.compile(r"^step +(\d+)/(\d+) \| loss ([0-9.]+) \| lr (\S+) \| norm ([0-9.]+)", re.M)


def steps(stdout):
    return [(m.group(1), m.group(3), m.group(4), m.group(5)) for m in STEP_RE.finditer(stdout)]


def train_job(precision, data):
    """Repeated-batch run, full run with checkpoints, resumed run: outputs and checkpoint bytes."""
    exe = OUT / f"emu_train_gpt_{precision}"
    data.mkdir(parents=True)
    rng = np.random.default_rng(3)
    datafile.write_shard(data / "one_train.bin", rng.integers(0, 64, 2 * 32 + 1))
    datafile.write_shard(data / "tiny_train.bin", rng.integers(0, 64, 20000))
    datafile.write_shard(data / "tiny_val.bin", rng.integers(0, 64, 4000))
    r = {}
    r["repeat"] = emu_run([exe, *TINY, "-i", data / "one_train.bin", "-j", "", "-b", "2", "-t", "32", "-x", "12", "-l", "1e-2",
                           "-s", "0"])
    common = [exe, *TINY, "-i", data / "tiny_train.bin", "-j", data / "tiny_val.bin", "-b", "2", "-t", "32", "-v", "0", "-s", "0",
              "-x", "6", "-n", "3", "--shuffle", "1", "-c", "0.1", "-k", "cosine", "-u", "2", "-q", "0.1", "-l", "1e-3"]
    full, part = data / "full", data / "part"
    r["full"] = emu_run([*common, "-o", full])
    part.mkdir()
    for name in ["model_00000003.bin", "state_00000003_00000.bin", "DONE_00000003"]:
        if (full / name).exists():
            shutil.copy(full / name, part / name)
    r["resumed"] = emu_run([*common, "-o", part, "-y", "1", "-r", "2"])  # resumed with selective recompute
    r["files"] = {name: ((full / name).read_bytes() if (full / name).exists() else None,
                         (part / name).read_bytes() if (part / name).exists() else None)
                  for name in ["model_00000006.bin", "state_00000006_00000.bin"]}
    # recompute through the command line, with gradient accumulation (-d: 2 micro-batches per step)
    modes = [exe, *TINY, "-i", data / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32", "-d", "128", "-x", "3", "-s", "0"]
    r["modes"] = {" ".join(flags): emu_run([*modes, *flags]) for flags in RECOMPUTE_FLAGS}
    # dropout at the embedding and on the residual branches (attention's waits for its kernels): every recompute
    # setting regenerates the masks; --dropout 0 is no dropout
    r["dropout_modes"] = {" ".join(flags): emu_run([*modes, *DROPOUT_FLAGS, *flags]) for flags in DROPOUT_RECOMPUTE_FLAGS}
    r["dropout_zero"] = emu_run([*modes, "--dropout", "0", "-r", "0"])
    return r


@pytest.fixture(scope="module")
def train_runs(emu_build, tmp_path_factory):
    """train_job of every built precision, started at once in the background
    (one per core); each test waits on its own."""
    built = set(subprocess.run(["make", "-s", "-C", str(EMU), "precisions"], capture_output=True, text=True).stdout.split())
    data = tmp_path_factory.mktemp("emu_train_data")
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=JOBS)
    yield {p: ex.submit(train_job, p, data / p) for p in PRECISIONS if p in built}
    ex.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("precision", [precision_param(p) for p in PRECISIONS])
def test_train_emulated_learns_resumes_and_recomputes_bitwise(train_runs, precision):
    """train_gpt emulated: loss falls on a repeated batch, resume bitwise, every recompute setting the same steps
    (with dropout too, and --dropout 0 as no flag)."""
    if precision not in train_runs:
        pytest.skip(f"{precision} not built")
    r = train_runs[precision].result()
    rep = r["repeat"]
    assert rep.returncode == 0, explain(rep)
    assert "EMU (CPU emulation of CUDA, not a GPU)" in rep.stdout
    losses = [float(s[1]) for s in steps(rep.stdout)]
    assert len(losses) == 12, rep.stdout[-2000:]
    assert losses[-1] < 0.5 * losses[0], losses
    assert sum(b > a for a, b in zip(losses, losses[1:])) <= 2, losses
    full, resumed = r["full"], r["resumed"]
    assert full.returncode == 0, explain(full)
    assert resumed.returncode == 0, explain(resumed)
    assert "resumed: step 3" in resumed.stdout, resumed.stdout[-2000:]
    assert len(steps(full.stdout)) == 6
    assert steps(resumed.stdout) == steps(full.stdout)[3:]
    for name, (a, b) in r["files"].items():
        assert a is not None and b is not None and a == b, f"{name} differs after resume"
    base = None
    for flags, res in r["modes"].items():
        assert res.returncode == 0, flags + "\n" + explain(res)
        assert "gradient accumulation 2" in res.stdout
        got = steps(res.stdout)
        assert len(got) == 3, res.stdout[-2000:]
        base = base or got
        assert got == base, f"{flags}: {got} != -r 0: {base}"
    assert steps(r["dropout_zero"].stdout) == base, explain(r["dropout_zero"])
    dropped = None
    for flags, res in r["dropout_modes"].items():
        assert res.returncode == 0, flags + "\n" + explain(res)
        assert "dropout: embedding 0.1 (--embd-dropout), attention 0.1 (--attn-dropout), residual 0.1 (--resid-dropout)" in res.stdout
        got = steps(res.stdout)
        assert len(got) == 3 and got != base, res.stdout[-2000:]
        dropped = dropped or got
        assert got == dropped, f"dropout, {flags}: {got} != -r 0: {dropped}"


def test_sweep_reads_the_trainers_output(train_runs):
    """dev/bench/sweep_recompute.py's parse of a real (emulated) train_gpt run:
    the emulator has no CUDA context or library memory, so the memory in use
    less the context the trainer names is the plan itself (to the step lines'
    whole-MiB rounding); ms/step and the number of timed steps come through;
    a failing run reads FAIL with the trainer's error line."""
    if "bf16" not in train_runs:
        pytest.skip("bf16 not built")
    spec = importlib.util.spec_from_file_location("sweep_recompute", REPO / "dev" / "bench" / "sweep_recompute.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    res = next(iter(train_runs["bf16"].result()["modes"].values()))  # 3 steps
    assert res.returncode == 0, explain(res)
    r = sweep.parse_run(res.stdout, res.stderr, res.returncode, 3, 60)
    assert r["status"] == "ok" and r["timed_steps"] == 2 and r["ms"] > 0, r
    assert r["context_mib"] == 0.0, r
    assert abs(r["measured_mib"] - r["context_mib"] - r["trainer_plan_mib"]) <= 0.5, r
    bad = sweep.parse_run("", "error: -t 0: must be at least 1\n", 1, 3, 60)
    assert bad["status"] == "FAIL (rc 1): error: -t 0: must be at least 1", bad
    assert sweep.parse_run("step 1", "", None, 3, 60)["status"] == "timeout (>60s)"


PROFILE_RE = re.compile(r"^profile of step (\d+): ([0-9.]+) ms on the stream \| forward ([0-9.]+) \(attention ([0-9.]+)\) "
                        r"\| classifier ([0-9.]+) \| backward ([0-9.]+), of which recompute ([0-9.]+) \(attention ([0-9.]+)\) "
                        r"and attention ([0-9.]+) \| grad sync ([0-9.]+) \| update ([0-9.]+) \| gaps (-?[0-9.]+)$", re.M)


@pytest.mark.parametrize("recompute", ["0", "1"])
def test_step_profile_emulated(emu_build, tmp_path, recompute):
    """REMAT_PROFILE=2 prints one breakdown of step 2 (two micro-steps) whose
    parts nest as documented (llmc/cuda/profile.cuh), and changes no result; with
    REMAT_PROFILE_COST_MODEL it writes the time model calibrated from that step,
    which --cost-model reads back."""
    datafile.write_shard(tmp_path / "t.bin", np.random.default_rng(5).integers(0, 64, 2000))
    args = [OUT / "emu_train_gpt_bf16", *TINY, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "32", "-d", "128",
            "-x", "3", "-s", "0", "-r", recompute]
    plain = emu_run(args)
    cost_file = tmp_path / "cost_model.txt"
    prof = emu_run(args, REMAT_PROFILE="2", REMAT_PROFILE_COST_MODEL=str(cost_file))
    assert plain.returncode == 0 and prof.returncode == 0, explain(prof)
    assert steps(prof.stdout) == steps(plain.stdout) and len(steps(plain.stdout)) == 3
    found = PROFILE_RE.findall(prof.stdout)
    assert len(found) == 1 and found[0][0] == "2", prof.stdout[-3000:]
    assert prof.stdout.index("profile of step 2") < prof.stdout.index("step    2/3")
    total, fwd, att_f, cls, bwd, rec, att_r, att_b, sync, upd, gaps = map(float, found[0][1:])
    assert 0 < att_f < fwd and cls > 0 and 0 < att_b < bwd and upd > 0
    assert (0 < att_r < rec < bwd) if recompute == "1" else (rec == 0 and att_r == 0)  # -r 0: no recompute span at all
    assert sync == 0  # no NCCL in the emulated build
    assert fwd + cls + bwd + upd <= total + 0.05 and gaps >= -0.05
    assert "profile of" not in plain.stdout
    # the sweep's reading of it (dev/bench/sweep_recompute.py)
    spec = importlib.util.spec_from_file_location("sweep_recompute", REPO / "dev" / "bench" / "sweep_recompute.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    r = sweep.parse_run(prof.stdout, prof.stderr, 0, 3, 60)
    assert r["attention_share"] == f"{100 * (att_f + att_r + att_b) / total:.0f}%"
    assert r["recompute_share"] == f"{100 * rec / total:.0f}%"
    # the time model calibrated from it: attention FLOPs counted here (2 micro-steps, 2 layers, forward
    # 2 B T (T+1) C, backward 2.5 times that, -r 1 once more) over the attention spans
    B, T, C = 2, 32, 32
    att_flops = 2 * 2 * (3.5 + (recompute == "1")) * 2 * B * T * (T + 1) * C
    rates = dict(line.split(" = ") for line in cost_file.read_text().splitlines() if " = " in line)
    att_ms = att_f + att_r + att_b  # the profile prints 2 decimals
    assert abs(float(rates["attention_flops_per_s"]) - att_flops / (att_ms * 1e-3)) <= att_flops / ((att_ms - 0.015) * 1e-3) - \
        att_flops / (att_ms * 1e-3)
    assert "cost model: " in prof.stdout and str(cost_file) in prof.stdout
    plan_cmd = [str(REPO / "train_gpt_cpu"), *TINY, "-b", "2", "-t", "32", "--cost-model", str(cost_file), "--plan-json"]
    planned = json.loads(subprocess.run(plan_cmd, capture_output=True, text=True, check=True).stdout)
    for key in ["matmul_flops_per_s", "attention_flops_per_s", "memory_bytes_per_s"]:
        assert planned["cost_model"][key] == pytest.approx(float(rates[key]), rel=1e-5)


def test_step_profile_times_the_offload_copies_emulated(emu_build, tmp_path):
    """With offloaded checkpoints REMAT_PROFILE_COST_MODEL measures the host link from step 2's own copies
    (llmc/cuda/offload.cuh's timing events): each layer's copies out and back in, 2 layers x 2 micro-steps x 2
    directions = 8 groups, their bytes over their seconds in the file, which --cost-model reads back; the
    results are those of the run without profiling."""
    datafile.write_shard(tmp_path / "t.bin", np.random.default_rng(5).integers(0, 64, 2000))
    args = [OUT / "emu_train_gpt_bf16", *TINY, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "32", "-d", "128",
            "-x", "3", "-s", "0", "-r", "1", "--offload-checkpoints"]
    plain = emu_run(args)
    cost_file = tmp_path / "cost_model.txt"
    prof = emu_run(args, REMAT_PROFILE="2", REMAT_PROFILE_COST_MODEL=str(cost_file))
    assert plain.returncode == 0 and prof.returncode == 0, explain(prof)
    assert steps(prof.stdout) == steps(plain.stdout) and len(steps(plain.stdout)) == 3
    m = re.search(r"host link ([0-9.e+]+) B/s from (\d+) timed copy groups of (\d+) bytes", prof.stdout)
    B, T, C = 2, 32, 32
    assert m and m.group(2) == "8" and int(m.group(3)) == 8 * B * T * C * 2, prof.stdout[-3000:]  # -r 1 offloads x, bf16
    rates = dict(line.split(" = ") for line in cost_file.read_text().splitlines() if " = " in line)
    plan_cmd = [str(REPO / "train_gpt_cpu"), *TINY, "-b", "2", "-t", "32", "-r", "1", "--offload-checkpoints", "--plan-json"]
    default = json.loads(subprocess.run(plan_cmd, capture_output=True, text=True, check=True).stdout)["cost_model"]
    measured = json.loads(subprocess.run([*plan_cmd, "--cost-model", str(cost_file)], capture_output=True, text=True,
                                         check=True).stdout)["cost_model"]
    assert float(rates["host_link_bytes_per_s"]) == pytest.approx(float(m.group(1)), rel=5e-3)  # printed to 3 digits
    assert measured["host_link_bytes_per_s"] == pytest.approx(float(rates["host_link_bytes_per_s"]), rel=1e-5)
    assert measured["host_link_bytes_per_s"] != default["host_link_bytes_per_s"]


def test_step_profile_bad_value_and_off(emu_build, tmp_path):
    datafile.write_shard(tmp_path / "t.bin", np.arange(200) % 64)
    args = [OUT / "emu_train_gpt_bf16", *TINY, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "32", "-x", "1"]
    res = emu_run(args, REMAT_PROFILE="two")
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 1 and lines == ["error: REMAT_PROFILE: 'two' is not a step number (0: off)"], explain(res)
    off = emu_run(args, REMAT_PROFILE="0")
    assert off.returncode == 0 and "profile of" not in off.stdout, explain(off)
    res = emu_run(args, REMAT_PROFILE_COST_MODEL=str(tmp_path / "cm.txt"))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 1 and lines == ["error: REMAT_PROFILE_COST_MODEL needs REMAT_PROFILE=N: the step whose profile "
                                             "calibrates it"], explain(res)


def test_train_without_device_fails_cleanly(emu_build, tmp_path):
    datafile.write_shard(tmp_path / "t.bin", np.arange(200) % 64)
    res = emu_run([OUT / "emu_train_gpt_bf16", *TINY, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "32", "-x", "1"],
                  EMU_DEVICE_COUNT="0")
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: no CUDA device"), explain(res)
    assert "cudaErrorNoDevice" in lines[0], explain(res)  # the runtime's error, by name


def test_gpu_presence_skip_only_without_a_gpu(emu_build):
    """test_gpt's check_gpu_presence: a present but unusable GPU is a failure, not a skip."""
    res = emu_run([OUT / "emu_test_gpt_bf16", "presence"])
    assert res.returncode == 0 and "PASS: GPU presence" in res.stdout, explain(res)


def test_train_out_of_device_memory_is_reported(emu_build, tmp_path):
    datafile.write_shard(tmp_path / "t.bin", np.arange(200) % 64)
    res = emu_run([OUT / "emu_train_gpt_bf16", *TINY, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "32", "-x", "1"],
                  EMU_DEVICE_MEMORY="64KiB")
    assert res.returncode == 1, explain(res)
    assert "out of device memory" in res.stderr, explain(res)


def test_train_emulated_samples_a_prompt_and_evaluates_by_position(emu_build, tmp_path):
    """The shared sampling and evaluation code through train_gpt's backend (its
    per-token losses, probabilities and device memory), on the emulator."""
    rng = np.random.default_rng(4)
    datafile.write_shard(tmp_path / "t.bin", rng.integers(0, 64, 2000))
    (tmp_path / "prompt.txt").write_text("5 9 13")
    res = emu_run([OUT / "emu_train_gpt_bf16", *TINY, "-i", tmp_path / "t.bin", "-j", tmp_path / "t.bin", "-b", "2",
                   "-t", "32", "-x", "2", "-v", "2", "-m", "2", "-s", "2", "-g", "5", "--prompt-tokens",
                   tmp_path / "prompt.txt", "--temperature", "0", "--eval-by-position", "8", "-o", tmp_path / "run"])
    assert res.returncode == 0, explain(res)
    overall = float(re.search(r"^val loss ([0-9.]+) at step 2$", res.stdout, re.M).group(1))
    line = re.search(r"^val loss by position at step 2: (.*)$", res.stdout, re.M).group(1)
    buckets = [(int(a), int(b), float(x)) for a, b, x in re.findall(r"(\d+)-(\d+) ([0-9.]+)", line)]
    assert [(a, b) for a, b, _ in buckets] == [(0, 8), (8, 16), (16, 32)]
    assert abs(sum((b - a) * x for a, b, x in buckets) / 32 - overall) < 5e-6
    sample = re.search(r"^sample at step 2:\n---\n(.*)\n---$", res.stdout, re.M).group(1)
    ids = [int(x) for x in re.findall(r"<(\d+)>", sample)]
    assert ids[:3] == [5, 9, 13] and len(ids) == 8 and all(0 <= t < 64 for t in ids), sample
    logged = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    train = [e for e in logged if "loss" in e]
    assert [e["tokens"] for e in train] == [64, 128] and all(e["memory_mib"] > 0 for e in train)
