"""Resuming a run (-y 1): that it continues bit for bit (with dropout too), what it falls back past, what it refuses and what
it keeps. Retention never counts a damaged checkpoint among those it keeps;
a second job on an -o in use is refused, and a killed job's lock goes with
it; a state file that disagrees with its name, its DONE marker or the other
ranks' files is damage, and -y 1 falls back past it as past a truncated
file; a resume on other data, another schedule, other dropout or model flags
is refused or named; an old state version still resumes; a resumed run
writes each log line once."""
import json
import os
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest

from conftest import (ONE_THREAD, REPO, STEP_RE, TINY_MODEL, TINY_MODEL as MODEL, TINY_RUN_MODEL, binary, copy_checkpoint, datafile,
                      log_lines, one_error, run, snapshot, steps, tiny_run, tiny_trainer)

HEADER_SLOTS = 256
ST_STEP, ST_RANK, ST_EPOCH, ST_BATCH_POS_LO, ST_LOSS_SCALE_BITS, ST_UPDATES = 2, 4, 9, 11, 17, 21


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    rng = np.random.default_rng(33)
    datafile.write_shard(d / "train.bin", rng.integers(0, 64, 20000))
    datafile.write_shard(d / "other.bin", rng.integers(0, 64, 24000))
    datafile.write_shard(d / "val.bin", rng.integers(0, 64, 2000))
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


@pytest.mark.parametrize("rank,slot,value,named", [(1, ST_STEP, 5, None), (0, ST_STEP, 3, None), (1, ST_RANK, 0, None),
                                                   (1, ST_EPOCH, 1, None), (0, ST_BATCH_POS_LO, 1, None), (1, ST_UPDATES, 3, None),
                                                   (1, ST_LOSS_SCALE_BITS, 0x40000000, None), (1, 42, 7, "its hyperparameter (header slot 42: 7)"),
                                                   (1, 250, 1, "its unused slot (header slot 250: 1)")])
def test_a_rank_state_that_disagrees_is_damage(synthetic, tmp_path, two_rank_run, rank, slot, value, named):
    """One rank's state of step 4 edited: -y 1 says which file and field
    (by what the slot holds), falls back to step 2 and continues as the run
    that never stopped (no hang, no other loss)."""
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
    assert victim.name in line and (named is None or named in line), line
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


# ---- refusals and fallbacks of a single process ----

def test_resume_writes_each_validation_by_position_line_once(data, tmp_path):
    args = ["-n", "2", "-v", "2", "-j", data / "val.bin", "-m", "2", "--eval-by-position", "4", "-o", tmp_path]
    trainer(data, "-x", "4", *args, check=True)
    trainer(data, "-x", "4", "-y", "1", *args, check=True)  # resumes at step 4 and evaluates it again
    trainer(data, "-x", "6", "-y", "1", *args, check=True)
    by_pos = [e["step"] for e in log_lines(tmp_path) if "val_loss_by_position" in e]
    val = [e["step"] for e in log_lines(tmp_path) if "val_loss" in e]
    assert by_pos == val == [0, 2, 4, 6]


def test_resume_names_the_model_flags_it_ignores(data, tmp_path):
    trainer(data, "-x", "2", "-o", tmp_path, check=True)
    res = run([binary("train_gpt_cpu"), "-e", "no/such/model.bin", "--layers", "3", "--max-seq-len", "32", "-i", data / "train.bin",
               "-j", "", "-b", "2", "-t", "8", "-s", "0", "-l", "1e-3", "-x", "3", "-y", "1", "-o", tmp_path], env=ONE_THREAD, check=True)
    assert f"resume: -e, --layers, --max-seq-len ignored: the model (its shape and position table) is the checkpoint's, " \
           f"{tmp_path}/model_00000002.bin" in res.stdout
    assert "resumed: step 2" in res.stdout


