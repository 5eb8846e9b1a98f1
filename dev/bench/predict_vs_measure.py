#!/usr/bin/env python3
"""The time model (llmc/plan/cost_model.h) against the CPU reference's own steps:
calibrate on one run, then predict and measure each setting side by side.

    python3 dev/bench/predict_vs_measure.py [--rounds 5] [--steps 3] [--threads 2] [--tile 256] [-- SHAPE FLAGS...]

Default shape: the issue's (d6's shape cut to 4 layers, C=128, 4 heads, V=64,
B=4, T=512) on random tokens. Settings: -r 0, 1, 2, 3, a per-layer mix, -r 1
with token tiles of --tile rows, -r 1 and -r 3 with offloaded checkpoints.

Each round runs every setting once (the order rotating between rounds), the
-r 0 run with REMAT_PROFILE=2 REMAT_PROFILE_COST_MODEL=FILE, so that each
round calibrates a cost model from its step 2. The model used is the one of
the round whose profiled step was fastest (the least disturbed, as the
measured figures are minimums). Per setting:
  predicted  the plan's "predicted_step_seconds" (--plan-json --cost-model FILE)
  measured   the fastest step over all rounds, the first step of each run
             excluded (cache warm-up)
  error      predicted / measured - 1
  median     the median of the same steps: how far the load moved them
and the extra time over -r 0, predicted and measured (from the same minimums),
with their difference in points.

--clock cpu (one thread) takes the load out: the calibration times step 2 in
the process's CPU time (REMAT_PROFILE_CLOCK=cpu), and a setting's measured
step is CPU time too: each round runs it for --steps steps and for one step,
and the difference of the two runs' CPU time (getrusage of the children) over
--steps - 1 is its CPU time per step after the first. Time the process was
descheduled for the other work of a shared machine then counts nowhere: the
figures are those of the machine to itself (cache and memory-bandwidth
contention remain). Prints a Markdown table with the machine,
the load average before and after, and the calibrated rates; asserts nothing
(performance is measured here, never in tests). On a shared machine the
absolute times move with the load: read the errors, and compare rounds.
"""
import argparse
import json
import os
import platform
import resource
import statistics
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "data"))
import datafile  # noqa: E402

DEFAULT_SHAPE = ["-e", "d6", "--layers", "4", "--channels", "128", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "512",
                 "-b", "4", "-t", "512"]
STEP = re.compile(r"^step +\d+/\d+ \| loss \S+ \| lr \S+ \| norm \S+ \| ([0-9.]+) ms", re.M)
CALIBRATED = re.compile(r"^cost model: step \d+ \(([0-9.]+) ms\) calibrated", re.M)
PROFILED_STEP = 2


def settings(tile, layers):
    mix = "/".join(f"{m}:{l}" for l, m in zip(range(layers), (1, 3, 2, 0) * layers) if m)
    return [("-r 0", ["-r", "0"]), ("-r 1", ["-r", "1"]), ("-r 2", ["-r", "2"]), ("-r 3", ["-r", "3"]),
            (f"-r {mix}", ["-r", mix]), (f"-r 1, tiles of {tile}", ["-r", "1", "--tile-tokens", str(tile)]),
            ("-r 1 offloaded", ["-r", "1", "--offload-checkpoints"]), ("-r 3 offloaded", ["-r", "3", "--offload-checkpoints"])]


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd, env):
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
        sys.exit(f"{' '.join(cmd)}: exited {res.returncode}: {last}")
    return res.stdout


def layers_of(shape):
    return int(shape[shape.index("--layers") + 1]) if "--layers" in shape else 12


def main():
    argv = sys.argv[1:]
    shape = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT_SHAPE
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", default=str(REPO / "train_gpt_cpu"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is not timed); at least 3")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS")
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: CPU time (one thread), see above")
    a = ap.parse_args(argv)
    if a.clock == "cpu" and a.threads != 1:
        sys.exit("--clock cpu measures one thread's CPU time: give --threads 1")
    if a.steps < 3 or a.rounds < 1:
        sys.exit("--steps must be at least 3 (step 2 calibrates) and --rounds at least 1")
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    cases = settings(a.tile, layers_of(shape))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.bin"
        datafile.write_shard(data, np.random.default_rng(0).integers(0, 64, 1 << 20))
        measured = {name: [] for name, _ in cases}
        calibrations = []  # (profiled step ms, file)
        for rnd in range(a.rounds):
            order = cases[rnd % len(cases):] + cases[:rnd % len(cases)]
            for name, flags in order:
                train = [a.trainer, *shape, *flags, "-i", str(data), "-j", "", "-s", "0", "-l", "1e-4"]
                if name == "-r 0":
                    cm = Path(tmp) / f"round{rnd}.cost"
                    cal_env = {**env, "REMAT_PROFILE": str(PROFILED_STEP), "REMAT_PROFILE_COST_MODEL": str(cm)}
                    if a.clock == "cpu":
                        cal_env["REMAT_PROFILE_CLOCK"] = "cpu"
                    out = run([*train, "-x", str(max(a.steps, PROFILED_STEP + 1))], cal_env)
                    calibrations.append((float(CALIBRATED.search(out).group(1)), cm))
                    if a.clock == "wall":
                        measured[name] += [float(x) for x in STEP.findall(out)][1:]
                        continue
                if a.clock == "wall":
                    measured[name] += [float(x) for x in STEP.findall(run([*train, "-x", str(a.steps)], env))][1:]
                    continue
                t0 = children_cpu_s()
                run([*train, "-x", "1"], env)
                t1 = children_cpu_s()
                run([*train, "-x", str(a.steps)], env)
                measured[name].append(1e3 * ((children_cpu_s() - t1) - (t1 - t0)) / (a.steps - 1))
            print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
        profiled_ms, cm = min(calibrations)
        rates = {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in cm.read_text().splitlines()
                                                  if "=" in line and not line.startswith("#"))}
        predicted = {}
        for name, flags in cases:
            plan = json.loads(run([a.trainer, *shape, *flags, "--plan-json", "--cost-model", str(cm)], env))
            predicted[name] = 1e3 * plan["predicted_step_seconds"]
    load_after = os.getloadavg()
    best = {name: min(v) for name, v in measured.items()}
    print(f"machine: {platform.node()}, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
          f"{a.threads} threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average before "
          f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    how = "wall-clock, minimum over the timed steps" if a.clock == "wall" else "CPU time per step after the first, minimum over the rounds"
    print(f"shape: {' '.join(shape)}; {a.rounds} rounds of {a.steps} steps per setting; {how}")
    print(f"calibrated on -r 0's step {PROFILED_STEP} of {profiled_ms:.1f} ms (fastest of {len(calibrations)}): " +
          ", ".join(f"{k} {v}" for k, v in rates.items() if k != "name"))
    print()
    print("| setting | predicted ms | measured ms (min) | error | predicted extra | measured extra | difference | median ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, _ in cases:
        p, m = predicted[name], best[name]
        pe, me = 100 * (p / predicted["-r 0"] - 1), 100 * (m / best["-r 0"] - 1)
        print(f"| {name} | {p:.1f} | {m:.1f} | {100 * (p / m - 1):+.1f}% | {pe:+.1f}% | {me:+.1f}% | {pe - me:+.1f} | "
              f"{statistics.median(measured[name]):.1f} |")


if __name__ == "__main__":
    main()
