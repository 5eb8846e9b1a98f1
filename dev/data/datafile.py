"""Shared reading and writing of remat's data files, used by every data script.

The trainer reads two binary formats (docs/FORMATS.md): token shards (a
1,024-byte header of 256 int32 values, then uint16 tokens, or uint32 tokens in
llm.c's llama-3 shards for vocabularies beyond 65,536) and tokenizer files
(same header size, then one length byte plus raw bytes per token). Keeping the
one implementation here means the scripts, the tests and the C reader all agree
on a single definition, and that every writer is atomic: a file only appears
under its final name once it is complete, so an interrupted run can never leave
a half-written shard that looks valid.

It also builds the GPT-2 tiktoken encoding, either online or, for machines
without internet, from a local copy of the r50k_base ranks file whose sha256 is
checked before use.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

# --- format constants (llm.c formats, docs/FORMATS.md) -----------------------------------------

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
# llm.c's llama-3 shards: the same header with their own magic and version, uint32 tokens
SHARD_MAGIC_U32 = 20240801
SHARD_VERSION_U32 = 7
# version -> (magic, token dtype)
SHARD_FORMATS = {SHARD_VERSION: (SHARD_MAGIC, "<u2"), SHARD_VERSION_U32: (SHARD_MAGIC_U32, "<u4")}
TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2

MAX_TOKEN_ID = 65535  # version-1 shards store uint16
MAX_TOKEN_ID_U32 = 2**32 - 1  # version-7 shards store uint32
MAX_VOCAB = 1 << 18  # the trainers' largest vocabulary (llmc/core/model.h)
MAX_SHARD_TOKENS = 2**31 - 1  # the count lives in an int32 header slot

# --- GPT-2 tokenizer facts --------------------------------------------------------

GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257
GPT2_EOT_TEXT = "<|endoftext|>"
# sha256 of the r50k_base ranks file (the one tiktoken itself expects).
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenizer split pattern, as tiktoken defines it for gpt2/r50k_base.
GPT2_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
TIKTOKEN_ENV = "REMAT_TIKTOKEN_FILE"

REPO_ROOT = Path(__file__).resolve().parents[2]
# Defaults are anchored at the repository so a script writes to the same place
# whatever directory it is started from.
DATA_ROOT = REPO_ROOT / "data"

# Token counts above which writers show a progress bar.
PROGRESS_THRESHOLD = 1 << 24


class DataError(ValueError):
    """An expected failure (bad input file, no network...) reported in one line."""


# --- atomic files -----------------------------------------------------------------


class _AtomicFile:
    """A binary file written under `path + ".tmp"` and renamed into place on commit.

    os.replace is atomic on POSIX, so readers see either no file or a whole one.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.tmp = self.path + ".tmp"
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.f = open(self.tmp, "wb")

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        try:
            os.remove(self.tmp)
        except FileNotFoundError:
            pass


def _header(values: Sequence[int], dtype: str) -> bytes:
    h = np.zeros(HEADER_INTS, dtype=dtype)  # unused slots must be zero
    h[: len(values)] = values
    return h.tobytes()


def _progress(total: int | None, desc: str, enabled: bool | None):
    """A tqdm token counter, shown only for big outputs unless asked for."""
    from tqdm import tqdm

    if enabled is None:
        enabled = total is None or total >= PROGRESS_THRESHOLD
    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not enabled)


# --- token shards -----------------------------------------------------------------


def _shard_format(version: int) -> tuple[int, str]:
    if version not in SHARD_FORMATS:
        raise DataError(f"shard version {version}: the formats are {SHARD_VERSION} (uint16 tokens) "
                        f"and {SHARD_VERSION_U32} (uint32 tokens)")
    return SHARD_FORMATS[version]


def shard_version_for(vocab_size: int) -> int:
    """The shard version a vocabulary needs: uint16 tokens while every id fits."""
    return SHARD_VERSION if vocab_size <= MAX_TOKEN_ID + 1 else SHARD_VERSION_U32


