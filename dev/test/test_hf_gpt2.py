"""dev/data/hf_gpt2.py: Hugging Face GPT-2 checkpoints in and out.

The checkpoint is built here in Hugging Face's documented layout (docs/FORMATS.md:
Conv1D weights stored (in, out), c_attn's columns q|k|v, names with or without
`transformer.`, causal-mask buffers, a tied or absent lm_head) and written with
the safetensors package; its loss comes from a float64 numpy forward written
here in that layout, never through the importer. The trainer's validation loss
on the imported file must match it."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, binary, datafile, run

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors is not installed (dev/data/requirements.txt)")

SCRIPT = REPO / "dev" / "data" / "hf_gpt2.py"
L, C, NH, V, NPOS = 2, 32, 4, 200, 32  # V=200 pads to 256
B, T = 2, 32


def hf_state(rng, prefix="transformer.", masks=True, head=True):
    """A random GPT-2 state dict in Hugging Face's layout."""
    def w(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    s = {"wte.weight": w(V, C, scale=0.3), "wpe.weight": w(NPOS, C), "ln_f.weight": 1 + w(C), "ln_f.bias": w(C)}
    for i in range(L):
        s.update({f"h.{i}.ln_1.weight": 1 + w(C), f"h.{i}.ln_1.bias": w(C),
                  f"h.{i}.attn.c_attn.weight": w(C, 3 * C, scale=0.3), f"h.{i}.attn.c_attn.bias": w(3 * C),
                  f"h.{i}.attn.c_proj.weight": w(C, C), f"h.{i}.attn.c_proj.bias": w(C),
                  f"h.{i}.ln_2.weight": 1 + w(C), f"h.{i}.ln_2.bias": w(C),
                  f"h.{i}.mlp.c_fc.weight": w(C, 4 * C), f"h.{i}.mlp.c_fc.bias": w(4 * C),
                  f"h.{i}.mlp.c_proj.weight": w(4 * C, C), f"h.{i}.mlp.c_proj.bias": w(C)})
        if masks:
            s[f"h.{i}.attn.bias"] = np.tril(np.ones((NPOS, NPOS), np.float32))[None, None]
            s[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    out = {prefix + k: v for k, v in s.items()}
    if head:
        out["lm_head.weight"] = s["wte.weight"].copy()
    return out


HF_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": L, "n_head": NH, "n_embd": C,
             "n_positions": NPOS, "n_ctx": NPOS, "vocab_size": V, "layer_norm_epsilon": 1e-5,
             "activation_function": "gelu_new", "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1}


def write_hf(path, state, config=HF_CONFIG):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    safetensors_numpy.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def hf_logprobs(state, inputs):
    """float64 GPT-2 forward in Hugging Face's layout (y = x @ W + b with W (in, out)):
    log-probabilities (B, T, V) of the next token at every position."""
    g = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in state.items()}
    hs = C // NH

    def ln(x, name):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(v + 1e-5) * g[name + ".weight"] + g[name + ".bias"]

    def conv1d(x, name):
        return x @ g[name + ".weight"] + g[name + ".bias"]

    n = inputs.shape[1]
    x = g["wte.weight"][inputs] + g["wpe.weight"][:n]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(L):
        q, k, v = np.split(conv1d(ln(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn"), 3, axis=-1)
        q, k, v = (a.reshape(*a.shape[:2], NH, hs).transpose(0, 2, 1, 3) for a in (q, k, v))
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        y = (p / p.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = x + conv1d(y, f"h.{i}.attn.c_proj")
        h = conv1d(ln(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        x = x + conv1d(h, f"h.{i}.mlp.c_proj")
    logits = ln(x, "ln_f") @ g["wte.weight"].T
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def hf_token_losses(state, inputs, targets):
    return -np.take_along_axis(hf_logprobs(state, inputs), targets[..., None], -1)[..., 0]


def hf_loss(state, inputs, targets):
    return hf_token_losses(state, inputs, targets).mean()


def hf_tool(*args):
    return run([sys.executable, SCRIPT, *args])


def val_loss(model, shard, t=T):
    res = run([binary("train_gpt_cpu"), "-e", model, "-i", shard, "-j", shard, "-b", B, "-t", t, "-x", "0", "-v", "1",
               "-m", "1", "-s", "0"], check=True)
    return float(re.search(r"^val loss ([0-9.]+) at step 0", res.stdout, re.M).group(1))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "val.bin"
    toks = np.random.default_rng(3).integers(0, V, B * 64 + 1)
    datafile.write_shard(path, toks)
    return path, toks


@pytest.mark.parametrize("variant", ["prefixed+masks+head", "bare"])
def test_import_matches_independent_hf_forward(tmp_path, tokens, variant):
    shard, toks = tokens
    state = hf_state(np.random.default_rng(7), **({} if variant != "bare" else dict(prefix="", masks=False, head=False)))
    hf = write_hf(tmp_path / "hf", state)
    res = hf_tool("import", hf, tmp_path / "m.bin")
    assert res.returncode == 0, res.stderr
    header = np.fromfile(tmp_path / "m.bin", dtype="<i4", count=8)
    assert list(header) == [20240326, 3, NPOS, V, L, NH, C, 256]
    expected = hf_loss(state, toks[:B * T].reshape(B, T), toks[1:B * T + 1].reshape(B, T))
    got = val_loss(tmp_path / "m.bin", shard)
    assert abs(got - expected) < 2e-6 * expected + 1e-6, (got, expected)


def test_prefix_and_buffers_do_not_change_the_file(tmp_path):
    state = hf_state(np.random.default_rng(8))
    bare = {k.removeprefix("transformer."): v for k, v in state.items() if not re.search(r"\.attn\.(bias|masked_bias)$", k)}
    del bare["lm_head.weight"]
    for name, s in (("a", state), ("b", bare)):
        assert hf_tool("import", write_hf(tmp_path / name, s), tmp_path / f"{name}.bin").returncode == 0
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_then_import_gives_the_identical_file(tmp_path, dtype):
    hf = write_hf(tmp_path / "hf", hf_state(np.random.default_rng(9)))
    assert hf_tool("import", hf, tmp_path / "a.bin", "--dtype", dtype).returncode == 0
    res = hf_tool("export", tmp_path / "a.bin", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["n_positions"], config["vocab_size"], config["n_layer"], config["n_embd"]) == (NPOS, V, L, C)
    exported = safetensors_numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported["transformer.wte.weight"].shape == (V, C)  # the true vocabulary, padding dropped
    assert exported["transformer.h.0.mlp.c_fc.weight"].shape == (C, 4 * C)  # Conv1D: (in, out)
    assert hf_tool("import", tmp_path / "out", tmp_path / "b.bin", "--dtype", dtype).returncode == 0
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_extended_position_table_is_exported(tmp_path, tokens):
    """A model whose table was extended by the trainer exports n_positions = the new length."""
    shard, _ = tokens
    hf = write_hf(tmp_path / "hf", hf_state(np.random.default_rng(10)))
    assert hf_tool("import", hf, tmp_path / "a.bin").returncode == 0
    run([binary("train_gpt_cpu"), "-e", tmp_path / "a.bin", "--max-seq-len", 64, "--wpe-init", "tile", "-i", shard, "-j", "", "-b", 1,
         "-t", 64, "-x", 1, "-l", 0, "-s", 0, "-o", tmp_path / "long"], check=True)
    assert hf_tool("export", tmp_path / "long" / "model_00000001.bin", tmp_path / "out").returncode == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["n_positions"] == 64
    wpe = safetensors_numpy.load_file(str(tmp_path / "out" / "model.safetensors"))["transformer.wpe.weight"]
    assert wpe.shape == (64, C)


@pytest.mark.parametrize("case", ["missing", "misshaped", "untied", "extra", "config"])
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, case):
    state = hf_state(np.random.default_rng(11))
    config = dict(HF_CONFIG)
    expect = {"missing": "h.1.mlp.c_fc.bias", "misshaped": "transformer.h.0.attn.c_attn.weight",
              "untied": "lm_head.weight", "extra": "transformer.h.0.crossattention.q_attn.weight",
              "config": "activation_function"}[case]
    if case == "missing":
        del state["transformer.h.1.mlp.c_fc.bias"]
    elif case == "misshaped":
        state["transformer.h.0.attn.c_attn.weight"] = state["transformer.h.0.attn.c_attn.weight"].T.copy()
    elif case == "untied":
        state["lm_head.weight"] = state["lm_head.weight"] + 1
    elif case == "extra":
        state[expect] = np.zeros((C, C), np.float32)
    else:
        config["activation_function"] = "relu"
    res = hf_tool("import", write_hf(tmp_path / "hf", state, config), tmp_path / "m.bin")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], res.stderr
    assert not (tmp_path / "m.bin").exists() and not (tmp_path / "m.bin.tmp").exists()


def torch_or_skip():
    try:
        import torch
    except ImportError as exc:
        pytest.skip(f"PyTorch is not installed ({exc}); the torch-side checks are optional")
    torch.set_num_threads(1)
    return torch


def test_pytorch_model_bin_reads_like_safetensors(tmp_path):
    torch = torch_or_skip()
    state = hf_state(np.random.default_rng(12))
    write_hf(tmp_path / "st", state)
    (tmp_path / "pt").mkdir()
    (tmp_path / "pt" / "config.json").write_text(json.dumps(HF_CONFIG))
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, tmp_path / "pt" / "pytorch_model.bin")
    for name in ("st", "pt"):
        res = hf_tool("import", tmp_path / name, tmp_path / f"{name}.bin")
        assert res.returncode == 0, res.stderr
    assert (tmp_path / "st.bin").read_bytes() == (tmp_path / "pt.bin").read_bytes()


def test_transformers_loads_the_export_with_the_same_loss(tmp_path, tokens):
    torch = torch_or_skip()
    try:
        from transformers import GPT2LMHeadModel
    except ImportError as exc:
        pytest.skip(f"transformers is not installed ({exc}); this check is optional")
    shard, toks = tokens
    hf = write_hf(tmp_path / "hf", hf_state(np.random.default_rng(13)))
    assert hf_tool("import", hf, tmp_path / "a.bin").returncode == 0
    # extend the table to 64 rows, so the export's n_positions is one Hugging Face never made
    run([binary("train_gpt_cpu"), "-e", tmp_path / "a.bin", "--max-seq-len", 64, "--wpe-init", "interpolate",
         "-i", shard, "-j", "", "-b", B, "-t", 64, "-x", 1, "-l", 1e-3, "-s", 0, "-o", tmp_path / "long"], check=True)
    model_file = tmp_path / "long" / "model_00000001.bin"
    assert hf_tool("export", model_file, tmp_path / "out").returncode == 0
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ids = torch.from_numpy(toks[:B * 64 + 1].astype(np.int64))
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:-1].view(B, 64)).logits.double(), -1)
        theirs = -logp.gather(-1, ids[1:].view(B, 64, 1)).mean().item()
    ours = val_loss(model_file, shard, t=64)
    assert abs(ours - theirs) < 1e-5 * theirs, (ours, theirs)


@pytest.mark.parametrize("safe", [True, False], ids=["model.safetensors", "pytorch_model.bin"])
def test_a_checkpoint_saved_by_transformers_imports_with_its_loss(tmp_path, tokens, safe):
    """The checkpoint made outside the project: transformers' own save_pretrained."""
    torch = torch_or_skip()
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        pytest.skip(f"transformers is not installed ({exc}); this check is optional")
    shard, toks = tokens
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=L, n_head=NH, n_embd=C, n_positions=NPOS, vocab_size=V,
                                       initializer_range=0.2)).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=safe)
    res = hf_tool("import", tmp_path / "hf", tmp_path / "m.bin")
    assert res.returncode == 0, res.stderr
    ids = torch.from_numpy(toks[:B * T + 1].astype(np.int64))
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:-1].view(B, T)).logits.double(), -1)
        theirs = -logp.gather(-1, ids[1:].view(B, T, 1)).mean().item()
    ours = val_loss(tmp_path / "m.bin", shard)
    assert abs(ours - theirs) < 1e-5 * theirs, (ours, theirs)


