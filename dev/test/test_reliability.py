"""Reliability of the CPU trainer's runs: non-finite state never saved, a
reused output directory superseded, log.jsonl under write failures,
checkpoint retention and preemption by a signal (what a resume refuses and
falls back past: test_resume.py)."""
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import time

import numpy as np
import pytest

from conftest import ONE_THREAD, REPO, TINY_MODEL as MODEL, binary, datafile, log_lines, one_error, run, steps, tiny_trainer as trainer


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    d = tmp_path_factory.mktemp("rel")
    datafile.write_shard(d / "train.bin", np.random.default_rng(5).integers(0, 64, 20000))
    return d / "train.bin"


# ---- non-finite state ----

@pytest.fixture(scope="module")
def negative_v_checkpoint(shard, tmp_path_factory):
    """A checkpoint at step 1 whose AdamW v for position row 12's first
    element (element 2240 of the parameters) is -1: finite, so it loads, but
    the next update takes its square root. With -t 8 that row never reaches
    the loss, so every loss and gradient norm stays finite while the
    parameter turns NaN: only a check of the parameters themselves can see it."""
    d = tmp_path_factory.mktemp("negv")
    trainer(shard, "-x", "1", "-o", d, check=True)
    state = d / "state_00000001_00000.bin"
    data = bytearray(state.read_bytes())
    C, Vp, N = 16, 128, 8896
    at = 1024 + 4 * N + 4 * (Vp * C + 12 * C)
    data[at:at + 4] = struct.pack("<f", -1.0)
    state.write_bytes(bytes(data))
    return d


