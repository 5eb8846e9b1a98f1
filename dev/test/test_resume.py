"""Resume, retention and the lock on -o (issue 33): retention never counts
a damaged checkpoint among those it keeps; a second job on an -o in use is
refused, and a killed job's lock goes with it; a state file that disagrees
with its name, its DONE marker or the other ranks' files is damage, and -y 1
falls back past it as past a truncated file."""
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import ONE_THREAD, REPO, TINY_MODEL, binary, datafile, one_error, steps, tiny_trainer

HEADER_SLOTS = 256
ST_STEP, ST_RANK, ST_EPOCH, ST_BATCH_POS_LO, ST_LOSS_SCALE_BITS, ST_UPDATES = 2, 4, 9, 11, 17, 21


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    datafile.write_shard(d / "train.bin", np.random.default_rng(33).integers(0, 64, 20000))
    return d


def trainer(data, *extra, **kw):
    return tiny_trainer(data / "train.bin", *extra, **kw)


def set_slot(path, slot, value):
    h = np.fromfile(path, dtype=np.int32, count=HEADER_SLOTS)
    h[slot] = value
    with open(path, "r+b") as f:
        f.write(h.tobytes())


def whole_steps(d):
    """Steps whose DONE marker, model file and state file all exist."""
    return sorted(int(p.name[5:]) for p in d.glob("DONE_*")
                  if (d / f"model_{p.name[5:]}.bin").exists() and (d / f"state_{p.name[5:]}_00000.bin").exists())


# ---- retention and damage (finding 1) ----

@pytest.mark.parametrize("damage", ["truncate state", "remove model"])
def test_retention_keeps_the_last_whole_checkpoints_not_a_damaged_newer_one(data, tmp_path, damage):
    """The damaged newest checkpoint is not one of the -nk kept: after a
    resume that fell back past it, the last -nk whole ones stay, and the next
    -y 1 resumes from the newest of them."""
    trainer(data, "-x", "6", "-n", "2", "-o", tmp_path, check=True)
    if damage == "truncate state":
        victim = tmp_path / "state_00000006_00000.bin"
        victim.write_bytes(victim.read_bytes()[:3000])
    else:
        (tmp_path / "model_00000006.bin").unlink()
    res = trainer(data, "-x", "5", "-n", "1", "-nk", "2", "-y", "1", "-o", tmp_path, check=True)
    assert "resumed: step 4" in res.stdout
    assert whole_steps(tmp_path) == [4, 5], sorted(p.name for p in tmp_path.iterdir())
    again = trainer(data, "-x", "7", "-n", "1", "-nk", "1", "-y", "1", "-o", tmp_path, check=True)
    assert "resumed: step 5" in again.stdout
    assert whole_steps(tmp_path) == [7]


def test_retention_with_keep_one_leaves_a_whole_checkpoint(data, tmp_path):
    """-nk 1 after a fall-back: the run's own newest checkpoint is the one kept."""
    trainer(data, "-x", "8", "-n", "4", "-o", tmp_path, check=True)
    victim = tmp_path / "model_00000008.bin"
    victim.write_bytes(victim.read_bytes()[:2000])
    trainer(data, "-x", "6", "-n", "1", "-nk", "1", "-y", "1", "-o", tmp_path, check=True)
    assert 6 in whole_steps(tmp_path)
    res = trainer(data, "-x", "7", "-y", "1", "-o", tmp_path, check=True)
    assert "resumed: step 6" in res.stdout


def test_a_step_written_again_over_a_damaged_one_is_not_mixed(data, tmp_path):
    """Falling back from damaged step 4 to 2, the run writes step 4 again:
    the stale marker goes first, so what -y 1 finds at step 4 afterwards is
    the new run's whole checkpoint, bitwise the uninterrupted run's."""
    trainer(data, "-x", "4", "-n", "2", "-o", tmp_path / "ref", check=True)
    trainer(data, "-x", "4", "-n", "2", "-o", tmp_path / "a", check=True)
    victim = tmp_path / "a" / "state_00000004_00000.bin"
    victim.write_bytes(victim.read_bytes()[:1500])
    res = trainer(data, "-x", "3", "-n", "1", "-y", "1", "-o", tmp_path / "a", check=True)
    assert "resumed: step 2" in res.stdout
    assert not (tmp_path / "a" / "DONE_00000004").exists()  # not whole, so not marked
    trainer(data, "-x", "4", "-n", "2", "-y", "1", "-o", tmp_path / "a", check=True)
    for name, id_slot in [("model_00000004.bin", 240), ("state_00000004_00000.bin", 22)]:
        a, ref = (tmp_path / "a" / name).read_bytes(), (tmp_path / "ref" / name).read_bytes()
        assert without_slots(a, id_slot) == without_slots(ref, id_slot), name  # the run ids differ, nothing else


