#!/usr/bin/env python3
"""Passkey retrieval by distance: evaluation shards, and the report of a
model's accuracy and loss on the answer tokens by how far back the key is.

The task of the long-context papers (position interpolation, LongLoRA): a
long stretch of filler, a key sentence at a chosen depth, and at the end a
question whose answer is the key. Retrieval at distance d means the model
finds the key d tokens back; a model that uses its new positions retrieves
at the distances only the longer context reaches.

  make   writes OUT/passkey.bin (a token shard of samples of exactly T tokens,
         one per validation row) and OUT/passkey.json (each sample's answer
         tokens, their positions and the key's distance; docs/FORMATS.md).
         --gpt2: GPT-2 tokens (English filler, "The pass key is 52713." and
         "What is the pass key? The pass key is 52713"); --vocab V: a small
         vocabulary for tests and toy models (random filler, a marker, a key
         from an alphabet of --keys tokens, the question marker, the key).
  eval   reads a trainer's --eval-dump of those rows (--dump FILE), or runs
         the trainer command given after -- with the flags that evaluate the
         shard once (-x 0 -v 1 -b 1 -t T -j OUT/passkey.bin --eval-dump ...),
         and prints per distance bucket: samples, accuracy (every answer
         token the model's top-1), token accuracy and the mean answer loss.

  python3 dev/data/passkey.py make data/passkey_8k --gpt2 --seq-len 8192 --samples-per-depth 8
  python3 dev/data/passkey.py eval data/passkey_8k -- ./train_gpt -e model.bin --max-seq-len 8192 -r auto
  mpirun -np 2 ... : python3 dev/data/passkey.py eval data/passkey_8k -- mpirun -np 2 ./train_gpt_cpu -e m.bin --context-parallel 2

Every flag the trainer takes works in the command (-r, --tile-tokens,
--context-parallel); those that choose the data or the evaluation (-x -v -s
-b -t -m -j --eval-dump) are the script's, and a command that gives one is
refused (to evaluate otherwise, run the trainer with --eval-dump and read the
file with --dump). Validation rows are contiguous (docs/FORMATS.md): row r's inputs are
sample r's T tokens, its last target the next sample's first token, so each
sample ends with its answer and never needs a token of the next.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datafile as df  # noqa: E402

META_FORMAT = "remat passkey"
META_VERSION = 1

# Small-vocabulary form: token ids.
SMALL_EOT, SMALL_MARKER, SMALL_QUESTION, SMALL_KEY0 = 0, 1, 2, 3

FILLER = (
    "The river kept its slow course past the mill. Rain came in the afternoon and left by evening. "
    "A cart went up the hill with bread for the village. The old clock in the square struck the hour. "
    "Children counted stones along the road. Someone lit a lamp in the window of the inn. "
    "The wind turned and the smoke from the chimneys leaned east. Bells rang far off across the fields. "
)


def parse_depths(text: str) -> list[float]:
    try:
        depths = [float(x) for x in text.split(",")]
    except ValueError:
        raise df.DataError(f"--depths {text}: not a comma-separated list of fractions") from None
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise df.DataError(f"--depths {text}: each depth is a fraction of the context in [0, 1]")
    return depths


class Gpt2Form:
    """English filler, a key sentence, the question; the key a 5-digit number."""

    def __init__(self, enc):
        self.enc = enc
        self.filler = np.array(enc.encode_ordinary(FILLER * 8), dtype=np.int64)
        self.vocab_size = df.GPT2_VOCAB_SIZE
        self.eot = df.GPT2_EOT

    def pieces(self, rng):
        key = int(rng.integers(10000, 100000))
        sentence = self.enc.encode_ordinary(f" The pass key is {key}. Remember it. {key} is the pass key.")
        question = self.enc.encode_ordinary(" What is the pass key? The pass key is")
        answer = self.enc.encode_ordinary(f" {key}")
        key_at = len(self.enc.encode_ordinary(" The pass key is"))  # the key's first token inside the sentence
        return sentence, key_at, question, answer

    def fill(self, n, rng):
        start = int(rng.integers(0, len(self.filler)))
        return np.resize(np.roll(self.filler, -start), n)


class SmallForm:
    """Tokens 0 (end of text), 1 (marker), 2 (question), 3..3+K-1 (keys), the rest filler (in turn)."""

    def __init__(self, vocab_size, keys, key_len, keys_from_filler=False):
        if keys < 2 or SMALL_KEY0 + keys >= vocab_size:
            raise df.DataError(f"--keys {keys}: need 2 or more, and fewer than --vocab {vocab_size} less 4 (room for filler)")
        if key_len < 1:
            raise df.DataError(f"--key-len {key_len}: at least 1")
        self.vocab_size, self.keys, self.key_len = vocab_size, keys, key_len
        self.eot = SMALL_EOT
        # keys drawn from the filler's tokens: only the marker before it tells the key
        # apart, so retrieval needs position (an induction head), not token identity alone
        self.key_first, self.key_count = (SMALL_KEY0 + keys, vocab_size - SMALL_KEY0 - keys) if keys_from_filler \
            else (SMALL_KEY0, keys)

    def pieces(self, rng):
        key = list(self.key_first + rng.integers(0, self.key_count, self.key_len))
        return [SMALL_MARKER, *key], 1, [SMALL_QUESTION], key

    def fill(self, n, rng):
        """The filler tokens in turn from a random one: predictable, so that a
        small model's loss and gradients are about the key, not the filler."""
        first, count = SMALL_KEY0 + self.keys, self.vocab_size - SMALL_KEY0 - self.keys
        return first + (int(rng.integers(0, count)) + np.arange(n)) % count


