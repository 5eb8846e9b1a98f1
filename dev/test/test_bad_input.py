"""Bad input to the CPU trainer: each case exits 1 with one 'error:' line that
names the file or flag and the reason, and never crashes. Run against the
AddressSanitizer + UndefinedBehaviorSanitizer build, so a parser that reads
out of bounds or overflows fails here even when it happens not to crash."""
import os
import re
import resource
import struct
import subprocess

import numpy as np
import pytest

from conftest import REPO, binary, datafile, run

MODEL = ["-e", "d6", "--layers", "1", "--channels", "16", "--heads", "2", "--vocab-size", "64", "--max-seq-len", "16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    rng = np.random.default_rng(1)
    datafile.write_shard(d / "good.bin", rng.integers(0, 64, 1000))
    good = (d / "good.bin").read_bytes()
    (d / "magic.bin").write_bytes(struct.pack("<i", 1234) + good[4:])
    (d / "version.bin").write_bytes(good[:4] + struct.pack("<i", 7) + good[8:])
    (d / "truncated.bin").write_bytes(good[:-2])
    (d / "trailing.bin").write_bytes(good + b"\0\0")
    (d / "short_header.bin").write_bytes(good[:100])
    (d / "empty.bin").write_bytes(b"")
    datafile.write_shard(d / "bigtoken.bin", np.r_[rng.integers(0, 64, 500), [64], rng.integers(0, 64, 10)])
    datafile.write_shard(d / "small.bin", rng.integers(0, 64, 10))
    # a valid model file (v3) to corrupt
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", d / "good.bin", "-j", "", "-b", "1", "-t", "16", "-x", "1",
               "-s", "0", "-o", d / "ckpt"], check=True)
    model = (d / "ckpt" / "model_00000001.bin").read_bytes()
    (d / "model_ok.bin").write_bytes(model)
    (d / "model_magic.bin").write_bytes(struct.pack("<i", 20240520) + model[4:])
    (d / "model_version.bin").write_bytes(model[:4] + struct.pack("<i", 4) + model[8:])
    (d / "model_truncated.bin").write_bytes(model[:-4])
    (d / "model_badshape.bin").write_bytes(model[:16] + struct.pack("<i", -3) + model[20:])
    (d / "model_heads.bin").write_bytes(model[:20] + struct.pack("<i", 3) + model[24:])
    (d / "model_padded.bin").write_bytes(model[:28] + struct.pack("<i", 1 << 30) + model[32:])
    tokens = [bytes([65 + i % 26]) for i in range(64)]
    datafile.write_tokenizer(d / "tok_ok.bin", tokens, 63)
    tok = (d / "tok_ok.bin").read_bytes()
    (d / "tok_eot_negative.bin").write_bytes(tok[:12] + struct.pack("<i", -1) + tok[16:])
    (d / "tok_eot_high.bin").write_bytes(tok[:12] + struct.pack("<i", 64) + tok[16:])
    state = (d / "ckpt" / "state_00000001_00000.bin").read_bytes()
    for name, slot, value in [("rank", 4, 5), ("step", 2, -7), ("params", 13, -1), ("shardpos", 10, -2)]:
        bad = d / f"state_{name}"
        bad.mkdir()
        for f in (d / "ckpt").iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        (bad / "state_00000001_00000.bin").write_bytes(state[:4 * slot] + struct.pack("<i", value) + state[4 * slot + 4:])
    rates = "matmul_flops_per_s = 1e12\nattention_flops_per_s = 1e12\nmemory_bytes_per_s = 1e11\n"
    (d / "cm_unknown.txt").write_text(rates + "frobs_per_s = 3\n")
    (d / "cm_missing.txt").write_text("matmul_flops_per_s = 1e12\n")
    (d / "cm_negative.txt").write_text(rates.replace("= 1e11", "= -1e11"))
    (d / "cm_twice.txt").write_text(rates + "matmul_flops_per_s = 2e12\n")
    (d / "cm_noeq.txt").write_text("matmul_flops_per_s 1e12\n")
    (d / "cm_half_ring.txt").write_text(rates + "ring_link_bytes_per_s = 5e9\n")
    return d


