#!/usr/bin/env python3
"""Where the memory goes: the trainer's --plan-json for one model, drawn.

    python3 dev/bench/plot_plan.py [--trainer ./train_gpt] [-e d12] [-b 1]
        [--seq-lens 1024,2048,4096,8192,16384,32768] [-o plan.png] [-- FLAGS...]

For every sequence length and each recompute mode (-r 0 keep all, -r 2
selective, -r 3 full but attention kept, -r 1 full, -r 1 with its checkpoints
offloaded) one bar, stacked from the plan's components: parameters, gradients,
optimizer state (AdamW m and v, plus the fp32 master weights of low-precision
builds), activations, and scratch (the logits chunk, gradient buffers, staging;
with the cuBLAS workspace), then, hatched, the host memory of offloaded
checkpoints (not on the device). The y axis fits the bars; dashed lines mark 80
GB and 141 GB, the memory of an H100 and an H200, where they fall within it.
Every run of the trainer uses --max-seq-len = the longest sequence, so the
parameters are the same in every bar. Flags after `--` go to the trainer (e.g.
--layers 24 --channels 2048 --heads 16), except those this script sets itself
(-e, -b, -t, -r, --max-seq-len, --plan-json, --plan), which are refused.
Nothing is allocated: --plan-json only plans (no GPU needed). The format of -o
follows its extension. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev"))
from plot_log import LogError, figure_format, pyplot, run_main, save_figure  # noqa: E402

MODES = (("0", "-r 0"), ("2", "-r 2"), ("3", "-r 3"), ("1", "-r 1"), ("1o:all", "-r 1o"))
# the trainer flags each bar's command line sets (plan_json); one after `--` would override them all
OWN_FLAGS = ("-e", "--max-seq-len", "-b", "-t", "-r", "--plan-json", "--plan")
# (label, plan components summed into it, colour)
STACK = (("parameters", ("parameters",), "tab:blue"), ("gradients", ("gradients",), "tab:orange"),
         ("optimizer state", ("optimizer", "master_weights"), "tab:green"),
         ("activations", ("activations",), "tab:red"), ("scratch", ("scratch", "workspace"), "tab:gray"))
LINES_GB = ((80, "80 GB (H100)"), (141, "141 GB (H200)"))
UNITS = ((1e9, "GB (1e9 bytes)"), (1e6, "MB (1e6 bytes)"), (1e3, "kB (1e3 bytes)"), (1, "bytes"))


class PlanError(LogError):
    pass


def plan_json(trainer: Path, model: str, batch: int, seq_len: int, max_seq_len: int, mode: str, extra: list) -> dict:
    cmd = [str(trainer.resolve()), "-e", model, "--max-seq-len", str(max_seq_len), "-b", str(batch), "-t", str(seq_len),
           "-r", mode, "--plan-json", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise PlanError(f"{' '.join(cmd)}: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}")
    return json.loads(res.stdout)


def collect(args) -> dict:
    """{(T, mode): plan} for every cell."""
    top = max(args.seq_lens)
    return {(T, mode): plan_json(args.trainer, args.model, args.b, T, top, mode, args.extra)
            for T in args.seq_lens for mode, _ in MODES}


def check_extra(extra: list) -> None:
    """Refuses, after `--`, a flag every bar sets itself: the trainer takes the
    last value given, so it would draw one plan under several labels."""
    own = [a for a in extra if a in OWN_FLAGS]
    if own:
        raise PlanError(f"{own[0]} after '--': plot_plan.py sets {', '.join(OWN_FLAGS)} itself for each bar "
                        "(use its own -e, -b and --seq-lens)")


def unit_for(top_bytes: float) -> tuple[float, str]:
    """The largest decimal unit the tallest bar reaches at least 1 of."""
    return next((scale, name) for scale, name in UNITS if top_bytes >= scale or scale == 1)


def draw(plans: dict, args, out: Path) -> None:
    plt = pyplot()
    seq_lens = sorted({T for T, _ in plans})
    fig, ax = plt.subplots(figsize=(max(8, 2.4 * len(seq_lens)), 6))
    totals = {key: sum(sum(p["components"].get(c, 0) for c in parts) for _, parts, _ in STACK) + p.get("host_total_bytes", 0)
              for key, p in plans.items()}
    scale, unit = unit_for(max(totals.values()))
    width = 0.8 / len(MODES)
    for g, T in enumerate(seq_lens):
        for k, (mode, mode_label) in enumerate(MODES):
            p = plans[(T, mode)]
            x = g + (k - (len(MODES) - 1) / 2) * width
            bottom = 0.0
            for label, parts, color in STACK:
                height = sum(p["components"].get(c, 0) for c in parts) / scale
                ax.bar(x, height, width * 0.95, bottom=bottom, color=color, label=label if g == 0 and k == 0 else None)
                bottom += height
            host = p.get("host_total_bytes", 0) / scale
            if host:
                ax.bar(x, host, width * 0.95, bottom=bottom, color="white", edgecolor="tab:purple", hatch="//",
                       label="host memory (offloaded)" if g == 0 else None)
                bottom += host
            ax.text(x, bottom, mode_label, ha="center", va="bottom", fontsize=7, rotation=90)
    top = max(totals.values()) / scale * 1.15  # room above the tallest bar for its label
    ax.set_ylim(0, top)
    for gb, label in LINES_GB:
        if gb * 1e9 / scale <= top:
            ax.axhline(gb * 1e9 / scale, color="black", ls="--", lw=1)
            ax.text(len(seq_lens) - 0.5, gb * 1e9 / scale, label, ha="right", va="bottom", fontsize=8)
    cfg = next(iter(plans.values()))["config"]
    elem = next(iter(plans.values()))["elem_bytes"]
    ax.set_xticks(range(len(seq_lens)), [str(T) for T in seq_lens])
    ax.set_xlim(-0.5, len(seq_lens) - 0.5)
    ax.set_xlabel("sequence length T\nbars, left to right: -r 0 keep all, -r 2 selective, -r 3 full but attention kept, "
                  "-r 1 full, -r 1 offloaded", fontsize=9)
    ax.set_ylabel(f"planned memory, {unit}")
    title = (f"{' '.join(['-e', args.model, *args.extra])}: L={cfg['num_layers']} C={cfg['channels']} "
             f"NH={cfg['num_heads']}, {cfg['num_parameters'] / 1e6:.3g}M parameters, B={args.b}, {elem}-byte storage "
             f"({Path(args.trainer).name})")
    # wrapped to the axes' width (about 10 characters of the 12-point title per inch); paths break anywhere
    ax.set_title("\n".join(textwrap.wrap(title, width=int(fig.get_figwidth() * 0.8 * 10))), fontsize=12)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: never over a bar
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(plt, fig, out)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_trainer = REPO / "train_gpt" if (REPO / "train_gpt").exists() else REPO / "train_gpt_cpu"
    p.add_argument("--trainer", type=Path, default=default_trainer,
                   help="trainer binary (default: ./train_gpt if built, else ./train_gpt_cpu, whose plan is fp32)")
    p.add_argument("-e", "--model", default="d12", help="model descriptor or file, as the trainer's -e (default d12)")
    p.add_argument("-b", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--seq-lens", default="1024,2048,4096,8192,16384,32768",
                   help="comma-separated sequence lengths (default 1024 to 32768)")
    p.add_argument("-o", "--output", type=Path, default=Path("plan.png"),
                   help="picture to write, its format from the extension: .png, .pdf, .svg, ... (default plan.png)")
    args = p.parse_args(argv)
    args.extra = extra
    check_extra(extra)
    try:
        args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
    except ValueError:
        raise PlanError(f"--seq-lens: '{args.seq_lens}' is not a comma-separated list of integers") from None
    if not args.trainer.exists():
        raise PlanError(f"{args.trainer} not found: build it (make train_gpt_cpu, or make train_gpt)")
    pyplot()  # before the trainer runs: fail at once without matplotlib or with a bad -o
    figure_format(args.output)
    draw(collect(args), args, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    run_main(main)
