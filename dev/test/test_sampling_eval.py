"""Prompted sampling (--prompt, --prompt-tokens, --temperature, --top-k, UTF-8
output), --eval-by-position and --wpe-init, through the CPU trainer, against
the float64 numpy forward of test_hf_gpt2.py (Hugging Face's layout, imported
with dev/data/hf_gpt2.py)."""
import json
import re
import sys

import numpy as np
import pytest

from conftest import REPO, binary, datafile, run
from test_hf_gpt2 import HF_CONFIG, hf_logprobs, hf_state, hf_token_losses, hf_tool, write_hf

V, NPOS = HF_CONFIG["vocab_size"], HF_CONFIG["n_positions"]
SAMPLE = re.compile(r"^sample at step \d+:\n---\n(.*?)\n---$", re.M | re.S)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random GPT-2 (sharp enough distributions: no near-ties) as a model file, its
    state dict, and a data folder without a tokenizer (samples print <id>)."""
    d = tmp_path_factory.mktemp("sampling")
    state = hf_state(np.random.default_rng(31))
    assert hf_tool("import", write_hf(d / "hf", state), d / "m.bin").returncode == 0
    (d / "data").mkdir()
    toks = np.random.default_rng(32).integers(0, V, 4 * NPOS + 1)
    datafile.write_shard(d / "data" / "val.bin", toks)
    return d / "m.bin", state, d / "data" / "val.bin", toks


def sample_ids(stdout):
    return [int(x) for x in re.findall(r"<(\d+)>", SAMPLE.search(stdout).group(1))]


def sample_run(model_path, shard, *flags, tokenizer=None):
    args = [binary("train_gpt_cpu"), "-e", model_path, "-i", shard, "-j", "", "-b", 1, "-t", NPOS, "-x", 0, "-s", 1,
            "--seed", 5, *flags]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    return run(args, check=True).stdout


def test_temperature_zero_is_argmax_of_the_reference(tmp_path, model):
    path, state, shard, _ = model
    prompt = [11, 42, 7]
    (tmp_path / "p.txt").write_text("11, 42\n7\n")
    ids = sample_ids(sample_run(path, shard, "--prompt-tokens", tmp_path / "p.txt", "--temperature", 0, "-g", 12))
    assert ids[:3] == prompt  # the prompt is printed first
    context = [V - 1] + ids  # samples start from end-of-text (V-1 without a GPT-2 tokenizer)
    assert len(ids) == 3 + 12
    for i in range(4, len(context)):
        logp = hf_logprobs(state, np.array([context[:i]]))[0, -1]
        top2 = np.sort(logp)[-2:]
        assert top2[1] - top2[0] > 1e-4, "near-tie: the test's model is not sharp enough"
        assert context[i] == int(np.argmax(logp)), f"token {i}: {context[i]} is not the argmax {np.argmax(logp)}"


def test_top_k_never_samples_outside_the_k_most_probable(tmp_path, model):
    path, state, shard, _ = model
    (tmp_path / "p.txt").write_text("5")
    ids = []
    for seed in range(3):
        out = sample_run(path, shard, "--prompt-tokens", tmp_path / "p.txt", "--temperature", 2.0, "--top-k", 3,
                         "-g", 20, "--seed", seed)
        ids.append(sample_ids(out))
    ranks = []
    for seq in ids:
        context = [V - 1] + seq
        logp = hf_logprobs(state, np.array([context[:-1]]))[0]  # row i-1 predicts context[i]
        for i in range(2, len(context)):
            order = list(np.argsort(-logp[i - 1]))
            ranks.append(order.index(context[i]))
    assert max(ranks) < 3, ranks
    assert min(ranks) == 0 and len(set(ranks)) > 1, ranks  # at temperature 2 not every draw is the argmax


def byte_tokenizer(path):
    """A byte-level tokenizer: the 256 bytes, then end-of-text (id 256)."""
    datafile.write_tokenizer(path, [bytes([b]) for b in range(256)] + [b"<|eot|>"], 256)


def expected_text(ids):
    """What the trainer must print: bytes as UTF-8 with every invalid or
    incomplete sequence as U+FFFD (Python's errors='replace'), and lone control
    bytes as <id>."""
    out, run_bytes = [], bytearray()
    for t in ids:
        if t < 32 and t not in (9, 10, 13):
            out.append(run_bytes.decode("utf-8", "replace") + f"<{t}>")
            run_bytes = bytearray()
        else:
            run_bytes.append(t)
    return "".join(out) + run_bytes.decode("utf-8", "replace")


def test_utf8_output_is_valid_for_byte_level_tokens(tmp_path):
    d = tmp_path
    state = hf_state(np.random.default_rng(33))
    cfg = dict(HF_CONFIG, vocab_size=257)
    state = {**state, "transformer.wte.weight": np.random.default_rng(34).standard_normal((257, 32)).astype(np.float32) * 0.5}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    assert hf_tool("import", write_hf(d / "hf", state, cfg), d / "m.bin").returncode == 0
    byte_tokenizer(d / "bytes.bin")
    datafile.write_shard(d / "val.bin", np.zeros(NPOS + 1, np.uint16))
    euro = list("€".encode())  # split over three byte tokens
    (d / "p.txt").write_text(" ".join(map(str, [0x61, *euro, 0x62])))
    texts, idss = [], []
    for seed in range(4):
        flags = ("--prompt-tokens", d / "p.txt", "-g", 25, "--seed", seed, "--temperature", 1.5)
        raw = run([binary("train_gpt_cpu"), "-e", d / "m.bin", "-i", d / "val.bin", "-j", "", "-b", 1, "-t", NPOS,
                   "-x", 0, "-s", 1, "--tokenizer", d / "bytes.bin", *flags], check=True)
        ids = run([binary("train_gpt_cpu"), "-e", d / "m.bin", "-i", d / "val.bin", "-j", "", "-b", 1, "-t", NPOS,
                   "-x", 0, "-s", 1, *flags], check=True)
        text = SAMPLE.search(raw.stdout).group(1)  # run() decodes strictly: invalid UTF-8 would have raised
        texts.append(text)
        idss.append(sample_ids(ids.stdout))
        assert text.startswith("a€b")
        assert text == expected_text(idss[-1]), (text, idss[-1])
    assert any(t >= 0x80 for s in idss for t in s[5:]), "no high bytes sampled: the test checked nothing"


def test_prompt_text_through_the_helper(tmp_path, synthetic):
    """--prompt TEXT runs dev/data/prompt.py: for the synthetic vocabulary (words with a
    leading space) its ids are the words', the same as --prompt-tokens with those ids."""
    data, meta = synthetic
    vocab, eot = datafile.read_tokenizer(data / "synthetic_tokenizer.bin")
    words = [3, 17, 101]
    text = "".join(vocab[w].decode() for w in words)
    common = [binary("train_gpt_cpu"), "-e", "d6", "--layers", 1, "--channels", 32, "--heads", 4, "--vocab-size",
              meta["vocab_size"], "--max-seq-len", 32, "-i", data / "synthetic_train.bin", "-j", "", "-b", 1, "-t",
              32, "-x", 0, "-s", 1, "-g", 8]
    by_text = run([*common, "--prompt", text], check=True).stdout
    (tmp_path / "p.txt").write_text(" ".join(map(str, words)))
    by_ids = run([*common, "--prompt-tokens", tmp_path / "p.txt"], check=True).stdout
    assert SAMPLE.search(by_text).group(1).startswith(text)
    assert SAMPLE.search(by_text).group(1) == SAMPLE.search(by_ids).group(1)


def test_prompt_helper_gpt2_ids():
    ranks = REPO.parent / "shared" / "data" / "gpt2.tiktoken"
    if not ranks.exists():
        pytest.skip(f"{ranks} is absent (the GPT-2 ranks file for offline tiktoken)")
    pytest.importorskip("tiktoken")
    res = run([sys.executable, REPO / "dev" / "data" / "prompt.py", "--tiktoken-file", ranks, "Hello world"], check=True)
    assert res.stdout.split() == ["15496", "995"]


@pytest.mark.parametrize("case,message", [
    ("too_long", "leave no room to generate"), ("out_of_vocab", "is not below the vocabulary size"),
    ("garbage", "is not part of a token id"), ("both", "give one of them"),
])
def test_bad_prompts_are_refused(tmp_path, model, case, message):
    path, _, shard, _ = model
    f = tmp_path / "p.txt"
    f.write_text({"too_long": " ".join(["1"] * NPOS), "out_of_vocab": f"3 {V}", "garbage": "3 x"}.get(case, "3"))
    extra = ["--prompt", "hi"] if case == "both" else []
    res = run([binary("train_gpt_cpu"), "-e", path, "-i", shard, "-j", "", "-b", 1, "-t", NPOS, "-x", 0, "-s", 1,
               "--prompt-tokens", f, *extra])
    assert res.returncode != 0 and message in res.stderr, res.stderr


def test_position_buckets_average_to_the_validation_loss(tmp_path, model):
    path, state, shard, toks = model
    out = run([binary("train_gpt_cpu"), "-e", path, "-i", shard, "-j", shard, "-b", 2, "-t", NPOS, "-x", 0, "-v", 1,
               "-m", 2, "-s", 0, "--eval-by-position", 4, "-o", tmp_path / "run"], check=True).stdout
    overall = float(re.search(r"^val loss ([0-9.]+) at step 0$", out, re.M).group(1))
    line = re.search(r"^val loss by position at step 0: (.*)$", out, re.M).group(1)
    buckets = [(int(a), int(b), float(x)) for a, b, x in re.findall(r"(\d+)-(\d+) ([0-9.]+)", line)]
    assert [(a, b) for a, b, _ in buckets] == [(0, 4), (4, 8), (8, 16), (16, 32)]
    weighted = sum((b - a) * x for a, b, x in buckets) / NPOS
    assert abs(weighted - overall) < 5e-6, (weighted, overall)
    # and each bucket is the reference's mean loss over those positions of the 2 batches of 2 rows
    n = 4 * NPOS
    ref = hf_token_losses(state, toks[:n].reshape(4, NPOS), toks[1:n + 1].reshape(4, NPOS))
    for a, b, x in buckets:
        assert abs(x - ref[:, a:b].mean()) < 2e-5 * x, (a, b, x, ref[:, a:b].mean())
    logged = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    by_pos = [e for e in logged if "val_loss_by_position" in e][0]["val_loss_by_position"]
    assert [(e["begin"], e["end"], e["tokens"]) for e in by_pos] == [(a, b, 4 * (b - a)) for a, b, _ in buckets]


@pytest.mark.parametrize("mode", ["tile", "interpolate"])
def test_wpe_init_extends_the_position_table(tmp_path, model, mode):
    path, _, shard, _ = model
    _, params, _ = datafile.read_model(path)
    datafile.write_shard(tmp_path / "t.bin", np.random.default_rng(2).integers(0, V, 2 * 96 + 1))
    out = run([binary("train_gpt_cpu"), "-e", path, "--max-seq-len", 96, "--wpe-init", mode, "-i", tmp_path / "t.bin",
               "-j", "", "-b", 1, "-t", 96, "-x", 1, "-l", 0, "-s", 0, "-o", tmp_path / "run"], check=True).stdout
    assert ("interpolated" if mode == "interpolate" else "repeated") in out
    _, new, _ = datafile.read_model(tmp_path / "run" / "model_00000001.bin")  # -l 0: the loaded weights unchanged
    old = params["wpe"]
    if mode == "tile":
        expected = old[np.arange(96) % NPOS]
    else:
        x = np.linspace(0, NPOS - 1, 96)
        expected = np.stack([np.interp(x, np.arange(NPOS), old[:, c]) for c in range(old.shape[1])], axis=1)
    assert np.allclose(new["wpe"], expected, atol=1e-6), np.abs(new["wpe"] - expected).max()
    assert np.array_equal(new["wte"], params["wte"])


def test_unknown_descriptor_is_named(tmp_path):
    res = run([binary("train_gpt_cpu"), "-e", "d7", "-x", 0])
    assert res.returncode != 0 and "unknown model descriptor 'd7'" in res.stderr, res.stderr
    res = run([binary("train_gpt_cpu"), "-e", tmp_path / "missing.bin", "-x", 0])
    assert res.returncode != 0 and "unknown model descriptor" not in res.stderr and "missing.bin" in res.stderr


@pytest.mark.parametrize("flags,message", [
    (["--prompt-tokens", "p.txt", "-s", 0], "-s 0 takes no samples"),
    (["--eval-by-position", 8, "-j", ""], "needs validation"),
    (["--wpe-init", "cubic"], "is not tile or interpolate"),
])
def test_flag_combinations_that_do_nothing_are_refused(tmp_path, model, flags, message):
    path, _, shard, _ = model
    (tmp_path / "p.txt").write_text("3")
    flags = [tmp_path / "p.txt" if f == "p.txt" else f for f in flags]
    res = run([binary("train_gpt_cpu"), "-e", path, "-i", shard, "-j", "", "-b", 1, "-t", NPOS, "-x", 0, *flags])
    assert res.returncode != 0 and message in res.stderr, res.stderr