def as_tokens(tokens, version: int = SHARD_VERSION) -> np.ndarray:
    """Validate token ids and return them as the shard version's little-endian
    integers (uint16 for version 1, uint32 for version 7)."""
    _, dtype = _shard_format(version)
    top = MAX_TOKEN_ID if version == SHARD_VERSION else MAX_TOKEN_ID_U32
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if arr.dtype.kind not in "iu":
        raise DataError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > top:
        bad = lo if lo < 0 else hi
        width = "uint16" if version == SHARD_VERSION else "uint32"
        hint = f"; a version-{SHARD_VERSION_U32} shard holds uint32" if version == SHARD_VERSION and bad > 0 else ""
        raise DataError(f"token id {bad} does not fit in {width} (0..{top}){hint}")
    return arr.astype(dtype, copy=False)


def shard_header(ntokens: int, version: int = SHARD_VERSION) -> bytes:
    magic, _ = _shard_format(version)
    if not 0 <= ntokens <= MAX_SHARD_TOKENS:
        raise DataError(f"a shard holds at most {MAX_SHARD_TOKENS} tokens, got {ntokens}")
    return _header([magic, version, ntokens], "<i4")


def write_shard(path, tokens, progress: bool | None = None, version: int = SHARD_VERSION) -> None:
    """Write one token shard atomically; big arrays are written in chunks with a bar.
    version 1: uint16 tokens (GPT-2's shards); 7: uint32 (llm.c's llama-3 shards)."""
    arr = as_tokens(tokens, version)
    out = _AtomicFile(path)
    try:
        out.f.write(shard_header(len(arr), version))
        chunk = 1 << 22
        with _progress(len(arr), f"write {os.path.basename(out.path)}", progress) as bar:
            for i in range(0, len(arr), chunk):
                piece = arr[i : i + chunk]
                out.f.write(piece.tobytes())
                bar.update(len(piece))
        out.commit()
    except BaseException:
        out.abort()
        raise


