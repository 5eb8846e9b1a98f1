"""Context parallelism (--context-parallel N) of the CPU reference under
OpenMPI: N processes share each sequence (2N chunks, ring attention) and
train like one process holding whole sequences.

Why the losses agree only within fp32 rounding, and the bound: every
token-wise operation (embedding, LayerNorm, matmul rows, GELU, residual,
dropout, classifier) computes the same bits for a token wherever it runs,
because each output element is summed in an order fixed by the code. What
differs is grouping: attention's softmax over a row's keys is merged from
per-block log-sum-exps instead of one running pass (a few ulps per output),
and the sums over tokens (weight gradients, the loss mean) are formed per rank
and then added across ranks. Both are reassociations of fp32 sums, relative
error ~1e-7 each; ten AdamW steps at lr 2e-3 carry them into the parameters
but do not amplify them (observed: at most 2e-7 relative on losses near 5.5).
The bound, 1e-5 relative, is the data-parallel tests' (test_multiprocess.py:
two ranks against one with twice the batch, the same kind of regrouping)
and 50x what is observed; a chunk of tokens at the wrong position, a skipped
or doubled attention tile, a mask drawn at a local index, a missing dK/dV
contribution or a wrong loss scale moves step 1 or the later steps by 1e-4 or
more (the mutants in the commit message).

Within one N everything is bitwise: the ring merges blocks in step order,
never in arrival order, so a run repeats itself and every -r mode (which
reruns attention, or keeps it) gives the -r 0 run's model file."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, binary, run

if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)", allow_module_level=True)

# the launch, model and output parsing of the data-parallel tests, shared
from test_multiprocess import MODEL, MPI_ENV, STEP_RE, losses, train, val_losses  # noqa: E402,F401

REL = 1e-5  # the bound of the module docstring


def assert_close(a, b, rel=REL):
    assert len(a) == len(b) and len(a) > 0
    for (sa, la), (sb, lb) in zip(a, b):
        assert sa == sb and abs(la - lb) <= rel * abs(lb), (a, b)


def without_run_id(data):
    return data[:4 * 240] + data[4 * 242:]  # model header slots 240-241: each run's own id


_references = {}


def reference(data, np_, b, dropout):
    """The run without context parallelism: one process holding the whole
    batch (dropout masks are keyed by the global sequence, not the rank)."""
    key = (np_, b, dropout)
    if key not in _references:
        _references[key] = train(np_, data, "-b", str(b), "-x", "10", "-v", "5", "--dropout", dropout).stdout
    return _references[key]


# (processes, N, -b per group, reference processes, reference -b without dropout, with dropout)
LAYOUTS = {"N=2": (2, 2, 2, (1, 2), (1, 2)), "N=4": (4, 4, 2, (1, 2), (1, 2)), "2x2": (4, 2, 1, (1, 2), (1, 2))}


@pytest.mark.parametrize("dropout", ["0", "0.2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_equal_one_process(synthetic, layout, dropout):
    """10 steps' training and validation losses against the run that holds
    whole sequences, with and without dropout at every site (the masks a rank
    draws are the ones one process draws for those tokens)."""
    np_, n, b, ref_plain, ref_drop = LAYOUTS[layout]
    ref_np, ref_b = ref_drop if dropout != "0" else ref_plain
    ref = reference(synthetic, ref_np, ref_b, dropout)
    res = train(np_, synthetic, "-b", str(b), "--context-parallel", str(n), "-x", "10", "-v", "5", "--dropout", dropout)
    assert f"share each sequence" in res.stdout and f"{np_ // n} group" in res.stdout
    assert len(losses(res.stdout)) == 10
    assert_close(losses(res.stdout), losses(ref))
    assert len(val_losses(ref)) == 3
    assert np.allclose(val_losses(res.stdout), val_losses(ref), rtol=REL, atol=0)


def test_run_to_run_and_every_recompute_mode_bitwise(synthetic, tmp_path):
    """With dropout, N = 2: a second run repeats the first bit for bit, and
    -r 1 (the ring again in backward), -r 2 and -r 3 (attention kept, no
    second ring) write the -r 0 run's model file byte for byte."""
    model = "model_00000006.bin"
    common = ["-b", "2", "--context-parallel", "2", "-x", "6", "-v", "0", "--dropout", "0.2"]
    files, steps = {}, {}
    for tag, r in [("r0", "0"), ("again", "0"), ("r1", "1"), ("r2", "2"), ("r3", "3")]:
        res = train(2, synthetic, *common, "-r", r, "-o", tmp_path / tag)
        steps[tag] = STEP_RE.findall(res.stdout)
        files[tag] = without_run_id((tmp_path / tag / model).read_bytes())
    assert len(steps["r0"]) == 6
    for tag in ["again", "r1", "r2", "r3"]:
        assert steps[tag] == steps["r0"], tag
        assert files[tag] == files["r0"], tag


