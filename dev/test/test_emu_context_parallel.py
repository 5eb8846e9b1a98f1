"""Context parallelism of the CUDA trainer (--context-parallel N: train_gpt.cu's
ring attention over llmc/cuda/multigpu.cuh's group communicator) under the CPU
emulator (dev/emu; NOT a GPU, NOT NCCL): `mpirun -np 2` of
emu_train_gpt_mpi_*, the ring's grouped ncclSend/ncclRecv on a stream of its
own that interleaves with the compute stream (EMU_STREAM_ORDER), every
cross-stream access checked by the emulator's streamcheck.

What is compared with what, and why the bounds:
- N = 2 on 2 ranks against one process holding the whole sequences (the plain
  emulated trainer, the same -b and -t: the same tokens per step). Token-wise
  work (embedding at the global positions, LayerNorm, matmul rows, GELU,
  dropout drawn at the global element, classifier) gives each token the same
  bits on either side. What regroups: attention's softmax is merged from
  per-block log-sum-exps in fp32 (ring.acc) instead of one pass, and the sums
  over tokens (weight gradients, the loss mean) are formed per rank and added
  by NCCL. FP32: those are reassociations of fp32 sums (~1e-7 relative each),
  so the losses of 4 AdamW steps agree to 1e-5 relative, the bound of the
  data-parallel tests and of the CPU's context-parallel tests. BF16: each
  rank's weight gradients are rounded to bf16 (2^-9 relative) before the sum
  and attention's output is rounded from a differently merged fp32 value, so
  an element can move by one bf16 ulp; AdamW's m / sqrt(v) normalises the size
  of small gradients, so one rounding can move an update by up to lr: after 4
  steps at lr 1e-3, 1e-3 absolute (the data-parallel BF16 bound; the measured
  differences are in the test output). Step 1's loss is computed before any
  update: it differs by attention's regrouping alone (5e-5 relative allowed
  in BF16: a few bf16 ulps of the attention output through two layers).
- N = 3 on 3 ranks (FP32): the same bound; the ring's direction and the
  skipped blocks matter only from three members on.
- with dropout at every site (0.1): the masks a rank draws are those one
  process draws for the same tokens, so the same bounds hold.
- every -r mode under N = 2 against -r 0, with dropout: bitwise (the ring
  merges blocks in step order, never in arrival order; -r 1 reruns the
  forward ring in the backward, -r 2 and -r 3 keep attention's output); and
  segments (the ring again in a segment's forward) against -r 0.
- token tiles under the ring: FP32 the same bound (tiles only reassociate the
  weight-gradient sums, in fp32); -r 1 bitwise equal to -r 0 at the same tiles.
- a checkpoint of 2 ranks at N = 2 resumed by 2 data-parallel ranks (N = 1,
  the same sequences per step), and the other way: the losses after the
  resume within the FP32 bound against the uninterrupted run.
- mutants: each cudaStreamWaitEvent of the ring (multigpu_ring_pass and
  multigpu_ring_join in llmc/cuda/multigpu.cuh) deleted at run time
  (EMU_DELETE_SYNC) must stop the run with a stream hazard on a ring buffer
  between the ring stream's NCCL group and compute.
"""
import re
import shutil
import subprocess

import pytest

from test_emu_multigpu import MULTIGPU, TINY, assert_runs_identical, bins, data, env, explain, steps, train  # noqa: F401

FP32_REL = 1e-5   # module docstring
BF16_ABS = 1e-3
BF16_STEP1_REL = 5e-5


def ring(bins, data, precision, *flags, **extra):
    """2 ranks sharing each sequence (one group)."""
    return train(bins, data, 2, precision, "--context-parallel", "2", *flags, **extra)


def assert_within(one, two, precision):
    assert len(one) == len(two) and len(one) > 0, (one, two)
    assert [a[0] for a in one] == [b[0] for b in two]
    diffs = [abs(float(a[1]) - float(b[1])) for a, b in zip(one, two)]
    print(f"{precision}: |loss(ring) - loss(1 process)| per step: {diffs}")
    if precision == "fp32":
        assert all(d <= FP32_REL * float(a[1]) for d, a in zip(diffs, one)), (one, two)
    else:
        assert all(d <= BF16_ABS for d in diffs), (one, two)
        assert diffs[0] <= BF16_STEP1_REL * float(one[0][1]), (one, two)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_members_match_one_process(bins, data, precision):
    one = steps(train(bins, data, 0, precision, "-b", "2", "-x", "4"))
    res = ring(bins, data, precision, "-b", "2", "-x", "4")
    assert "context parallel: NCCL ring of 2 in each group" in res.stdout, explain(res)
    assert_within(one, steps(res), precision)


