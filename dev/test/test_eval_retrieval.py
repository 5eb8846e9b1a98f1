"""Evaluation of what a long fine-tune is for: passkey retrieval by distance
(dev/data/passkey.py on a model trained here), --eval-by-position's explicit
buckets and top-1 accuracy, --eval-dump, evaluation-only runs (-x 0) without
training data and their -o model, and the --wpe-init default, against counts
made here with numpy and, where safetensors is installed, the float64 forward
of test_hf_gpt2.py."""
import json
import re
import shutil
import sys

import numpy as np
import pytest

from conftest import REPO, binary, datafile, run

try:  # the independent float64 forward; its module needs safetensors
    from test_hf_gpt2 import HF_CONFIG, hf_logprobs, hf_state, hf_tool, write_hf
    HAVE_HF = True
except pytest.skip.Exception:
    HAVE_HF = False
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="safetensors is not installed (dev/data/requirements.txt)")

PASSKEY = REPO / "dev" / "data" / "passkey.py"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
T = 16
TINY = ["--layers", "2", "--channels", "64", "--heads", "2", "--vocab-size", "64"]


def read_dump_arrays(path):
    """The dump as docs/FORMATS.md lays it out (version 2), read here without
    passkey.py: the header and the four (S, T) arrays."""
    raw = path.read_bytes()
    h = np.frombuffer(raw[:1024], dtype="<i4")
    assert (h[0], h[1]) == (20261203, 2), h[:2]
    t, s = int(h[2]), int(h[3])
    assert len(raw) == 1024 + 16 * s * t, (len(raw), s, t)
    body = np.frombuffer(raw[1024:], dtype="<i4").reshape(4, s, t)
    return h, body[0], body[1], body[2].view("<f4"), body[3]


def read_dump(path):
    """Header, target, top1 and loss of a dump."""
    return read_dump_arrays(path)[:4]


def val_loss(stdout):
    return float(re.search(r"^val loss ([0-9.]+) at step \d+$", stdout, re.M).group(1))


@pytest.fixture(scope="module")
def passkey(tmp_path_factory):
    """Small-vocabulary passkey data at T=16 (training: random depths; evaluation:
    every depth), and a 2-layer model trained on it (it retrieves from about
    step 300 on; 1,024 tokens a step)."""
    d = tmp_path_factory.mktemp("passkey")
    run([sys.executable, PASSKEY, "make", d / "train", "--seq-len", T, "--depths", "random", "--samples", 3000,
         "--seed", 1], check=True)
    run([sys.executable, PASSKEY, "make", d / "val", "--seq-len", T, "--samples-per-depth", 4, "--seed", 2], check=True)
    run([binary("train_gpt_cpu"), "-e", "d6", *TINY, "--max-seq-len", T, "-t", T, "-b", 64, "-x", 400, "-l", 3e-3,
         "-u", 20, "-i", d / "train" / "passkey.bin", "-j", "", "-s", 0, "-o", d / "run"], env=ONE_THREAD, check=True,
        timeout=300)
    return d, d / "run" / "model_00000400.bin"


def passkey_eval(data, *command, env=ONE_THREAD):
    res = run([sys.executable, PASSKEY, "eval", data, "--json", data / "rows.json", "--", *command], env=env, check=True)
    return json.loads((data / "rows.json").read_text()), res.stdout


def test_passkey_retrieval_rises_above_chance(passkey):
    """Trained at every distance up to T: the keys are found, far above chance
    (1/16), with a low answer loss; the untrained model is at chance."""
    d, model = passkey
    meta = json.loads((d / "val" / "passkey.json").read_text())
    rows, out = passkey_eval(d / "val", binary("train_gpt_cpu"), "-e", model)
    assert meta["chance"] == 1 / 16 and "distance" in out and "chance 0.0625" in out, out
    assert sum(r["samples"] for r in rows) == len(meta["samples"]) == 44
    trained = [r for r in rows if r["begin"] >= 2]  # distance 1: the key right before the question
    accuracy = sum(r["accuracy"] * r["samples"] for r in trained) / sum(r["samples"] for r in trained)
    assert accuracy > 0.6, rows
    assert np.mean([r["loss"] for r in trained]) < 1.0, rows
    run([binary("train_gpt_cpu"), "-e", "d6", *TINY, "--max-seq-len", T, "-t", T, "-b", 1, "-x", 0, "-v", 0, "-s", 0,
         "-o", d / "init"],
        check=True)  # the untrained model, saved by -x 0 -o
    before, _ = passkey_eval(d / "val", binary("train_gpt_cpu"), "-e", d / "init" / "model_00000000.bin")
    assert np.mean([r["accuracy"] for r in before]) < 0.25, before


