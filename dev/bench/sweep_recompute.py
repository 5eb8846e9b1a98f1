#!/usr/bin/env python3
"""Memory/time sweep of activation recompute on the CUDA trainer (FP16 build).

For each model, sequence length T and recompute mode (-r 0, 2, 3, 1 on every
layer), at B=4, one cell reports:
  planned bytes   the trainer's own plan (--plan-json; needs no GPU)
  predicted       the plan's predicted ms/step and extra time over -r 0 from the
                  trainer's time model (llmc/plan/cost_model.h: its GPU's defaults, or
                  --cost-model FILE, e.g. one calibrated by REMAT_PROFILE_COST_MODEL),
                  beside the measured ones
  measured peak   device memory in use after step 1, as the trainer prints it
                  ("device memory after step 1: X MiB in use ..."), as a share of
                  the plan with and without the CUDA context and cuBLASLt handle
                  (which the trainer measures before allocating; not in the plan)
  ms/step         the trainer's "average step time" (first step excluded)
A cell whose plan exceeds the free device memory (the trainer's own budget:
free memory once the CUDA context exists, less 256 MiB) is not run and reads
"OOM (plan X GiB)". Cells that would not finish within the time budget
(predicted from the same model at a smaller T, attention ~ T^2) are skipped
and say so; their planned bytes are still reported.

Models (both with a 32768-row position table, so one model serves every T):
  d12      12 layers x 768 channels x 12 heads   (-e d12 --max-seq-len 32768)
  24x2048  24 layers x 2048 channels x 16 heads  (-e d24 --layers 24
           --channels 2048 --heads 16 --max-seq-len 32768)
Runs load a bf16 model file written once under data/sweep/ (random values in
the init's distribution) instead of the trainer's random init, which draws
1.4 billion normals on one CPU core (about a minute) before every run.
Tokens: a random GPT-2-vocabulary shard (V = 50257).

    python3 dev/bench/sweep_recompute.py              # default sweep, ~5 minutes on an H200
    python3 dev/bench/sweep_recompute.py --quick      # the subset dev/gpu_check.sh runs
    python3 dev/bench/sweep_recompute.py --dry-run    # planned bytes only: no GPU needed
    python3 dev/bench/plot_sweep.py out/sweep/sweep.csv

Writes OUT/sweep.md (markdown table) and OUT/sweep.csv (OUT: --out, default
out/sweep) and prints the table. Memory is in GiB (2^30 bytes).
Status: written without a GPU (compiles-and-runs only in --dry-run; the GPU
path was exercised against a stand-in trainer that prints the real one's
lines); unverified on GPU, and so is the ~5 minute estimate.
"""
import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "data"))
import datafile  # noqa: E402
from datafile import DataError, make_output_dir, run_main  # noqa: E402

GIB = float(1 << 30)
MIB = float(1 << 20)
V = 50257

MODELS = {
    "d12": {"label": "d12 (12 x 768, 12 heads)", "flags": ["-e", "d12"]},
    "24x2048": {"label": "24 layers x 2048 ch x 16 heads",
                "flags": ["-e", "d24", "--layers", "24", "--channels", "2048", "--heads", "16"]},
}
DEFAULT_T = [2048, 4096, 8192, 16384, 32768]
MODES = ["0", "2", "3", "1"]
MODE_NAMES = {"0": "-r 0", "2": "-r 2", "3": "-r 3", "1": "-r 1"}

# The cells --quick runs, most important first (the 24x2048 T=8192 -r 1 cell is
# the acceptance point; -r 0 beside -r 1 at T=2048 gives the time cost).
QUICK_CELLS = [("24x2048", 8192, "1"), ("24x2048", 8192, "3"), ("24x2048", 2048, "0"), ("24x2048", 2048, "1"),
               ("d12", 2048, "0"), ("d12", 2048, "2"), ("d12", 2048, "3"), ("d12", 2048, "1"),
               ("d12", 4096, "0"), ("d12", 4096, "2"), ("d12", 4096, "1")]

REFERENCE = ("Published reference for the 24 x 2048 model, B=4, on an 80 GB GPU: T=2048 38.4 GB and 142 ms/step "
             "without recompute, 12.2 GB and 178 ms with it; T=8192 out of memory without, 34.8 GB and 680 ms with. "
             "Not directly comparable: here the model state alone (fp16 parameters and gradients, fp32 master "
             "weights and AdamW m, v: 16 bytes per parameter, 1.38 billion parameters with the 32768-row position "
             "table) is 20.5 GiB, and attention is this project's simple WMMA tensor-core kernel (no FlashAttention).")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---- planning -----------------------------------------------------------------------------

