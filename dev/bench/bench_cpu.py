#!/usr/bin/env python3
"""CPU reference benchmark: ms/step of d12 at B=4, T=64 (the issue's reference
point) under each recompute mode, measured side by side in one run, with the
planned bytes and the measured peak resident memory of each.

    python3 dev/bench/bench_cpu.py [--steps 6] [--model d12] [-b 4] [-t 64]

Side by side against another build of the trainer (e.g. the previous commit's
binary, built in a copy of the repository), in interleaved rounds:

    python3 dev/bench/bench_cpu.py --against /path/to/old/train_gpt_cpu [--rounds 5] [-r 0]

Each round runs both builds once, the order alternating between rounds, on the
same model, tokens and flags; it prints each build's ms/step (the mean of the
timed steps of one run) as the minimum and the median over rounds, the ratio
of the minimums (this build / the other), and whether the two builds printed
the same step losses and gradient norms.

Side by side against llm.c's CPU trainer (train_gpt2.c, built outside this
repository), on its own files: the model DIR/gpt2_124M.bin and the tokens
DIR/dev/data/tinyshakespeare/tiny_shakespeare_train.bin, DIR being the folder
of the binary, which runs there. Its main is fixed to B=4, T=64, lr 1e-4,
AdamW (0.9, 0.999), no clipping, no decay; this trainer gets the same files and
settings, as many steps as llm.c printed, and the ratio of ms/step and the
largest difference between the two step losses are printed:

    python3 dev/bench/bench_cpu.py --llmc /path/to/llm.c/train_gpt2 [--rounds 3]

Prints markdown tables. The first step of each run is excluded from the
average (cache warm-up). Timings on a shared machine are noisy: compare
within one run, not across runs; the minimum over interleaved rounds is the
least disturbed figure.
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


def output_of(cmd, **kwargs) -> str:
    """A binary's standard output, or a one-line DataError with its last error line."""
    res = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
        raise datafile.DataError(f"{cmd[0]} exited {res.returncode}: {last}")
    return res.stdout


def run_mode(args, shard, mode, binary=None):
    cmd = [str(binary or args.binary), "-e", args.model, "-i", str(shard), "-j", "", "-b", str(args.b),
           "-t", str(args.t), "-x", str(args.steps), "-s", "0", "-r", mode]
    out = output_of(cmd)
    avg = float(re.search(r"average step time ([0-9.]+) ms", out).group(1))
    plan = float(re.search(r"total +([0-9.]+) MiB", out).group(1))
    peak = float(re.search(r"peak resident memory: ([0-9.]+) MiB", out).group(1))
    loss = re.findall(r"loss ([0-9.]+)", out)[-1]
    return avg, plan, peak, loss


def step_values(out):
    """The step lines without their timings: loss, lr and gradient norm."""
    return [re.sub(r"\| [0-9.]+ ms.*", "", line) for line in out.splitlines() if line.startswith("step ")]


def run_timed(args, shard, binary):
    cmd = [str(binary), "-e", args.model, "-i", str(shard), "-j", "", "-b", str(args.b), "-t", str(args.t),
           "-x", str(args.steps), "-s", "0", "-r", args.r]
    out = output_of(cmd)
    return float(re.search(r"average step time ([0-9.]+) ms", out).group(1)), step_values(out)


def side_by_side(args, shard):
    builds = {"this build": args.binary, "other build": args.against}
    times = {name: [] for name in builds}
    lines = {}
    print(f"{args.model}, B={args.b}, T={args.t}, -r {args.r}, {args.steps} steps (first excluded), "
          f"{args.rounds} interleaved rounds\n")
    print(f"this build: {args.binary}\nother build: {args.against}\n")
    for rnd in range(args.rounds):
        order = list(builds) if rnd % 2 == 0 else list(builds)[::-1]
        for name in order:
            ms, lines[name] = run_timed(args, shard, builds[name])
            times[name].append(ms)
        print(f"round {rnd + 1}: " + ", ".join(f"{n} {times[n][-1]:.0f} ms/step" for n in builds), flush=True)
    print("\n| build | min ms/step | median ms/step |")
    print("| --- | --- | --- |")
    for name in builds:
        print(f"| {name} | {min(times[name]):.0f} | {np.median(times[name]):.0f} |")
    ratio = min(times["this build"]) / min(times["other build"])
    same = lines["this build"] == lines["other build"]
    print(f"\nratio (this / other, min over rounds): {ratio:.2f}x")
    print(f"step losses and norms identical: {'yes' if same else 'NO'}")