def _shard_layout(path: str) -> tuple[int, int]:
    """(version, token count) of a shard whose header and size agree; else DataError."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"{path}: cannot read token shard: {e.strerror}") from None
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path}: truncated header ({len(raw)} of {HEADER_BYTES} bytes)")
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, ntokens = (int(x) for x in header[:3])
    magics = {m: v for v, (m, _) in SHARD_FORMATS.items()}
    if magic not in magics:
        raise DataError(f"{path}: bad magic {magic} (a token shard has {SHARD_MAGIC}, "
                        f"or {SHARD_MAGIC_U32} with uint32 tokens)")
    if version != magics[magic]:
        raise DataError(f"{path}: unsupported shard version {version} (magic {magic} has version {magics[magic]})")
    if ntokens < 0:
        raise DataError(f"{path}: negative token count {ntokens}")
    width = np.dtype(SHARD_FORMATS[version][1]).itemsize
    expected = HEADER_BYTES + width * ntokens
    if size != expected:
        what = "truncated" if size < expected else "trailing bytes"
        raise DataError(
            f"{path}: {what}: file is {size} bytes but header says {ntokens} tokens "
            f"({expected} bytes)"
        )
    return version, ntokens


def read_shard_version(path) -> int:
    """1 (uint16 tokens) or 7 (uint32 tokens), after checking the shard is whole."""
    return _shard_layout(os.fspath(path))[0]


def read_shard(path, mmap: bool = False) -> np.ndarray:
    """Read a token shard (version 1: uint16, version 7: uint32), refusing anything
    that is not exactly a valid one."""
    path = os.fspath(path)
    version, ntokens = _shard_layout(path)
    dtype = SHARD_FORMATS[version][1]
    if mmap:
        return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(ntokens,))
    data = np.fromfile(path, dtype=dtype, count=ntokens, offset=HEADER_BYTES)
    return data.astype(np.uint16 if version == SHARD_VERSION else np.uint32, copy=False)


class ShardWriter:
    """Streams token arrays into shards of exactly `shard_tokens` tokens each.

    `path_for(index)` names shard `index` (0, 1, ...). Documents are not kept whole:
    a document that crosses a boundary continues at the start of the next shard, so
    every shard except the last is exactly full. With `shard_tokens=None` everything
    goes into the single shard 0, written incrementally so the whole token stream
    never has to sit in memory. Each shard becomes visible only once complete.
    """

    def __init__(
        self,
        path_for: Callable[[int], str | os.PathLike],
        shard_tokens: int | None = None,
        desc: str = "tokens",
        total: int | None = None,
        progress: bool | None = None,
        version: int = SHARD_VERSION,
    ):
        _shard_format(version)
        self.version = version
        if shard_tokens is not None and not 0 < shard_tokens <= MAX_SHARD_TOKENS:
            raise DataError(f"shard size must be in 1..{MAX_SHARD_TOKENS}, got {shard_tokens}")
        self.path_for = path_for
        self.shard_tokens = shard_tokens
        self.paths: list[str] = []
        self._out: _AtomicFile | None = None
        self._count = 0
        self.total_tokens = 0
        self._bar = _progress(total, desc, True if progress is None else progress)

    def add(self, tokens) -> None:
        arr = as_tokens(tokens, self.version)
        pos = 0
        while pos < len(arr):
            if self._out is None:
                self._open()
            take = len(arr) - pos
            if self.shard_tokens is not None:
                take = min(take, self.shard_tokens - self._count)
            self._out.f.write(arr[pos : pos + take].tobytes())
            self._count += take
            self.total_tokens += take
            pos += take
            self._bar.update(take)
            if self._count == self.shard_tokens:
                self._finish()

    def close(self) -> list[str]:
        """Finish the last (possibly partial) shard and return all shard paths."""
        if self._out is None and not self.paths:
            self._open()  # always leave at least one (possibly empty) shard behind
        if self._out is not None:
            self._finish()
        self._bar.close()
        return self.paths

    def abort(self) -> None:
        if self._out is not None:
            self._out.abort()
            self._out = None
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def _open(self) -> None:
        self._out = _AtomicFile(self.path_for(len(self.paths)))
        self._out.f.write(bytes(HEADER_BYTES))  # placeholder until the count is known
        self._count = 0

    def _finish(self) -> None:
        out = self._out
        if self._count > MAX_SHARD_TOKENS:
            self.abort()
            raise DataError(f"{out.path}: more than {MAX_SHARD_TOKENS} tokens; use shards")
        out.f.seek(0)
        out.f.write(shard_header(self._count, self.version))
        out.commit()
        self.paths.append(out.path)
        self._out = None


def write_train_val(out_dir, prefix: str, train, val, progress: bool | None = None, version: int = SHARD_VERSION):
    """Write `<prefix>_train.bin` and `<prefix>_val.bin`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path = out_dir / f"{prefix}_train.bin"
    val_path = out_dir / f"{prefix}_val.bin"
    write_shard(val_path, val, progress, version)
    write_shard(train_path, train, progress, version)
    return train_path, val_path


# --- tokenizer files --------------------------------------------------------------


def write_tokenizer(path, token_bytes_list: Sequence[bytes], eot_id: int) -> None:
    """Write a version-2 tokenizer file (eot id in header slot 3)."""
    n = len(token_bytes_list)
    if not 0 <= eot_id < n:
        raise DataError(f"end-of-text id {eot_id} is outside the vocabulary (size {n})")
    body = bytearray()
    for i, tok in enumerate(token_bytes_list):
        if not isinstance(tok, (bytes, bytearray)):
            raise DataError(f"token {i} is {type(tok).__name__}, expected bytes")
        if not 1 <= len(tok) <= 255:
            raise DataError(f"token {i} has length {len(tok)}; the format allows 1..255 bytes")
        body.append(len(tok))
        body += tok
    out = _AtomicFile(path)
    try:
        out.f.write(_header([TOKENIZER_MAGIC, TOKENIZER_VERSION, n, eot_id], "<u4"))
        out.f.write(bytes(body))
        out.commit()
    except BaseException:
        out.abort()
        raise


