#!/usr/bin/env python3
"""torch_gpt2.py: a minimal PyTorch GPT-2 trainer, remat's side-by-side baseline.

It trains the model remat trains (docs/FORMATS.md: pre-LayerNorm GPT-2, eps 1e-5,
fused QKV, tanh GELU, tied token embedding and LM head over the vocabulary
padded to a multiple of 128, loss over the first V logits only) the way an
ordinary PyTorch user would: fp32 parameters, bf16 autocast on CUDA,
F.scaled_dot_product_attention(is_causal=True), AdamW (fused on CUDA),
optionally torch.compile. Nothing here is tuned to win or to lose.

What makes the comparison fair:
  - the flags and their defaults are remat's (-e d12, -b, -t, -x, -i, -l, -u,
    -q, -k, -c, --beta1, --beta2, --eps, --grad-clip, --seed);
  - the weights: -e dN initialises exactly as remat does (llmc/core/model.h and
    llmc/core/rand.h: the same counter-based normal draws from --seed), and -e FILE
    (or --model FILE) loads an llm.c / remat model file, version 3 (fp32) or
    5 (bf16);
  - the data: token shards in remat's format, read in remat's order without
    shuffling: batch i of a shard is tokens [i*B*T, (i+1)*B*T] (B*T+1 tokens);
  - the output: the same step line, "average step time X ms over N steps
    (first step excluded)", "device memory after step 1: X MiB in use", and MFU
    with remat's convention (model FLOPs 6N + 12LCT per token, N the
    parameters less the position table, over the dense bf16 peak); at the end
    one machine-readable line, "summary {json}".

On --device cpu everything runs in fp32 without autocast, so the step-1 loss
equals train_gpt_cpu's on the same weights and tokens to about 1e-6
(dev/test/test_torch_baseline.py checks this).

usage: python3 dev/bench/torch_gpt2.py -e d12 -b 16 -t 1024 -x 30 -i data/random50257/random50257_train.bin
Exit status 77 when PyTorch is not installed (nothing else is needed but numpy).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as exc:  # the benchmark is optional; callers treat 77 as "skipped"
    print(f"torch_gpt2: PyTorch is not importable ({exc}); nothing to run", file=sys.stderr)
    sys.exit(77)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "dev", "data"))
import datafile  # noqa: E402  (remat's shard reader)

MODEL_MAGIC = 20240326
# remat's descriptors (llmc/core/model.h config_from_descriptor): layers, heads, channels
DESCRIPTORS = {"d6": (6, 6, 384), "d12": (12, 12, 768), "d24": (24, 16, 1024), "d36": (36, 20, 1280),
               "d48": (48, 25, 1600)}
# the 16 tensors of a model file, in file order (docs/FORMATS.md)
TENSOR_NAMES = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb",
                "fcprojw", "fcprojb", "lnfw", "lnfb"]
DECAYED = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}  # weight decay on 2-D weights only, as remat


def fail(msg):
    print(f"torch_gpt2: error: {msg}", file=sys.stderr)
    sys.exit(1)


def pad_vocab(v):
    return (v + 127) // 128 * 128


def tensor_shapes(cfg):
    L, C, Vp, maxT = cfg["L"], cfg["C"], cfg["Vp"], cfg["maxT"]
    return [(Vp, C), (maxT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C), (L, C), (L, C),
            (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C), (C,), (C,)]


# ---------------------------------------------------------------------------
# model files


def read_model_file(path):
    """Header and the 16 tensors (numpy fp32) of a version 3 or 5 model file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(1024), dtype="<i4")
    except OSError as e:
        fail(f"{path}: cannot read model file: {e.strerror}")
    if len(header) < 256 or header[0] != MODEL_MAGIC:
        fail(f"{path}: not an llm.c model file (magic {header[0] if len(header) else '?'}, expected {MODEL_MAGIC})")
    version = int(header[1])
    if version not in (3, 5):
        fail(f"{path}: unsupported model file version {version} (expected 3 or 5)")
    cfg = dict(maxT=int(header[2]), V=int(header[3]), L=int(header[4]), NH=int(header[5]), C=int(header[6]),
               Vp=int(header[7]))
    shapes = tensor_shapes(cfg)
    total = sum(int(np.prod(s)) for s in shapes)
    elem = 4 if version == 3 else 2
    if size != 1024 + total * elem:
        fail(f"{path}: size {size} bytes does not match its header (expected {1024 + total * elem})")
    if version == 3:
        flat = np.fromfile(path, dtype="<f4", offset=1024, count=total)
    else:  # bf16: the upper 16 bits of an fp32
        flat = (np.fromfile(path, dtype="<u2", offset=1024, count=total).astype(np.uint32) << 16).view(np.float32)
    tensors, off = {}, 0
    for name, shape in zip(TENSOR_NAMES, shapes):
        n = int(np.prod(shape))
        tensors[name] = torch.from_numpy(flat[off:off + n].reshape(shape).copy())
        off += n
    return cfg, version, tensors