def test_import_carries_the_configs_dropout(tmp_path, tokens):
    """attn_pdrop, embd_pdrop, resid_pdrop go into header slots 242-244 (absent:
    GPT2Config's 0.1); the trainer trains with them unless a flag overrides one,
    says where each came from, and evaluates without them; export writes them back."""
    shard, toks = tokens
    state = hf_state(np.random.default_rng(14))
    config = {k: v for k, v in HF_CONFIG.items() if k != "embd_pdrop"}
    config.update(attn_pdrop=0.25, resid_pdrop=0.0)
    assert hf_tool("import", write_hf(tmp_path / "hf", state, config), tmp_path / "m.bin").returncode == 0
    slots = np.fromfile(tmp_path / "m.bin", dtype="<f4", count=256)[242:245]
    assert list(slots) == [np.float32(0.1), np.float32(0.25), np.float32(0.0)]
    train = [binary("train_gpt_cpu"), "-e", tmp_path / "m.bin", "-i", shard, "-j", shard, "-b", B, "-t", T, "-x", "1",
             "-v", "1", "-m", "1", "-s", "0", "-l", "1e-3"]
    res = run([*train, "--embd-dropout", "0.05"], check=True)
    assert f"dropout: embedding 0.05 (--embd-dropout), attention 0.25 (attn_pdrop of {tmp_path / 'm.bin'}), residual 0 " \
           f"(default)" in res.stdout
    expected = hf_loss(state, toks[:B * T].reshape(B, T), toks[1:B * T + 1].reshape(B, T))
    assert abs(val_loss(tmp_path / "m.bin", shard) - expected) < 2e-6 * expected + 1e-6  # evaluation never drops
    assert hf_tool("export", tmp_path / "m.bin", tmp_path / "out").returncode == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["embd_pdrop"], exported["attn_pdrop"], exported["resid_pdrop"]) == (0.1, 0.25, 0.0)


