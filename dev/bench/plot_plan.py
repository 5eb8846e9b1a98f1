#!/usr/bin/env python3
"""Where the memory goes: the trainer's --plan-json for one model, drawn.

    python3 dev/bench/plot_plan.py [--trainer ./train_gpt] [-e d12] [-b 1]
        [--seq-lens 1024,2048,4096,8192,16384,32768] [-o plan.png] [-- FLAGS...]

For every sequence length and each recompute mode (-r 0 keep all, -r 2
selective, -r 1 full, -r 1 with its checkpoints offloaded) one bar, stacked from the plan's components:
parameters, gradients, optimizer state (AdamW m and v, plus the fp32 master
weights of low-precision builds), activations, and scratch (the logits chunk,
gradient buffers, staging; with the cuBLAS workspace), then, hatched, the host
memory of offloaded checkpoints (not on the device). Horizontal lines mark 80
GB and 141 GB, the memory of an H100 and an H200. Every run of the trainer uses
--max-seq-len = the longest sequence, so the parameters are the same in every
bar. Flags after `--` go to the trainer (e.g. --layers 24 --channels 2048
--heads 16). Nothing is allocated: --plan-json only plans (no GPU needed).
Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev"))
from plot_log import LogError, pyplot, save_figure  # noqa: E402
MODES = (("0", "-r 0"), ("2", "-r 2"), ("1", "-r 1"), ("1o:all", "-r 1o"))
# (label, plan components summed into it, colour)
STACK = (("parameters", ("parameters",), "tab:blue"), ("gradients", ("gradients",), "tab:orange"),
         ("optimizer state", ("optimizer", "master_weights"), "tab:green"),
         ("activations", ("activations",), "tab:red"), ("scratch", ("scratch", "workspace"), "tab:gray"))
LINES_GB = ((80, "80 GB (H100)"), (141, "141 GB (H200)"))


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


def draw(plans: dict, args, out: Path) -> None:
    plt = pyplot()
    seq_lens = sorted({T for T, _ in plans})
    fig, ax = plt.subplots(figsize=(max(8, 1.9 * len(seq_lens)), 6))
    width = 0.2
    for g, T in enumerate(seq_lens):
        for k, (mode, mode_label) in enumerate(MODES):
            p = plans[(T, mode)]
            x = g + (k - (len(MODES) - 1) / 2) * width
            bottom = 0.0
            for label, parts, color in STACK:
                gb = sum(p["components"].get(c, 0) for c in parts) / 1e9
                ax.bar(x, gb, width * 0.95, bottom=bottom, color=color, label=label if g == 0 and k == 0 else None)
                bottom += gb
            host = p.get("host_total_bytes", 0) / 1e9
            if host:
                ax.bar(x, host, width * 0.95, bottom=bottom, color="white", edgecolor="tab:purple", hatch="//",
                       label="host memory (offloaded)" if g == 0 else None)
                bottom += host
            ax.text(x, bottom, mode_label, ha="center", va="bottom", fontsize=7, rotation=90)
    for gb, label in LINES_GB:
        ax.axhline(gb, color="black", ls="--", lw=1)
        ax.text(len(seq_lens) - 0.5, gb, label, ha="right", va="bottom", fontsize=8)
    cfg = next(iter(plans.values()))["config"]
    elem = next(iter(plans.values()))["elem_bytes"]
    ax.set_xticks(range(len(seq_lens)), [str(T) for T in seq_lens])
    ax.set_xlabel("sequence length T (bars: -r 0 keep all, -r 2 selective, -r 1 full recompute, -r 1 offloaded)")
    ax.set_ylabel("planned memory, GB (1e9 bytes)")
    ax.set_title(f"{' '.join(['-e', args.model, *args.extra])}: L={cfg['num_layers']} C={cfg['channels']} NH={cfg['num_heads']}, "
                 f"{cfg['num_parameters'] / 1e6:.0f}M parameters, B={args.b}, {elem}-byte storage "
                 f"({Path(args.trainer).name})")
    ax.legend(loc="upper left")
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
    p.add_argument("-o", "--output", type=Path, default=Path("plan.png"), help="PNG to write (default plan.png)")
    args = p.parse_args(argv)
    args.extra = extra
    try:
        try:
            args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
        except ValueError:
            raise PlanError(f"--seq-lens: '{args.seq_lens}' is not a comma-separated list of integers") from None
        if not args.trainer.exists():
            raise PlanError(f"{args.trainer} not found: build it (make train_gpt_cpu, or make train_gpt)")
        pyplot()  # before the trainer runs: fail at once without matplotlib
        draw(collect(args), args, args.output)
    except LogError as e:
        print(f"plot_plan.py: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