def llmc_side_by_side(args):
    llmc = args.llmc.resolve()
    model, tokens = llmc.parent / "gpt2_124M.bin", llmc.parent / "dev/data/tinyshakespeare/tiny_shakespeare_train.bin"
    for f in [model, tokens]:
        if not f.is_file():
            sys.exit(f"error: {f}: missing (llm.c's train_gpt2 reads it from the folder it runs in)")
    times = {"this build": [], "llm.c": []}
    print(f"llm.c's CPU trainer {llmc} against {args.binary}, model {model}, B=4, T=64, {args.rounds} interleaved rounds\n")
    for rnd in range(args.rounds):
        for name in (["llm.c", "this build"] if rnd % 2 == 0 else ["this build", "llm.c"]):
            if name == "llm.c":
                out = output_of([str(llmc)], cwd=llmc.parent)
                steps = re.findall(r"step (\d+): train loss ([0-9.]+) \(took ([0-9.]+) ms\)", out)
                if len(steps) < 2:
                    sys.exit(f"error: {llmc} printed {len(steps)} step lines; the first is not timed, so at least 2 are needed")
                llmc_losses = [float(s[1]) for s in steps]
                times[name].append(float(np.mean([float(s[2]) for s in steps[1:]])))
            else:
                cmd = [str(args.binary), "-e", str(model), "-i", str(tokens), "-j", "", "-b", "4", "-t", "64",
                       "-x", str(len(llmc_losses)), "-s", "0", "-r", args.r,
                       "-l", "1e-4", "-k", "constant", "--beta2", "0.999", "--grad-clip", "0", "-c", "0"]
                out = output_of(cmd)
                times[name].append(float(re.search(r"average step time ([0-9.]+) ms", out).group(1)))
                our_losses = [float(x) for x in re.findall(r"^step +\d+/\d+ \| loss ([0-9.]+)", out, re.M)]
        print(f"round {rnd + 1}: " + ", ".join(f"{n} {times[n][-1]:.0f} ms/step" for n in times), flush=True)
    print("\n| trainer | min ms/step | median ms/step |")
    print("| --- | --- | --- |")
    for name in times:
        print(f"| {name} | {min(times[name]):.0f} | {np.median(times[name]):.0f} |")
    print(f"\nratio (this / llm.c, min over rounds): {min(times['this build']) / min(times['llm.c']):.2f}x")
    n = min(len(llmc_losses), len(our_losses))
    print(f"largest step-loss difference over {n} steps: {max(abs(a - b) for a, b in zip(llmc_losses, our_losses)):.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="d12")
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-t", type=int, default=64)
    ap.add_argument("--binary", type=Path, default=REPO / "train_gpt_cpu", help="the build under test")
    ap.add_argument("--against", type=Path, help="another build of the trainer to run side by side")
    ap.add_argument("--rounds", type=int, default=5, help="--against: interleaved rounds")
    ap.add_argument("--llmc", type=Path, help="llm.c's CPU trainer binary to run side by side (see above)")
    ap.add_argument("-r", default="0", help="--against, --llmc: recompute mode of this build")
    args = ap.parse_args()
    for binary in [args.binary] + ([args.against] if args.against else []):
        if not binary.is_file():
            sys.exit(f"error: {binary}: no such trainer binary (make train_gpt_cpu builds this one)")
    if args.rounds < 1 or args.steps < 2:
        sys.exit("error: --rounds must be at least 1 and --steps at least 2 (the first step is not timed)")
    if args.b < 1 or args.t < 1:
        sys.exit(f"error: -b {args.b} -t {args.t}: both must be at least 1")
    if args.llmc:
        if not args.llmc.is_file():
            sys.exit(f"error: {args.llmc}: no such llm.c binary")
        llmc_side_by_side(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "bench_train.bin"
        datafile.write_shard(shard, np.random.default_rng(0).integers(0, 50257, args.b * args.t * (args.steps + 2) + 1))
        if args.against:
            side_by_side(args, shard)
            return
        print(f"{args.model}, B={args.b}, T={args.t}, {args.steps} steps (first excluded), CPU reference\n")
        print("| -r | ms/step | vs -r 0 | planned MiB | peak RSS MiB | last loss |")
        print("| --- | --- | --- | --- | --- | --- |")
        base = None
        for mode in ["0", "2", "1"]:
            avg, plan, peak, loss = run_mode(args, shard, mode)
            base = base or avg
            print(f"| {mode} | {avg:.0f} | {avg / base:.2f}x | {plan:.0f} | {peak:.0f} | {loss} |", flush=True)


if __name__ == "__main__":
    datafile.run_main(main)
