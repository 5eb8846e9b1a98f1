#!/usr/bin/env python3
"""Plots of training runs from their log.jsonl (written by the trainers with -o DIR).

    python3 dev/plot_log.py RUN_DIR [RUN_DIR ...] [-o FILE.png] [--labels A,B,...]

Panels: train and validation loss against step and against tokens, learning
rate, gradient norm, tokens/s, memory (device memory in use on the GPU, peak
resident memory on the CPU) and, when the runs used --eval-by-position, the
validation loss per position bucket at their last evaluation. Several runs are
overlaid, one colour each. A run resumed into the same directory appends to
its log; the steps it repeated (after the checkpoint it resumed from) are
taken from the resumed run only, so every step appears once. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class LogError(ValueError):
    pass


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or a one-line error."""
    try:
        import matplotlib
    except ImportError:
        raise LogError("matplotlib is not installed: pip install -r dev/data/requirements.txt") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, out: Path) -> None:
    """Writes the PNG under a temporary name first, so a half-written file never has the name."""
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)


def read_log(path: Path) -> dict:
    """Train, val and by-position records by step, later runs replacing the steps
    they repeated: a "resumed" event at step s, or a train step not after the last
    one (a fresh run into the same directory), drops every record after it."""
    train, val, by_pos = {}, {}, {}

    def truncate(after: int) -> None:
        for records in (train, val, by_pos):
            for s in [s for s in records if s > after]:
                del records[s]

    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise LogError(f"{path}: cannot read ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            if n == len(lines):
                continue  # a run killed mid-line leaves a partial last line
            raise LogError(f"{path}:{n}: not a log record") from None
        if rec.get("event") == "resumed":
            truncate(step)
        elif "loss" in rec:
            if train and step <= max(train):
                truncate(step - 1)
            train[step] = rec
        elif "val_loss" in rec:
            val[step] = rec["val_loss"]
        elif "val_loss_by_position" in rec:
            by_pos[step] = rec["val_loss_by_position"]
    if not train and not val:
        raise LogError(f"{path}: no training or validation records")
    return {"train": dict(sorted(train.items())), "val": dict(sorted(val.items())), "by_pos": by_pos}


def tokens_at(log: dict, step: int):
    """Tokens trained on at `step` (from the train records' tokens per step)."""
    if step == 0:
        return 0
    for s, rec in log["train"].items():
        if "tokens" in rec and s > 0:
            return rec["tokens"] / s * step
    return None


def plot(runs: list[tuple[str, dict]], out: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(20, 9))
    ax = dict(zip(["loss_step", "loss_tokens", "lr", "norm", "tps", "mem", "by_pos", "unused"], axes.flat))
    for i, (label, log) in enumerate(runs):
        color = f"C{i % 10}"
        steps = list(log["train"])
        field = lambda k: [r.get(k) for r in log["train"].values()]  # noqa: E731
        vsteps = list(log["val"])
        ax["loss_step"].plot(steps, field("loss"), color=color, alpha=0.6, lw=1, label=f"{label} train")
        ax["loss_step"].plot(vsteps, list(log["val"].values()), "o-", color=color, ms=4, label=f"{label} val")
        tokens = field("tokens")
        if steps and all(t is not None for t in tokens):
            ax["loss_tokens"].plot(tokens, field("loss"), color=color, alpha=0.6, lw=1, label=f"{label} train")
            vt = [tokens_at(log, s) for s in vsteps]
            ax["loss_tokens"].plot(vt, list(log["val"].values()), "o-", color=color, ms=4, label=f"{label} val")
        ax["lr"].plot(steps, field("lr"), color=color, label=label)
        ax["norm"].plot(steps, field("norm"), color=color, lw=1, label=label)
        ax["tps"].plot(steps, field("tokens_per_s"), color=color, lw=1, label=label)
        mem = field("memory_mib")
        if steps and all(m is not None for m in mem):
            ax["mem"].plot(steps, mem, color=color, label=label)
        if log["by_pos"]:
            last = max(log["by_pos"])
            buckets = log["by_pos"][last]
            ax["by_pos"].step([b["begin"] for b in buckets] + [buckets[-1]["end"]],
                              [b["loss"] for b in buckets] + [buckets[-1]["loss"]], where="post", color=color,
                              label=f"{label} (step {last})")
    titles = {"loss_step": ("loss vs step", "step"), "loss_tokens": ("loss vs tokens", "tokens"), "lr": ("learning rate", "step"),
              "norm": ("gradient norm (before clipping)", "step"), "tps": ("tokens/s", "step"),
              "mem": ("memory, MiB (GPU: device in use; CPU: peak resident)", "step"),
              "by_pos": ("val loss by position (last evaluation)", "position")}
    for key, (title, xlabel) in titles.items():
        a = ax[key]
        a.set_title(title)
        a.set_xlabel(xlabel)
        a.grid(alpha=0.3)
        if a.lines:
            a.legend(fontsize=7)
        else:
            a.text(0.5, 0.5, "no data in these logs", ha="center", va="center", transform=a.transAxes, color="gray")
    if any(ax["norm"].lines):
        ax["norm"].set_yscale("log")
    if ax["by_pos"].lines and max(b["end"] for _, log in runs for v in log["by_pos"].values() for b in v) > 4096:
        ax["by_pos"].set_xscale("symlog", linthresh=1024)
    ax["unused"].axis("off")
    fig.tight_layout()
    save_figure(plt, fig, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (-o of the trainer) or log.jsonl files")
    p.add_argument("-o", "--output", help="PNG to write (default: log.png in the first run directory)")
    p.add_argument("--labels", help="comma-separated labels, one per run (default: directory names)")
    args = p.parse_args(argv)
    paths = [Path(r) / "log.jsonl" if Path(r).is_dir() else Path(r) for r in args.runs]
    labels = args.labels.split(",") if args.labels else [p.parent.name or str(p) for p in paths]
    try:
        if len(labels) != len(paths):
            raise LogError(f"--labels: {len(labels)} labels for {len(paths)} runs")
        runs = [(label, read_log(path)) for label, path in zip(labels, paths)]
        out = Path(args.output) if args.output else paths[0].parent / "log.png"
        plot(runs, out)
    except LogError as e:
        print(f"plot_log.py: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
