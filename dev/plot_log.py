#!/usr/bin/env python3
"""Plots of training runs from their log.jsonl (written by the trainers with -o DIR).

    python3 dev/plot_log.py RUN_DIR [RUN_DIR ...] [-o FILE.png|.pdf|.svg] [--labels A,B,...]
    python3 dev/plot_log.py [RUN_DIR ...] --dump DUMP [--dump DUMP ...] -o FILE.png

Panels: train and validation loss against step and against tokens, learning
rate, gradient norm, tokens/s, memory (device memory in use on the GPU, peak
resident memory on the CPU) and, when a run used --eval-by-position, the
validation loss per position bucket at its last evaluation; with --dump (a
trainer's --eval-dump, docs/FORMATS.md), the loss and top-1 accuracy at each
position the model gave a token (within its document under
--reset-position-ids), averaged over the tokens counted (not those
--eod-mask-loss skips; in bins of positions when T is above 512), one line per dump. The format of -o
follows its extension (PNG when it has none). Several runs are
overlaid, one colour each. A run resumed into the same directory appends to
its log; the steps it repeated (after the checkpoint it resumed from) are
taken from the resumed run only, so every step appears once. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
from datafile import DataError, read_eval_dump, run_main  # noqa: E402  (the scripts' one-line error path)


class LogError(DataError):
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


def figure_format(out: Path) -> str:
    """The file format -o names by its extension (png without one), checked
    with the directory before any work: a bad -o fails at once, in one line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fmt = out.suffix[1:].lower() or "png"
    supported = FigureCanvasAgg.get_supported_filetypes()
    if fmt not in supported:
        raise LogError(f"-o {out}: .{fmt} is not a format matplotlib writes ({', '.join(sorted(supported))})")
    if out.is_dir():
        raise LogError(f"-o {out}: is a directory (give the file to write)")
    if not out.parent.is_dir():
        raise LogError(f"-o {out}: the directory {out.parent} does not exist")
    return fmt


def save_figure(plt, fig, out: Path) -> None:
    """Writes the figure in the format of out's extension under a temporary
    name first, so a half-written file never has the name."""
    tmp = out.with_name(out.name + ".tmp")
    try:
        fig.savefig(tmp, format=figure_format(out), dpi=100)
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LogError(f"-o {out}: cannot write ({e.strerror})") from None
    finally:
        plt.close(fig)


def readable_log_y(ax) -> None:
    """A log y axis labelled in plain numbers with enough ticks for its range:
    within a decade evenly spaced values, over a few decades 1-2-5 steps,
    beyond that decades (matplotlib's default labels only the decades)."""
    from matplotlib import ticker

    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    decades = math.log10(hi / lo)
    axis = ax.yaxis
    if decades < 1:
        ticks = [t for t in ticker.MaxNLocator(nbins=6).tick_values(lo, hi) if lo <= t <= hi]
        axis.set_major_locator(ticker.FixedLocator(ticks))
    elif decades < 3:
        axis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
    else:
        axis.set_major_locator(ticker.LogLocator())
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


