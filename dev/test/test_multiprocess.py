"""Data-parallel training of the CPU reference under OpenMPI: N processes with
batch B train exactly like one process with batch N*B; ZeRO-1 like ZeRO-0;
resume is bitwise identical; an error on one rank stops all of them."""
import json
import os
import re
import shutil
import struct
import time

import numpy as np
import pytest

from conftest import binary, datafile, run

if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)", allow_module_level=True)

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
MODEL = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--max-seq-len", "32"]
STEP_RE = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr \S+ \| norm ([0-9.]+)", re.M)


def train(np_, data, *flags, check=True, timeout=300):
    out, meta = data
    args = ["mpirun", "-np", str(np_), str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]),
            "-i", out / "synthetic_train.bin", "-j", out / "synthetic_val.bin", "-t", "32", "-s", "0", "-l", "2e-3",
            "-c", "0.1", *flags]
    return run(args, env=MPI_ENV, check=check, timeout=timeout)


def losses(stdout):
    return [(int(m.group(1)), float(m.group(2))) for m in STEP_RE.finditer(stdout)]


def val_losses(stdout):
    return [float(v) for v in re.findall(r"val loss ([0-9.]+)", stdout)]


def assert_close(a, b, rel=1e-5):
    assert len(a) == len(b) and len(a) > 0
    for (sa, la), (sb, lb) in zip(a, b):
        assert sa == sb and abs(la - lb) <= rel * abs(lb), (a, b)


def test_two_ranks_match_one_rank_with_twice_the_batch(synthetic):
    one = train(1, synthetic, "-b", "4", "-x", "10", "-v", "5")
    two = train(2, synthetic, "-b", "2", "-x", "10", "-v", "5")
    assert "x 2 processes" in two.stdout
    assert_close(losses(two.stdout), losses(one.stdout))
    assert len(val_losses(one.stdout)) == 3  # at steps 0, 5 and 10
    assert np.allclose(val_losses(two.stdout), val_losses(one.stdout), rtol=1e-5)


def test_two_ranks_with_gradient_accumulation(synthetic):
    one = train(1, synthetic, "-b", "2", "-d", "256", "-x", "10", "-v", "0")
    two = train(2, synthetic, "-b", "1", "-d", "256", "-x", "10", "-v", "0")
    assert "gradient accumulation 4" in two.stdout
    assert_close(losses(two.stdout), losses(one.stdout))


def test_zero1_matches_zero0(synthetic, tmp_path):
    """ZeRO-1 trains bitwise like ZeRO-0: with 2 ranks each summed gradient is
    a + b either way, every shard runs the same AdamW arithmetic, and the norm
    differs only in how a double sum of squares is grouped before it is
    rounded to float. So the step lines and the final model file are equal,
    not merely close (a wrong shard, weight decay or bias correction on one
    rank would move them)."""
    z0 = train(2, synthetic, "-b", "2", "-x", "10", "-v", "0", "-z", "0", "-o", tmp_path / "z0")
    z1 = train(2, synthetic, "-b", "2", "-x", "10", "-v", "0", "-z", "1", "-o", tmp_path / "z1")
    opt = lambda s: float(re.search(r"optimizer state +([0-9.]+) MiB", s).group(1))
    assert opt(z1.stdout) < opt(z0.stdout)
    assert len(STEP_RE.findall(z0.stdout)) == 10
    assert STEP_RE.findall(z1.stdout) == STEP_RE.findall(z0.stdout)
    model = "model_00000010.bin"
    without_run_id = lambda data: data[:4 * 240] + data[4 * 242:]  # header slots 240-241: each run's own id
    assert without_run_id((tmp_path / "z1" / model).read_bytes()) == without_run_id((tmp_path / "z0" / model).read_bytes())


@pytest.mark.parametrize("zero", ["0", "1"])
def test_two_rank_resume_is_bitwise_identical(synthetic, tmp_path, zero):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["-b", "2", "-x", "8", "-n", "4", "-v", "0", "-z", zero, "--shuffle", "1"]
    ref = train(2, synthetic, *common, "-o", full)
    part.mkdir()
    for name in ["model_00000004.bin", "state_00000004_00000.bin", "state_00000004_00001.bin", "DONE_00000004"]:
        shutil.copy(full / name, part / name)
    resumed = train(2, synthetic, *common, "-o", part, "-y", "1")
    assert [s for s in STEP_RE.findall(resumed.stdout)] == [s for s in STEP_RE.findall(ref.stdout)][4:]
    for name in ["model_00000008.bin", "state_00000008_00000.bin", "state_00000008_00001.bin"]:
        assert (part / name).read_bytes() == (full / name).read_bytes(), name


