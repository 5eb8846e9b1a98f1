"""The CPU reference's configurable block (Llama, Qwen2) against an independent
float64 numpy forward of Hugging Face transformers' semantics (modeling_llama,
modeling_qwen2, modeling_rope_utils), written here: numpy writes a random
version-7 model file from docs/FORMATS.md's description, train_gpt_cpu reads it
and prints the loss of its first step, which must be numpy's within 1e-5.

The numpy model: RMSNorm x / sqrt(mean(x^2) + eps) * w; q/k/v projections of
NH and NKV heads (Qwen2: with biases); RoPE in rotate_half form on q and k with
cos and sin of position * inv_freq (inv_freq per rope type, yarn's attention
factor on cos and sin); K/V heads repeated to the query heads (repeat_kv);
causal softmax(q k^T / sqrt(HD)) v; o_proj; SwiGLU down(silu(gate) * up);
final RMSNorm; logits from lm_head (or wte when tied) over the real vocabulary.
"""
import math
import re

import numpy as np
import pytest

from conftest import binary, datafile, run

V, VP, MAXT = 64, 128, 64
B, T = 2, 32


def default_config(**kw):
    cfg = dict(family=2, L=2, C=32, NH=4, NKV=2, HD=8, F=48, eps=1e-5, theta=10000.0, rope="default", factor=1.0,
               low=0.0, high=0.0, original=0, attn_factor=0.0, bias=0, tied=False)
    cfg.update(kw)
    return cfg


ROPE_TYPES = {"default": 0, "linear": 1, "llama3": 2, "yarn": 3}


def header(cfg):
    h = np.zeros(256, dtype=np.int32)
    f = h.view(np.float32)
    h[:8] = [20240326, 7, MAXT, V, cfg["L"], cfg["NH"], cfg["C"], VP]
    h[8], h[9], h[10], h[11], h[12] = cfg["family"], cfg["NKV"], cfg["HD"], cfg["F"], 1  # RMSNorm
    f[13] = cfg["eps"]
    h[14] = 1  # RoPE
    f[15] = cfg["theta"]
    h[16] = ROPE_TYPES[cfg["rope"]]
    f[17], f[18], f[19] = cfg["factor"], cfg["low"], cfg["high"]
    h[20] = cfg["original"]
    f[21] = cfg["attn_factor"]
    h[22] = 1  # SwiGLU
    h[23] = cfg["bias"]
    h[24] = 1 if cfg["tied"] else 0
    h[25], h[26], h[27] = -1, -1, 0
    return h


def random_params(cfg, seed):
    """Weights large enough that attention is far from uniform (so positions matter), as float32 values."""
    rng = np.random.default_rng(seed)
    L, C, NH, NKV, HD, F = cfg["L"], cfg["C"], cfg["NH"], cfg["NKV"], cfg["HD"], cfg["F"]
    qkv = (NH + 2 * NKV) * HD
    def w(*shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)
    p = {"wte": w(VP, C, std=1.0)}
    p["wte"][V:] = 0
    p["ln1w"] = 1 + w(L, C, std=0.2)
    p["qkvw"] = w(L, qkv, C, std=0.5)
    if cfg["bias"] & 1:
        p["qkvb"] = w(L, qkv, std=0.5)
    p["attprojw"] = w(L, C, NH * HD, std=0.3)
    p["ln2w"] = 1 + w(L, C, std=0.2)
    p["fcw"] = w(L, 2 * F, C, std=0.3)
    p["fcprojw"] = w(L, C, F, std=0.3)
    p["lnfw"] = 1 + w(C, std=0.2)
    if not cfg["tied"]:
        p["lm_head"] = w(VP, C, std=0.5)
        p["lm_head"][V:] = 0
    return p


ORDER = ["wte", "ln1w", "qkvw", "qkvb", "attprojw", "ln2w", "fcw", "fcprojw", "lnfw", "lm_head"]


def write_model(path, cfg, p):
    payload = b"".join(p[name].astype(np.float32).tobytes() for name in ORDER if name in p)
    path.write_bytes(header(cfg).tobytes() + payload)


