"""The trainers' C loader and tokenizer reader (through build/read_data, built
with the sanitizers) read exactly what the Python data scripts write."""
import numpy as np

from conftest import binary, datafile, run


def parse_batches(stdout):
    lines = stdout.splitlines()
    inputs = [list(map(int, l.split()[1:])) for l in lines if l.startswith("inputs")]
    targets = [list(map(int, l.split()[1:])) for l in lines if l.startswith("targets")]
    return inputs, targets, lines


def test_loader_reads_python_shards_in_order(tmp_path):
    rng = np.random.default_rng(11)
    a, b = rng.integers(0, 1000, 301), rng.integers(0, 1000, 170)
    datafile.write_shard(tmp_path / "x_000000.bin", a)
    datafile.write_shard(tmp_path / "x_000001.bin", b)
    B, T = 3, 16
    res = run([binary("build/read_data"), "shards", tmp_path / "x_*.bin", B, T, 1000], check=True)
    inputs, targets, lines = parse_batches(res.stdout)
    expected = []
    for shard in (a, b):
        for k in range((len(shard) - 1) // (B * T)):
            expected.append(shard[k * B * T:(k + 1) * B * T + 1])
    assert lines[0] == f"shards 2 batches {len(expected)}"
    assert inputs == [list(w[:-1]) for w in expected]
    assert targets == [list(w[1:]) for w in expected]
    assert lines[-1] == "epoch after 1"


def test_shuffled_epoch_is_a_permutation_of_the_batches(tmp_path):
    rng = np.random.default_rng(12)
    tokens = rng.integers(0, 500, 10 * 8 + 1)
    datafile.write_shard(tmp_path / "s.bin", tokens)
    plain = parse_batches(run([binary("build/read_data"), "shards", tmp_path / "s.bin", 1, 8, 500], check=True).stdout)[0]
    shuf = parse_batches(run([binary("build/read_data"), "shards", tmp_path / "s.bin", 1, 8, 500, 1, 5], check=True).stdout)[0]
    assert sorted(shuf) == sorted(plain) and shuf != plain


def test_tokenizer_file_reads_back(tmp_path):
    rng = np.random.default_rng(13)
    tokens = [bytes(rng.integers(0, 256, rng.integers(1, 20)).astype(np.uint8)) for _ in range(300)]
    tokens[5] = b"\xff" * 255  # the longest a token can be
    tokens[6] = b"\0"  # GPT-2 has a token for the NUL byte
    datafile.write_tokenizer(tmp_path / "tok.bin", tokens, eot_id=299)
    res = run([binary("build/read_data"), "tokenizer", tmp_path / "tok.bin"], check=True)
    lines = res.stdout.splitlines()
    assert lines[0] == "eot 299" and lines[1] == "vocab 300"
    got = [bytes.fromhex(l.split(" ", 1)[1]) for l in lines[2:]]
    assert got == tokens  # NUL bytes inside tokens included


def test_synthetic_tokenizer_decodes_in_c(synthetic):
    out, meta = synthetic
    res = run([binary("build/read_data"), "tokenizer", out / "synthetic_tokenizer.bin"], check=True)
    py_tokens, eot = datafile.read_tokenizer(out / "synthetic_tokenizer.bin")
    lines = res.stdout.splitlines()
    assert lines[0] == f"eot {eot}" and eot == meta["eot"]
    assert [bytes.fromhex(l.split(" ", 1)[1]) for l in lines[2:]] == py_tokens
