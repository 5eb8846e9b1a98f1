"""The ring's chunks paired by their work under --reset-attention-mask
(llmc/core/token_layout.h ring_chunks_balance; docs/context-parallel.md).

Rows of very unequal documents (one long document somewhere in each row,
the rest documents of one to four tokens) leave the zigzag's members very
unequal work; the loader pairs each batch's chunks so that the busiest
member's attended pairs are as small as any pairing makes them. Against one
process (which has no chunks): training losses and norms, validation loss,
--eval-by-position's buckets, the --eval-dump file and a sample from a
prompt with documents inside it, 2 and 4 processes, within 1e-5 (the bound
of test_context_parallel.py). The step report's shares show the imbalance
before (the zigzag) and after."""
import re
import shutil
import subprocess

import numpy as np
import pytest

from conftest import binary, run
import datafile

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
EOT, T, REL = 63, 64, 1e-5
MODEL = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", str(T)]
FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--eot-token", str(EOT)]
STEP_RE = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr \S+ \| norm ([0-9.]+)", re.M)
BALANCE_RE = re.compile(r"ring balance: members' shares of the attended pairs ([0-9. ]+), the busiest ([0-9.]+)x the mean "
                        r"\(the zigzag chunks: ([0-9. ]+), ([0-9.]+)x\)")


