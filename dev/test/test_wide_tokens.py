"""Token ids beyond 65,535: llm.c's llama-3 token shards (magic 20240801, version 7,
uint32 tokens) written and read by dev/data/datafile.py, read by the C loader
(build/read_data) beside GPT-2's uint16 shards, and trained on by the CPU trainer
with a vocabulary of 70,000. Layouts are checked with struct against
docs/FORMATS.md; losses against the float64 numpy GPT-2 forward of
test_hf_gpt2.py, never through the trainer."""
import json
import re
import struct
import sys

import numpy as np
import pytest

from conftest import REPO, binary, datafile, run

BIG_V = 70_000  # beyond uint16: pads to 70,016


def read_batches(pattern, B, T, V):
    res = run([binary("build/read_data"), "shards", pattern, B, T, V], check=True)
    lines = res.stdout.splitlines()
    inputs = [list(map(int, l.split()[1:])) for l in lines if l.startswith("inputs")]
    targets = [list(map(int, l.split()[1:])) for l in lines if l.startswith("targets")]
    return inputs, targets


def expected_batches(shards, B, T):
    windows = [s[k * B * T:(k + 1) * B * T + 1] for s in shards for k in range((len(s) - 1) // (B * T))]
    return [list(map(int, w[:-1])) for w in windows], [list(map(int, w[1:])) for w in windows]


# --- the Python side ---------------------------------------------------------------------


def test_version_7_shard_layout_and_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 2**32, size=777, dtype=np.uint64)
    tokens[:3] = [0, 65536, 2**32 - 1]
    path = tmp_path / "s.bin"
    datafile.write_shard(path, tokens, version=7)
    raw = path.read_bytes()
    assert len(raw) == 1024 + 4 * len(tokens)
    header = struct.unpack("<256i", raw[:1024])
    assert header[:3] == (20240801, 7, len(tokens)) and not any(header[3:])
    assert raw[1024:] == struct.pack(f"<{len(tokens)}I", *tokens.tolist())
    back = datafile.read_shard(path)
    assert back.dtype == np.uint32 and np.array_equal(back, tokens)
    assert np.array_equal(datafile.read_shard(path, mmap=True), tokens)
    assert datafile.read_shard_version(path) == 7
    datafile.write_shard(tmp_path / "v1.bin", [1, 2, 3])
    assert datafile.read_shard_version(tmp_path / "v1.bin") == 1


def test_shard_writer_streams_version_7(tmp_path):
    tokens = np.arange(100_000, 100_250)
    with datafile.ShardWriter(lambda i: tmp_path / f"w_{i}.bin", 100, version=7) as w:
        w.add(tokens[:130])
        w.add(tokens[130:])
    assert [len(datafile.read_shard(tmp_path / f"w_{i}.bin")) for i in range(3)] == [100, 100, 50]
    assert np.array_equal(np.concatenate([datafile.read_shard(tmp_path / f"w_{i}.bin") for i in range(3)]), tokens)


@pytest.mark.parametrize("version, bad, why", [(1, 65536, "version-7 shard holds uint32"), (7, 2**32, "uint32"),
                                               (7, -1, "uint32"), (3, 5, "shard version 3")])
def test_shard_writer_refuses_what_the_version_cannot_hold(tmp_path, version, bad, why):
    with pytest.raises(datafile.DataError, match=why):
        datafile.write_shard(tmp_path / "s.bin", np.array([1, bad], dtype=np.int64), version=version)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("mutate, reason", [
    (lambda r: r[:4] + struct.pack("<i", 1) + r[8:], "magic 20240801 has version 7"),
    (lambda r: struct.pack("<i", 20240520) + r[4:], "magic 20240520 has version 1"),
    (lambda r: r[:-2], "truncated"),
    (lambda r: r + b"\0\0\0\0", "trailing bytes"),
])
def test_malformed_version_7_shards_are_refused(tmp_path, mutate, reason):
    datafile.write_shard(tmp_path / "good.bin", np.arange(10), version=7)
    (tmp_path / "bad.bin").write_bytes(mutate((tmp_path / "good.bin").read_bytes()))
    with pytest.raises(datafile.DataError, match=reason):
        datafile.read_shard(tmp_path / "bad.bin")


def test_vocabulary_picks_the_shard_version():
    assert [datafile.shard_version_for(v) for v in (50257, 65536, 65537, 151_936)] == [1, 1, 7, 7]


def test_pack_documents_keeps_uint32_tokens(tmp_path):
    """pack_documents.py on a version-7 shard (Llama 3's end of text, 128001) and a
    version-1 one: the output is version 7 and holds the documents' ids unchanged."""
    eot = 128_001
    datafile.write_shard(tmp_path / "in_000.bin", [7, eot, 100_000, 65_536, 3, eot, 70_000], version=7)
    datafile.write_shard(tmp_path / "in_001.bin", [65_535, 1, 2])  # no end of text: all dropped as a lead
    res = run([sys.executable, REPO / "dev/data/pack_documents.py", tmp_path / "in_*.bin", tmp_path / "out", "--eot", eot],
              check=True)
    out = tmp_path / "out" / "packed_000000.bin"
    assert struct.unpack("<2i", out.read_bytes()[:8]) == (20240801, 7)
    assert datafile.read_shard(out).tolist() == [eot, 100_000, 65_536, 3, eot, 70_000], res.stdout


# --- the C loader -----------------------------------------------------------------------


def test_c_loader_reads_version_7_shards_beyond_uint16(tmp_path):
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, BIG_V, 301), rng.integers(60_000, BIG_V, 170)
    datafile.write_shard(tmp_path / "x_000000.bin", a, version=7)
    datafile.write_shard(tmp_path / "x_000001.bin", b, version=7)
    assert read_batches(tmp_path / "x_*.bin", 3, 16, BIG_V) == expected_batches([a, b], 3, 16)