def test_nonfinite_parameters_are_never_saved_as_a_checkpoint(shard, negative_v_checkpoint, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(negative_v_checkpoint, work)
    res = run(env=ONE_THREAD, args=[binary("build/train_gpt_cpu_asan"), *MODEL, "-i", shard, "-j", "", "-b", "2", "-t", "8", "-s", "0",
               "-l", "1e-3", "-x", "3", "-y", "1", "-o", work], timeout=120)
    assert [int(s[0]) for s in steps(res.stdout)] == [2, 3]  # the losses were finite
    line = one_error(res)
    assert re.search(r"step 3: parameters element 2240 is -?nan:", line) and "no checkpoint" in line, line
    assert not list(work.glob("DONE_00000003")) and not list(work.glob("model_00000003*")) and not list(work.glob("*.tmp"))


def test_nonfinite_model_file_is_refused_at_load(shard, negative_v_checkpoint, tmp_path):
    """Issue 23 item 3: a NaN or Inf in a model file is named (tensor and
    element within it, from the layout of docs/FORMATS.md) before anything runs."""
    C, Vp, L, maxT = 16, 128, 2, 16
    src = (negative_v_checkpoint / "model_00000001.bin").read_bytes()
    # element offsets of wpe row 12 and of lnfb's last element, counted independently of the trainer
    wpe_at = Vp * C + 12 * C + 3
    total = Vp * C + maxT * C + L * (C + C + 3 * C * C + 3 * C + C * C + C + C + C + 4 * C * C + 4 * C + 4 * C * C + C) + C + C
    for at, value, want in [(wpe_at, float("nan"), "tensor wpe element 195 is nan"),
                            (total - 1, float("inf"), f"tensor lnfb element {C - 1} is inf")]:
        data = bytearray(src)
        data[1024 + 4 * at:1024 + 4 * at + 4] = struct.pack("<f", value)
        bad = tmp_path / "bad.bin"
        bad.write_bytes(bytes(data))
        line = one_error(run(env=ONE_THREAD, args=[binary("train_gpt_cpu"), "-e", bad, "-i", shard, "-j", "", "-b", "2", "-t", "8",
                                                   "-s", "0", "-x", "1"]))
        assert str(bad) in line and want in line and "diverged" not in line, line


# ---- a reused output directory (resume refusals: test_resume.py) ----

def test_supersede_replaces_the_earlier_run(shard, tmp_path):
    trainer(shard, "-x", "4", "-n", "2", "-o", tmp_path, check=True)
    old_id = (tmp_path / "DONE_00000004").read_text()
    res = trainer(shard, "-x", "1", "-o", tmp_path, "--seed", "7", "--supersede", check=True)
    assert "removed 2 earlier checkpoints" in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["DONE_00000001", "log.jsonl", "model_00000001.bin", "state_00000001_00000.bin"]
    assert (tmp_path / "DONE_00000001").read_text() != old_id
    assert [e["step"] for e in log_lines(tmp_path)] == [1]  # the earlier run's log is gone too
    # a later -y 1 resumes the new run, not the old one
    assert "resumed: step 1" in trainer(shard, "-x", "2", "-o", tmp_path, "--seed", "7", "-y", "1", check=True).stdout


# ---- log.jsonl ----

def test_log_write_failure_is_reported_once_and_the_log_stays_line_valid(shard, tmp_path):
    """The file size limit (as a full disk would) stops log writes part way
    through the run; the checkpoint files (state: about 72 KB) still fit."""
    limit = 80000
    def limit_file_size():  # SIGXFSZ left at its default: the trainer must ignore it itself
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    res = subprocess.run([str(binary("build/train_gpt_cpu_asan")), *MODEL, "-i", str(shard), "-j", "", "-b", "2", "-t", "8",
                          "-s", "0", "-x", "1000", "-o", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         preexec_fn=limit_file_size, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert res.returncode == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if "log.jsonl: write failed" in line]
    assert len(warnings) == 1 and "reported once" in warnings[0], res.stderr
    entries = log_lines(tmp_path)  # every line parses: none was cut or spliced
    # about 150 bytes a line: the limit stops the log after some 530 of the 1000 steps
    assert 400 < len(entries) < 1000 and [e["step"] for e in entries] == list(range(1, len(entries) + 1))
    assert (tmp_path / "DONE_00001000").exists()


# ---- retention ----

def test_retention_keeps_the_last_n_and_every_mth(shard, tmp_path):
    trainer(shard, "-x", "12", "-n", "1", "-nk", "2", "-nm", "5", "-o", tmp_path, check=True)
    done = sorted(int(p.name[5:]) for p in tmp_path.glob("DONE_*"))
    assert done == [5, 10, 11, 12]
    models = sorted(int(p.name[6:14]) for p in tmp_path.glob("model_*.bin"))
    states = sorted(int(p.name[6:14]) for p in tmp_path.glob("state_*.bin"))
    assert models == states == done


# ---- preemption ----

def wait_for_step(proc, step):
    for line in proc.stdout:
        if line.startswith(f"step {step:4d}/"):
            return
    raise AssertionError("the run ended before step %d" % step)


def finish(proc, timeout):
    """The rest of stdout after wait_for_step, and stderr, once the run ends. Read through the same
    buffered pipe objects: communicate() reads the raw descriptors and would lose the lines the
    iteration above has already buffered. The run writes a few lines after the signal, far less than
    a pipe holds, so waiting first cannot block it."""
    proc.wait(timeout=timeout)
    return proc.stdout.read(), proc.stderr.read()


PREEMPT_STEPS = "2000"  # long enough (seconds) that the signal lands before the end


def preempt_args(out):
    return [str(binary("train_gpt_cpu")), *MODEL, "-i", "SHARD", "-j", "", "-b", "2", "-t", "8", "-s", "0", "-l", "1e-3",
            "--shuffle", "1", "-x", PREEMPT_STEPS, "-n", "0", "-o", str(out)]


@pytest.fixture(scope="module")
def uninterrupted(shard, tmp_path_factory):
    args = [a if a != "SHARD" else str(shard) for a in preempt_args(tmp_path_factory.mktemp("uninterrupted"))]
    return steps(run(args, env=ONE_THREAD, check=True).stdout)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_checkpoints_and_the_resumed_run_joins_exactly(shard, uninterrupted, tmp_path, sig):
    args = [a if a != "SHARD" else str(shard) for a in preempt_args(tmp_path)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_step(proc, 5)
    proc.send_signal(sig)
    out, err = finish(proc, 120)
    assert proc.returncode == 75, (proc.returncode, err)
    m = re.search(r"stopped by (SIG\w+) after step (\d+): checkpoint written, resume with -y 1", out)
    assert m and m.group(1) == sig.name, out
    stop = int(m.group(2))
    assert stop < int(PREEMPT_STEPS) and (tmp_path / f"DONE_{stop:08d}").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"DONE_{stop:08d}", "log.jsonl", f"model_{stop:08d}.bin",
                                                         f"state_{stop:08d}_00000.bin"]
    resumed = run([*args, "-y", "1"], env=ONE_THREAD, check=True)
    before = [s for s in uninterrupted if int(s[0]) <= stop]
    assert steps(out) == before[5:]  # steps 6..stop, after the lines read above; the last one is the step saved
    assert before + steps(resumed.stdout) == uninterrupted


def test_second_signal_exits_at_once(tmp_path):
    """A step of this model takes far longer than the gap between the two
    signals, so the second one lands inside the same step."""
    datafile.write_shard(tmp_path / "big.bin", np.random.default_rng(6).integers(0, 64, 20000))
    proc = subprocess.Popen([str(binary("train_gpt_cpu")), "-e", "d6", "--channels", "384", "--vocab-size", "64", "--max-seq-len", "64",
                             "-i", str(tmp_path / "big.bin"), "-j", "", "-b", "16", "-t", "64", "-s", "0", "-x", "100",
                             "-o", str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_step(proc, 1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = finish(proc, 60)
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - t0 < 5, (proc.returncode, out[-500:])
    assert "stopped by" not in out and not list((tmp_path / "out").glob("DONE_*"))


# ---- a binary without MPI under a launcher ----

@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"])
def test_binary_without_mpi_refuses_a_multi_process_launch(shard, var):
    res = trainer(shard, "-x", "1", exe="build/train_gpt_cpu_asan", env={var: "2"})  # the sanitizer build has no MPI
    line = one_error(res)
    assert line.startswith(f"error: {var}=2: started as one of several processes") and "without MPI" in line, line
    assert trainer(shard, "-x", "1", exe="build/train_gpt_cpu_asan", env={var: "1"}).returncode == 0


def test_make_rebuilds_the_trainer_when_mpi_appears_or_disappears():
    """`make -q` (question mode) says whether a target is up to date; the
    trainer was just built by make test-bins with this machine's MPI setting."""
    here = subprocess.run(["make", "-q", "train_gpt_cpu"], cwd=REPO, capture_output=True)
    other = "NO_USE_MPI=1" if shutil.which("mpicc") else "MPICC=/usr/bin/mpicc"
    flipped = subprocess.run(["make", "-q", "train_gpt_cpu", other], cwd=REPO, capture_output=True)
    assert here.returncode == 0 and flipped.returncode == 1, (here, flipped)