def test_recompute_full_bitwise_with_four(synthetic, tmp_path):
    """N = 4 (three ring steps, blocks skipped and diagonal), ZeRO-1 sharded
    over the four: -r 1 reruns the ring in backward and gets -r 0's model file."""
    common = ["-b", "1", "--context-parallel", "4", "-x", "3", "-v", "0", "--dropout", "0.1", "-z", "1"]
    for r in ["0", "1"]:
        train(4, synthetic, *common, "-r", r, "-o", tmp_path / r)
    name = "model_00000003.bin"
    assert without_run_id((tmp_path / "1" / name).read_bytes()) == without_run_id((tmp_path / "0" / name).read_bytes())


@pytest.mark.parametrize("first,second", [(("2", "2"), ("1", "1")), (("1", "1"), ("2", "2"))])
def test_resume_under_another_degree(synthetic, tmp_path, first, second):
    """A checkpoint of 2 processes at N = 2 (-b 2: one group, 2 sequences)
    resumes at N = 1 (-b 1: two groups, the same 2 sequences per micro-step)
    and the other way: the same data, the same losses within the bound."""
    (n1, b1), (n2, b2) = first, second
    full, part = tmp_path / "full", tmp_path / "part"
    ref = train(2, synthetic, "-b", b1, "--context-parallel", n1, "-x", "8", "-n", "4", "-v", "0", "--shuffle", "1", "-o", full)
    part.mkdir()
    for name in ["model_00000004.bin", "state_00000004_00000.bin", "state_00000004_00001.bin", "DONE_00000004"]:
        shutil.copy(full / name, part / name)
    resumed = train(2, synthetic, "-b", b2, "--context-parallel", n2, "-x", "8", "-n", "4", "-v", "0", "--shuffle", "1",
                    "-o", part, "-y", "1")
    assert "resumed: step 4" in resumed.stdout
    assert_close(losses(resumed.stdout), losses(ref.stdout)[4:])


def test_resume_with_other_sequences_per_step_is_refused(synthetic, tmp_path):
    train(2, synthetic, "-b", "2", "--context-parallel", "2", "-x", "2", "-v", "0", "-o", tmp_path)
    res = train(2, synthetic, "-b", "2", "-x", "4", "-v", "0", "-o", tmp_path, "-y", "1", "--resume-override", check=False)
    assert res.returncode != 0
    assert "2 sequences per micro-step (-b 2, --context-parallel 2); resume needs the same T" in res.stderr


def test_eval_by_position_and_sampling_under_two(synthetic):
    """--eval-by-position buckets by global position, and sampling (the group
    runs the padded context through the ring) gives one process's text."""
    flags = ["-b", "2", "-x", "2", "-v", "2", "-s", "2", "-g", "12", "--eval-by-position", "8"]
    one = train(1, synthetic, *flags).stdout
    two = train(2, synthetic, *flags, "--context-parallel", "2").stdout
    by_pos = lambda s: re.findall(r"val loss by position at step (\d+): (.*)", s)
    a, b = by_pos(one), by_pos(two)
    assert len(a) == 2 and [x[0] for x in a] == [x[0] for x in b]
    for (_, la), (_, lb) in zip(a, b):
        ka, kb = re.findall(r"(\S+-\S+) ([0-9.]+)", la), re.findall(r"(\S+-\S+) ([0-9.]+)", lb)
        assert [k for k, _ in ka] == [k for k, _ in kb] == ["0-8", "8-16", "16-32"]
        assert np.allclose([float(v) for _, v in kb], [float(v) for _, v in ka], rtol=REL, atol=0)
    sample = lambda s: re.findall(r"sample at step \d+:\n---\n(.*?)\n---", s, re.S)
    assert len(sample(one)) == 1 and len(sample(one)[0]) > 20 and sample(two) == sample(one)


@pytest.mark.parametrize("flags,message", [
    (["-np", "2", "--context-parallel", "4"], "flag --context-parallel: 4 does not divide the 2 processes"),
    (["-np", "2", "--context-parallel", "2", "-t", "30"], "flag -t: 30 is not a multiple of 2N = 4 (--context-parallel 2 cuts "
                                                          "each sequence into 4 equal chunks): -t 28 or 32 work"),
])
def test_bad_launch_one_line(synthetic, flags, message):
    out, meta = synthetic
    np_ = flags[1]
    res = run(["mpirun", "-np", np_, str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]),
               "-i", out / "synthetic_train.bin", "-j", "", "-b", "1", "-t", "32", "-x", "1", "-s", "0", *flags[2:]],
              env=MPI_ENV, timeout=120)
    assert res.returncode != 0
    assert message in res.stderr