def make_sample(form, T, depth, rng):
    """T tokens: end of text, filler, the key sentence at `depth` of the
    filler, more filler, the question, the answer (the sample's last tokens)."""
    sentence, key_at, question, answer = form.pieces(rng)
    filler = T - 1 - len(sentence) - len(question) - len(answer)
    if filler < 0:
        raise df.DataError(f"--seq-len {T}: too short for the key sentence, the question and the answer "
                           f"({T - filler} tokens)")
    before = int(round(depth * filler))
    tokens = np.concatenate([[form.eot], form.fill(before, rng), sentence, form.fill(filler - before, rng), question, answer])
    assert len(tokens) == T
    first = T - len(answer)  # offset of the answer's first token; the position predicting it is one less
    positions = list(range(first - 1, T - 1))
    key_position = 1 + before + key_at
    return tokens.astype(np.int64), {
        "depth": depth,
        "key_position": key_position,
        "answer_positions": positions,
        "answer_tokens": [int(t) for t in answer],
        "distance": positions[0] - key_position,
    }


def cmd_make(args):
    if args.gpt2:
        form = Gpt2Form(df.gpt2_encoding(args.tiktoken_file))
    else:
        form = SmallForm(args.vocab, args.keys, args.key_len, args.keys_from_filler)
    rng = np.random.default_rng(args.seed)
    rows, samples = [], []
    if args.depths == "random":
        depths = list(rng.random(args.samples))
    else:
        depths = [d for d in parse_depths(args.depths) for _ in range(args.samples_per_depth)]
    for d in depths:
        tokens, meta = make_sample(form, args.seq_len, float(d), rng)
        rows.append(tokens)
        samples.append(meta)
    stream = np.concatenate([*rows, [form.eot]])  # the last row's last target
    out = df.make_output_dir(args.out_dir, "OUT_DIR")  # only now: a refused request leaves nothing behind
    df.write_shard(out / "passkey.bin", stream, version=df.shard_version_for(form.vocab_size))
    meta = {"format": META_FORMAT, "version": META_VERSION, "seq_len": args.seq_len, "vocab_size": form.vocab_size,
            "form": "gpt2" if args.gpt2 else "small", "chance": None if args.gpt2 else 1.0 / form.key_count ** args.key_len,
            "shard": "passkey.bin", "samples": samples}
    (out / "passkey.json").write_text(json.dumps(meta, indent=1) + "\n")
    dist = [s["distance"] for s in samples]
    print(f"passkey: {len(samples)} samples of {args.seq_len} tokens, key distances {min(dist)}-{max(dist)}, "
          f"written to {out / 'passkey.bin'} and {out / 'passkey.json'}")