# ---------------------------------------------------------------------------
# remat's initialisation, bit for bit (llmc/core/rand.h, llmc/core/model.h param_init_chunk)
#
# Every value is a pure function of (seed, tensor index, element index): a
# SplitMix64-style hash gives two 53-bit uniforms, Box-Muller in double, then
# fp32. torch has no unsigned 64-bit arithmetic on every device, so the hash
# runs in int64 (multiplication and addition wrap the same way) with logical
# right shifts done as arithmetic shift plus mask.

M64 = (1 << 64) - 1


def _s64(c):
    c &= M64
    return c - (1 << 64) if c >= 1 << 63 else c


MIX1, MIX2 = _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)
GOLDEN, IDX_MUL, IDX_ADD = 0x9E3779B97F4A7C15, _s64(0xD1B54A32D192ED03), _s64(0x632BE59BD9B4E019)


def _mix64_int(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _srl(z, k):
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64_tensor(z):
    z = (z ^ _srl(z, 30)) * MIX1
    z = (z ^ _srl(z, 27)) * MIX2
    return z ^ _srl(z, 31)


def _rand_u64_tensor(seed, stream, index):
    h = _s64(_mix64_int((seed + GOLDEN * (stream + 1)) & M64))
    return _mix64_tensor(h ^ (index * IDX_MUL + IDX_ADD))


def rand_normal_tensor(seed, stream, index):
    """remat's rand_normal(seed, stream, index) for an int64 tensor of indices, as fp32."""
    a = _rand_u64_tensor(seed, stream, 2 * index)
    b = _rand_u64_tensor(seed, stream, 2 * index + 1)
    u1 = (_srl(a, 11).double() + 1.0) * (1.0 / 9007199254740992.0)
    u2 = _srl(b, 11).double() * (1.0 / 9007199254740992.0)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(6.283185307179586 * u2)).float()


