#!/usr/bin/env python3
"""Register spills and register counts of the CUDA kernels, checked at build time.

Why: the attention backward is a few registers from the 255 limit, and a
spill (local-memory traffic in the inner loop) or a register count that
changes the blocks per SM would cost speed silently; llmc/attention_mma.cuh
records the ptxas figures its occupancy arithmetic relies on
(AttMmaResources). This compiles a translation unit that instantiates the
kernels (default: test_gpt.cu, every kernel the trainer and its test use)
with `-Xptxas -v,-warn-spills` and fails, naming the kernel, on

  - any spill: a "Registers are spilled" warning or a nonzero spill-store or
    spill-load count in the -v report;
  - a kernel whose register count differs from what the code asserts:
    llmc/attention_mma.cuh's FWD_REGS/DKV_REGS/DQ_REGS for the forward, dK/dV
    and dQ kernels at head sizes 64 and 128 (FWD_BLOCK_REGS, ... for their
    attention-block instantiations) (and any
    --expect NAME=REGS given, NAME a substring of the demangled kernel name);
  - an asserted kernel that the report does not contain (a renamed kernel
    must not turn the check into a no-op).

usage: dev/ptxas_check.py [--source test_gpt.cu] [--arch 90] [--define ENABLE_BF16]
                          [--expect NAME=REGS ...] [--no-source-asserts] [--nvcc PATH] [--] [extra nvcc flags]
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


def source_asserts():
    """The register counts llmc/attention_mma.cuh records: {demangled-name substring: registers}, for the
    whole-sequence instantiations (<HS, false>: FWD_REGS, ...) and the attention blocks' (<HS, true>:
    FWD_BLOCK_REGS, ...)."""
    text = (REPO / "llmc" / "attention_mma.cuh").read_text()
    kernels = {"FWD": "attention_mma_forward_kernel", "DKV": "attention_mma_backward_dkv_kernel", "DQ": "attention_mma_backward_dq_kernel"}
    got = {}
    for prefix, kernel in kernels.items():
        for field, block in ((prefix + "_REGS", "false"), (prefix + "_BLOCK_REGS", "true")):
            m = re.search(r"\b" + field + r"\s*=\s*HS\s*==\s*64\s*\?\s*(\d+)\s*:\s*(\d+)", text)
            if not m:
                sys.exit(f"ptxas_check: llmc/attention_mma.cuh: AttMmaResources' {field} not found (update dev/ptxas_check.py)")
            got[f"{kernel}<64, {block}>"], got[f"{kernel}<128, {block}>"] = int(m.group(1)), int(m.group(2))
    return got


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
    ap.add_argument("--no-source-asserts", action="store_true", help="only --expect (for a source without the attention kernels)")
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    defines = a.define if a.define is not None else ["ENABLE_BF16"]
    expect = {} if a.no_source_asserts else source_asserts()
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
    print(f"ptxas_check: {len(kernels)} functions in the report; registers of the asserted kernels:")
    for want in expect:
        for k in kernels:
            if want in names[k]:
                print(f"  {names[k][:110]}: {kernels[k].get('regs', '?')} registers, {kernels[k].get('spill_stores', '?')} bytes spill stores")
    for p in problems:
        print("ptxas_check: FAIL:", p)
    if problems:
        return 1
    print("ptxas_check: PASS: no spills; every asserted register count matches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
