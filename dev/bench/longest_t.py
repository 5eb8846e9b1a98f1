#!/usr/bin/env python3
"""The longest sequence that fits, by the memory plan: GPT-2 124M, 350M, 774M
and 1.5B (d12, d24, d36, d48) on an 80 GB and a 141 GB card, batch 1, per
technique and all together, with the time model's predicted step time.

Every number comes from `train_gpt --plan-json` (the GPU trainer's own plan,
BF16 with fp32 master weights; no GPU needed to plan): for each setting the
longest T in [1, 1048576] (the search's ceiling, once train_gpt's limit of tokens per rank; the learned position table
grows with it) whose plan fits the device budget and, where checkpoints are
offloaded, the host budget, found by bisection (a plan grows with T).

  techniques   none           -r 0
               recompute      -r 1
               offload        -r 1 --offload-checkpoints (every layer's input in host memory)
               tiles          -r 1 --tile-tokens auto (untiled where that fits, else the fastest
                              power-of-two tile, down to one row, that does)
               segments       -r auto --tile-tokens auto, no host memory: the segment size
                              (--segment-layers), modes and tile chosen for the least predicted
                              time that fits the device
               all            -r auto --offload-checkpoints --tile-tokens auto (the tile size as for
                              tiles, then segments, modes and offloading chosen for the least
                              predicted time within both budgets)
  budgets      a card's memory as nvidia-smi reports it (H100 80GB: 81559 MiB, H200: 143771 MiB)
               less 1 GiB for the CUDA context and libraries; host memory --host-gib (default 120)

usage: python3 dev/bench/longest_t.py [--exe ./train_gpt] [--host-gib 120] [--models 124M,...]
       [--cards 80GB,141GB] [--techniques none,...] [--json]
Prints a Markdown table (docs/offload-and-tiles.md holds one; dev/test/test_offload.py
reruns a row of it against the program).
"""
import argparse
import json
import subprocess
import sys

MODELS = {"124M": "d12", "350M": "d24", "774M": "d36", "1.5B": "d48"}
CARDS = {"80GB": ("h100", 81559), "141GB": ("h200", 143771)}  # cost model, MiB
TECHNIQUES = {
    "none": ["-r", "0"],
    "recompute": ["-r", "1"],
    "offload": ["-r", "1", "--offload-checkpoints"],
    "tiles": ["-r", "1", "--tile-tokens", "auto"],
    "segments": ["-r", "auto", "--tile-tokens", "auto"],
    "all": ["-r", "auto", "--offload-checkpoints", "--tile-tokens", "auto"],
}
MAX_T = 1048576
HEADROOM_MIB = 1024


def plan(exe, model, T, flags, budget, host, cost_model):
    """The plan at sequence length T, or None when -r auto finds nothing that fits."""
    res = subprocess.run([exe, "-e", model, "--max-seq-len", str(T), "-b", "1", "-t", str(T), *flags, "--mem-budget", str(budget),
                          "--host-mem-budget", str(host), "--cost-model", cost_model, "--plan-json"], capture_output=True, text=True)
    if res.returncode != 0:
        if "-r auto: nothing fits" in res.stderr or "-r auto: nothing without offloading fits" in res.stderr:
            return None
        sys.exit(f"{exe} failed at T={T} {' '.join(flags)}:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)


def recompute_cell(d):
    """The -r value of a plan, and its --segment-layers K where K > 1."""
    K = d.get("segment_layers", 1)
    return d["recompute"] + (f" --segment-layers {K}" if K > 1 else "")


def fits(d, budget, host):
    return d is not None and d["total_bytes"] <= budget and d["host_total_bytes"] <= host


def longest(exe, model, flags, budget, host, cost_model):
    """The longest T that fits and its plan; (0, None) when not even T=1 does."""
    lo, best, hi = 0, None, MAX_T
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        d = plan(exe, model, mid, flags, budget, host, cost_model)
        if fits(d, budget, host):
            lo, best = mid, d
        else:
            hi = mid - 1
    return lo, best


def rows(exe, models, cards, host_gib, techniques=tuple(TECHNIQUES)):
    host = host_gib << 30
    for name in models:
        for card in cards:
            cost_model, mib = CARDS[card]
            budget = (mib - HEADROOM_MIB) << 20
            for tech in techniques:
                flags = TECHNIQUES[tech]
                T, d = longest(exe, MODELS[name], flags, budget, host, cost_model)
                yield {"model": name, "card": card, "technique": tech, "longest_T": T, "at_limit": T == MAX_T,
                       "device_bytes": d["total_bytes"] if d else 0, "host_bytes": d["host_total_bytes"] if d else 0,
                       "recompute": recompute_cell(d) if d else "", "tile_tokens": d["tile_tokens"] if d else 0,
                       "predicted_step_seconds": d["predicted_step_seconds"] if d else 0.0,
                       "budget_bytes": budget, "host_budget_bytes": host}


def markdown(results):
    out = ["| model | card | technique | longest T | device GiB | host GiB | -r | tile | predicted step s |",
           "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        t = f"{r['longest_T']}" + (" (limit)" if r["at_limit"] else "")
        out.append(f"| {r['model']} | {r['card']} | {r['technique']} | {t} | {r['device_bytes'] / 2**30:.1f} | "
                   f"{r['host_bytes'] / 2**30:.1f} | `{r['recompute']}` | {r['tile_tokens']} | {r['predicted_step_seconds']:.1f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exe", default="./train_gpt")
    ap.add_argument("--host-gib", type=int, default=120)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--cards", default=",".join(CARDS))
    ap.add_argument("--techniques", default=",".join(TECHNIQUES))
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    a = ap.parse_args()
    models, cards = a.models.split(","), a.cards.split(",")
    for m in models:
        if m not in MODELS:
            sys.exit(f"--models: unknown model {m} (one of {', '.join(MODELS)})")
    for c in cards:
        if c not in CARDS:
            sys.exit(f"--cards: unknown card {c} (one of {', '.join(CARDS)})")
    for t in a.techniques.split(","):
        if t not in TECHNIQUES:
            sys.exit(f"--techniques: unknown technique {t} (one of {', '.join(TECHNIQUES)})")
    results = rows(a.exe, models, cards, a.host_gib, a.techniques.split(","))
    if a.json:
        for r in results:
            print(json.dumps(r), flush=True)
    else:
        print(f"host memory {a.host_gib} GiB; device budget: the card less {HEADROOM_MIB} MiB")
        print(markdown(list(results)))


if __name__ == "__main__":
    main()