def test_ranks_disagreeing_on_degree_are_refused(synthetic):
    """Started with different --context-parallel (an MPMD launch), the ranks
    stop before the first step, naming the flag."""
    out, meta = synthetic
    base = [str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]), "-i", str(out / "synthetic_train.bin"),
            "-j", "", "-b", "1", "-t", "32", "-x", "1", "-s", "0"]
    res = run(["mpirun", "-np", "1", *base, "--context-parallel", "2", ":", "-np", "1", *base, "--context-parallel", "1"],
              env=MPI_ENV, timeout=120)
    assert res.returncode != 0
    assert "flag --context-parallel differs between the processes of this run" in res.stderr
    assert not STEP_RE.search(res.stdout)


def plan_json(*flags):
    res = run([binary("train_gpt_cpu"), "-e", "d12", "--max-seq-len", "8192", "-b", "1", "-t", "8192", "--plan-json", *flags], check=True)
    return json.loads(res.stdout)


def test_plan_divides_activations_and_names_ring_buffers():
    one = plan_json("--plan-processes", "8")
    eight = plan_json("--plan-processes", "8", "--context-parallel", "8")
    assert eight["components"]["activations"] * 8 == pytest.approx(one["components"]["activations"], rel=1e-3)
    buffers = {b["name"]: b["bytes"] for b in eight["buffers"]}
    kv = 1 * (8192 // 8) * 2 * 768 * 4  # B x T/N tokens x 2C x fp32
    assert buffers["ring.kv_blocks"] == 2 * kv and buffers["ring.dkv_blocks"] == 2 * kv
    assert "ring.kv_blocks" not in {b["name"] for b in one["buffers"]}
    assert eight["context_parallel"] == 8 and eight["predicted_ring_seconds"] > 0
    # the parameters, gradients and optimizer state do not shrink with N
    for k in ["parameters", "gradients", "optimizer"]:
        assert eight["components"][k] == one["components"][k]


def test_profiled_step_measures_the_ring_link(synthetic, tmp_path):
    """REMAT_PROFILE_COST_MODEL under N = 2: after step 2 the ring's link is
    timed on its own buffers (six messages), fitted, and written; --cost-model
    reads it back as the ring's link unless --ring-link names one."""
    out, meta = synthetic
    cm = tmp_path / "cm.txt"
    res = run(["mpirun", "-np", "2", str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]), "-i",
               out / "synthetic_train.bin", "-j", "", "-t", "32", "-b", "2", "-s", "0", "-x", "3", "--context-parallel", "2"],
              env={**MPI_ENV, "REMAT_PROFILE": "2", "REMAT_PROFILE_COST_MODEL": str(cm)}, check=True, timeout=300)
    line = re.search(r"^cost model: step 2 \(\S+ ms\) calibrated, written to \S+: .*; 1 link measured: .* \(0 copies\), ring \S+ B/s and \S+ s a message "
                     r"\(6 waits\); matmuls at half rate at \S+ rows$", res.stdout, re.M)
    assert line, res.stdout
    rates = {k.strip(): float(v) for k, v in (l.split("=", 1) for l in cm.read_text().splitlines() if "_per_s" in l or "_s =" in l)}
    assert rates["ring_link_bytes_per_s"] > 0 and rates["ring_link_latency_s"] > 0
    d = plan_json("--plan-processes", "2", "--context-parallel", "2", "--cost-model", str(cm))
    assert (d["ring_link"], d["ring_link_bytes_per_s"], d["ring_link_latency_s"]) == \
        ("measured", rates["ring_link_bytes_per_s"], rates["ring_link_latency_s"])
    assert plan_json("--plan-processes", "2", "--context-parallel", "2", "--cost-model", str(cm), "--ring-link", "nvlink")["ring_link"] == "nvlink"


def test_plan_time_model_prices_the_ring_in_recompute():
    """-r 1 pays the forward ring again; -r 3 does not: on a slow link their
    predicted gap grows by exactly the forward ring's time per layer (the
    per-layer recompute time -r auto weighs is the same function)."""
    fast = plan_json("--plan-processes", "4", "--context-parallel", "4", "--ring-link", "nvlink")
    slow = plan_json("--plan-processes", "4", "--context-parallel", "4", "--ring-link", "mpi")
    modes = lambda p: {m["recompute"]: m["predicted_step_seconds"] for m in p["modes"]}
    gap = lambda p: modes(p)["1"] - modes(p)["3"]
    assert slow["predicted_ring_seconds"] > fast["predicted_ring_seconds"]
    assert gap(slow) - gap(fast) == pytest.approx(12 * (slow["ring_forward_seconds_per_layer"] - fast["ring_forward_seconds_per_layer"]), rel=1e-6)


