"""--eval-by-position under --reset-position-ids buckets by the position
within the document (llmc/run/run_eval.h): a bucket no token falls in (here
positions 16 to 31, past every document of the validation shard) prints as
having no tokens, "- top1 - (0 tokens)", never "nan", and the JSON log
carries it as loss null, top1 null, tokens 0. The buckets that have tokens
hold all of them: their token-weighted mean is the validation loss."""
import json
import re

import numpy as np

from conftest import binary, run
import datafile

EOT, T = 63, 32
MODEL = ["-e", "d6", "--layers", "1", "--channels", "16", "--heads", "2", "--vocab-size", "64", "--max-seq-len", str(T)]
BUCKET_RE = re.compile(r"(\d+)-(\d+) (\S+) top1 (\S+)( \(0 tokens\))?")


def short_documents(n, rng):
    """Documents of 1 to 12 tokens (end of text first), n tokens in all."""
    tokens = rng.integers(0, EOT, n)
    p = 0
    while p < n:
        tokens[p] = EOT
        p += int(rng.integers(1, 13))
    return tokens


def evaluate(tmp_path, out, *flags):
    rng = np.random.default_rng(4)
    datafile.write_shard(tmp_path / "train.bin", short_documents(4000, rng))
    datafile.write_shard(tmp_path / "val.bin", short_documents(T * 8 + 1, rng))
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", tmp_path / "train.bin", "-j", tmp_path / "val.bin", "-t", str(T), "-b", "2",
               "-x", "1", "-v", "1", "-m", "4", "-s", "0", "--eot-token", str(EOT), "--eval-by-position", "every:8", "-o", out, *flags],
              env={"OMP_NUM_THREADS": "1"}, check=True)
    line = re.search(r"val loss by position at step 1: (.*)", res.stdout).group(1)
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    return res.stdout, BUCKET_RE.findall(line), [r for r in log if "val_loss_by_position" in r and r["step"] == 1][0]


def test_empty_bucket_has_no_tokens_not_nan(tmp_path):
    stdout, buckets, rec = evaluate(tmp_path, tmp_path / "reset", "--reset-position-ids")
    assert "nan" not in stdout.lower()
    assert [(b, e) for b, e, *_ in buckets] == [("0", "8"), ("8", "16"), ("16", "24"), ("24", "32")]
    assert [x[2] for x in buckets[2:]] == ["-", "-"] and [x[3] for x in buckets[2:]] == ["-", "-"] and all(x[4] for x in buckets[2:])
    assert all(float(x[2]) > 0 and not x[4] for x in buckets[:2])
    js = rec["val_loss_by_position"]
    assert [b["tokens"] for b in js[2:]] == [0, 0] and all(b["loss"] is None and b["top1"] is None for b in js[2:])
    assert sum(b["tokens"] for b in js[:2]) == 2 * T * 4  # every token of the 4 batches in the first two buckets
    mean = sum(b["loss"] * b["tokens"] for b in js[:2]) / sum(b["tokens"] for b in js[:2])
    val = float(re.search(r"val loss ([0-9.]+) at step 1", stdout).group(1))
    assert abs(mean - val) <= 1e-5 * val
    # without reset positions every bucket has tokens (the check can tell the cases apart)
    _, plain, _ = evaluate(tmp_path, tmp_path / "plain", "--reset-attention-mask")
    assert len(plain) == 4 and all(x[2] != "-" and not x[4] for x in plain)
