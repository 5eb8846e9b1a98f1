#!/usr/bin/env python3
"""GPT-2 checkpoints between Hugging Face's layout and llm.c model files.

    python3 dev/data/hf_gpt2.py import HF_DIR OUT.bin [--dtype fp32|bf16]
    python3 dev/data/hf_gpt2.py export MODEL.bin OUT_DIR [--eot-token N]

import: HF_DIR holds config.json and model.safetensors (or an older
pytorch_model.bin, read without torch). Tensor names may carry the
`transformer.` prefix or not; the causal-mask buffers (`h.i.attn.bias`,
`h.i.attn.masked_bias`) are ignored; `lm_head.weight` may be absent or equal to
`wte.weight` (GPT-2 ties them; an untied head cannot be stored in an llm.c
file and is refused). GPT-2's Conv1D layers store weights as (in, out), so
they are transposed to the file's (out, in); the token table is padded with
zero rows to a multiple of 128. The config's dropout probabilities
(embd_pdrop, attn_pdrop, resid_pdrop; Hugging Face's GPT-2 default 0.1 where
absent) go into header slots 242-244, the trainer's defaults for --embd-dropout,
--attn-dropout and --resid-dropout. --dtype bf16 writes a version-5 file (round to
nearest even), fp32 (default) a version-3 file.

export: OUT_DIR/config.json and OUT_DIR/model.safetensors (fp32), which
transformers' GPT2LMHeadModel.from_pretrained(OUT_DIR) loads: the true
vocabulary (padding rows dropped), n_positions = the model's position table
(an extended table included), tied embeddings, the dropout probabilities of the
model file's header (those it was imported with or trained with; 0 where none),
bos/eos the end-of-text token (--eot-token N; else the run's --eot-token, which
the checkpoint's state file beside model_N.bin records under the packed-document
flags; else 50256 for GPT-2's vocabulary, else V - 1; the line printed says
which). The tokenizer is not part of the export: GPT-2's own
(GPT2TokenizerFast.from_pretrained("gpt2")) fits a 50257-token model.

Only numpy and safetensors are needed (dev/data/requirements.txt).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pickle
import re
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402
from datafile import DataError  # noqa: E402

PREFIX = "transformer."
MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")  # causal-mask buffers, not parameters
# GPT-2's activation names for the tanh approximation of GELU, the one remat computes
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}


# --- reading Hugging Face checkpoints ---------------------------------------------------


def _int_list(value, length=None) -> bool:
    """A JSON list of integers (not booleans), of `length` items when given."""
    return (isinstance(value, list) and (length is None or len(value) == length)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))


def _safetensors_entry(path: Path, name: str, info, data_bytes: int) -> tuple[str, tuple, int, int]:
    """(numpy dtype, shape, begin, end) of one header entry, each checked: the
    offsets lie inside the data section (0 <= begin <= end <= its size) and span
    exactly the shape's bytes."""
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict):
        raise DataError(f"{where}: header entry is {type(info).__name__}, not an object with dtype, shape, data_offsets")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise DataError(f"{where}: header entry has no {key}")
    dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise DataError(f"{where}: dtype {info['dtype']!r} is not a float type (F32, F16, BF16, F64)")
    shape = info["shape"]
    if not _int_list(shape) or any(d < 0 for d in shape):
        raise DataError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    offsets = info["data_offsets"]
    if not _int_list(offsets, 2):
        raise DataError(f"{where}: data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise DataError(f"{where}: data_offsets {begin}..{end} outside the data section (0..{data_bytes} bytes)")
    if end - begin != math.prod(shape) * np.dtype(dtype).itemsize:
        raise DataError(f"{where}: data_offsets {begin}..{end} hold {end - begin} bytes, shape {shape} "
                        f"of {info['dtype']} needs {math.prod(shape) * np.dtype(dtype).itemsize}")
    return dtype, tuple(shape), begin, end


def safetensors_entries(path: Path) -> tuple[np.memmap, dict]:
    """(the file mapped, {name: (numpy dtype, shape, start, end, safetensors dtype)}) of
    a safetensors file, every entry checked; start/end are offsets into the file."""
    size = path.stat().st_size
    if size < 8:
        raise DataError(f"{path}: {size} bytes, too short for a safetensors file (8-byte header length first)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8:
        raise DataError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError as e:
        raise DataError(f"{path}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise DataError(f"{path}: the header is a JSON {type(header).__name__}, not an object of tensors by name")
    base = 8 + n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _safetensors_entry(path, name, info, len(data) - base)
        entries[name] = (dtype, shape, base + begin, base + end, info["dtype"])
    return data, entries


def safetensors_tensor(data: np.memmap, entry) -> np.ndarray:
    """One entry of safetensors_entries as a float32 array (exact for F16 and BF16)."""
    dtype, shape, start, end, st_dtype = entry
    arr = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
    return df.bf16_bits_to_float32(arr) if st_dtype == "BF16" else arr.astype(np.float32)


def read_safetensors(path: Path) -> dict:
    """All tensors of a safetensors file as float32 arrays, by name."""
    data, entries = safetensors_entries(path)
    return {name: safetensors_tensor(data, entry) for name, entry in entries.items()}


class _TorchPickle(pickle.Unpickler):
    """Reads a torch.save zip archive's data.pkl with numpy: only tensors, their
    storages and ordered dicts are allowed, nothing is executed."""

    STORAGES = {"FloatStorage": "<f4", "HalfStorage": "<f2", "DoubleStorage": "<f8", "BFloat16Storage": "<u2"}

    def __init__(self, f, archive: zipfile.ZipFile, root: str, path: Path):
        super().__init__(f)
        self.archive, self.root, self.path = archive, root, path

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in self.STORAGES:
            return name
        raise DataError(f"{self.path}: holds {module}.{name}, which is not a plain tensor (refused)")

    def persistent_load(self, pid):
        _, storage, key, _, numel = pid  # ('storage', type, key, location, numel)
        raw = self.archive.read(f"{self.root}/data/{key}")
        arr = np.frombuffer(raw, dtype=self.STORAGES[storage], count=numel)
        return df.bf16_bits_to_float32(arr) if storage == "BFloat16Storage" else arr


def _rebuild_tensor(storage, offset, size, stride, *_):
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size), strides=tuple(s * item for s in stride))
    return np.array(view, dtype=np.float32)


def read_torch_bin(path: Path) -> dict:
    """A pytorch_model.bin in torch's zip format (torch >= 1.6), without torch."""
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path}: not torch's zip format (a pre-1.6 torch file?): convert it to model.safetensors")
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                raise DataError(f"{path}: no data.pkl in the archive")
            with z.open(pkl[0]) as f:
                state = _TorchPickle(f, z, pkl[0][: -len("/data.pkl")], path).load()
    except DataError:
        raise
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, KeyError, ValueError, TypeError) as e:
        raise DataError(f"{path}: not a readable torch checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise DataError(f"{path}: does not hold a state dict")
    return dict(state)


def read_hf_dir(hf_dir: Path) -> tuple[dict, dict]:
    """(config.json as a dict, tensors by name) of a Hugging Face GPT-2 directory."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise DataError(f"{hf_dir}: no config.json (a Hugging Face model directory has one)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise DataError(f"{config_path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise DataError(f"{config_path}: a JSON {type(config).__name__}, not an object of settings")
    for name, reader in (("model.safetensors", read_safetensors), ("pytorch_model.bin", read_torch_bin)):
        if (hf_dir / name).is_file():
            with np.errstate(over="ignore"):  # F64 beyond float32's range becomes inf, refused by name later
                return config, reader(hf_dir / name)
    if (hf_dir / "model.safetensors.index.json").is_file():
        raise DataError(f"{hf_dir}: sharded checkpoints (model.safetensors.index.json) are not supported")
    raise DataError(f"{hf_dir}: neither model.safetensors nor pytorch_model.bin")


# --- import -----------------------------------------------------------------------------


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def shape_from_config(config: dict, where: str) -> dict:
    """The llm.c shape of a GPT-2 config, refusing what remat's model does not compute."""
    for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DataError(f"{where}: {key} {value!r} is not a positive integer" if key in config
                            else f"{where}: {key} missing (a positive integer)")
    C = config["n_embd"]
    checks = [
        (config.get("model_type", "gpt2") == "gpt2", f"model_type {config.get('model_type')!r} is not gpt2"),
        (config.get("activation_function", "gelu_new") in TANH_GELU,
         f"activation_function {config.get('activation_function')!r}: remat computes the tanh GELU (gelu_new)"),
        (_is_number(config.get("layer_norm_epsilon", 1e-5)) and abs(config.get("layer_norm_epsilon", 1e-5) - 1e-5) < 1e-12,
         f"layer_norm_epsilon {config.get('layer_norm_epsilon')}: remat uses 1e-5"),
        (config.get("n_inner") in (None, 4 * C), f"n_inner {config.get('n_inner')}: remat's MLP is 4 x n_embd"),
        (config.get("scale_attn_weights", True), "scale_attn_weights false: remat scales scores by 1/sqrt(head size)"),
        (not config.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx is not supported"),
        (not config.get("add_cross_attention", False), "add_cross_attention is not supported"),
        (C % config["n_head"] == 0, f"n_embd {C} is not divisible by n_head {config['n_head']}"),
        (config["vocab_size"] <= df.MAX_VOCAB, f"vocab_size {config['vocab_size']}: the trainers hold at most {df.MAX_VOCAB}"),
    ]
    for ok, why in checks:
        if not ok:
            raise DataError(f"{where}: {why}")
    V = config["vocab_size"]
    return {"max_seq_len": config["n_positions"], "vocab_size": V, "padded_vocab_size": df.pad_vocab(V),
            "num_layers": config["n_layer"], "num_heads": config["n_head"], "channels": C}


class _Tensors:
    """Looks tensors up with or without the `transformer.` prefix and checks shapes."""

    def __init__(self, tensors: dict, where: str):
        self.tensors, self.where, self.used = tensors, where, set()

    def get(self, name: str, shape: tuple, optional: bool = False):
        for key in (name, PREFIX + name):
            if key in self.tensors:
                arr = self.tensors[key]
                if tuple(arr.shape) != shape:
                    raise DataError(f"{self.where}: tensor {key} has shape {tuple(arr.shape)}, expected {shape}")
                bad = np.flatnonzero(~np.isfinite(arr))
                if bad.size:
                    index = ", ".join(map(str, np.unravel_index(bad[0], arr.shape)))
                    raise DataError(f"{self.where}: tensor {key}[{index}] is {arr.flat[bad[0]]} "
                                    f"({bad.size} of {arr.size} values are not finite as float32)")
                self.used.add(key)
                return arr
        if optional:
            return None
        raise DataError(f"{self.where}: tensor {name} is missing (looked for it with and without the '{PREFIX}' prefix)")

    def check_nothing_else(self) -> None:
        for key in self.tensors:
            bare = key[len(PREFIX):] if key.startswith(PREFIX) else key
            if key not in self.used and not MASK_BUFFER.fullmatch(bare):
                raise DataError(f"{self.where}: unexpected tensor {key}: not part of a GPT-2 LM that remat can hold")


def hf_to_llmc(config: dict, tensors: dict, where: str) -> tuple[dict, dict]:
    """(cfg, params) of an llm.c model from a GPT-2 config and state dict."""
    cfg = shape_from_config(config, f"{where}/config.json")
    L, C, V, T = cfg["num_layers"], cfg["channels"], cfg["vocab_size"], cfg["max_seq_len"]
    t = _Tensors(tensors, where)
    wte = t.get("wte.weight", (V, C))
    head = t.get("lm_head.weight", (V, C), optional=True)
    if head is not None and not np.array_equal(head, wte):
        raise DataError(f"{where}: lm_head.weight differs from wte.weight: an untied head cannot be stored in an llm.c file")
    params = {"wte": np.zeros((cfg["padded_vocab_size"], C), np.float32), "wpe": t.get("wpe.weight", (T, C))}
    params["wte"][:V] = wte
    # (file tensor, HF name, HF shape, Conv1D weight to transpose)
    per_layer = [("ln1w", "ln_1.weight", (C,), False), ("ln1b", "ln_1.bias", (C,), False),
                 ("qkvw", "attn.c_attn.weight", (C, 3 * C), True), ("qkvb", "attn.c_attn.bias", (3 * C,), False),
                 ("attprojw", "attn.c_proj.weight", (C, C), True), ("attprojb", "attn.c_proj.bias", (C,), False),
                 ("ln2w", "ln_2.weight", (C,), False), ("ln2b", "ln_2.bias", (C,), False),
                 ("fcw", "mlp.c_fc.weight", (C, 4 * C), True), ("fcb", "mlp.c_fc.bias", (4 * C,), False),
                 ("fcprojw", "mlp.c_proj.weight", (4 * C, C), True), ("fcprojb", "mlp.c_proj.bias", (C,), False)]
    for ours, theirs, shape, transpose in per_layer:
        layers = [t.get(f"h.{i}.{theirs}", shape) for i in range(L)]
        params[ours] = np.stack([a.T if transpose else a for a in layers])
    params["lnfw"] = t.get("ln_f.weight", (C,))
    params["lnfb"] = t.get("ln_f.bias", (C,))
    t.check_nothing_else()
    return cfg, params


HF_DEFAULT_PDROP = 0.1  # GPT2Config's default for each of the three


def dropout_from_config(config: dict, where: str) -> dict:
    """embd_pdrop, attn_pdrop, resid_pdrop of a GPT-2 config (absent: GPT2Config's default)."""
    out = {}
    for key in df.MODEL_DROPOUT_KEYS:
        p = config.get(key, HF_DEFAULT_PDROP)
        if not _is_number(p) or not 0.0 <= p <= df.MODEL_DROPOUT_MAX:
            raise DataError(f"{where}: {key} {p!r} is not a dropout probability in [0, {df.MODEL_DROPOUT_MAX}]")
        out[key] = float(p)
    return out


def remat_record(config: dict, where: str) -> tuple[int, int]:
    """(run id, model file version) that an export from a remat model file kept in
    config.json (remat_run_id, 16 hex digits; remat_model_version); (0, 0) when absent."""
    run_id, version = config.get("remat_run_id", "0" * 16), config.get("remat_model_version", 0)
    if not (isinstance(run_id, str) and len(run_id) == 16 and all(c in "0123456789abcdef" for c in run_id)):
        raise DataError(f"{where}: remat_run_id {run_id!r} is not 16 lowercase hex digits")
    if version not in (0, df.MODEL_VERSION_FP32, df.MODEL_VERSION_BF16):
        raise DataError(f"{where}: remat_model_version {version!r} is not 3 or 5")
    return int(run_id, 16), version


def cmd_import(args) -> None:
    df.refuse_directory(args.out, "import: OUT")
    hf_dir = Path(args.hf_dir)
    config, tensors = read_hf_dir(hf_dir)
    cfg, params = hf_to_llmc(config, tensors, str(hf_dir))
    dropout = dropout_from_config(config, str(hf_dir / "config.json"))
    run_id, file_version = remat_record(config, str(hf_dir / "config.json"))
    if args.dtype is None:  # an export of a remat file: its own precision, so the file comes back byte for byte
        args.dtype = "bf16" if file_version == df.MODEL_VERSION_BF16 else "fp32"
    version = df.MODEL_VERSION_BF16 if args.dtype == "bf16" else df.MODEL_VERSION_FP32
    df.write_model(args.out, cfg, params, version, dropout, run_id)
    n = sum(p.size for p in params.values())
    drops = ", ".join(f"{k} {v:g}" for k, v in dropout.items())
    print(f"{args.out}: L={cfg['num_layers']} NH={cfg['num_heads']} C={cfg['channels']} V={cfg['vocab_size']} "
          f"(padded {cfg['padded_vocab_size']}) maxT={cfg['max_seq_len']}, {n:,} parameters, {drops}, "
          f"version {version} ({args.dtype})")


# --- export -----------------------------------------------------------------------------


def llmc_to_hf(cfg: dict, params: dict, dropout: dict, eot: int) -> tuple[dict, dict]:
    """(config.json dict, state dict with the `transformer.` prefix) of an
    llm.c model whose end-of-text token is eot (bos and eos)."""
    L, C, V = cfg["num_layers"], cfg["channels"], cfg["vocab_size"]
    tensors = {PREFIX + "wte.weight": params["wte"][:V], PREFIX + "wpe.weight": params["wpe"],
               PREFIX + "ln_f.weight": params["lnfw"], PREFIX + "ln_f.bias": params["lnfb"]}
    names = {"ln1w": "ln_1.weight", "ln1b": "ln_1.bias", "qkvw": "attn.c_attn.weight", "qkvb": "attn.c_attn.bias",
             "attprojw": "attn.c_proj.weight", "attprojb": "attn.c_proj.bias", "ln2w": "ln_2.weight",
             "ln2b": "ln_2.bias", "fcw": "mlp.c_fc.weight", "fcb": "mlp.c_fc.bias", "fcprojw": "mlp.c_proj.weight",
             "fcprojb": "mlp.c_proj.bias"}
    for ours, theirs in names.items():
        for i in range(L):
            a = params[ours][i]
            tensors[f"{PREFIX}h.{i}.{theirs}"] = a.T if a.ndim == 2 else a  # Conv1D weights are (in, out)
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_layer": L, "n_head": cfg["num_heads"], "n_embd": C,
        "n_positions": cfg["max_seq_len"], "n_ctx": cfg["max_seq_len"], "vocab_size": V,
        "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02, **dropout,
        "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
    }
    return config, tensors


STATE_MAGIC, STATE_RUN_ID_SLOT, STATE_HPARAMS_SLOT = 20240527, 22, 32  # docs/FORMATS.md, the state file
HP_DOCUMENT_FLAGS, HP_EOT_TOKEN = (17, 18, 19), 20  # the packed-document flags' and --eot-token's hyperparameters


def run_eot_token(model_path: Path):
    """The end-of-text token the run that wrote model_path trained with, and
    where it is known: --eot-token as its checkpoint's state file
    (state_N_00000.bin beside model_N.bin, carrying the model's run id)
    records it when a packed-document flag was on. None when nothing records it."""
    m = re.fullmatch(r"model_(\d{8})\.bin", model_path.name)
    state = model_path.with_name(f"state_{m.group(1)}_00000.bin") if m else None
    if state is None or not state.is_file():
        return None, None
    h = np.frombuffer(state.read_bytes()[:df.HEADER_BYTES], dtype="<i4")
    if len(h) < df.HEADER_INTS or h[0] != STATE_MAGIC or h[1] not in (2, 3):
        return None, None
    run_id = int(h[STATE_RUN_ID_SLOT:STATE_RUN_ID_SLOT + 2].copy().view("<u8")[0])
    if run_id == 0 or run_id != df.read_model_run_id(model_path):
        return None, None
    hp = h[STATE_HPARAMS_SLOT:]
    if hp[0] <= HP_EOT_TOKEN or not any(hp[1 + i] for i in HP_DOCUMENT_FLAGS) or hp[1 + HP_EOT_TOKEN] < 0:
        return None, None  # no document flag (no end of text in the run), or the tokenizer file's
    return int(hp[1 + HP_EOT_TOKEN]), f"--eot-token of the run, from {state.name}"


def export_eot_token(args, V: int) -> tuple[int, str]:
    """bos/eos of the export: --eot-token, else the run's, else GPT-2's 50256
    for its vocabulary, else V - 1 (a guess, said so)."""
    if args.eot_token is not None:
        if not 0 <= args.eot_token < V:
            raise DataError(f"export: --eot-token {args.eot_token} is not a token of the model's vocabulary ({V})")
        return args.eot_token, "--eot-token"
    eot, source = run_eot_token(Path(args.model))
    if eot is not None:
        if eot >= V:
            raise DataError(f"export: {source} says end of text is {eot}, beyond the model's vocabulary ({V})")
        return eot, source
    if V == df.GPT2_VOCAB_SIZE:
        return df.GPT2_EOT, "GPT-2's"
    return V - 1, "V - 1: no checkpoint state beside the model records the run's; give --eot-token N if it is another"


def current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: set it back at once
    os.umask(mask)
    return mask


def cmd_export(args) -> None:
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise DataError("safetensors is not installed: pip install -r dev/data/requirements.txt") from None
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"export: OUT_DIR {out}: exists and is not a directory")
    cfg, params, version = df.read_model(args.model)
    V = cfg["vocab_size"]
    if np.any(params["wte"][V:]):
        print(f"note: {args.model}: padded rows {V}..{cfg['padded_vocab_size'] - 1} of wte are not zero; they are dropped")
    # float32 to the shortest decimal that reads back as the same float32 (0.1, not 0.10000000149)
    dropout = {k: float(np.format_float_positional(np.float32(v))) for k, v in df.read_model_dropout(args.model).items()}
    eot, eot_source = export_eot_token(args, V)
    config, tensors = llmc_to_hf(cfg, params, dropout, eot)
    # what import needs to give back this very file (Hugging Face ignores keys it does not know)
    config["remat_run_id"] = f"{df.read_model_run_id(args.model):016x}"
    config["remat_model_version"] = version
    df.make_output_dir(out, "export: OUT_DIR")
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o666 & ~current_umask())  # safetensors creates its file 0600; an export is for sharing
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(out / "config.json.tmp", out / "config.json")
    print(f"{out}: config.json and model.safetensors (n_positions {cfg['max_seq_len']}, vocab_size {V}, "
          f"{sum(a.size for a in tensors.values()):,} parameters; bos/eos token {eot}: {eot_source})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pi = sub.add_parser("import", help="Hugging Face GPT-2 directory -> llm.c model file")
    pi.add_argument("hf_dir", help="directory with config.json and model.safetensors or pytorch_model.bin")
    pi.add_argument("out", help="model file to write (e.g. gpt2_124M.bin)")
    pi.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="fp32: version 3; bf16: version 5 (default: the version an export from remat recorded in "
                         "config.json, else fp32)")
    pe = sub.add_parser("export", help="llm.c model file -> Hugging Face GPT-2 directory")
    pe.add_argument("model", help="model file (version 3 or 5), e.g. out/run/model_00001000.bin")
    pe.add_argument("out_dir", help="directory for config.json and model.safetensors")
    pe.add_argument("--eot-token", type=int, default=None,
                    help="the end-of-text token (config.json's bos/eos; default: the run's --eot-token, which the state "
                         "file beside a checkpoint's model records under the packed-document flags, else 50256 for "
                         "GPT-2's vocabulary, else V - 1)")
    args = p.parse_args(argv)
    (cmd_import if args.command == "import" else cmd_export)(args)


if __name__ == "__main__":
    df.run_main(main)