def test_resume_with_another_world_size_is_refused(synthetic, tmp_path):
    train(2, synthetic, "-b", "2", "-x", "2", "-v", "0", "-o", tmp_path)
    res = train(1, synthetic, "-b", "2", "-x", "4", "-v", "0", "-o", tmp_path, "-y", "1", check=False)
    assert res.returncode != 0
    assert "written by 2 processes; resume needs the same number (this run has 1)" in res.stderr


def test_bad_shard_on_one_rank_stops_every_rank(synthetic, tmp_path):
    out, meta = synthetic
    good = datafile.read_shard(out / "synthetic_train.bin")[:5000]
    bad = good.copy()
    bad[100] = meta["vocab_size"]  # out of range: found by rank 1, which scans shard 1
    datafile.write_shard(tmp_path / "s_000000.bin", good)
    datafile.write_shard(tmp_path / "s_000001.bin", bad)
    t0 = time.time()
    res = run(["mpirun", "-np", "2", str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]),
               "-i", tmp_path / "s_*.bin", "-j", "", "-b", "2", "-t", "32", "-x", "5", "-s", "0"],
              env=MPI_ENV, timeout=120)
    assert res.returncode != 0
    assert time.time() - t0 < 30
    assert "error: rank 1: " in res.stderr and "s_000001.bin" in res.stderr and "out of range" in res.stderr


def test_nan_stops_every_rank(synthetic, tmp_path):
    out, meta = synthetic
    train(1, synthetic, "-b", "2", "-x", "1", "-v", "0", "-o", tmp_path / "ck")
    model = bytearray((tmp_path / "ck" / "model_00000001.bin").read_bytes())
    model[1024 + 4 * 5:1024 + 4 * 6] = struct.pack("<f", 3.0e38)  # finite (a NaN is refused at load): overflows the forward pass
    (tmp_path / "nan.bin").write_bytes(bytes(model))
    t0 = time.time()
    res = run(["mpirun", "-np", "2", str(binary("train_gpt_cpu")), "-e", tmp_path / "nan.bin", "-i",
               out / "synthetic_train.bin", "-j", "", "-b", "2", "-t", "32", "-x", "3", "-s", "0"],
              env=MPI_ENV, timeout=120)
    assert res.returncode != 0 and time.time() - t0 < 30
    assert "training diverged" in res.stderr and "error: rank " in res.stderr


@pytest.mark.parametrize("zero", ["0", "1"])
def test_plan_of_two_processes_matches_plan_processes(synthetic, zero):
    """What two running processes plan is what --plan-processes 2 predicts
    from one."""
    import json
    out, meta = synthetic
    args = [str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]), "-b", "2", "-t", "32",
            "-z", zero, "--mem-budget", "1GiB", "--plan-json"]
    two = json.loads(run(["mpirun", "-np", "2", *args], env=MPI_ENV, check=True).stdout)
    one = json.loads(run([*args, "--plan-processes", "2"], check=True).stdout)
    assert two["world_size"] == 2 and two == one


def mpmd(data, per_rank, common=(), wdirs=None, timeout=120):
    """mpirun with one app context per rank: rank r gets common + per_rank[r]."""
    out, meta = data
    args = ["mpirun"]
    for r, extra in enumerate(per_rank):
        if r:
            args.append(":")
        args += ["-np", "1", *(["-wdir", wdirs[r]] if wdirs else []), str(binary("train_gpt_cpu")), *MODEL,
                 "--vocab-size", str(meta["vocab_size"]), "-t", "32", "-s", "0", "-j", "", *common, *extra]
    return run(args, env=MPI_ENV, timeout=timeout)


@pytest.mark.parametrize("flag, a, b", [("-b", "2", "4"), ("-x", "3", "4"), ("--seed", "1", "2"), ("-l", "1e-3", "2e-3"),
                                          ("--collective-timeout", "0", "5")])
def test_ranks_with_different_flags_are_refused(synthetic, flag, a, b):
    out, _ = synthetic
    common = ["-i", out / "synthetic_train.bin", "-b", "2", "-x", "3"]
    t0 = time.time()
    res = mpmd(synthetic, [[flag, a], [flag, b]], common)
    assert res.returncode != 0 and time.time() - t0 < 60
    assert f"error: rank 0: flag {flag} differs between the processes of this run" in res.stderr, res.stderr
    assert "step " not in res.stdout


