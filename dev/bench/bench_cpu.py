#!/usr/bin/env python3
"""CPU reference benchmark: ms/step of d12 at B=4, T=64 (the issue's reference
point) under each recompute mode, measured side by side in one run, with the
planned bytes and the measured peak resident memory of each.

    python3 dev/bench/bench_cpu.py [--steps 6] [--model d12] [-b 4] [-t 64]

Prints a markdown table. The first step of each run is excluded from the
average (cache warm-up). Timings on a shared machine are noisy: compare the
modes within one run, not across runs.
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "data"))
import datafile  # noqa: E402


def run_mode(args, shard, mode):
    cmd = [str(REPO / "train_gpt_cpu"), "-e", args.model, "-i", str(shard), "-j", "", "-b", str(args.b),
           "-t", str(args.t), "-x", str(args.steps), "-s", "0", "-r", mode]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    avg = float(re.search(r"average step time ([0-9.]+) ms", out).group(1))
    plan = float(re.search(r"total +([0-9.]+) MiB", out).group(1))
    peak = float(re.search(r"peak resident memory: ([0-9.]+) MiB", out).group(1))
    loss = re.findall(r"loss ([0-9.]+)", out)[-1]
    return avg, plan, peak, loss


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="d12")
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-t", type=int, default=64)
    args = ap.parse_args()
    if not (REPO / "train_gpt_cpu").exists():
        sys.exit("error: build the trainer first: make train_gpt_cpu")
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "bench_train.bin"
        datafile.write_shard(shard, np.random.default_rng(0).integers(0, 50257, args.b * args.t * (args.steps + 2) + 1))
        print(f"{args.model}, B={args.b}, T={args.t}, {args.steps} steps (first excluded), CPU reference\n")
        print("| -r | ms/step | vs -r 0 | planned MiB | peak RSS MiB | last loss |")
        print("| --- | --- | --- | --- | --- | --- |")
        base = None
        for mode in ["0", "2", "1"]:
            avg, plan, peak, loss = run_mode(args, shard, mode)
            base = base or avg
            print(f"| {mode} | {avg:.0f} | {avg / base:.2f}x | {plan:.0f} | {peak:.0f} | {loss} |", flush=True)


if __name__ == "__main__":
    main()