def test_passkey_evaluation_under_recompute_tiles_and_context_parallelism(passkey, tmp_path):
    """The same answers and losses whatever the trainer recomputes, tiles or
    splits across processes: the dump is the evaluation's, not the layout's."""
    d, model = passkey
    base = [binary("train_gpt_cpu"), "-e", model, "-x", 0, "-v", 1, "-s", 0, "-b", 1, "-t", T, "-m", 44,
            "-j", d / "val" / "passkey.bin"]
    run([*base, "--eval-dump", tmp_path / "plain.bin"], env=ONE_THREAD, check=True)
    _, target, top1, loss = read_dump(tmp_path / "plain.bin")
    run([*base, "-r", "1", "--tile-tokens", "8", "--eval-dump", tmp_path / "tiled.bin"], env=ONE_THREAD, check=True)
    _, t2, p2, l2 = read_dump(tmp_path / "tiled.bin")
    assert np.array_equal(target, t2) and np.array_equal(top1, p2)
    assert np.allclose(loss, l2, rtol=1e-5, atol=1e-6), np.abs(loss - l2).max()
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found: context parallelism not checked")
    rows_one, _ = passkey_eval(d / "val", binary("train_gpt_cpu"), "-e", model)
    rows_two, _ = passkey_eval(d / "val", "mpirun", "-np", "2", binary("train_gpt_cpu"), "-e", model,
                               "--context-parallel", "2", env=MPI_ENV)
    assert [r["accuracy"] for r in rows_one] == [r["accuracy"] for r in rows_two]
    assert np.allclose([r["loss"] for r in rows_one], [r["loss"] for r in rows_two], rtol=1e-4), (rows_one, rows_two)


def bucket_line(stdout):
    line = re.search(r"^val loss by position at step \d+: (.*)$", stdout, re.M).group(1)
    return [(int(a), int(b), float(x), float(y)) for a, b, x, y in re.findall(r"(\d+)-(\d+) ([0-9.]+) top1 ([0-9.]+)", line)]


def test_explicit_buckets_accuracy_and_dump_agree_with_a_count(passkey, tmp_path):
    """Edges 0,1,9,14,15 (position 15 outside every bucket): each bucket's loss
    and top-1 accuracy is numpy's count over the dump; the dump is exactly
    1024 + 12 S T bytes, its mean loss the printed val loss, its targets the shard."""
    d, model = passkey
    shard = datafile.read_shard(d / "val" / "passkey.bin").astype(np.int64)
    out = run([binary("train_gpt_cpu"), "-e", model, "-x", 0, "-v", 1, "-s", 0, "-b", 2, "-t", T, "-m", 3,
               "-j", d / "val" / "passkey.bin", "--eval-by-position", "0,1,9,14,15", "--eval-dump", tmp_path / "d.bin"],
              env=ONE_THREAD, check=True).stdout
    h, target, top1, loss = read_dump(tmp_path / "d.bin")
    assert (h[2], h[3], h[4], h[5]) == (T, 6, 0, 64)  # T, 3 batches x 2 rows, step 0, V
    assert np.array_equal(target, shard[1:6 * T + 1].reshape(6, T))  # contiguous rows: row r's targets start at r*T+1
    assert abs(float(loss.astype(np.float64).mean()) - val_loss(out)) < 2e-6
    hits = top1 == target
    overall = float(re.search(r"^val top-1 accuracy ([0-9.]+) at step 0 \((\d+) tokens\)$", out, re.M).group(1))
    assert abs(overall - hits.mean()) < 1e-6
    buckets = bucket_line(out)
    assert [(a, b) for a, b, _, _ in buckets] == [(0, 1), (1, 9), (9, 14), (14, 15)]
    for a, b, x, acc in buckets:
        assert abs(x - loss[:, a:b].astype(np.float64).mean()) < 2e-6 * max(1.0, x), (a, b, x)
        assert abs(acc - hits[:, a:b].mean()) < 6e-5, (a, b, acc, hits[:, a:b].mean())
    assert hits[:, T - 2].mean() > 0.6  # position T-2 predicts the answer: retrieval, seen per position


