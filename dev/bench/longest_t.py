#!/usr/bin/env python3
"""The longest sequence that fits, by the memory plan: GPT-2 124M, 350M, 774M
and 1.5B (d12, d24, d36, d48) on an 80 GB and a 141 GB card, and Llama 3.2 1B,
3.2 3B and 3.1 8B (the presets llama3.2-1b, llama3.2-3b, llama3.1-8b) on one
141 GB card and on eight sharing each sequence (--context-parallel 8), batch 1,
per technique and all together, with the time model's predicted step time.

Every number comes from `train_gpt --plan-json` (the GPU trainer's own plan,
BF16 with fp32 master weights; no GPU needed to plan): for each setting the
longest T in [1, 4194304] (--max-seq-len's limit, and train_gpt's of tokens per rank;
GPT-2's learned position table grows with T, RoPE has none) whose plan fits the device
budget and, where checkpoints or the optimizer are offloaded, the host budget, found by bisection (a plan
grows with T). On eight cards (8x141GB) each rank holds T/8 tokens, T a multiple of 16 (2N
chunks), the AdamW state and master weights sharded over the eight (-z 1), the NVLink ring;
the budgets are per GPU (the plan is rank 0's; every rank's is the same size).

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
               per GPU
  cards        GPT-2's rows 80GB and 141GB, Llama's 141GB and 8x141GB (--cards picks for all)

The optimizer's table (--optimizer) takes its own rows (OPTIMIZER_ROWS: a model, a card, a host
budget, a technique) with the optimizer in host memory as one more choice of -r auto:

  optimizer    -r auto --tile-tokens auto --offload-optimizer: master weights, AdamW's moments and a
               gradient copy in host memory, activations on the device (segments, modes, tile)
  every        -r auto --offload-checkpoints --tile-tokens auto --offload-optimizer: every lever at once

and beside the predicted step the optimizer's parts (the plan's optimizer_offload_seconds: gradients
down, the host AdamW, parameters up) and what the step does not hide of them, its share of the step.

usage: python3 dev/bench/longest_t.py [--exe ./train_gpt] [--host-gib 120] [--models 124M,...]
       [--cards 80GB,141GB,8x141GB] [--techniques none,...] [--optimizer] [--json]
Prints a Markdown table: docs/offload-and-tiles.md holds both, written by
`python3 dev/docs_tables.py --longest-t` (which calls main_table and optimizer_table here);
dev/test/test_offload.py reruns every row against the program.
"""
import argparse
import json
import subprocess
import sys

MODELS = {"124M": "d12", "350M": "d24", "774M": "d36", "1.5B": "d48",
          "llama3.2-1b": "llama3.2-1b", "llama3.2-3b": "llama3.2-3b", "llama3.1-8b": "llama3.1-8b"}
CARDS = {"80GB": ("h100", 81559, 1), "141GB": ("h200", 143771, 1), "8x141GB": ("h200", 143771, 8)}  # cost model, MiB, GPUs
# the cards each family's rows take unless --cards says
DEFAULT_CARDS = {"d": ("80GB", "141GB"), "llama": ("141GB", "8x141GB")}
TECHNIQUES = {
    "none": ["-r", "0"],
    "recompute": ["-r", "1"],
    "offload": ["-r", "1", "--offload-checkpoints"],
    "tiles": ["-r", "1", "--tile-tokens", "auto"],
    "segments": ["-r", "auto", "--tile-tokens", "auto"],
    "all": ["-r", "auto", "--offload-checkpoints", "--tile-tokens", "auto"],
}
# the main table's techniques; the optimizer's two take OPTIMIZER_ROWS only
TABLE_TECHNIQUES = tuple(TECHNIQUES)
TECHNIQUES["optimizer"] = ["-r", "auto", "--tile-tokens", "auto", "--offload-optimizer"]
TECHNIQUES["every"] = ["-r", "auto", "--offload-checkpoints", "--tile-tokens", "auto", "--offload-optimizer"]
# (model, card, host GiB, technique): GPT-2 1.5B with every lever at once, the Llama presets with the optimizer
# in host memory on one H200, Llama 3.1 8B on one H100 beside ALST's one-GPU result, with 120 GiB of host memory
# per GPU and 256 GiB (a 2 TiB node of eight), and 8B with 1,500 GiB, where the device alone stops it
OPTIMIZER_ROWS = [("1.5B", "141GB", 120, "every"),
                  ("llama3.2-1b", "141GB", 120, "optimizer"), ("llama3.2-1b", "141GB", 120, "every"),
                  ("llama3.2-3b", "141GB", 120, "optimizer"), ("llama3.2-3b", "141GB", 120, "every"),
                  ("llama3.1-8b", "141GB", 120, "optimizer"), ("llama3.1-8b", "141GB", 120, "every"),
                  ("llama3.1-8b", "141GB", 256, "every"), ("llama3.1-8b", "141GB", 1500, "every"),
                  ("llama3.1-8b", "80GB", 120, "every"), ("llama3.1-8b", "80GB", 256, "every")]