def test_resume_on_other_training_data_is_refused_unless_overridden(data, tmp_path):
    trainer(data, "-x", "2", "-o", tmp_path, check=True)
    line = one_error(trainer(data, "-x", "3", "-y", "1", "-o", tmp_path, "-i", data / "other.bin"))
    assert line.startswith(f"error: flag -i: the checkpoint was trained on -i {data / 'train.bin'}, this run gives another -i") \
        and "--resume-override" in line, line
    moved = tmp_path / "moved.bin"
    shutil.copy(data / "train.bin", moved)
    assert "gives another -i" in one_error(trainer(data, "-x", "3", "-y", "1", "-o", tmp_path, "-i", moved))
    datafile.write_shard(moved, np.arange(20002) % 64)  # the same path, other data
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", moved, "-j", "", "-b", "2", "-t", "8", "-s", "0", "-l", "1e-3", "-x", "2",
               "-o", tmp_path / "b"], env=ONE_THREAD, check=True)
    shutil.copy(data / "other.bin", moved)
    line = one_error(run([binary("train_gpt_cpu"), *MODEL, "-i", moved, "-j", "", "-b", "2", "-t", "8", "-s", "0", "-l", "1e-3",
                          "-x", "3", "-y", "1", "-o", tmp_path / "b"], env=ONE_THREAD))
    assert "reads shards of other sizes (the data changed)" in line, line
    ok = trainer(data, "-x", "3", "-y", "1", "-o", tmp_path, "-i", data / "other.bin", "--resume-override", check=True)
    assert "resume: the checkpoint was trained on -i" in ok.stdout and "resumed: step 2" in ok.stdout
    assert res.returncode == 0


@pytest.mark.parametrize("schedule, final, refused", [("cosine", "0.1", True), ("linear", "0.1", True),
                                                      ("cosine", "1", False), ("constant", "0.1", False)])
def test_resume_with_more_steps_is_refused_where_the_schedule_decays_over_them(data, tmp_path, schedule, final, refused):
    hp = ["-k", schedule, "-q", final]
    trainer(data, "-x", "2", "-o", tmp_path, *hp, check=True)
    res = trainer(data, "-x", "4", "-y", "1", "-o", tmp_path, *hp)
    if refused:
        line = one_error(res)
        assert line.startswith("error: flag -x: the checkpoint was trained with -x 2 steps") and "--resume-override" in line, line
        ok = trainer(data, "-x", "4", "-y", "1", "-o", tmp_path, *hp, "--resume-override", check=True)
        assert "resume: -x changed from 2 to 4 (--resume-override)" in ok.stdout
    else:
        assert res.returncode == 0 and "resumed: step 2" in res.stdout, res.stderr


def test_a_version_2_state_still_resumes(data, tmp_path):
    """State version 2 (before the data record and -x): slots 24-27 and
    64-127 zero, 15 hyperparameters (no -x, no --tile-tokens, no document flags). It resumes as the same
    state in version 3 does, and says the data is not compared."""
    trainer(data, "-x", "2", "-o", tmp_path / "v3", check=True)
    shutil.copytree(tmp_path / "v3", tmp_path / "v2")
    state = tmp_path / "v2" / "state_00000002_00000.bin"
    h = np.frombuffer(state.read_bytes()[:1024], dtype=np.int32).copy()
    assert h[1] == 3 and h[32] == 21 and h[32 + 16] == 2  # the version, the count of hyperparameters, -x
    h[1] = 2
    h[24:28] = 0
    h[64:128] = 0
    h[32] = 15
    h[32 + 16:32 + 22] = 0  # -x, --tile-tokens and the four document slots
    state.write_bytes(h.tobytes() + state.read_bytes()[1024:])
    a = trainer(data, "-x", "4", "-y", "1", "-o", tmp_path / "v3", check=True)
    b = trainer(data, "-x", "4", "-y", "1", "-o", tmp_path / "v2", check=True)
    assert "predates the record of the training data" in b.stdout
    assert steps(a.stdout) == steps(b.stdout) and len(steps(a.stdout)) == 2
    assert (tmp_path / "v2" / "model_00000004.bin").read_bytes() == (tmp_path / "v3" / "model_00000004.bin").read_bytes()


def test_changed_dropout_on_resume_names_the_flag_typed(data, tmp_path):
    trainer(data, "-x", "2", "--dropout", "0.1", "-o", tmp_path, check=True)
    line = one_error(trainer(data, "-x", "3", "-y", "1", "--dropout", "0.2", "-o", tmp_path))
    assert line.startswith("error: flag --dropout: the checkpoint was trained with --dropout 0.1, this run gives 0.2"), line
    line = one_error(trainer(data, "-x", "3", "-y", "1", "--attn-dropout", "0.3", "-o", tmp_path))
    assert line.startswith("error: flag --attn-dropout:"), line