@needs_hf
def test_top1_and_losses_match_an_independent_forward(tmp_path):
    """A random GPT-2 through the float64 numpy forward: the dump's top-1 is its
    argmax, its losses its -log p, at every position of every row."""
    V, NPOS = HF_CONFIG["vocab_size"], HF_CONFIG["n_positions"]
    state = hf_state(np.random.default_rng(41))
    assert hf_tool("import", write_hf(tmp_path / "hf", state), tmp_path / "m.bin").returncode == 0
    toks = np.random.default_rng(42).integers(0, V, 3 * NPOS + 1)
    datafile.write_shard(tmp_path / "val.bin", toks)
    out = run([binary("train_gpt_cpu"), "-e", tmp_path / "m.bin", "-x", 0, "-v", 1, "-s", 0, "-b", 1, "-t", NPOS,
               "-m", 3, "-j", tmp_path / "val.bin", "--eval-by-position", "every:8", "--eval-dump", tmp_path / "d.bin"],
              env=ONE_THREAD, check=True).stdout
    _, target, top1, loss = read_dump(tmp_path / "d.bin")
    inputs = toks[:3 * NPOS].reshape(3, NPOS)
    logp = hf_logprobs(state, inputs)
    ref_loss = -np.take_along_axis(logp, target[..., None], -1)[..., 0]
    assert np.allclose(loss, ref_loss, rtol=2e-5, atol=2e-5), np.abs(loss - ref_loss).max()
    top2 = np.sort(logp, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-4  # near-ties may go either way in fp32
    assert clear.mean() > 0.9
    assert np.array_equal(top1[clear], np.argmax(logp, axis=-1)[clear])
    buckets = bucket_line(out)
    assert [(a, b) for a, b, _, _ in buckets] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    for a, b, _, acc in buckets:
        assert abs(acc - (top1 == target)[:, a:b].mean()) < 1e-6, (a, b, acc)


@pytest.mark.parametrize("spec,message", [
    ("5,3", "the edges must increase"),
    ("0,40", "edge 40 is beyond -t 16"),
    ("every:0", "every:W needs one width W of at least 1"),
    ("x", "is not 0, a width W, every:W, or increasing edges"),
    ("0,-4", "is not 0, a width W, every:W, or increasing edges"),
    ("every:17", "every:17 is beyond -t 16"),
    (",".join(map(str, range(10**6, 10**6 + 400))), "...': edge 1000001 is beyond -t 16"),  # a long list cut short
])
def test_bad_bucket_specs_are_refused(passkey, spec, message):
    d, model = passkey
    res = run([binary("train_gpt_cpu"), "-e", model, "-x", 0, "-v", 1, "-s", 0, "-b", 1, "-t", T, "-m", 1,
               "-j", d / "val" / "passkey.bin", "--eval-by-position", spec])
    assert res.returncode != 0 and message in res.stderr and res.stderr.count("\n") == 1 and len(res.stderr) < 300, res.stderr


def test_eval_dump_into_a_directory_is_refused(passkey, tmp_path):
    d, model = passkey
    res = run([binary("train_gpt_cpu"), "-e", model, "-x", 0, "-v", 1, "-s", 0, "-b", 1, "-t", T, "-m", 1,
               "-j", d / "val" / "passkey.bin", "--eval-dump", tmp_path])
    assert res.returncode != 0 and "is a directory" in res.stderr, res.stderr
    res = run([binary("train_gpt_cpu"), "-e", model, "-x", 0, "-v", 0, "-s", 0, "-b", 1, "-t", T, "--eval-dump", tmp_path / "d.bin"])
    assert res.returncode != 0 and "--eval-dump needs validation" in res.stderr, res.stderr


def test_evaluation_needs_no_training_data(passkey, tmp_path):
    """-x 0 reads no -i: a missing file (or the missing default) is no error."""
    d, model = passkey
    args = [binary("train_gpt_cpu"), "-e", model, "-x", 0, "-v", 1, "-s", 0, "-b", 1, "-t", T, "-m", 2,
            "-j", d / "val" / "passkey.bin"]
    with_i = run([*args, "-i", tmp_path / "missing.bin"], env=ONE_THREAD, check=True).stdout
    without = run(args, env=ONE_THREAD, check=True).stdout
    assert val_loss(with_i) == val_loss(without)
    res = run([binary("train_gpt_cpu"), "-e", model, "-x", 1, "-v", 0, "-s", 0, "-b", 1, "-t", T,
               "-i", tmp_path / "missing.bin"])
    assert res.returncode != 0 and "missing.bin" in res.stderr, res.stderr  # training still needs it


def test_x0_o_saves_the_resized_model_and_wpe_init_has_no_default(passkey, tmp_path):
    """Lengthening a position table without --wpe-init is refused, naming both
    choices (no silent default: docs/finetune_long.md measures each ahead of
    the other on some model). -x 0 -o with --max-seq-len 80: model_00000000.bin
    holds the model evaluated, its 80-row position table the learned 16 rows
    interpolated (or repeated), every other tensor unchanged."""
    d, model = passkey
    _, old, _ = datafile.read_model(model)
    common = [binary("train_gpt_cpu"), "-e", model, "--max-seq-len", 80, "-x", 0, "-v", 0, "-s", 0, "-t", 80, "-b", 1]
    res = run([*common, "-o", tmp_path / "none"])
    assert res.returncode != 0 and res.stderr.count("\n") == 1 and "--wpe-init interpolate" in res.stderr \
        and "--wpe-init tile" in res.stderr and "(16 rows)" in res.stderr, res.stderr
    assert not (tmp_path / "none").exists()
    out = run([*common, "--wpe-init", "interpolate", "-o", tmp_path / "interp"], env=ONE_THREAD, check=True).stdout
    assert "interpolated" in out and "model_00000000.bin" in out, out
    cfg, new, _ = datafile.read_model(tmp_path / "interp" / "model_00000000.bin")
    assert cfg["max_seq_len"] == 80
    x = np.linspace(0, T - 1, 80)
    expected = np.stack([np.interp(x, np.arange(T), old["wpe"][:, c]) for c in range(old["wpe"].shape[1])], axis=1)
    assert np.allclose(new["wpe"], expected, atol=1e-6), np.abs(new["wpe"] - expected).max()
    assert all(np.array_equal(new[k], old[k]) for k in old if k != "wpe")
    assert not (tmp_path / "interp" / "DONE_00000000").exists()  # a model file, not a checkpoint to resume
    run([*common, "--wpe-init", "tile", "-o", tmp_path / "tile"], env=ONE_THREAD, check=True)
    _, tiled, _ = datafile.read_model(tmp_path / "tile" / "model_00000000.bin")
    assert np.array_equal(tiled["wpe"], old["wpe"][np.arange(80) % T])


@needs_hf
def test_resized_model_exports_to_hugging_face_and_back_byte_for_byte(passkey, tmp_path):
    d, model = passkey
    run([binary("train_gpt_cpu"), "-e", model, "--max-seq-len", 64, "--wpe-init", "interpolate", "-x", 0, "-v", 0, "-s", 0,
         "-t", 64, "-b", 1, "-o", tmp_path / "run"], env=ONE_THREAD, check=True)
    saved = tmp_path / "run" / "model_00000000.bin"
    res = hf_tool("export", saved, tmp_path / "hf")
    assert res.returncode == 0, res.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["n_positions"] == 64 and config["vocab_size"] == 64
    assert int(config["remat_run_id"], 16) == datafile.read_model_run_id(saved) != 0
    assert hf_tool("import", tmp_path / "hf", tmp_path / "back.bin").returncode == 0
    assert (tmp_path / "back.bin").read_bytes() == saved.read_bytes()


def test_finetune_long_script_reports_passkey_before_and_after(passkey, tmp_path):
    """scripts/finetune_long.sh with PASSKEY: retrieval by distance of the resized
    model, then of the last checkpoint, evaluated at SEQ_LEN."""
    import os
    import subprocess
    d, model = passkey
    run([sys.executable, PASSKEY, "make", tmp_path / "pk32", "--seq-len", 32, "--samples-per-depth", 1, "--seed", 4],
        check=True)
    env = {**os.environ, "TRAINER": str(binary("train_gpt_cpu")), "TRAIN": str(d / "train" / "passkey.bin"), "VAL": "",
           "MEM_BUDGET": "64MiB", "OMP_NUM_THREADS": "1", "TOKENS_PER_STEP": "32", "PASSKEY": str(tmp_path / "pk32"),
           "OUT_DIR": str(tmp_path / "out")}
    res = subprocess.run([str(REPO / "scripts" / "finetune_long.sh"), model, "32", "-x", "2"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "passkey retrieval, the resized model before training:" in res.stdout
    assert "position table resized from 16 to 32 rows (learned rows interpolated)" in res.stdout  # WPE_INIT's default
    assert f"passkey retrieval, after training ({tmp_path / 'out' / 'model_00000002.bin'}):" in res.stdout
    assert res.stdout.count("passkey retrieval at step 0 (11 samples of 32 tokens") == 2, res.stdout


def test_plot_log_and_passkey_read_a_dump(passkey, tmp_path):
    """dev/plot_log.py --dump draws a dump's loss and top-1 by position;
    passkey.py eval --dump reports from a dump made elsewhere, and refuses one
    of other data or a damaged file in one line."""
    d, model = passkey
    run([binary("train_gpt_cpu"), "-e", model, "-x", 0, "-v", 1, "-s", 0, "-b", 1, "-t", T, "-m", 44,
         "-j", d / "val" / "passkey.bin", "--eval-dump", tmp_path / "d.bin"], env=ONE_THREAD, check=True)
    report = run([sys.executable, PASSKEY, "eval", d / "val", "--dump", tmp_path / "d.bin"], check=True).stdout
    assert "passkey retrieval at step 0 (44 samples of 16 tokens; chance 0.0625)" in report, report
    other = run([sys.executable, PASSKEY, "eval", d / "train", "--dump", tmp_path / "d.bin"])
    assert other.returncode == 1 and "holds 44 sequences, the data 3000 samples" in other.stderr, other.stderr
    (tmp_path / "cut.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-4])
    cut = run([sys.executable, PASSKEY, "eval", d / "val", "--dump", tmp_path / "cut.bin"])
    assert cut.returncode == 1 and "but its header says 44 sequences of 16 tokens" in cut.stderr, cut.stderr
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: plot_log.py not checked")
    res = run([sys.executable, REPO / "dev" / "plot_log.py", "--dump", tmp_path / "d.bin", "-o", tmp_path / "p.png"])
    assert res.returncode == 0 and (tmp_path / "p.png").stat().st_size > 1000, res.stderr


@pytest.fixture
def random_model_args(tmp_path):
    """A random 2-layer model and a validation shard: flag checks need no training."""
    datafile.write_shard(tmp_path / "val.bin", np.arange(4 * T + 1) % 64)
    return [binary("train_gpt_cpu"), "-e", "d6", *TINY, "--max-seq-len", T, "-t", T, "-b", 1, "-m", 1, "-x", 0]


def test_eval_dump_into_a_missing_directory_is_refused_before_any_output(random_model_args, tmp_path):
    """Refused with the flag named, before -o is created (not at the first
    evaluation, naming a temporary file, with -o's log already written)."""
    res = run([*random_model_args, "-v", 1, "-s", 0, "-j", tmp_path / "val.bin", "--eval-dump", tmp_path / "nodir" / "d.bin",
               "-o", tmp_path / "out"])
    assert res.returncode != 0 and res.stderr.count("\n") == 1, res.stderr
    assert f"--eval-dump {tmp_path / 'nodir' / 'd.bin'}" in res.stderr and "does not exist" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "nodir").exists()


@pytest.mark.parametrize("flags", [["-j", ""], ["-v", 0]])
def test_x0_with_nothing_to_evaluate_sample_or_write_is_refused(random_model_args, tmp_path, flags):
    """-x 0 without validation, samples (-s 0) or -o would do nothing and exit 0;
    with -o it writes the model (the resize-then-export path), so it runs."""
    args = [*random_model_args, "-s", 0, "-j", tmp_path / "val.bin", *flags]
    res = run(args)
    assert res.returncode != 0 and res.stderr.count("\n") == 1 and "flag -x 0: nothing to do" in res.stderr, res.stderr
    run([*args, "-o", tmp_path / "out"], env=ONE_THREAD, check=True)
    assert (tmp_path / "out" / "model_00000000.bin").exists()
