"""The rest of the trainer's capabilities on the configurable family (issue 41), each on a tiny Llama
model that numpy writes (test_llama_reference.write_model): micro-steps, data parallelism and ZeRO-1
against one process, --eval-dump against the printed val loss and --eval-by-position against the
dump's own per-position losses, greedy sampling against numpy's argmax, -r auto under --mem-budget
on a preset's shape, and the plan's ring block for Llama 3.1 8B counted by hand."""
import json
import re
import shutil

import numpy as np
import pytest

from conftest import binary, datafile, run
from test_llama_reference import CASES, V, random_params, reference_loss, write_model

STEP_RE = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr \S+ \| norm ([0-9.]+)", re.M)
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
T = 16


@pytest.fixture
def llama(tmp_path):
    """A 2-layer Llama 3 model (4 query heads on 1 K/V head, untied) and 600 random tokens."""
    cfg = CASES["llama3-untied"]
    p = random_params(cfg, 21)
    write_model(tmp_path / "m.bin", cfg, p)
    datafile.write_shard(tmp_path / "t.bin", np.random.default_rng(22).integers(0, V, 600))
    return cfg, p


def train(tmp_path, *flags, np_=1, **kw):
    args = ["-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-t", str(T), "-s", "0", "-l", "1e-3", *flags]
    exe = [binary("train_gpt_cpu")] if np_ == 1 else ["mpirun", "-np", str(np_), binary("train_gpt_cpu")]
    return run([*exe, *args], env=MPI_ENV, check=True, **kw)


def losses(stdout):
    """(step, loss, gradient norm) of each step line: AdamW barely feels a gradient's scale, the norm does."""
    return [(int(s), float(x), float(n)) for s, x, n in STEP_RE.findall(stdout)]


def assert_close(a, b, rel=1e-5):
    assert len(a) == len(b) == 3, (a, b)
    assert all(sa == sb and abs(la - lb) <= rel * lb and abs(na - nb) <= rel * nb
               for (sa, la, na), (sb, lb, nb) in zip(a, b)), (a, b)


def test_micro_steps_match_one_big_batch(tmp_path, llama):
    """-d 4*T with -b 2: two micro-steps of 2 rows accumulate the gradient of one step of 4 rows."""
    big = train(tmp_path, "-b", "4", "-d", str(4 * T), "-x", "3")
    micro = train(tmp_path, "-b", "2", "-d", str(4 * T), "-x", "3")
    assert "gradient accumulation 2" in micro.stdout
    assert_close(losses(micro.stdout), losses(big.stdout))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found (install OpenMPI)")
@pytest.mark.parametrize("zero", ["0", "1"])
def test_two_processes_match_one(tmp_path, llama, zero):
    """Data parallelism (ZeRO-0 and ZeRO-1): 2 processes of batch 2 train like one process of batch 4."""
    one = train(tmp_path, "-b", "4", "-x", "3")
    two = train(tmp_path, "-b", "2", "-x", "3", "-z", zero, np_=2)
    assert "x 2 processes" in two.stdout
    assert_close(losses(two.stdout), losses(one.stdout))


