"""The CPU reference trainer (train_gpt_cpu) end to end, and its C unit tests."""
import os
import re

import numpy as np
import pytest

from conftest import ONE_THREAD, REPO, STEP_RE, TINY_RUN_MODEL, binary, datafile, run, steps, tiny_run


# ---- C unit tests ----

@pytest.mark.parametrize("name", ["test_gradcheck", "test_gradcheck_llama", "test_recompute", "test_plan", "test_loss_scaler", "test_matmul_order", "test_dropout",
                                  "test_dropout_sites"])
def test_c_unit(name):
    res = run([binary(f"build/{name}")])
    print(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS" in res.stdout


# ---- recompute: identical losses through the real command line ----

@pytest.mark.parametrize("flags", [["-r", "1"], ["-r", "2"], ["-r", "1", "--recompute-layers", "1"],
                                   ["-r", "1", "--recompute-layers", "every:2"],
                                   ["-r", "1", "--recompute-layers", "0,2"], ["-r", "3"],
                                   ["-r", "3", "--recompute-layers", "every:2"], ["-r", "3:0/1:1/2:2"]])
def test_recompute_modes_print_identical_steps(tiny_shards, flags):
    base = steps(tiny_run(tiny_shards, "-x", "6", "-d", "128").stdout)
    other = steps(tiny_run(tiny_shards, "-x", "6", "-d", "128", *flags).stdout)
    assert len(base) == 6
    assert other == base


def test_recompute_reduces_planned_activations(tiny_shards):
    def act_mib(*flags):
        out = tiny_run(tiny_shards, "-x", "1", *flags).stdout
        return float(re.search(r"activations +([0-9.]+) MiB", out).group(1))
    assert act_mib("-r", "1") < act_mib("-r", "3") < act_mib("-r", "2") < act_mib("-r", "0")


# ---- checkpoints ----

def test_checkpoint_model_file_is_llmc_format(tiny_shards, tmp_path):
    tiny_run(tiny_shards, "-x", "1", "-o", tmp_path)
    data = (tmp_path / "model_00000001.bin").read_bytes()
    header = np.frombuffer(data[:1024], dtype=np.int32)
    assert list(header[:8]) == [20240326, 3, 32, 64, 3, 4, 32, 128]
    # slots 240-241: the run id, the same as in the DONE marker (llmc/core/checkpoint.h); the rest zero
    assert not header[8:240].any() and not header[242:].any()
    run_id = int(np.frombuffer(header[240:242].tobytes(), dtype="<u8")[0])
    assert (tmp_path / "DONE_00000001").read_text() == f"run {run_id:016x}\n" and run_id != 0
    C, L, Vp, T = 32, 3, 128, 32
    params = Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert len(data) == 1024 + 4 * params
    wte = np.frombuffer(data[1024:1024 + 4 * Vp * C], dtype=np.float32).reshape(Vp, C)
    assert not wte[64:].any()  # padded rows stay zero through training


def test_model_file_round_trip(tiny_shards, tmp_path):
    """A saved model file holds exactly the trained parameters: loaded, it gives
    the validation loss the saving run measured after its last step (bitwise,
    as printed), and that loss differs from the initial one."""
    a = tmp_path / "a"
    val = lambda out: dict((int(st), v) for v, st in re.findall(r"val loss ([0-9.]+) at step (\d+)", out))
    ref = val(tiny_run(tiny_shards, "-x", "3", "-o", a, "-l", "1e-2", "-j", tiny_shards / "tiny_val.bin", "-v", "3",
                       "-m", "4").stdout)
    assert set(ref) == {0, 3} and ref[0] != ref[3]
    res = run([binary("train_gpt_cpu"), "-e", a / "model_00000003.bin", "-i", tiny_shards / "tiny_train.bin",
               "-j", tiny_shards / "tiny_val.bin", "-b", "2", "-t", "32", "-x", "1", "-s", "0", "-l", "0", "-v", "1",
               "-m", "4"], check=True)
    assert val(res.stdout)[0] == ref[3]


# ---- learning ----

def test_repeated_batch_loss_falls_steadily(tmp_path):
    rng = np.random.default_rng(3)
    datafile.write_shard(tmp_path / "one_train.bin", rng.integers(0, 64, 2 * 32 + 1))
    res = run([binary("train_gpt_cpu"), *TINY_RUN_MODEL, "-i", tmp_path / "one_train.bin", "-j", "", "-b", "2", "-t", "32",
               "-x", "40", "-l", "1e-2", "-s", "0"], check=True)
    losses = [float(s[1]) for s in steps(res.stdout)]
    assert len(losses) == 40
    assert losses[-1] < 0.1 * losses[0]
    rises = sum(b > a for a, b in zip(losses, losses[1:]))
    assert rises <= 1, losses


def test_synthetic_loss_approaches_entropy_floor(synthetic):
    out, meta = synthetic
    floor = meta["entropy_nats_per_token"]
    res = run([binary("train_gpt_cpu"), "-e", "d6", "--layers", "2", "--channels", "64", "--heads", "4",
               "--vocab-size", str(meta["vocab_size"]), "--max-seq-len", "64", "-i", out / "synthetic_train.bin",
               "-j", out / "synthetic_val.bin", "-b", "16", "-t", "64", "-x", "500", "-l", "4e-3", "-u", "20",
               "-q", "0.05", "-v", "500", "-m", "20", "-s", "0"], check=True, timeout=900)
    val = [float(v) for v in re.findall(r"val loss ([0-9.]+) at step 500", res.stdout)]
    print(f"val loss {val[-1]:.4f}, entropy floor {floor:.4f}")
    assert floor - 0.02 < val[-1] < floor + 0.1


def test_sample_is_decoded_with_the_tokenizer(synthetic):
    out, meta = synthetic
    res = run([binary("train_gpt_cpu"), *TINY_RUN_MODEL[:-4], "--vocab-size", str(meta["vocab_size"]), "--max-seq-len", "32",
               "-i", out / "synthetic_train.bin", "-j", "", "-b", "2", "-t", "32", "-x", "2", "-s", "2", "-g", "16"],
              check=True)
    text = res.stdout.split("sample at step 2:\n---\n")[1].split("\n---")[0]
    assert re.fullmatch(r"[a-z <|>\n]+", text), text  # pseudo-words, not token ids


def test_help_lists_every_flag_the_parser_takes():
    res = run([binary("train_gpt_cpu"), "--help"], check=True)
    flags = re.findall(r"^  (-[-a-z0-9]+)", res.stdout, re.M)
    assert len(flags) > 30
    src = (REPO / "llmc/core/cli.h").read_text()
    table = re.findall(r'^\s*\{"(-[-a-z0-9]+)", FLAG_\w+, OPT\(\w+\), [^,]+, [^,]+, (FOR_\w+)', src, re.M)
    flags = [f for f in flags if f != "-h"]
    assert sorted(flags) == sorted(f for f, who in table if who != "FOR_GPU")


def test_zero_steps_evaluates_and_samples_a_saved_model(synthetic, tmp_path):
    """-x 0: no training; the model loaded is evaluated and sampled, and no
    checkpoint is written, only the model evaluated (model_00000000.bin, the
    same parameters). The validation loss is the one the saving run measured
    at its end (same weights, same batches)."""
    out, meta = synthetic
    data = ["-i", out / "synthetic_train.bin", "-j", out / "synthetic_val.bin", "-b", "2", "-t", "32", "-m", "3"]
    saved = run([binary("train_gpt_cpu"), *TINY_RUN_MODEL[:-4], "--vocab-size", str(meta["vocab_size"]), "--max-seq-len",
                 "32", *data, "-x", "2", "-v", "2", "-s", "0", "-o", tmp_path / "a"], check=True)
    res = run([binary("train_gpt_cpu"), "-e", tmp_path / "a" / "model_00000002.bin", *data, "-x", "0", "-s", "1",
               "-g", "8", "-o", tmp_path / "b"], check=True)
    assert not STEP_RE.search(res.stdout)
    assert re.search(r"val loss ([0-9.]+) at step 0", res.stdout).group(1) == \
        re.search(r"val loss ([0-9.]+) at step 2", saved.stdout).group(1)
    assert "sample at step 0:" in res.stdout
    assert [p.name for p in (tmp_path / "b").glob("*_*")] == ["model_00000000.bin"]  # no state file, no DONE marker
    assert (tmp_path / "b" / "model_00000000.bin").read_bytes()[1024:] == (tmp_path / "a" / "model_00000002.bin").read_bytes()[1024:]


def test_missing_default_data_says_how_to_make_it(tmp_path):
    """Run where no data/ exists: the default shards are named with the script
    that makes them, before anything is allocated (d12 would take 4 GiB)."""
    import subprocess
    res = subprocess.run([str(binary("train_gpt_cpu")), "-x", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: -i: the default data data/tinyshakespeare/tiny_shakespeare_train.bin is missing: "
                                  "make it with python3 dev/data/tinyshakespeare.py, or give -i")
    assert "memory plan" not in res.stdout


def test_peak_memory_follows_the_plan(tiny_shards):
    """The closing peak-RSS line measures the process: between a small and a
    large batch it grows by what the plan grows by (the program's own pages
    are the same in both), within a MiB."""
    peaks = []
    for b in ("2", "256"):
        res = run([binary("train_gpt_cpu"), "-e", "d6", "--layers", "2", "--channels", "64", "--heads", "2", "--vocab-size", "64",
                   "--max-seq-len", "16", "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", b, "-t", "16", "-s", "0", "-x", "1"],
                  env=ONE_THREAD, check=True)
        m = re.search(r"peak resident memory: ([0-9.]+) MiB \(plan: ([0-9.]+) MiB", res.stdout)
        assert m, res.stdout[-2000:]
        peaks.append((float(m.group(1)), float(m.group(2))))
    (rss_small, plan_small), (rss_large, plan_large) = peaks
    assert plan_large - plan_small > 30  # the batch's activations
    assert abs((rss_large - rss_small) - (plan_large - plan_small)) < 1.0, peaks
    assert rss_large >= plan_large


def test_long_context_resize_of_the_position_table(tiny_shards, tmp_path):
    """--max-seq-len with a model file resizes wpe: longer tables repeat the
    learned rows, shorter ones keep the first; nothing else changes."""
    tiny_run(tiny_shards, "-x", "1", "-o", tmp_path / "a")
    src = tmp_path / "a" / "model_00000001.bin"
    C, Vp, T = 32, 128, 32

    def tensors(path, maxT):
        raw = np.frombuffer(path.read_bytes()[1024:], dtype=np.float32)
        wte, wpe, rest = raw[:Vp * C], raw[Vp * C:Vp * C + maxT * C].reshape(maxT, C), raw[Vp * C + maxT * C:]
        return wte, wpe, rest

    def from_model(model, *flags, out=None):
        args = [binary("train_gpt_cpu"), "-e", model, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2",
                "-s", "0", "-x", "1", "-l", "0", *flags]
        return run(args + (["-o", out] if out else []), check=True)

    longer = from_model(src, "--max-seq-len", "80", "--wpe-init", "tile", "-t", "64", out=tmp_path / "b")
    assert "position table resized from 32 to 80 rows (learned rows repeated)" in longer.stdout
    wte0, wpe0, rest0 = tensors(src, T)
    wte1, wpe1, rest1 = tensors(tmp_path / "b" / "model_00000001.bin", 80)
    assert np.array_equal(wte0, wte1) and np.array_equal(rest0, rest1)
    assert np.array_equal(wpe1, wpe0[np.arange(80) % T])
    # the first T positions are untouched, so the loss at T=32 is the same
    same_t = [steps(from_model(m, "-t", "32").stdout)[0][1] for m in (src, tmp_path / "b" / "model_00000001.bin")]
    assert same_t[0] == same_t[1]
    from_model(src, "--max-seq-len", "16", "-t", "16", out=tmp_path / "c")
    _, wpe2, rest2 = tensors(tmp_path / "c" / "model_00000001.bin", 16)
    assert np.array_equal(wpe2, wpe0[:16]) and np.array_equal(rest2, rest0)


def test_finetune_long_script(tiny_shards, tmp_path):
    """scripts/finetune_long.sh, run from another directory with relative
    paths: plan at the new length, then -r auto training from the resized
    model; later flags override its defaults, and -d follows the -b given."""
    import subprocess
    tiny_run(tiny_shards, "-x", "1", "-o", tmp_path / "a")
    env = {**os.environ, "TRAINER": str(binary("train_gpt_cpu")), "TRAIN": str(tiny_shards / "tiny_train.bin"), "VAL": "",
           "MEM_BUDGET": "64MiB", "OMP_NUM_THREADS": "2"}
    res = subprocess.run([str(REPO / "scripts" / "finetune_long.sh"), "a/model_00000001.bin", "128", "-x", "2", "-b", "2"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "position table resized from 32 to 128 rows" in res.stdout
    assert "memory plan (4-byte storage, B=2 T=128)" in res.stdout  # --plan, then the training run
    assert "fit in 64.0 MiB (--mem-budget, as given: no headroom kept for the program), all layers" \
        in res.stdout
    assert "recompute auto: fits 64.0 MiB (--mem-budget, as given" in res.stdout
    assert "gradient accumulation 256 (65536 tokens per step)" in res.stdout
    # the plan step passes the run's -d and -r auto: it predicts the step time the run predicts
    planned = re.search(r"^this run, -r (\S+): predicted ([0-9.]+) ms per step \(256 micro-steps\)", res.stdout, re.M)
    chosen = re.findall(r"^recompute auto: .*?: -r (\S+); predicted ([0-9.]+) ms per step", res.stdout, re.M)
    assert planned and len(chosen) == 2 and chosen[-1] == planned.groups(), (planned, chosen)
    assert [s[0] for s in steps(res.stdout)] == ["1", "2"]
    model = tmp_path / "out" / "long_128" / "model_00000002.bin"  # OUT_DIR's default, under the directory run from
    header = np.frombuffer(model.read_bytes()[:1024], dtype=np.int32)
    assert header[2] == 128  # max_seq_len of the written model


@pytest.mark.parametrize("args, message", [([], "usage: scripts/finetune_long.sh"),
                                           (["missing.bin", "128"], "model file 'missing.bin' not found"),
                                           (["MODEL", "12x"], "SEQ_LEN '12x' is not a positive integer")])
def test_finetune_long_script_refuses_bad_arguments(tiny_shards, tmp_path, args, message):
    args = [str(tiny_shards / "tiny_train.bin") if a == "MODEL" else a for a in args]
    res = run([REPO / "scripts" / "finetune_long.sh", *args], env={"TRAINER": str(binary("train_gpt_cpu"))})
    assert res.returncode != 0 and message in res.stderr


@pytest.mark.parametrize("flags, expect", [(["-v", "0"], "the run did not validate"),
                                           (["-j", ""], "the run did not validate"),
                                           (["-v", "2"], "final validation loss ")])
def test_quickstart_ends_with_a_word_on_validation(flags, expect):
    """scripts/quickstart.sh on the CPU (no nvidia-smi on its PATH): a run
    without validation finishes with exit 0 and says why there is no loss to
    compare with the entropy floor, instead of exiting 1 without a word."""
    binary("train_gpt_cpu")
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, "nvidia-smi")))
    res = run([REPO / "scripts" / "quickstart.sh", "-x", "2", "-b", "2", *flags], env={"PATH": path})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    last = res.stdout.strip().splitlines()[-1]
    assert expect in last and "entropy floor" in last, last
    if flags == ["-v", "2"]:
        assert float(last.split()[3]) == float(VAL_RE.findall(res.stdout)[-1][0])


# ---- dropout ----

VAL_RE = re.compile(r"^val loss ([0-9.]+) at step (\d+)", re.M)


def test_dropout_zero_is_no_dropout(tiny_shards):
    """--dropout 0 (and each site's flag at 0) takes the plain path: the same
    printed steps, bit for bit, as no flag; any p > 0 changes them."""
    base = steps(tiny_run(tiny_shards, "-x", "3").stdout)
    assert steps(tiny_run(tiny_shards, "-x", "3", "--dropout", "0").stdout) == base
    zero_sites = tiny_run(tiny_shards, "-x", "3", "--dropout", "0.5", "--attn-dropout", "0", "--resid-dropout", "0",
                          "--embd-dropout", "0")
    assert steps(zero_sites.stdout) == base and "dropout:" not in zero_sites.stdout
    for flag in ("--dropout", "--attn-dropout", "--resid-dropout", "--embd-dropout"):
        dropped = steps(tiny_run(tiny_shards, "-x", "3", flag, "0.1").stdout)
        assert [s[1] for s in dropped] != [s[1] for s in base], flag


def test_dropout_leaves_evaluation_unchanged(tiny_shards):
    """Validation never drops: the step-0 validation loss is the same with
    dropout set; training with it differs. -x 0 evaluation and its sample too."""
    common = ["-x", "2", "-v", "2", "-m", "2"]
    plain, dropped = (tiny_run(tiny_shards, *common, *extra).stdout for extra in ([], ["--dropout", "0.3"]))
    assert "dropout: embedding 0.3 (--dropout), attention 0.3 (--dropout), residual 0.3 (--dropout)" in dropped
    val_plain, val_dropped = dict((s, v) for v, s in VAL_RE.findall(plain)), dict((s, v) for v, s in VAL_RE.findall(dropped))
    assert val_plain["0"] == val_dropped["0"] and val_plain["2"] != val_dropped["2"]
    assert steps(plain) != steps(dropped)
    evals = [tiny_run(tiny_shards, "-x", "0", "-v", "1", "-m", "2", "-s", "1", "-g", "8", *extra).stdout
             for extra in ([], ["--dropout", "0.5"])]
    assert VAL_RE.findall(evals[0]) == VAL_RE.findall(evals[1])
    sample = lambda out: out.split("sample at step 0:\n---\n")[1].split("\n---\n")[0]  # (the memory line after it varies)
    assert sample(evals[0]) == sample(evals[1])


def test_dropout_recompute_modes_print_identical_steps(tiny_shards):
    """Every recompute setting regenerates the forward's masks: with dropout
    at every site and two micro-steps per step, identical printed steps."""
    common = ["-x", "4", "-d", "128", "--dropout", "0.2"]
    base = steps(tiny_run(tiny_shards, *common).stdout)
    assert len(base) == 4 and base != steps(tiny_run(tiny_shards, "-x", "4", "-d", "128").stdout)
    for flags in (["-r", "1"], ["-r", "2"], ["-r", "3"], ["-r", "1", "--recompute-layers", "every:2"], ["-r", "3:0/1:1/2:2"]):
        assert steps(tiny_run(tiny_shards, *common, *flags).stdout) == base, flags


def test_dropout_refuses_more_micro_steps_than_the_site_word_holds(tiny_shards):
    args = [binary("train_gpt_cpu"), *TINY_RUN_MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32",
            "-d", str(64 * 262145), "-x", "1"]
    res = run([*args, "--dropout", "0.1"])
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: flag -d: 262145 micro-steps per step; with dropout at most 262144 (fewer tokens per "
                                  "step, or a larger -b)")
    assert "memory plan" not in res.stdout
    assert run([*args, "--plan"]).returncode == 0  # without dropout the site word does not matter


@pytest.mark.parametrize("value", ["1", "-0.1", "0.995", "nan"])
def test_dropout_flag_out_of_range_is_refused(value):
    res = run([binary("train_gpt_cpu"), "--attn-dropout", value])
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1
    assert res.stderr.startswith("error: flag --attn-dropout: ")