def test_three_members_match_one_process(bins, data):
    """N = 3 (T = 24: chunks of 4): three ring steps, blocks the causal mask empties skipped, K/V passed on twice and
    dK/dV three times round the ring (with N = 2, r + 1 and r - 1 are the same member, so a ring running the wrong way
    passes unnoticed); the gradients summed over three ranks in rank order. FP32 bound of the module docstring."""
    one = steps(train(bins, data, 0, "fp32", "-b", "2", "-t", "24", "-x", "3"))
    three = steps(train(bins, data, 3, "fp32", "-b", "2", "-t", "24", "-x", "3", "--context-parallel", "3", EMU_DEVICE_COUNT="3"))
    assert_within(one, three, "fp32")


def test_with_dropout_matches_one_process(bins, data):
    flags = ["-b", "2", "-x", "3", "--dropout", "0.1"]
    assert_within(steps(train(bins, data, 0, "fp32", *flags)), steps(ring(bins, data, "fp32", *flags)), "fp32")


def test_every_recompute_mode_bitwise_with_dropout(bins, data, tmp_path):
    """-r 1 runs the forward ring again in the backward; -r 2 and -r 3 keep
    attention's output: the step lines and model files of -r 0. Each run in
    another stream order (which changes when the ring's transfers run, not
    what is summed)."""
    runs = {}
    orders = {"0": "earliest", "1": "latest", "2": "shuffle:5", "3": "shuffle:9"}
    for r, order in orders.items():
        res = ring(bins, data, "bf16", "-b", "2", "-x", "2", "-n", "2", "--dropout", "0.1", "-r", r, "-o", tmp_path / r,
                   EMU_STREAM_ORDER=order)
        runs[r] = (res, steps(res))
    assert_runs_identical(runs, tmp_path, 2)


def test_segments_under_the_ring_bitwise(bins, data, tmp_path):
    """Segment checkpointing under the ring (three layers, --segment-layers 2:
    the backward runs segment 0's forward again, its ring included, from its
    offloaded input): the step lines and model file of -r 0, with dropout."""
    runs = {}
    for name, flags in {"r0": ["-r", "0"], "seg": ["-r", "1", "--segment-layers", "2", "--offload-checkpoints"]}.items():
        res = ring(bins, data, "bf16", "--layers", "3", "-b", "2", "-x", "1", "-n", "1", "--dropout", "0.1", *flags, "-o", tmp_path / name)
        runs[name] = (res, steps(res))
    assert "segments: 2 segments of 2 layers" in runs["seg"][0].stdout, explain(runs["seg"][0])
    assert_runs_identical(runs, tmp_path, 1)


def test_token_tiles_under_the_ring(bins, data, tmp_path):
    """Token tiles (--tile-tokens 5: tiles that divide no rank's rows, dropout drawn from a tile's first row at
    global elements) and the ring together: FP32 within the module's bound of one untiled process (tiles sum
    weight gradients in fp32 across tiles: a reassociation); BF16 -r 1 bitwise equal to -r 0 at the same tiles."""
    flags = ["-b", "2", "-x", "3", "--dropout", "0.1"]
    assert_within(steps(train(bins, data, 0, "fp32", *flags)), steps(ring(bins, data, "fp32", *flags, "--tile-tokens", "5")), "fp32")
    tiled = [steps(ring(bins, data, "bf16", "-b", "2", "-x", "2", "--dropout", "0.1", "--tile-tokens", "5", "-r", r)) for r in "01"]
    assert len(tiled[0]) == 2 and tiled[1] == tiled[0], tiled


