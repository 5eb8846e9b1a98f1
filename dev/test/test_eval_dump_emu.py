"""train_gpt's per-token evaluation on the emulator (dev/emu) against the CPU
reference: --eval-dump's targets, top-1 tokens (classifier_top1_kernel) and
losses, and --eval-by-position's top-1 accuracy, for the same model file."""
import re

import numpy as np
import pytest

from conftest import binary, datafile, run
from emu_support import OUT, emu_run, explain
from test_eval_retrieval import read_dump, read_dump_arrays

MODEL = ["--layers", "2", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
LOSS_TOL = {"fp32": 1e-5, "bf16": 5e-2}


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A model that memorised 4 rows, saved by the CPU trainer, and an evaluation
    shard of two of them (top-1 right by a clear margin) and two fresh rows
    (mostly wrong): an accuracy near one half."""
    d = tmp_path_factory.mktemp("dump_emu")
    rows = np.random.default_rng(5).integers(0, 64, 4 * 32 + 1)
    datafile.write_shard(d / "rows.bin", rows)
    datafile.write_shard(d / "mixed.bin", np.concatenate([rows[:64], np.random.default_rng(6).integers(0, 64, 65)]))
    run([binary("train_gpt_cpu"), "-e", "d6", *MODEL, "-i", d / "rows.bin", "-j", "", "-b", 4, "-t", 32, "-x", 60,
         "-l", 1e-2, "-s", 0, "-o", d / "run"], env={"OMP_NUM_THREADS": "1"}, check=True)
    return d, d / "run" / "model_00000060.bin"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_dump_matches_the_cpu(emu_build, sharp_model, tmp_path, precision):
    exe = OUT / f"emu_train_gpt_{precision}"
    if not exe.exists():
        pytest.skip(f"{exe.name} not built")
    d, model = sharp_model
    flags = ["-e", model, "-x", 0, "-v", 1, "-s", 0, "-b", 2, "-t", 32, "-m", 2, "-j", d / "mixed.bin",
             "--eval-by-position", "0,16,31"]
    cpu = run([binary("train_gpt_cpu"), *flags, "--eval-dump", tmp_path / "cpu.bin"], env={"OMP_NUM_THREADS": "1"},
              check=True).stdout
    res = emu_run([exe, *flags, "--eval-dump", tmp_path / "gpu.bin"])
    assert res.returncode == 0, explain(res)
    _, target, top1, loss = read_dump(tmp_path / "cpu.bin")
    _, g_target, g_top1, g_loss = read_dump(tmp_path / "gpu.bin")
    assert np.array_equal(target, g_target)
    assert np.array_equal(read_dump_arrays(tmp_path / "cpu.bin")[4], read_dump_arrays(tmp_path / "gpu.bin")[4])
    assert np.array_equal(read_dump_arrays(tmp_path / "gpu.bin")[4], np.tile(np.arange(32), (4, 1)))  # no document flags
    assert np.allclose(loss, g_loss, atol=LOSS_TOL[precision], rtol=LOSS_TOL[precision]), np.abs(loss - g_loss).max()
    if precision == "fp32":  # the same logits to about 1e-6: the same top-1 everywhere
        assert np.array_equal(top1, g_top1)
    sure = loss < 0.2  # the memorised rows: the CPU's top-1 is the target by a clear margin
    assert 0.3 < sure.mean() < 0.7 and np.array_equal(top1[sure], g_top1[sure])
    accuracy = [float(x) for x in re.findall(r"top1 ([0-9.]+)", res.stdout)]
    assert len(accuracy) == 2
    hits = g_top1 == g_target
    assert abs(accuracy[0] - hits[:, :16].mean()) < 1e-4 and abs(accuracy[1] - hits[:, 16:31].mean()) < 1e-4, res.stdout
    assert "val top-1 accuracy" in cpu


@pytest.mark.parametrize("precision", ["fp32"])
def test_gpu_dump_positions_under_document_flags(emu_build, sharp_model, tmp_path, precision):
    """Version 2's position array (issue 44): the GPU trainer's dump under the
    three document flags holds the CPU's positions exactly (within the
    document, -1 where --eod-mask-loss skips the token) and the same losses
    where they count."""
    exe = OUT / f"emu_train_gpt_{precision}"
    if not exe.exists():
        pytest.skip(f"{exe.name} not built")
    d, model = sharp_model
    eot = int(np.bincount(np.asarray(datafile.read_shard(d / "mixed.bin"))[:128]).argmax())  # the commonest token: several documents
    flags = ["-e", model, "-x", 0, "-v", 1, "-s", 0, "-b", 2, "-t", 32, "-m", 2, "-j", d / "mixed.bin", "--eot-token", eot,
             "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    run([binary("train_gpt_cpu"), *flags, "--eval-dump", tmp_path / "cpu.bin"], env={"OMP_NUM_THREADS": "1"}, check=True)
    res = emu_run([exe, *flags, "--eval-dump", tmp_path / "gpu.bin"])
    assert res.returncode == 0, explain(res)
    *_, loss, position = read_dump_arrays(tmp_path / "cpu.bin")
    *_, g_loss, g_position = read_dump_arrays(tmp_path / "gpu.bin")
    assert np.array_equal(position, g_position) and (position == -1).any() and (position >= 0).any()
    counted = position >= 0
    assert np.allclose(loss[counted], g_loss[counted], atol=LOSS_TOL[precision], rtol=LOSS_TOL[precision])