def cases(d):
    base = ["-i", d / "good.bin", "-j", "", "-b", "1", "-t", "16", "-x", "1", "-s", "0"]
    return {
        "missing train file": ([*MODEL, "-i", d / "nope.bin", *base[2:]], ["nope.bin", "no files match"]),
        "shard bad magic": ([*MODEL, "-i", d / "magic.bin", *base[2:]], ["magic.bin", "bad magic"]),
        "shard bad version": ([*MODEL, "-i", d / "version.bin", *base[2:]], ["version.bin", "version 7"]),
        "shard truncated": ([*MODEL, "-i", d / "truncated.bin", *base[2:]], ["truncated.bin", "does not match its header"]),
        "shard trailing bytes": ([*MODEL, "-i", d / "trailing.bin", *base[2:]], ["trailing.bin", "does not match its header"]),
        "shard short header": ([*MODEL, "-i", d / "short_header.bin", *base[2:]], ["short_header.bin", "too short"]),
        "shard empty": ([*MODEL, "-i", d / "empty.bin", *base[2:]], ["empty.bin", "too short"]),
        "token out of range": ([*MODEL, "-i", d / "bigtoken.bin", *base[2:]], ["bigtoken.bin", "token 64 at position 500"]),
        "shard too small": ([*MODEL, "-i", d / "small.bin", *base[2:]], ["small.bin", "too few"]),
        "val shard bad": ([*MODEL, *base[:2], "-j", d / "magic.bin", "-v", "1", *base[4:]], ["magic.bin", "bad magic"]),
        "model missing": (["-e", d / "nomodel.bin", *base], ["nomodel.bin", "cannot open"]),
        "model bad magic": (["-e", d / "model_magic.bin", *base], ["model_magic.bin", "bad magic"]),
        "model bad version": (["-e", d / "model_version.bin", *base], ["model_version.bin", "version 4"]),
        "model truncated": (["-e", d / "model_truncated.bin", *base], ["model_truncated.bin", "does not match its header"]),
        "model bad shape": (["-e", d / "model_badshape.bin", *base], ["model_badshape.bin", "layers -3"]),
        "model heads": (["-e", d / "model_heads.bin", *base], ["model_heads.bin", "not divisible by heads 3"]),
        "model with shape flags": (["-e", d / "model_ok.bin", "--layers", "2", *base], ["--layers", "random init only"]),
        "T above max": ([*MODEL, *base[:6], "-t", "17", *base[8:]], ["-t", "exceeds the model's maximum 16"]),
        "-d not divisible": ([*MODEL, *base, "-d", "24"], ["-d", "not a positive multiple"]),
        "unknown flag": ([*MODEL, *base, "--frobnicate", "1"], ["--frobnicate", "unknown flag"]),
        "malformed int": ([*MODEL, *base[:4], "-b", "4x", *base[6:]], ["-b", "'4x' is not an integer"]),
        "int out of range": ([*MODEL, *base[:4], "-b", "0", *base[6:]], ["-b", "out of range"]),
        "malformed float": ([*MODEL, *base, "-l", "fast"], ["-l", "'fast' is not a number"]),
        "nan float": ([*MODEL, *base, "-l", "nan"], ["-l", "is not a number"]),
        "missing value": ([*MODEL, *base, "-l"], ["-l", "needs a value"]),
        "bad schedule": ([*MODEL, *base, "-k", "step"], ["-k", "unknown schedule"]),
        "bad recompute": ([*MODEL, *base, "-r", "4"], ["-r", "'4'"]),
        "bad mix mode": ([*MODEL, *base, "-r", "5:0"], ["-r", "MODE:LAYERS"]),
        "mix names a layer twice": ([*MODEL, *base, "-r", "1:0/3:0"], ["-r", "names layer 0 twice"]),
        "mix layer out of range": ([*MODEL, *base, "-r", "1:0-9"], ["-r", "out of range"]),
        "mix empty group": ([*MODEL, *base, "-r", "1:0/3:"], ["-r", "empty layer list"]),
        "mix ends with /": ([*MODEL, *base, "-r", "1:0/"], ["-r", "ends with /"]),
        "mix with --recompute-layers": ([*MODEL, *base, "-r", "1:0", "--recompute-layers", "1"],
                                        ["--recompute-layers", "per-layer mix"]),
        "cost model missing": ([*MODEL, *base, "--cost-model", d / "nope.txt"], ["--cost-model", "nope.txt", "readable file"]),
        "cost model unknown key": ([*MODEL, *base, "--cost-model", d / "cm_unknown.txt"], ["cm_unknown.txt", "line 4", "frobs_per_s"]),
        "cost model key missing": ([*MODEL, *base, "--cost-model", d / "cm_missing.txt"], ["cm_missing.txt", "attention_flops_per_s missing"]),
        "cost model negative": ([*MODEL, *base, "--cost-model", d / "cm_negative.txt"], ["cm_negative.txt", "line 3", "positive"]),
        "cost model key twice": ([*MODEL, *base, "--cost-model", d / "cm_twice.txt"], ["cm_twice.txt", "given twice"]),
        "cost model no =": ([*MODEL, *base, "--cost-model", d / "cm_noeq.txt"], ["cm_noeq.txt", "key = value"]),
        "cost model ring link half given": ([*MODEL, *base, "--cost-model", d / "cm_half_ring.txt"],
                                            ["cm_half_ring.txt", "ring_link_bytes_per_s and ring_link_latency_s go together"]),
        "bad layer list": ([*MODEL, *base, "-r", "1", "--recompute-layers", "0,x"], ["--recompute-layers"]),
        "layer out of range": ([*MODEL, *base, "-r", "1", "--recompute-layers", "0-5"], ["--recompute-layers", "out of range"]),
        "bad descriptor": (["-e", "d7", *base], ["d7", "unknown model descriptor"]),
        "resume without -o": ([*MODEL, *base, "-y", "1"], ["-y", "-o"]),
        "resume and supersede": ([*MODEL, *base, "-y", "1", "--supersede", "-o", d / "emptydir"], ["-y 1", "--supersede"]),
        "bad tokenizer": ([*MODEL, *base, "--tokenizer", d / "good.bin", "-s", "1"], ["good.bin", "bad magic"]),
        "shape channels/heads": (["-e", "d6", "--channels", "10", "--heads", "3", *base], ["channels 10 not divisible by heads 3"]),
        # numbers that would be narrowed (cast to int) or wrap round
        "every:K at 2^31": ([*MODEL, *base, "-r", "1", "--recompute-layers", "every:2147483648"], ["--recompute-layers", "K in [1, 1]"]),
        "every:K above 2^32": ([*MODEL, *base, "-r", "1", "--recompute-layers", "every:4294967297"], ["--recompute-layers", "K in [1, 1]"]),
        "every:K huge": ([*MODEL, *base, "-r", "1", "--recompute-layers", "every:99999999999999999999"], ["--recompute-layers"]),
        "int flag above 2^32": ([*MODEL, *base, "-n", "4294967297"], ["-n", "out of range"]),
        "mem budget below a byte": ([*MODEL, *base, "--plan", "--mem-budget", "1e-9"], ["--mem-budget", "less than one byte"]),
        "plan beyond 2^64 bytes": (["-e", "d6", "--layers", "4096", "--channels", "65536", "--heads", "1", "--vocab-size", "65536",
                                    "--max-seq-len", "1048576", "-b", "2047", "-t", "1048576", "--plan"], ["exceeds 2^64 bytes"]),
        # header fields out of range
        "model padded vocab": (["-e", d / "model_padded.bin", *base], ["model_padded.bin", "padded vocabulary 1073741824"]),
        "tokenizer eot negative": ([*MODEL, *base, "--tokenizer", d / "tok_eot_negative.bin", "-s", "1"],
                                   ["tok_eot_negative.bin", "end-of-text token 4294967295 out of range"]),
        "tokenizer eot = V": ([*MODEL, *base, "--tokenizer", d / "tok_eot_high.bin", "-s", "1"],
                              ["tok_eot_high.bin", "end-of-text token 64 out of range"]),
        "state rank": ([*MODEL, *base, "-x", "2", "-y", "1", "-o", d / "state_rank"], ["state_00000001_00000.bin", "rank 5 of 1"]),
        "state step": ([*MODEL, *base, "-x", "2", "-y", "1", "-o", d / "state_step"], ["state_00000001_00000.bin", "negative step"]),
        "state params": ([*MODEL, *base, "-x", "2", "-y", "1", "-o", d / "state_params"], ["state_00000001_00000.bin", "parameter count"]),
        "state loader": ([*MODEL, *base, "-x", "2", "-y", "1", "-o", d / "state_shardpos"], ["state_00000001_00000.bin", "dataloader position"]),
    }