@pytest.mark.parametrize("V", [1000, BIG_V])
def test_c_loader_mixes_token_widths(tmp_path, V):
    """A uint16 shard and a uint32 shard in one glob, read into a window of 2
    bytes a token (V <= 65536: the uint32 shard is narrowed) or 4 (widened)."""
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 1000, 2100), rng.integers(0, 1000, 5000)
    datafile.write_shard(tmp_path / "m_000000.bin", a)
    datafile.write_shard(tmp_path / "m_000001.bin", b, version=7)
    for B, T in ((2, 32), (2, 1024)):  # 2 x 1024 + 1 tokens: several of the loader's 4 KiB conversion pieces
        assert read_batches(tmp_path / "m_*.bin", B, T, V) == expected_batches([a, b], B, T)


@pytest.mark.parametrize("V, bad, version", [(BIG_V, BIG_V, 7), (1000, 65536 + 5, 7), (1000, 1000, 1)])
def test_c_loader_refuses_tokens_beyond_the_vocabulary(tmp_path, V, bad, version):
    """65541 with V = 1000 is refused, not narrowed to the valid 5."""
    toks = np.random.default_rng(3).integers(0, min(V, 1000), 400)
    toks[123] = bad
    datafile.write_shard(tmp_path / "s.bin", toks, version=version)
    res = run([binary("build/read_data"), "shards", tmp_path / "s.bin", 1, 8, V])
    assert res.returncode != 0
    assert f"s.bin: token {bad} at position 123 is out of range for vocabulary size {V}" in res.stderr, res.stderr


# --- the CPU trainer with V = 70,000 ----------------------------------------------------------

L, C, NH, NPOS = 1, 16, 2, 16


