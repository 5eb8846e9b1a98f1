"""dev/data/hf_llama.py and dev/data/model_config.py: Llama and Qwen2 checkpoints in
Hugging Face's layout, in and out of the configurable family's model files
(versions 7 and 8, /work/tools/llama_format.md in docs/FORMATS.md).

The checkpoints are made here, in Hugging Face's documented layout (q_proj,
k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, (out, in) weights,
`model.` names, lm_head, config.json), written with the safetensors package (BF16
by the few lines of `write_bf16_safetensors`: numpy has no bfloat16). The model
file is checked against the format slot by slot and tensor by tensor with struct
and offsets computed here, never through model_config; the export is read back
with the safetensors package and compared bit for bit with what the test wrote."""
import json
import math
import struct
import sys

import numpy as np
import pytest

from conftest import REPO, datafile, run

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors is not installed (dev/data/requirements.txt)")

SCRIPT = REPO / "dev" / "data" / "hf_llama.py"
sys.path.insert(0, str(REPO / "dev" / "data"))
import model_config as mc  # noqa: E402

L, C, NH, NKV, HD, F, V = 2, 32, 4, 2, 12, 40, 300  # NH x HD = 48 != C; V pads to 384


def llama_config(**over):
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": C,
         "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV,
         "head_dim": HD, "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    c.update(over)
    return c


def qwen2_config(**over):
    c = llama_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6,
                     use_sliding_window=False, sliding_window=4096, max_window_layers=L, tie_word_embeddings=True)
    for k in ("attention_bias", "mlp_bias"):
        del c[k]
    c.update(over)
    return c


def hf_state(config, rng, dtype=np.float32):
    """A random state dict in LlamaForCausalLM's / Qwen2ForCausalLM's names and shapes."""
    hd = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    nh, nkv, c, f, v = config["num_attention_heads"], config.get("num_key_value_heads"), config["hidden_size"], \
        config["intermediate_size"], config["vocab_size"]
    qwen = config["model_type"] == "qwen2"
    attn_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(dtype)
    s = {"model.embed_tokens.weight": w(v, c), "model.norm.weight": 1 + w(c)}
    if not config["tie_word_embeddings"]:
        s["lm_head.weight"] = w(v, c)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s.update({p + "input_layernorm.weight": 1 + w(c), p + "post_attention_layernorm.weight": 1 + w(c),
                  p + "self_attn.q_proj.weight": w(nh * hd, c), p + "self_attn.k_proj.weight": w(nkv * hd, c),
                  p + "self_attn.v_proj.weight": w(nkv * hd, c), p + "self_attn.o_proj.weight": w(c, nh * hd),
                  p + "mlp.gate_proj.weight": w(f, c), p + "mlp.up_proj.weight": w(f, c), p + "mlp.down_proj.weight": w(c, f)})
        if qwen or attn_bias:
            s.update({p + "self_attn.q_proj.bias": w(nh * hd), p + "self_attn.k_proj.bias": w(nkv * hd),
                      p + "self_attn.v_proj.bias": w(nkv * hd)})
        if attn_bias:
            s[p + "self_attn.o_proj.bias"] = w(c)
        if mlp_bias:
            s.update({p + "mlp.gate_proj.bias": w(f), p + "mlp.up_proj.bias": w(f), p + "mlp.down_proj.bias": w(c)})
    return s


def bf16_state(state, rng):
    """The state as bf16 bit patterns (uint16), each a finite bf16 value near the original."""
    return {k: (v.astype("<f4").view("<u4") >> 16).astype("<u2") for k, v in state.items()}