# The trainer writes a non-finite loss, norm or validation loss as null (JSON
# has no NaN); logs of earlier versions have printf's nan, -nan, inf or -inf,
# read as NaN and +-Infinity. Either way a non-finite value plots as a gap.
NON_FINITE = re.compile(r"(?<=: )(-?nan|-?inf)(?=[,}])")
NULLABLE = ("loss", "norm", "val_loss")
JSON_NON_FINITE = {"nan": "NaN", "-nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
TRAIN_NUMBERS = ("loss", "lr", "norm", "ms", "tokens_per_s", "tokens", "memory_mib")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _nulls_as_nan(rec):
    """The trainer's null for a non-finite loss, norm or validation loss, as NaN."""
    if not isinstance(rec, dict):
        return rec
    for k in NULLABLE:
        if k in rec and rec[k] is None:
            rec[k] = float("nan")
    buckets = rec.get("val_loss_by_position")
    if isinstance(buckets, list):
        for b in buckets:
            if isinstance(b, dict) and "loss" in b and b["loss"] is None:
                b["loss"] = float("nan")
    return rec


def record_problem(rec: dict):
    """What makes a parsed record unplottable (a field that is not a number,
    a malformed bucket list), or None."""
    if "loss" in rec:
        bad = [k for k in TRAIN_NUMBERS if rec.get(k) is not None and not _is_number(rec[k])]
        return f"{bad[0]} {rec[bad[0]]!r} is not a number" if bad else None
    if "val_loss" in rec:
        return None if _is_number(rec["val_loss"]) else f"val_loss {rec['val_loss']!r} is not a number"
    if "val_loss_by_position" in rec:
        buckets = rec["val_loss_by_position"]
        ok = isinstance(buckets, list) and buckets and all(
            isinstance(b, dict) and all(_is_number(b.get(k)) for k in ("begin", "end", "loss")) for b in buckets)
        return None if ok else "val_loss_by_position is not a list of buckets with numbers begin, end, loss"
    return None


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
            rec = _nulls_as_nan(json.loads(NON_FINITE.sub(lambda m: JSON_NON_FINITE[m.group(1)], line)))
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            if n == len(lines):
                continue  # a run killed mid-line leaves a partial last line
            raise LogError(f"{path}:{n}: not a log record") from None
        problem = record_problem(rec)
        if problem:
            raise LogError(f"{path}:{n}: {problem}")
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


def dump_by_position(dump: dict, bins: int = 512):
    """(first position of each bin, mean loss, top-1 accuracy) over the tokens
    the dump counts (position >= 0), by the position the model gave them (in
    the document under --reset-position-ids): the means of --eval-by-position.
    A bin no token reaches is NaN (a gap in the plot)."""
    import numpy as np

    T = dump["T"]
    width = max(1, -(-T // bins))
    edges = np.arange(0, T, width)
    pos = dump["position"]
    counted = pos >= 0
    where = pos[counted]
    tokens = np.add.reduceat(np.bincount(where, minlength=T).astype(np.float64), edges)
    loss = np.add.reduceat(np.bincount(where, weights=dump["loss"][counted].astype(np.float64), minlength=T), edges)
    hits = np.add.reduceat(np.bincount(where, weights=(dump["top1"] == dump["target"])[counted].astype(np.float64), minlength=T), edges)
    with np.errstate(invalid="ignore", divide="ignore"):
        return edges, np.where(tokens > 0, loss / tokens, np.nan), np.where(tokens > 0, hits / tokens, np.nan)


def plot(runs: list[tuple[str, dict]], out: Path, dumps: list[tuple[str, dict]] = ()) -> None:
    plt = pyplot()
    panels = ["loss_step", "loss_tokens", "lr", "norm", "tps", "mem"] if runs else []
    if any(log["by_pos"] for _, log in runs):
        panels.append("by_pos")
    if dumps:
        panels += ["dump_loss", "dump_top1"]
    cols = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(5.5 * cols, 9))
    ax = dict(zip(panels, axes.flat))
    for unused in axes.flat[len(panels):]:
        unused.axis("off")
    for i, (label, log) in enumerate(runs):
        color = f"C{i % 10}"
        steps = list(log["train"])
        field = lambda k: [r.get(k) for r in log["train"].values()]  # noqa: E731
        vsteps = list(log["val"])
        ax["loss_step"].plot(steps, field("loss"), color=color, alpha=0.6, lw=1, label=f"{label} train")
        if vsteps:
            ax["loss_step"].plot(vsteps, list(log["val"].values()), "o-", color=color, ms=4, label=f"{label} val")
        tokens = field("tokens")
        if steps and all(t is not None for t in tokens):
            ax["loss_tokens"].plot(tokens, field("loss"), color=color, alpha=0.6, lw=1, label=f"{label} train")
            if vsteps:
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
    for i, (label, dump) in enumerate(dumps):
        edges, loss, top1 = dump_by_position(dump)
        ax["dump_loss"].plot(edges, loss, color=f"C{i % 10}", lw=1, label=f"{label} (step {dump['step']})")
        ax["dump_top1"].plot(edges, top1, color=f"C{i % 10}", lw=1, label=f"{label} (step {dump['step']})")
    titles = {"loss_step": ("loss vs step", "step"), "loss_tokens": ("loss vs tokens", "tokens"), "lr": ("learning rate", "step"),
              "norm": ("gradient norm (before clipping)", "step"), "tps": ("tokens/s", "step"),
              "mem": ("memory, MiB (GPU: device in use; CPU: peak RSS)", "step"),
              "by_pos": ("val loss by position (last evaluation)", "position"),
              "dump_loss": ("val loss at each position (--eval-dump)", "position"),
              "dump_top1": ("val top-1 accuracy at each position (--eval-dump)", "position")}
    for key in panels:
        title, xlabel = titles[key]
        a = ax[key]
        a.set_title(title)
        a.set_xlabel(xlabel)
        a.grid(alpha=0.3)
        if a.lines:
            a.legend(fontsize=7)
        else:
            a.text(0.5, 0.5, "no data in these logs", ha="center", va="center", transform=a.transAxes, color="gray")
    if runs and any(n is not None and n > 0 for _, log in runs for n in (r.get("norm") for r in log["train"].values())):
        readable_log_y(ax["norm"])
    if "by_pos" in ax and max(b["end"] for _, log in runs for v in log["by_pos"].values() for b in v) > 4096:
        ax["by_pos"].set_xscale("symlog", linthresh=1024)
    fig.tight_layout()
    save_figure(plt, fig, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="run directories (-o of the trainer) or log.jsonl files")
    p.add_argument("-o", "--output", help="picture to write, its format from the extension: .png, .pdf, .svg, ... "
                   "(default: log.png in the first run directory)")
    p.add_argument("--labels", help="comma-separated labels, one per run (default: directory names)")
    p.add_argument("--dump", action="append", default=[], help="a trainer's --eval-dump file: loss and top-1 accuracy "
                   "by position (repeatable)")
    args = p.parse_args(argv)
    if not args.runs and not args.dump:
        raise LogError("give run directories, --dump files, or both")
    if not args.runs and not args.output:
        raise LogError("--dump without run directories: give -o FILE")
    paths = [Path(r) / "log.jsonl" if Path(r).is_dir() else Path(r) for r in args.runs]
    labels = args.labels.split(",") if args.labels else [p.parent.name or str(p) for p in paths]
    if len(labels) != len(paths):
        raise LogError(f"--labels: {len(labels)} labels for {len(paths)} runs")
    out = Path(args.output) if args.output else paths[0].parent / "log.png"
    pyplot()
    figure_format(out)
    runs = [(label, read_log(path)) for label, path in zip(labels, paths)]
    dumps = [(Path(d).name, read_eval_dump(d)) for d in args.dump]
    plot(runs, out, dumps)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