def without_slots(data, slot, n=2):
    return data[:4 * slot] + data[4 * (slot + n):]


# ---- one job per -o (finding 2) ----

def start_long_run(data, out, *extra):
    args = [binary("train_gpt_cpu"), *TINY_MODEL, "-i", data / "train.bin", "-j", "", "-b", "2", "-t", "8", "-s", "0",
            "-l", "1e-3", "-x", "1000000", "-n", "50", "-o", out, *extra]
    proc = subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **ONE_THREAD})
    for line in proc.stdout:  # until a checkpoint is written: the run is in its loop
        if line.startswith("checkpoint: step"):
            return proc
    raise AssertionError(proc.stderr.read())


@pytest.mark.parametrize("second", [["-y", "1", "--resume-override"], ["--supersede"], ["-y", "1", "--plan"]])
def test_a_second_job_on_an_output_in_use_is_refused(data, tmp_path, second):
    first = start_long_run(data, tmp_path)
    try:
        res = trainer(data, "-x", "3", "-o", tmp_path, *second)
        if "--plan" in second:  # a plan writes nothing: no lock needed
            assert res.returncode == 0, res.stderr
        else:
            line = one_error(res)
            assert f"-o {tmp_path} is in use by another job" in line, line
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()


def test_a_killed_job_does_not_leave_the_output_locked(data, tmp_path):
    first = start_long_run(data, tmp_path)
    first.send_signal(signal.SIGKILL)
    first.wait()
    res = trainer(data, "-x", "60", "-y", "1", "-o", tmp_path, check=True)
    assert "resumed: step" in res.stdout


def test_two_jobs_started_together_one_refused(data, tmp_path):
    """Neither has created -o yet when both start: one trains, one is refused."""
    args = [binary("train_gpt_cpu"), *TINY_MODEL, "-i", data / "train.bin", "-j", "", "-b", "2", "-t", "8", "-s", "0",
            "-x", "300", "-n", "100", "-o", tmp_path / "new", "-y", "1"]
    procs = [subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, **ONE_THREAD}) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    refused = [err for p, (out, err) in zip(procs, outs) if p.returncode != 0]
    assert codes in ([0, 0], [0, 1]), (codes, outs)
    for err in refused:
        assert "is in use by another job" in err, err
    if codes == [0, 0]:  # one ended before the other took the lock: the later one resumed it, never both fresh
        assert sum("resumed: step 300" in out for out, _ in outs) == 1, outs


# ---- a state file against its name, its marker and the other ranks (findings 3 and 4) ----

@pytest.mark.parametrize("slot,value,why", [(ST_STEP, 5, "its name says"), (ST_STEP, 3, "its name says"),
                                            (ST_RANK, 1, "out of range")])
def test_state_header_disagreeing_with_its_name_is_damage(data, tmp_path, slot, value, why):
    trainer(data, "-x", "4", "-n", "2", "-o", tmp_path / "ref", check=True)
    shutil.copytree(tmp_path / "ref", tmp_path / "a")
    set_slot(tmp_path / "a" / "state_00000004_00000.bin", slot, value)
    res = trainer(data, "-x", "6", "-n", "2", "-y", "1", "-o", tmp_path / "a", check=True)
    assert "resume: checkpoint of step 4 is damaged" in res.stdout and "resumed: step 2" in res.stdout, res.stdout
    assert why in res.stdout, res.stdout
    ref = trainer(data, "-x", "6", "-n", "2", "-o", tmp_path / "ref2", check=True)
    assert steps(res.stdout) == steps(ref.stdout)[2:]


def test_state_of_another_run_than_its_marker_is_damage(data, tmp_path):
    """The state of step 4 from another run (same flags, another id): the
    checkpoint is damaged, the earlier one of this run is resumed."""
    trainer(data, "-x", "4", "-n", "2", "-o", tmp_path / "a", check=True)
    trainer(data, "-x", "4", "-n", "2", "-o", tmp_path / "b", check=True)
    shutil.copy(tmp_path / "b" / "state_00000004_00000.bin", tmp_path / "a" / "state_00000004_00000.bin")
    res = trainer(data, "-x", "5", "-y", "1", "-o", tmp_path / "a", check=True)
    assert "resume: checkpoint of step 4 is damaged" in res.stdout and "mixes two runs" in res.stdout, res.stdout
    assert "resumed: step 2" in res.stdout


# ---- the same under mpirun: each rank's state against the others' ----

def mpi_train(*args, **kw):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)")
    from test_multiprocess import train
    return train(*args, **kw)


@pytest.fixture(scope="module")
def two_rank_run(synthetic, tmp_path_factory):
    """A 2-process run (ZeRO-1, so the ranks' shards differ) to step 6,
    checkpoints at 2, 4 and 6."""
    d = tmp_path_factory.mktemp("two_rank")
    res = mpi_train(2, synthetic, "-b", "1", "-x", "6", "-n", "2", "-v", "0", "-z", "1", "-o", d / "full")
    return d / "full", steps(res.stdout)