def rand_normal_reference(seed, stream, index):
    """The same with Python integers and the math module: the check for the tensor version."""
    def u64(i):
        h = _mix64_int((seed + GOLDEN * (stream + 1)) & M64)
        return _mix64_int(h ^ ((i * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & M64))
    a, b = u64(2 * index), u64(2 * index + 1)
    u1 = ((a >> 11) + 1.0) * (1.0 / 9007199254740992.0)
    u2 = (b >> 11) * (1.0 / 9007199254740992.0)
    return float(np.float32(math.sqrt(-2.0 * math.log(u1)) * math.cos(6.283185307179586 * u2)))


def check_rng(device):
    """The int64 hash must wrap like uint64 on this device; a silent difference would change every weight."""
    idx = [0, 1, 2, 12345, 98_765_432, (1 << 40) + 7]
    got = rand_normal_tensor(1337, 4, torch.tensor(idx, dtype=torch.int64, device=device)).cpu().tolist()
    want = [rand_normal_reference(1337, 4, i) for i in idx]
    for g, w, i in zip(got, want, idx):
        if abs(g - w) > 2e-7 * max(1.0, abs(w)):  # a last-bit difference from the double log/cos is tolerable
            fail(f"remat init: random draw {i} is {g} on {device}, expected {w}: int64 arithmetic does not wrap here")


def remat_init(cfg, seed, device):
    """The 16 stacked tensors of remat's random init for `cfg` and `seed`."""
    check_rng(device)
    L = cfg["L"]
    std = {name: 0.0 for name in TENSOR_NAMES}
    std.update(wte=0.02, wpe=0.02, qkvw=0.02, fcw=0.02)
    residual = float(np.float32(0.02) / np.sqrt(np.float32(2.0 * L), dtype=np.float32))  # 0.02f / sqrtf(2.0f*L)
    std.update(attprojw=residual, fcprojw=residual)
    real_wte = cfg["V"] * cfg["C"]
    out = {}
    chunk = 1 << 23
    for t, (name, shape) in enumerate(zip(TENSOR_NAMES, tensor_shapes(cfg))):
        n = int(np.prod(shape))
        if std[name] == 0.0:
            fill = 1.0 if name in ("ln1w", "ln2w", "lnfw") else 0.0
            out[name] = torch.full(shape, fill, dtype=torch.float32, device=device)
            continue
        flat = torch.empty(n, dtype=torch.float32, device=device)
        s = torch.tensor(std[name], dtype=torch.float32, device=device)
        for start in range(0, n, chunk):
            e = torch.arange(start, min(n, start + chunk), dtype=torch.int64, device=device)
            v = s * rand_normal_tensor(seed, t, e)  # float32 product, as std * rand_normal(...) in C
            if name == "wte":
                v = torch.where(e < real_wte, v, torch.zeros_like(v))  # padded rows are zero
            flat[start:start + len(e)] = v
        out[name] = flat.view(shape)
    return out


# ---------------------------------------------------------------------------
# the model


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln1 = nn.LayerNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, 3 * C)
        self.attproj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C, eps=1e-5)
        self.fc = nn.Linear(C, 4 * C)
        self.fcproj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        heads = self.qkv(self.ln1(x)).view(B, T, 3, self.NH, C // self.NH)
        q, k, v = (heads[:, :, i].transpose(1, 2) for i in range(3))  # (B, NH, T, hs) each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(hs)
        x = x + self.attproj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        C = cfg["C"]
        self.wte = nn.Parameter(torch.zeros(cfg["Vp"], C))  # token embedding and LM head (tied)
        self.wpe = nn.Parameter(torch.zeros(cfg["maxT"], C))
        self.blocks = nn.ModuleList(Block(C, cfg["NH"]) for _ in range(cfg["L"]))
        self.lnf = nn.LayerNorm(C, eps=1e-5)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = F.embedding(idx, self.wte) + self.wpe[:T]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte)  # (B, T, Vp): the padded width keeps the matmul's shape round
        V = self.cfg["V"]
        if logits.shape[-1] > V:
            logits[..., V:] = float("-inf")  # softmax and loss over the real vocabulary only, as remat
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))

    def stacked_views(self):
        """(file tensor name, per-layer parameters) in file order."""
        per_layer = {"ln1w": "ln1.weight", "ln1b": "ln1.bias", "qkvw": "qkv.weight", "qkvb": "qkv.bias",
                     "attprojw": "attproj.weight", "attprojb": "attproj.bias", "ln2w": "ln2.weight",
                     "ln2b": "ln2.bias", "fcw": "fc.weight", "fcb": "fc.bias", "fcprojw": "fcproj.weight",
                     "fcprojb": "fcproj.bias"}
        out = []
        for name in TENSOR_NAMES:
            if name == "wte":
                out.append((name, [self.wte]))
            elif name == "wpe":
                out.append((name, [self.wpe]))
            elif name == "lnfw":
                out.append((name, [self.lnf.weight]))
            elif name == "lnfb":
                out.append((name, [self.lnf.bias]))
            else:
                out.append((name, [b.get_parameter(per_layer[name]) for b in self.blocks]))
        return out

    @torch.no_grad()
    def load_stacked(self, tensors):
        for name, params in self.stacked_views():
            src = tensors[name]
            if len(params) == 1:
                params[0].copy_(src)
            else:
                for layer, p in enumerate(params):
                    p.copy_(src[layer])

    def param_groups(self, weight_decay):
        decay, no_decay = [], []
        for name, params in self.stacked_views():
            (decay if name in DECAYED else no_decay).extend(params)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ---------------------------------------------------------------------------