def test_eval_dump_and_eval_by_position(tmp_path, llama):
    """The dump's targets are the shard's, its losses numpy's and their mean the printed val loss; each
    --eval-by-position bucket is the mean of the dump's losses at those positions."""
    cfg, p = llama
    toks = np.random.default_rng(23).integers(0, V, 4 * T + 1)
    datafile.write_shard(tmp_path / "v.bin", toks)
    res = run([binary("train_gpt_cpu"), "-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", tmp_path / "v.bin", "-b", "2",
               "-t", str(T), "-x", "0", "-v", "1", "-m", "2", "-s", "0", "--eval-dump", tmp_path / "dump.bin",
               "--eval-by-position", "every:4", "-o", tmp_path / "out"], env={"OMP_NUM_THREADS": "1"}, check=True)
    dump = datafile.read_eval_dump(tmp_path / "dump.bin")
    inputs, targets = toks[:4 * T].reshape(4, T), toks[1:4 * T + 1].reshape(4, T)
    assert np.array_equal(dump["target"], targets)
    val = float(re.search(r"val loss ([0-9.]+)", res.stdout).group(1))
    assert abs(dump["loss"].mean() - val) <= 1e-5 * val, (dump["loss"].mean(), val)
    expected = reference_loss(cfg, p, inputs, targets, np.tile(np.arange(T), (4, 1)))
    assert abs(val - expected) <= 1e-5 * expected, (val, expected)
    log = [json.loads(x) for x in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    buckets = [r for r in log if "val_loss_by_position" in r][0]["val_loss_by_position"]
    assert [b["tokens"] for b in buckets] == [4 * 4] * (T // 4)
    for i, b in enumerate(buckets):
        want = dump["loss"][:, 4 * i:4 * i + 4].mean()
        assert abs(b["loss"] - want) <= 1e-5 * want, (i, b, want)
    assert np.ptp([b["loss"] for b in buckets]) > 1e-3  # the buckets differ, so a wrong bucket would show


def greedy(cfg, p, prompt, n):
    """numpy's greedy continuation: the next token is the target of least loss at the last position."""
    seq = list(prompt)
    for _ in range(n):
        inputs = np.array([seq])
        pos = np.arange(len(seq))[None]
        cand = [reference_loss(cfg, p, inputs, np.array([[0] * (len(seq) - 1) + [c]]), pos) for c in range(V)]
        seq.append(int(np.argmin(cand)))
    return seq


def test_greedy_sampling_matches_numpy(tmp_path, llama):
    """-s / -g with --temperature 0: the sample is the prompt and then numpy's argmax tokens, all below V (the
    context starts with end-of-text, V - 1 for a file whose eos slot is -1 and no tokenizer)."""
    cfg, p = llama
    prompt = [7, 40, 3]
    (tmp_path / "p.txt").write_text(" ".join(map(str, prompt)))
    out = train(tmp_path, "-b", "1", "-x", "0", "-s", "1", "--temperature", "0", "-g", "5",
                "--prompt-tokens", tmp_path / "p.txt").stdout
    sample = re.search(r"^sample at step \d+:\n---\n(.*?)\n---$", out, re.M | re.S).group(1)
    got = [int(x) for x in re.findall(r"<(\d+)>", sample)]
    assert got == greedy(cfg, p, [V - 1] + prompt, 5)[1:], out
    assert all(0 <= t < V for t in got)


def plan(*flags):
    return json.loads(run([binary("train_gpt_cpu"), *flags, "--plan-json"], check=True).stdout)


def test_auto_recompute_fits_a_budget_on_a_preset(tmp_path):
    """-r auto --mem-budget on Llama 3.2 1B's shape at T 8192: -r 0 does not fit, the chosen mix does, and
    it is predicted no slower than -r 1 everywhere (which fits too)."""
    shape = ["-e", "llama3.2-1b", "-b", "1", "-t", "8192"]
    keep_all = plan(*shape, "-r", "0")["total_bytes"]
    one = plan(*shape, "-r", "1")
    recompute_all = one["total_bytes"]
    budget = (keep_all + recompute_all) // 2
    auto = plan(*shape, "-r", "auto", "--mem-budget", str(budget))
    assert recompute_all < budget < keep_all
    assert auto["total_bytes"] <= budget
    assert any(m != 0 for m in auto["layer_modes"]), auto["layer_modes"]
    assert auto["predicted_step_seconds"] <= one["predicted_step_seconds"]


def test_plan_ring_block_of_llama3_1_8b():
    """--context-parallel 8 for Llama 3.1 8B: each member's K/V block is its T/8 tokens x 2 (K and V) x 8
    K/V heads x 128 x 4 bytes (fp32), a quarter of the 32 query heads' K/V that replicating would send."""
    t, n = 65536, 8
    flags = ["-e", "llama3.1-8b", "-b", "1", "-t", str(t), "--context-parallel", str(n), "--plan-processes", str(n)]
    kv = (t // n) * 2 * 8 * 128 * 4
    assert kv * 4 == (t // n) * 2 * 32 * 128 * 4
    text = run([binary("train_gpt_cpu"), *flags, "--plan"], check=True).stdout
    assert f"K/V block {kv / 2**20:.1f} MiB" in text, text[-3000:]
    buffers = {b["name"]: b["bytes"] for b in plan(*flags)["buffers"]}
    assert buffers["ring.kv_blocks"] == 2 * kv  # two blocks: the one attended and the one arriving
