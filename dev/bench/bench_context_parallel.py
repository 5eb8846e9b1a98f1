#!/usr/bin/env python3
"""Context parallelism on the CPU: step time and per-rank memory for 1, 2 and
4 ranks sharing each sequence (--context-parallel 1, 2, 4), side by side in
one run on the same model, tokens and flags; then the plan's predicted table
for GPT-2 1.5B (-e d48) on eight H200s at long T.

    python3 dev/bench/bench_context_parallel.py [--layers 4] [--channels 128] [--heads 4] [--vocab-size 256] [-t 4096]
                                                [--steps 3] [--ranks 1,2,4]
    python3 dev/bench/bench_context_parallel.py --plan-only   # just the H200 table

Each rank runs with OMP_NUM_THREADS=1 under mpirun (--oversubscribe), so the
figures say how the work and memory split, not what a multi-core machine
reaches. Memory: each rank's peak resident set, measured by a wrapper around
it (getrusage of its child), beside the rank's plan. The first step is
excluded from the step time. Prints markdown tables.

The H200 table uses train_gpt's plan when it is built (bf16 storage, the GPU's
buffers), else train_gpt_cpu's with --cost-model h200 (fp32 storage: twice the
activation bytes), and says which. Predicted times come from the time model
(llmc/plan/cost_model.h) with the NVLink link: compiles, unverified on a GPU.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
# Runs the trainer and writes its peak RSS (KiB) to DIR/rss_<rank>: a file per
# rank, since mpirun may interleave the ranks' stderr lines.
RSS_WRAPPER = ("import os, resource, subprocess, sys\nr = subprocess.run(sys.argv[2:])\n"
               "open(os.path.join(sys.argv[1], 'rss_' + os.environ['OMPI_COMM_WORLD_RANK']), 'w')"
               ".write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
               "sys.exit(r.returncode)\n")


def tokens_file(tmp, n, vocab):
    sys.path.insert(0, str(REPO / "dev" / "data"))
    import datafile
    import numpy as np
    path = Path(tmp) / "bench_tokens.bin"
    datafile.write_shard(path, np.random.default_rng(0).integers(0, vocab, n))
    return path


def measure(args, ranks, data, wrapper):
    flags = ["-e", "d6", "--layers", str(args.layers), "--channels", str(args.channels), "--heads", str(args.heads),
             "--vocab-size", str(args.vocab_size), "--max-seq-len", str(args.t), "-b", "1", "-t", str(args.t),
             "-x", str(args.steps), "-s", "0", "-v", "0", "-j", "", "-i", str(data), "--context-parallel", str(ranks), "-r", args.r]
    rss_dir = wrapper.parent / f"rss{ranks}"
    rss_dir.mkdir()
    cmd = ["mpirun", "-np", str(ranks), sys.executable, str(wrapper), str(rss_dir), str(REPO / "train_gpt_cpu"), *flags]
    res = subprocess.run(cmd, env={**os.environ, **MPI_ENV}, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    step_ms = float(re.search(r"average step time ([0-9.]+) ms", res.stdout).group(1))
    plan = float(re.search(r"total +([0-9.]+) MiB", res.stdout).group(1))
    acts = float(re.search(r"activations +([0-9.]+) MiB", res.stdout).group(1))
    rss = [int((rss_dir / f"rss_{r}").read_text()) / 1024 for r in range(ranks)]
    loss = re.findall(r"step +\d+/\d+ \| loss ([0-9.]+)", res.stdout)
    return step_ms, plan, acts, rss, loss


def cpu_table(args):
    with tempfile.TemporaryDirectory() as tmp:
        data = tokens_file(tmp, 4 * args.t * (args.steps + 2), args.vocab_size)
        wrapper = Path(tmp) / "rss.py"
        wrapper.write_text(RSS_WRAPPER)
        rows = [(n, *measure(args, n, data, wrapper)) for n in args.ranks]
    print(f"### CPU: L={args.layers} C={args.channels} NH={args.heads} V={args.vocab_size}, B=1, T={args.t}, -r {args.r}, "
          f"{args.steps} steps (first excluded), one thread per rank\n")
    print("| ranks (N) | ms/step | plan per rank MiB | activations per rank MiB | peak RSS per rank MiB | last loss |")
    print("|---|---|---|---|---|---|")
    for n, ms, plan, acts, rss, loss in rows:
        print(f"| {n} | {ms:.0f} | {plan:.1f} | {acts:.1f} | {', '.join(f'{r:.1f}' for r in rss)} | {loss[-1] if loss else '?'} |")
    print()


def h200_plan(exe, t, n, r, z):
    flags = ["-e", "d48", "--max-seq-len", str(t), "-t", str(t), "-b", "1", "-r", r, "-z", z, "--mem-budget", "139GiB", "--plan-json"]
    if n > 1:
        flags += ["--plan-processes", str(n), "--context-parallel", str(n)]
    if exe.name == "train_gpt_cpu":
        flags += ["--cost-model", "h200", "--ring-link", "nvlink"]
    res = subprocess.run([str(exe), *flags], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        sys.exit(f"{exe} {' '.join(flags)} failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def h200_table():
    gpu = REPO / "train_gpt"
    exe = gpu if gpu.exists() else REPO / "train_gpt_cpu"
    note = "train_gpt's plan (bf16)" if exe == gpu else "train_gpt_cpu's plan with --cost-model h200 (fp32 storage: not the GPU's bytes)"
    print(f"### Predicted: GPT-2 1.5B (-e d48), B=1, on H200s (139 GiB), {note}\n")
    print("| T | GPUs (N) | -r | -z | GiB per GPU | fits | predicted s/step | ring s/step (not hidden) |")
    print("|---|---|---|---|---|---|---|---|")
    for t, n, r, z in [(393216, 1, "1", "0"), (1048576, 8, "1", "0"), (1048576, 8, "1", "1"), (1048576, 8, "3", "1"),
                       (2097152, 8, "1", "0"), (2097152, 8, "1", "1")]:
        p = h200_plan(exe, t, n, r, z)
        gib = p["total_bytes"] / 2**30
        print(f"| {t:,} | {n} | {r} | {z} | {gib:.1f} | {'yes' if gib <= 139 else 'no'} | {p['predicted_step_seconds']:.1f} | "
              f"{p.get('predicted_ring_seconds', 0.0):.2f} |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("-t", type=int, default=4096)
    ap.add_argument("-r", default="0")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--plan-only", action="store_true")
    args = ap.parse_args()
    args.ranks = [int(x) for x in args.ranks.split(",")]
    if not args.plan_only:
        cpu_table(args)
    h200_table()


if __name__ == "__main__":
    main()
