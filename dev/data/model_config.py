"""The configurable family's model files (versions 7 and 8) in Python: every width
from one function of the configuration.

A model file (docs/FORMATS.md) is a 1,024-byte header of 256 int32 slots and then
its tensors back to back. GPT-2's files are versions 3 (fp32) and 5 (bf16) with 8
shape slots; the configurable family (gpt2, llama, qwen2) uses versions 7 (fp32)
and 8 (bf16) whose slots 8-27 name every switch of the block: K/V heads, head
size, MLP width, norm and its epsilon, learned or rotary positions with the
RoPE scaling, GELU or SwiGLU, biases, a tied or untied head, bos/eos and the
max_position_embeddings of the config it came from.

`tensor_shapes(cfg)` is the one place that turns a configuration into the list
of tensors and their shapes; reading, writing, the Hugging Face converter
(hf_llama.py) and the tests all go through it. A configuration is a dict with
the keys of CONFIG_KEYS; `gpt2_config` builds GPT-2's, whose version-7 file
holds exactly the 16 tensors of a version-3 file.

    cfg, params, version = read_model(path)        # versions 3, 5, 7, 8
    write_model(path, cfg, params, version=7)      # 7: fp32, 8: bf16 (round to nearest even)
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402
from datafile import DataError  # noqa: E402

VERSION_FP32, VERSION_BF16 = 7, 8
GPT2_VERSIONS = (df.MODEL_VERSION_FP32, df.MODEL_VERSION_BF16)

FAMILIES = {1: "gpt2", 2: "llama", 3: "qwen2"}
NORM_LAYERNORM, NORM_RMSNORM = 0, 1
POS_LEARNED, POS_ROPE = 0, 1
ROPE_TYPES = {0: "default", 1: "linear", 2: "llama3", 3: "yarn"}
MLP_GELU, MLP_SWIGLU = 0, 1
BIAS_QKV, BIAS_ATTPROJ, BIAS_MLP, BIAS_NORM = 1, 2, 4, 8
MAX_INT32 = 2**31 - 1

# (header slot, key, kind): "i" int32, "f" fp32 bits. Slots 0-1 are magic and version.
SLOTS = [
    (2, "max_seq_len", "i"), (3, "vocab_size", "i"), (4, "num_layers", "i"), (5, "num_heads", "i"),
    (6, "channels", "i"), (7, "padded_vocab_size", "i"),
    (8, "family", "i"),             # 1 gpt2, 2 llama, 3 qwen2 (a name; the switches decide the computation)
    (9, "num_kv_heads", "i"),       # NKV: NH is a multiple of it
    (10, "head_dim", "i"),          # HD: NH x HD may differ from C
    (11, "ffn_dim", "i"),           # F: the MLP's width (GELU 4C for GPT-2; SwiGLU: intermediate_size)
    (12, "norm", "i"),              # 0 LayerNorm, 1 RMSNorm
    (13, "norm_eps", "f"),
    (14, "positions", "i"),         # 0 learned table (wpe), 1 RoPE
    (15, "rope_theta", "f"),
    (16, "rope_scaling", "i"),      # ROPE_TYPES
    (17, "rope_factor", "f"),       # 1.0 for none
    (18, "rope_low", "f"),          # llama3: low_freq_factor; yarn: beta_fast
    (19, "rope_high", "f"),         # llama3: high_freq_factor; yarn: beta_slow
    (20, "rope_original_max", "i"), # original_max_position_embeddings (llama3, yarn; 0: none)
    (21, "rope_attention_factor", "f"),  # yarn: mscale; 0 = transformers' default 0.1 ln(factor) + 1
    (22, "mlp", "i"),               # 0 GELU (tanh), 1 SwiGLU
    (23, "biases", "i"),            # BIAS_* bit mask
    (24, "tied", "i"),              # 1 the classifier is wte, 0 its own (Vp, C) lm_head
    (25, "bos", "i"),               # -1 none
    (26, "eos", "i"),               # -1 none
    (27, "hf_max_position_embeddings", "i"),  # of the config.json it came from (0 unknown)
]
CONFIG_KEYS = tuple(key for _, key, _ in SLOTS)
FLOAT_KEYS = tuple(key for _, key, kind in SLOTS if kind == "f")


def fp32(x) -> float:
    """x as the float32 the header stores (a Python float of that exact value)."""
    return float(np.float32(x))


def gpt2_config(max_seq_len: int, vocab_size: int, num_layers: int, num_heads: int, channels: int,
                padded_vocab_size: int | None = None) -> dict:
    """GPT-2's switches: NKV = NH, HD = C / NH, F = 4C, LayerNorm (eps 1e-5) with
    biases everywhere, a learned position table, GELU, tied head."""
    return {"max_seq_len": max_seq_len, "vocab_size": vocab_size, "num_layers": num_layers, "num_heads": num_heads,
            "channels": channels, "padded_vocab_size": padded_vocab_size or df.pad_vocab(vocab_size),
            "family": 1, "num_kv_heads": num_heads, "head_dim": channels // num_heads, "ffn_dim": 4 * channels,
            "norm": NORM_LAYERNORM, "norm_eps": fp32(1e-5), "positions": POS_LEARNED, "rope_theta": 0.0,
            "rope_scaling": 0, "rope_factor": 1.0, "rope_low": 0.0, "rope_high": 0.0, "rope_original_max": 0,
            "rope_attention_factor": 0.0, "mlp": MLP_GELU, "biases": BIAS_QKV | BIAS_ATTPROJ | BIAS_MLP | BIAS_NORM,
            "tied": 1, "bos": -1, "eos": -1, "hf_max_position_embeddings": 0}


def is_gpt2(cfg: dict) -> bool:
    """Whether cfg computes exactly GPT-2 (what a version-3/5 file can hold)."""
    ref = gpt2_config(cfg["max_seq_len"], cfg["vocab_size"], cfg["num_layers"], cfg["num_heads"], cfg["channels"],
                      cfg["padded_vocab_size"])
    same = ("num_kv_heads", "head_dim", "ffn_dim", "norm", "norm_eps", "positions", "mlp", "biases", "tied")
    return cfg["channels"] % cfg["num_heads"] == 0 and all(cfg[k] == ref[k] for k in same)


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple]]:
    """The tensors of a model file in file order, with their shapes: the one
    function of the configuration every width comes from. A tensor the switches
    leave out is absent (no zero-size placeholder)."""
    Vp, C, L, T = cfg["padded_vocab_size"], cfg["channels"], cfg["num_layers"], cfg["max_seq_len"]
    NH, NKV, HD, F = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["ffn_dim"]
    qkv = (NH + 2 * NKV) * HD                       # rows: Q heads, then K heads, then V heads
    fc = 2 * F if cfg["mlp"] == MLP_SWIGLU else F   # SwiGLU: rows [gate (F); up (F)]
    bias = cfg["biases"]
    shapes = [("wte", (Vp, C))]
    if cfg["positions"] == POS_LEARNED:
        shapes.append(("wpe", (T, C)))
    per_layer = [("ln1w", (L, C), True), ("ln1b", (L, C), bias & BIAS_NORM),
                 ("qkvw", (L, qkv, C), True), ("qkvb", (L, qkv), bias & BIAS_QKV),
                 ("attprojw", (L, C, NH * HD), True), ("attprojb", (L, C), bias & BIAS_ATTPROJ),
                 ("ln2w", (L, C), True), ("ln2b", (L, C), bias & BIAS_NORM),
                 ("fcw", (L, fc, C), True), ("fcb", (L, fc), bias & BIAS_MLP),
                 ("fcprojw", (L, C, F), True), ("fcprojb", (L, C), bias & BIAS_MLP),
                 ("lnfw", (C,), True), ("lnfb", (C,), bias & BIAS_NORM)]
    shapes += [(name, shape) for name, shape, present in per_layer if present]
    if not cfg["tied"]:
        shapes.append(("lm_head", (Vp, C)))
    return shapes


def num_parameters(cfg: dict) -> int:
    return sum(math.prod(shape) for _, shape in tensor_shapes(cfg))


def config_problem(cfg: dict) -> str | None:
    """What makes cfg impossible to hold or compute (one phrase), or None."""
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        return f"configuration lacks {', '.join(missing)}"
    for key in CONFIG_KEYS:
        value = cfg[key]
        if key in FLOAT_KEYS:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or not abs(value) < 3.4e38:
                return f"{key} {value!r} is not a finite float32"
        elif not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not -1 <= value <= MAX_INT32:
            return f"{key} {value!r} is not an int32 of the header"
    positive = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels", "padded_vocab_size",
                "num_kv_heads", "head_dim", "ffn_dim")
    for key in positive:
        if cfg[key] < 1:
            return f"{key} {cfg[key]} must be positive"
    c = cfg
    checks = [
        (c["padded_vocab_size"] >= c["vocab_size"], f"padded vocabulary {c['padded_vocab_size']} below the vocabulary {c['vocab_size']}"),
        (c["family"] in FAMILIES, f"family {c['family']} is not 1 (gpt2), 2 (llama) or 3 (qwen2)"),
        (c["num_heads"] % c["num_kv_heads"] == 0, f"{c['num_heads']} query heads are not a multiple of {c['num_kv_heads']} K/V heads"),
        (c["norm"] in (NORM_LAYERNORM, NORM_RMSNORM), f"norm {c['norm']} is not 0 (LayerNorm) or 1 (RMSNorm)"),
        (c["norm_eps"] > 0, f"norm epsilon {c['norm_eps']} must be positive"),
        (c["positions"] in (POS_LEARNED, POS_ROPE), f"positions {c['positions']} is not 0 (learned) or 1 (RoPE)"),
        (c["mlp"] in (MLP_GELU, MLP_SWIGLU), f"mlp {c['mlp']} is not 0 (GELU) or 1 (SwiGLU)"),
        (0 <= c["biases"] <= 15, f"biases {c['biases']} is not a mask of 1, 2, 4, 8"),
        (not (c["norm"] == NORM_RMSNORM and c["biases"] & BIAS_NORM), "RMSNorm has no bias (biases bit 8)"),
        (c["tied"] in (0, 1), f"tied {c['tied']} is not 0 or 1"),
        (-1 <= c["bos"] < c["vocab_size"], f"bos token {c['bos']} is outside the vocabulary ({c['vocab_size']})"),
        (-1 <= c["eos"] < c["vocab_size"], f"eos token {c['eos']} is outside the vocabulary ({c['vocab_size']})"),
        (c["hf_max_position_embeddings"] >= 0, f"max_position_embeddings {c['hf_max_position_embeddings']} is negative"),
        (c["rope_scaling"] in ROPE_TYPES, f"RoPE scaling {c['rope_scaling']} is not 0-3 ({', '.join(ROPE_TYPES.values())})"),
        (c["rope_original_max"] >= 0, f"original_max_position_embeddings {c['rope_original_max']} is negative"),
    ]
    if c["positions"] == POS_ROPE:
        checks += [(c["head_dim"] % 2 == 0, f"head size {c['head_dim']} is odd: RoPE rotates pairs"),
                   (c["rope_theta"] > 0, f"RoPE theta {c['rope_theta']} must be positive"),
                   (c["rope_factor"] > 0, f"RoPE scaling factor {c['rope_factor']} must be positive")]
        if c["rope_scaling"] == 2:
            checks += [(c["rope_original_max"] > 0, "llama3 RoPE scaling needs original_max_position_embeddings"),
                       (c["rope_high"] > c["rope_low"] > 0,
                        f"llama3 RoPE: high_freq_factor {c['rope_high']} must exceed low_freq_factor {c['rope_low']} > 0")]
        if c["rope_scaling"] == 3:
            checks += [(c["rope_low"] > 0 and c["rope_high"] > 0, "yarn RoPE: beta_fast and beta_slow must be positive"),
                       (c["rope_attention_factor"] >= 0, f"yarn attention factor {c['rope_attention_factor']} is negative")]
    else:
        checks.append((c["rope_scaling"] == 0, "a RoPE scaling without RoPE positions"))
    for ok, why in checks:
        if not ok:
            return why
    return None


def check_config(cfg: dict, where: str) -> None:
    why = config_problem(cfg)
    if why:
        raise DataError(f"{where}: {why}")


def header(cfg: dict, version: int, dropout: dict | None = None, run_id: int = 0) -> np.ndarray:
    """The 256 int32 header slots of a version-7/8 file (3/5: the first 8 only)."""
    h = np.zeros(df.HEADER_INTS, dtype="<i4")
    h[0], h[1] = df.MODEL_MAGIC, version
    for slot, key, kind in SLOTS:
        if version in GPT2_VERSIONS and slot > 7:
            break
        h[slot] = np.array([cfg[key]], "<f4").view("<i4")[0] if kind == "f" else cfg[key]
    probs = np.array([(dropout or {}).get(k, 0.0) for k in df.MODEL_DROPOUT_KEYS], dtype="<f4")
    for key, p in zip(df.MODEL_DROPOUT_KEYS, probs):
        if not 0.0 <= p <= df.MODEL_DROPOUT_MAX:
            raise DataError(f"{key} {p}: not a dropout probability in [0, {df.MODEL_DROPOUT_MAX}]")
    h[df.MODEL_DROPOUT_SLOT:df.MODEL_DROPOUT_SLOT + 3] = probs.view("<i4")
    if not 0 <= run_id < 2 ** 64:
        raise DataError(f"run id {run_id}: not a 64-bit unsigned integer")
    h[df.MODEL_RUN_ID_SLOT:df.MODEL_RUN_ID_SLOT + 2] = np.array([run_id], dtype="<u8").view("<i4")
    return h


def config_from_header(h: np.ndarray, where: str) -> tuple[dict, int]:
    """(configuration, version) of a model file's header, checked."""
    if int(h[0]) != df.MODEL_MAGIC:
        raise DataError(f"{where}: bad magic {int(h[0])} (a model file has {df.MODEL_MAGIC})")
    version = int(h[1])
    if version not in GPT2_VERSIONS + (VERSION_FP32, VERSION_BF16):
        raise DataError(f"{where}: unsupported model file version {version} (expected 3 or 5 for GPT-2, 7 or 8)")
    if version in GPT2_VERSIONS:
        shape = [int(x) for x in h[2:8]]
        if min(shape) < 1 or shape[4] % shape[3]:
            raise DataError(f"{where}: inconsistent shape in the header: {shape}")
        cfg = gpt2_config(shape[0], shape[1], shape[2], shape[3], shape[4], shape[5])
    else:
        cfg = {key: (float(h[slot:slot + 1].view("<f4")[0]) if kind == "f" else int(h[slot])) for slot, key, kind in SLOTS}
    check_config(cfg, where)
    return cfg, version