def distance_buckets(spec, distances):
    if spec:
        try:
            edges = [int(x) for x in spec.split(",")]
        except ValueError:
            raise df.DataError(f"--buckets {spec}: not a comma-separated list of integers") from None
        if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise df.DataError(f"--buckets {spec}: at least two increasing edges")
        return list(zip(edges, edges[1:]))
    return [(d, d + 1) for d in sorted(set(distances))]  # one bucket per distance made


def report(meta, dump, bucket_spec):
    """Rows of (begin, end, samples, accuracy, token accuracy, answer loss)."""
    samples = meta["samples"]
    if dump["T"] != meta["seq_len"]:
        raise df.DataError(f"the dump's T is {dump['T']}, the passkey data's {meta['seq_len']}: evaluate with -t {meta['seq_len']}")
    if dump["sequences"] < len(samples):
        raise df.DataError(f"the dump holds {dump['sequences']} sequences, the data {len(samples)} samples: evaluate them all "
                           "(-m at least the samples / (B x data-parallel groups))")
    per = []
    for i, s in enumerate(samples):
        pos = s["answer_positions"]
        if list(dump["target"][i, pos]) != s["answer_tokens"]:
            raise df.DataError(f"sample {i}: the dump's targets at the answer are {list(dump['target'][i, pos])}, the data's "
                               f"{s['answer_tokens']}: not a dump of this passkey shard")
        if (dump["position"][i, pos] < 0).any():
            raise df.DataError(f"sample {i}: the dump did not count the answer's tokens (the trainer's --eod-mask-loss skips "
                               "tokens whose input is end of text): evaluate without it")
        hits = dump["top1"][i, pos] == dump["target"][i, pos]
        per.append((s["distance"], bool(hits.all()), float(hits.mean()), float(dump["loss"][i, pos].mean())))
    rows = []
    for a, b in distance_buckets(bucket_spec, [p[0] for p in per]):
        inside = [p for p in per if a <= p[0] < b]
        if inside:
            rows.append((a, b, len(inside), np.mean([p[1] for p in inside]), np.mean([p[2] for p in inside]),
                         np.mean([p[3] for p in inside])))
    return rows


SCRIPT_FLAGS = ["-x", "-v", "-s", "-b", "-t", "-m", "-j", "--eval-dump"]  # the evaluation run_trainer sets


def check_command(command):
    """The trainer's flags in `command` (those after the trainer's own name,
    so a launcher's -x is not one) must leave the evaluation's to the
    script: refused, not silently overridden."""
    names = [i for i, a in enumerate(command) if Path(a).name.startswith("train_gpt")]
    for arg in command[names[-1] + 1 if names else 0:]:
        flag = arg.split("=", 1)[0]
        if flag in SCRIPT_FLAGS:
            raise df.DataError(f"the trainer command gives {flag}: passkey.py eval sets {' '.join(SCRIPT_FLAGS)} itself (one "
                               "evaluation of every sample at the data's T, into its own dump): drop it, or run the trainer "
                               "yourself with --eval-dump and give that file as --dump")