def write_bf16_safetensors(path, bits):
    """safetensors with BF16 tensors from uint16 bit patterns: 8-byte header length, JSON, data."""
    header, blobs, off = {}, [], 0
    for name, a in bits.items():
        blob = np.ascontiguousarray(a, "<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors_raw(path):
    """{name: (dtype, shape, bytes)} of a safetensors file, parsed here."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return {k: (v["dtype"], tuple(v["shape"]), raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def write_hf(path, config, state, shards=1, bf16_bits=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = list(bf16_bits or state)
    if shards == 1:
        if bf16_bits:
            write_bf16_safetensors(path / "model.safetensors", bf16_bits)
        else:
            safetensors_numpy.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        if bf16_bits:
            write_bf16_safetensors(path / fname, {n: bf16_bits[n] for n in part})
        else:
            safetensors_numpy.save_file({n: state[n] for n in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def tool(*args):
    return run([sys.executable, SCRIPT, *args])


def ok(res):
    assert res.returncode == 0, res.stderr
    return res


def one_line_error(res, *needles):
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def f32_bits(x):
    return struct.unpack("<i", struct.pack("<f", x))[0]


def expected_file_tensors(config, state):
    """The file's tensors in the order of the format (docs/FORMATS.md), built here from
    Hugging Face's: [(name, float32 array)]."""
    c, v = config["hidden_size"], config["vocab_size"]
    vp = (v + 127) // 128 * 128
    qwen = config["model_type"] == "qwen2"
    layers = range(config["num_hidden_layers"])

    def stack(*names):
        return np.stack([np.concatenate([state[f"model.layers.{i}.{n}"] for n in names]) for i in layers])

    def padded(a):
        return np.concatenate([a, np.zeros((vp - v, c), np.float32)])
    out = [("wte", padded(state["model.embed_tokens.weight"])), ("ln1w", stack("input_layernorm.weight")),
           ("qkvw", stack("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))]
    if qwen or config.get("attention_bias"):
        out.append(("qkvb", stack("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")))
    out.append(("attprojw", stack("self_attn.o_proj.weight")))
    if config.get("attention_bias"):
        out.append(("attprojb", stack("self_attn.o_proj.bias")))
    out += [("ln2w", stack("post_attention_layernorm.weight")), ("fcw", stack("mlp.gate_proj.weight", "mlp.up_proj.weight"))]
    if config.get("mlp_bias"):
        out.append(("fcb", stack("mlp.gate_proj.bias", "mlp.up_proj.bias")))
    out.append(("fcprojw", stack("mlp.down_proj.weight")))
    if config.get("mlp_bias"):
        out.append(("fcprojb", stack("mlp.down_proj.bias")))
    out.append(("lnfw", state["model.norm.weight"]))
    if not config["tie_word_embeddings"]:
        out.append(("lm_head", padded(state["lm_head.weight"])))
    return out


def check_model_file(path, config, state, version=7):
    """Header slots and every tensor's bytes against the format, computed here."""
    raw = path.read_bytes()
    h = struct.unpack("<256i", raw[:1024])
    v, c = config["vocab_size"], config["hidden_size"]
    nh = config["num_attention_heads"]
    qwen = config["model_type"] == "qwen2"
    biases = 1 if qwen else 3 * bool(config.get("attention_bias")) + 4 * bool(config.get("mlp_bias"))
    assert h[:12] == (20240326, version, config["max_position_embeddings"], v, config["num_hidden_layers"], nh, c,
                      (v + 127) // 128 * 128, 3 if qwen else 2, config.get("num_key_value_heads", nh),
                      config.get("head_dim", c // nh), config["intermediate_size"])
    assert h[12] == 1 and h[13] == f32_bits(config["rms_norm_eps"]) and h[14] == 1 and h[22] == 1
    assert h[23] == biases and h[24] == int(config["tie_word_embeddings"])
    assert h[25:28] == (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"])
    tensors = expected_file_tensors(config, state)
    body = np.concatenate([a.astype(np.float32).ravel() for _, a in tensors])
    if version == 7:
        assert len(raw) == 1024 + 4 * body.size and raw[1024:] == body.astype("<f4").tobytes()
    else:  # the state holds bf16 values already: truncation is exact
        assert len(raw) == 1024 + 2 * body.size
        assert raw[1024:] == (body.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    return h


ROPE_CASES = {
    "default": (None, (0, 1.0, 0.0, 0.0, 0, 0.0)),
    "linear": ({"rope_type": "linear", "factor": 4.0}, (1, 4.0, 0.0, 0.0, 0, 0.0)),
    "llama3": ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, (2, 32.0, 1.0, 4.0, 8192, 0.0)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0,
              "beta_slow": 1.0, "attention_factor": 1.25}, (3, 4.0, 32.0, 1.0, 32768, 1.25)),
}


def rope_slots(h):
    f = [struct.unpack("<f", struct.pack("<i", h[s]))[0] for s in (17, 18, 19, 21)]
    return (h[16], f[0], f[1], f[2], h[20], f[3])


def check_export_bit_for_bit(out, state, config, st_dtype="F32"):
    got = read_safetensors_raw(out / "model.safetensors")
    want_names = set(state) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert set(got) == want_names
    np_dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[st_dtype]
    for name in want_names:
        dtype, shape, blob = got[name]
        assert dtype == st_dtype and shape == state[name].shape, name
        assert blob == np.ascontiguousarray(state[name], np_dtype).tobytes(), name
    exported = json.loads((out / "config.json").read_text())
    for key in ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act"):
        assert exported[key] == config[key], key
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    return exported


# --- model_config: GPT-2 in the configurable family -------------------------------------


def test_gpt2_configuration_has_gpt2s_tensors_and_bytes(tmp_path):
    cfg = mc.gpt2_config(64, 200, 2, 4, 32)
    assert [(n, s) for n, s in mc.tensor_shapes(cfg)] == list(datafile.model_tensor_shapes(
        {k: cfg[k] for k in ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels", "padded_vocab_size")}).items())
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in mc.tensor_shapes(cfg)}
    datafile.write_model(tmp_path / "v3.bin", {k: cfg[k] for k in ("max_seq_len", "vocab_size", "num_layers", "num_heads",
                                                                    "channels", "padded_vocab_size")}, params)
    mc.write_model(tmp_path / "v7.bin", cfg, params, 7)
    mc.write_model(tmp_path / "v3b.bin", cfg, params, 3)
    v3, v7 = (tmp_path / "v3.bin").read_bytes(), (tmp_path / "v7.bin").read_bytes()
    assert (tmp_path / "v3b.bin").read_bytes() == v3 and v7[1024:] == v3[1024:]
    h = struct.unpack("<256i", v7[:1024])
    assert h[1] == 7 and h[8:12] == (1, 4, 8, 128) and h[13] == f32_bits(1e-5) and h[22:25] == (0, 15, 1)
    for path in ("v3.bin", "v7.bin"):
        back, got, _ = mc.read_model(tmp_path / path)
        assert back == cfg and all(np.array_equal(got[n], params[n]) for n in params)


def test_model_config_refuses_what_the_format_cannot_hold(tmp_path):
    cfg = mc.gpt2_config(64, 200, 2, 4, 32)
    bad = [({"num_kv_heads": 3}, "not a multiple"), ({"positions": 1, "head_dim": 7, "rope_theta": 1e4}, "odd"),
           ({"family": 9}, "family 9"), ({"norm": 1}, "RMSNorm has no bias"), ({"rope_scaling": 1}, "without RoPE"),
           ({"eos": 200}, "eos token 200"), ({"padded_vocab_size": 100}, "below the vocabulary")]
    for change, why in bad:
        with pytest.raises(datafile.DataError, match=why):
            mc.write_model(tmp_path / "m.bin", {**cfg, **change}, {}, 7)
    swiglu = {**cfg, "mlp": mc.MLP_SWIGLU}
    with pytest.raises(datafile.DataError, match="holds GPT-2 only"):
        mc.write_model(tmp_path / "m.bin", swiglu, {}, 3)
    assert not list(tmp_path.iterdir())


def test_version_8_rounds_to_nearest_even_and_reads_back(tmp_path):
    """A Llama configuration written as version 8: every value rounded to bf16 to
    nearest, ties to even (computed here from the bits), read back exactly."""
    cfg = mc.gpt2_config(16, 300, 2, 4, 32)
    cfg.update(family=2, num_kv_heads=2, head_dim=12, ffn_dim=40, norm=1, norm_eps=mc.fp32(1e-6), positions=1,
               rope_theta=500000.0, mlp=1, biases=0, tied=0, bos=1, eos=2, hf_max_position_embeddings=16)
    rng = np.random.default_rng(10)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in mc.tensor_shapes(cfg)}
    params["lnfw"][:4] = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF], "<u4").view("<f4")
    mc.write_model(tmp_path / "m.bin", cfg, params, 8)
    raw = (tmp_path / "m.bin").read_bytes()
    assert struct.unpack("<2i", raw[:8]) == (20240326, 8)
    u = np.concatenate([params[n].ravel() for n, _ in mc.tensor_shapes(cfg)]).view("<u4").astype(np.uint64)
    lower, rest = u >> 16, u & 0xFFFF
    want = (lower + ((rest > 0x8000) | ((rest == 0x8000) & (lower & 1 == 1)))).astype("<u2")
    assert raw[1024:] == want.tobytes()
    back, got, version = mc.read_model(tmp_path / "m.bin")
    assert version == 8 and back == cfg
    assert np.array_equal(np.concatenate([got[n].ravel() for n, _ in mc.tensor_shapes(cfg)]).view("<u4"),
                          want.astype("<u4") << 16)
    assert [n for n, _ in mc.tensor_shapes(cfg)] == ["wte", "ln1w", "qkvw", "attprojw", "ln2w", "fcw", "fcprojw", "lnfw",
                                                     "lm_head"]
    assert dict(mc.tensor_shapes(cfg))["qkvw"] == (2, (4 + 2 * 2) * 12, 32) and dict(mc.tensor_shapes(cfg))["fcw"] == (2, 80, 32)


# --- import: the file against the format ------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama_untied", "llama_tied_biases", "qwen2_tied", "qwen2_untied"])
def test_import_lays_out_the_format(tmp_path, kind):
    config = {"llama_untied": llama_config(), "llama_tied_biases": llama_config(tie_word_embeddings=True, attention_bias=True,
                                                                                  mlp_bias=True),
              "qwen2_tied": qwen2_config(), "qwen2_untied": qwen2_config(tie_word_embeddings=False)}[kind]
    state = hf_state(config, np.random.default_rng(1))
    if config["tie_word_embeddings"] and kind.startswith("llama"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].copy()  # a tied head may be stored too
    ok(tool("import", write_hf(tmp_path / "hf", config, state), tmp_path / "m.bin"))
    check_model_file(tmp_path / "m.bin", config, state)


@pytest.mark.parametrize("rope", list(ROPE_CASES))
@pytest.mark.parametrize("spelling", ["rope_type", "type", "rope_parameters"])
def test_rope_scaling_in_every_spelling(tmp_path, rope, spelling):
    scaling, slots = ROPE_CASES[rope]
    if spelling == "type" and scaling:
        scaling = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    if spelling == "rope_parameters":  # transformers 5: the theta inside, no rope_scaling
        config = llama_config(rope_parameters={"rope_type": rope, "rope_theta": 500000.0, **(scaling or {})})
        del config["rope_scaling"], config["rope_theta"]
    else:
        config = llama_config(rope_scaling=scaling)
    state = hf_state(config, np.random.default_rng(2))
    ok(tool("import", write_hf(tmp_path / "hf", config, state), tmp_path / "m.bin"))
    h = check_model_file(tmp_path / "m.bin", llama_config(), state)
    assert h[15] == f32_bits(500000.0) and rope_slots(h) == slots
    ok(tool("export", tmp_path / "m.bin", tmp_path / "out"))
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    want = None if rope == "default" else {"rope_type": rope, **{k: v for k, v in (ROPE_CASES[rope][0] or {}).items()
                                                                if k != "rope_type"}}
    assert exported["rope_scaling"] == want
    assert exported["rope_parameters"] == {"rope_type": rope, "rope_theta": 500000.0, **{k: v for k, v in (want or {}).items()}}


# --- HF -> remat -> HF, bit for bit ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama_nkv_untied", "llama_tied_biases_sharded", "qwen2_biases_tied", "qwen2_untied_sharded",
                                  "llama_llama3_rope"])
def test_round_trip_fp32_bit_for_bit(tmp_path, case):
    config = {"llama_nkv_untied": llama_config(),
              "llama_tied_biases_sharded": llama_config(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
              "qwen2_biases_tied": qwen2_config(),
              "qwen2_untied_sharded": qwen2_config(tie_word_embeddings=False),
              "llama_llama3_rope": llama_config(rope_scaling=ROPE_CASES["llama3"][0])}[case]
    state = hf_state(config, np.random.default_rng(3))
    hf = write_hf(tmp_path / "hf", config, state, shards=3 if "sharded" in case else 1)
    ok(tool("import", hf, tmp_path / "m.bin"))
    check_model_file(tmp_path / "m.bin", config, state)
    ok(tool("export", tmp_path / "m.bin", tmp_path / "out"))
    exported = check_export_bit_for_bit(tmp_path / "out", state, config)
    assert exported["rope_scaling"] == config["rope_scaling"]
    ok(tool("import", tmp_path / "out", tmp_path / "m2.bin"))  # and back: the same file
    assert (tmp_path / "m2.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()


def test_round_trip_bf16_checkpoint(tmp_path):
    """A BF16 checkpoint (sharded): imported as version 8 (or 7: bf16 is exact in
    fp32) and exported as BF16, the same bits."""
    config = qwen2_config(torch_dtype="bfloat16")
    rng = np.random.default_rng(4)
    bits = bf16_state(hf_state(config, rng), rng)
    state = {k: (b.astype("<u4") << 16).view("<f4") for k, b in bits.items()}
    hf = write_hf(tmp_path / "hf", config, state, shards=2, bf16_bits=bits)
    ok(tool("import", hf, tmp_path / "m8.bin", "--dtype", "bf16"))
    check_model_file(tmp_path / "m8.bin", config, state, version=8)
    ok(tool("export", tmp_path / "m8.bin", tmp_path / "out8"))
    check_export_bit_for_bit(tmp_path / "out8", bits, config, "BF16")
    assert json.loads((tmp_path / "out8" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ok(tool("import", hf, tmp_path / "m7.bin"))
    check_model_file(tmp_path / "m7.bin", config, state, version=7)
    ok(tool("export", tmp_path / "m7.bin", tmp_path / "out7", "--dtype", "bf16"))
    check_export_bit_for_bit(tmp_path / "out7", bits, config, "BF16")


def test_round_trip_fp16_checkpoint(tmp_path):
    config = llama_config(torch_dtype="float16")
    state = hf_state(config, np.random.default_rng(5), dtype=np.float16)
    ok(tool("import", write_hf(tmp_path / "hf", config, state), tmp_path / "m.bin"))
    check_model_file(tmp_path / "m.bin", config, {k: v.astype(np.float32) for k, v in state.items()})
    ok(tool("export", tmp_path / "m.bin", tmp_path / "out", "--dtype", "fp16"))
    check_export_bit_for_bit(tmp_path / "out", state, config, "F16")


def test_export_rounds_bf16_to_nearest_even(tmp_path):
    """fp32 values exported as BF16: round to nearest, ties to even, computed here."""
    config = llama_config()
    state = hf_state(config, np.random.default_rng(6))
    w = state["model.norm.weight"]
    w[:4] = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF], "<u4").view("<f4")  # ties down, up; above; below
    ok(tool("import", write_hf(tmp_path / "hf", config, state), tmp_path / "m.bin"))
    ok(tool("export", tmp_path / "m.bin", tmp_path / "out", "--dtype", "bf16"))
    _, _, blob = read_safetensors_raw(tmp_path / "out" / "model.safetensors")["model.norm.weight"]
    got = np.frombuffer(blob, "<u2")
    assert got[:4].tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80]
    u = w.view("<u4").astype(np.uint64)
    lower, rest = u >> 16, u & 0xFFFF
    want = lower + ((rest > 0x8000) | ((rest == 0x8000) & (lower & 1 == 1)))
    assert np.array_equal(got, want.astype("<u2"))


def test_context_extension_exports_the_longer_max_position_embeddings(tmp_path):
    """A model file whose sequence length grew past the config it came from (slot 2
    above slot 27) exports the longer max_position_embeddings."""
    config = llama_config(rope_scaling=ROPE_CASES["linear"][0])
    state = hf_state(config, np.random.default_rng(7))
    ok(tool("import", write_hf(tmp_path / "hf", config, state), tmp_path / "m.bin"))
    raw = bytearray((tmp_path / "m.bin").read_bytes())
    raw[8:12] = struct.pack("<i", 1024)
    (tmp_path / "long.bin").write_bytes(bytes(raw))
    ok(tool("export", tmp_path / "long.bin", tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == 1024


# --- refusals ---------------------------------------------------------------------------------


REFUSALS = {
    "sliding window": (qwen2_config(use_sliding_window=True), None, "use_sliding_window"),
    "dynamic rope": (llama_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), None, "'dynamic' is not supported"),
    "longrope": (llama_config(rope_scaling={"type": "longrope", "factor": 2.0}), None, "'longrope' is not supported"),
    "two rope types": (llama_config(rope_scaling={"type": "linear", "rope_type": "yarn", "factor": 2.0}), None, "says rope_type"),
    "llama3 without original": (llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0}), None, "original_max_position_embeddings missing"),
    "moe": (llama_config(num_local_experts=8), None, "mixtures of experts"),
    "mixtral": (llama_config(model_type="mixtral", architectures=["MixtralForCausalLM"]), None, "model_type 'mixtral'"),
    "gelu": (llama_config(hidden_act="gelu"), None, "hidden_act 'gelu'"),
    "partial rotary": (llama_config(partial_rotary_factor=0.5), None, "partial_rotary_factor"),
    "heads not a multiple": (llama_config(num_key_value_heads=3), None, "not a multiple of num_key_value_heads 3"),
    "no head_dim, C % NH": (llama_config(head_dim=None, hidden_size=30), None, "not divisible"),
    "head_dim against tensors": (llama_config(head_dim=8), "state", "q_proj.weight has shape (48, 32), expected (32, 32)"),
    "tied but lm_head differs": (llama_config(tie_word_embeddings=True), "lm_head", "lm_head.weight differs"),
    "unexpected tensor": (llama_config(), "extra", "unexpected tensor model.layers.0.self_attn.q_norm.weight"),
    "eos outside": (llama_config(eos_token_id=V), None, "eos_token_id 300"),
    "vocabulary too large": (llama_config(vocab_size=300_000), None, "vocab_size 300000: the trainers hold at most 262144"),
    "not a finite value": (llama_config(), "nan", "q_proj.weight[1, 2] is nan"),
    "missing shard": (llama_config(), "shard", "is missing"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_one_line(tmp_path, case):
    config, damage, why = REFUSALS[case]
    if config.get("head_dim") is None:
        config = {k: v for k, v in config.items() if k != "head_dim"}
    good = llama_config()
    state = hf_state(good, np.random.default_rng(8))
    if damage == "lm_head":
        state["lm_head.weight"][0, 0] += 1
    if damage == "extra":
        state["model.layers.0.self_attn.q_norm.weight"] = np.ones(HD, np.float32)
    if damage == "nan":
        state["model.layers.0.self_attn.q_proj.weight"][1, 2] = np.nan
    hf = write_hf(tmp_path / "hf", config, state, shards=2 if damage == "shard" else 1)
    if damage == "shard":
        next(hf.glob("model-00002-*.safetensors")).unlink()
    one_line_error(tool("import", hf, tmp_path / "m.bin"), why)
    assert not (tmp_path / "m.bin").exists()


def test_export_refuses_gpt2_and_bad_files(tmp_path):
    cfg = mc.gpt2_config(16, 64, 1, 2, 16)
    params = {n: np.zeros(s, np.float32) for n, s in mc.tensor_shapes(cfg)}
    mc.write_model(tmp_path / "gpt2.bin", cfg, params, 7)
    one_line_error(tool("export", tmp_path / "gpt2.bin", tmp_path / "out"), "hf_gpt2.py")
    (tmp_path / "short.bin").write_bytes((tmp_path / "gpt2.bin").read_bytes()[:-4])
    one_line_error(tool("export", tmp_path / "short.bin", tmp_path / "out"), "does not match its header")
    assert not (tmp_path / "out").exists()


# --- against transformers, where it is installed ---------------------------------------------------


def test_against_transformers(tmp_path):
    """LlamaForCausalLM loads the export and gives the logits of the checkpoint it came from."""
    torch = pytest.importorskip("torch", reason="torch is not installed: the export is not checked against transformers")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: the export is not checked")
    for config in (llama_config(rope_scaling=ROPE_CASES["llama3"][0]), qwen2_config()):
        state = hf_state(config, np.random.default_rng(9))
        hf = write_hf(tmp_path / config["model_type"], config, state)
        ok(tool("import", hf, tmp_path / "m.bin"))
        ok(tool("export", tmp_path / "m.bin", tmp_path / "out"))
        ids = torch.tensor([[1, 5, 9, 33, 200, 7]])
        a = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
        b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(a(ids).logits, b(ids).logits)