def tensor_bytes(cfg: dict, version: int) -> int:
    return num_parameters(cfg) * (4 if version in (df.MODEL_VERSION_FP32, VERSION_FP32) else 2)


def write_model(path, cfg: dict, params: dict, version: int = VERSION_FP32, dropout: dict | None = None,
                run_id: int = 0) -> None:
    """Write a model file atomically. params: each tensor of tensor_shapes(cfg) by
    name (anything float; stored fp32 for versions 3/7, bf16 rounded to nearest
    even for 5/8). Versions 3/5 only for a configuration that is exactly GPT-2."""
    check_config(cfg, os.fspath(path))
    if version in GPT2_VERSIONS and not is_gpt2(cfg):
        raise DataError(f"{path}: a version-{version} file holds GPT-2 only; this configuration needs version 7 or 8")
    if version not in GPT2_VERSIONS + (VERSION_FP32, VERSION_BF16):
        raise DataError(f"model file version must be 3, 5 (GPT-2), 7 (fp32) or 8 (bf16), got {version}")
    shapes = tensor_shapes(cfg)
    extra = sorted(set(params) - {name for name, _ in shapes})
    if extra:
        raise DataError(f"{path}: tensors {', '.join(extra)} are not part of this configuration")
    h = header(cfg, version, dropout, run_id)
    bf16 = version in (df.MODEL_VERSION_BF16, VERSION_BF16)
    out = df._AtomicFile(path)
    try:
        out.f.write(h.tobytes())
        for name, shape in shapes:
            if name not in params:
                raise DataError(f"{path}: tensor {name} {shape} is missing")
            arr = np.asarray(params[name], dtype=np.float32)
            if arr.shape != shape:
                raise DataError(f"{path}: tensor {name} has shape {arr.shape}, expected {shape}")
            data = df.float32_to_bf16_bits(arr) if bf16 else arr.astype("<f4")
            out.f.write(np.ascontiguousarray(data).tobytes())
        out.commit()
    except BaseException:
        out.abort()
        raise