@pytest.mark.parametrize("value", [1.0, -0.1, "0.1", True])
def test_bad_dropout_in_config_is_refused(tmp_path, value):
    config = dict(HF_CONFIG, attn_pdrop=value)
    res = hf_tool("import", write_hf(tmp_path / "hf", hf_state(np.random.default_rng(15)), config), tmp_path / "m.bin")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "attn_pdrop" in lines[0], res.stderr
    assert not (tmp_path / "m.bin").exists()


def test_a_model_file_with_a_bad_dropout_slot_is_refused(tmp_path, tokens):
    shard, _ = tokens
    assert hf_tool("import", write_hf(tmp_path / "hf", hf_state(np.random.default_rng(16))), tmp_path / "m.bin").returncode == 0
    data = bytearray((tmp_path / "m.bin").read_bytes())
    data[4 * 244:4 * 245] = np.float32(1.5).tobytes()
    (tmp_path / "bad.bin").write_bytes(bytes(data))
    res = run([binary("train_gpt_cpu"), "-e", tmp_path / "bad.bin", "-i", shard, "-j", "", "-b", B, "-t", T, "-x", "1"])
    assert res.returncode == 1
    assert res.stderr.strip() == (f"error: {tmp_path / 'bad.bin'}: header slot 244 (resid_pdrop) is 1.5: not a dropout "
                                  "probability in [0, 0.99]")