@pytest.mark.parametrize("damage", ["model", "state"])
def test_damaged_latest_checkpoint_falls_back_to_the_newest_whole_one(data, tmp_path, damage):
    trainer(data, "-x", "4", "-n", "2", "-o", tmp_path / "a", check=True)
    shutil.copytree(tmp_path / "a", tmp_path / "ref")
    for name in ["DONE_00000004", "model_00000004.bin", "state_00000004_00000.bin"]:
        (tmp_path / "ref" / name).unlink()
    victim = tmp_path / "a" / ("model_00000004.bin" if damage == "model" else "state_00000004_00000.bin")
    victim.write_bytes(victim.read_bytes()[:5000])
    res = trainer(data, "-x", "6", "-n", "2", "-y", "1", "-o", tmp_path / "a", check=True)
    assert f"resume: checkpoint of step 4 is damaged ({victim}: size 5000 bytes does not match its header" in res.stdout
    assert "resume: falling back to step 2, the latest whole checkpoint" in res.stdout and "resumed: step 2" in res.stdout
    ref = trainer(data, "-x", "6", "-n", "2", "-y", "1", "-o", tmp_path / "ref", check=True)
    assert steps(res.stdout) == steps(ref.stdout) and len(steps(ref.stdout)) == 4
    assert (tmp_path / "a" / "model_00000006.bin").read_bytes() == (tmp_path / "ref" / "model_00000006.bin").read_bytes()


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(data, tmp_path):
    trainer(data, "-x", "2", "-o", tmp_path, check=True)
    (tmp_path / "model_00000002.bin").write_bytes(b"")
    before = snapshot(tmp_path)
    line = one_error(trainer(data, "-x", "4", "-y", "1", "-o", tmp_path))
    assert line.startswith(f"error: -y 1: no whole checkpoint in {tmp_path} (the latest, step 2:"), line
    assert snapshot(tmp_path) == before


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(data, tmp_path):
    trainer(data, "-x", "2", "-o", tmp_path, check=True)
    res = trainer(data, "-x", "2", "-o", tmp_path, "--seed", "7")
    line = one_error(res)
    assert str(tmp_path) in line and "step 2" in line and "--supersede" in line and "-y 1" in line
    assert (tmp_path / "DONE_00000002").exists()


@pytest.mark.parametrize("kind", ["model", "state"])
def test_checkpoint_mixing_two_runs_is_refused(data, tmp_path, kind):
    a, b = tmp_path / "a", tmp_path / "b"
    trainer(data, "-x", "2", "-o", a, check=True)
    trainer(data, "-x", "2", "-o", b, check=True)
    name = "model_00000002.bin" if kind == "model" else "state_00000002_00000.bin"
    shutil.copy(b / name, a / name)  # as a crash in the middle of b's write into a's directory would leave it
    line = one_error(trainer(data, "-x", "3", "-o", a, "-y", "1"))
    assert name in line and "mixes two runs" in line, line


def test_resume_with_no_checkpoint_starts_fresh(data, tmp_path):
    fresh = trainer(data, "-x", "3", check=True)
    res = trainer(data, "-x", "3", "-o", tmp_path / "new", "-y", "1", check=True)
    assert f"resume: no complete checkpoint (DONE_* marker) in {tmp_path / 'new'}: starting a fresh run" in res.stdout
    assert steps(res.stdout) == steps(fresh.stdout)
    assert (tmp_path / "new" / "DONE_00000003").exists()


@pytest.mark.parametrize("flag, old, new", [("-l", "1e-3", "2e-3"), ("-k", "cosine", "linear"), ("-u", "0", "2"),
                                            ("-c", "0", "0.1"), ("--beta2", "0.95", "0.99"), ("--seed", "1337", "5"),
                                            ("--grad-clip", "1", "0.5"), ("--shuffle", "0", "1"), ("-d", "16", "32")])
