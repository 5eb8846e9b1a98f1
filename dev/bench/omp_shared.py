#!/usr/bin/env python3
"""The CPU trainer's step time alone and with a second trainer on the same
cores, under each OpenMP setting (llmc/cpu/cpu_threads.h says why the
trainer's default wait policy is passive).

The model is the quick start's CPU model (scripts/quickstart.sh: 2 layers,
C=64, 4 heads, B=16, T=64) on random tokens of a 256-token vocabulary, -x
STEPS steps, no validation or sampling; a run's time is the trainer's own
"average step time" (first step excluded). For each setting:

  alone     one trainer
  shared    two trainers started together, the mean of their averages

Settings (environment of both trainers):

  default        the trainer's defaults (passive wait policy, threads from the free CPUs)
  active         OMP_WAIT_POLICY=active (libgomp spins at every region's end)
  runtime        REMAT_OMP_DEFAULTS=1: the trainer leaves the wait policy to libgomp
                 (its default: spin a while, then sleep), as before issue 44
  one thread     OMP_NUM_THREADS=1

Each cell is the median of --rounds rounds, the settings interleaved within
a round so that other load on the machine falls on all of them alike. The
machine's load average before and after is printed: on a machine that
others share, "alone" means no second trainer of ours.

usage: python3 dev/bench/omp_shared.py [--exe ./train_gpt_cpu] [--steps 40] [--rounds 3]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "data"))
import datafile  # noqa: E402

MODEL = ["-e", "d6", "--layers", "2", "--channels", "64", "--heads", "4", "--max-seq-len", "64", "--vocab-size", "256",
         "-b", "16", "-t", "64", "-l", "4e-3", "-j", "", "-s", "0", "-v", "0"]
SETTINGS = {
    "default": {},
    "active": {"OMP_WAIT_POLICY": "active"},
    "runtime": {"REMAT_OMP_DEFAULTS": "1"},
    "one thread": {"OMP_NUM_THREADS": "1"},
}
AVERAGE = re.compile(r"average step time ([0-9.]+) ms")


def start(exe, shard, steps, env):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "REMAT_OMP_DEFAULTS")}
    return subprocess.Popen([exe, *MODEL, "-i", shard, "-x", str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**base, **env})


def average_ms(proc):
    out, err = proc.communicate()
    m = AVERAGE.search(out)
    if proc.returncode != 0 or not m:
        sys.exit(f"trainer failed ({proc.returncode}):\n{err[-2000:]}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exe", default=str(REPO / "train_gpt_cpu"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "train.bin"
        import numpy as np
        datafile.write_shard(shard, np.random.default_rng(1).integers(0, 256, 200000))
        times = {(s, w): [] for s in SETTINGS for w in ("alone", "shared")}
        load_before = os.getloadavg()
        for _ in range(args.rounds):
            for name, env in SETTINGS.items():
                times[(name, "alone")].append(average_ms(start(args.exe, shard, args.steps, env)))
                pair = [start(args.exe, shard, args.steps, env) for _ in range(2)]
                times[(name, "shared")].append(statistics.mean(average_ms(p) for p in pair))
        load_after = os.getloadavg()
    print(f"CPUs: {os.cpu_count()}, load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min)")
    print(f"{args.steps} steps, median of {args.rounds} rounds, ms per step (first step excluded)\n")
    print("| setting | alone | two trainers together |")
    print("|---|---:|---:|")
    for name in SETTINGS:
        print(f"| {name} | {statistics.median(times[(name, 'alone')]):.1f} | {statistics.median(times[(name, 'shared')]):.1f} |")


if __name__ == "__main__":
    main()
