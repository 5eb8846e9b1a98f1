#!/usr/bin/env python3
"""Plots the recompute sweep's CSV (dev/bench/sweep_recompute.py) as a PNG.

    python3 dev/bench/plot_sweep.py [out/sweep/sweep.csv] [-o out/sweep/sweep.png]

One column per model: device memory against T on top (lines: the plan of each
-r mode; markers: the measured peak; dotted: the free-memory budget the cells
were checked against), ms/step against T below (log scales). Cells that were
not run appear in the memory panel only (their plan). Needs matplotlib; without
it the script says so and exits 0, so scripts calling it do not fail.
"""
import argparse
import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev"))
from plot_log import LogError, figure_format, run_main, save_figure  # noqa: E402

COLUMNS = ("model", "T", "recompute", "planned_bytes", "measured_mib", "ms_per_step", "budget_bytes")
GIB = float(1 << 30)
MODE_STYLE = {"0": ("-r 0 (keep all)", "tab:red", "o"), "2": ("-r 2 (selective)", "tab:orange", "s"),
              "1": ("-r 1 (full)", "tab:blue", "^")}


def num(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def read_rows(src: Path) -> list:
    """The sweep's rows, each with the columns the plot reads: T an integer,
    planned_bytes a number (the other numbers may be empty: cells not run)."""
    try:
        with open(src, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise LogError(f"{src}: cannot read as CSV ({e})") from None
    if not rows:
        raise LogError(f"{src} has no rows")
    missing = [c for c in COLUMNS if c not in rows[0]]
    if missing:
        raise LogError(f"{src}: no column {', '.join(missing)} (not a sweep_recompute.py CSV)")
    for n, r in enumerate(rows, 2):
        if not (r["T"] or "").isdigit() or num(r["planned_bytes"]) is None:
            raise LogError(f"{src}:{n}: T {r['T']!r} or planned_bytes {r['planned_bytes']!r} is not a number")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?", default=str(REPO / "out" / "sweep" / "sweep.csv"))
    ap.add_argument("-o", "--output", default=None,
                    help="picture to write, its format from the extension (default: beside the CSV, sweep.png)")
    args = ap.parse_args()
    src = Path(args.csv)
    if not src.is_file():
        raise LogError(f"{src} not found: run dev/bench/sweep_recompute.py first")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.ScalarFormatter below)
    except ImportError:
        print("plot_sweep: matplotlib is not installed, no plot made (pip install matplotlib)", file=sys.stderr)
        return 0
    out = Path(args.output) if args.output else src.with_name("sweep.png")
    figure_format(out)
    rows = read_rows(src)
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        mem, tim = axes[0][col], axes[1][col]
        mine = [r for r in rows if r["model"] == model]
        for mode, (label, color, marker) in MODE_STYLE.items():
            cells = sorted((int(r["T"]), r) for r in mine if r["recompute"] == mode)
            if not cells:
                continue
            Ts = [T for T, _ in cells]
            mem.plot(Ts, [num(r["planned_bytes"]) / GIB for _, r in cells], color=color, marker=".", label=f"{label}, plan")
            measured = [(T, num(r["measured_mib"]) / 1024) for T, r in cells if num(r["measured_mib"]) is not None]
            if measured:
                mem.plot(*zip(*measured), linestyle="none", marker=marker, color=color, label=f"{label}, measured")
            timed = [(T, num(r["ms_per_step"])) for T, r in cells if num(r["ms_per_step"]) is not None]
            if timed:
                tim.plot(*zip(*timed), marker=marker, color=color, label=label)
        budgets = {num(r["budget_bytes"]) for r in mine if num(r["budget_bytes"])}
        if len(budgets) == 1:
            b = budgets.pop() / GIB
            mem.axhline(b, color="gray", linestyle=":", label=f"budget {b:.0f} GiB")
        for ax in (mem, tim):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel("sequence length T")
            ax.grid(True, which="both", alpha=0.3)
        mem.set_yscale("log", base=2)
        mem.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        tim.set_yscale("log")
        mem.set_title(f"{model}: device memory")
        mem.set_ylabel("GiB")
        tim.set_title(f"{model}: time per step")
        tim.set_ylabel("ms/step")
        mem.legend(fontsize=7)
        if tim.lines:
            tim.legend(fontsize=7)
        else:
            tim.text(0.5, 0.5, "no timings (plans only)", transform=tim.transAxes, ha="center", color="gray")
    fig.tight_layout()
    save_figure(plt, fig, out)
    print(f"plot_sweep: wrote {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