@pytest.mark.parametrize("rank,slot,value", [(1, ST_STEP, 5), (0, ST_STEP, 3), (1, ST_RANK, 0), (1, ST_EPOCH, 1),
                                             (0, ST_BATCH_POS_LO, 1), (1, ST_UPDATES, 3), (1, ST_LOSS_SCALE_BITS, 0x40000000)])
def test_a_rank_state_that_disagrees_is_damage(synthetic, tmp_path, two_rank_run, rank, slot, value):
    """One rank's state of step 4 edited: -y 1 says which file and field,
    falls back to step 2 and continues as the run that never stopped (no
    hang, no other loss)."""
    full, ref_steps = two_rank_run
    part = tmp_path / "part"
    part.mkdir()
    for p in full.iterdir():
        if "00000006" not in p.name and p.name != "log.jsonl":
            shutil.copy(p, part / p.name)
    victim = part / f"state_00000004_{rank:05d}.bin"
    set_slot(victim, slot, value)
    res = mpi_train(2, synthetic, "-b", "1", "-x", "6", "-n", "2", "-v", "0", "-z", "1", "-o", part, "-y", "1", timeout=120)
    line = next(l for l in res.stdout.splitlines() if l.startswith("resume: checkpoint of step 4 is damaged ("))
    assert victim.name in line, line
    assert "resumed: step 2" in res.stdout
    assert steps(res.stdout) == ref_steps[2:]


# ---- dropout masks keyed by the global sequence (finding 5) ----

def close_losses(a, b, rel=1e-5):
    assert len(a) == len(b) and len(a) > 0, (a, b)
    for (sa, la, *_), (sb, lb, *_) in zip(a, b):
        assert sa == sb and abs(float(la) - float(lb)) <= rel * abs(float(lb)), (a, b)


@pytest.mark.parametrize("before,after", [(["--context-parallel", "2", "-b", "2"], ["-b", "1"]),
                                          (["-b", "1"], ["--context-parallel", "2", "-b", "2"])])
def test_resume_across_layouts_with_dropout_draws_the_same_masks(synthetic, tmp_path, before, after):
    """Two processes with dropout at every site: a run checkpointed under
    one layout (context parallelism, or two data-parallel ranks) resumes
    under the other within the layouts' 1e-5 (docs/context-parallel.md) of
    the run that never stopped: each sequence's masks are its own, whichever
    rank holds it."""
    common = ["-x", "6", "-n", "3", "-v", "0", "--dropout", "0.2"]
    full = mpi_train(2, synthetic, *common, *before, "-o", tmp_path / "full")
    part = tmp_path / "part"
    part.mkdir()
    for p in (tmp_path / "full").iterdir():
        if "00000003" in p.name:
            shutil.copy(p, part / p.name)
    resumed = mpi_train(2, synthetic, *common, *after, "-o", part, "-y", "1")
    assert "resumed: step 3" in resumed.stdout
    close_losses(steps(resumed.stdout), steps(full.stdout)[3:])


def test_retention_under_context_parallelism_keeps_whole_checkpoints(synthetic, tmp_path):
    """The same under --context-parallel 2: rank 1's state of the newest
    checkpoint truncated; -nk 1 after the fall-back keeps the run's own newest."""
    common = ["-b", "1", "-v", "0", "--context-parallel", "2"]
    mpi_train(2, synthetic, *common, "-x", "6", "-n", "3", "-o", tmp_path)
    victim = tmp_path / "state_00000006_00001.bin"
    victim.write_bytes(victim.read_bytes()[:4000])
    res = mpi_train(2, synthetic, *common, "-x", "5", "-n", "1", "-nk", "1", "-o", tmp_path, "-y", "1")
    assert "resumed: step 3" in res.stdout
    again = mpi_train(2, synthetic, *common, "-x", "6", "-o", tmp_path, "-y", "1")
    assert "resumed: step 5" in again.stdout


def test_a_job_of_two_ranks_on_an_output_in_use_is_refused(data, synthetic, tmp_path):
    """Rank 0 takes the lock for the job: a two-process job on an -o that a
    running job holds stops before it writes anything."""
    first = start_long_run(data, tmp_path)
    try:
        before = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("log"))
        res = mpi_train(2, synthetic, "-b", "1", "-v", "0", "-x", "2", "-o", tmp_path, "--supersede", check=False, timeout=120)
        assert res.returncode != 0 and f"-o {tmp_path} is in use by another job" in res.stderr, res.stderr
        assert first.poll() is None
        after = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("log"))
        assert set(before) <= set(after)  # nothing of the first job's removed
    finally:
        first.kill()
        first.wait()