def plan(exe, model, T, mode, args, budget=None):
    """The trainer's --plan-json for one cell (shape flags: no model file needed)."""
    cmd = [str(exe)] + MODELS[model]["flags"] + ["--max-seq-len", str(args.max_seq_len), "-b", str(args.b),
                                                 "-t", str(T), "-r", mode, "--plan-json"]
    if budget:
        cmd += ["--mem-budget", budget]
    if args.cost_model:
        cmd += ["--cost-model", args.cost_model]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        last = (res.stderr.strip() or "no output").splitlines()[-1]
        raise DataError(f"{' '.join(cmd)}: {last}")
    return json.loads(res.stdout)


def parse_bytes(text):
    m = re.fullmatch(r"\s*([0-9.]+)\s*(GiB|MiB|GB|MB|B)?\s*", text)
    if not m:
        raise ValueError(f"cannot read a size from {text!r} (e.g. 80GiB, 141GB)")
    mult = {"GiB": GIB, "MiB": MIB, "GB": 1e9, "MB": 1e6, "B": 1, None: 1}[m.group(2)]
    return int(float(m.group(1)) * mult)


# ---- inputs: token shard and model files ---------------------------------------------------

def ensure_shard(args):
    need = args.b * max(args.T) * (args.steps + 2) + 1
    n = max(2_000_000, need)
    path = Path(args.data_dir) / f"random50257_{n}.bin"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        datafile.write_shard(path, np.random.default_rng(0).integers(0, V, size=n), progress=False)
    return path


