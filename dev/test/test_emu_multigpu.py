"""The NCCL data-parallel path of train_gpt (llmc/cuda/multigpu.cuh) under the CPU
emulator (dev/emu; NOT a GPU, NOT NCCL): `mpirun -np 2` of emu_train_gpt_mpi_*,
whose NCCL calls run over MPI (dev/emu/runtime/emu_nccl.cpp) on a stream of
their own that really interleaves with the compute stream (EMU_STREAM_ORDER),
every cross-stream access checked by the emulator's streamcheck.

What is compared with what, and why the bounds:
- 2 ranks x B against 1 rank x 2B (the plain emulated trainer, no NCCL): the
  same tokens per step, but the gradient of the 2B rows is one matmul
  reduction on one rank and the sum of two B-row reductions (each rounded to
  the gradient type) on two. FP32: those differ by rounding only (~1e-7
  relative per step), so the losses of a few AdamW steps agree to 1e-5
  relative. BF16: the two per-rank gradients are each rounded to bf16 (8
  significant bits, 2^-9 relative) before the sum, and AdamW's update,
  m / sqrt(v), normalises away the size of small gradients, so a rounding
  change can move an update by up to lr; after 4 steps at lr 1e-3 the losses
  agree to 1e-3 absolute (measured: 0, 5.6e-5, 6.2e-5, 6.2e-5; FP32: 0 at
  the 6 printed decimals).
- one emulated rank through NCCL (mpirun -np 1) against the plain trainer:
  an all-reduce over one rank is the identity, so the runs are bitwise equal.
- ZeRO-1 against ZeRO-0, per-layer overlap against the sum after the
  backward (REMAT_NCCL_OVERLAP=0): the same rank-order sums of the same
  values (the emulated NCCL sums in rank order on every rank) and the same
  AdamW arithmetic per element, so the step lines and the model files are
  bitwise equal.
- resume across ranks: bitwise, like the one-process resume.
- mutants: each cudaStreamWaitEvent of llmc/cuda/multigpu.cuh deleted at run time
  (EMU_DELETE_SYNC=llmc/cuda/multigpu.cuh:LINE) must stop the run with a stream
  hazard naming the buffer, both streams and both operations.
"""
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import REPO, datafile

EMU = REPO / "dev" / "emu"
OUT = REPO / "build" / "emu"
TINY = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
STEP_RE = re.compile(r"^step +(\d+)/(\d+) \| loss ([0-9.]+) \| lr (\S+) \| norm ([0-9.]+)", re.M)
MULTIGPU = REPO / "llmc" / "cuda" / "multigpu.cuh"

if shutil.which("mpirun") is None or shutil.which("mpicc") is None:
    pytest.skip("mpirun/mpicc not found: the emulated multi-GPU runs need OpenMPI (apt-get install openmpi-bin libopenmpi-dev)",
                allow_module_level=True)


def env(**extra):
    e = dict(os.environ)
    e.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
              "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "EMU_DEVICE_COUNT": "2"})  # each process its own device
    e.update(extra)
    return e


def explain(res):
    return f"exit {res.returncode}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-5000:]}"


@pytest.fixture(scope="module")
def bins():
    res = subprocess.run(["make", "-C", str(EMU), "-j2", "mpi-bins", str(OUT / "emu_train_gpt_bf16"), str(OUT / "emu_train_gpt_fp32")],
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        pytest.fail("building the emulated trainers failed:\n" + res.stdout[-3000:] + res.stderr[-5000:])
    if "skipped" in res.stdout and not (OUT / "emu_train_gpt_mpi_bf16").exists():
        pytest.skip(res.stdout.strip().splitlines()[-1])
    return OUT


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("emu_multigpu")
    rng = np.random.default_rng(3)
    datafile.write_shard(d / "train.bin", rng.integers(0, 64, 20000))
    return d


def train(bins, data, ranks, precision, *flags, timeout=600, **extra):
    """ranks 0: the plain emulated trainer, one process, no NCCL; else mpirun -np ranks of the NCCL build."""
    common = [*TINY, "-i", data / "train.bin", "-j", "", "-t", "32", "-s", "0", "-l", "1e-3", *flags]
    if ranks == 0:
        args = [bins / f"emu_train_gpt_{precision}", *common]
    else:
        args = ["mpirun", "-np", str(ranks), bins / f"emu_train_gpt_mpi_{precision}", *common]
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env(**extra), cwd=REPO)


def steps(res):
    assert res.returncode == 0, explain(res)
    return [(m.group(1), m.group(3), m.group(4), m.group(5)) for m in STEP_RE.finditer(res.stdout)]


def model_without_run_id(path):
    data = path.read_bytes()
    return data[:4 * 240] + data[4 * 242:]  # header slots 240-241: each run's own id


