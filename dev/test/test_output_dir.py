"""What a run may do to the files already in its -o (issue 44, findings 1
and 7): a fresh run never deletes or overwrites a checkpoint file (nothing
there is provably its own), --supersede deletes an earlier run's but never
the file -e reads, and files named like checkpoints that are not this
trainer's (llm.c's) are refused alike by a fresh run, -y 1 and --supersede,
with one line naming the file and what to do. Every refusal leaves -o as it
was, byte for byte."""
import shutil
import struct

import numpy as np
import pytest

from conftest import ONE_THREAD, binary, datafile, one_error, run, snapshot, tiny_trainer as trainer


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    d = tmp_path_factory.mktemp("outdir")
    datafile.write_shard(d / "train.bin", np.random.default_rng(44).integers(0, 64, 4000))
    return d / "train.bin"


@pytest.fixture(scope="module")
def evaluated(shard, tmp_path_factory):
    """A directory holding only the model a -x 0 run saved: model_00000000.bin, no DONE."""
    d = tmp_path_factory.mktemp("x0") / "ft"
    trainer(shard, "-x", "0", "-o", d, check=True)
    assert sorted(p.name for p in d.glob("*.bin")) == ["model_00000000.bin"] and not list(d.glob("DONE_*"))
    return d


def from_file(train_bin, model, *extra, **kw):
    """tiny_trainer's run, the model from a file."""
    return run([binary("train_gpt_cpu"), "-e", model, "-i", train_bin, "-j", "", "-b", "2", "-t", "8", "-s", "0", "-l", "1e-3", *extra],
               env=ONE_THREAD, **kw)


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("extra", [[], ["-y", "1"], ["--supersede"]])
def test_the_model_a_run_reads_from_its_own_output_is_never_deleted(shard, evaluated, tmp_path, extra):
    """The issue's reproducer and its variants: -e names a file of -o, as
    the same path or through another spelling of it (a symlink elsewhere)."""
    ft = copy_dir(evaluated, tmp_path / "ft")
    before = snapshot(ft)
    (tmp_path / "elsewhere").symlink_to(ft / "model_00000000.bin")
    for model in [ft / "model_00000000.bin", tmp_path / "elsewhere"]:
        line = one_error(from_file(shard, model, "-x", "3", "-o", ft, *extra))
        assert f"-e {model} is model_00000000.bin in -o {ft}" in line and "another -o" in line, line
        assert snapshot(ft) == before
    # the way out the message names works: the same model trains into another -o
    from_file(shard, ft / "model_00000000.bin", "-x", "1", "-o", tmp_path / "other", check=True)
    assert snapshot(ft) == before


@pytest.mark.parametrize("leftover", ["model", "state"])
def test_a_fresh_run_refuses_incomplete_leftovers_and_supersede_deletes_them(shard, tmp_path, leftover):
    """Files of a checkpoint without its DONE marker carry another run's id:
    a fresh run (and -y 1, which then starts fresh) refuses and names them;
    --supersede deletes them."""
    d = tmp_path / "d"
    trainer(shard, "-x", "2", "-o", d, check=True)
    (d / "DONE_00000002").unlink()  # as if the run died writing its first checkpoint
    if leftover == "model":
        (d / "state_00000002_00000.bin").unlink()
    else:
        (d / "model_00000002.bin").unlink()
    kept = d / ("model_00000002.bin" if leftover == "model" else "state_00000002_00000.bin")
    at = 4 * (240 if leftover == "model" else 22)  # the run id's header slots (docs/FORMATS.md)
    run_id = struct.unpack("<Q", kept.read_bytes()[at:at + 8])[0]
    before = snapshot(d)
    for extra in [[], ["-y", "1"]]:
        line = one_error(trainer(shard, "-x", "3", "-o", d, *extra))
        assert f"-o {d} holds {leftover}_00000002" in line and f"run {run_id:016x} with no DONE marker" in line, line
        assert "--supersede" in line and "another -o" in line, line
        assert snapshot(d) == before
    res = trainer(shard, "-x", "3", "-o", d, "--supersede", check=True)
    assert "removed 1 earlier checkpoint from" in res.stdout
    assert not kept.exists()
    assert (d / "DONE_00000003").exists()