def read_header(path) -> np.ndarray:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(df.HEADER_BYTES)
    except OSError as e:
        raise DataError(f"{path}: cannot read model file: {e.strerror}") from None
    if len(raw) < df.HEADER_BYTES:
        raise DataError(f"{path}: truncated header ({len(raw)} of {df.HEADER_BYTES} bytes)")
    return np.frombuffer(raw, dtype="<i4")


def read_model(path) -> tuple[dict, dict, int]:
    """(configuration, tensors as float32 by name, version) of a model file of
    version 3, 5, 7 or 8; its size must be exactly what the header implies."""
    path = os.fspath(path)
    cfg, version = config_from_header(read_header(path), path)
    elem = 4 if version in (df.MODEL_VERSION_FP32, VERSION_FP32) else 2
    count = num_parameters(cfg)
    size = os.path.getsize(path)
    if size != df.HEADER_BYTES + count * elem:
        raise DataError(f"{path}: size {size} bytes does not match its header "
                        f"(expected {df.HEADER_BYTES + count * elem}: {count} parameters x {elem} bytes + 1024)")
    flat = np.fromfile(path, dtype="<f4" if elem == 4 else "<u2", count=count, offset=df.HEADER_BYTES)
    if elem == 2:
        flat = df.bf16_bits_to_float32(flat)
    params, off = {}, 0
    for name, shape in tensor_shapes(cfg):
        n = math.prod(shape)
        params[name] = flat[off:off + n].reshape(shape)
        off += n
    return cfg, params, version


def read_dropout_and_run_id(path) -> tuple[dict, int]:
    h = read_header(path)
    probs = h[df.MODEL_DROPOUT_SLOT:df.MODEL_DROPOUT_SLOT + 3].view("<f4")
    run_id = int(h[df.MODEL_RUN_ID_SLOT:df.MODEL_RUN_ID_SLOT + 2].copy().view("<u8")[0])
    return {k: float(p) for k, p in zip(df.MODEL_DROPOUT_KEYS, probs)}, run_id