def test_ranks_with_different_data_are_refused(synthetic, tmp_path):
    """The same -i on both ranks, but it names different files (one working
    directory each): with -x -1 they would disagree on the number of steps
    and hang in a collective."""
    out, _ = synthetic
    tokens = datafile.read_shard(out / "synthetic_train.bin")
    for r, n in enumerate([6000, 9000]):
        (tmp_path / str(r)).mkdir()
        datafile.write_shard(tmp_path / str(r) / "train.bin", tokens[:n])
    res = mpmd(synthetic, [[], []], ["-i", "train.bin", "-b", "2", "-x", "-1"], wdirs=[tmp_path / "0", tmp_path / "1"])
    assert res.returncode != 0
    assert "error: rank 0: -i (the token counts of the training shards) differs between the processes" in res.stderr, res.stderr


def test_signal_stops_every_rank_after_the_same_step(synthetic, tmp_path):
    import signal
    import subprocess
    out, meta = synthetic
    args = ["mpirun", "-np", "2", str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]), "-i",
            str(out / "synthetic_train.bin"), "-j", "", "-b", "2", "-t", "32", "-s", "0", "-x", "100000", "-o", str(tmp_path)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **MPI_ENV})
    for line in proc.stdout:
        if line.startswith("step    3/"):
            break
    # mpirun forwards SIGUSR1 to both ranks (on SIGTERM it would end them itself, checkpoint or not)
    proc.send_signal(signal.SIGUSR1)
    out_text, err = proc.communicate(timeout=120)
    m = re.search(r"stopped by SIGUSR1 after step (\d+)", out_text)
    assert m, (out_text[-1000:], err)
    step = int(m.group(1))
    assert (tmp_path / f"DONE_{step:08d}").exists()
    assert (tmp_path / f"state_{step:08d}_00000.bin").exists() and (tmp_path / f"state_{step:08d}_00001.bin").exists()
    assert proc.returncode != 0 and "Exit code:    75" in err, err  # each rank exits 75, and mpirun says so


def rank_pids(mpirun_pid, n):
    """The rank processes among mpirun's children, by MPI rank."""
    pids = {}
    for _ in range(1000):
        if len(pids) == n:
            break
        children = []
        for task in os.listdir(f"/proc/{mpirun_pid}/task"):
            children += open(f"/proc/{mpirun_pid}/task/{task}/children").read().split()
        for c in children:
            env = open(f"/proc/{c}/environ", "rb").read().split(b"\0")
            rank = [e for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
            if "train_gpt_cpu" in open(f"/proc/{c}/cmdline").read() and rank:
                pids[int(rank[0].split(b"=")[1])] = int(c)
    return pids


# Seconds allowed past the 2 s timeout for the waiting ranks to notice, print
# and for mpirun to take the job down: generous, as a loaded 2-core CI machine
# can take several seconds to tear the job down; a hang is what the test is
# for, and it shows as the full wait_s.
STOP_SLACK_S = 20


def stuck_job(np_, data, stop_rank=None, env=None, flags=("--collective-timeout", "2"), wait_s=60):
    """Trains on np_ ranks until they are stuck: rank stop_rank is stopped
    (SIGSTOP) once step 2 is printed, or REMAT_TEST_STALL in env stops one.
    Returns (exit status, stderr, seconds from the stop to the end); after
    wait_s the job is killed (exit status None)."""
    import signal
    import subprocess
    import threading
    out, meta = data
    args = ["mpirun", "-np", str(np_), str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]), "-i",
            str(out / "synthetic_train.bin"), "-j", "", "-b", "2", "-t", "32", "-s", "0", "-x", "100000", *flags]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **MPI_ENV, **(env or {})})
    pids = {}
    guard = threading.Timer(wait_s + 30, proc.kill)  # a job that never reaches step 2 must not hang the test
    guard.start()
    try:
        for line in proc.stdout:
            if line.startswith("step    2/"):
                break
        pids = rank_pids(proc.pid, np_)
        if stop_rank is not None:
            os.kill(pids[stop_rank], signal.SIGSTOP)
        t0 = time.time()
        try:
            _, err = proc.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None, "", time.time() - t0
        return proc.returncode, err, time.time() - t0
    finally:
        guard.cancel()
        proc.kill()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("stop_rank", [1, 0])
def test_collective_timeout_names_the_stopped_rank(synthetic, stop_rank):
    """A rank stopped at any point (SIGSTOP from outside, mpirun's children):
    the other stops the job within a few seconds of the timeout and names it,
    whether the stop caught it between collectives (the message says where it
    was last seen) or inside one (two ranks: the only other)."""
    code, err, seconds = stuck_job(2, synthetic, stop_rank=stop_rank)
    waiter = 1 - stop_rank
    assert code != 0 and seconds < 2 + STOP_SLACK_S, (code, seconds, err)
    assert re.search(rf"^error: rank {waiter}: waited more than 2 s in the [a-z -]+ \((step \d+|setup)\) for rank {stop_rank}"
                     rf"( \(last seen at [^)]*\)|, which arrived at it but did not finish it): .*\(--collective-timeout\)$",
                     err, re.M), err
    assert f"error: rank {stop_rank}: waited" not in err, err  # resumed to be killed, it does not blame the other


