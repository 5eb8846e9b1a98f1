"""Segment checkpointing (--segment-layers K, llmc/plan/plan.h) through the CPU
trainer: every K on a 6-layer model, in recompute mixes, with offloaded
segment inputs, token tiles, dropout, micro-steps, resume and two-process
context parallelism, writes model files, state files and losses byte-equal
to -r 0's; the plan's bytes against a count written out here; the saving in
peak resident memory, not only in the plan; bad input."""
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO, binary, run, one_error
from test_offload import files, losses

L = 6
MODEL = ["-e", "d6", "--layers", str(L), "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]


def train(tiny_shards, out, *extra, prefix=(), exe="train_gpt_cpu", steps="4"):
    return run([*prefix, binary(exe), *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", tiny_shards / "tiny_val.bin",
                "-b", "2", "-t", "32", "-v", "2", "-m", "2", "-s", "0", "-l", "1e-3", "-x", steps, "-n", "2", "-o", out, *extra],
               check=True)


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory):
    """-r 0 without segments, once per flag set the tests below add to it."""
    cache = {}

    def get(*extra):
        if extra not in cache:
            out = tmp_path_factory.mktemp("r0")
            train(tiny_shards, out, *extra)
            cache[extra] = (files(out), losses(out))
        return cache[extra]
    return get


def check_equal(tiny_shards, tmp_path, reference, flags, extra=(), name="seg"):
    out = tmp_path / name
    res = train(tiny_shards, out, *flags, *extra)
    ref_files, ref_losses = reference(*extra)
    assert any(n.startswith("model_") for n in ref_files) and any(n.startswith("state_") for n in ref_files)
    assert losses(out) == ref_losses and len(ref_losses) >= 4
    assert files(out) == ref_files
    return res


