"""What the emulated tests share: where the emulator and its binaries are,
whether this machine can run it, how a run is started and explained, and
mutated copies of the sources (dev/emu/README.md). The session's build of
the emulator is conftest.py's emu_build fixture."""
import os
import platform
import re
import shutil
import subprocess

import pytest

from conftest import REPO

EMU = REPO / "dev" / "emu"
OUT = REPO / "build" / "emu"
SLOW = os.environ.get("REMAT_EMU_SLOW") == "1"
slow = pytest.mark.skipif(not SLOW, reason="slow emulator extra: set REMAT_EMU_SLOW=1")
JOBS = max(1, min(os.cpu_count() or 1, 4))


def fp16_in_sources():
    return re.search(r"typedef\s+__half\s+floatX", (REPO / "llmc/cuda/cuda_common.cuh").read_text()) is not None


PRECISIONS = ["bf16", "fp32", "fp16"]


def precision_param(p):
    if p == "fp16" and not fp16_in_sources():
        return pytest.param(p, marks=pytest.mark.skip(reason="FP16 not in the sources yet (no 'typedef __half floatX')"))
    return p


def platform_problem():
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the emulator's context switch is x86-64 Linux only (this is {platform.system()} {platform.machine()})"
    if not shutil.which(os.environ.get("CXX", "g++")):
        return "g++ not found (the emulator compiles the CUDA sources with it)"
    if not shutil.which("make"):
        return "make not found"
    return None


def emu_env(**extra):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # the pool runs one process per core
    env["OMP_WAIT_POLICY"] = "passive"
    env.update(extra)
    return env


def emu_run(args, timeout=900, **env):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=emu_env(**env), cwd=REPO)


def explain(res):
    return f"exit {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"


def mutant_sources(tmp, edits):
    """A copy of the sources and dev/emu in tmp with edits {file: (old, new)} applied (each old text must be
    there once), reusing the built runtime objects: newer than the copied runtime sources, so make keeps them.
    The caller builds the emulated binaries it needs from tmp."""
    for f in REPO.iterdir():
        if f.is_file() and f.suffix in (".c", ".cu", ".h"):
            shutil.copy2(f, tmp / f.name)
    shutil.copytree(REPO / "llmc", tmp / "llmc")
    shutil.copytree(EMU, tmp / "dev" / "emu")
    (tmp / "build" / "emu" / "obj").mkdir(parents=True)
    for obj in (OUT / "obj").glob("emu_*.o"):
        if not obj.name.startswith(("emu_test_gpt", "emu_train_gpt", "emu_bench")):
            shutil.copy2(obj, tmp / "build" / "emu" / "obj" / obj.name)
    for rel, (old, new) in edits.items():
        text = (tmp / rel).read_text()
        assert_mutant_applies(text, rel, old)
        (tmp / rel).write_text(text.replace(old, new))
    return tmp


def assert_mutant_applies(text, rel, old):
    """A mutant's text is in its source (text, of file rel) once. The slow sets' mutants are checked so in the fast
    suite too: a source that changed under one would else go unnoticed until a slow run."""
    assert text.count(old) == 1, f"{rel}: the text to mutate is not there once (the source changed: update the mutant)"


def build_trainers(repo, out, precisions):
    """The emulated train_gpt of each precision, built by dev/emu's Makefile
    in `repo` (the sources, or a mutated copy) into `out`; skips where the
    emulator cannot run."""
    why = platform_problem()
    if why:
        pytest.skip(why)
    exes = [out / f"emu_train_gpt_{p}" for p in precisions]
    res = subprocess.run(["make", "-s", "-C", str(repo / "dev" / "emu"), *map(str, exes)], capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return dict(zip(precisions, exes))


# Two steps, two micro-steps each, dropout 0.1 at every site, a checkpoint after step 2
TWO_STEPS = ["-j", "", "-b", "2", "-t", "32", "-x", "2", "-n", "2", "-s", "0", "-l", "1e-3", "--dropout", "0.1", "-d", "128"]


def train_two_steps(exe, model, tiny_shards, out, *flags, check=True):
    """TWO_STEPS of `model` on tiny_shards, the files in `out`."""
    res = emu_run([exe, *model, "-i", tiny_shards / "tiny_train.bin", *TWO_STEPS, "-o", out, *flags])
    if check:
        assert res.returncode == 0, explain(res)
    return res