# ---- hostile checkpoints: one line naming what and why, and no model file ----

def assert_refused(res, out, *needles):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], res.stderr
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()


@pytest.mark.parametrize("tensor, index, value", [("transformer.h.1.attn.c_attn.weight", (3, 17), np.nan),
                                                  ("transformer.wpe.weight", (31, 0), np.inf),
                                                  ("transformer.ln_f.bias", (5,), -np.inf)])
def test_non_finite_weights_are_refused_naming_tensor_and_index(tmp_path, tensor, index, value):
    state = hf_state(np.random.default_rng(17))
    state[tensor][index] = value
    res = hf_tool("import", write_hf(tmp_path / "hf", state), tmp_path / "m.bin")
    assert_refused(res, tmp_path / "m.bin", f"{tensor}[{', '.join(map(str, index))}]", "not finite")


def test_float64_beyond_float32_range_is_refused(tmp_path):
    state = hf_state(np.random.default_rng(18))
    state["transformer.h.0.mlp.c_fc.bias"] = state["transformer.h.0.mlp.c_fc.bias"].astype(np.float64)
    state["transformer.h.0.mlp.c_fc.bias"][7] = 1e300  # finite in F64, inf once stored as float32
    res = hf_tool("import", write_hf(tmp_path / "hf", state), tmp_path / "m.bin")
    assert_refused(res, tmp_path / "m.bin", "transformer.h.0.mlp.c_fc.bias[7]", "not finite")


