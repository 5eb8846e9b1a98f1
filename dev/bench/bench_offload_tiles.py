#!/usr/bin/env python3
"""Memory and step time with and without each technique, side by side:
-r 0, -r 1, -r 1 with offloaded checkpoints, -r 1 with token tiles, and -r 1
with both, on one shape, a few steps each.

    python3 dev/bench/bench_offload_tiles.py [--trainer ./train_gpt_cpu] [--steps 4] [--tile 256] [-- SHAPE FLAGS...]

Default shape: 2 layers, C=256, 4 heads, V=64, B=8, T=512 on random tokens,
small enough for the CPU reference. Per setting: the plan's device bytes
(--plan-json total_bytes), its host pool (host_total_bytes), what the run
measured (the CPU trainer's peak resident memory; the GPU trainer's device
memory in use), and the median step time of the steps after the first.
--tile applies to the CPU trainer only (the GPU trainer has no token tiles:
those rows are skipped for it). Prints a Markdown table; asserts nothing
(performance is measured here, never in tests).
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "data"))
import datafile  # noqa: E402

DEFAULT_SHAPE = ["-e", "d6", "--layers", "2", "--channels", "256", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "512",
                 "-b", "8", "-t", "512"]
STEP = re.compile(r"^step +\d+/\d+ \| loss \S+ \| lr \S+ \| norm \S+ \| ([0-9.]+) ms.*?(?:device memory ([0-9.]+) MiB)?$", re.M)
RSS = re.compile(r"peak resident memory: ([0-9.]+) MiB")


def settings(tile, gpu):
    out = [("-r 0", ["-r", "0"]), ("-r 1", ["-r", "1"]), ("-r 1 offloaded", ["-r", "1", "--offload-checkpoints"])]
    if not gpu:
        out += [(f"-r 1 tiles of {tile}", ["-r", "1", "--tile-tokens", str(tile)]),
                (f"-r 1 offloaded, tiles of {tile}", ["-r", "1", "--offload-checkpoints", "--tile-tokens", str(tile)])]
    return out


def main():
    argv = sys.argv[1:]
    shape = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT_SHAPE
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", default=str(REPO / "train_gpt_cpu"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tile", type=int, default=256)
    a = ap.parse_args(argv)
    gpu = not Path(a.trainer).name.startswith("train_gpt_cpu")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.bin"
        import numpy as np
        datafile.write_shard(data, np.random.default_rng(0).integers(0, 64, 1 << 20))
        print("| setting | plan device MiB | plan host MiB | measured MiB | step ms |\n|---|---:|---:|---:|---:|")
        for name, flags in settings(a.tile, gpu):
            plan = subprocess.run([a.trainer, *shape, *flags, "--plan-json"], capture_output=True, text=True)
            if plan.returncode != 0:
                sys.exit(f"{name}: {plan.stderr.strip()}")
            p = json.loads(plan.stdout)
            res = subprocess.run([a.trainer, *shape, *flags, "-i", str(data), "-j", "", "-x", str(a.steps), "-s", "0", "-l", "1e-4"],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"{name}: {res.stderr.strip()}")
            steps = STEP.findall(res.stdout)
            ms = statistics.median(float(s[0]) for s in steps[1:]) if len(steps) > 1 else float(steps[0][0])
            rss = RSS.search(res.stdout)
            measured = float(rss.group(1)) if rss else max(float(s[1] or 0) for s in steps)
            print(f"| {name} | {p['total_bytes'] / 2**20:.1f} | {p['host_total_bytes'] / 2**20:.1f} | {measured:.1f} | {ms:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