def test_peak_rss_per_rank_against_the_plan(synthetic, tmp_path):
    """Each rank's peak resident memory (measured by a wrapper around it)
    stays within its plan plus the process's fixed cost, and halving the
    tokens per rank (N = 2) saves what the plan says it saves."""
    out, meta = synthetic
    wrapper = tmp_path / "rss.py"  # a file per rank: mpirun may interleave the ranks' stderr
    wrapper.write_text("import os, resource, subprocess, sys\nr = subprocess.run(sys.argv[2:])\n"
                       "open(os.path.join(sys.argv[1], 'rss_' + os.environ['OMPI_COMM_WORLD_RANK']), 'w')"
                       ".write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\nsys.exit(r.returncode)\n")
    shape = ["-e", "d6", "--layers", "4", "--channels", "64", "--heads", "4", "--max-seq-len", "1024", "--vocab-size",
             str(meta["vocab_size"]), "-i", str(out / "synthetic_train.bin"), "-j", "", "-b", "8", "-t", "1024", "-x", "1", "-s", "0"]

    def measure(np_, n):
        rss_dir = tmp_path / f"rss{np_}"
        rss_dir.mkdir()
        res = run(["mpirun", "-np", str(np_), sys.executable, wrapper, rss_dir, str(binary("train_gpt_cpu")), *shape,
                   "--context-parallel", str(n)], env=MPI_ENV, check=True, timeout=600)
        plan = float(re.search(r"total +([0-9.]+) MiB", res.stdout).group(1))
        return [int((rss_dir / f"rss_{r}").read_text()) / 1024 for r in range(np_)], plan

    rss1, plan1 = measure(1, 1)
    rss2, plan2 = measure(2, 2)
    assert len(rss1) == 1 and len(rss2) == 2
    assert plan2 < 0.6 * plan1
    fixed = 120.0  # MiB: the binary, OpenMP and Open MPI's shared-memory segments
    assert rss1[0] <= plan1 + fixed, (rss1, plan1)
    for r in rss2:
        assert r <= plan2 + fixed, (rss2, plan2)
        assert rss1[0] - r >= 0.8 * (plan1 - plan2), (rss1, plan1, rss2, plan2)


def test_gradcheck_through_the_ring():
    """The fp64 build with 2 processes: finite differences of the loss the
    ring computes, and the gradients against one process on whole sequences."""
    exe = binary("build/test_ring_gradcheck")
    if not exe.exists():
        pytest.skip("build/test_ring_gradcheck not built (make test-bins with mpicc)")
    res = run(["mpirun", "-np", "2", exe], env=MPI_ENV, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "PASS: ring gradient check" in res.stdout


def test_finetune_long_script_takes_the_degree(synthetic, tmp_path):
    """scripts/finetune_long.sh with CONTEXT_PARALLEL=2: plans for the two
    processes, then starts them with mpirun sharing each sequence."""
    out, meta = synthetic
    train(1, synthetic, "-b", "1", "-x", "1", "-v", "0", "-o", tmp_path / "a")
    env = {**os.environ, **MPI_ENV, "TRAINER": str(binary("train_gpt_cpu")), "TRAIN": str(out / "synthetic_train.bin"), "VAL": "",
           "MEM_BUDGET": "64MiB", "CONTEXT_PARALLEL": "2", "TOKENS_PER_STEP": "128"}
    res = subprocess.run([str(REPO / "scripts" / "finetune_long.sh"), "a/model_00000001.bin", "64", "-x", "2"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "per process, 2 processes, ZeRO-0; context parallel 2: 32 tokens of each row per process" in res.stdout
    assert "context parallel: 1 group of 2 processes share each sequence" in res.stdout
    assert "gradient accumulation 2 (128 tokens per step)" in res.stdout
    assert [s for s, _ in losses(res.stdout)] == [1, 2]


def test_collective_timeout_names_the_rank_lost_inside_the_ring(synthetic):
    """Rank 1 stops itself as step 3 begins (REMAT_TEST_STALL): rank 0 waits
    in the ring of step 3's first layer and, after --collective-timeout,
    names rank 1 and stops the job."""
    import time
    out, meta = synthetic
    t0 = time.time()
    res = run(["mpirun", "-np", "2", str(binary("train_gpt_cpu")), *MODEL, "--vocab-size", str(meta["vocab_size"]), "-i",
               out / "synthetic_train.bin", "-j", "", "-b", "2", "-t", "32", "-s", "0", "-x", "100", "--context-parallel", "2",
               "--collective-timeout", "2"], env={**MPI_ENV, "REMAT_TEST_STALL": "1:3"}, timeout=120)
    assert res.returncode != 0 and time.time() - t0 < 60, res.stderr
    assert re.search(r"^error: rank 0: waited more than 2 s in the ring attention forward \(step 3\) for rank 1, the other member "
                     r"of this rank's context-parallel ring: it is stuck, stopped or gone; stopping the job "
                     r"\(--collective-timeout\)$", res.stderr, re.M), res.stderr