def read_tokenizer(path) -> tuple[list[bytes], int]:
    """Read a tokenizer file (version 1 or 2); returns (token bytes by id, eot id)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read tokenizer file: {e.strerror}") from None
    if len(data) < HEADER_BYTES:
        raise DataError(f"{path}: truncated header ({len(data)} of {HEADER_BYTES} bytes)")
    magic, version, vocab, eot = (int(x) for x in np.frombuffer(data, "<u4", 4))
    if magic != TOKENIZER_MAGIC:
        raise DataError(f"{path}: bad magic {magic} (a tokenizer file has {TOKENIZER_MAGIC})")
    if version == 1:
        eot = GPT2_EOT  # version 1 predates the eot slot and means GPT-2
    elif version != 2:
        raise DataError(f"{path}: unsupported tokenizer version {version} (expected 1 or 2)")
    if not 0 <= eot < vocab:
        raise DataError(f"{path}: end-of-text id {eot} is outside the vocabulary ({vocab})")
    tokens: list[bytes] = []
    pos = HEADER_BYTES
    for i in range(vocab):
        if pos >= len(data):
            raise DataError(f"{path}: truncated: file ends before token {i} of {vocab}")
        n = data[pos]
        if n == 0:
            raise DataError(f"{path}: token {i} has length 0 (must be 1..255)")
        if pos + 1 + n > len(data):
            raise DataError(f"{path}: truncated: token {i} runs past the end of the file")
        tokens.append(data[pos + 1 : pos + 1 + n])
        pos += 1 + n
    if pos != len(data):
        raise DataError(f"{path}: trailing bytes: {len(data) - pos} bytes after the last token")
    return tokens, eot


# --- model files -----------------------------------------------------------------

MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
MODEL_VERSION_BF16 = 5
# The 16 parameter tensors in file order (docs/FORMATS.md); weight matrices are (out, in).
# Header slots 242-244: dropout probabilities as float32 bits (0: none; llm.c
# readers ignore them), the keys of Hugging Face's GPT-2 config.
MODEL_DROPOUT_SLOT = 242
MODEL_RUN_ID_SLOT = 240  # slots 240-241: the run id (uint64, low word first) of the remat run that wrote the file; 0: none
MODEL_DROPOUT_KEYS = ("embd_pdrop", "attn_pdrop", "resid_pdrop")
MODEL_DROPOUT_MAX = 0.99
MODEL_TENSORS = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
                 "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")


def pad_vocab(vocab_size: int) -> int:
    """The padded vocabulary of a model file: V rounded up to a multiple of 128."""
    return (vocab_size + 127) // 128 * 128


def model_tensor_shapes(cfg: dict) -> dict:
    """Shape of each parameter tensor for cfg (keys max_seq_len, vocab_size,
    padded_vocab_size, num_layers, num_heads, channels)."""
    L, C = cfg["num_layers"], cfg["channels"]
    return {
        "wte": (cfg["padded_vocab_size"], C), "wpe": (cfg["max_seq_len"], C),
        "ln1w": (L, C), "ln1b": (L, C), "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C),
        "attprojw": (L, C, C), "attprojb": (L, C), "ln2w": (L, C), "ln2b": (L, C),
        "fcw": (L, 4 * C, C), "fcb": (L, 4 * C), "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
        "lnfw": (C,), "lnfb": (C,),
    }


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as the trainers do; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded[nan] = (bits[nan] >> 16) | 0x40
    return rounded.astype("<u2")


def bf16_bits_to_float32(h: np.ndarray) -> np.ndarray:
    return (np.asarray(h, dtype="<u2").astype("<u4") << 16).view("<f4")


def write_model(path, cfg: dict, params: dict, version: int = MODEL_VERSION_FP32, dropout: dict | None = None,
                run_id: int = 0) -> None:
    """Write an llm.c model file atomically: params maps each of MODEL_TENSORS to an
    array of its shape (model_tensor_shapes); version 3 stores fp32, 5 bf16.
    dropout: probabilities by MODEL_DROPOUT_KEYS (absent keys: 0); run_id: slots 240-241."""
    if version not in (MODEL_VERSION_FP32, MODEL_VERSION_BF16):
        raise DataError(f"model file version must be 3 (fp32) or 5 (bf16), got {version}")
    shapes = model_tensor_shapes(cfg)
    h = np.frombuffer(_header([MODEL_MAGIC, version, cfg["max_seq_len"], cfg["vocab_size"], cfg["num_layers"],
                               cfg["num_heads"], cfg["channels"], cfg["padded_vocab_size"]], "<i4"), dtype="<i4").copy()
    probs = np.array([(dropout or {}).get(k, 0.0) for k in MODEL_DROPOUT_KEYS], dtype="<f4")
    for key, p in zip(MODEL_DROPOUT_KEYS, probs):
        if not 0.0 <= p <= MODEL_DROPOUT_MAX:
            raise DataError(f"{key} {p}: not a dropout probability in [0, {MODEL_DROPOUT_MAX}]")
    h[MODEL_DROPOUT_SLOT:MODEL_DROPOUT_SLOT + 3] = probs.view("<i4")
    if not 0 <= run_id < 2 ** 64:
        raise DataError(f"run id {run_id}: not a 64-bit unsigned integer")
    h[MODEL_RUN_ID_SLOT:MODEL_RUN_ID_SLOT + 2] = np.array([run_id], dtype="<u8").view("<i4")
    header = h.tobytes()
    out = _AtomicFile(path)
    try:
        out.f.write(header)
        for name in MODEL_TENSORS:
            arr = np.asarray(params[name], dtype=np.float32)
            if arr.shape != shapes[name]:
                raise DataError(f"{name}: shape {arr.shape}, expected {shapes[name]}")
            data = float32_to_bf16_bits(arr) if version == MODEL_VERSION_BF16 else arr.astype("<f4")
            out.f.write(np.ascontiguousarray(data).tobytes())
        out.commit()
    except BaseException:
        out.abort()
        raise


def read_model(path) -> tuple[dict, dict, int]:
    """Read an llm.c model file (version 3 or 5); returns (cfg, params as fp32, version)."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
            h = np.frombuffer(raw, dtype="<i4") if len(raw) == HEADER_BYTES else None
            if h is None:
                raise DataError(f"{path}: truncated header ({len(raw)} of {HEADER_BYTES} bytes)")
            if h[0] != MODEL_MAGIC:
                raise DataError(f"{path}: bad magic {h[0]} (a model file has {MODEL_MAGIC})")
            version = int(h[1])
            if version not in (MODEL_VERSION_FP32, MODEL_VERSION_BF16):
                raise DataError(f"{path}: unsupported model file version {version} (expected 3 or 5)")
            keys = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels", "padded_vocab_size")
            cfg = {k: int(v) for k, v in zip(keys, h[2:8])}
            if min(cfg.values()) < 1 or cfg["padded_vocab_size"] < cfg["vocab_size"] \
                    or cfg["channels"] % cfg["num_heads"]:
                raise DataError(f"{path}: inconsistent shape in the header: {cfg}")
            shapes = model_tensor_shapes(cfg)
            elem = 4 if version == MODEL_VERSION_FP32 else 2
            count = sum(int(np.prod(s)) for s in shapes.values())
            if size != HEADER_BYTES + count * elem:
                raise DataError(f"{path}: size {size} bytes does not match its header "
                                f"(expected {HEADER_BYTES + count * elem}: {count} parameters x {elem} bytes + 1024)")
            dtype = "<f4" if version == MODEL_VERSION_FP32 else "<u2"
            flat = np.fromfile(f, dtype=dtype, count=count)
    except OSError as e:
        raise DataError(f"{path}: cannot read model file: {e.strerror}") from None
    if version == MODEL_VERSION_BF16:
        flat = bf16_bits_to_float32(flat)
    params, off = {}, 0
    for name in MODEL_TENSORS:
        n = int(np.prod(shapes[name]))
        params[name] = flat[off:off + n].reshape(shapes[name])
        off += n
    return cfg, params, version