MAX_T = 4194304
HEADROOM_MIB = 1024


def cards_of(model):
    """The cards a model's rows take by default."""
    return DEFAULT_CARDS["d" if MODELS[model].startswith("d") else "llama"]


def settings(models=tuple(MODELS), cards=None, techniques=TABLE_TECHNIQUES):
    """(model, card, technique) of every row, in the table's order."""
    return [(m, c, t) for m in models for c in (cards or cards_of(m)) for t in techniques]


def gpus(card):
    return CARDS[card][2]


def t_step(card):
    """The T the bisection steps by: 1, or 2N chunks under --context-parallel N."""
    return 2 * gpus(card) if gpus(card) > 1 else 1


def card_flags(card):
    """A card's flags beside the technique's: the ring and ZeRO-1 over N GPUs."""
    n = gpus(card)
    return ["--context-parallel", str(n), "--plan-processes", str(n), "-z", "1"] if n > 1 else []


def flags_of(card, technique):
    return TECHNIQUES[technique] + card_flags(card)


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
    """The -r value of a plan, its --segment-layers K where K > 1, and --offload-optimizer where the
    optimizer went to host memory."""
    K = d.get("segment_layers", 1)
    return d["recompute"] + (f" --segment-layers {K}" if K > 1 else "") + (" --offload-optimizer" if d.get("offload_optimizer") else "")


def fits(d, budget, host):
    return d is not None and d["total_bytes"] <= budget and d["host_total_bytes"] <= host


def longest(exe, model, flags, budget, host, cost_model, step=1):
    """The longest T (a multiple of step) that fits and its plan; (0, None) when not even T=step does."""
    lo, best, hi = 0, None, MAX_T // step
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        d = plan(exe, model, mid * step, flags, budget, host, cost_model)
        if fits(d, budget, host):
            lo, best = mid, d
        else:
            hi = mid - 1
    return lo * step, best


def host_optimizer_bytes(d):
    """The host bytes of --offload-optimizer's pool: master weights, the gradient copy, AdamW's moments."""
    h = d["host_components"]
    return h["master_weights"] + h["gradients"] + h["optimizer"]


def row(exe, name, card, host_gib, tech):
    """One setting's longest T and what its plan says there."""
    cost_model, mib, _ = CARDS[card]
    budget, host = (mib - HEADROOM_MIB) << 20, host_gib << 30
    T, d = longest(exe, MODELS[name], flags_of(card, tech), budget, host, cost_model, t_step(card))
    o = d["optimizer_offload_seconds"] if d else {"down": 0.0, "adamw": 0.0, "up": 0.0, "exposed": 0.0}
    return {"model": name, "card": card, "technique": tech, "longest_T": T, "at_limit": T == MAX_T,
            "device_bytes": d["total_bytes"] if d else 0, "host_bytes": d["host_total_bytes"] if d else 0,
            "recompute": recompute_cell(d) if d else "", "tile_tokens": d["tile_tokens"] if d else 0,
            "predicted_step_seconds": d["predicted_step_seconds"] if d else 0.0,
            "budget_bytes": budget, "host_budget_bytes": host, "host_optimizer_bytes": host_optimizer_bytes(d) if d else 0,
            "optimizer_seconds": o}