def inv_freq(cfg):
    HD, base, factor = cfg["HD"], cfg["theta"], cfg["factor"]
    freq = 1.0 / base ** (np.arange(0, HD, 2, dtype=np.float64) / HD)
    rope, attention = cfg["rope"], 1.0
    if rope == "linear":
        freq = freq / factor
    elif rope == "llama3":
        orig, low, high = cfg["original"], cfg["low"], cfg["high"]
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > orig / low, freq / factor, freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / high) & (wavelen <= orig / low)
        freq = np.where(medium, smoothed, scaled)
    elif rope == "yarn":
        orig, fast, slow = cfg["original"], cfg["low"], cfg["high"]
        def correction(rotations):
            return HD * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = max(math.floor(correction(fast)), 0), min(math.ceil(correction(slow)), HD - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(HD // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        freq = freq / factor * (1 - extrapolation) + freq * extrapolation
        attention = cfg["attn_factor"] or (0.1 * math.log(factor) + 1 if factor > 1 else 1.0)
    return freq, attention


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_loss(cfg, p, inputs, targets, positions):
    p = {k: v.astype(np.float64) for k, v in p.items()}
    L, C, NH, NKV, HD, F, eps = cfg["L"], cfg["C"], cfg["NH"], cfg["NKV"], cfg["HD"], cfg["F"], cfg["eps"]
    Bn, Tn = inputs.shape
    freq, attention = inv_freq(cfg)
    angles = positions[..., None].astype(np.float64) * freq  # (B, T, HD/2)
    emb = np.concatenate([angles, angles], axis=-1)[:, None]  # (B, 1, T, HD)
    cos, sin = np.cos(emb) * attention, np.sin(emb) * attention
    mask = np.tril(np.ones((Tn, Tn), dtype=bool))
    x = p["wte"][inputs]
    for l in range(L):
        h = rmsnorm(x, p["ln1w"][l], eps)
        qkv = h @ p["qkvw"][l].T + (p["qkvb"][l] if "qkvb" in p else 0)
        q, k, v = np.split(qkv, [NH * HD, (NH + NKV) * HD], axis=-1)
        q = q.reshape(Bn, Tn, NH, HD).transpose(0, 2, 1, 3)
        k = k.reshape(Bn, Tn, NKV, HD).transpose(0, 2, 1, 3)
        v = v.reshape(Bn, Tn, NKV, HD).transpose(0, 2, 1, 3)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, NH // NKV, axis=1), np.repeat(v, NH // NKV, axis=1)  # repeat_kv
        att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(HD)
        att = np.where(mask, att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(Bn, Tn, NH * HD)
        x = x + y @ p["attprojw"][l].T
        h = rmsnorm(x, p["ln2w"][l], eps)
        gate, up = np.split(h @ p["fcw"][l].T, 2, axis=-1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p["fcprojw"][l].T
    x = rmsnorm(x, p["lnfw"], eps)
    logits = (x @ (p["wte"] if cfg["tied"] else p["lm_head"]).T)[..., :V]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()


def first_loss(stdout):
    return float(re.search(r"^step +1/\d+ \| loss ([0-9.]+)", stdout, re.M).group(1))


CASES = {
    "llama-default-untied": default_config(),
    "llama-NH*HD>C": default_config(HD=12),
    "llama3-tied": default_config(rope="llama3", factor=8.0, low=1.0, high=4.0, original=64, tied=True),
    "llama3-untied": default_config(rope="llama3", factor=32.0, low=1.0, high=4.0, original=64, theta=500000.0, HD=16, NKV=1),
    "yarn": default_config(rope="yarn", factor=4.0, low=32.0, high=1.0, original=16),
    "yarn-attention-factor": default_config(rope="yarn", factor=4.0, low=32.0, high=1.0, original=16, attn_factor=1.2),
    "qwen2-linear-tied": default_config(family=3, rope="linear", factor=2.0, bias=1, tied=True, NKV=1, theta=1000000.0, eps=1e-6),
    "qwen2-default-untied": default_config(family=3, bias=1, theta=1000000.0, eps=1e-6),
}


def losses_of(exe, tmp_path, name):
    """(the trainer's first loss, numpy's, numpy's with every position 0) for case `name`, the trainer `exe`."""
    cfg = CASES[name]
    rng = np.random.default_rng(list(CASES).index(name))
    tokens = rng.integers(0, V, B * T + 1)
    datafile.write_shard(tmp_path / "t.bin", tokens)
    p = random_params(cfg, 7)
    write_model(tmp_path / "m.bin", cfg, p)
    res = run([exe, "-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-b", str(B), "-t", str(T), "-x", "1", "-s", "0"],
              check=True)
    inputs, targets = tokens[:B * T].reshape(B, T), tokens[1:B * T + 1].reshape(B, T)
    positions = np.tile(np.arange(T), (B, 1))
    expected = reference_loss(cfg, p, inputs, targets, positions)
    return first_loss(res.stdout), expected, reference_loss(cfg, p, inputs, targets, positions * 0)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_matches_numpy_transformers_semantics(tmp_path, name):
    loss, expected, unturned = losses_of(binary("train_gpt_cpu"), tmp_path, name)
    print(name, loss, expected)
    assert abs(loss - expected) < 1e-5 * expected, (loss, expected)
    # the check can fail: positions matter at this scale (the loss without RoPE's turn differs)
    assert abs(unturned - expected) > 1e-3 * expected


def test_reset_position_ids_restart_rope(tmp_path):
    """Packed documents: --reset-position-ids restarts RoPE's positions at each end-of-text token (the
    position the learned table would use: t minus its document's start)."""
    cfg = CASES["llama3-tied"]
    eot = 5
    rng = np.random.default_rng(3)
    tokens = rng.integers(6, V, B * T + 1)
    tokens[[7, 20, 40, 41]] = eot
    datafile.write_shard(tmp_path / "t.bin", tokens)
    p = random_params(cfg, 8)
    write_model(tmp_path / "m.bin", cfg, p)
    res = run([binary("train_gpt_cpu"), "-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-b", str(B),
               "-t", str(T), "-x", "1", "-s", "0", "--eot-token", str(eot), "--reset-position-ids"], check=True)
    inputs, targets = tokens[:B * T].reshape(B, T), tokens[1:B * T + 1].reshape(B, T)
    positions = np.zeros((B, T), dtype=np.int64)
    for b in range(B):
        start = 0
        for t in range(T):
            if inputs[b, t] == eot:
                start = t
            positions[b, t] = t - start
    expected = reference_loss(cfg, p, inputs, targets, positions)
    assert abs(first_loss(res.stdout) - expected) < 1e-5 * expected, (first_loss(res.stdout), expected)
    plain = reference_loss(cfg, p, inputs, targets, np.tile(np.arange(T), (B, 1)))
    assert abs(plain - expected) > 1e-4 * expected  # the restart changed the loss