def assert_runs_identical(runs, out, step):
    """runs {name: (result, steps)} with -o out/name: every run's steps and
    model file of `step` (less the run id) are the first run's."""
    (first, (_, base)), model = next(iter(runs.items())), f"model_{step:08d}.bin"
    assert len(base) == step
    for name, (res, got) in runs.items():
        assert got == base, f"{name}: {got} != {first}: {base}"
        assert (out / name / model).exists(), explain(res)
        assert model_without_run_id(out / name / model) == model_without_run_id(out / first / model), f"{name}: model differs"


@pytest.mark.parametrize("precision, bound", [("fp32", 1e-5), ("bf16", 1e-3)])
def test_two_ranks_match_one_rank_with_twice_the_batch(bins, data, precision, bound):
    one = steps(train(bins, data, 0, precision, "-b", "4", "-x", "4"))
    two_res = train(bins, data, 2, precision, "-b", "2", "-x", "4")
    two = steps(two_res)
    assert "x 2 processes" in two_res.stdout and "data parallel: 2 processes, NCCL" in two_res.stdout, explain(two_res)
    assert len(one) == len(two) == 4, (one, two)
    diffs = [abs(float(a[1]) - float(b[1])) for a, b in zip(one, two)]
    print(f"{precision}: |loss(2 ranks x 2) - loss(1 rank x 4)| per step: {diffs}")
    if precision == "fp32":
        assert all(d <= bound * float(b[1]) for d, b in zip(diffs, one)), (one, two)
    else:
        assert all(d <= bound for d in diffs), (one, two)
    assert diffs[0] <= 1e-5 * float(one[0][1]) * (1 if precision == "fp32" else 100), "step 1's loss is computed before any update"


def test_one_rank_through_nccl_is_the_plain_trainer(bins, data):
    """An all-reduce over one rank is the identity: the NCCL build alone is bitwise the plain trainer."""
    plain = steps(train(bins, data, 0, "bf16", "-b", "2", "-x", "3"))
    nccl = train(bins, data, 1, "bf16", "-b", "2", "-x", "3")
    assert "data parallel: 1 process, NCCL 2.21.5" in nccl.stdout, explain(nccl)
    assert steps(nccl) == plain and len(plain) == 3


def test_zero1_and_the_sum_after_the_backward_match_per_layer_overlap_bitwise(bins, data, tmp_path):
    """ZeRO-0 with the per-layer overlap, ZeRO-1 with it, ZeRO-0 summing everything after the backward
    (REMAT_NCCL_OVERLAP=0), with 2 micro-steps per step (the overlap arms on the last one): the same bits.
    The three runs also use the three stream orders (which change when the collectives run, not what they sum)."""
    runs = {}
    for name, flags, extra in [("z0", ["-z", "0"], {"EMU_STREAM_ORDER": "earliest"}),
                               ("z1", ["-z", "1"], {"EMU_STREAM_ORDER": "latest"}),
                               ("z0-after", ["-z", "0"], {"REMAT_NCCL_OVERLAP": "0", "EMU_STREAM_ORDER": "shuffle:3"})]:
        res = train(bins, data, 2, "bf16", "-b", "2", "-d", "256", "-x", "3", "-n", "3", "-o", tmp_path / name, *flags, **extra)
        runs[name] = (res, steps(res))
    assert "gradient accumulation 2" in runs["z0"][0].stdout
    assert "ZeRO-1" in runs["z1"][0].stdout and "per layer during the last micro-step's backward" in runs["z1"][0].stdout
    assert "after the backward (REMAT_NCCL_OVERLAP=0)" in runs["z0-after"][0].stdout
    assert_runs_identical(runs, tmp_path, 3)