EVAL_DUMP_MAGIC, EVAL_DUMP_VERSION = 20261203, 2
EVAL_DUMP_ARRAYS = {1: 3, 2: 4}  # version 2 added `position`


def read_eval_dump(path) -> dict:
    """A trainer's --eval-dump (docs/FORMATS.md): version, T, sequences, step,
    vocab_size, and target, top1 (int32), loss (float32) and position (int32:
    the position the model gave the token, -1 where it was not counted) as
    (sequences, T) arrays. A version 1 file has no position array: it is the
    position in the sequence, every token counted (true of a run without
    --reset-position-ids and --eod-mask-loss, the only runs it is right for)."""
    raw = Path(path).read_bytes()
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path}: too short for an evaluation dump header ({HEADER_BYTES} bytes)")
    h = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    if h[0] != EVAL_DUMP_MAGIC or int(h[1]) not in EVAL_DUMP_ARRAYS:
        raise DataError(f"{path}: not an evaluation dump (magic {h[0]}, version {h[1]}; expected {EVAL_DUMP_MAGIC}, "
                        f"versions 1 to {EVAL_DUMP_VERSION})")
    version, T, S = int(h[1]), int(h[2]), int(h[3])
    arrays = EVAL_DUMP_ARRAYS[version]
    if T < 1 or S < 0 or len(raw) != HEADER_BYTES + 4 * arrays * S * T:
        raise DataError(f"{path}: {len(raw)} bytes, but its header says {S} sequences of {T} tokens "
                        f"({HEADER_BYTES + 4 * arrays * S * T} for version {version})")
    body = np.frombuffer(raw[HEADER_BYTES:], dtype="<i4").reshape(arrays, S, T)
    position = body[3] if version >= 2 else np.broadcast_to(np.arange(T, dtype="<i4"), (S, T))
    if version >= 2 and (position.size and (position.min() < -1 or position.max() >= T)):
        raise DataError(f"{path}: a position outside -1..{T - 1} (the dump is damaged)")
    return {"version": version, "T": T, "sequences": S, "step": int(h[4]), "vocab_size": int(h[5]), "target": body[0],
            "top1": body[1], "loss": body[2].view("<f4"), "position": position}


