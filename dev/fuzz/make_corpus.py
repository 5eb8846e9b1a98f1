"""Writes the seed corpus of the fuzz harnesses (dev/fuzz/corpus/<harness>/):
small valid files of every format, so fuzzing starts past the magic numbers.
Run once; the output is committed, and crash inputs found later are added
beside these as regressions."""
import struct
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "corpus"


def header(values, fill=256):
    return struct.pack(f"<{fill}i", *(list(values) + [0] * (fill - len(values))))


def put(harness, name, data):
    d = OUT / harness
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def model(version, maxT=2, V=3, L=1, NH=1, C=2, Vp=4):
    params = Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C
    payload = np.linspace(-1, 1, params, dtype=np.float32)
    body = payload.tobytes() if version == 3 else (payload.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return header([20240326, version, maxT, V, L, NH, C, Vp]) + body


def main():
    put("model", "v3", model(3))
    put("model", "v5", model(5))
    put("model", "v3_two_heads", model(3, C=4, NH=2))
    tokens = np.array([0, 1, 2, 1, 0, 63, 5], dtype=np.uint16)
    put("shard", "v64", b"\x01" + header([20240520, 1, len(tokens)]) + tokens.tobytes())
    put("shard", "v2", b"\x00" + header([20240520, 1, 3]) + np.array([0, 1, 1], dtype=np.uint16).tobytes())
    toks = [b"a", b"bc", b"\n"]
    put("tokenizer", "v2", header([20240328, 2, len(toks), 2]) + b"".join(bytes([len(t)]) + t for t in toks))
    put("tokenizer", "v1", header([20240328, 1, 2]) + b"\x01a\x01b")
    st = [0] * 256
    st[0:9] = [20240527, 2, 3, 1, 0, 0, 0, 2, 4]
    st[13] = 5  # parameters
    st[15] = 5  # this rank's shard
    st[17] = struct.unpack("<i", struct.pack("<f", 65536.0))[0]
    st[21] = 3
    st[22], st[23] = 0x12345678, 0x0abcdef0
    put("state", "plain", struct.pack("<256i", *st) + np.zeros(10, dtype=np.float32).tobytes())
    st[6] = 1
    put("state", "master", struct.pack("<256i", *st) + np.zeros(15, dtype=np.float32).tobytes())
    put("done", "marker", b"run 0123456789abcdef\n")
    put("done", "name_done", b"DONE_00000012")
    put("done", "name_model", b"model_00000012.bin")
    put("done", "log_train", b'{"step": 4, "loss": 1.5, "lr": 0.001, "norm": 1, "ms": 1.0, "tokens_per_s": 10.0}\n')
    put("done", "log_val", b'{"step": 5, "val_loss": 2.5}\n')
    flags = [["-b", "4", "-t", "64", "-l", "1e-3"], ["-r", "1", "--recompute-layers", "every:3"],
             ["-r", "1", "--recompute-layers", "0,2,5-7"], ["-r", "auto", "--mem-budget", "80GiB"],
             ["--mem-budget", "1e9", "--plan"], ["-r", "1", "--recompute-layers", "3"], ["-y", "1", "-o", "out", "-nk", "2"]]
    for i, f in enumerate(flags):
        put("flags", f"args{i}", bytes([8 + i]) + b"\0".join(a.encode() for a in f))


if __name__ == "__main__":
    sys.exit(main())
