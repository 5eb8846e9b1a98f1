"""The GPU trainer (train_gpt.cu) on the Llama family, under the CPU emulator of CUDA (dev/emu): a checkpoint written
here in Hugging Face's layout (test_hf_llama's writer), imported by dev/data/hf_llama.py, trains a few steps emulated
and by the CPU reference train_gpt_cpu on the same tokens; the losses must agree within bf16's tolerance, and every
recompute setting (with an offloaded layer too) must print -r 0's steps bit for bit, and the settings at one token tile
size those of -r 0 at that size (the slow set). The block's switches:
RMSNorm, RoPE (llama3 and linear scalings), SwiGLU, no biases (Llama) or Q/K/V biases (Qwen2), an untied (Llama) or
tied (Qwen2) head; K/V heads as many as query heads, or fewer (grouped-query attention, Llama's NKV 2 for NH 4), and
NH x HD = C. test_gpt's Llama cases (test_emu.py) compare every tensor; this is the
trainer's own path (the model file, the flags, the driver). Emulated: no GPU verification (dev/emu/README.md)."""
import subprocess
import sys

import numpy as np
import pytest

import test_hf_llama as hf
from conftest import REPO, binary, datafile, run
from emu_support import OUT, emu_run, explain, slow
from test_train_emu import steps

B, T, STEPS = 2, 32, 4
CASES = {
    "llama-llama3-untied": (hf.llama_config, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2-biases-linear-tied": (hf.qwen2_config, {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "llama-grouped-query": (hf.llama_config, {"num_key_value_heads": hf.NH // 2}),
}
# Each group against its first: the modes untiled (with an offloaded layer), and at one token tile size (tiles sum
# the weight gradients in fp32 across tiles: bitwise among themselves, not with the untiled run).
MODE_GROUPS = [[["-r", "0"], ["-r", "1"], ["-r", "2"], ["-r", "3"], ["-r", "1:0/2:1"], ["-r", "1", "--offload-checkpoints"]],
               [["-r", "0", "--tile-tokens", "24"], ["-r", "2", "--tile-tokens", "24"], ["-r", "1:0/3:1", "--tile-tokens", "24"]]]


def imported_model(tmp_path, make, over):
    """A Hugging Face checkpoint (HD = C / NH; NKV = NH unless `over` says) imported into a model file, and a token
    shard."""
    config = make(**{"num_key_value_heads": hf.NH, "head_dim": hf.C // hf.NH, **over})
    hf.write_hf(tmp_path / "hf", config, hf.hf_state(config, np.random.default_rng(5)))
    res = subprocess.run([sys.executable, REPO / "dev/data/hf_llama.py", "import", tmp_path / "hf", tmp_path / "m.bin"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    datafile.write_shard(tmp_path / "t.bin", np.random.default_rng(7).integers(0, config["vocab_size"], 4000))
    return ["-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-b", B, "-t", T, "-x", STEPS, "-l", "3e-3", "-s", "0"]


def losses(out):
    return [float(s[1]) for s in steps(out)]


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_gpu_trains_an_imported_llama_as_the_cpu(emu_build, tmp_path, name):
    flags = imported_model(tmp_path, *CASES[name])
    cpu = run([binary("train_gpt_cpu"), *flags], check=True)
    ref = losses(cpu.stdout)
    assert len(ref) == STEPS
    gpu = emu_run([OUT / "emu_train_gpt_bf16", *flags, "-r", "0"])
    assert gpu.returncode == 0, explain(gpu)
    got = losses(gpu.stdout)
    assert len(got) == STEPS, gpu.stdout[-2000:]
    for step, (g, c) in enumerate(zip(got, ref), 1):  # bf16 storage against fp32: a few parts in a thousand
        assert abs(g - c) < 1e-2 * c, f"step {step}: emulated GPU {g} vs CPU {c}"


@slow
@pytest.mark.parametrize("name", list(CASES))
def test_emulated_gpu_llama_modes_bitwise(emu_build, tmp_path, name):
    flags = imported_model(tmp_path, *CASES[name])
    for group in MODE_GROUPS:
        base = None
        for mode in group:
            res = emu_run([OUT / "emu_train_gpt_bf16", *flags, *mode])
            assert res.returncode == 0, " ".join(mode) + "\n" + explain(res)
            got = steps(res.stdout)
            assert len(got) == STEPS, res.stdout[-2000:]
            base = base or got
            assert got == base, f"{' '.join(mode)}: {got} != {' '.join(group[0])}: {base}"
