#!/usr/bin/env python3
"""bench_llama_cpu.py: the CPU reference's training step on a Llama shape, beside transformers + torch.

remat's side: train_gpt_cpu -e PRESET (random init, the shape of the model's config.json) on random tokens, -b B
-t T, -x STEPS; its "average step time" line (first step excluded). The other side, where torch and transformers
are installed: LlamaForCausalLM built from the same shape (random init), fp32, the same number of threads, the same
tokens, forward + backward + AdamW per step, the first step excluded too. Nothing is tuned to win or to lose; the
two sides run one after the other on the same machine, so compare the ratio, not the absolute times.

usage: python3 dev/bench/bench_llama_cpu.py [--preset smollm2-135m] [-t 1024] [-b 1] [-x 4] [--threads N]
Prints one line per side and a final "summary {json}" line; a side that cannot run says why.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "data"))
import datafile  # noqa: E402

# The presets this script knows, as config.json keys (llmc/core/model.h's table holds the same shapes).
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def remat_step_ms(args, shard, threads):
    exe = REPO / "train_gpt_cpu"
    if not exe.exists():
        return None, "train_gpt_cpu is not built (make train_gpt_cpu)"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    res = subprocess.run([str(exe), "-e", args.preset, "-i", str(shard), "-j", "", "-b", str(args.b), "-t", str(args.t),
                          "-x", str(args.x), "-s", "0", "-v", "0"], capture_output=True, text=True, env=env, cwd=REPO)
    m = re.search(r"average step time ([0-9.]+) ms", res.stdout)
    if res.returncode != 0 or not m:
        return None, f"train_gpt_cpu failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}"
    return float(m.group(1)), ""


def torch_step_ms(args, tokens, threads):
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        return None, f"not run: {e.name} is not installed"
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    shape = SHAPES[args.preset]
    model = LlamaForCausalLM(LlamaConfig(**shape, hidden_act="silu", attention_bias=False, mlp_bias=False))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    n = args.b * args.t
    times = []
    for step in range(args.x):
        window = torch.from_numpy(tokens[step * n: step * n + n + 1].astype(np.int64))
        inputs, targets = window[:-1].view(args.b, args.t), window[1:].view(args.b, args.t)
        t0 = time.perf_counter()
        loss = model(input_ids=inputs, labels=None).logits
        loss = torch.nn.functional.cross_entropy(loss.view(-1, loss.size(-1)), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return 1e3 * sum(times[1:]) / max(len(times) - 1, 1), ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("-t", type=int, default=1024)
    ap.add_argument("-b", type=int, default=1)
    ap.add_argument("-x", type=int, default=4, help="steps (the first is excluded from the mean)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    if args.x < 2:
        sys.exit("bench_llama_cpu.py: -x must be at least 2 (the first step is excluded)")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPES[args.preset]["vocab_size"], args.x * args.b * args.t + 1)
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "tokens.bin"
        datafile.write_shard(shard, tokens)
        remat_ms, remat_why = remat_step_ms(args, shard, args.threads)
    torch_ms, torch_why = torch_step_ms(args, tokens, args.threads)
    print(f"{args.preset} B={args.b} T={args.t}, {args.threads} threads")
    print(f"  train_gpt_cpu:            {remat_ms:.1f} ms/step" if remat_ms else f"  train_gpt_cpu:            {remat_why}")
    print(f"  transformers + torch:     {torch_ms:.1f} ms/step" if torch_ms else f"  transformers + torch:     {torch_why}")
    if remat_ms and torch_ms:
        print(f"  ratio (torch / remat):    {torch_ms / remat_ms:.2f}")
    print("summary " + json.dumps({"preset": args.preset, "B": args.b, "T": args.t, "threads": args.threads,
                                   "remat_ms": remat_ms, "torch_ms": torch_ms}))


if __name__ == "__main__":
    main()
