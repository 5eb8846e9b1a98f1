#!/usr/bin/env python3
"""Kept inputs against depth for segment checkpointing, measured: the CPU
trainer runs one training step of an L-layer model (C=64, T=1024, -r 1) at
--segment-layers 1, round(sqrt L) and L, and reports the plan's kept inputs
(segment inputs plus slots, from --plan-json) and the step's peak resident
memory (/usr/bin/time's maximum resident set), and that memory less the
same model's at T=1 (the run's fixed part). docs/DESIGN.md holds a table it printed.

usage: python3 dev/bench/segments_memory.py [--exe ./train_gpt_cpu] [--depths 4,9,16,25,36]
"""
import argparse
import json
import math
import re
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, "dev/data")
import datafile  # noqa: E402

C, T = 64, 1024


def model(L, t):
    return ["-e", "d6", "--layers", str(L), "--channels", str(C), "--heads", "4", "--vocab-size", "64", "--max-seq-len", str(T),
            "-b", "1", "-t", str(t), "-r", "1"]


def measure(exe, shard, L, K, t=T):
    flags = [*model(L, t), "--segment-layers", str(K)]
    plan = json.loads(subprocess.run([exe, *flags, "--plan-json"], capture_output=True, text=True, check=True).stdout)
    res = subprocess.run(["/usr/bin/time", "-f", "maxrss %M", exe, *flags, "-i", shard, "-j", "", "-s", "0", "-x", "1"],
                         capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
    rss = int(re.search(r"maxrss (\d+)", res.stderr).group(1)) * 1024
    kept = plan["activations_by_tensor"].get("x", 0) // (t * C * 4)
    return kept, rss


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exe", default="./train_gpt_cpu")
    ap.add_argument("--depths", default="4,9,16,25,36")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shard = f"{tmp}/train.bin"
        datafile.write_shard(shard, np.random.default_rng(0).integers(0, 64, 20000))
        print(f"C={C}, T={T}, -r 1, one training step; kept inputs of {T * C * 4 / 2**20:.2f} MiB each")
        print("| L | K | kept inputs | peak RSS MiB | over the run at T=1, MiB |")
        print("|---:|---:|---:|---:|---:|")
        for L in map(int, a.depths.split(",")):
            _, base = measure(a.exe, shard, L, 1, t=1)
            for K in sorted({1, max(1, round(math.sqrt(L))), L}):
                kept, rss = measure(a.exe, shard, L, K)
                print(f"| {L} | {K} | {kept} | {rss / 2**20:.2f} | {(rss - base) / 2**20:.2f} |", flush=True)


if __name__ == "__main__":
    main()