def read_model_run_id(path) -> int:
    """The run id in a model file's slots 240-241 (0: not written by a remat run)."""
    with open(path, "rb") as f:
        h = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    if len(h) < HEADER_INTS:
        raise DataError(f"{path}: truncated header ({4 * len(h)} of {HEADER_BYTES} bytes)")
    return int(h[MODEL_RUN_ID_SLOT:MODEL_RUN_ID_SLOT + 2].copy().view("<u8")[0])


def read_model_dropout(path) -> dict:
    """The dropout probabilities a model file's header holds, by MODEL_DROPOUT_KEYS."""
    with open(path, "rb") as f:
        h = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    if len(h) < HEADER_INTS:
        raise DataError(f"{path}: truncated header ({4 * len(h)} of {HEADER_BYTES} bytes)")
    probs = h[MODEL_DROPOUT_SLOT:MODEL_DROPOUT_SLOT + 3].view("<f4")
    return {k: float(p) for k, p in zip(MODEL_DROPOUT_KEYS, probs)}


# --- GPT-2 encoding ---------------------------------------------------------------


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _import_tiktoken():
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise DataError(
            "tiktoken is not installed: pip install -r dev/data/requirements.txt"
        ) from None
    return tiktoken


def gpt2_encoding(tiktoken_file: str | os.PathLike | None = None):
    """The GPT-2 tiktoken Encoding: from a local ranks file if one is given
    (argument, else $REMAT_TIKTOKEN_FILE), otherwise fetched by tiktoken online."""
    tiktoken = _import_tiktoken()
    path = tiktoken_file or os.environ.get(TIKTOKEN_ENV) or None
    if path is None:
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # tiktoken surfaces network failures in many types
            raise DataError(
                f"cannot fetch the GPT-2 tokenizer online ({type(e).__name__}); "
                f"without internet pass --tiktoken-file PATH or set {TIKTOKEN_ENV} to the "
                "r50k_base ranks file (e.g. ../shared/data/gpt2.tiktoken)"
            ) from None
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"tiktoken ranks file not found: {path}")
    # Checked here as well as by tiktoken: our message is clearer, and tiktoken's
    # cache (keyed by path) could otherwise serve an older copy of the file.
    digest = sha256_file(path)
    if digest != GPT2_RANKS_SHA256:
        raise DataError(
            f"{path}: sha256 {digest} is not the GPT-2 r50k_base ranks file "
            f"(expected {GPT2_RANKS_SHA256})"
        )
    ranks = tiktoken.load.load_tiktoken_bpe(path, expected_hash=GPT2_RANKS_SHA256)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={GPT2_EOT_TEXT: GPT2_EOT},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