def llmc_files(d, done_text=b""):
    """What llm.c leaves in its output directory: a model file whose header
    has no run id (slots 240-241 zero), an llm.c state file (version 1) and
    an empty DONE marker, written here from llm.c's documented layout."""
    d.mkdir(parents=True, exist_ok=True)
    header = np.zeros(256, np.int32)
    header[:8] = [20240326, 3, 16, 64, 2, 2, 16, 128]
    (d / "model_00000400.bin").write_bytes(header.tobytes() + np.zeros(8896, np.float32).tobytes())
    state = np.zeros(256, np.int32)
    state[:4] = [20240527, 1, 1, 0]
    (d / "state_00000400_00000.bin").write_bytes(state.tobytes())
    (d / "DONE_00000400").write_bytes(done_text)


@pytest.mark.parametrize("what", ["empty DONE", "DONE with other text", "model without DONE", "state without DONE"])
def test_llmc_files_in_output_get_one_answer(shard, tmp_path, what):
    """A fresh run, -y 1 and --supersede give the same line: what -o holds
    and what to do; none changes a byte of it."""
    d = tmp_path / "llmc"
    llmc_files(d, b"step 400\n" if what == "DONE with other text" else b"")
    if what == "model without DONE":
        (d / "DONE_00000400").unlink(); (d / "state_00000400_00000.bin").unlink()
    if what == "state without DONE":
        (d / "DONE_00000400").unlink(); (d / "model_00000400.bin").unlink()
    name = {"model without DONE": "model_00000400.bin", "state without DONE": "state_00000400_00000.bin"}.get(what, "DONE_00000400")
    before = snapshot(d)
    lines = set()
    for extra in [[], ["-y", "1"], ["--supersede"], ["-y", "1", "-x", "0"]]:
        line = one_error(trainer(shard, "-x", "2", "-o", d, *extra))
        assert line.startswith(f"error: -o {d} holds {name}, ") and "not a checkpoint of this trainer" in line, line
        assert "another -o" in line and "step 400" in line, line
        lines.add(line)
        assert snapshot(d) == before
    assert len(lines) == 1


def test_llmc_files_next_to_a_checkpoint_of_this_trainer(shard, tmp_path):
    """Not skipped as a damaged checkpoint by -y 1 (whose resume would then
    remove the newer marker): refused as the others are."""
    d = tmp_path / "mixed"
    trainer(shard, "-x", "2", "-o", d, check=True)
    (d / "DONE_00000400").write_bytes(b"")
    before = snapshot(d)
    line = one_error(trainer(shard, "-x", "4", "-o", d, "-y", "1"))
    assert f"-o {d} holds DONE_00000400, " in line and "not a checkpoint of this trainer" in line, line
    assert snapshot(d) == before


def test_resume_refuses_a_file_of_another_run(shard, tmp_path):
    """A file of another run in the -o resumed (here a model a -x 0 run
    saved, copied in) would be overwritten when the run reaches its step."""
    a, b = tmp_path / "a", tmp_path / "b"
    trainer(shard, "-x", "2", "-o", a, check=True)
    trainer(shard, "-x", "0", "-o", b, check=True)
    shutil.copy(b / "model_00000000.bin", a / "model_00000004.bin")
    other = struct.unpack("<Q", (b / "model_00000000.bin").read_bytes()[960:968])[0]
    before = snapshot(a)
    line = one_error(trainer(shard, "-x", "4", "-o", a, "-y", "1"))
    assert f"-o {a} holds model_00000004.bin of run {other:016x}, not of the run resumed" in line, line
    assert snapshot(a) == before
    # its own leftovers (a newer checkpoint without its marker) resume as before
    (a / "model_00000004.bin").unlink()
    trainer(shard, "-x", "4", "-n", "1", "-o", a, "-y", "1", check=True)
    (a / "DONE_00000004").unlink()
    assert "resumed: step 3" in trainer(shard, "-x", "4", "-o", a, "-y", "1", check=True).stdout
