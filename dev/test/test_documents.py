"""Packed documents (--reset-attention-mask, --reset-position-ids,
--eod-mask-loss; docs/documents.md) in the CPU trainer.

build/test_documents (and its fp64 build) checks the model against each
document run on its own, token tiles, every -r mode bitwise and finite
differences; here the trainer end to end: the loss of the step is the mean
over the counted tokens of the whole step however it is split (micro-steps,
data-parallel ranks, context-parallel ranks: 1e-5, the bound of
test_context_parallel.py), losses do not change when the documents of a
sequence are reordered, and bad flags are refused."""
import re
import shutil
import sys

import numpy as np
import pytest

from conftest import REPO, binary, run
import datafile

FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
MODEL = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--max-seq-len", "32"]
STEP_RE = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr \S+ \| norm ([0-9.]+)", re.M)
REL = 1e-5


@pytest.mark.parametrize("name", ["test_documents", "test_documents_fp64"])
def test_c_checks(name):
    res = run([binary(f"build/{name}")], env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and "passed: 0 failures" in res.stdout, res.stdout[-3000:]


def train(np_, data, *flags, check=True):
    out, meta = data
    args = [binary("train_gpt_cpu"), *MODEL, "--vocab-size", str(meta["vocab_size"]), "-i", out / "synthetic_train.bin",
            "-j", out / "synthetic_val.bin", "-t", "32", "-s", "0", "-l", "2e-3", "-c", "0.1", *flags]
    if np_ > 1:
        args = ["mpirun", "-np", str(np_), *args]
    return run(args, env=MPI_ENV, check=check, timeout=300)


def losses(stdout):
    return [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in STEP_RE.finditer(stdout)]


def assert_close(a, b, rel=REL):
    assert len(a) == len(b) and len(a) > 0
    for (sa, la, na), (sb, lb, nb) in zip(a, b):
        assert sa == sb and abs(la - lb) <= rel * abs(lb) and abs(na - nb) <= rel * abs(nb), (a, b)


def test_one_step_however_split(synthetic):
    """4 sequences a step: one process, two micro-steps, two data-parallel
    ranks: the same losses and norms (the mean over the counted tokens of the
    step, not a mean of per-micro-batch means)."""
    one = train(1, synthetic, *FLAGS, "-b", "4", "-x", "4", "-v", "0")
    assert "documents: start at token 255" in one.stdout
    assert_close(losses(train(1, synthetic, *FLAGS, "-b", "2", "-d", "128", "-x", "4", "-v", "0").stdout), losses(one.stdout))
    if shutil.which("mpirun"):
        assert_close(losses(train(2, synthetic, *FLAGS, "-b", "2", "-x", "4", "-v", "0").stdout), losses(one.stdout))


@pytest.mark.parametrize("n", [2, 4])
def test_context_parallel_against_one_process(synthetic, n):
    """N processes share each sequence (documents begin in other ranks'
    chunks, and chunks hold no end of text at all): training and validation
    losses within 1e-5 of one process."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
    common = [*FLAGS, "-b", "2", "-x", "6", "-v", "3"]
    one = train(1, synthetic, *common)
    ring = train(n, synthetic, *common, "--context-parallel", str(n))
    assert_close(losses(ring.stdout), losses(one.stdout))
    assert "documents: attention attends" in ring.stdout and "ranks' pairs from" in ring.stdout
    plain = train(1, synthetic, "-b", "2", "-x", "6", "-v", "3")  # the masks change the steps: the check can tell
    assert losses(plain.stdout) != losses(one.stdout)
    val = lambda s: [float(v) for v in re.findall(r"val loss ([0-9.]+)", s)]  # noqa: E731
    assert len(val(one.stdout)) == 3 and np.allclose(val(ring.stdout), val(one.stdout), rtol=REL, atol=0)


def reorder_rows(tokens, T, eot, rng):
    """Each row of T tokens with its whole documents (those that start with
    end of text and end inside the row) shuffled among themselves."""
    out = tokens.copy()
    for r0 in range(0, len(tokens) - T, T):
        row = tokens[r0:r0 + T]
        starts = [i for i in range(T) if row[i] == eot]
        if len(starts) < 3:
            continue
        docs = [row[a:b] for a, b in zip(starts, starts[1:])]  # the last one runs past the row: kept in place
        order = rng.permutation(len(docs))
        out[r0 + starts[0]:r0 + starts[-1]] = np.concatenate([docs[k] for k in order])
    return out


def test_reordered_documents_same_loss(synthetic, tmp_path):
    """Validation on a shard and on the same shard with the documents inside
    each sequence reordered: the same loss with the three flags (to 1e-6,
    fp32 rounding of the loss sum), a different one without them."""
    out, meta = synthetic
    tokens = datafile.read_shard(out / "synthetic_val.bin")[:32 * 40 + 1]
    shuffled = reorder_rows(tokens, 32, meta["eot"], np.random.default_rng(3))
    assert not np.array_equal(tokens, shuffled)
    for name, t in [("a.bin", tokens), ("b.bin", shuffled)]:
        datafile.write_shard(tmp_path / name, t)

    def val_loss(shard, *flags):  # after 4 steps on the training shard (the same model for a.bin and b.bin)
        res = run([binary("train_gpt_cpu"), *MODEL, "--vocab-size", str(meta["vocab_size"]), "-i", out / "synthetic_train.bin",
                   "-j", shard, "-t", "32", "-b", "2", "-x", "4", "-v", "4", "-l", "1e-2", "-s", "0", "-m", "20", *flags],
                  env={"OMP_NUM_THREADS": "1"}, check=True)
        return float(re.findall(r"val loss ([0-9.]+) at step 4", res.stdout)[-1])

    masked = [val_loss(tmp_path / n, *FLAGS, "--eot-token", str(meta["eot"])) for n in ["a.bin", "b.bin"]]
    plain = [val_loss(tmp_path / n) for n in ["a.bin", "b.bin"]]
    assert abs(masked[0] - masked[1]) <= 1e-6 * masked[0], masked
    assert abs(plain[0] - plain[1]) > 3e-5 * plain[0], plain  # observed: 1.5e-4 (the masked ones: equal)


@pytest.mark.parametrize("flags,message", [
    (["--eot-token", "5"], "flag --eot-token: applies with --reset-attention-mask"),
    (["--eod-mask-loss", "--eot-token", "300"], "flag --eot-token 300: not a token of the model's vocabulary (256)"),
    (["--reset-attention-mask", "--eot-token", "7"], "flag --eot-token 7: the tokenizer file"),
])
def test_bad_flags_refused(synthetic, flags, message):
    res = train(1, synthetic, "-b", "2", "-x", "1", "-v", "0", *flags, check=False)
    assert res.returncode == 1 and message in res.stderr, res.stderr


def test_plan_counts_document_pairs():
    """--plan-doc-len: the time model's attention counts the documents' pairs
    (T = 4096 in documents of 1000: 4 x 1000 x 1001 / 2 + 96 x 97 / 2 of the
    causal 4096 x 4097 / 2), and the predicted step falls; without
    --reset-attention-mask the flag is refused."""
    common = [binary("train_gpt_cpu"), "-e", "d12", "--max-seq-len", "4096", "-t", "4096", "-b", "1", "--plan", "--cost-model", "h100",
              "--mem-budget", "80GiB"]
    plain = run(common, check=True)
    docs = run([*common, "--reset-attention-mask", "--plan-doc-len", "1000"], check=True)
    share = (4 * 1000 * 1001 / 2 + 96 * 97 / 2) / (4096 * 4097 / 2)
    assert f"attention attends {100 * share:.3g}% of the causal pairs" in docs.stdout, docs.stdout[-2000:]
    ms = lambda s: float(re.search(r"this run, -r \S+: predicted ([0-9.]+) ms", s).group(1))  # noqa: E731
    assert 0 < ms(docs.stdout) < ms(plain.stdout)
    res = run([*common, "--plan-doc-len", "8"])
    assert res.returncode == 1 and "flag --plan-doc-len: applies with --reset-attention-mask" in res.stderr


def test_no_end_of_text_known_refused(tiny_shards):
    """A vocabulary that is not GPT-2's and no tokenizer file: which token
    starts a document is not guessed."""
    res = run([binary("train_gpt_cpu"), "-e", "d6", "--layers", "1", "--channels", "16", "--heads", "2", "--vocab-size", "64",
               "--max-seq-len", "16", "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "8", "-x", "1", "-s", "0",
               "--tokenizer", "", "--reset-attention-mask"], env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 1 and "give --eot-token N" in res.stderr, res.stderr
    ok = run([binary("train_gpt_cpu"), "-e", "d6", "--layers", "1", "--channels", "16", "--heads", "2", "--vocab-size", "64",
              "--max-seq-len", "16", "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "8", "-x", "1", "-s", "0",
              "--reset-attention-mask", "--eot-token", "63"], env={"OMP_NUM_THREADS": "1"})
    assert ok.returncode == 0 and "documents: start at token 63" in ok.stdout, ok.stderr


def test_gradient_is_the_mean_over_counted_tokens(tmp_path):
    """Rows of 32 tokens: 16 documents of end of text alone (no loss
    counted: their input is end of text), then a document of 16 (15 counted);
    against rows of 16 holding that document alone. With the three flags
    both steps see the same 15 predictions in the same positions, so the
    loss and the gradient norm (the mean over the tokens counted) agree; a
    gradient left as the sum over all tokens would be half as large in the
    first."""
    rng = np.random.default_rng(5)
    eot, words = 63, rng.integers(0, 63, (8, 15))
    long_rows = np.concatenate([np.concatenate([np.full(17, eot), w]) for w in words] + [[eot]])
    short_rows = np.concatenate([np.concatenate([[eot], w]) for w in words] + [[eot]])
    datafile.write_shard(tmp_path / "long.bin", long_rows)
    datafile.write_shard(tmp_path / "short.bin", short_rows)

    def steps(shard, T):
        res = run([binary("train_gpt_cpu"), "-e", "d6", "--layers", "2", "--channels", "16", "--heads", "2", "--vocab-size", "64",
                   "--max-seq-len", "32", "-i", tmp_path / shard, "-j", "", "-b", "1", "-t", str(T), "-x", "3", "-s", "0",
                   "-l", "1e-2", *FLAGS, "--eot-token", str(eot)], env={"OMP_NUM_THREADS": "1"}, check=True)
        return losses(res.stdout)

    assert_close(steps("long.bin", 32), steps("short.bin", 16))


def test_synthetic_floor_without_end_of_text_predictions(synthetic):
    """dev/data/synthetic.py's floor for --eod-mask-loss against the data:
    the plug-in conditional entropy of the training shard's transitions
    whose input is not end of text (its bias ~ states x successors / 2n,
    about 1e-3 here)."""
    out, meta = synthetic
    tokens = datafile.read_shard(out / "synthetic_train.bin").astype(np.int64)
    eot, V = meta["eot"], meta["vocab_size"]
    a, b = tokens[:-1], tokens[1:]
    keep = a != eot
    counts = np.zeros((V, V))
    np.add.at(counts, (a[keep], b[keep]), 1)
    rows = counts.sum(axis=1, keepdims=True)
    p = np.where(counts > 0, counts / np.maximum(rows, 1), 1.0)
    empirical = float(-(counts * np.log(p)).sum() / keep.sum())
    floor = meta["entropy_nats_per_token_eod_masked"]
    assert abs(empirical - floor) < 0.01, (empirical, floor)
    assert floor != meta["entropy_nats_per_token"]


def test_pack_documents(tmp_path):
    """dev/data/pack_documents.py: the documents of at least --min-tokens,
    whole and each after its end of text, shuffled by --seed; the tokens
    before a shard's first end of text dropped; the pairs saved as counted
    by hand."""
    eot = 9
    a = [5, 5, eot, 1, 2, 3, eot, 4, eot, 1, 1, 1, 1, 1]  # lead 2, then documents of 4, 2, 6
    b = [eot, 7, 7, 7, 7, 7, 7, 7]                           # a document of 8
    datafile.write_shard(tmp_path / "in_000.bin", np.array(a))
    datafile.write_shard(tmp_path / "in_001.bin", np.array(b))
    res = run([sys.executable, REPO / "dev/data/pack_documents.py", tmp_path / "in_*.bin", tmp_path / "out", "--eot", str(eot),
               "--min-tokens", "4", "--seq-len", "6"], check=True)
    got = datafile.read_shard(tmp_path / "out" / "packed_000000.bin").tolist()
    assert got == [eot, 1, 2, 3, eot, 1, 1, 1, 1, 1, eot, 7, 7, 7, 7, 7, 7, 7]
    assert "kept 3 of 4 documents (18 tokens" in res.stdout and "2 tokens before" in res.stdout
    # rows of 6: [4 | 2 of the next], [4 of it | 2], [6]: pieces 4,2,4,2,6 against 3 rows of 21 pairs
    assert f"{63 / (10 + 3 + 10 + 3 + 21):.1f}x fewer" in res.stdout
    shuffled = run([sys.executable, REPO / "dev/data/pack_documents.py", tmp_path / "in_*.bin", tmp_path / "s", "--eot", str(eot),
                    "--min-tokens", "4", "--seed", "1"], check=True)
    s = datafile.read_shard(tmp_path / "s" / "packed_000000.bin").tolist()
    assert shuffled.returncode == 0 and sorted(s) == sorted(got) and s.count(eot) == 3
