"""--eval-dump version 2 (issue 44, finding 2): its `position` array is the
position the model gave each token (within its document under
--reset-position-ids) and -1 where the token is not counted (--eod-mask-loss),
so that, under every combination of the document flags, the mean of `loss`
where position >= 0 is the printed val loss, the hits there the printed top-1
accuracy, and the means by position --eval-by-position's buckets. The
positions are checked against numpy's reading of the validation stream;
version 1 files (three arrays) still read; plot_log.py --dump plots the
counted tokens by their position. Also: an evaluation in which no token
counts prints "no token counted" and logs null, never -nan or 0."""
import itertools
import json
import re
import sys

import numpy as np
import pytest

from conftest import REPO, binary, one_error, run
import datafile

sys.path.insert(0, str(REPO / "dev"))
import plot_log  # noqa: E402

EOT, T, B, M = 0, 16, 2, 3
MODEL = ["-e", "d6", "--layers", "1", "--channels", "16", "--heads", "2", "--vocab-size", "64", "--max-seq-len", str(T)]
DOC_FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
BUCKET_RE = re.compile(r"(\d+)-(\d+) (\S+) top1 (\S+)")


def documents(n, rng, longest=9):
    """Documents of 1 to `longest` tokens, end of text first; a row may start inside one."""
    tokens = rng.integers(1, 64, n)
    p = int(rng.integers(0, 4))
    while p < n:
        tokens[p] = EOT
        p += int(rng.integers(1, longest + 1))
    return tokens


@pytest.fixture(scope="module")
def val(tmp_path_factory):
    d = tmp_path_factory.mktemp("dumppos")
    tokens = documents(T * B * M + 1, np.random.default_rng(44))
    datafile.write_shard(d / "val.bin", tokens)
    datafile.write_shard(d / "train.bin", documents(2000, np.random.default_rng(45)))
    return d, tokens


def expected_positions(tokens, S, reset, mask):
    """Row s's inputs are tokens s*T .. s*T+T-1; a document starts at its
    end of text, or at the row's start; -1 where the input is end of text
    and --eod-mask-loss skips it."""
    pos = np.empty((S, T), np.int64)
    for s in range(S):
        start = 0
        for t in range(T):
            x = tokens[s * T + t]
            if x == EOT:
                start = t
            pos[s, t] = -1 if (mask and x == EOT) else (t - start if reset else t)
    return pos


MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def evaluate(d, out, *flags, exe="train_gpt_cpu", launcher=()):
    res = run([*launcher, binary(exe), *MODEL, "-i", d / "train.bin", "-j", d / "val.bin", "-t", T, "-b", B, "-x", 0, "-v", 1,
               "-m", M, "-s", 0, *(["--eot-token", EOT] if flags else []), "--eval-by-position", "every:1", "--eval-dump", out, *flags],
              env={"OMP_NUM_THREADS": "1", **(MPI_ENV if launcher else {})}, check=True)
    return res.stdout


@pytest.mark.parametrize("flags", [list(c) for n in range(4) for c in itertools.combinations(DOC_FLAGS, n)],
                         ids=lambda f: "+".join(x.split("-")[-1] for x in f) or "none")
def test_dump_agrees_with_the_printed_numbers(val, tmp_path, flags):
    d, tokens = val
    stdout = evaluate(d, tmp_path / "d.bin", *flags)
    dump = datafile.read_eval_dump(tmp_path / "d.bin")
    raw = (tmp_path / "d.bin").read_bytes()
    S = B * M
    assert dump["version"] == 2 and dump["sequences"] == S and len(raw) == 1024 + 16 * S * T
    assert np.array_equal(dump["target"], tokens[1:S * T + 1].reshape(S, T))
    want = expected_positions(tokens, S, "--reset-position-ids" in flags, "--eod-mask-loss" in flags)
    assert np.array_equal(dump["position"], want)
    counted = want >= 0
    loss, hits = dump["loss"].astype(np.float64), dump["top1"] == dump["target"]
    val_loss = float(re.search(r"^val loss ([0-9.]+) at step 0$", stdout, re.M).group(1))
    assert abs(loss[counted].mean() - val_loss) <= 2e-6 * val_loss + 1e-6, (loss[counted].mean(), val_loss)
    m = re.search(r"^val top-1 accuracy ([0-9.]+) at step 0 \((\d+) tokens\)$", stdout, re.M)
    assert int(m.group(2)) == counted.sum() and abs(float(m.group(1)) - hits[counted].mean()) < 1e-6
    line = re.search(r"val loss by position at step 0: (.*)", stdout).group(1)
    buckets = BUCKET_RE.findall(line)
    assert len(buckets) == T
    for b, e, bl, bt in buckets:
        at = counted & (want == int(b))
        if not at.any():
            assert bl == "-" and bt == "-"
            continue
        assert abs(float(bl) - loss[at].mean()) <= 1e-6 + 1e-6 * loss[at].mean() and abs(float(bt) - hits[at].mean()) < 1e-4
    # plot_log.py --dump plots those same means, position by position
    edges, by_loss, by_top1 = plot_log.dump_by_position(dump)
    assert list(edges) == list(range(T))
    for p in range(T):
        at = counted & (want == p)
        assert (np.isnan(by_loss[p]) and not at.any()) or abs(by_loss[p] - loss[at].mean()) < 1e-9
        assert (np.isnan(by_top1[p]) and not at.any()) or abs(by_top1[p] - hits[at].mean()) < 1e-9


