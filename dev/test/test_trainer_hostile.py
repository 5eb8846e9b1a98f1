"""The CPU trainer under a hostile newcomer's use: nothing in -o changes
before every input is checked, non-finite state, stale temporaries, a file
size limit, flags that would do nothing, prompts without room,
out-of-memory advice, the program's share of memory and the exit status of
a stop signal (resumes: test_resume.py)."""
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess

import numpy as np
import pytest

from conftest import BUILD, ONE_THREAD, REPO, TINY_MODEL as MODEL, binary, datafile, log_lines, one_error, run, snapshot, steps, tiny_trainer

N_PARAMS = 8896  # of MODEL (conftest.TINY_MODEL)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    rng = np.random.default_rng(23)
    datafile.write_shard(d / "train.bin", rng.integers(0, 64, 20000))
    datafile.write_shard(d / "other.bin", rng.integers(0, 64, 24000))
    datafile.write_shard(d / "val.bin", rng.integers(0, 64, 2000))
    write_tokenizer(d / "wrong_vocab_tokenizer.bin", 50)
    return d


def write_tokenizer(path, vocab):
    """A version-2 tokenizer file (docs/FORMATS.md) of `vocab` one-byte tokens."""
    header = np.zeros(256, dtype=np.uint32)
    header[:4] = [20240328, 2, vocab, vocab - 1]
    body = b"".join(bytes([1, 65 + i % 26]) for i in range(vocab))
    path.write_bytes(header.tobytes() + body)


def trainer(data, *extra, **kw):
    return tiny_trainer(data / "train.bin", *extra, **kw)


def built_with_mpi():
    return (BUILD / ".mpi-cpu-on").exists()


# ---- 1: validate before destroying ----

@pytest.fixture(scope="module")
def earlier_run(data, tmp_path_factory):
    """A finished run with two checkpoints, a validated log and a stale temporary."""
    d = tmp_path_factory.mktemp("earlier")
    trainer(data, "-x", "4", "-n", "2", "-v", "2", "-j", data / "val.bin", "-m", "2", "-o", d, check=True)
    (d / "model_00000006.bin.tmp").write_bytes(b"left by kill -9")
    return d


def long_prompt(tmp_path, n):
    p = tmp_path / f"prompt{n}.txt"
    p.write_text(" ".join(str(i % 60 + 1) for i in range(n)))
    return p


REFUSED = [
    (["--supersede", "-s", "1", "--prompt-tokens", "NOPE"], "NOPE: cannot open"),
    (["--supersede", "--eval-by-position", "4", "-v", "0"], "--eval-by-position needs validation"),
    (["--supersede", "-s", "1", "--prompt", "hello", "--tokenizer", "NOPE"], "NOPE: cannot open"),
    (["--supersede", "-i", "NOPE*.bin"], "-i"),
    (["--supersede", "-v", "1", "-j", "NOPE.bin"], "-j"),
    (["--supersede", "-s", "1", "--tokenizer", "WRONG_TOKENIZER"], "--tokenizer"),
    (["--supersede", "-s", "1", "--prompt-tokens", "LONG_PROMPT"], "no room to generate"),
    (["--supersede", "-r", "1", "--recompute-layers", "9"], "--recompute-layers"),
    (["-y", "1", "-l", "5e-3"], "flag -l"),
    (["-y", "1", "-i", "OTHER"], "flag -i"),
    (["-y", "1", "-x", "3"], "flag -x"),
    (["-y", "1", "-v", "2", "-j", "NOPE.bin"], "-j"),
]


@pytest.mark.parametrize("extra, why", REFUSED, ids=[" ".join(e) for e, _ in REFUSED])
def test_nothing_in_the_output_directory_changes_before_everything_is_checked(data, earlier_run, tmp_path, extra, why):
    work = tmp_path / "work"
    shutil.copytree(earlier_run, work)
    before = snapshot(work)
    subst = {"WRONG_TOKENIZER": str(data / "wrong_vocab_tokenizer.bin"), "LONG_PROMPT": str(long_prompt(tmp_path, 7)),
             "OTHER": str(data / "other.bin")}
    extra = [subst.get(a, a) for a in extra]
    line = one_error(trainer(data, "-x", "4", "-n", "2", "-o", work, *extra))
    assert why in line, line
    assert snapshot(work) == before  # no checkpoint removed, no log truncated or trimmed, not even the stale temporary


