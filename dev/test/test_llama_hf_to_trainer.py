"""The whole road a Hugging Face Llama or Qwen2 checkpoint takes: written here in transformers' layout (config.json,
safetensors), imported by dev/data/hf_llama.py, trained one step by train_gpt_cpu; its first loss must be the float64
numpy forward of transformers' semantics (test_llama_reference.reference_loss) on the checkpoint's own tensors, mapped
from Hugging Face's names here. The importer and the trainer were written against one format description by two
hands: this is where they must agree."""
import subprocess
import sys

import numpy as np
import pytest

import test_hf_llama as hf
import test_llama_reference as ref
from conftest import REPO, binary, datafile, run

B, T = 2, 32

CASES = {
    "llama-llama3-untied": (hf.llama_config, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-default-tied": (hf.llama_config, {"tie_word_embeddings": True}),
    "qwen2-biases-linear": (hf.qwen2_config, {"rope_scaling": {"type": "linear", "factor": 2.0}}),
}


def reference_config(config):
    """test_llama_reference's configuration dict, read from config.json's keys here (not through the importer)."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return ref.default_config(
        family=3 if config["model_type"] == "qwen2" else 2, L=config["num_hidden_layers"], C=config["hidden_size"],
        NH=config["num_attention_heads"], NKV=config["num_key_value_heads"], HD=config["head_dim"], F=config["intermediate_size"],
        eps=config["rms_norm_eps"], theta=config["rope_theta"], rope=kind, factor=scaling.get("factor", 1.0),
        low=scaling.get("low_freq_factor", 0.0), high=scaling.get("high_freq_factor", 0.0),
        original=scaling.get("original_max_position_embeddings", 0), bias=1 if config["model_type"] == "qwen2" else 0,
        tied=config["tie_word_embeddings"])


def reference_params(config, state):
    """The reference's tensors from Hugging Face's names: q/k/v and gate/up stacked as the reference splits them."""
    L = config["num_hidden_layers"]
    layer = lambda i, name: state[f"model.layers.{i}.{name}"]
    stack = lambda f: np.stack([f(i) for i in range(L)])
    p = {"wte": state["model.embed_tokens.weight"], "lnfw": state["model.norm.weight"],
         "ln1w": stack(lambda i: layer(i, "input_layernorm.weight")),
         "ln2w": stack(lambda i: layer(i, "post_attention_layernorm.weight")),
         "qkvw": stack(lambda i: np.concatenate([layer(i, f"self_attn.{x}_proj.weight") for x in "qkv"])),
         "attprojw": stack(lambda i: layer(i, "self_attn.o_proj.weight")),
         "fcw": stack(lambda i: np.concatenate([layer(i, "mlp.gate_proj.weight"), layer(i, "mlp.up_proj.weight")])),
         "fcprojw": stack(lambda i: layer(i, "mlp.down_proj.weight"))}
    if config["model_type"] == "qwen2":
        p["qkvb"] = stack(lambda i: np.concatenate([layer(i, f"self_attn.{x}_proj.bias") for x in "qkv"]))
    if not config["tie_word_embeddings"]:
        p["lm_head"] = state["lm_head.weight"]
    return p


@pytest.mark.parametrize("name", list(CASES))
def test_imported_checkpoint_trains_from_transformers_loss(tmp_path, monkeypatch, name):
    make, over = CASES[name]
    config = make(**over)
    state = hf.hf_state(config, np.random.default_rng(3))
    hf.write_hf(tmp_path / "hf", config, state)
    res = subprocess.run([sys.executable, REPO / "dev/data/hf_llama.py", "import", tmp_path / "hf", tmp_path / "m.bin"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, config["vocab_size"], B * T + 1)
    datafile.write_shard(tmp_path / "t.bin", tokens)
    out = run([binary("train_gpt_cpu"), "-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-b", B, "-t", T,
               "-x", "1", "-s", "0"], check=True)
    monkeypatch.setattr(ref, "V", config["vocab_size"])  # the reference's logits over the real vocabulary
    inputs, targets = tokens[:B * T].reshape(B, T), tokens[1:].reshape(B, T)
    positions = np.tile(np.arange(T), (B, 1))
    expected = ref.reference_loss(reference_config(config), reference_params(config, state), inputs, targets, positions)
    assert abs(ref.first_loss(out.stdout) - expected) < 1e-5 * expected, (ref.first_loss(out.stdout), expected)