def test_dump_under_context_parallel_matches_one_process(val, tmp_path):
    """Under --context-parallel 2 each rank writes its chunks' positions: the
    file is the one process's, the positions exactly."""
    import shutil
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)")
    d, _ = val
    evaluate(d, tmp_path / "one.bin", *DOC_FLAGS)
    evaluate(d, tmp_path / "two.bin", *DOC_FLAGS, "--context-parallel", "2",
             launcher=("mpirun", "-np", "2"))
    one, two = datafile.read_eval_dump(tmp_path / "one.bin"), datafile.read_eval_dump(tmp_path / "two.bin")
    assert np.array_equal(one["position"], two["position"]) and np.array_equal(one["target"], two["target"])
    assert np.allclose(one["loss"], two["loss"], atol=1e-5)


def write_v1(path, target, top1, loss, step=5, V=64):
    h = np.zeros(256, "<i4")
    h[:6] = [20261203, 1, target.shape[1], target.shape[0], step, V]
    path.write_bytes(h.tobytes() + target.astype("<i4").tobytes() + top1.astype("<i4").tobytes() + loss.astype("<f4").tobytes())


def test_a_version_1_dump_still_reads(tmp_path):
    rng = np.random.default_rng(1)
    S, Tv = 3, 8
    target, top1 = rng.integers(0, 64, (S, Tv)), rng.integers(0, 64, (S, Tv))
    loss = rng.random((S, Tv)).astype(np.float32)
    write_v1(tmp_path / "v1.bin", target, top1, loss)
    dump = datafile.read_eval_dump(tmp_path / "v1.bin")
    assert dump["version"] == 1 and dump["step"] == 5 and np.array_equal(dump["target"], target)
    assert np.array_equal(dump["position"], np.tile(np.arange(Tv), (S, 1)))  # every token counted, at its place in the row
    _, by_loss, _ = plot_log.dump_by_position(dump)
    assert np.allclose(by_loss, loss.astype(np.float64).mean(axis=0))
    # a version 1 header over a version 2 body (or the reverse) is named, not misread
    (tmp_path / "bad.bin").write_bytes((tmp_path / "v1.bin").read_bytes() + b"\0" * 4 * S * Tv)
    with pytest.raises(datafile.DataError, match="for version 1"):
        datafile.read_eval_dump(tmp_path / "bad.bin")


@pytest.mark.parametrize("extra", [[], ["--reset-position-ids"]])
def test_no_token_counted_says_so(tmp_path, extra):
    """Validation made of end-of-text tokens only, under --eod-mask-loss: no
    token counts. The val loss and top-1 lines say so, the log holds null."""
    datafile.write_shard(tmp_path / "val.bin", np.full(T * B + 1, EOT))
    datafile.write_shard(tmp_path / "train.bin", documents(2000, np.random.default_rng(3)))
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", tmp_path / "train.bin", "-j", tmp_path / "val.bin", "-t", T, "-b", B,
               "-x", 1, "-v", 1, "-m", 1, "-s", 0, "--eot-token", EOT, "--eod-mask-loss", "--eval-by-position", "8",
               "--eval-dump", tmp_path / "d.bin", "-o", tmp_path / "out", *extra], env={"OMP_NUM_THREADS": "1"}, check=True)
    assert "nan" not in res.stdout.lower(), res.stdout
    assert re.search(r"^val loss - at step 1 \(no token counted", res.stdout, re.M), res.stdout
    assert re.search(r"^val top-1 accuracy - at step 1 \(no token counted", res.stdout, re.M), res.stdout
    log = [json.loads(x) for x in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert [e["val_loss"] for e in log if "val_loss" in e] == [None, None]  # at steps 0 and 1
    assert (datafile.read_eval_dump(tmp_path / "d.bin")["position"] == -1).all()