def unequal_rows(rows, rng, T=T):
    """Each row of T: a document of 3T/8 to 7T/8 tokens at a random place (at
    the row's start for most rows, so that the zigzag's middle chunks carry
    it), documents of 1 to 4 tokens around it; end of text at every start."""
    out = []
    for r in range(rows):
        row = rng.integers(0, EOT, T)
        length = int(rng.integers(3 * T // 8, 7 * T // 8 + 1))
        begin = int(rng.integers(0, min(T - length, T // 8) + 1)) if r % 4 else int(rng.integers(0, T - length + 1))
        starts = {begin}
        p = 0
        while p < begin:
            starts.add(p)
            p += int(rng.integers(1, 5))
        p = begin + length
        while p < T:
            starts.add(p)
            p += int(rng.integers(1, 5))
        for s in starts:
            row[s] = EOT
        out.append(row)
    return np.concatenate(out + [[EOT]])


@pytest.fixture(scope="module")
def unequal(tmp_path_factory):
    d = tmp_path_factory.mktemp("unequal")
    rng = np.random.default_rng(11)
    datafile.write_shard(d / "train.bin", unequal_rows(48, rng))
    datafile.write_shard(d / "val.bin", unequal_rows(16, rng))
    (d / "prompt.txt").write_text(" ".join(str(t) for t in [1, 2, 3, EOT, 4, EOT, 5, 6, 7, 8, 9, 10, 11, 12, 13, EOT, 14]))
    return d


def train(np_, d, tmp, *flags):
    args = [binary("train_gpt_cpu"), *MODEL, "-i", d / "train.bin", "-j", d / "val.bin", "-t", str(T), "-b", "2", "-x", "4",
            "-v", "2", "-m", "4", "-l", "2e-3", "-s", "4", "-g", "20", "--prompt-tokens", d / "prompt.txt",
            "--eval-by-position", "every:16", "--eval-dump", tmp / f"dump{np_}.bin", *FLAGS, *flags]
    if np_ > 1:
        args = ["mpirun", "-np", str(np_), *args]
    return run(args, env=MPI_ENV, check=True, timeout=300).stdout


def dump(path):
    """target, top1, loss and position of a version 2 dump (docs/FORMATS.md)."""
    raw = np.fromfile(path, dtype=np.int32)
    assert raw[1] == 2
    n = raw[3] * raw[2]
    body = raw[256:]
    assert len(body) == 4 * n
    return body[:n], body[n:2 * n], body[2 * n:3 * n].view(np.float32), body[3 * n:]


@pytest.mark.parametrize("n", [2, 4])
def test_balanced_ring_against_one_process(unequal, tmp_path, n):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
    one = train(1, unequal, tmp_path)
    ring = train(n, unequal, tmp_path, "--context-parallel", str(n))
    a, b = STEP_RE.findall(one), STEP_RE.findall(ring)
    assert len(a) == 4 and [s for s, _, _ in a] == [s for s, _, _ in b]
    for (_, la, na), (_, lb, nb) in zip(a, b):
        assert abs(float(la) - float(lb)) <= REL * float(la) and abs(float(na) - float(nb)) <= REL * float(na), (a, b)
    val = lambda s: [float(v) for v in re.findall(r"val loss ([0-9.]+) at", s)]  # noqa: E731
    assert len(val(one)) == 3 and np.allclose(val(ring), val(one), rtol=REL, atol=0)
    by_pos = lambda s: [float(v) for v in re.findall(r"\d+-\d+ ([0-9.]+) top1", s)]  # noqa: E731
    assert len(by_pos(one)) == 3 * 4 and np.allclose(by_pos(ring), by_pos(one), rtol=REL, atol=0)
    ta, ka, la, pa = dump(tmp_path / "dump1.bin")
    tb, kb, lb, pb = dump(tmp_path / f"dump{n}.bin")
    assert np.array_equal(ta, tb) and np.mean(ka == kb) > 0.99 and np.allclose(lb, la, rtol=REL, atol=1e-6)
    assert np.array_equal(pa, pb)  # the positions the model gave, whichever rank held the token
    sample = lambda s: re.findall(r"sample at step \d+:\n---\n(.*?)\n---", s, re.S)  # noqa: E731
    assert len(sample(one)) == 1 and sample(ring) == sample(one)
    # the report: shares that sum to one, and the pairing's busiest member below the zigzag's
    m = BALANCE_RE.search(ring)
    assert m, ring[-3000:]
    paired, busiest, zigzag, busiest_zigzag = m.groups()
    assert len(paired.split()) == n and abs(sum(map(float, paired.split())) - 1) < 2e-3
    assert abs(max(map(float, paired.split())) * n - float(busiest)) < 5e-3 * n
    assert float(busiest_zigzag) > 1.3 and float(busiest) < float(busiest_zigzag) - 0.2, m.group(0)
    print(m.group(0))


def test_no_documents_keep_the_zigzag(unequal, tmp_path):
    """Positions reset without the attention mask: the work is the causal
    triangle's, the chunks stay the zigzag and no balance is reported."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
    out = run(["mpirun", "-np", "2", binary("train_gpt_cpu"), *MODEL, "-i", unequal / "train.bin", "-j", "", "-t", str(T), "-b", "2",
               "-x", "1", "-s", "0", "--reset-position-ids", "--eot-token", str(EOT), "--context-parallel", "2"],
              env=MPI_ENV, check=True, timeout=300).stdout
    assert "holds chunks 0 and 3 of 4" in out and "ring balance" not in out


def pairings(chunks):
    """Every way to cut a list of chunks into pairs."""
    if not chunks:
        yield []
        return
    first, rest = chunks[0], chunks[1:]
    for i, c in enumerate(rest):
        for p in pairings(rest[:i] + rest[i + 1:]):
            yield [(first, c)] + p


@pytest.mark.parametrize("n,doc_len", [(2, 3000), (4, 1000), (4, 700)])
def test_plan_shows_each_members_share(n, doc_len):
    """--plan --plan-doc-len under the ring: each member's share with the
    zigzag chunks, and the busiest member's share paired as the loader pairs
    them equal to the best of every pairing (brute force here)."""
    T = 4096
    res = run([binary("train_gpt_cpu"), "-e", "d12", "--max-seq-len", str(T), "-t", str(T), "-b", "1", "--plan", "--cost-model", "h100",
               "--mem-budget", "80GiB", "--plan-processes", str(n), "--context-parallel", str(n), "--reset-attention-mask",
               "--plan-doc-len", str(doc_len)], check=True)
    tc = T // (2 * n)
    work = [sum(p % doc_len + 1 for p in range(c * tc, (c + 1) * tc)) for c in range(2 * n)]
    total = sum(work)
    zigzag = [(work[m] + work[2 * n - 1 - m]) / total for m in range(n)]
    best = min(max(work[a] + work[b] for a, b in p) for p in pairings(list(range(2 * n)))) * n / total
    m = re.search(r"ring members' shares of the attended pairs: ([0-9. ]+) with the zigzag chunks \(the busiest ([0-9.]+)x the mean\), "
                  r"([0-9. ]+) paired by their work \(([0-9.]+)x\)", res.stdout)
    assert m, res.stdout[-3000:]
    assert [float(v) for v in m.group(1).split()] == pytest.approx(zigzag, abs=6e-4)
    assert float(m.group(2)) == pytest.approx(max(zigzag) * n, abs=6e-4)
    assert float(m.group(4)) == pytest.approx(best, abs=6e-4) and best < max(zigzag) * n


def test_emulated_nccl_ring_against_one_process(tmp_path):
    """The GPU trainer's ring (train_gpt.cu, llmc/core/ring.h's pairing; mpirun -np 2
    of the emulated NCCL build, dev/emu: NOT a GPU) on rows of unequal
    documents against train_gpt_cpu in one process: FP32 losses, norms and
    validation within 1e-5 (test_emu_context_parallel.py's bound)."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
    from test_emu_multigpu import EMU, OUT, env, explain
    res = subprocess.run(["make", "-C", str(EMU), "-j2", "mpi-bins"], capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        pytest.fail("building the emulated trainers failed:\n" + res.stdout[-3000:] + res.stderr[-5000:])
    if not (OUT / "emu_train_gpt_mpi_fp32").exists():
        pytest.skip(res.stdout.strip().splitlines()[-1])
    rng = np.random.default_rng(12)
    datafile.write_shard(tmp_path / "t.bin", unequal_rows(16, rng, T=32))
    common = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32",
              "-i", tmp_path / "t.bin", "-j", tmp_path / "t.bin", "-t", "32", "-b", "2", "-x", "2", "-v", "2", "-m", "1", "-s", "0",
              "-l", "1e-3", *FLAGS]
    cpu = run([binary("train_gpt_cpu"), *common], env={"OMP_NUM_THREADS": "1"}, check=True).stdout
    emu = subprocess.run([str(a) for a in ["mpirun", "-np", "2", OUT / "emu_train_gpt_mpi_fp32", *common, "--context-parallel", "2"]],
                         capture_output=True, text=True, timeout=900, env=env())
    assert emu.returncode == 0, explain(emu)
    a, b = STEP_RE.findall(cpu), STEP_RE.findall(emu.stdout)
    assert len(a) == 2 and [s for s, _, _ in a] == [s for s, _, _ in b]
    for (_, la, na), (_, lb, nb) in zip(a, b):
        assert abs(float(la) - float(lb)) <= REL * float(la) and abs(float(na) - float(nb)) <= REL * float(na), (a, b)
    val = lambda s: [float(v) for v in re.findall(r"val loss ([0-9.]+) at", s)]  # noqa: E731
    assert len(val(cpu)) == 2 and np.allclose(val(emu.stdout), val(cpu), rtol=REL, atol=0)
    m = BALANCE_RE.search(emu.stdout)
    assert m and float(m.group(2)) < float(m.group(4)), emu.stdout[-3000:]
