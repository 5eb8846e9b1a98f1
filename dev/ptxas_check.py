#!/usr/bin/env python3
"""Register spills and register counts of the CUDA kernels, checked at build time.

Why: the mma attention kernels sit near the 255-register limit, and a spill
(local-memory traffic in the inner loop) or a register count that changes
the blocks per SM would cost speed silently; llmc/cuda/attention_mma.cuh states a
register budget for each (AttMmaRegs: ATT_MMA_MAX_REGS, with headroom below
255) that its occupancy arithmetic relies on (AttMmaResources). This compiles
a translation unit that instantiates the kernels (default: test_gpt.cu, every
kernel the trainer and its test use; `make cuda-all` runs it on
dev/ptxas_attention.cu, the attention kernels alone) with
`-Xptxas -v,-warn-spills` and fails, naming the kernel, on

  - any spill: a "Registers are spilled" warning or a nonzero spill-store or
    spill-load count in the -v report;
  - an mma kernel (forward, dK/dV, dQ at head sizes 64 and 128, whole
    sequence and attention tile) above its register budget, or with a stack
    frame above ATT_MMA_MAX_STACK_BYTES;
  - a kernel whose register count differs from an --expect NAME=REGS given
    (NAME a substring of the demangled kernel name);
  - a budgeted or expected kernel that the report does not contain (a renamed
    kernel must not turn the check into a no-op).

usage: dev/ptxas_check.py [--source test_gpt.cu] [--arch 90] [--define ENABLE_BF16]
                          [--expect NAME=REGS ...] [--budget NAME=MAX ...] [--max-stack BYTES]
                          [--no-source-asserts] [--nvcc PATH] [--] [extra nvcc flags]
Exit status: 0 clean, 1 a spill or a register mismatch (one line each), 2 the compile failed.
Run by dev/gpu_check.sh's build stage; dev/test/test_ptxas_check.py checks that it fails on a kernel forced to spill.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# "ptxas info    : Compiling entry function '_Z...' for 'sm_90'" / "Function properties for _Z..." / "Used 128 registers, ..."
ENTRY_RE = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(sm_\d+a?)'")
PROPS_RE = re.compile(r"ptxas info\s*: Function properties for (\S+)")
SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED_RE = re.compile(r"ptxas info\s*: Used (\d+) registers")
WARN_SPILL_RE = re.compile(r"ptxas warning\s*: .*[Rr]egisters are spilled.*?(?:function '([^']+)')?", re.S)


def demangle(names):
    cxxfilt = shutil.which("c++filt") or shutil.which("cu++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def source_budgets():
    """The register budgets llmc/cuda/attention_mma.cuh states (AttMmaRegs):
    {demangled-name substring: max registers} for the mma kernels at head
    sizes 64 and 128, whole sequence (<HS, false>) and attention tile
    (<HS, true>), and the stack cap in bytes. The names leave the template
    argument list open, so a kernel that gains a parameter (<HS, TILE, ...>)
    stays budgeted."""
    text = (REPO / "llmc" / "cuda" / "attention_mma.cuh").read_text()
    defines = {}
    for name in ("ATT_MMA_MAX_REGS", "ATT_MMA_MAX_REGS_DQ_TILE64", "ATT_MMA_MAX_REGS_DQ_TILE128", "ATT_MMA_MAX_STACK_BYTES"):
        m = re.search(r"^#define\s+" + name + r"\s+(\d+)\s*$", text, re.M)
        if not m:
            sys.exit(f"ptxas_check: llmc/cuda/attention_mma.cuh: #define {name} not found (update dev/ptxas_check.py)")
        defines[name] = int(m.group(1))
    if not re.search(r"DQ\s*=\s*TILE\s*\?\s*\(HS\s*==\s*64\s*\?\s*ATT_MMA_MAX_REGS_DQ_TILE64\s*:\s*ATT_MMA_MAX_REGS_DQ_TILE128\)\s*:\s*ATT_MMA_MAX_REGS",
                     text):
        sys.exit("ptxas_check: llmc/cuda/attention_mma.cuh: AttMmaRegs' DQ budget not found (update dev/ptxas_check.py)")
    got = {}
    for kernel in ("attention_mma_forward_kernel", "attention_mma_backward_dkv_kernel", "attention_mma_backward_dq_kernel"):
        for hs in (64, 128):
            for tile in ("false", "true"):
                special = kernel == "attention_mma_backward_dq_kernel" and tile == "true"
                got[f"{kernel}<{hs}, {tile}"] = defines[f"ATT_MMA_MAX_REGS_DQ_TILE{hs}" if special else "ATT_MMA_MAX_REGS"]
    return got, defines["ATT_MMA_MAX_STACK_BYTES"]


def parse(report):
    """-> {mangled kernel: {"regs": int, "spill_stores": int, "spill_loads": int, "stack": int}}, [spill warnings]."""
    kernels, current = {}, None
    warnings = []
    for line in report.splitlines():
        if "ptxas warning" in line and "spill" in line.lower():
            warnings.append(line.strip())
        m = ENTRY_RE.search(line) or PROPS_RE.search(line)
        if m:
            current = m.group(1)
            kernels.setdefault(current, {})
            continue
        if current is None:
            continue
        m = SPILL_RE.search(line)
        if m:
            kernels[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = USED_RE.search(line)
        if m:
            kernels[current]["regs"] = int(m.group(1))
    return kernels, warnings


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="test_gpt.cu")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--define", action="append", default=None, help="a -D macro (default ENABLE_BF16)")
    ap.add_argument("--expect", action="append", default=[], help="NAME=REGS: the kernel whose demangled name contains NAME uses REGS")
    ap.add_argument("--budget", action="append", default=[], help="NAME=MAX: the kernel whose demangled name contains NAME uses at most MAX "
                    "registers and a stack frame of at most --max-stack bytes (besides llmc/cuda/attention_mma.cuh's budgets)")
    ap.add_argument("--max-stack", type=int, default=None, help="stack frame cap of --budget kernels (default: ATT_MMA_MAX_STACK_BYTES, or 0)")
    ap.add_argument("--no-source-asserts", action="store_true", help="no register budgets (for a source without the attention kernels)")
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    defines = a.define if a.define is not None else ["ENABLE_BF16"]
    budgets, max_stack = ({}, None) if a.no_source_asserts else source_budgets()
    if a.max_stack is not None:
        max_stack = a.max_stack
    elif max_stack is None:
        max_stack = 0
    for e in a.budget:
        name, _, regs = e.partition("=")
        if not name or not regs.isdigit():
            sys.exit(f"ptxas_check: --budget {e}: expected NAME=MAX")
        budgets[name] = int(regs)
    expect = {}
    for e in a.expect:
        name, _, regs = e.partition("=")
        if not name or not regs.isdigit():
            sys.exit(f"ptxas_check: --expect {e}: expected NAME=REGS")
        expect[name] = int(regs)
    cmd = [a.nvcc, "-O3", "-std=c++17", "-I", str(REPO), f"-gencode=arch=compute_{a.arch},code=sm_{a.arch}",
           *[f"-D{d}" for d in defines], "-Xptxas", "-v,-warn-spills", "-c", "-o", os.devnull, a.source, *a.extra]
    print("ptxas_check:", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    report = res.stdout + res.stderr
    if res.returncode != 0:
        print(report[-6000:])
        print(f"ptxas_check: FAIL: the compile failed (exit {res.returncode})")
        return 2
    kernels, warnings = parse(report)
    names = demangle(list(kernels))
    problems = [f"ptxas warning: {w}" for w in warnings]
    for k, v in sorted(kernels.items(), key=lambda kv: names[kv[0]]):
        if v.get("spill_stores", 0) or v.get("spill_loads", 0):
            problems.append(f"{names[k]}: {v['spill_stores']} bytes spill stores, {v['spill_loads']} bytes spill loads "
                            f"({v.get('regs', '?')} registers, {v.get('stack', '?')} bytes stack)")
    for want, regs in expect.items():
        hits = [k for k in kernels if want in names[k] and "regs" in kernels[k]]
        if not hits:
            problems.append(f"{want}: asserted at {regs} registers, but no such kernel in the ptxas report")
        for k in hits:
            if kernels[k]["regs"] != regs:
                problems.append(f"{names[k]}: {kernels[k]['regs']} registers, the code asserts {regs}")
    for want, budget in budgets.items():
        hits = [k for k in kernels if want in names[k] and "regs" in kernels[k]]
        if not hits:
            problems.append(f"{want}: budgeted at {budget} registers, but no such kernel in the ptxas report")
        for k in hits:
            if kernels[k]["regs"] > budget:
                problems.append(f"{names[k]}: {kernels[k]['regs']} registers, above its budget of {budget} (llmc/cuda/attention_mma.cuh AttMmaRegs)")
            if kernels[k].get("stack", 0) > max_stack:
                problems.append(f"{names[k]}: {kernels[k]['stack']} bytes stack frame, above ATT_MMA_MAX_STACK_BYTES {max_stack}")
    print(f"ptxas_check: {len(kernels)} functions in the report; registers of the budgeted and asserted kernels:")
    for want in [*budgets, *expect]:
        for k in kernels:
            if want in names[k]:
                limit = f" (budget {budgets[want]})" if want in budgets else f" (asserted {expect[want]})"
                print(f"  {names[k][:110]}: {kernels[k].get('regs', '?')} registers{limit}, {kernels[k].get('stack', '?')} bytes stack, "
                      f"{kernels[k].get('spill_stores', '?')} bytes spill stores")
    for p in problems:
        print("ptxas_check: FAIL:", p)
    if problems:
        return 1
    print("ptxas_check: PASS: no spills; every budgeted kernel within its budget, every asserted register count matches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