def gpt2_token_bytes(enc) -> list[bytes]:
    return [enc.decode_single_token_bytes(i) for i in range(GPT2_VOCAB_SIZE)]


def write_gpt2_tokenizer(path, enc) -> None:
    """Write the GPT-2 tokenizer file (vocab 50257, eot 50256) for decoding in C."""
    if enc.n_vocab != GPT2_VOCAB_SIZE or enc.eot_token != GPT2_EOT:
        raise DataError(f"not a GPT-2 encoding (n_vocab {enc.n_vocab}, eot {enc.eot_token})")
    write_tokenizer(path, gpt2_token_bytes(enc), GPT2_EOT)


def encode_document(enc, text: str) -> np.ndarray:
    """One document as uint16 tokens, preceded by EOT (FORMATS: EOT precedes each
    document). encode_ordinary so "<|endoftext|>" inside text stays plain text."""
    ids = enc.encode_ordinary(text)
    out = np.empty(len(ids) + 1, dtype="<u2")
    out[0] = GPT2_EOT
    out[1:] = ids
    return out


# --- network and command-line plumbing --------------------------------------------

# Exception type names (anywhere in the MRO) that mean "could not reach the server".
# Names rather than classes, so requests/httpx/urllib3/huggingface_hub need not be
# importable to recognise their errors.
_NETWORK_ERROR_NAMES = {
    "ConnectionError",
    "ConnectError",
    "ConnectTimeout",
    "ReadTimeout",
    "Timeout",
    "TimeoutError",
    "TimeoutException",
    "NetworkError",
    "TransportError",
    "gaierror",
    "NameResolutionError",
    "MaxRetryError",
    "NewConnectionError",
    "ProtocolError",
    "OfflineModeIsEnabled",
    "LocalEntryNotFoundError",
    "URLError",
}