CASE_NAMES = list(cases(REPO).keys())


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_input_is_refused_with_one_line(files, case):
    args, needles = cases(files)[case]
    (files / "emptydir").mkdir(exist_ok=True)
    res = run([binary("build/train_gpt_cpu_asan"), *args], timeout=120)
    assert res.returncode == 1, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr}"
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert str(needle) in lines[0], lines[0]


def test_output_path_that_is_a_file_is_refused(files, tmp_path):
    blocker = tmp_path / "file_not_dir"
    blocker.write_text("x")
    res = run([binary("build/train_gpt_cpu_asan"), *MODEL, "-i", files / "good.bin", "-j", "", "-b", "1", "-t", "16",
               "-x", "1", "-s", "0", "-o", blocker])
    assert res.returncode == 1
    assert res.stderr.strip() == f"error: {blocker}: not a directory", res.stderr


@pytest.mark.parametrize("exe", ["train_gpt_cpu", "build/train_gpt_cpu_asan"])
def test_no_half_written_checkpoint_on_failure(files, tmp_path, exe):
    """A checkpoint whose write fails midway (here: the file size limit, as a
    full disk would) stops the run with one line and leaves nothing under any
    name: no model file that looks complete, no DONE marker, no temporary.
    SIGXFSZ is left at its default (subprocess restores it in the child): the
    trainer itself must keep the limit from killing it, the build with MPI
    (started alone: no MPI start-up, whose files the limit would stop) too."""
    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8000, 8000))  # the model file is about 24 KB
    out = tmp_path / "out"
    res = subprocess.run([str(binary(exe)), *MODEL, "-i", str(files / "good.bin"), "-j", "", "-b", "1",
                          "-t", "16", "-x", "1", "-s", "0", "-o", str(out)], capture_output=True, text=True, timeout=120,
                         preexec_fn=limit_file_size, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {out}/model_00000001.bin: write failed (file too large: the file size limit (ulimit -f) is reached)"], \
        res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl"]