# data: remat's order without shuffling (llmc/core/dataloader.h, one process)


class Loader:
    def __init__(self, pattern, B, T, V, device):
        paths = sorted(glob.glob(pattern))
        if not paths:
            fail(f"-i: no files match '{pattern}'")
        self.shards = []
        for p in paths:
            try:
                tokens = datafile.read_shard(p, mmap=True)
            except datafile.DataError as e:
                fail(str(e))
            if len(tokens) < B * T + 1:
                fail(f"{p}: {len(tokens)} tokens, too few for one batch of {B} x {T} + 1 tokens")
            top = int(tokens.max())
            if top >= V:
                fail(f"{p}: token {top} is out of range for vocabulary size {V}")
            self.shards.append(tokens)
        self.B, self.T, self.device = B, T, device
        self.shard, self.batch = 0, 0

    def batches_per_epoch(self):
        return sum((len(s) - 1) // (self.B * self.T) for s in self.shards)

    def next(self):
        BT = self.B * self.T
        tokens = self.shards[self.shard]
        window = torch.from_numpy(tokens[self.batch * BT:(self.batch + 1) * BT + 1].astype(np.int64))
        if self.device.type == "cuda":
            window = window.pin_memory().to(self.device, non_blocking=True)
        self.batch += 1
        if self.batch == (len(tokens) - 1) // BT:
            self.batch = 0
            self.shard = (self.shard + 1) % len(self.shards)
        return window[:-1].view(self.B, self.T), window[1:].view(self.B, self.T)


# ---------------------------------------------------------------------------
# schedule, FLOPs


def learning_rate(schedule, peak, final_frac, warmup, step, total):
    """llmc/run/schedule.h, with its float32 roundings; step is 0-based."""
    f32 = np.float32
    if step < warmup:
        return float(f32(peak) * f32(step + 1) / f32(warmup))
    if schedule == "constant" or total <= warmup + 1:
        return float(f32(peak))
    progress = min(1.0, (step - warmup) / (total - 1 - warmup))
    floor_lr = float(f32(peak)) * float(f32(final_frac))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return float(f32(floor_lr + (float(f32(peak)) - floor_lr) * shape))


def peak_flops(device, dtype):
    """Dense peak of the matmul datatype, remat's table (train_gpt.cu device_peak_flops); 0 if unknown."""
    if device.type != "cuda":
        return 0.0, "cpu"
    name = torch.cuda.get_device_name(device)
    bf16 = fp32 = 0.0
    if "H200" in name or "GH200" in name:
        bf16, fp32 = 989e12, 67e12
    elif "H100" in name and "PCIe" in name:
        bf16, fp32 = 756e12, 51e12
    elif "H100" in name:
        bf16, fp32 = 989e12, 67e12
    elif "A100" in name:
        bf16, fp32 = 312e12, 19.5e12
    return (bf16 if dtype == "bf16" else fp32), name


def mib(n):
    return n / 1048576.0


# ---------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description="Minimal PyTorch GPT-2 trainer: remat's side-by-side baseline "
                                "(same model, flags, data order and output words).")
    p.add_argument("-e", dest="model", default="d12", help="d6|d12|d24|d36|d48 (remat's init) or a model file (v3/v5)")
    p.add_argument("--model", dest="model_file", default="", help="a model file (the same as -e FILE)")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--heads", type=int, default=0)
    p.add_argument("--channels", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=0, help="V, padded to a multiple of 128 for the classifier")
    p.add_argument("--init", choices=["remat", "torch"], default="remat",
                   help="random init: remat's exact draws from --seed (default), or torch.randn (faster on CPU)")
    p.add_argument("-i", dest="train", default="data/tinyshakespeare/tiny_shakespeare_train.bin")
    p.add_argument("-b", dest="B", type=int, default=4)
    p.add_argument("-t", dest="T", type=int, default=1024)
    p.add_argument("-x", dest="steps", type=int, default=-1, help="steps (-1: one epoch of the data)")
    p.add_argument("-l", dest="lr", type=float, default=3e-4)
    p.add_argument("-k", dest="schedule", choices=["cosine", "linear", "constant"], default="cosine")
    p.add_argument("-u", dest="warmup", type=int, default=0)
    p.add_argument("-q", dest="final_frac", type=float, default=1.0)
    p.add_argument("-c", dest="weight_decay", type=float, default=0.0)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="CUDA: bf16 autocast (default) or plain fp32; the CPU always runs fp32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (off: compiling takes minutes)")
    a = p.parse_args(argv)
    for flag, v, lo in [("-b", a.B, 1), ("-t", a.T, 1), ("-x", a.steps, -1)]:
        if v < lo:
            p.error(f"{flag} {v} is below {lo}")
    return a