def is_network_error(exc: BaseException | None) -> bool:
    """True if exc, or anything it was raised from, is a failure to reach a server."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(t.__name__ in _NETWORK_ERROR_NAMES for t in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def download(url: str, dest, what: str, offline_hint: str, timeout: float = 60) -> Path:
    """Fetch url into dest atomically with a progress bar; skip if dest exists."""
    dest = Path(dest)
    if dest.exists():
        print(f"{dest} already present, not downloading")
        return dest
    import requests
    from tqdm import tqdm

    out = None
    try:
        with requests.get(url, stream=True, timeout=timeout) as r:
            r.raise_for_status()
            total = int(r.headers.get("content-length", 0)) or None
            out = _AtomicFile(dest)
            with tqdm(total=total, desc=f"download {dest.name}", unit="B", unit_scale=True) as bar:
                for block in r.iter_content(1 << 20):
                    out.f.write(block)
                    bar.update(len(block))
            out.commit()
    except Exception as e:
        if out is not None:
            out.abort()
        if is_network_error(e):
            raise DataError(
                f"downloading {what} needs internet ({url} unreachable); {offline_hint}"
            ) from None
        if isinstance(e, requests.HTTPError):
            raise DataError(f"downloading {what} failed: {e}") from None
        raise
    return dest


def check_reachable(url: str, what: str, offline_hint: str, timeout: float = 15) -> None:
    """Fail in seconds, not after a library's minutes of retries, when offline."""
    import requests

    try:
        requests.head(url, timeout=timeout, allow_redirects=True)
    except Exception as e:
        if is_network_error(e):
            raise DataError(f"{what} needs internet ({url} unreachable); {offline_hint}") from None
        raise


def add_tiktoken_arg(parser) -> None:
    parser.add_argument(
        "--tiktoken-file",
        metavar="PATH",
        default=None,
        help=f"GPT-2 r50k_base ranks file for offline use (default: ${TIKTOKEN_ENV}, "
        "else tiktoken downloads it); its sha256 is checked",
    )


def make_output_dir(path, flag: str) -> Path:
    """Creates an output directory (and its parents), or a one-line DataError
    naming the flag that gave it and why it cannot be one."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DataError(f"{flag} {path}: exists and is not a directory") from None
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot create the directory ({e.strerror})") from None
    return path


def refuse_directory(path, flag: str) -> None:
    """A file output whose name is taken by a directory: refused before any work."""
    if Path(path).is_dir():
        raise DataError(f"{flag} {path}: is a directory (give the file to write)")


def os_error_line(e: OSError) -> str:
    """An OSError as "FILE: reason" (both names when it is about two)."""
    names = [os.fspath(n) for n in (e.filename, e.filename2) if n is not None]
    return ": ".join([" -> ".join(map(str, names)), e.strerror or str(e)] if names else [e.strerror or str(e)])


def run_main(main: Callable[[], object]) -> None:
    """Run a script's main(); expected failures (DataError, and a file the system
    refuses: OSError) print one line and exit 1; main's integer return is the status."""
    prog = os.path.basename(sys.argv[0]) or "remat-data"
    try:
        status = main()
    except DataError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        print(f"{prog}: error: {os_error_line(e)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(status if isinstance(status, int) else 0)


def iter_chunks(items: Iterable, n: int):
    """Group an iterable into lists of n (the last may be shorter)."""
    batch = []
    for x in items:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


# --- parallel tokenization ----------------------------------------------------------

_worker_enc = None


def init_gpt2_worker(tiktoken_file=None) -> None:
    """Pool initializer: each worker process builds its own encoding once."""
    global _worker_enc
    _worker_enc = gpt2_encoding(tiktoken_file)


def tokenize_batch(texts: Sequence[str]) -> np.ndarray:
    """Documents (in a worker) to one uint16 array, EOT before each document."""
    if not texts:
        return np.zeros(0, dtype="<u2")
    return np.concatenate([encode_document(_worker_enc, t) for t in texts])


def ordered_pool_map(pool, fn, items: Iterable, window: int):
    """Like pool.imap, but with at most `window` tasks in flight. pool.imap reads its
    whole input eagerly, which for a streamed corpus would pull the dataset into
    memory as fast as the network allows."""
    pending = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