def test_two_rank_resume_is_bitwise_identical(bins, data, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["-b", "2", "-x", "4", "-n", "2", "-z", "1"]
    first = train(bins, data, 2, "bf16", *common, "-o", full)
    part.mkdir()
    copied = [f for f in full.iterdir() if f.name.endswith("_00000002.bin") or "_00000002_" in f.name or f.name == "DONE_00000002"]
    assert len(copied) >= 4, sorted(f.name for f in full.iterdir())  # model, a state file per rank, DONE
    for f in copied:
        shutil.copy(f, part / f.name)
    resumed = train(bins, data, 2, "bf16", *common, "-o", part, "-y", "1")
    assert "resumed: step 2" in resumed.stdout, explain(resumed)
    assert steps(resumed) == steps(first)[2:] and len(steps(first)) == 4
    for f in full.iterdir():
        if "00000004" in f.name and f.suffix == ".bin":
            a, b = f.read_bytes(), (part / f.name).read_bytes()
            assert a == b, f"{f.name} differs after the resume"


def test_collective_timeout_names_the_stalled_rank(bins, data):
    """Rank 1 stops itself (SIGSTOP) as step 3 begins: rank 0 waits in the gradient reduction's arrival exchange and
    names rank 1 within a few seconds of --collective-timeout 2."""
    args = ["mpirun", "-np", "2", str(bins / "emu_train_gpt_mpi_bf16"), *TINY, "-i", str(data / "train.bin"), "-j", "", "-b", "2",
            "-t", "32", "-s", "0", "-x", "1000", "--collective-timeout", "2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(REMAT_TEST_STALL="1:3"),
                            start_new_session=True)
    guard = threading.Timer(240, lambda: os.killpg(proc.pid, signal.SIGKILL))
    guard.start()
    try:
        t0 = time.time()
        out, err = proc.communicate()
        seconds = time.time() - t0
    finally:
        guard.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the stopped rank, if mpirun left it
        except ProcessLookupError:
            pass
    assert proc.returncode != 0, out[-2000:] + err[-3000:]
    assert re.search(r"^error: rank 0: waited more than 2 s in the gradient all-reduce \(step 3\) for rank 1 \(last seen at [^)]*\): "
                     r".*\(--collective-timeout\)$", err, re.M), err[-3000:]
    assert "step    2/" in out and "step    3/" not in out, out[-2000:]
    print(f"stopped {seconds:.1f} s after the start")


def wait_lines():
    """The gradient collectives' stream waits; the context-parallel ring's (multigpu_ring_*), which a data-parallel
    run never reaches, are deleted by test_emu_context_parallel.py."""
    lines, inside = [], None
    for i, ln in enumerate(MULTIGPU.read_text().splitlines(), 1):
        m = re.match(r"static inline \w+ (\w+)\(", ln)
        if m:
            inside = m.group(1)
        if (re.search(r"\bcudaStreamWaitEvent\(", ln.split("//")[0]) and not ln.lstrip().startswith(("*", "/*"))
                and not (inside or "").startswith("multigpu_ring_")):
            lines.append(i)
    assert len(lines) >= 2, "llmc/cuda/multigpu.cuh: fewer cudaStreamWaitEvent calls than the fork and the join"
    return lines


@pytest.mark.parametrize("line", wait_lines())
def test_deleting_a_stream_wait_is_a_stream_hazard(bins, data, line):
    res = train(bins, data, 2, "bf16", "-b", "2", "-x", "2", "-z", "0", EMU_DELETE_SYNC=f"llmc/cuda/multigpu.cuh:{line}")
    assert res.returncode != 0, explain(res)
    m = re.search(r"emu: stream hazard: (.+?) on (.+?) (reads|writes) byte \d+ of buffer '(\w+)' .*?, which (.+?) on (.+?) (wrote|read) "
                  r"before, and no event wait, stream wait or host synchronisation orders the two", res.stderr)
    assert m, explain(res)
    ops, streams = {m.group(1), m.group(5)}, {m.group(2), m.group(6)}
    assert "the legacy default stream" in streams and any("cudaStreamNonBlocking" in s for s in streams), m.group(0)
    assert any("ncclAllReduce" in o for o in ops) and any(o.startswith("kernel ") for o in ops), m.group(0)
    assert m.group(4) == "grads", m.group(0)


def test_the_unmutated_run_has_no_hazard_in_any_stream_order(bins, data):
    """The control of the mutants: the same run without a deletion, in the order that delays the collective stream most."""
    res = train(bins, data, 2, "bf16", "-b", "2", "-x", "2", "-z", "1", EMU_STREAM_ORDER="latest")
    assert len(steps(res)) == 2 and "stream hazard" not in res.stderr


@pytest.mark.parametrize("ranks", [3, 1])
def test_emulated_nccl_selftest(bins, ranks):
    """dev/emu/nccl_selftest.cu: every collective in place and out of place, fp32/bf16/fp16/int32, sum/max/avg, reduce and
    broadcast from every root, a grouped send/recv ring on a second stream, ncclCommSplit (pairs keyed in reverse, an all-reduce
    and a ring inside each, NCCL_SPLIT_NOCOLOR), a nonblocking communicator, version and error
    strings, against values computed on the host (3 ranks: sums where the association matters)."""
    res = subprocess.run(["mpirun", "-np", str(ranks), str(bins / "emu_nccl_selftest")], capture_output=True, text=True, timeout=300,
                         env=env(EMU_DEVICE_COUNT=str(ranks)), cwd=REPO)
    assert res.returncode == 0 and f"nccl selftest ({ranks} ranks): PASS" in res.stdout, explain(res)


@pytest.mark.parametrize("case, message", [
    ("overlap", "ncclAllReduce: sendbuff (200 bytes at"),
    ("before_ready", "ncclAllReduce: the communicator's nonblocking initialisation has not completed"),
])
def test_emulated_nccl_stops_misuse(bins, case, message):
    res = subprocess.run(["mpirun", "-np", "2", str(bins / "emu_nccl_selftest"), f"fail:{case}"], capture_output=True, text=True,
                         timeout=300, env=env(), cwd=REPO)
    assert res.returncode != 0 and "NOT STOPPED" not in res.stdout and message in res.stderr, explain(res)
