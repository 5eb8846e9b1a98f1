"""dev/data/hf_tokenize.py: text to llama-3 token shards with a model's own
tokenizer.json. The tokenizers are made here with the `tokenizers` package (a
small byte-level BPE trained on the test's text; nothing is downloaded). Shards
are checked with struct against docs/FORMATS.md, their ids against the
tokenizer's own encoding of each document, and the tokenizer file by decoding
every document's ids back to its exact UTF-8 bytes."""
import json
import struct
import sys

import numpy as np
import pytest

from conftest import REPO, binary, datafile, run

tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed (dev/data/requirements.txt)")

SCRIPT = REPO / "dev" / "data" / "hf_tokenize.py"
DOCS = ["The quick brown fox jumps over the lazy dog.", "Une d\u00e9j\u00e0-vu na\u00efve \u00e0 l'\u00e9cole.",
        "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002 tabs\tand\nnewlines",
        "numbers 12345 and symbols <>&%$", "short", "A longer document that says the same thing twice, twice, twice."]
SPECIALS = {"llama": ["<|begin_of_text|>", "<|end_of_text|>"], "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}


def make_tokenizer(d, family, vocab=400, config=True, model_vocab=None):
    """A byte-level BPE tokenizer.json (and config.json) in directory d."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS[family], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 20, trainer)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    if config:
        bos = tok.token_to_id(SPECIALS[family][0])
        (d / "config.json").write_text(json.dumps({"model_type": family, "vocab_size": model_vocab or tok.get_vocab_size(),
                                                   "bos_token_id": bos, "eos_token_id": bos + 1}))
    return tok


def tool(*args):
    return run([sys.executable, SCRIPT, *map(str, args)])


def shard_tokens(path):
    raw = path.read_bytes()
    magic, version, n = struct.unpack("<3i", raw[:12])
    assert (magic, version) == (20240801, 7) and len(raw) == 1024 + 4 * n and not any(raw[12:1024])
    return list(struct.unpack(f"<{n}I", raw[1024:]))


def write_inputs(d):
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[:4])))
    (d / "rest.txt").write_text("\n\n".join(DOCS[4:]))
    return [d / "docs.jsonl", d / "rest.txt"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shards_hold_each_document_after_the_familys_delimiter(tmp_path, family):
    tok = make_tokenizer(tmp_path / "model", family)
    inputs = write_inputs(tmp_path)
    res = tool("--tokenizer", tmp_path / "model", *inputs, "--doc-separator", "\n\n", "--val-docs", 2, "--shard-tokens", 40,
               "--output-dir", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    delim = tok.token_to_id({"llama": "<|begin_of_text|>", "qwen2": "<|endoftext|>"}[family])
    stream = [t for doc in DOCS for t in [delim] + tok.encode(doc, add_special_tokens=False).ids]
    n_val = sum(1 + len(tok.encode(doc, add_special_tokens=False).ids) for doc in DOCS[:2])
    assert shard_tokens(tmp_path / "out" / f"{family}_val.bin") == stream[:n_val]
    shards = sorted((tmp_path / "out").glob(f"{family}_train_*.bin"))
    train = [shard_tokens(s) for s in shards]
    assert [len(t) for t in train[:-1]] == [40] * (len(train) - 1) and 0 < len(train[-1]) <= 40
    assert sum(train, []) == stream[n_val:]
    assert datafile.read_shard(shards[0]).dtype == np.uint32


def test_tokenizer_file_decodes_documents_to_their_bytes(tmp_path):
    """Byte-level BPE is lossless: each document's ids, decoded through the
    tokenizer file (in Python and through the trainers' C reader), give back its
    UTF-8 bytes exactly; the delimiter is the file's end of text; ids the tokenizer
    does not use (the model's vocabulary 70,000 is larger) decode as <|ID|>."""
    tok = make_tokenizer(tmp_path / "model", "llama", model_vocab=70_000)
    res = tool("--tokenizer", tmp_path / "model" / "tokenizer.json", *write_inputs(tmp_path), "--doc-separator", "\n\n",
               "--output-dir", tmp_path / "out", "--prefix", "t")
    assert res.returncode == 0, res.stderr
    table, eot = datafile.read_tokenizer(tmp_path / "out" / "t_tokenizer.bin")
    assert len(table) == 70_000 and eot == tok.token_to_id("<|begin_of_text|>") and table[eot] == b"<|begin_of_text|>"
    assert table[69_999] == b"<|69999|>"
    for doc in DOCS:
        assert b"".join(table[i] for i in tok.encode(doc, add_special_tokens=False).ids) == doc.encode("utf-8")
    c = run([binary("build/read_data"), "tokenizer", tmp_path / "out" / "t_tokenizer.bin"], check=True).stdout.splitlines()
    assert c[0] == f"eot {eot}" and c[1] == "vocab 70000"
    assert [bytes.fromhex(line.split(" ", 1)[1]) for line in c[2:]] == table


def test_prompt_uses_the_tokenizer_json_beside_the_tokenizer_file(tmp_path):
    tok = make_tokenizer(tmp_path / "model", "qwen2")
    assert tool("--tokenizer", tmp_path / "model", *write_inputs(tmp_path), "--output-dir", tmp_path / "out").returncode == 0
    text = "The lazy fox, na\u00efve."
    res = run([sys.executable, REPO / "dev/data/prompt.py", "--tokenizer", tmp_path / "out" / "qwen2_tokenizer.bin", "--", text],
              check=True)
    assert list(map(int, res.stdout.split())) == tok.encode(text, add_special_tokens=False).ids


def test_min_tokens_and_seed(tmp_path):
    tok = make_tokenizer(tmp_path / "model", "llama")
    lengths = [1 + len(tok.encode(d, add_special_tokens=False).ids) for d in DOCS]
    keep = sorted(lengths)[2]
    res = tool("--tokenizer", tmp_path / "model", *write_inputs(tmp_path), "--doc-separator", "\n\n", "--min-tokens", keep,
               "--seed", 3, "--output-dir", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    got = shard_tokens(tmp_path / "out" / "llama_train_000000.bin")
    delim = tok.token_to_id("<|begin_of_text|>")
    cuts = [i for i, t in enumerate(got) if t == delim] + [len(got)]
    docs = sorted(tuple(got[a:b]) for a, b in zip(cuts, cuts[1:]))
    want = sorted(tuple([delim] + tok.encode(d, add_special_tokens=False).ids) for d, n in zip(DOCS, lengths) if n >= keep)
    assert docs == want and len(docs) == sum(n >= keep for n in lengths)


@pytest.mark.parametrize("case, why", [
    ("no family", "give --family llama or qwen2"),
    ("bad delimiter", "--delimiter '<|nope|>' is not a token"),
    ("no tokenizer", "no tokenizer.json"),
    ("bad jsonl", "docs.jsonl:2: no string field 'text'"),
    ("vocab too small", "must hold the tokenizer's"),
    ("all for validation", "no training document of at least 1 tokens (of 6; --val-docs took 6)"),
])
def test_refusals_are_one_line(tmp_path, case, why):
    make_tokenizer(tmp_path / "model", "llama", config=case != "no family")
    inputs = write_inputs(tmp_path)
    args = ["--tokenizer", tmp_path / ("nowhere" if case == "no tokenizer" else "model"), *inputs, "--output-dir", tmp_path / "out"]
    if case == "bad delimiter":
        args += ["--delimiter", "<|nope|>"]
    if case == "bad jsonl":
        (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    if case == "vocab too small":
        args += ["--vocab-size", 10]
    if case == "all for validation":
        args += ["--val-docs", 6, "--doc-separator", "\n\n"]
    res = tool(*args)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1 and why in res.stderr, res.stderr
    assert not list((tmp_path / "out").glob("*.bin"))  # a missing folder globs to nothing too
