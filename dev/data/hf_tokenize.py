#!/usr/bin/env python3
"""Text to llm.c's llama-3 token shards with a model's own tokenizer.json.

    python3 dev/data/hf_tokenize.py --tokenizer HF_DIR_OR_TOKENIZER_JSON INPUT... [--output-dir DIR]

INPUT files are documents: a `.jsonl` file holds one JSON object per line whose
--text-field (default "text") is a document; any other file is one document, or
several cut at --doc-separator (e.g. $'\\n\\n'). Each document is encoded with the
`tokenizers` package (the tokenizer.json of a Llama or Qwen2 checkpoint; no
special tokens added by the tokenizer) and preceded by the family's document
delimiter, the token the trainers' --eot-token names (docs/documents.md):

- llama: the beginning of text, `<|begin_of_text|>` (Llama 3, 128000) or `<s>`
  (Llama 2), as Meta's tokenizers put it before each document;
- qwen2: `<|endoftext|>` (151643), which Qwen writes between documents (its
  tokenizer adds no beginning-of-text token).

The family comes from config.json beside tokenizer.json (model_type) or
--family; --delimiter TOKEN names another. Documents are packed as
pack_documents.py packs GPT-2's: those of at least --min-tokens tokens (the
delimiter included), shuffled with --seed if given (which holds every document in
memory; without it they stream to disk), back to back, cut into shards of
--shard-tokens (a document may continue in the next shard). The first
--val-docs documents go to PREFIX_val.bin, the rest to PREFIX_train_000000.bin,
... Shards are version 7 (magic 20240801, uint32 tokens; docs/FORMATS.md).

It also writes PREFIX_tokenizer.bin (docs/FORMATS.md: each token's bytes, the
delimiter as end of text) for the trainers to decode samples, with the model's
vocabulary size (config.json's vocab_size or --vocab-size: ids the tokenizer does
not use decode as `<|ID|>`), and PREFIX_tokenizer.json, a copy of the tokenizer
that dev/data/prompt.py uses to encode --prompt text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402
from datafile import DataError  # noqa: E402

DELIMITERS = {"llama": ("<|begin_of_text|>", "<s>"), "qwen2": ("<|endoftext|>",)}


def import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("the tokenizers package is not installed: pip install -r dev/data/requirements.txt") from None
    return tokenizers


def tokenizer_paths(given: str) -> tuple[Path, Path | None]:
    """(tokenizer.json, config.json or None) from a model directory or the file itself."""
    path = Path(given)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"--tokenizer {given}: no tokenizer.json there")
    config = path.parent / "config.json"
    return path, config if config.is_file() else None


def load_tokenizer(path: Path):
    tokenizers = import_tokenizers()
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the package reports a bad file in its own exception type
        raise DataError(f"{path}: not a tokenizer.json the tokenizers package reads ({str(e).splitlines()[0]})") from None


# --- each token's bytes --------------------------------------------------------------------


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's, also Llama 3's and Qwen2's): the printable
    bytes stand for themselves, every other byte for the code point 256 + its rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_of = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in char_of]
    char_of.update({b: chr(256 + i) for i, b in enumerate(others)})
    return {c: b for b, c in char_of.items()}


def _decoder_types(node) -> set[str]:
    if not isinstance(node, dict):
        return set()
    out = {node.get("type")}
    for child in node.get("decoders") or []:
        out |= _decoder_types(child)
    return out


def token_bytes_table(tok, spec: dict, vocab_size: int) -> list[bytes]:
    """Bytes of every id below vocab_size: byte-level tokens through the alphabet,
    SentencePiece-style ones with ▁ as space and <0xNN> as a byte, added (special)
    tokens as their text, ids without a token as <|ID|>."""
    byte_level = "ByteLevel" in _decoder_types(spec.get("decoder"))
    alphabet = byte_level_alphabet()
    added = {t["id"] for t in spec.get("added_tokens") or []}
    table = []
    for i in range(vocab_size):
        text = tok.id_to_token(i)
        if text is None:
            raw = f"<|{i}|>".encode()
        elif i in added:
            raw = text.encode("utf-8")
        elif byte_level:
            raw = bytes(alphabet[c] for c in text) if all(c in alphabet for c in text) else text.encode("utf-8")
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            raw = bytes([int(text[3:5], 16)])
        else:
            raw = text.replace("\u2581", " ").encode("utf-8")
        if not 1 <= len(raw) <= 255:  # the tokenizer file's bound; decoding such a token shows its id
            raw = f"<|{i}|>".encode()
        table.append(raw)
    return table


# --- the family's conventions ------------------------------------------------------------------


def read_config(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path}: not JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def delimiter_id(tok, family: str, config: dict, given: str | None) -> tuple[int, str]:
    """(id, text) of the token that precedes each document."""
    names = (given,) if given else DELIMITERS[family]
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid, name
    if given:
        raise DataError(f"--delimiter {given!r} is not a token of the tokenizer")
    key = "bos_token_id" if family == "llama" else "eos_token_id"
    tid = config.get(key)
    if isinstance(tid, list):
        tid = tid[0] if tid else None
    if isinstance(tid, int) and not isinstance(tid, bool) and tok.id_to_token(tid) is not None:
        return tid, tok.id_to_token(tid)
    raise DataError(f"the tokenizer has none of {', '.join(names)} and config.json no {key}: name the token that starts "
                    "a document with --delimiter")


# --- documents ------------------------------------------------------------------------------


def documents(paths: list[str], text_field: str, separator: str | None):
    for name in paths:
        path = Path(name)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{n}: not JSON ({e})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                    raise DataError(f"{path}:{n}: no string field {text_field!r}")
                yield obj[text_field]
        elif separator:
            yield from (d for d in text.split(separator) if d.strip())
        else:
            yield text


def encode_documents(tok, texts, delimiter: int, batch: int = 256):
    """Each document's ids with the delimiter first, as uint32, and whether it held
    the delimiter's own text (the tokenizer turns that text into the token)."""
    for chunk in df.iter_chunks(texts, batch):
        for enc in tok.encode_batch(chunk, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.uint32)
            yield np.concatenate([np.array([delimiter], np.uint32), ids]), bool(np.any(ids == delimiter))