def test_resume_with_changed_hyperparameter_is_refused(data, tmp_path, flag, old, new):
    trainer(data, "-x", "2", "-o", tmp_path, flag, old, check=True)
    line = one_error(trainer(data, "-x", "4", "-o", tmp_path, "-y", "1", flag, new))
    assert line.startswith(f"error: flag {flag}:") and "--resume-override" in line, line
    ok = trainer(data, "-x", "4", "-o", tmp_path, "-y", "1", flag, new, "--resume-override", check=True)
    assert f"resume: {flag} changed from" in ok.stdout and "resumed: step 2" in ok.stdout


def test_resume_drops_the_log_lines_it_reruns(data, tmp_path):
    ref = tmp_path / "ref"
    full = trainer(data, "-x", "6", "-n", "2", "-v", "2", "-j", data / "train.bin", "-m", "2", "-o", ref, check=True)
    work = tmp_path / "work"
    shutil.copytree(ref, work)
    for step in (4, 6):
        (work / f"DONE_{step:08d}").unlink()  # as if the run had died while writing step 4
    with open(work / "log.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.0')  # and in the middle of a line
    res = trainer(data, "-x", "6", "-n", "2", "-v", "2", "-j", data / "train.bin", "-m", "2", "-o", work, "-y", "1", check=True)
    assert steps(res.stdout) == steps(full.stdout)[2:]
    got, want = log_lines(work), log_lines(ref)
    strip = lambda log: [{k: v for k, v in e.items() if k not in ("ms", "tokens_per_s", "memory_mib")} for e in log if "event" not in e]
    assert strip(got) == strip(want)
    assert {"step": 2, "event": "resumed"} in got


def test_resume_with_other_document_flags_is_refused(data, tmp_path):
    """The packed-document flags change what is trained (masks, positions,
    the loss): each is saved with the state, and a resume that gives another
    value is refused naming it, as for the other hyperparameters."""
    docs = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--eot-token", "0"]
    trainer(data, "-x", "2", "-o", tmp_path, *docs, check=True)
    assert "resumed: step 2" in trainer(data, "-x", "3", "-o", tmp_path, "-y", "1", *docs, check=True).stdout
    for dropped in ("--reset-attention-mask", "--eod-mask-loss"):
        line = one_error(trainer(data, "-x", "4", "-o", tmp_path, "-y", "1", *[f for f in docs if f != dropped]))
        assert line.startswith(f"error: flag {dropped}: the checkpoint was trained with {dropped} 1, this run gives 0"), line
    line = one_error(trainer(data, "-x", "4", "-o", tmp_path, "-y", "1", *docs[:3], "--eot-token", "1"))
    assert line.startswith("error: flag --eot-token: the checkpoint was trained with --eot-token 0"), line


def test_a_state_from_before_the_document_flags_still_resumes(data, tmp_path):
    """A state of the previous release holds 17 hyperparameters (up to
    --tile-tokens): the document flags it lacks read as off, its end-of-text
    token is not compared, and it resumes as if it had them."""
    trainer(data, "-x", "2", "-o", tmp_path / "new", check=True)
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    state = tmp_path / "old" / "state_00000002_00000.bin"
    h = np.frombuffer(state.read_bytes()[:1024], dtype=np.int32).copy()
    h[32] = 17
    h[32 + 18:32 + 22] = 0
    state.write_bytes(h.tobytes() + state.read_bytes()[1024:])
    a = trainer(data, "-x", "3", "-y", "1", "-o", tmp_path / "new", check=True)
    b = trainer(data, "-x", "3", "-y", "1", "-o", tmp_path / "old", check=True)
    assert steps(a.stdout) == steps(b.stdout) and len(steps(a.stdout)) == 1
    line = one_error(trainer(data, "-x", "4", "-y", "1", "-o", tmp_path / "old", "--reset-attention-mask", "--eot-token", "0"))
    assert line.startswith("error: flag --reset-attention-mask: the checkpoint was trained with --reset-attention-mask 0"), line


# ---- resuming bitwise (tiny_shards: the 3-layer model of tiny_run) ----

def test_resume_is_bitwise_identical(tiny_shards, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["-x", "8", "-n", "4", "--shuffle", "1", "-c", "0.1", "-k", "cosine", "-u", "2", "-q", "0.1"]
    ref = tiny_run(tiny_shards, *common, "-o", full)
    assert (full / "DONE_00000004").exists() and (full / "DONE_00000008").exists()
    log = [json.loads(line) for line in (full / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "loss" in e] == list(range(1, 9))
    assert [f"{e['loss']:.6f}" for e in log if "loss" in e] == [s[1] for s in steps(ref.stdout)]
    copy_checkpoint(full, part, 4)
    resumed = tiny_run(tiny_shards, *common, "-o", part, "-y", "1")
    assert "resumed: step 4" in resumed.stdout
    assert steps(resumed.stdout) == steps(ref.stdout)[4:]
    for name in ["model_00000008.bin", "state_00000008_00000.bin"]:
        assert (part / name).read_bytes() == (full / name).read_bytes(), name
    assert len(list(part.glob("*.tmp"))) == 0


def test_incomplete_checkpoint_is_ignored(tiny_shards, tmp_path):
    tiny_run(tiny_shards, "-x", "4", "-n", "2", "-o", tmp_path)
    (tmp_path / "DONE_00000004").unlink()  # as if the run died while writing step 4
    resumed = tiny_run(tiny_shards, "-x", "4", "-o", tmp_path, "-y", "1")
    assert "resumed: step 2" in resumed.stdout


def test_resume_with_other_batch_is_refused(tiny_shards, tmp_path):
    tiny_run(tiny_shards, "-x", "2", "-o", tmp_path)
    res = run([binary("train_gpt_cpu"), *TINY_RUN_MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "1",
               "-t", "32", "-o", tmp_path, "-y", "1"])
    assert res.returncode == 1
    assert "B=2 T=32" in res.stderr


def test_resume_with_zero_or_too_few_steps(tiny_shards, tmp_path):
    """-y 1 -x 0 evaluates the checkpoint at its step; -x below the
    checkpoint's step is refused with one line instead of doing nothing."""
    full = tiny_run(tiny_shards, "-x", "3", "-v", "3", "-m", "2", "-o", tmp_path)
    at3 = re.search(r"val loss ([0-9.]+) at step 3", full.stdout).group(1)
    ev = tiny_run(tiny_shards, "-x", "0", "-y", "1", "-v", "3", "-m", "2", "-o", tmp_path)
    assert "training: none (-x 0): evaluating the model at step 3" in ev.stdout
    assert re.findall(r"val loss ([0-9.]+) at step (\d+)", ev.stdout) == [(at3, "3")]
    assert not STEP_RE.search(ev.stdout)
    res = run([binary("train_gpt_cpu"), *TINY_RUN_MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32",
               "-l", "1e-3", "-x", "2", "-y", "1", "-o", tmp_path])  # the checkpoint's -l: resume compares it
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: flag -x: 2 steps, but the checkpoint resumed is at step 3 "
                                  "(more steps, or -x 0 to evaluate it)")


def test_dropout_resume_is_bitwise_identical(tiny_shards, tmp_path):
    """The masks depend on the step, not on how many were drawn: a resumed run
    with dropout continues as the uninterrupted one, bit for bit. The
    checkpoint's model file carries the dropout, so the resume needs no flag;
    a different value is refused naming the flag."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["-x", "6", "-n", "3", "-d", "128", "--shuffle", "1"]
    ref = tiny_run(tiny_shards, *common, "--dropout", "0.2", "--attn-dropout", "0.1", "-o", full)
    header = np.frombuffer((full / "model_00000003.bin").read_bytes()[:1024], dtype="<f4")
    assert list(header[242:245]) == [np.float32(0.2), np.float32(0.1), np.float32(0.2)]
    copy_checkpoint(full, part, 3)
    resumed = tiny_run(tiny_shards, *common, "-o", part, "-y", "1")
    assert "attention 0.1 (attn_pdrop of " in resumed.stdout
    assert steps(resumed.stdout) == steps(ref.stdout)[3:]
    assert (part / "model_00000006.bin").read_bytes() == (full / "model_00000006.bin").read_bytes()
    res = run([binary("train_gpt_cpu"), *TINY_RUN_MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32",
               "-l", "1e-3", *common, "-x", "8", "--resid-dropout", "0.3", "-o", part, "-y", "1"])
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: flag --resid-dropout: the checkpoint was trained with --resid-dropout 0.2, this run "
                                  "gives 0.3: give the same, or --resume-override to change it")