def safetensors_parts(state):
    """(header dict, data section) of a genuine safetensors file, split by the
    documented layout: 8-byte little-endian header length, JSON header, data."""
    raw = safetensors_numpy.save(state, metadata={"format": "pt"})
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw_safetensors(path, header, data=b"", length=None):
    h = json.dumps(header).encode()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    (path / "model.safetensors").write_bytes((len(h) if length is None else length).to_bytes(8, "little") + h + data)
    return path


def hostile_safetensors(tmp_path, case):
    """An HF directory whose model.safetensors is damaged as `case` says, and
    what the one-line error must name."""
    header, data = safetensors_parts(hf_state(np.random.default_rng(19)))
    name = "transformer.ln_f.bias"
    begin, end = header[name]["data_offsets"]
    if case == "empty file":
        path = write_raw_safetensors(tmp_path / "hf", {})
        (path / "model.safetensors").write_bytes(b"")
        return path, ("model.safetensors", "0 bytes")
    if case == "header is a list":
        return write_raw_safetensors(tmp_path / "hf", [header[name]], data), ("header", "list")
    if case == "entry is a string":
        header[name] = "F32"
        return write_raw_safetensors(tmp_path / "hf", header, data), (name, "str")
    if case == "no data_offsets":
        del header[name]["data_offsets"]
        return write_raw_safetensors(tmp_path / "hf", header, data), (name, "data_offsets")
    if case == "negative shape":
        header[name]["shape"] = [-C, -1]  # the product (C) matches the offsets
        return write_raw_safetensors(tmp_path / "hf", header, data), (name, "shape", f"-{C}")
    if case == "negative offsets":
        # the same byte count, but before the data section: the header's own bytes
        header[name]["data_offsets"] = [begin - end, 0]
        return write_raw_safetensors(tmp_path / "hf", header, data), (name, "data_offsets", f"{begin - end}..0")
    if case == "offsets past the end":
        header[name]["data_offsets"] = [len(data) - (end - begin) + 4, len(data) + 4]
        return write_raw_safetensors(tmp_path / "hf", header, data), (name, "data_offsets")
    if case == "offsets reversed":
        header[name]["data_offsets"] = [end, begin]
        return write_raw_safetensors(tmp_path / "hf", header, data), (name, "data_offsets")
    if case == "boolean offsets":
        header[name]["data_offsets"] = [False, True]
        return write_raw_safetensors(tmp_path / "hf", header, data), (name, "data_offsets")
    if case == "header length past the end":
        return write_raw_safetensors(tmp_path / "hf", header, data, length=10**9), ("header length",)
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["empty file", "header is a list", "entry is a string", "no data_offsets",
                                  "negative shape", "negative offsets", "offsets past the end", "offsets reversed",
                                  "boolean offsets", "header length past the end"])
def test_damaged_safetensors_are_refused_in_one_line(tmp_path, case):
    hf, needles = hostile_safetensors(tmp_path, case)
    res = hf_tool("import", hf, tmp_path / "m.bin")
    assert_refused(res, tmp_path / "m.bin", *needles)


@pytest.mark.parametrize("config, needles", [([1, 2], ("config.json", "list")),
                                             (dict(HF_CONFIG, n_positions=True), ("n_positions", "True")),
                                             (dict(HF_CONFIG, n_layer=2.0), ("n_layer",)),
                                             ({k: v for k, v in HF_CONFIG.items() if k != "n_embd"}, ("n_embd", "missing")),
                                             (dict(HF_CONFIG, layer_norm_epsilon="1e-5"), ("layer_norm_epsilon",))])
def test_bad_configs_are_refused_in_one_line(tmp_path, config, needles):
    res = hf_tool("import", write_hf(tmp_path / "hf", hf_state(np.random.default_rng(20)), config), tmp_path / "m.bin")
    assert_refused(res, tmp_path / "m.bin", *needles)