def test_collective_timeout_names_a_stalled_rank_and_where_it_was(synthetic):
    """Three ranks, rank 2 stops itself as step 3 begins (REMAT_TEST_STALL):
    the others wait in step 3's first collective and name rank 2, last seen at
    step 2's last one. The first rank to time out aborts the job, and
    mpirun's abort resumes every process (SIGCONT) before it kills them: rank
    2 may then arrive, and a waiter whose deadline falls just after the abort
    says, truly, that it timed out inside the all-reduce. Every line is one of
    the two, and at least one names rank 2."""
    code, err, seconds = stuck_job(3, synthetic, env={"REMAT_TEST_STALL": "2:3"})
    assert code != 0 and seconds < 2 + STOP_SLACK_S, (code, seconds, err)
    lines = [ln for ln in err.splitlines() if "waited more than" in ln]
    named = r"for rank 2 \(last seen at the stop-signal vote, step 2\): it is stuck, stopped or gone"
    inside = r"for one of the other 2 ranks, which all arrived at it: one stopped inside it or the network failed"
    for ln in lines:
        assert re.fullmatch(rf"error: rank [01]: waited more than 2 s in the gradient all-reduce \(step 3\) "
                            rf"(?:{named}|{inside}); stopping the job \(--collective-timeout\)", ln), ln
    assert any(re.search(named, ln) for ln in lines), err


@pytest.fixture(scope="module")
def proc_timeout_exe():
    from conftest import BUILD, REPO
    BUILD.mkdir(exist_ok=True)
    exe = BUILD / "test_proc_timeout"
    run(["mpicc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-DUSE_MPI", "-I", REPO, "-o", exe,
         REPO / "dev/test/test_proc_timeout.c", "-lm"], check=True, timeout=120)
    return exe


@pytest.mark.parametrize("mode, np_, line", [
    ("missing", 3, "error: rank 0: waited more than 1 s in the second sum (step 4) for ranks 1, 2 (rank 1 last seen at the "
                   "first sum, step 4): they are stuck, stopped or gone; stopping the job (--collective-timeout)"),
    ("inside", 3, "error: rank [01]: waited more than 1 s in the second sum \\(step 4\\) for one of the other 2 ranks, which all "
                  "arrived at it: one stopped inside it or the network failed; stopping the job \\(--collective-timeout\\)"),
    ("diverge", 2, "error: rank ([01]): the ranks run different collectives: rank \\1 is in (a sum|a barrier) \\(step 4\\), rank [01] "
                   "in (a barrier|a sum) \\(step 4\\) \\(collective #2\\); stopping the job \\(--collective-timeout\\)")])
def test_collective_timeout_messages(proc_timeout_exe, mode, np_, line):
    """The cases the trainers never produce by themselves: several ranks
    missing, a rank that arrived and stopped inside (three ranks: not
    nameable), ranks in different collectives (#1 is the first sum)."""
    t0 = time.time()
    res = run(["mpirun", "-np", str(np_), proc_timeout_exe, mode], env=MPI_ENV, timeout=60)
    assert res.returncode != 0 and time.time() - t0 < 15, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    pattern = re.escape(line) if mode == "missing" else line
    assert errors and all(re.fullmatch(pattern, ln) for ln in errors), res.stderr


def test_without_collective_timeout_a_stalled_rank_still_blocks_the_others(synthetic):
    """The flag is off by default: the plain blocking collectives wait on."""
    code, err, seconds = stuck_job(2, synthetic, env={"REMAT_TEST_STALL": "1:3"}, flags=(), wait_s=4)
    assert code is None and seconds >= 4, (code, err)


@pytest.mark.parametrize("zero", ["0", "1"])
def test_collective_timeout_on_leaves_the_results_bitwise_equal(synthetic, tmp_path, zero):
    """With every rank healthy the timed (nonblocking) collectives give the
    blocking ones' results: log.jsonl's losses, norms and validation losses
    (printed to 9 digits) are identical."""
    logs = []
    for name, extra in [("off", []), ("on", ["--collective-timeout", "30"])]:
        train(2, synthetic, "-b", "2", "-x", "6", "-v", "3", "-z", zero, "-o", tmp_path / name, *extra)
        rows = [json.loads(ln) for ln in (tmp_path / name / "log.jsonl").read_text().splitlines()]
        logs.append([{k: r[k] for k in ("step", "loss", "norm", "val_loss") if k in r} for r in rows])
    assert len([r for r in logs[0] if "loss" in r]) == 6 and logs[0] == logs[1]