def counted(encoded, stats: dict):
    """encode_documents' output, counting documents seen and those holding the delimiter."""
    for ids, inside in encoded:
        stats["seen"] += 1
        stats["inside"] += inside
        yield ids, inside


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text files (one document each, or cut at --doc-separator) or .jsonl files")
    p.add_argument("--tokenizer", required=True, help="a Hugging Face model directory, or its tokenizer.json")
    p.add_argument("--output-dir", default=str(df.DATA_ROOT / "hf_tokenized"), help="where the shards go (default data/hf_tokenized)")
    p.add_argument("--prefix", default=None, help="file names PREFIX_train_000000.bin, ... (default: the family)")
    p.add_argument("--family", choices=tuple(DELIMITERS), default=None, help="default: config.json's model_type")
    p.add_argument("--delimiter", default=None, help="the token (its text) that precedes each document (default: the family's)")
    p.add_argument("--vocab-size", type=int, default=None, help="the model's vocabulary (default: config.json's vocab_size, "
                                                                 "else the tokenizer's)")
    p.add_argument("--text-field", default="text", help="the field of a .jsonl line that holds the document (default text)")
    p.add_argument("--doc-separator", default=None, help="cut text files into documents at this string")
    p.add_argument("--val-docs", type=int, default=0, help="documents for PREFIX_val.bin (default 0: none)")
    p.add_argument("--min-tokens", type=int, default=1, help="keep documents of at least this many tokens (default 1: all)")
    p.add_argument("--seed", type=int, default=None, help="shuffle the documents with this seed (default: keep their order)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per training shard (default 100M)")
    a = p.parse_args(argv)
    if a.val_docs < 0 or a.min_tokens < 1 or not 0 < a.shard_tokens <= df.MAX_SHARD_TOKENS:
        raise DataError("--val-docs must be >= 0, --min-tokens and --shard-tokens positive")
    for name in a.inputs:
        if not Path(name).is_file():
            raise DataError(f"input {name}: no such file")
    tok_path, config_path = tokenizer_paths(a.tokenizer)
    config = read_config(config_path)
    family = a.family or config.get("model_type")
    if family not in DELIMITERS:
        raise DataError(f"family {family!r} (config.json's model_type): give --family llama or qwen2")
    tok = load_tokenizer(tok_path)
    spec = json.loads(tok_path.read_text())
    vocab = a.vocab_size or config.get("vocab_size") or tok.get_vocab_size(with_added_tokens=True)
    if not isinstance(vocab, int) or not tok.get_vocab_size(with_added_tokens=True) <= vocab <= df.MAX_VOCAB:
        raise DataError(f"vocabulary size {vocab!r}: must hold the tokenizer's {tok.get_vocab_size(with_added_tokens=True)} "
                        f"tokens and be at most {df.MAX_VOCAB}")
    delim, delim_text = delimiter_id(tok, family, config, a.delimiter)
    prefix = a.prefix or family
    out = df.make_output_dir(a.output_dir, "--output-dir")
    stats = {"seen": 0, "inside": 0}

    docs = (ids for ids, _ in counted(encode_documents(tok, documents(a.inputs, a.text_field, a.doc_separator), delim),
                                      stats) if len(ids) >= a.min_tokens)
    if a.seed is not None:  # shuffling needs every document at once; without it they stream to the shards
        docs = list(docs)
        docs = iter([docs[i] for i in np.random.default_rng(a.seed).permutation(len(docs))])
    val = [ids for _, ids in zip(range(a.val_docs), docs)]  # the first --val-docs documents
    kept_train = 0
    with df.ShardWriter(lambda i: out / f"{prefix}_train_{i:06d}.bin", a.shard_tokens, desc="train", progress=False,
                        version=df.SHARD_VERSION_U32) as writer:
        for ids in docs:
            writer.add(ids)
            kept_train += 1
        if not kept_train:  # nothing written stays: the writer aborts
            raise DataError(f"no training document of at least {a.min_tokens} tokens (of {stats['seen']}; "
                            f"--val-docs took {len(val)})")
    if val:
        df.write_shard(out / f"{prefix}_val.bin", np.concatenate(val), version=df.SHARD_VERSION_U32)
    df.write_tokenizer(out / f"{prefix}_tokenizer.bin", token_bytes_table(tok, spec, vocab), delim)
    shutil.copyfile(tok_path, out / f"{prefix}_tokenizer.json")
    print(f"{family}: each document after {delim_text} ({delim}); kept {len(val) + kept_train:,} of {stats['seen']:,} "
          f"documents, {writer.total_tokens:,} training tokens in {len(writer.paths)} shard(s), "
          f"{sum(map(len, val)):,} validation tokens; vocabulary {vocab:,}; wrote {out}/{prefix}_*")
    if stats["inside"]:
        print(f"note: {stats['inside']} document(s) hold the text of {delim_text}, which the tokenizer turned into that "
              "token: those documents split there")


if __name__ == "__main__":
    df.run_main(main)