def test_profiled_step_measures_the_ring_link(bins, data, tmp_path):
    """REMAT_PROFILE_COST_MODEL under N = 2 on the GPU trainer: after step 2 six messages of the ring's own
    (three of the K/V block's size, three of a sixteenth) are timed on the ring stream (multigpu_time_ring), the
    link fitted and written with the calibrated compute rates; the results are those of the run without it."""
    cm = tmp_path / "cm.txt"
    plain = steps(ring(bins, data, "bf16", "-b", "2", "-x", "3"))
    res = ring(bins, data, "bf16", "-b", "2", "-x", "3", REMAT_PROFILE="2", REMAT_PROFILE_COST_MODEL=str(cm))
    assert steps(res) == plain
    m = re.search(r"ring (\S+) B/s and (\S+) s a message from (\d+) timed messages\)$", res.stdout, re.M)
    assert m and m.group(3) == "6", explain(res)
    rates = dict(line.split(" = ") for line in cm.read_text().splitlines() if " = " in line)
    assert float(rates["ring_link_bytes_per_s"]) == pytest.approx(float(m.group(1)), rel=5e-3) and float(m.group(1)) > 0  # printed to 3 digits
    assert float(rates["ring_link_latency_s"]) == pytest.approx(float(m.group(2)), rel=5e-3) and float(m.group(2)) > 0


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_resume_under_another_degree(bins, data, tmp_path, first, second):
    """2 ranks at N = 2 (-b 2: one group) against 2 data-parallel ranks at N = 1 (-b 1: two groups): the same two
    sequences per step. A checkpoint at step 2 of one resumed by the other (a resume keeps the processes)."""
    def run(n, out, *flags):
        batch = ["-b", "2", "--context-parallel", "2"] if n == 2 else ["-b", "1"]
        return train(bins, data, 2, "fp32", *batch, "-x", "4", "-n", "2", "-o", out, *flags)
    full, part = tmp_path / "full", tmp_path / "part"
    ref = steps(run(first, full))
    part.mkdir()
    copied = [f for f in full.iterdir() if "00000002" in f.name]
    assert len(copied) >= 4, sorted(f.name for f in full.iterdir())  # model, a state file per rank, DONE
    for f in copied:
        shutil.copy(f, part / f.name)
    resumed = run(second, part, "-y", "1")
    assert "resumed: step 2" in resumed.stdout, explain(resumed)
    assert_within(ref[2:], steps(resumed), "fp32")


def ring_wait_lines():
    """The cudaStreamWaitEvent lines inside multigpu_ring_pass (the transfer waits for compute) and multigpu_ring_join
    (compute waits for the transfers)."""
    lines, inside = [], None
    for i, ln in enumerate(MULTIGPU.read_text().splitlines(), 1):
        m = re.match(r"static inline \w+ (\w+)\(", ln)
        if m:
            inside = m.group(1)
        if inside in ("multigpu_ring_pass", "multigpu_ring_join") and re.search(r"\bcudaStreamWaitEvent\(", ln):
            lines.append(i)
    assert len(lines) == 2, "llmc/cuda/multigpu.cuh: expected one stream wait in the ring's pass and one in its join"
    return lines


@pytest.mark.parametrize("line", ring_wait_lines())
def test_deleting_a_ring_stream_wait_is_a_stream_hazard(bins, data, line):
    res = ring(bins, data, "bf16", "-b", "2", "-x", "1", EMU_DELETE_SYNC=f"llmc/cuda/multigpu.cuh:{line}")
    assert res.returncode != 0, explain(res)
    m = re.search(r"emu: stream hazard: (.+?) on (.+?) (reads|writes) byte \d+ of buffer '([\w.]+)' .*?, which (.+?) on (.+?) "
                  r"(wrote|read) before, and no event wait, stream wait or host synchronisation orders the two", res.stderr)
    assert m, explain(res)
    ops, streams = {m.group(1), m.group(5)}, {m.group(2), m.group(6)}
    assert "the legacy default stream" in streams and any("cudaStreamNonBlocking" in s for s in streams), m.group(0)
    assert any("ncclSend" in o for o in ops), m.group(0)
    assert m.group(4) in ("ring.kv_blocks", "ring.dkv_blocks"), m.group(0)


def test_the_unmutated_ring_has_no_hazard_when_the_ring_stream_lags(bins, data):
    """The control of the mutants: the same run, the ring stream as far behind as its waits allow. 9 steps of 8
    transfers each: the 64 event pairs of multigpu_ring_pass run out once, and the host waits for the ring stream."""
    res = ring(bins, data, "bf16", "-b", "2", "-x", "9", EMU_STREAM_ORDER="latest")
    assert len(steps(res)) == 9 and "stream hazard" not in res.stderr, explain(res)


