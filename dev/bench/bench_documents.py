"""CPU step time with packed documents against without: the work the document
mask skips (docs/documents.md).

One sequence of T = 4096 tokens a step, packed with 32 documents of 128 tokens
(end of text, then 127 random words), on a model where attention is most of the
step (2 layers, C 128, 2 heads of 64, V 256). The runs alternate, masked
(--reset-attention-mask --reset-position-ids --eod-mask-loss) and unmasked,
ROUNDS times each on the same data, so a load change on a shared machine hits
both; each run's average step time excludes its first step. Printed: the
median step time of each, their ratio, and what the attended pairs predict for
attention alone (T (T + 1) / 2 against 32 x 128 x 129 / 2: 31.8x fewer).

    python3 dev/bench/bench_documents.py [--rounds 2] [--steps 3] [--T 4096] [--docs 32]
"""
import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "data"))
import datafile  # noqa: E402

MODEL = ["-e", "d6", "--layers", "2", "--channels", "128", "--heads", "2", "--vocab-size", "256"]
FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--eot-token", "255"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--docs", type=int, default=32)
    a = p.parse_args()
    if a.T % a.docs:
        p.error("--T must be a multiple of --docs")
    exe = REPO / "train_gpt_cpu"
    if not exe.exists():
        p.error(f"{exe} is not built (make train_gpt_cpu)")
    L = a.T // a.docs
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(a.steps + 1):
        for _ in range(a.docs):
            rows.append(np.concatenate([[255], rng.integers(0, 255, L - 1)]))
    tokens = np.concatenate(rows + [[255]])
    times = {"masked": [], "unmasked": []}
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "docs.bin"
        datafile.write_shard(shard, tokens)
        common = [str(exe), *MODEL, "--max-seq-len", str(a.T), "-i", str(shard), "-j", "", "-b", "1", "-t", str(a.T),
                  "-x", str(a.steps), "-s", "0", "--tokenizer", ""]
        for r in range(a.rounds):
            for name, flags in [("masked", FLAGS), ("unmasked", [])]:
                res = subprocess.run(common + flags, capture_output=True, text=True, cwd=REPO)
                if res.returncode != 0:
                    sys.exit(f"{name}: exit {res.returncode}\n{res.stderr[-2000:]}")
                ms = float(re.search(r"average step time ([0-9.]+) ms", res.stdout).group(1))
                times[name].append(ms)
                print(f"round {r + 1} {name:8s} {ms:10.1f} ms/step", flush=True)
    masked, unmasked = statistics.median(times["masked"]), statistics.median(times["unmasked"])
    pairs_all = a.T * (a.T + 1) / 2
    pairs_docs = a.docs * L * (L + 1) / 2
    print(f"\nT={a.T}, {a.docs} documents of {L}: median step {masked:.1f} ms masked, {unmasked:.1f} ms unmasked: "
          f"{unmasked / masked:.2f}x faster; attended pairs {pairs_all / pairs_docs:.1f}x fewer")


if __name__ == "__main__":
    main()