@pytest.mark.parametrize("K", range(1, L + 1))
@pytest.mark.parametrize("r", ["0", "1", "2", "3"])
def test_every_k_every_mode_equals_r0(tiny_shards, tmp_path, reference, K, r):
    res = check_equal(tiny_shards, tmp_path, reference, ["-r", r, "--segment-layers", str(K)])
    S = -(-L // K)
    if K > 1:
        assert f"segments: {S} segments of {K} layers (--segment-layers {K}; the last of {L - (S - 1) * K})" in res.stdout, res.stdout
    else:
        assert "segments:" not in res.stdout


MIXES = ["1:0,2/3:1,4/2:3", "3:0-2/1:3-4", "2:1,5/1:2-3", "1o:0/1:2,4/3:1/2:3"]


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("mix", MIXES)
def test_mixes_equal_r0(tiny_shards, tmp_path, reference, K, mix):
    check_equal(tiny_shards, tmp_path, reference, ["-r", mix, "--segment-layers", str(K)])


@pytest.mark.parametrize("K,r", [(2, "1"), (3, "0"), (4, "3"), (6, "2"), (5, "1")])
def test_offloaded_segment_inputs_equal_r0(tiny_shards, tmp_path, reference, K, r):
    res = check_equal(tiny_shards, tmp_path, reference, ["-r", r, "--segment-layers", str(K), "--offload-checkpoints"])
    S = -(-L // K)
    m = re.search(r"host memory, offloaded checkpoints: ([0-9.]+) MiB \(a second allocation\), device staging ring (\d) slots", res.stdout)
    assert m and int(m.group(2)) == min(3, S), res.stdout
    assert float(m.group(1)) == pytest.approx(S * 2 * 32 * 32 * 4 / 2**20, abs=0.06)


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("extra", [
    ("--tile-tokens", "20"),
    ("--dropout", "0.2", "-d", "128"),
    ("--dropout", "0.1", "--tile-tokens", "24", "-d", "128"),
], ids=["tiles", "dropout+2micro", "dropout+tiles+2micro"])
@pytest.mark.parametrize("r", ["1", "0", "3:0-2/2:3-5"])
def test_tiles_dropout_micro_steps_equal_r0(tiny_shards, tmp_path, reference, K, extra, r):
    check_equal(tiny_shards, tmp_path, reference, ["-r", r, "--segment-layers", str(K)], extra)


def test_resume_with_other_segments_equals_one_run(tiny_shards, tmp_path, reference):
    """A run with K = 2 whose step-4 checkpoint is deleted, resumed from step
    2 with K = 3 and -r 1: K is no hyperparameter of the state (the result
    does not depend on it)."""
    out = tmp_path / "resumed"
    train(tiny_shards, out, "-r", "0", "--segment-layers", "2", "--dropout", "0.1")
    for p in out.iterdir():
        if "00000004" in p.name:
            p.unlink()
    log = out / "log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines() if json.loads(line).get("step", 0) <= 2))
    res = train(tiny_shards, out, "-r", "1", "--segment-layers", "3", "--dropout", "0.1", "-y", "1")
    assert "resum" in res.stdout.lower()
    ref_files, ref_losses = reference("--dropout", "0.1")
    assert losses(out) == ref_losses
    assert files(out) == ref_files


def test_context_parallel_two_processes_equal_r0(tiny_shards, tmp_path):
    mpirun = shutil.which("mpirun")
    if not mpirun:
        pytest.skip("mpirun not installed")
    prefix = [mpirun, "--oversubscribe", "-np", "2"]
    if subprocess.run([mpirun, "--allow-run-as-root", "--version"], capture_output=True).returncode == 0:
        prefix.insert(1, "--allow-run-as-root")
    outs = {}
    for name, flags in (("r0", ["-r", "0"]), ("seg", ["-r", "1", "--segment-layers", "3", "--dropout", "0.1"]),
                        ("r0drop", ["-r", "0", "--dropout", "0.1"]), ("segmix", ["-r", "3:0-2/1:3-5", "--segment-layers", "2"])):
        outs[name] = tmp_path / name
        res = train(tiny_shards, outs[name], "--context-parallel", "2", *flags, prefix=prefix)
        assert "context parallel: 1 group of 2 processes" in res.stdout, res.stdout
    assert files(outs["seg"]) == files(outs["r0drop"]) and losses(outs["seg"]) == losses(outs["r0drop"])
    assert files(outs["segmix"]) == files(outs["r0"]) and losses(outs["segmix"]) == losses(outs["r0"])


# ---- the plan ----

def a256(n):
    return -(-n // 256) * 256


def plan_json(*args):
    res = run([binary("train_gpt_cpu"), *MODEL, *map(str, args), "--plan-json"])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


KEEPS = {0: ["x", "ln1", "ln1_mean", "ln1_rstd", "qkv", "atty", "att_lse", "res2", "ln2", "ln2_mean", "ln2_rstd", "fch", "fch_gelu"],
         1: ["x"], 2: ["x", "ln1_mean", "ln1_rstd", "qkv", "atty", "att_lse", "res2", "ln2_mean", "ln2_rstd", "fch"],
         3: ["x", "atty", "att_lse"]}


def width(name, C=32, NH=4):
    return {"qkv": 3 * C, "fch": 4 * C, "fch_gelu": 4 * C, "att_lse": NH}.get(name, 1 if name.endswith(("_mean", "_rstd")) else C)


@pytest.mark.parametrize("K,modes", [(2, [1] * 6), (3, [0] * 6), (4, [3, 1, 2, 1, 0, 3]), (6, [2] * 6), (5, [1, 3, 1, 1, 1, 0])])
def test_plan_keeps_segment_inputs_and_k_slots(K, modes):
    """Counted here: one x per segment, and in slot i every tensor one of
    layers i, i+K, ... keeps (slot 0 without x); the per-layer plan's
    layer entries disappear, the rest of the plan is as without segments."""
    flag = "/".join(f"{m}:{l}" for l, m in enumerate(modes) if m) or "0"
    B, T, N = 2, 32, 64
    seg = plan_json("-b", B, "-t", T, "-r", flag, "--segment-layers", K)
    per_layer = plan_json("-b", B, "-t", T, "-r", flag)
    layer_bytes = sum(a256(N * width(a) * 4) for m in modes for a in KEEPS[m])
    expect = [a256(N * 32 * 4)] * (-(-L // K))
    for i in range(K):
        kept = set(a for m in modes[i::K] for a in KEEPS[m]) - ({"x"} if i == 0 else set())
        expect += [a256(N * width(a) * 4) for a in kept]
    assert seg["total_bytes"] == per_layer["total_bytes"] - layer_bytes + sum(expect)
    names = [b["name"] for b in seg["buffers"]]
    assert not any(n.startswith("layer") for n in names)
    assert sum(n.startswith("segment") and not n.startswith("segment_slot") for n in names) == -(-L // K)


def test_sqrt_l_keeps_fewer_inputs_than_per_layer():
    """-r 1 on 16 layers: 16 kept inputs; K = 4: 4 segment inputs + 3 slots of x."""
    big = ["--layers", "16"]
    one = run([binary("train_gpt_cpu"), *MODEL, *big, "-b", "1", "-t", "32", "-r", "1", "--plan-json"], check=True)
    four = run([binary("train_gpt_cpu"), *MODEL, *big, "-b", "1", "-t", "32", "-r", "1", "--segment-layers", "4", "--plan-json"], check=True)
    d1, d4 = json.loads(one.stdout), json.loads(four.stdout)
    assert d1["activations_by_tensor"]["x"] == 16 * a256(32 * 32 * 4)
    assert d4["activations_by_tensor"]["x"] == 7 * a256(32 * 32 * 4)
    assert d1["total_bytes"] - d4["total_bytes"] == 9 * a256(32 * 32 * 4)


# ---- resident memory ----

RSS_MODEL = ["-e", "d6", "--layers", "16", "--channels", "64", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "8192"]


def test_peak_rss_follows_the_plan(tiny_shards, tmp_path):
    """A 16-layer model with -r 0 at T = 1024: K = 4 keeps 4 inputs and 4
    layers' tensors instead of 16 layers'; the drop in peak resident memory
    (measured with /usr/bin/time's maximum resident set) is the plan's drop,
    and it is below -r 1's per-layer inputs plus K = 4's slots."""
    time_bin = "/usr/bin/time"
    if not os.path.exists(time_bin):
        pytest.skip("/usr/bin/time not installed")
    results = {}
    for name, flags in (("r0", ["-r", "0"]), ("seg4", ["-r", "0", "--segment-layers", "4"]), ("r1", ["-r", "1"]),
                        ("r1seg4", ["-r", "1", "--segment-layers", "4"])):
        base = [binary("train_gpt_cpu"), *RSS_MODEL, "-b", "1", "-t", "1024"]
        plan = json.loads(run([*base, *flags, "--plan-json"], check=True).stdout)
        res = run([time_bin, "-f", "maxrss %M", *base, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-s", "0", "-x", "1", *flags],
                  check=True)
        rss = int(re.search(r"maxrss (\d+)", res.stderr).group(1)) * 1024
        results[name] = (plan["total_bytes"], rss)
    for name, (planned, rss) in results.items():  # the plan's arena is touched whole, the program adds a few MiB
        assert planned <= rss <= planned + (24 << 20), (name, planned, rss)
    saving_plan = results["r0"][0] - results["seg4"][0]
    saving_rss = results["r0"][1] - results["seg4"][1]
    assert saving_plan > 40 << 20, results  # 12 layers' tensors of 1024 tokens, less 4 inputs
    assert abs(saving_rss - saving_plan) < 8 << 20, results
    x = a256(1024 * 64 * 4)  # one kept input
    assert results["r1"][0] - results["r1seg4"][0] == 9 * x  # 16 inputs against 4 + 3 slots
    # within four inputs (1 MiB): malloc's and the kernel's page accounting moved it by 1.5 inputs on a loaded machine
    assert abs((results["r1"][1] - results["r1seg4"][1]) - 9 * x) < 4 * x, results


# ---- bad input ----

def test_offload_mark_on_a_layer_that_starts_no_segment_is_refused():
    res = run([binary("train_gpt_cpu"), *MODEL, "-b", "1", "-t", "32", "-r", "1o:0,2/3:1", "--segment-layers", "3", "--plan"])
    one_error(res)
    assert "offloads layer 2, which starts no segment of --segment-layers 3" in res.stderr, res.stderr


@pytest.mark.parametrize("value,msg", [("0", "not a positive number of layers"), ("-2", "not a positive number"),
                                       ("x", "not a positive number"), ("7", "more than the model's 6 layers")])
def test_bad_segment_layers(value, msg):
    res = run([binary("train_gpt_cpu"), *MODEL, "-b", "1", "-t", "32", "--segment-layers", value, "--plan"])
    one_error(res)
    assert msg in res.stderr, res.stderr


# ---- the planner: --plan rows, -r auto ----

BIG = ["-e", "d6", "--layers", "16", "--channels", "64", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "4096"]


def test_plan_prints_a_row_per_k():
    res = run([binary("train_gpt_cpu"), *BIG, "-b", "1", "-t", "4096", "-r", "1", "--segment-layers", "4", "--plan"], check=True)
    rows = re.findall(r"^  (\d+) +([0-9.]+) +([0-9.]+) +(yes|no) +([0-9.]+) +([+-][0-9.]+)%(  <- this run)?$", res.stdout, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, 17)), res.stdout
    assert [r[0] for r in rows if r[6]] == ["4"]
    total = {int(r[0]): float(r[1]) for r in rows}
    assert min(total, key=total.get) == 4  # 16 layers: 4 + 3 kept inputs is the least, 2 sqrt(L) - 1
    assert total[1] == total[16]  # one segment of every layer: its slots are the per-layer plan
    d = json.loads(run([binary("train_gpt_cpu"), *BIG, "-b", "1", "-t", "4096", "-r", "1", "--segment-layers", "4", "--plan-json"],
                       check=True).stdout)
    assert d["segment_layers"] == 4 and [s["segment_layers"] for s in d["segments"]] == list(range(1, 17))
    assert d["segments"][3]["total_bytes"] == d["total_bytes"]
    times = [s["predicted_step_seconds"] for s in d["segments"]]
    assert times[0] == times[15] < times[1]  # a forward again costs time


AUTO_NOTE = re.compile(r"^recompute auto: fits .* with ([0-9.]+) MiB: -r (\S+)((?: --\S+(?: \d+)?)*); predicted ([0-9.]+) ms", re.M)


@pytest.mark.parametrize("offload", [False, True])
def test_auto_chooses_segments_below_per_layer_recompute(offload):
    """A budget 5 MiB (five kept inputs) below -r 1's per-layer plan in the
    smallest tile: only segments fit (offloading 4 layers of 16 into 4 MiB of
    host memory saves one input beside its 3 staging slots), and -r auto
    prints flags that reproduce its plan within both budgets."""
    base = [binary("train_gpt_cpu"), *BIG, "-b", "1", "-t", "4096"]
    r1 = json.loads(run([*base, "-r", "1", "--tile-tokens", "64", "--plan-json"], check=True).stdout)["total_bytes"]
    extra = ["--offload-checkpoints", "--host-mem-budget", "4MiB"] if offload else []
    budget = r1 - (5 << 20)
    res = run([*base, "-r", "auto", "--mem-budget", str(budget), *extra, "--plan"], check=True)
    m = AUTO_NOTE.search(res.stdout)
    assert m, res.stdout
    flags = m.group(3).split()
    assert "--segment-layers" in flags and int(flags[flags.index("--segment-layers") + 1]) > 1
    again = json.loads(run([*base, "-r", m.group(2), *flags, "--plan-json"], check=True).stdout)
    assert again["total_bytes"] <= budget and again["host_total_bytes"] <= (4 << 20 if offload else 0)
    assert abs(again["predicted_step_seconds"] * 1e3 - float(m.group(4))) <= 0.05 + 1e-6 * float(m.group(4))