def test_import_to_a_directory_and_export_to_a_file_are_refused(tmp_path):
    hf = write_hf(tmp_path / "hf", hf_state(np.random.default_rng(21)))
    (tmp_path / "dir").mkdir()
    res = hf_tool("import", hf, tmp_path / "dir")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and str(tmp_path / "dir") in lines[0] and "directory" in lines[0]
    assert list((tmp_path / "dir").iterdir()) == [] and not (tmp_path / "dir.tmp").exists()
    assert hf_tool("import", hf, tmp_path / "m.bin").returncode == 0
    (tmp_path / "file").write_text("keep me")
    for target in (tmp_path / "file", tmp_path / "file" / "sub"):
        res = hf_tool("export", tmp_path / "m.bin", target)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1 and str(target) in lines[0], res.stderr
    assert (tmp_path / "file").read_text() == "keep me"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_honours_the_umask(tmp_path, umask):
    assert hf_tool("import", write_hf(tmp_path / "hf", hf_state(np.random.default_rng(22))), tmp_path / "m.bin").returncode == 0
    res = subprocess.run([sys.executable, SCRIPT, "export", tmp_path / "m.bin", tmp_path / "out"], capture_output=True,
                         text=True, preexec_fn=lambda: os.umask(umask))
    assert res.returncode == 0, res.stderr
    for name in ("model.safetensors", "config.json"):
        assert oct((tmp_path / "out" / name).stat().st_mode & 0o777) == oct(0o666 & ~umask), name


@pytest.mark.parametrize("eot, flags", [(0, ["--eod-mask-loss"]), (17, ["--reset-attention-mask", "--reset-position-ids"]),
                                        (None, [])])
def test_export_writes_the_runs_end_of_text_token(tmp_path, tokens, eot, flags):
    """bos/eos in config.json are the end-of-text token the run trained with
    (its --eot-token, which the state file beside model_N.bin records), not
    V - 1; without document flags the run has none and V - 1 is said to be a
    guess; --eot-token N of the export wins; a model whose state is of
    another run (copied in) does not lend it its token."""
    shard, _ = tokens
    hf = write_hf(tmp_path / "hf", hf_state(np.random.default_rng(11)))
    assert hf_tool("import", hf, tmp_path / "a.bin").returncode == 0
    run([binary("train_gpt_cpu"), "-e", tmp_path / "a.bin", "-i", shard, "-j", "", "-b", 1, "-t", T, "-x", 1, "-s", 0, "-o",
         tmp_path / "run", *flags, *(["--eot-token", eot] if eot is not None else [])], check=True)
    model = tmp_path / "run" / "model_00000001.bin"
    res = hf_tool("export", model, tmp_path / "out")
    assert res.returncode == 0, res.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    want = eot if eot is not None else V - 1
    assert config["bos_token_id"] == config["eos_token_id"] == want, config
    assert f"bos/eos token {want}: " + ("--eot-token of the run, from state_00000001_00000.bin" if eot is not None else "V - 1")\
        in res.stdout, res.stdout
    res = hf_tool("export", model, tmp_path / "out2", "--eot-token", "5")
    assert res.returncode == 0 and json.loads((tmp_path / "out2" / "config.json").read_text())["eos_token_id"] == 5
    bad = hf_tool("export", model, tmp_path / "out3", "--eot-token", str(V))
    assert bad.returncode != 0 and f"--eot-token {V} is not a token of the model's vocabulary ({V})" in bad.stderr
    # the same file copied beside another run's state: the state is not its run's, so it says nothing
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_00000001.bin").write_bytes(model.read_bytes())
    state = bytearray((tmp_path / "run" / "state_00000001_00000.bin").read_bytes())
    state[88:96] = (int.from_bytes(state[88:96], "little") ^ 1).to_bytes(8, "little")  # another run id (slots 22-23)
    (other / "state_00000001_00000.bin").write_bytes(bytes(state))
    assert hf_tool("export", other / "model_00000001.bin", tmp_path / "out4").returncode == 0
    assert json.loads((tmp_path / "out4" / "config.json").read_text())["eos_token_id"] == V - 1
