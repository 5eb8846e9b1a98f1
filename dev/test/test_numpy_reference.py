"""The CPU reference's model against an independent float64 numpy GPT-2
written here from docs/FORMATS.md's description: same model file, same tokens,
same loss. Also: a version-5 (bf16) model file loads into the fp32 trainer."""
import re

import numpy as np

from conftest import binary, datafile, run

C, L, NH, V, MAXT = 32, 2, 4, 64, 32
VP = 128


def read_model(path):
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    assert list(header[:8]) == [20240326, 3, MAXT, V, L, NH, C, VP]
    flat = np.frombuffer(raw[1024:], dtype=np.float32).astype(np.float64)
    shapes = [(VP, C), (MAXT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C), (L, C), (L, C),
              (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C), (C,), (C,)]
    names = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb",
             "fcprojw", "fcprojb", "lnfw", "lnfb"]
    params, off = {}, 0
    for name, shape in zip(names, shapes):
        n = int(np.prod(shape))
        params[name] = flat[off:off + n].reshape(shape)
        off += n
    assert off == len(flat)
    return params


def layernorm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def gpt2_loss(p, inputs, targets):
    B, T = inputs.shape
    hs = C // NH
    x = p["wte"][inputs] + p["wpe"][:T]
    mask = np.tril(np.ones((T, T), dtype=bool))
    for l in range(L):
        h = layernorm(x, p["ln1w"][l], p["ln1b"][l])
        qkv = h @ p["qkvw"][l].T + p["qkvb"][l]
        q, k, v = np.split(qkv, 3, axis=-1)
        q, k, v = (a.reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs)
        att = np.where(mask, att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ p["attprojw"][l].T + p["attprojb"][l]
        h = layernorm(x, p["ln2w"][l], p["ln2b"][l])
        x = x + gelu(h @ p["fcw"][l].T + p["fcb"][l]) @ p["fcprojw"][l].T + p["fcprojb"][l]
    x = layernorm(x, p["lnfw"], p["lnfb"])
    logits = (x @ p["wte"].T)[..., :V]  # softmax over the real vocabulary only
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()


MODEL = ["-e", "d6", "--layers", str(L), "--channels", str(C), "--heads", str(NH), "--vocab-size", str(V),
         "--max-seq-len", str(MAXT)]


def first_loss(stdout):
    return float(re.search(r"^step +1/\d+ \| loss ([0-9.]+)", stdout, re.M).group(1))


def test_loss_matches_independent_numpy_gpt2(tmp_path):
    rng = np.random.default_rng(21)
    tokens = rng.integers(0, V, 3 * 32 + 1)
    datafile.write_shard(tmp_path / "t.bin", tokens)
    # train two steps so the checked parameters are not at their init (LayerNorm != 1/0, biases != 0)
    run([binary("train_gpt_cpu"), *MODEL, "-i", tmp_path / "t.bin", "-j", "", "-b", "3", "-t", "32", "-x", "2",
         "-s", "0", "-l", "1e-2", "-o", tmp_path / "ck"], check=True)
    model = tmp_path / "ck" / "model_00000002.bin"
    res = run([binary("train_gpt_cpu"), "-e", model, "-i", tmp_path / "t.bin", "-j", "", "-b", "3", "-t", "32",
               "-x", "1", "-s", "0"], check=True)
    inputs = tokens[:96].reshape(3, 32)
    targets = tokens[1:97].reshape(3, 32)
    expected = gpt2_loss(read_model(model), inputs, targets)
    assert abs(first_loss(res.stdout) - expected) < 2e-6 * expected, (first_loss(res.stdout), expected)


def test_bf16_model_file_loads(tmp_path):
    rng = np.random.default_rng(22)
    tokens = rng.integers(0, V, 2 * 32 + 1)
    datafile.write_shard(tmp_path / "t.bin", tokens)
    run([binary("train_gpt_cpu"), *MODEL, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "32", "-x", "1",
         "-s", "0", "-o", tmp_path / "ck"], check=True)
    raw = (tmp_path / "ck" / "model_00000001.bin").read_bytes()
    f32 = np.frombuffer(raw[1024:], dtype=np.float32)
    bits = f32.view(np.uint32).astype(np.uint64)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    header = np.frombuffer(raw[:1024], dtype=np.int32).copy()
    header[1] = 5
    (tmp_path / "m5.bin").write_bytes(header.tobytes() + bf16.tobytes())
    widened = (bf16.astype(np.uint32) << 16).view(np.float32)  # the same values as fp32
    header[1] = 3
    (tmp_path / "m3.bin").write_bytes(header.tobytes() + widened.tobytes())
    losses = []
    for name in ["m5.bin", "m3.bin"]:
        res = run([binary("train_gpt_cpu"), "-e", tmp_path / name, "-i", tmp_path / "t.bin", "-j", "", "-b", "2",
                   "-t", "32", "-x", "1", "-s", "0"], check=True)
        assert "(version " + name[1] + ")" in res.stdout
        losses.append(first_loss(res.stdout))
    assert losses[0] == losses[1]
    # and both are the loss of those weights, computed independently
    expected = gpt2_loss(read_model(tmp_path / "m3.bin"), tokens[:64].reshape(2, 32), tokens[1:65].reshape(2, 32))
    assert abs(losses[0] - expected) < 2e-6 * expected, (losses[0], expected)