def big_vocab_model(tmp_path):
    """A random GPT-2 of vocabulary 70,000 in Hugging Face's layout, imported with
    hf_gpt2.py; its state dict for the numpy forward."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors is not installed (dev/data/requirements.txt)")
    rng = np.random.default_rng(4)

    def w(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    s = {"wte.weight": w(BIG_V, C, scale=0.5), "wpe.weight": w(NPOS, C), "ln_f.weight": 1 + w(C), "ln_f.bias": w(C)}
    for i in range(L):
        s.update({f"h.{i}.ln_1.weight": 1 + w(C), f"h.{i}.ln_1.bias": w(C),
                  f"h.{i}.attn.c_attn.weight": w(C, 3 * C, scale=0.3), f"h.{i}.attn.c_attn.bias": w(3 * C),
                  f"h.{i}.attn.c_proj.weight": w(C, C), f"h.{i}.attn.c_proj.bias": w(C),
                  f"h.{i}.ln_2.weight": 1 + w(C), f"h.{i}.ln_2.bias": w(C),
                  f"h.{i}.mlp.c_fc.weight": w(C, 4 * C), f"h.{i}.mlp.c_fc.bias": w(4 * C),
                  f"h.{i}.mlp.c_proj.weight": w(4 * C, C), f"h.{i}.mlp.c_proj.bias": w(C)})
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {"model_type": "gpt2", "n_layer": L, "n_head": NH, "n_embd": C, "n_positions": NPOS, "vocab_size": BIG_V,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0}  # training below: no dropout
    (hf / "config.json").write_text(json.dumps(config))
    safetensors_numpy.save_file(s, str(hf / "model.safetensors"))
    res = run([sys.executable, REPO / "dev/data/hf_gpt2.py", "import", hf, tmp_path / "m.bin"])
    assert res.returncode == 0, res.stderr
    return tmp_path / "m.bin", s


def gpt2_logprobs(state, inputs):
    import test_hf_gpt2 as ref
    saved = ref.L, ref.C, ref.NH
    ref.L, ref.C, ref.NH = L, C, NH  # the reference forward reads the shape from its module
    try:
        return ref.hf_logprobs(state, inputs)
    finally:
        ref.L, ref.C, ref.NH = saved


def test_cpu_trainer_evaluates_and_trains_on_a_version_7_shard(tmp_path):
    """Every target of --eval-dump is the shard's token (many above 65,535), every
    loss the float64 forward's, every top-1 its argmax; training from the shard's
    first batch reports that batch's loss."""
    model, state = big_vocab_model(tmp_path)
    rng = np.random.default_rng(5)
    toks = rng.integers(0, BIG_V, 4 * NPOS + 1)
    toks[::3] = rng.integers(65_536, BIG_V, len(toks[::3]))
    datafile.write_shard(tmp_path / "val.bin", toks, version=7)
    exe = binary("train_gpt_cpu")
    res = run([exe, "-e", model, "-i", tmp_path / "val.bin", "-j", tmp_path / "val.bin", "-b", 1, "-t", NPOS, "-x", 0,
               "-v", 1, "-m", 4, "-s", 0, "--eval-dump", tmp_path / "dump.bin"], env={"OMP_NUM_THREADS": "1"}, check=True)
    dump = datafile.read_eval_dump(tmp_path / "dump.bin")
    rows = dump["sequences"]
    inputs = toks[:rows * NPOS].reshape(rows, NPOS)
    targets = toks[1:rows * NPOS + 1].reshape(rows, NPOS)
    assert dump["vocab_size"] == BIG_V and np.array_equal(dump["target"], targets)
    logp = gpt2_logprobs(state, inputs)
    want = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    assert np.allclose(dump["loss"], want, rtol=2e-5, atol=0), np.abs(dump["loss"] / want - 1).max()  # fp32 sums of 70,000 exps
    top2 = np.sort(logp, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-3
    assert clear.mean() > 0.9 and np.array_equal(dump["top1"][clear], np.argmax(logp, -1)[clear])
    assert (dump["top1"] >= 65_536).any()  # the top-1 buffer holds ids beyond uint16

    res = run([exe, "-e", model, "-i", tmp_path / "val.bin", "-j", "", "-b", 1, "-t", NPOS, "-x", 2, "-s", 0,
               "-l", "1e-3"], env={"OMP_NUM_THREADS": "1"}, check=True)
    step1 = float(re.search(r"^step +1/2 \| loss ([0-9.]+)", res.stdout, re.M).group(1))
    assert abs(step1 - want[0].mean()) < 1e-5 * want[0].mean(), (step1, want[0].mean())


def test_cpu_trainer_names_the_file_and_position_of_a_token_beyond_the_vocabulary(tmp_path):
    toks = np.random.default_rng(6).integers(0, 64, 300)
    toks[77] = 65_600
    datafile.write_shard(tmp_path / "t.bin", toks, version=7)
    res = run([binary("train_gpt_cpu"), "-e", "d6", "--layers", "1", "--channels", "16", "--heads", "2", "--vocab-size", "64",
               "--max-seq-len", "16", "-i", tmp_path / "t.bin", "-j", "", "-b", "1", "-t", "16", "-x", "1", "-s", "0"])
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "t.bin: token 65600 at position 77 is out of range for vocabulary size 64" in err[0], res.stderr


def test_uint16_and_uint32_shards_train_bit_for_bit_alike(tmp_path):
    """The same tokens in a version-1 and a version-7 shard (the window narrowing
    the latter, V = 64; widening the former, V = 70,000) train to the same bytes."""
    toks = np.random.default_rng(7).integers(0, 64, 2000)
    datafile.write_shard(tmp_path / "v1.bin", toks)
    datafile.write_shard(tmp_path / "v7.bin", toks, version=7)
    for V in (64, BIG_V):
        outs = []
        for shard in ("v1.bin", "v7.bin"):
            out = tmp_path / f"{V}_{shard}"
            run([binary("train_gpt_cpu"), "-e", "d6", "--layers", "1", "--channels", "16", "--heads", "2", "--vocab-size", V,
                 "--max-seq-len", "16", "-i", tmp_path / shard, "-j", tmp_path / shard, "-v", 2, "-b", "2", "-t", "16",
                 "-x", "3", "-s", "0", "-o", out, "--seed", 3], env={"OMP_NUM_THREADS": "1"}, check=True)
            outs.append((out / "model_00000003.bin").read_bytes()[1024:])
        assert outs[0] == outs[1]


def test_prompt_tokens_beyond_uint16_from_a_version_7_shard_and_text(tmp_path):
    """--prompt-tokens reads a version-7 shard (and a text file) with ids above
    65,535; the sample starts with them; an id at V is refused by position."""
    model, _ = big_vocab_model(tmp_path)
    datafile.write_shard(tmp_path / "val.bin", np.random.default_rng(8).integers(0, BIG_V, 4 * NPOS + 1), version=7)
    prompt = [66_000, BIG_V - 1, 5]
    datafile.write_shard(tmp_path / "p.bin", prompt, version=7)
    (tmp_path / "p.txt").write_text(" ".join(map(str, prompt)))
    base = [binary("train_gpt_cpu"), "-e", model, "-i", tmp_path / "val.bin", "-j", "", "-b", 1, "-t", NPOS, "-x", 0, "-s", 1,
            "--temperature", 0, "-g", 4]
    for f in ("p.bin", "p.txt"):
        out = run([*base, "--prompt-tokens", tmp_path / f], env={"OMP_NUM_THREADS": "1"}, check=True).stdout
        sample = re.search(r"^sample at step \d+:\n---\n(.*?)\n---$", out, re.M | re.S).group(1)
        assert [int(x) for x in re.findall(r"<(\d+)>", sample)][:3] == prompt, out
    (tmp_path / "bad.txt").write_text(f"1 2 {BIG_V}")
    res = run([*base, "--prompt-tokens", tmp_path / "bad.txt"])
    assert res.returncode == 1 and f"token {BIG_V} at position 2 is not below the vocabulary size {BIG_V}" in res.stderr, res.stderr


def test_two_processes_on_version_7_shards_match_one(tmp_path):
    """Data parallelism on llama-3 shards (V = 70,000): 2 processes of batch 1 train
    like 1 process of batch 2; with 2 shards each process scans its own share,
    and a token at V in the other process's shard still stops both in one line."""
    import shutil
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found: data parallelism on uint32 shards not checked")
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    rng = np.random.default_rng(9)
    for i in range(2):
        datafile.write_shard(tmp_path / f"t_{i}.bin", rng.integers(0, BIG_V, 600), version=7)
    model = ["-e", "d6", "--layers", "1", "--channels", "16", "--heads", "2", "--vocab-size", BIG_V, "--max-seq-len", "16",
             "-i", tmp_path / "t_*.bin", "-j", "", "-t", 16, "-x", 4, "-s", 0, "-l", "1e-3"]

    def losses(np_, b, check=True):
        res = run(["mpirun", "-np", np_, binary("train_gpt_cpu"), *model, "-b", b], env=env, check=check)
        return res, [float(x) for x in re.findall(r"^step +\d+/\d+ \| loss ([0-9.]+)", res.stdout, re.M)]
    _, one = losses(1, 2)
    _, two = losses(2, 1)
    assert len(one) == 4 and np.allclose(one, two, rtol=1e-5, atol=0), (one, two)
    bad = datafile.read_shard(tmp_path / "t_1.bin").astype(np.int64)
    bad[321] = BIG_V
    datafile.write_shard(tmp_path / "t_1.bin", bad, version=7)
    res, _ = losses(2, 1, check=False)
    assert res.returncode != 0 and f"t_1.bin: token {BIG_V} at position 321 is out of range for vocabulary size {BIG_V}" in res.stderr
