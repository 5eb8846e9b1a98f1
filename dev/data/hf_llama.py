#!/usr/bin/env python3
"""Llama and Qwen2 checkpoints between Hugging Face's layout and remat's model files.

    python3 dev/data/hf_llama.py import HF_DIR OUT.bin [--dtype fp32|bf16]
    python3 dev/data/hf_llama.py export MODEL.bin OUT_DIR [--dtype fp32|bf16|fp16]

import: HF_DIR holds config.json (LlamaForCausalLM or Qwen2ForCausalLM) and
model.safetensors, or shards named by model.safetensors.index.json; tensors may
be F32, BF16, F16 or F64 (read without torch, each exactly as float32). It writes
a version-7 (fp32, default) or version-8 (bf16, round to nearest even) model file
(docs/FORMATS.md) whose header names every switch: K/V heads, head size, MLP
width, RMSNorm epsilon, RoPE theta and scaling (rope_scaling with `rope_type` or
the older `type`, or transformers 5's rope_parameters: default, linear, llama3,
yarn), biases (Qwen2's q/k/v; Llama's attention_bias and mlp_bias), a tied or
untied head, bos/eos and max_position_embeddings. q_proj/k_proj/v_proj are
stacked as they are (Q heads, K heads, V heads: Hugging Face's rotate_half
pairing, no permutation); gate_proj and up_proj as the rows [gate; up] of fcw;
the token table (and an untied lm_head) padded with zero rows to a multiple of
128. What the file cannot hold is refused in one line: a sliding window in use,
another rope type, mixtures of experts, partial rotary, an activation other than
silu, head_dim or sizes that do not agree with the tensors, an unexpected tensor.

export: OUT_DIR/config.json (architectures, model_type and every field
transformers needs, rope_scaling written back, max_position_embeddings the larger
of the imported one and the model's sequence length), model.safetensors and
generation_config.json (bos/eos). Tensors are written in the model file's
precision (version 7: F32, 8: BF16) unless --dtype says otherwise (fp16: F16,
rounded to nearest even), so a checkpoint imported and exported in its own
precision comes back bit for bit.

Only numpy is needed (safetensors is read and written here).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402
import hf_gpt2  # noqa: E402
import model_config as mc  # noqa: E402
from datafile import DataError  # noqa: E402

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
FAMILY_IDS = {"llama": 2, "qwen2": 3}
ROPE_IDS = {name: i for i, name in mc.ROPE_TYPES.items()}
IGNORED = re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # a buffer of old checkpoints
INDEX = "model.safetensors.index.json"


# --- reading a checkpoint ---------------------------------------------------------------


class Checkpoint:
    """The tensors of a Hugging Face directory, read one at a time (a model of
    billions of parameters never sits whole in memory as float32)."""

    def __init__(self, hf_dir: Path):
        self.where = str(hf_dir)
        self.entries: dict[str, tuple] = {}  # name -> (mapped file, entry)
        if (hf_dir / "model.safetensors").is_file():
            files = [hf_dir / "model.safetensors"]
        elif (hf_dir / INDEX).is_file():
            files = self._shards(hf_dir)
        else:
            raise DataError(f"{hf_dir}: neither model.safetensors nor {INDEX}")
        for path in files:
            data, entries = hf_gpt2.safetensors_entries(path)
            for name, entry in entries.items():
                if name in self.entries:
                    raise DataError(f"{path}: tensor {name} is in two shards")
                self.entries[name] = (data, entry, path)
        self.used: set[str] = set()

    def _shards(self, hf_dir: Path) -> list[Path]:
        where = hf_dir / INDEX
        try:
            index = json.loads(where.read_text())
        except ValueError as e:
            raise DataError(f"{where}: not JSON ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise DataError(f"{where}: no weight_map of tensor names to shard files")
        files = sorted(set(weight_map.values()))
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                raise DataError(f"{where}: shard {name!r} is not a file name in {hf_dir}")
            if not (hf_dir / name).is_file():
                raise DataError(f"{where}: shard {name} is missing")
        self.weight_map = weight_map
        return [hf_dir / name for name in files]

    def check_index(self) -> None:
        for name, shard in getattr(self, "weight_map", {}).items():
            if name not in self.entries or self.entries[name][2].name != shard:
                raise DataError(f"{self.where}/{INDEX}: tensor {name} is not in its shard {shard}")

    def key(self, name: str) -> str | None:
        for key in (name, name.removeprefix("model.")):
            if key in self.entries:
                return key
        return None

    def get(self, name: str, shape: tuple, optional: bool = False) -> np.ndarray | None:
        key = self.key(name)
        if key is None:
            if optional:
                return None
            raise DataError(f"{self.where}: tensor {name} is missing")
        data, entry, path = self.entries[key]
        if tuple(entry[1]) != shape:
            raise DataError(f"{path}: tensor {key} has shape {tuple(entry[1])}, expected {shape} (from config.json)")
        with np.errstate(over="ignore"):  # F64 beyond float32's range becomes inf, refused by name below
            arr = hf_gpt2.safetensors_tensor(data, entry)
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            index = ", ".join(map(str, np.unravel_index(bad[0], arr.shape)))
            raise DataError(f"{path}: tensor {key}[{index}] is {arr.flat[bad[0]]} "
                            f"({bad.size} of {arr.size} values are not finite as float32)")
        self.used.add(key)
        return arr

    def dtypes(self) -> set[str]:
        return {entry[4] for _, entry, _ in self.entries.values()}

    def check_nothing_else(self) -> None:
        for key in self.entries:
            if key not in self.used and not IGNORED.fullmatch(key):
                raise DataError(f"{self.where}: unexpected tensor {key}: not part of a model the file can hold")


def read_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise DataError(f"{hf_dir}: no config.json (a Hugging Face model directory has one)")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: a JSON {type(config).__name__}, not an object of settings")
    return config


# --- config.json -> the header's switches -----------------------------------------------------


def _int(config: dict, key: str, where: str, default=None, low: int = 1) -> int:
    value = config.get(key)
    value = default if value is None else value  # null means absent, as transformers reads it
    if value is None:
        raise DataError(f"{where}: {key} missing (an integer)")
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= mc.MAX_INT32:
        raise DataError(f"{where}: {key} {value!r} is not an integer in [{low}, {mc.MAX_INT32}]")
    return value


def _float(d: dict, key: str, where: str, default=None, positive: bool = True) -> float:
    value = d.get(key)
    value = default if value is None else value  # null means absent
    if value is None:
        raise DataError(f"{where}: {key} missing (a number)")
    if not hf_gpt2._is_number(value) or not math.isfinite(value) or (positive and value <= 0) or abs(value) >= 3.4e38:
        raise DataError(f"{where}: {key} {value!r} is not a {'positive ' if positive else ''}finite number")
    return mc.fp32(value)


def rope_from_config(config: dict, where: str) -> dict:
    """RoPE theta and scaling of a config in any spelling: rope_theta with rope_scaling
    ({"rope_type": ...} or the older {"type": ...}), or transformers 5's rope_parameters."""
    scaling = config.get("rope_scaling")
    theta_from = config
    spelling = "rope_scaling"
    if config.get("rope_parameters") is not None:
        scaling, theta_from, spelling = config["rope_parameters"], config["rope_parameters"], "rope_parameters"
        if isinstance(scaling, dict) and any(isinstance(v, dict) for v in scaling.values()):
            raise DataError(f"{where}: rope_parameters per layer type (sliding and full attention) is not supported")
    if scaling is not None and not isinstance(scaling, dict):
        raise DataError(f"{where}: {spelling} {scaling!r} is not an object")
    scaling = scaling or {}
    theta = _float(theta_from, "rope_theta", where, config.get("rope_theta") or 10000.0)
    kinds = {scaling[k] for k in ("rope_type", "type") if scaling.get(k) is not None}
    if len(kinds) > 1:
        raise DataError(f"{where}: {spelling} says rope_type {scaling['rope_type']!r} and type {scaling['type']!r}")
    kind = kinds.pop() if kinds else "default"
    if kind not in ROPE_IDS:
        raise DataError(f"{where}: {spelling} type {kind!r} is not supported (default, linear, llama3, yarn)")
    prf = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise DataError(f"{where}: partial_rotary_factor {prf!r}: remat rotates the whole head")
    rope = {"rope_theta": theta, "rope_scaling": ROPE_IDS[kind], "rope_factor": 1.0, "rope_low": 0.0, "rope_high": 0.0,
            "rope_original_max": 0, "rope_attention_factor": 0.0}
    w = f"{where}: {spelling}"
    if kind != "default":
        rope["rope_factor"] = _float(scaling, "factor", w)
    if kind == "llama3":
        rope["rope_low"] = _float(scaling, "low_freq_factor", w)
        rope["rope_high"] = _float(scaling, "high_freq_factor", w)
        rope["rope_original_max"] = _int(scaling, "original_max_position_embeddings", w)
        if not rope["rope_high"] > rope["rope_low"]:
            raise DataError(f"{w}: high_freq_factor {rope['rope_high']} must exceed low_freq_factor {rope['rope_low']}")
    if kind == "yarn":
        rope["rope_low"] = _float(scaling, "beta_fast", w, 32.0)
        rope["rope_high"] = _float(scaling, "beta_slow", w, 1.0)
        # 0: absent (transformers then uses max_position_embeddings, header slot 27)
        rope["rope_original_max"] = _int(scaling, "original_max_position_embeddings", w, 0, low=0)
        if scaling.get("attention_factor") is not None:
            rope["rope_attention_factor"] = _float(scaling, "attention_factor", w)
        for key in ("mscale", "mscale_all_dim"):
            if scaling.get(key) not in (None, 0):
                raise DataError(f"{w}: {key} {scaling[key]!r} is not supported (DeepSeek's yarn variant)")
        if scaling.get("truncate", True) is not True:
            raise DataError(f"{w}: truncate {scaling['truncate']!r} is not supported (remat truncates yarn's bounds)")
    return rope