def resolve_model(a):
    path = a.model_file or (a.model if a.model not in DESCRIPTORS else "")
    if path:
        if a.layers or a.heads or a.channels or a.vocab_size or a.max_seq_len:
            fail(f"shape flags apply to random init only, not to the model file {path}")
        cfg, version, tensors = read_model_file(path)
        return cfg, tensors, f"{path} (version {version})"
    L, NH, C = DESCRIPTORS[a.model]
    cfg = dict(L=a.layers or L, NH=a.heads or NH, C=a.channels or C, maxT=a.max_seq_len or 1024,
               V=a.vocab_size or 50257)
    cfg["Vp"] = pad_vocab(cfg["V"])
    if cfg["C"] % cfg["NH"]:
        fail(f"channels {cfg['C']} not divisible by heads {cfg['NH']}")
    return cfg, None, f"{a.model}, random init ({a.init}) with seed {a.seed}"


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("no CUDA device (use --device cpu)")
    dtype = a.dtype if device.type == "cuda" else "fp32"
    cfg, tensors, desc = resolve_model(a)
    if a.T > cfg["maxT"]:
        fail(f"-t: sequence length {a.T} exceeds the model's maximum {cfg['maxT']}")
    loader = Loader(a.train, a.B, a.T, cfg["V"], device)  # data errors before the (slow on a CPU) init
    steps = a.steps if a.steps >= 0 else max(1, loader.batches_per_epoch())
    torch.manual_seed(a.seed)

    with device:  # parameters are created on the device (nn.Linear's own init is overwritten below)
        model = GPT2(cfg)
    if tensors is None:
        if a.init == "remat":
            tensors = remat_init(cfg, a.seed, device)
        else:
            tensors = {n: (torch.randn(s) * 0.02 if n in DECAYED else torch.zeros(s)) for n, s in
                       zip(TENSOR_NAMES, tensor_shapes(cfg))}
            for n in ("ln1w", "ln2w", "lnfw"):
                tensors[n].fill_(1.0)
            tensors["wte"][cfg["V"]:] = 0.0
    model.load_stacked(tensors)
    del tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the init's temporaries must not count as the trainer's memory
    num_params = sum(p.numel() for p in model.parameters())  # remat's count: wte with its padded rows

    groups = model.param_groups(a.weight_decay)
    opt_kw = dict(betas=(a.beta1, a.beta2), eps=a.eps)
    if device.type == "cuda":
        opt_kw["fused"] = True
    optimizer = torch.optim.AdamW(groups, lr=a.lr, **opt_kw)
    params = [p for g in groups for p in g["params"]]

    step_fn = model
    if a.compile:
        step_fn = torch.compile(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()

    tokens_per_step = a.B * a.T
    flops_per_step = (6.0 * (num_params - cfg["maxT"] * cfg["C"]) + 12.0 * cfg["L"] * cfg["C"] * a.T) * tokens_per_step
    peak, dev_name = peak_flops(device, dtype)

    print(f"torch_gpt2: PyTorch {torch.__version__}, device {dev_name}, {dtype}"
          f"{' autocast' if dtype == 'bf16' else ''}, SDPA attention, AdamW{' (fused)' if device.type == 'cuda' else ''}"
          f", {'torch.compile' if a.compile else 'eager'}")
    print(f"model: {desc}")
    print(f"  L={cfg['L']} NH={cfg['NH']} C={cfg['C']} V={cfg['V']} Vp={cfg['Vp']} maxT={cfg['maxT']}, "
          f"{num_params} parameters")
    print(f"batch: B={a.B} T={a.T} ({tokens_per_step} tokens per step)")
    if peak > 0:
        print(f"MFU: model FLOPs (PaLM convention, 6N + 12LCT per token) over {peak / 1e12:.0f} TFLOPS dense {dtype} peak")
    else:
        print("MFU: n/a (no peak FLOPS known for this device)")
    print(f"training: {steps} steps, lr {a.lr:g} {a.schedule} schedule, warmup {a.warmup}", flush=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    total_ms, timed, losses = 0.0, 0, []
    mem_after_step1 = None
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = loader.next()
        with autocast:
            loss = step_fn(x, y)
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))  # global L2 norm, as clip_grad_norm_
        if a.grad_clip > 0:  # remat: scale by clip/norm when norm > clip
            torch._foreach_mul_(grads, torch.clamp(a.grad_clip / norm, max=1.0))
        lr = learning_rate(a.schedule, a.lr, a.final_frac, a.warmup, step - 1, steps)
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_v, norm_v = loss.item(), norm.item()  # the step's only host sync, as remat's one per step
        ms = (time.perf_counter() - t0) * 1e3
        if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            fail(f"step {step}: loss {loss_v}, gradient norm {norm_v}: training diverged")
        if step > 1:
            total_ms += ms
            timed += 1
        losses.append(loss_v)
        extras = ""
        if device.type == "cuda":
            mfu = f"{100.0 * flops_per_step / (ms * 1e-3) / peak:.1f}%" if peak > 0 else "n/a"
            free_b, total_b = torch.cuda.mem_get_info(device)
            extras = f" | MFU {mfu} | device memory {mib(total_b - free_b):.0f} MiB"
        print(f"step {step:4d}/{steps} | loss {loss_v:.6f} | lr {lr:.4e} | norm {norm_v:.4f} | {ms:.2f} ms | "
              f"{tokens_per_step / (ms / 1e3):.0f} tok/s{extras}", flush=True)
        if step == 1 and device.type == "cuda":
            free_b, total_b = torch.cuda.mem_get_info(device)
            mem_after_step1 = mib(total_b - free_b)
            print(f"device memory after step 1: {mem_after_step1:.1f} MiB in use (cudaMemGetInfo: CUDA context, "
                  f"torch's caching allocator, other processes); allocator: "
                  f"{mib(torch.cuda.memory_allocated(device)):.1f} MiB allocated, "
                  f"{mib(torch.cuda.memory_reserved(device)):.1f} MiB reserved")

    avg = total_ms / timed if timed else None
    if timed:
        print(f"average step time {avg:.2f} ms over {timed} steps (first step excluded)")
    summary = dict(trainer="torch_gpt2", torch=torch.__version__, device=dev_name, dtype=dtype, compile=a.compile,
                   L=cfg["L"], C=cfg["C"], NH=cfg["NH"], V=cfg["V"], Vp=cfg["Vp"], B=a.B, T=a.T, steps=steps,
                   params=num_params, step1_loss=losses[0] if losses else None,
                   last_loss=losses[-1] if losses else None, avg_ms=avg,
                   tok_per_s=tokens_per_step / (avg / 1e3) if avg else None,
                   mfu=flops_per_step / (avg * 1e-3) / peak if avg and peak > 0 else None)
    if device.type == "cuda":
        peak_alloc, peak_res = mib(torch.cuda.max_memory_allocated(device)), mib(torch.cuda.max_memory_reserved(device))
        print(f"peak device memory: {peak_alloc:.1f} MiB allocated, {peak_res:.1f} MiB reserved "
              "(torch.cuda.max_memory_allocated / max_memory_reserved; without the CUDA context)")
        summary.update(peak_allocated_mib=round(peak_alloc, 1), peak_reserved_mib=round(peak_res, 1),
                       memory_after_step1_mib=round(mem_after_step1, 1) if mem_after_step1 is not None else None)
    print("summary " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