def run_trainer(meta_dir, meta, command, dump_path):
    check_command(command)
    flags = ["-x", "0", "-v", "1", "-s", "0", "-b", "1", "-t", str(meta["seq_len"]), "-m", str(len(meta["samples"])),
             "-j", str(Path(meta_dir) / meta["shard"]), "--eval-dump", str(dump_path)]
    res = subprocess.run([*command, *flags], capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise df.DataError(f"the trainer exited {res.returncode}: {last[0]}")
    return res.stdout


def cmd_eval(args):
    meta_dir = Path(args.data)
    meta = json.loads((meta_dir / "passkey.json").read_text())
    if meta.get("format") != META_FORMAT or meta.get("version") != META_VERSION:
        raise df.DataError(f"{meta_dir / 'passkey.json'}: not passkey metadata of version {META_VERSION}")
    command = args.command
    if bool(args.dump) == bool(command):
        raise df.DataError("give the dump of an evaluation (--dump FILE) or a trainer command after --, one of them")
    if command:
        with tempfile.TemporaryDirectory() as tmp:
            run_trainer(meta_dir, meta, command, Path(tmp) / "dump.bin")
            dump = df.read_eval_dump(Path(tmp) / "dump.bin")
    else:
        dump = df.read_eval_dump(args.dump)
    rows = report(meta, dump, args.buckets)
    chance = meta.get("chance")
    print(f"passkey retrieval at step {dump['step']} ({len(meta['samples'])} samples of {meta['seq_len']} tokens"
          + (f"; chance {chance:.4f}" if chance else "") + ")")
    print(f"{'distance':>14} {'samples':>8} {'accuracy':>9} {'token acc':>10} {'answer loss':>12}")
    for a, b, n, acc, tok, loss in rows:
        print(f"{f'{a}' if b == a + 1 else f'{a}-{b - 1}':>14} {n:>8} {acc:>9.4f} {tok:>10.4f} {loss:>12.6f}")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(["begin", "end", "samples", "accuracy", "token_accuracy", "loss"],
                                                        [a, b, n, float(acc), float(tok), float(loss)]))
                                               for a, b, n, acc, tok, loss in rows]) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s make OUT_DIR --seq-len T [...] | %(prog)s eval DATA_DIR [--dump FILE] [-- TRAINER FLAGS]")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write passkey samples as a token shard and their metadata")
    m.add_argument("out_dir", metavar="OUT_DIR")
    m.add_argument("--seq-len", type=int, required=True, help="T: tokens per sample (one validation row each)")
    m.add_argument("--depths", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
                   help="where the key sentence starts, as fractions of the filler (0: first, 1: just before the question); "
                        "'random': uniform, one per sample (training data)")
    m.add_argument("--samples-per-depth", type=int, default=4)
    m.add_argument("--samples", type=int, default=1000, help="with --depths random: how many")
    m.add_argument("--seed", type=int, default=0)
    form = m.add_mutually_exclusive_group()
    form.add_argument("--gpt2", action="store_true", help="GPT-2 tokens (needs tiktoken)")
    form.add_argument("--vocab", type=int, default=64, help="small-vocabulary form: V (default 64)")
    m.add_argument("--keys", type=int, default=16, help="small form: the key alphabet's size (chance is 1/keys^key-len)")
    m.add_argument("--key-len", type=int, default=1, help="small form: tokens per key")
    m.add_argument("--keys-from-filler", action="store_true",
                   help="small form: keys are filler tokens, told apart only by the marker before them (retrieval by "
                        "position: harder to learn)")
    df.add_tiktoken_arg(m)
    e = sub.add_parser("eval", help="accuracy and loss on the answer tokens by distance")
    e.add_argument("data", metavar="DATA_DIR", help="the directory make wrote")
    e.add_argument("--dump", help="a trainer's --eval-dump of the shard (else run the command after --)")
    e.add_argument("--buckets", default="", help="distance bucket edges E0,E1,... (default: one per distance made)")
    e.add_argument("--json", help="also write the rows to this file")
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []  # -- TRAINER FLAGS: the run that evaluates the shard
    args = p.parse_args(argv[:len(argv) - len(command) - 1] if "--" in argv else argv)
    args.command = command
    if args.cmd == "make" and (args.seq_len < 2 or args.samples < 1 or args.samples_per_depth < 1):
        p.error("--seq-len: at least 2; --samples, --samples-per-depth: at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    return cmd_make(args) if args.cmd == "make" else cmd_eval(args)


if __name__ == "__main__":
    df.run_main(main)