def _token_id(config: dict, key: str, where: str, vocab: int) -> int:
    value = config.get(key)
    if isinstance(value, list):
        if not value:
            return -1
        if len(value) > 1:
            print(f"note: {where}: {key} {value}: the model file keeps the first, {value[0]}")
        value = value[0]
    if value is None:
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise DataError(f"{where}: {key} {value!r} is not a token of the vocabulary ({vocab})")
    return value


def cfg_from_config(config: dict, where: str) -> dict:
    """The model file's configuration from a Llama or Qwen2 config.json, refusing
    what the file cannot hold."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise DataError(f"{where}: model_type {model_type!r}: hf_llama.py converts llama and qwen2 "
                        "(LlamaForCausalLM, Qwen2ForCausalLM)")
    archs = config.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[model_type]]:
        raise DataError(f"{where}: architectures {archs!r}: expected [{ARCHITECTURES[model_type]!r}]")
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
        if config.get(key):
            raise DataError(f"{where}: {key} {config[key]!r}: mixtures of experts are not supported")
    if config.get("use_sliding_window"):
        raise DataError(f"{where}: use_sliding_window true: remat's attention has no sliding window")
    if config.get("layer_types") is not None and any(t != "full_attention" for t in config["layer_types"]):
        raise DataError(f"{where}: layer_types {sorted(set(config['layer_types']))}: only full_attention is supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise DataError(f"{where}: hidden_act {act!r}: remat's SwiGLU gates with silu")
    V = _int(config, "vocab_size", where)
    C = _int(config, "hidden_size", where)
    L = _int(config, "num_hidden_layers", where)
    NH = _int(config, "num_attention_heads", where)
    NKV = _int(config, "num_key_value_heads", where, NH)
    F = _int(config, "intermediate_size", where)
    maxpos = _int(config, "max_position_embeddings", where)
    if config.get("head_dim") is None and C % NH:
        raise DataError(f"{where}: hidden_size {C} is not divisible by num_attention_heads {NH} and head_dim is not given")
    HD = _int(config, "head_dim", where, C // NH)
    if NH % NKV:
        raise DataError(f"{where}: num_attention_heads {NH} is not a multiple of num_key_value_heads {NKV}")
    if HD % 2:
        raise DataError(f"{where}: head_dim {HD} is odd: RoPE rotates pairs")
    if V > df.MAX_VOCAB:
        raise DataError(f"{where}: vocab_size {V}: the trainers hold at most {df.MAX_VOCAB}")
    if model_type == "qwen2":  # q/k/v always carry biases, o_proj and the MLP never
        biases = mc.BIAS_QKV
    else:
        for key in ("attention_bias", "mlp_bias"):
            if not isinstance(config.get(key, False), bool):
                raise DataError(f"{where}: {key} {config[key]!r} is not true or false")
        biases = (mc.BIAS_QKV | mc.BIAS_ATTPROJ) * config.get("attention_bias", False) + mc.BIAS_MLP * config.get("mlp_bias", False)
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise DataError(f"{where}: tie_word_embeddings {tied!r} is not true or false")
    cfg = {"max_seq_len": maxpos, "vocab_size": V, "num_layers": L, "num_heads": NH, "channels": C,
           "padded_vocab_size": df.pad_vocab(V), "family": FAMILY_IDS[model_type], "num_kv_heads": NKV, "head_dim": HD,
           "ffn_dim": F, "norm": mc.NORM_RMSNORM, "norm_eps": _float(config, "rms_norm_eps", where, 1e-6),
           "positions": mc.POS_ROPE, **rope_from_config(config, where), "mlp": mc.MLP_SWIGLU, "biases": biases,
           "tied": int(tied), "bos": _token_id(config, "bos_token_id", where, V),
           "eos": _token_id(config, "eos_token_id", where, V), "hf_max_position_embeddings": maxpos}
    mc.check_config(cfg, where)
    return cfg


def dropout_from_config(config: dict, where: str) -> dict:
    p = config.get("attention_dropout", 0.0)
    if not hf_gpt2._is_number(p) or not 0.0 <= p <= df.MODEL_DROPOUT_MAX:
        raise DataError(f"{where}: attention_dropout {p!r} is not a dropout probability in [0, {df.MODEL_DROPOUT_MAX}]")
    return {"embd_pdrop": 0.0, "attn_pdrop": float(p), "resid_pdrop": 0.0}


# --- import ---------------------------------------------------------------------------------


def _padded(arr: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, arr.shape[1]), np.float32)
    out[:len(arr)] = arr
    return out


def params_from_checkpoint(cfg: dict, ckpt: Checkpoint) -> dict:
    """Every tensor of tensor_shapes(cfg) from Hugging Face's names (with or without `model.`)."""
    V, Vp, C, L = cfg["vocab_size"], cfg["padded_vocab_size"], cfg["channels"], cfg["num_layers"]
    NH, NKV, HD, F, bias = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["ffn_dim"], cfg["biases"]
    wte = ckpt.get("model.embed_tokens.weight", (V, C))
    params = {"wte": _padded(wte, Vp)}
    head = ckpt.get("lm_head.weight", (V, C), optional=bool(cfg["tied"]))
    if cfg["tied"] and head is not None and not np.array_equal(head, wte):
        raise DataError(f"{ckpt.where}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    if not cfg["tied"]:
        params["lm_head"] = _padded(head, Vp)
    # (file tensor, [(HF name, shape)], present): stacked rows of several HF tensors, per layer
    attn = "model.layers.{}.self_attn."
    mlp = "model.layers.{}.mlp."
    parts = [
        ("ln1w", [("model.layers.{}.input_layernorm.weight", (C,))], True),
        ("qkvw", [(attn + "q_proj.weight", (NH * HD, C)), (attn + "k_proj.weight", (NKV * HD, C)),
                  (attn + "v_proj.weight", (NKV * HD, C))], True),
        ("qkvb", [(attn + "q_proj.bias", (NH * HD,)), (attn + "k_proj.bias", (NKV * HD,)),
                  (attn + "v_proj.bias", (NKV * HD,))], bias & mc.BIAS_QKV),
        ("attprojw", [(attn + "o_proj.weight", (C, NH * HD))], True),
        ("attprojb", [(attn + "o_proj.bias", (C,))], bias & mc.BIAS_ATTPROJ),
        ("ln2w", [("model.layers.{}.post_attention_layernorm.weight", (C,))], True),
        ("fcw", [(mlp + "gate_proj.weight", (F, C)), (mlp + "up_proj.weight", (F, C))], True),
        ("fcb", [(mlp + "gate_proj.bias", (F,)), (mlp + "up_proj.bias", (F,))], bias & mc.BIAS_MLP),
        ("fcprojw", [(mlp + "down_proj.weight", (C, F))], True),
        ("fcprojb", [(mlp + "down_proj.bias", (C,))], bias & mc.BIAS_MLP),
    ]
    for ours, theirs, present in parts:
        if present:
            params[ours] = np.stack([np.concatenate([ckpt.get(name.format(i), shape) for name, shape in theirs])
                                     for i in range(L)])
    params["lnfw"] = ckpt.get("model.norm.weight", (C,))
    ckpt.check_nothing_else()
    ckpt.check_index()
    return params


def cmd_import(args) -> None:
    df.refuse_directory(args.out, "import: OUT")
    hf_dir = Path(args.hf_dir)
    config = read_config(hf_dir)
    where = str(hf_dir / "config.json")
    cfg = cfg_from_config(config, where)
    dropout = dropout_from_config(config, where)
    run_id, file_version = _remat_record(config, where)
    ckpt = Checkpoint(hf_dir)
    params = params_from_checkpoint(cfg, ckpt)
    if args.dtype is None:  # an export of a remat file: its own precision, so the file comes back byte for byte
        args.dtype = "bf16" if file_version == mc.VERSION_BF16 else "fp32"
    version = mc.VERSION_BF16 if args.dtype == "bf16" else mc.VERSION_FP32
    mc.write_model(args.out, cfg, params, version, dropout, run_id)
    rope = mc.ROPE_TYPES[cfg["rope_scaling"]]
    print(f"{args.out}: {config['model_type']} L={cfg['num_layers']} NH={cfg['num_heads']} NKV={cfg['num_kv_heads']} "
          f"HD={cfg['head_dim']} C={cfg['channels']} F={cfg['ffn_dim']} V={cfg['vocab_size']} "
          f"(padded {cfg['padded_vocab_size']}), RoPE theta {cfg['rope_theta']:g} {rope}, "
          f"{'tied' if cfg['tied'] else 'untied'} head, {mc.num_parameters(cfg):,} parameters, "
          f"version {version} ({args.dtype}; checkpoint {'/'.join(sorted(ckpt.dtypes()))})")


def _remat_record(config: dict, where: str) -> tuple[int, int]:
    """(run id, model file version) an export kept in config.json."""
    run_id, version = config.get("remat_run_id", "0" * 16), config.get("remat_model_version", 0)
    if not (isinstance(run_id, str) and len(run_id) == 16 and all(c in "0123456789abcdef" for c in run_id)):
        raise DataError(f"{where}: remat_run_id {run_id!r} is not 16 lowercase hex digits")
    if version not in (0, mc.VERSION_FP32, mc.VERSION_BF16):
        raise DataError(f"{where}: remat_model_version {version!r} is not 7 or 8")
    return int(run_id, 16), version


# --- export ---------------------------------------------------------------------------------


def rope_to_config(cfg: dict) -> tuple[dict | None, dict]:
    """(rope_scaling, rope_parameters) of the header's RoPE: transformers 4's
    spelling and transformers 5's, which carries the theta too."""
    kind = mc.ROPE_TYPES[cfg["rope_scaling"]]
    scaling = {"rope_type": kind}
    if kind != "default":
        scaling["factor"] = cfg["rope_factor"]
    if kind == "llama3":
        scaling.update(low_freq_factor=cfg["rope_low"], high_freq_factor=cfg["rope_high"],
                       original_max_position_embeddings=cfg["rope_original_max"])
    if kind == "yarn":
        scaling.update(beta_fast=cfg["rope_low"], beta_slow=cfg["rope_high"])
        if cfg["rope_original_max"]:
            scaling["original_max_position_embeddings"] = cfg["rope_original_max"]
        if cfg["rope_attention_factor"]:
            scaling["attention_factor"] = cfg["rope_attention_factor"]
    return (None if kind == "default" else scaling), {**scaling, "rope_theta": cfg["rope_theta"]}


def _short(x: float) -> float:
    """float32 to the shortest decimal that reads back as the same float32 (1e-06, not 9.99999997e-07)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-")) if x else 0.0


def config_from_cfg(cfg: dict, dropout: dict, dtype: str) -> dict:
    family = mc.FAMILIES[cfg["family"]]
    where = f"a {family} model"
    if family not in ARCHITECTURES:
        raise DataError(f"{where}: hf_llama.py exports llama and qwen2 (GPT-2: dev/data/hf_gpt2.py)")
    needs = [(cfg["norm"] == mc.NORM_RMSNORM, "LayerNorm"), (cfg["positions"] == mc.POS_ROPE, "a learned position table"),
             (cfg["mlp"] == mc.MLP_SWIGLU, "a GELU MLP")]
    llama_biases = {0, mc.BIAS_QKV | mc.BIAS_ATTPROJ, mc.BIAS_MLP, mc.BIAS_QKV | mc.BIAS_ATTPROJ | mc.BIAS_MLP}
    needs.append((cfg["biases"] == mc.BIAS_QKV if family == "qwen2" else cfg["biases"] in llama_biases,
                  f"biases {cfg['biases']} (Qwen2: q/k/v only, 1; Llama: attention_bias covers q, k, v and o, mlp_bias the MLP)"))
    for ok, what in needs:
        if not ok:
            raise DataError(f"{where} with {what} has no {ARCHITECTURES[family]} config")
    rope_scaling, rope_parameters = rope_to_config(cfg)
    for d in (rope_scaling or {}, rope_parameters):
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = _short(v)
    maxpos = max(cfg["hf_max_position_embeddings"], cfg["max_seq_len"])
    config = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "vocab_size": cfg["vocab_size"], "hidden_size": cfg["channels"], "intermediate_size": cfg["ffn_dim"],
        "num_hidden_layers": cfg["num_layers"], "num_attention_heads": cfg["num_heads"],
        "num_key_value_heads": cfg["num_kv_heads"], "head_dim": cfg["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": maxpos, "rms_norm_eps": _short(cfg["norm_eps"]),
        "rope_theta": _short(cfg["rope_theta"]), "rope_scaling": rope_scaling, "rope_parameters": rope_parameters,
        "attention_dropout": _short(dropout["attn_pdrop"]), "tie_word_embeddings": bool(cfg["tied"]),
        "bos_token_id": cfg["bos"] if cfg["bos"] >= 0 else None, "eos_token_id": cfg["eos"] if cfg["eos"] >= 0 else None,
        "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
    }
    if family == "llama":
        config.update(attention_bias=bool(cfg["biases"] & mc.BIAS_QKV), mlp_bias=bool(cfg["biases"] & mc.BIAS_MLP),
                      pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_layers"])
    return config


def hf_tensors(cfg: dict, params: dict) -> dict:
    """Hugging Face's state dict of the model file's tensors (float32; the padding rows dropped)."""
    V, L = cfg["vocab_size"], cfg["num_layers"]
    NH, NKV, HD, F = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["ffn_dim"]
    q, k = NH * HD, NKV * HD
    out = {"model.embed_tokens.weight": params["wte"][:V], "model.norm.weight": params["lnfw"]}
    if not cfg["tied"]:
        out["lm_head.weight"] = params["lm_head"][:V]
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = params["ln1w"][i]
        out[p + "post_attention_layernorm.weight"] = params["ln2w"][i]
        for suffix, ours in (("weight", "qkvw"), ("bias", "qkvb")):
            if ours in params:
                a = params[ours][i]
                out.update({f"{p}self_attn.q_proj.{suffix}": a[:q], f"{p}self_attn.k_proj.{suffix}": a[q:q + k],
                            f"{p}self_attn.v_proj.{suffix}": a[q + k:]})
        for suffix, ours in (("weight", "fcw"), ("bias", "fcb")):
            if ours in params:
                a = params[ours][i]
                out.update({f"{p}mlp.gate_proj.{suffix}": a[:F], f"{p}mlp.up_proj.{suffix}": a[F:]})
        for name, ours in (("self_attn.o_proj.weight", "attprojw"), ("self_attn.o_proj.bias", "attprojb"),
                           ("mlp.down_proj.weight", "fcprojw"), ("mlp.down_proj.bias", "fcprojb")):
            if ours in params:
                out[p + name] = params[ours][i]
    return out


SAFETENSORS_OUT = {"fp32": ("F32", "<f4"), "bf16": ("BF16", "<u2"), "fp16": ("F16", "<f2")}


def fp16_round(a: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = a.astype("<f2")  # numpy rounds to nearest even
    if not np.all(np.isfinite(h)):
        raise DataError(f"tensor {name}: values beyond float16's range (65504); export with --dtype fp32 or bf16")
    return h


def write_safetensors(path: Path, tensors: dict, dtype: str) -> None:
    """A safetensors file (8-byte header length, JSON header padded with spaces to a
    multiple of 8, then the data) in F32, BF16 (round to nearest even) or F16."""
    st_dtype, _ = SAFETENSORS_OUT[dtype]
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        blob = (df.float32_to_bf16_bits(arr) if dtype == "bf16" else fp16_round(arr, name) if dtype == "fp16"
                else arr.astype("<f4")).tobytes()
        header[name] = {"dtype": st_dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out = df._AtomicFile(path)
    try:
        out.f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            out.f.write(blob)
        out.commit()
    except BaseException:
        out.abort()
        raise
    os.chmod(path, 0o666 & ~hf_gpt2.current_umask())


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def cmd_export(args) -> None:
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"export: OUT_DIR {out}: exists and is not a directory")
    cfg, params, version = mc.read_model(args.model)
    dropout, run_id = mc.read_dropout_and_run_id(args.model)
    dtype = args.dtype or ("bf16" if version in (mc.VERSION_BF16, df.MODEL_VERSION_BF16) else "fp32")
    config = config_from_cfg(cfg, dropout, dtype)
    V = cfg["vocab_size"]
    for name in ("wte", "lm_head"):
        if name in params and np.any(params[name][V:]):
            print(f"note: {args.model}: padded rows {V}..{cfg['padded_vocab_size'] - 1} of {name} are not zero; they are dropped")
    tensors = hf_tensors(cfg, params)
    config["remat_run_id"] = f"{run_id:016x}"  # what import needs to give back this very file
    config["remat_model_version"] = version
    df.make_output_dir(out, "export: OUT_DIR")
    write_safetensors(out / "model.safetensors", tensors, dtype)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    _write_json(out / "generation_config.json", generation)
    _write_json(out / "config.json", config)
    print(f"{out}: config.json, generation_config.json and model.safetensors ({config['architectures'][0]}, "
          f"max_position_embeddings {config['max_position_embeddings']}, {sum(a.size for a in tensors.values()):,} "
          f"parameters, {SAFETENSORS_OUT[dtype][0]})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pi = sub.add_parser("import", help="Hugging Face Llama/Qwen2 directory -> model file (version 7 or 8)")
    pi.add_argument("hf_dir", help="directory with config.json and model.safetensors (or its shards and their index)")
    pi.add_argument("out", help="model file to write")
    pi.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="fp32: version 7; bf16: version 8 (default: the version an export from remat recorded in "
                         "config.json, else fp32)")
    pe = sub.add_parser("export", help="model file (version 7 or 8) -> Hugging Face Llama/Qwen2 directory")
    pe.add_argument("model", help="model file, e.g. out/run/model_00001000.bin")
    pe.add_argument("out_dir", help="directory for config.json, generation_config.json and model.safetensors")
    pe.add_argument("--dtype", choices=tuple(SAFETENSORS_OUT), default=None,
                    help="the tensors' type in model.safetensors (default: the model file's, fp32 or bf16)")
    args = p.parse_args(argv)
    (cmd_import if args.command == "import" else cmd_export)(args)


if __name__ == "__main__":
    df.run_main(main)