def rows(exe, models, cards, host_gib, techniques=TABLE_TECHNIQUES):
    for name, card, tech in settings(models, cards, techniques):
        yield row(exe, name, card, host_gib, tech)


def optimizer_rows(exe, settings=OPTIMIZER_ROWS):
    for name, card, host_gib, tech in settings:
        yield row(exe, name, card, host_gib, tech)


def markdown(results):
    out = ["| model | card | technique | longest T | device GiB | host GiB | -r | tile | predicted step s |",
           "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        t = f"{r['longest_T']}" + (" (limit)" if r["at_limit"] else "")
        out.append(f"| {r['model']} | {r['card']} | {r['technique']} | {t} | {r['device_bytes'] / 2**30:.1f} | "
                   f"{r['host_bytes'] / 2**30:.1f} | `{r['recompute']}` | {r['tile_tokens']} | {r['predicted_step_seconds']:.1f} |")
    return "\n".join(out)


def share(r):
    """What the step does not hide of the optimizer's parts, as a fraction of the step."""
    return r["optimizer_seconds"]["exposed"] / r["predicted_step_seconds"] if r["predicted_step_seconds"] else 0.0


def optimizer_markdown(results):
    out = ["| model | card | host budget GiB | technique | longest T | device GiB | host GiB | optimizer's host GiB | -r | tile | "
           "predicted step s | optimizer down / AdamW / up s | not hidden s | share |",
           "|---|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        t = f"{r['longest_T']}" + (" (limit)" if r["at_limit"] else "")
        o = r["optimizer_seconds"]
        out.append(f"| {r['model']} | {r['card']} | {r['host_budget_bytes'] >> 30} | {r['technique']} | {t} | "
                   f"{r['device_bytes'] / 2**30:.1f} | {r['host_bytes'] / 2**30:.1f} | {r['host_optimizer_bytes'] / 2**30:.1f} | "
                   f"`{r['recompute']}` | {r['tile_tokens']} | {r['predicted_step_seconds']:.1f} | "
                   f"{o['down']:.2f} / {o['adamw']:.2f} / {o['up']:.2f} | {o['exposed']:.2f} | {100 * share(r):.2f}% |")
    return "\n".join(out)


def main_table(exe="./train_gpt"):
    """The main table as docs/offload-and-tiles.md holds it (dev/docs_tables.py --longest-t)."""
    return markdown(list(rows(exe, tuple(MODELS), [], 120)))


def optimizer_table(exe="./train_gpt"):
    """The optimizer's table as docs/offload-and-tiles.md holds it (dev/docs_tables.py --longest-t)."""
    return optimizer_markdown(list(optimizer_rows(exe)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exe", default="./train_gpt")
    ap.add_argument("--host-gib", type=int, default=120)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--cards", default="", help="cards for every model (default: each family's, DEFAULT_CARDS)")
    ap.add_argument("--techniques", default=",".join(TECHNIQUES))
    ap.add_argument("--optimizer", action="store_true", help="the optimizer's table (OPTIMIZER_ROWS) instead of the main one")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    a = ap.parse_args()
    if a.optimizer:
        results = optimizer_rows(a.exe)
        if a.json:
            for r in results:
                print(json.dumps(r), flush=True)
        else:
            print(optimizer_markdown(list(results)))
        return
    models, cards = a.models.split(","), [c for c in a.cards.split(",") if c]
    for m in models:
        if m not in MODELS:
            sys.exit(f"--models: unknown model {m} (one of {', '.join(MODELS)})")
    for c in cards:
        if c not in CARDS:
            sys.exit(f"--cards: unknown card {c} (one of {', '.join(CARDS)})")
    for t in a.techniques.split(","):
        if t not in TABLE_TECHNIQUES:
            sys.exit(f"--techniques: unknown technique {t} (one of {', '.join(TABLE_TECHNIQUES)}; the optimizer's: --optimizer)")
    results = rows(a.exe, models, cards, a.host_gib, a.techniques.split(","))
    if a.json:
        for r in results:
            print(json.dumps(r), flush=True)
    else:
        print(f"host memory {a.host_gib} GiB per GPU; device budget: the card less {HEADROOM_MIB} MiB")
        print(markdown(list(results)))


if __name__ == "__main__":
    main()