def to_bf16_bits(x):
    """fp32 -> bf16 bits, round to nearest even (no NaN here)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def ensure_model_file(model, cfg, args):
    """A version-5 (bf16) model file of the model's shape: weights N(0, std) as the
    trainer's init draws them (a 1M-value random block repeated, which is all a
    benchmark needs), LayerNorm weights 1, biases 0. Written once, atomically."""
    L, C, NH, maxT, Vp = cfg["num_layers"], cfg["channels"], cfg["num_heads"], cfg["max_seq_len"], cfg["padded_vocab_size"]
    path = Path(args.data_dir) / f"model_{model}_maxT{maxT}_bf16.bin"
    counts = [Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
              L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
    total = sum(counts)
    if total != cfg["num_parameters"]:
        raise RuntimeError(f"parameter count {total} differs from the trainer's {cfg['num_parameters']}")
    if path.exists() and path.stat().st_size == 1024 + 2 * total:
        return path
    t0 = time.time()
    path.parent.mkdir(parents=True, exist_ok=True)
    proj_std = 0.02 / math.sqrt(2.0 * L)
    std = {0: 0.02, 1: 0.02, 4: 0.02, 10: 0.02, 6: proj_std, 12: proj_std}
    ones = {2, 8, 14}  # ln1w, ln2w, lnfw
    block = np.random.default_rng(1337).standard_normal(1 << 20, dtype=np.float32)
    header = np.zeros(256, dtype=np.int32)
    header[:8] = [20240326, 5, maxT, cfg["vocab_size"], L, NH, C, Vp]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        for t, n in enumerate(counts):
            if t in std:
                piece = np.tile(to_bf16_bits(block * np.float32(std[t])), 16)  # 16M values, 32 MiB
            else:
                piece = np.full(1 << 24, 0x3F80 if t in ones else 0, dtype=np.uint16)
            for s in range(0, n, len(piece)):
                f.write(piece[: min(len(piece), n - s)].tobytes())
    os.replace(tmp, path)
    log(f"sweep: wrote {path} ({total} parameters, {(1024 + 2 * total) / GIB:.2f} GiB) in {time.time() - t0:.0f}s")
    return path


# ---- one cell on the GPU --------------------------------------------------------------------

def run_cell(exe, model_file, shard, T, mode, args, timeout):
    # one step more than timed: the last is profiled (llmc/cuda/profile.cuh) and left out of ms/step
    cmd = [str(exe), "-e", str(model_file), "-b", str(args.b), "-t", str(T), "-r", mode, "-x", str(args.steps + 1),
           "-i", str(shard), "-j", "", "-v", "0", "-s", "0"]
    t0 = time.time()
    env = dict(os.environ, REMAT_PROFILE=str(args.steps + 1))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, rc = res.stdout, res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = "", None
    r = parse_run(out, err, rc, args.steps, timeout)
    r["wall_s"], r["cmd"] = time.time() - t0, " ".join(cmd)
    return r


PROFILE_RE = re.compile(r"^profile of step \d+: ([0-9.]+) ms on the stream \| forward [0-9.]+ \(attention ([0-9.]+)\) "
                        r"\| classifier [0-9.]+ \| backward [0-9.]+, of which recompute ([0-9.]+) \(attention ([0-9.]+)\) "
                        r"and attention ([0-9.]+) \|", re.M)


STEP_MS_RE = re.compile(r"^step +(\d+)/\d+ \| loss [0-9.]+ \| lr \S+ \| norm [0-9.]+ \| ([0-9.]+) ms \|", re.M)


def parse_run(out, err, rc, steps, timeout):
    """What one trainer run printed: device memory (the largest of step 1's
    report and the step lines), the CUDA context and cuBLASLt handle that step
    1's report names (not part of the plan), ms/step, the profiled step's
    shares of attention and of recomputation, and a status word.
    rc None: the run timed out."""
    r = {}
    m = PROFILE_RE.search(out)
    if m:
        total, att_f, rec, att_r, att_b = map(float, m.groups())
        if total > 0:
            r["attention_share"] = f"{100 * (att_f + att_r + att_b) / total:.0f}%"
            r["recompute_share"] = f"{100 * rec / total:.0f}%"
    m = re.search(r"^device memory after step \d+: ([0-9.]+) MiB in use .* vs plan ([0-9.]+) MiB", out, re.M)
    used = [float(x) for x in re.findall(r"\| device memory ([0-9.]+) MiB", out)]
    if m:
        used.append(float(m.group(1)))
        r["trainer_plan_mib"] = float(m.group(2))
    if used:
        r["measured_mib"] = max(used)
    m = re.search(r"^ +difference [+-][0-9.]+ MiB = CUDA context and other processes ([0-9.]+) \+ cuBLASLt handle ([0-9.]+)",
                  out, re.M)
    if m:
        r["context_mib"] = float(m.group(1)) + float(m.group(2))
    # ms/step: steps 2..steps (step 1 warms up; a profiled step after them is left out)
    step_ms = [float(ms) for n, ms in STEP_MS_RE.findall(out) if 2 <= int(n) <= steps]
    if step_ms:
        r["ms"], r["timed_steps"] = sum(step_ms) / len(step_ms), len(step_ms)
    skipped = len(re.findall(r"skipped: inf/NaN gradients", out))
    if rc is None:
        r["status"] = f"timeout (>{timeout:.0f}s)"
    elif rc != 0:
        if "out of memory" in err or "out of device memory" in err:
            r["status"] = "OOM at allocation"
        else:
            last = (err.strip().splitlines() or ["?"])[-1].replace("|", "/")
            r["status"] = f"FAIL (rc {rc}): {last[:80]}"
    else:
        ran = len(re.findall(r"^step +\d+/", out, re.M))
        r["status"] = "ok" + (f", {skipped} of {ran} steps skipped (fp16 overflow, scale halved)" if skipped else "")
    if rc != 0:
        r["log_tail"] = (out + err)[-2000:]
    return r


# ---- the sweep ------------------------------------------------------------------------------

def cells_to_run(args):
    if args.quick:
        return [c for c in QUICK_CELLS if c[0] in args.models and c[1] in args.T and c[2] in args.modes]
    core = [(m, T, r) for m in ["24x2048", "d12"] if m in args.models for T in args.T if T <= 8192 for r in args.modes]
    extra = [(m, T, r) for T in args.T if T > 8192 for m in ["d12", "24x2048"] if m in args.models for r in args.modes]
    return core + extra


def predict_s(results, plans, model, T, mode, args):
    """Seconds a cell will take: startup plus steps at the largest smaller-T step
    time of this model scaled by (T/T0)^2 (attention-bound; an over-estimate where
    matmuls dominate), times the ratio of the two modes' predicted costs over -r 0
    (the time model's extra time) when another mode was measured. None when
    nothing smaller was measured."""
    best = None
    extra = lambda c: plans[c]["predicted_extra_time_fraction"] if c in plans else 0.0  # noqa: E731
    for (m, T0, r0), res in results.items():
        if m != model or T0 > T or "ms" not in res or (T0 == T and r0 == mode):
            continue
        ms = res["ms"] * (T / T0) ** 2 * max(1.0, (1 + extra((model, T, mode))) / (1 + extra((m, T0, r0))))
        startup = max(0.0, res["wall_s"] - ((args.steps + 1) * res["ms"]) / 1e3)  # steps + the profiled one
        est = startup + (args.steps + 2) * ms / 1e3
        best = est if best is None else max(best, est)
    return best


def fmt_gib(b):
    return "" if b is None else f"{b / GIB:.1f}"


def write_outputs(rows, args, header_lines):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = ["model", "T", "recompute", "planned_bytes", "planned_gib", "model_state_gib", "activations_gib", "scratch_gib",
              "budget_bytes", "fits", "measured_mib", "measured_over_plan", "arena_over_plan", "ms_per_step", "timed_steps", "tokens_per_s",
              "vs_r0", "predicted_ms_per_step", "predicted_vs_r0", "attention_share", "recompute_share", "status", "wall_s"]
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    lines = list(header_lines)
    if args.dry_run:
        budgets = [b for b in args.dry_budgets]
        lines.append("| model | T | -r | planned GiB | model state | activations | scratch | predicted ms/step | "
                     "predicted vs -r 0 | " + " | ".join(f"fits {b}" for b in budgets) + " |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in budgets) + " |")
        for r in rows:
            fits = " | ".join("yes" if r["planned_bytes"] <= parse_bytes(b) else "no" for b in budgets)
            lines.append(f"| {r['model']} | {r['T']} | {r['recompute']} | {r['planned_gib']} | {r['model_state_gib']} | "
                         f"{r['activations_gib']} | {r['scratch_gib']} | {r['predicted_ms_per_step']} | "
                         f"{r['predicted_vs_r0']} | {fits} |")
    else:
        lines.append("| model | T | -r | planned GiB | measured GiB | measured/plan | less context/plan | ms/step | vs -r 0 "
                     "| predicted ms/step | predicted vs -r 0 | tok/s | attention / recompute share | status |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            meas = f"{r['measured_mib'] * MIB / GIB:.1f}" if r.get("measured_mib") != "" else ""
            lines.append(f"| {r['model']} | {r['T']} | {r['recompute']} | {r['planned_gib']} | {meas} | "
                         f"{r['measured_over_plan']} | {r['arena_over_plan']} | {r['ms_per_step']} | {r['vs_r0']} | "
                         f"{r['predicted_ms_per_step']} | {r['predicted_vs_r0']} | {r['tokens_per_s']} | {r['attention_share'] or '-'} / {r['recompute_share'] or '-'} | "
                         f"{r['status']} |")
    lines += ["", REFERENCE]
    text = "\n".join(lines) + "\n"
    (out / "sweep.md").write_text(text)
    print(text, end="", flush=True)
    log(f"sweep: wrote {out / 'sweep.md'} and {out / 'sweep.csv'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--exe", default=str(REPO / "build" / "train_gpt_fp16"), help="trainer (default: build/train_gpt_fp16)")
    ap.add_argument("--models", default="d12,24x2048", help="comma list of d12, 24x2048")
    ap.add_argument("--T", default=",".join(map(str, DEFAULT_T)), help="comma list of sequence lengths")
    ap.add_argument("--modes", default="0,2,3,1", help="comma list of -r values (0, 2, 3, 1)")
    ap.add_argument("--cost-model", default="", help="the trainer's --cost-model for the predicted times (default: its own)")
    ap.add_argument("-b", type=int, default=4, help="batch size (default 4)")
    ap.add_argument("--max-seq-len", type=int, default=32768, help="position table rows of both models (default 32768)")
    ap.add_argument("--steps", type=int, default=3,
                    help="timed steps per cell, the first excluded from ms/step (at least 2; default 3); one more, profiled, follows")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock seconds for everything, setup included (default 290; --quick 140)")
    ap.add_argument("--cell-timeout-s", type=float, default=150, help="limit for one cell (default 150)")
    ap.add_argument("--quick", action="store_true", help="the small subset dev/gpu_check.sh runs")
    ap.add_argument("--dry-run", action="store_true", help="planned bytes only (no GPU needed, nothing is run)")
    ap.add_argument("--dry-budgets", default="79GiB,139GiB",
                    help="--dry-run: memory sizes to show the fit against (default 79GiB,139GiB: an 80 GB and a 141 GB card)")
    ap.add_argument("--out", default=str(REPO / "out" / "sweep"), help="output directory (default out/sweep)")
    ap.add_argument("--data-dir", default=str(REPO / "data" / "sweep"), help="model files and token shard (default data/sweep)")
    args = ap.parse_args()
    t_start = time.time()
    args.models = [m for m in args.models.split(",") if m]
    try:
        args.T = [int(t) for t in args.T.split(",") if t]
    except ValueError:
        sys.exit(f"error: --T {args.T!r} is not a comma list of integers")
    if not args.T or min(args.T) < 1:
        sys.exit(f"error: --T {args.T}: sequence lengths must be at least 1")
    args.modes = [r for r in args.modes.split(",") if r]
    args.dry_budgets = [b for b in args.dry_budgets.split(",") if b]
    for m in args.models:
        if m not in MODELS:
            sys.exit(f"error: --models: unknown model {m!r} (d12, 24x2048)")
    for r in args.modes:
        if r not in MODES:
            sys.exit(f"error: --modes: -r {r!r} is not 0, 2, 3 or 1")
    if args.steps < 2:
        sys.exit("error: --steps must be at least 2 (the first step only warms up)")
    if max(args.T) > args.max_seq_len:
        sys.exit(f"error: --T {max(args.T)} exceeds --max-seq-len {args.max_seq_len}")
    budget_s = args.budget_s if args.budget_s is not None else (140.0 if args.quick else 290.0)
    exe = Path(args.exe).resolve()  # a bare name would be looked up on PATH, not here
    make_output_dir(args.out, "--out")
    if not exe.exists():
        sys.exit(f"error: {exe} not found: build it with `make cuda-all` (or `make {exe.relative_to(REPO) if exe.is_absolute() and REPO in exe.parents else exe}`)")

    # plans for every cell of the table (quick: only the cells it runs)
    if args.quick and not args.dry_run:
        table_cells = sorted(cells_to_run(args), key=lambda c: (list(MODELS).index(c[0]), c[1], MODES.index(c[2])))
    else:
        table_cells = [(m, T, r) for m in MODELS if m in args.models for T in args.T for r in args.modes]
    # On the GPU the first plan measures the free device memory (the trainer's
    # default budget); the others reuse it as --mem-budget, which spares a CUDA
    # context per call.
    plans, cfgs = {}, {}
    budget_arg = args.dry_budgets[0] if args.dry_run else None
    for cell in table_cells:
        p = plan(exe, *cell, args, budget=budget_arg)
        plans[cell] = p
        cfgs[cell[0]] = p["config"]
        if budget_arg is None:
            budget_arg = str(p["budget_bytes"])
    prec = {2: "fp16 or bf16", 4: "fp32"}.get(next(iter(plans.values()))["elem_bytes"], "?") if plans else "?"
    if "fp16" not in exe.name:
        log(f"sweep: note: {exe.name} is not the FP16 build ({prec} storage)")

    results = {}
    if not args.dry_run:
        budget_free = next(iter(plans.values()))["budget_bytes"] if plans else 0
        log(f"sweep: free device memory budget (trainer's): {budget_free / GIB:.1f} GiB; time budget {budget_s:.0f}s")
        shard = ensure_shard(args)
        model_files = {}
        for cell in cells_to_run(args):
            model, T, mode = cell
            p = plans[cell]
            left = budget_s - (time.time() - t_start)
            if p["total_bytes"] > p["budget_bytes"]:
                results[cell] = {"status": f"OOM (plan {p['total_bytes'] / GIB:.1f} GiB)"}
                continue
            if model not in model_files:
                if left < 30:
                    results[cell] = {"status": "skipped: no time left"}
                    continue
                model_files[model] = ensure_model_file(model, cfgs[model], args)
                left = budget_s - (time.time() - t_start)
            pred = predict_s(results, plans, model, T, mode, args)
            if left < 15 or (pred is not None and pred > left):
                why = f"predicted {pred:.0f}s" if pred is not None else "no time"
                results[cell] = {"status": f"skipped: {why}, {max(left, 0):.0f}s left"}
                continue
            timeout = max(10.0, min(args.cell_timeout_s, left - 5))
            log(f"sweep: {model} T={T} -r {mode} (plan {p['total_bytes'] / GIB:.1f} GiB, limit {timeout:.0f}s"
                + (f", predicted {pred:.0f}s" if pred is not None else "") + ")")
            r = run_cell(exe, model_files[model], shard, T, mode, args, timeout)
            results[cell] = r
            log(f"sweep:   {r['status']}, {r.get('ms', float('nan')):.1f} ms/step, "
                f"{r.get('measured_mib', float('nan')):.0f} MiB measured, {r['wall_s']:.0f}s")
            if "log_tail" in r:
                log("sweep:   last output:\n" + "\n".join("    " + l for l in r["log_tail"].splitlines()[-8:]))
            tp = r.get("trainer_plan_mib")
            if tp is not None and abs(tp - p["total_bytes"] / MIB) > 0.1:
                r["status"] += f"; trainer's plan {tp:.1f} MiB differs from --plan-json's"

    rows = []
    for cell in table_cells:
        model, T, mode = cell
        p = plans[cell]
        comp = p["components"]
        state = comp["parameters"] + comp["master_weights"] + comp["gradients"] + comp["optimizer"]
        res = results.get(cell, {})
        row = {"model": model, "T": T, "recompute": mode, "planned_bytes": p["total_bytes"],
               "planned_gib": fmt_gib(p["total_bytes"]), "model_state_gib": fmt_gib(state),
               "activations_gib": fmt_gib(comp["activations"]), "scratch_gib": fmt_gib(comp["scratch"] + comp["workspace"]),
               "budget_bytes": p["budget_bytes"], "fits": p["total_bytes"] <= p["budget_bytes"],
               "measured_mib": "", "measured_over_plan": "", "arena_over_plan": "", "ms_per_step": "", "timed_steps": "", "tokens_per_s": "",
               "vs_r0": "", "predicted_ms_per_step": f"{1e3 * p['predicted_step_seconds']:.0f}",
               "predicted_vs_r0": f"{100.0 * p['predicted_extra_time_fraction']:+.0f}%",
               "attention_share": res.get("attention_share", ""), "recompute_share": res.get("recompute_share", ""),
               "status": res.get("status", "planned only" if args.dry_run else "not run"),
               "wall_s": f"{res['wall_s']:.0f}" if "wall_s" in res else ""}
        if "measured_mib" in res:
            row["measured_mib"] = round(res["measured_mib"])
            row["measured_over_plan"] = f"{100.0 * res['measured_mib'] * MIB / p['total_bytes']:.1f}%"
            if "context_mib" in res:
                row["arena_over_plan"] = f"{100.0 * (res['measured_mib'] - res['context_mib']) * MIB / p['total_bytes']:.1f}%"
        if "ms" in res:
            row["ms_per_step"] = f"{res['ms']:.0f}"
            row["timed_steps"] = res["timed_steps"]
            row["tokens_per_s"] = f"{args.b * T / (res['ms'] / 1e3):.0f}"
            base = results.get((model, T, "0"), {})
            if mode != "0" and "ms" in base:
                row["vs_r0"] = f"{100.0 * (res['ms'] / base['ms'] - 1):+.0f}%"
        rows.append(row)
    mode_word = "dry run (plans only)" if args.dry_run else ("quick sweep" if args.quick else "sweep")
    head = [f"Recompute {mode_word}: {exe.name}, B={args.b}, max-seq-len {args.max_seq_len}, "
            + ("" if args.dry_run else f"{args.steps} timed steps per cell (ms/step excludes the first; attention and "
               "recompute shares: of one more, profiled step's stream time, REMAT_PROFILE), ")
            + "memory in GiB; model state = parameters + master weights + gradients + AdamW state; predicted: "
            + f"the plan's time model ({next(iter(plans.values()))['cost_model']['name'] if plans else '?'}).", ""]
    write_outputs(rows, args, head)
    if not args.dry_run:
        failed = sum(1 for r in results.values() if r.get("status", "").startswith("FAIL"))
        log(f"sweep: done in {time.time() - t_start:.0f}s" + (f"; {failed} cell(s) FAILED" if failed else ""))
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    run_main(main)