# ---- 3: non-finite optimizer state in a checkpoint ----

def test_nonfinite_checkpoint_state_is_refused_naming_the_element(data, tmp_path):
    trainer(data, "-x", "2", "-o", tmp_path, check=True)
    state = tmp_path / "state_00000002_00000.bin"
    raw = bytearray(state.read_bytes())
    at = 1024 + 4 * 777  # AdamW m, element 777 (m comes first in the payload)
    raw[at:at + 4] = struct.pack("<f", float("inf"))
    state.write_bytes(bytes(raw))
    line = one_error(trainer(data, "-x", "3", "-y", "1", "-o", tmp_path))
    assert str(state) in line and "AdamW m element 777 is inf" in line and "diverged" not in line, line


# ---- 5: a file size limit ----

@pytest.mark.parametrize("exe", ["train_gpt_cpu", "build/train_gpt_cpu_asan"])
def test_file_size_limit_ends_the_run_with_one_line_and_whole_files(data, tmp_path, exe):
    """SIGXFSZ stays at its default in the child (subprocess restores it):
    only the trainer itself can keep the limit from killing it. The log hits
    8 KiB after some 50 lines; the model file (36 KiB) cannot be written."""
    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
    args = [str(binary(exe)), *MODEL, "-i", str(data / "train.bin"), "-j", "", "-b", "2", "-t", "8", "-s", "0", "-x", "60",
            "-o", str(tmp_path)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size,
                         env={**os.environ, **ONE_THREAD}, cwd=REPO)
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path}/model_00000060.bin: write failed (file too large: the file size limit (ulimit -f) "
                      "is reached)"], res.stderr
    assert len(steps(res.stdout)) == 60
    entries = log_lines(tmp_path)  # every line whole
    assert 30 < len(entries) < 60 and [e["step"] for e in entries] == list(range(1, len(entries) + 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]  # no checkpoint, not even a partial one


# ---- 10: out-of-memory advice ----

def plan_total(*extra):
    res = run([binary("train_gpt_cpu"), "-e", "d12", "-i", "x", "--plan-json", *extra], check=True)
    return json.loads(res.stdout)["total_bytes"]


def least_plan(*extra):
    """The least plan the suggestions' levers reach: -r 1, untiled or at a
    tile of one row, at any of d12's segment sizes."""
    return min(plan_total(*extra, "-r", "1", "--tile-tokens", tile, "--segment-layers", K) for tile in ("0", "1") for K in map(str, range(1, 13)))


def test_smaller_batch_suggestions_keep_the_tokens_per_step():
    """-b 8 -t 256 -d 2048: a budget where the least plan (tiles and
    segments) fits up to -b 7, but only -b 1, 2, 4 (and 8) keep 2048
    tokens per step; and no lever keeps -b 8."""
    b7 = least_plan("-b", "7", "-t", "256")
    assert least_plan("-b", "8", "-t", "256") > b7
    res = run([binary("train_gpt_cpu"), "-e", "d12", "-i", "x", "-b", "8", "-t", "256", "-d", "2048", "-r", "auto",
               "--tile-tokens", "0", "--segment-layers", "1", "--mem-budget", str(b7), "--plan"])
    assert res.returncode == 1
    m = re.search(r"^  -r \S+(?: --(?:segment-layers|tile-tokens) \d+)* -b (\d+) -d (\d+) ", res.stderr, re.M)
    assert m and (int(m.group(1)), int(m.group(2))) == (4, 2048), res.stderr
    assert "keeping the batch" not in res.stderr


def test_small_budgets_print_in_kib():
    res = run([binary("train_gpt_cpu"), "-e", "d12", "-i", "x", "-r", "auto", "--mem-budget", "1KiB", "--plan"])
    assert "what would fit in 1.0 KiB:" in res.stderr and res.stderr.strip().endswith("error: -r auto: nothing fits in 1.0 KiB")
    assert "0.0 MiB" not in res.stderr


@pytest.mark.parametrize("exe", ["train_gpt_cpu", "build/train_gpt_cpu_asan"])
def test_zero_sharding_is_suggested_only_where_the_build_runs_processes(exe):
    """d12 at -b 1 -t 64: a budget between the plan over two processes with
    ZeRO-1 and the plan of one process; -z 1 across 2 processes with -d ...
    is what fits, with a smaller -b or both processes on each sequence (the
    batch of 4 on one does not)."""
    one = plan_total("-b", "1", "-t", "64", "-r", "1")
    two = plan_total("-b", "1", "-t", "64", "-r", "1", "-z", "1", "--plan-processes", "2")
    assert two < one
    res = run([binary(exe), "-e", "d12", "-i", "x", "-b", "4", "-t", "64", "-r", "auto", "--mem-budget", str((one + two) // 2), "--plan"])
    assert res.returncode == 1
    mpi = exe == "train_gpt_cpu" and built_with_mpi()
    if mpi:
        # a smaller -b, or the batch kept with both processes on each sequence
        assert re.search(r"^  -r \S+(?: --(?:segment-layers|tile-tokens) \d+)*(?: -b \d| --context-parallel 2) -d 256 -z 1 across 2 processes",
                         res.stderr, re.M), res.stderr
    else:
        assert "-z 1" not in res.stderr and "this build runs one process: no ZeRO-1" in res.stderr, res.stderr


# ---- 11: a prompt must leave room for a token ----

def test_prompt_room_rule(data, tmp_path):
    """-t 8: the context is the end-of-text token and the prompt; generating
    reads at most 8 tokens of context, so 6 prompt tokens leave room for one
    and 7 for none."""
    res = trainer(data, "-x", "1", "-s", "1", "-g", "5", "--prompt-tokens", long_prompt(tmp_path, 6), check=True)
    assert "leaves room for 1 of the -g 5 tokens within -t 8" in res.stdout
    sample = res.stdout.split("sample at step 1:\n---\n")[1].split("\n---")[0]
    assert len(re.findall(r"<\d+>", sample)) == 6 + 1, sample  # the prompt, then one generated token (as <id>: no tokenizer)
    line = one_error(trainer(data, "-x", "1", "-s", "1", "--prompt-tokens", long_prompt(tmp_path, 7)))
    assert "8 tokens with the leading end-of-text leave no room to generate within -t 8 (at most 6 prompt tokens)" in line, line


# ---- 12: flags never ignored silently ----

IGNORED = [
    (["-r", "0", "--recompute-layers", "1"], "flag --recompute-layers: applies to -r 1 and -r 3 only"),
    (["-r", "2", "--recompute-layers", "all"], "flag --recompute-layers: applies to -r 1 and -r 3 only"),
    (["-r", "auto", "--recompute-layers", "1"], "flag --recompute-layers: applies to -r 1 and -r 3 only"),
    (["-nm", "5", "-o", "OUT"], "flag -nm: applies with -nk"),
    (["--wpe-init", "interpolate"], "flag --wpe-init: applies to a model file"),
    (["--resume-override"], "flag --resume-override: applies to -y 1 only"),
    (["-s", "1", "--tokenizer", "WRONG_TOKENIZER"], "50 tokens, but the model's vocabulary has 64"),
    (["-w", "0"], "flag -w: GPU trainer only (train_gpt)"),
]


@pytest.mark.parametrize("extra, why", IGNORED, ids=[" ".join(e) for e, _ in IGNORED])
def test_a_flag_without_effect_is_refused(data, tmp_path, extra, why):
    subst = {"WRONG_TOKENIZER": str(data / "wrong_vocab_tokenizer.bin"), "OUT": str(tmp_path / "out")}
    line = one_error(trainer(data, "-x", "1", *[subst.get(a, a) for a in extra]))
    assert why in line, line
    assert not (tmp_path / "out").exists()


def test_mem_budget_below_a_fixed_plan_is_refused_with_what_fits(data):
    res = trainer(data, "-x", "1", "-r", "0", "--mem-budget", "1MiB")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and lines[0] == "the plan of -r 0 needs 1.2 MiB, more than --mem-budget 1.0 MiB", res.stderr
    assert lines[1] == "what would fit in 1.0 MiB:" and lines[-1].startswith("error: flag --mem-budget: the plan (1.2 MiB with -r 0)")
    assert trainer(data, "-x", "1", "-r", "0", "--mem-budget", "2MiB").returncode == 0  # a budget the plan keeps


def test_wpe_init_needs_a_lengthened_table(data, tmp_path):
    trainer(data, "-x", "1", "-o", tmp_path, check=True)
    model = tmp_path / "model_00000001.bin"
    base = [binary("train_gpt_cpu"), "-e", model, "-i", data / "train.bin", "-j", "", "-b", "2", "-t", "8", "-s", "0", "-x", "1"]
    line = one_error(run([*base, "--wpe-init", "tile"], env=ONE_THREAD))
    assert "flag --wpe-init: applies only when --max-seq-len lengthens the position table" in line and "16 rows" in line, line
    assert "flag --wpe-init" in one_error(run([*base, "--max-seq-len", "8", "--wpe-init", "tile"], env=ONE_THREAD))
    run([*base, "--max-seq-len", "32", "--wpe-init", "interpolate"], env=ONE_THREAD, check=True)


def test_collective_timeout_needs_mpi(data):
    """The sanitizer build has no MPI; a build with MPI started alone runs
    one process and says the flag has nothing to do."""
    line = one_error(trainer(data, "-x", "1", "--collective-timeout", "5", exe="build/train_gpt_cpu_asan"))
    assert line.startswith("error: flag --collective-timeout: this binary was built without MPI"), line
    if built_with_mpi():
        res = trainer(data, "-x", "1", "--collective-timeout", "5", check=True)
        assert "note: --collective-timeout with one process: no collective to time out" in res.stdout


def test_auto_found_tokenizer_of_another_vocabulary_is_not_used(data, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(data / "train.bin", d / "train.bin")
    write_tokenizer(d / "x_tokenizer.bin", 50)
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", d / "train.bin", "-j", "", "-b", "2", "-t", "8", "-x", "1", "-s", "1"],
              env=ONE_THREAD, check=True)
    assert f"tokenizer: {d / 'x_tokenizer.bin'} has 50 tokens, the model's vocabulary 64: not used" in res.stdout


def test_help_marks_shape_flags_as_from_the_model():
    out = run([binary("train_gpt_cpu"), "--help"], check=True).stdout
    for flag in ["--layers", "--heads", "--channels", "--max-seq-len", "--vocab-size"]:
        assert re.search(rf"^  {flag} N .*\[from -e\]$", out, re.M), flag
    assert re.search(r"^  -nm N +with -nk: also keep every checkpoint whose step is a multiple of N ", out, re.M)


# ---- 15: stale temporaries ----

STALE = ["model_00000003.bin.tmp", "state_00000003_00000.bin.tmp", "DONE_00000003.tmp", "log.jsonl.tmp"]
NOT_OURS = ["notes.tmp", "model_3.bin.tmp", "state_00000003_0.bin.tmp"]


@pytest.mark.parametrize("how", ["resume", "supersede"])
def test_stale_temporaries_of_a_run_are_removed_at_start(data, tmp_path, how):
    trainer(data, "-x", "2", "-o", tmp_path, check=True)
    for name in STALE + NOT_OURS:
        (tmp_path / name).write_bytes(b"x" * 100)
    extra = ["-y", "1"] if how == "resume" else ["--supersede"]
    res = trainer(data, "-x", "3", "-o", tmp_path, *extra, check=True)
    assert f"checkpoints: removed 4 stale temporary files (*.tmp) from {tmp_path}" in res.stdout
    left = {p.name for p in tmp_path.iterdir()}
    assert not left & set(STALE) and set(NOT_OURS) <= left


# ---- 16: the program's share of host memory ----

def test_peak_memory_stays_within_the_plan_and_the_program_share(data):
    res = trainer(data, "-x", "3", check=True)
    m = re.search(r"peak resident memory: ([0-9.]+) MiB \(plan: ([0-9.]+) MiB, and up to (\d+) MiB for the program\)", res.stdout)
    assert m, res.stdout[-500:]
    peak, plan, program = map(float, m.groups())
    assert program == (6 if built_with_mpi() else 4) and plan < peak <= plan + program  # the MPI library: 2 MiB


@pytest.mark.skipif(not shutil.which("mpirun"), reason="no mpirun")
def test_peak_memory_under_mpi_stays_within_the_plan_and_the_program_share(data):
    if not built_with_mpi():
        pytest.skip("train_gpt_cpu was built without MPI")
    res = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "1", binary("train_gpt_cpu"), *MODEL,
               "-i", data / "train.bin", "-j", "", "-b", "2", "-t", "8", "-s", "0", "-x", "3"], env=ONE_THREAD, check=True)
    m = re.search(r"peak resident memory: ([0-9.]+) MiB \(plan: ([0-9.]+) MiB, and up to (\d+) MiB for the program and MPI\)",
                  res.stdout)
    assert m, res.stdout[-500:]
    peak, plan, program = map(float, m.groups())
    assert program == 22 and plan + 6 < peak <= plan + program  # MPI's share is more than the program alone's


# ---- 17: a stop signal without -o ----

def test_stop_signal_without_output_exits_with_the_signal_status(data):
    proc = subprocess.Popen([str(binary("train_gpt_cpu")), *MODEL, "-i", str(data / "train.bin"), "-j", "", "-b", "2", "-t", "8",
                             "-s", "0", "-x", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **ONE_THREAD})
    for line in proc.stdout:
        if line.startswith("step    3/"):
            break
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    out = proc.stdout.read()
    assert proc.returncode == 128 + signal.SIGTERM, proc.returncode
    assert re.search(r"stopped by SIGTERM after step \d+: no -o, nothing saved", out), out[-500:]


LOGGER_PROBE = r"""
#include "llmc/run/logger.h"
int main(int argc, char** argv) {
    (void)argc;
    Logger lg;
    logger_open(&lg, argv[1], -1);
    logger_train(&lg, 1, NAN, 1e-3f, INFINITY, 1.0, 2.0, 16, 3.0);
    logger_val(&lg, 1, -INFINITY);
    int begin[2] = {0, 8}, end[2] = {8, 16};
    float loss[2] = {2.5f, NAN}, top1[2] = {0.5f, NAN};
    double tokens[2] = {8, 8};
    logger_val_by_position(&lg, 1, 2, begin, end, loss, top1, tokens);
    logger_train(&lg, 2, 2.25f, 1e-3f, 0.5f, 1.0, 2.0, 32, 3.0);
    logger_close(&lg);
    return 0;
}
"""


def test_log_lines_are_strict_json_with_non_finite_values(tmp_path):
    """A non-finite loss, norm or validation loss is written as null: every line
    parses as strict JSON (no NaN or Infinity tokens), the finite values intact."""
    src = tmp_path / "probe.c"
    src.write_text(LOGGER_PROBE)
    exe = tmp_path / "probe"
    run(["cc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-I", REPO, "-o", exe, src, "-lm"], check=True)
    run([exe, tmp_path], check=True)

    def refuse(token):
        raise ValueError(f"non-JSON constant {token}")

    lines = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] is None and lines[0]["norm"] is None and lines[0]["lr"] == pytest.approx(1e-3, rel=1e-7)
    assert lines[1] == {"step": 1, "val_loss": None}
    assert [b["loss"] for b in lines[2]["val_loss_by_position"]] == [2.5, None]
    assert [b["top1"] for b in lines[2]["val_loss_by_position"]] == [0.5, None]
    assert lines[3]["loss"] == 2.25 and lines[3]["norm"] == 0.5