def test_collective_timeout_names_the_rank_lost_inside_the_ring(bins, data):
    """Rank 1 stops itself as step 3 begins: rank 0's GPU waits on the ring of
    step 3's first layer; its host, waiting for the loss, names rank 1 after
    --collective-timeout (the gradient reduction after the backward:
    REMAT_NCCL_OVERLAP=0, so that no per-layer arrival exchange comes first)."""
    import os
    import signal
    import threading
    args = ["mpirun", "-np", "2", str(bins / "emu_train_gpt_mpi_bf16"), *TINY, "-i", str(data / "train.bin"), "-j", "", "-b", "2",
            "-t", "32", "-s", "0", "-x", "1000", "--context-parallel", "2", "--collective-timeout", "2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(REMAT_TEST_STALL="1:3", REMAT_NCCL_OVERLAP="0"), start_new_session=True)
    guard = threading.Timer(240, lambda: os.killpg(proc.pid, signal.SIGKILL))
    guard.start()
    try:
        out, err = proc.communicate()
    finally:
        guard.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the stopped rank, if mpirun left it
        except ProcessLookupError:
            pass
    assert proc.returncode != 0, out[-2000:] + err[-3000:]
    assert re.search(r"^error: rank 0: waited more than 2 s in the ring attention forward \(step 3\) for rank 1, the other member "
                     r"of this rank's context-parallel ring: it is stuck, stopped or gone; communicators aborted, stopping the job "
                     r"\(--collective-timeout\)$", err, re.M), err[-3000:]
    assert "step    2/" in out and "step    3/" not in out, out[-2000:]


def test_plan_names_the_gpu_ring_buffers(bins):
    """--plan-json of the GPU build at N = 2: the ring's K/V blocks in floatX, dK/dV in fp32, and ring.acc (fp32, this
    rank's tokens x C); none of them at N = 1."""
    import json

    def plan(*flags):
        res = subprocess.run([str(bins / "emu_train_gpt_bf16"), *TINY, "-b", "2", "-t", "32", "--plan-json", "--plan-processes", "2",
                              *flags], capture_output=True, text=True, timeout=120, env=env())
        assert res.returncode == 0, explain(res)
        return {b["name"]: b["bytes"] for b in json.loads(res.stdout)["buffers"]}
    two, one = plan("--context-parallel", "2"), plan()
    tokens, C = 2 * 32 // 2, 32
    assert two["ring.kv_blocks"] == 2 * tokens * 2 * C * 2 and two["ring.dkv_blocks"] == 2 * tokens * 2 * C * 4
    assert two["ring.acc"] == tokens * C * 4
    assert not any(name.startswith("ring.") for name in one)


def test_eval_by_position_and_sampling_match_one_process(bins, data):
    """Validation by global position (the group's sums) and sampling (group 0 runs the padded context through the ring;
    the member holding the last position broadcasts the probabilities): one process's buckets within the FP32 bound and
    its sampled tokens."""
    import numpy as np
    flags = ["-b", "2", "-x", "2", "-j", data / "train.bin", "-v", "2", "-s", "2", "-g", "6", "--eval-by-position", "8"]
    one = train(bins, data, 0, "fp32", *flags)
    two = ring(bins, data, "fp32", *flags)
    for res in (one, two):
        assert res.returncode == 0, explain(res)
    by_pos = lambda s: re.findall(r"val loss by position at step (\d+): (.*)", s)
    a, b = by_pos(one.stdout), by_pos(two.stdout)
    assert len(a) == 2 and [x[0] for x in a] == [x[0] for x in b], (a, b)  # steps 0 and 2
    for (_, la), (_, lb) in zip(a, b):
        ka, kb = re.findall(r"(\S+-\S+) ([0-9.]+)", la), re.findall(r"(\S+-\S+) ([0-9.]+)", lb)
        assert [k for k, _ in ka] == [k for k, _ in kb] == ["0-8", "8-16", "16-32"], (la, lb)
        assert np.allclose([float(v) for _, v in kb], [float(v) for _, v in ka], rtol=FP32_REL, atol=0), (la, lb)
    sample = lambda s: re.findall(r"sample at step \d+:\n---\n(.*?)\n---", s, re.S)
    assert len(sample(one.stdout)) == 1 and sample(two.stdout) == sample(one.stdout), (sample(one.stdout), sample(two.stdout))