def test_nan_in_training_stops_the_run(files, tmp_path):
    """A model whose loss turns NaN stops with one line instead of training on
    garbage (under mpirun every rank stops: see test_multiprocess.py). The
    model is finite (a non-finite one is refused at load): one embedding
    value near the float maximum overflows the forward pass."""
    model = bytearray((files / "model_ok.bin").read_bytes())
    model[1024 + 4 * 70:1024 + 4 * 71] = struct.pack("<f", 3.0e38)  # inside wte
    (tmp_path / "nan.bin").write_bytes(bytes(model))
    res = run([binary("build/train_gpt_cpu_asan"), "-e", tmp_path / "nan.bin", "-i", files / "good.bin", "-j", "",
               "-b", "1", "-t", "16", "-x", "2", "-s", "0"], timeout=120)
    assert res.returncode == 1
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and re.match(r"error: step 1: loss -?nan", lines[0]) and "diverged" in lines[0], res.stderr


@pytest.mark.parametrize("change", ["token", "size"])
def test_shard_changed_during_training_is_refused(tmp_path, change):
    """A shard rewritten after the start-up validation, before the loader
    reaches it: the token check of each batch (same size) or the check at
    reopening (other size) stops the run with one line, never an
    out-of-bounds embedding lookup (ASan would report it)."""
    rng = np.random.default_rng(3)
    first, second = tmp_path / "a_train.bin", tmp_path / "b_train.bin"
    datafile.write_shard(first, rng.integers(0, 64, 16 * 3000 + 1))  # about 3000 steps before the loader switches shards
    datafile.write_shard(second, rng.integers(0, 64, 16 * 100 + 1))
    proc = subprocess.Popen([str(binary("build/train_gpt_cpu_asan")), *MODEL, "-i", str(tmp_path / "*_train.bin"), "-j", "",
                             "-b", "1", "-t", "16", "-x", "3050", "-s", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        if line.startswith("step "):
            break
    tokens = rng.integers(0, 64, 16 * 100 + 1 if change == "token" else 16 * 50 + 1)
    tokens[200] = 64 if change == "token" else tokens[200]
    datafile.write_shard(second, tokens)
    out, err = proc.communicate(timeout=300)
    assert "step 3000/3050" in out, "the shard was rewritten too late to test anything"
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    expected = "token 64 at position 200" if change == "token" else "now holds 801 tokens, 1601"
    assert len(lines) == 1 and str(second) in lines[0] and expected in lines[0], err
