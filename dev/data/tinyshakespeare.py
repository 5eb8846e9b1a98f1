"""Tiny Shakespeare as GPT-2 token shards: the small real-text dataset for remat.

Downloads the tiny Shakespeare corpus (1.1 MB, karpathy/char-rnn) or reads a local
copy with --input, tokenizes it with the GPT-2 tokenizer and writes

    <output-dir>/tiny_shakespeare_val.bin     token shard, first ~32K tokens
    <output-dir>/tiny_shakespeare_train.bin   token shard, the rest (~298K tokens)
    <output-dir>/gpt2_tokenizer.bin           GPT-2 tokenizer file for decoding

Documents are the paragraphs of the text: it is split at every "\\n\\n" and each
paragraph is written as EOT (50256) followed by its tokens, so decoding the val
tokens then the train tokens, splitting at EOT and joining the pieces with "\\n\\n"
gives back the input text exactly. The validation set is the leading paragraphs, up
to the first paragraph boundary at or after 32,768 tokens; the training set is all
paragraphs after that. Both files start with EOT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SEPARATOR = "\n\n"
VAL_TOKENS = 32768
DEFAULT_DIR = df.DATA_ROOT / "tinyshakespeare"
PREFIX = "tiny_shakespeare"


def split_documents(text: str) -> list[str]:
    """Paragraphs; "\\n\\n".join(split_documents(t)) == t for every t."""
    return text.split(SEPARATOR)


def tokenize_documents(enc, docs: list[str]) -> list[np.ndarray]:
    return [df.encode_document(enc, d) for d in docs]


def split_val_train(doc_tokens: list[np.ndarray], val_tokens: int = VAL_TOKENS):
    """Whole documents into val until it holds >= val_tokens tokens, the rest into train."""
    count, cut = 0, 0
    while cut < len(doc_tokens) and count < val_tokens:
        count += len(doc_tokens[cut])
        cut += 1
    empty = np.zeros(0, dtype="<u2")
    val = np.concatenate(doc_tokens[:cut]) if cut else empty
    train = np.concatenate(doc_tokens[cut:]) if cut < len(doc_tokens) else empty
    return train, val


def load_text(input_path: str | None, out_dir: Path) -> str:
    if input_path is not None:
        try:
            return Path(input_path).read_text(encoding="utf-8")
        except OSError as e:
            raise df.DataError(f"cannot read --input {input_path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise df.DataError(f"--input {input_path} is not UTF-8 text: {e.reason}") from None
    path = df.download(
        URL,
        out_dir / "tiny_shakespeare.txt",
        "tiny Shakespeare",
        "offline, pass --input FILE (e.g. ../shared/data/tinyshakespeare.txt)",
    )
    return path.read_text(encoding="utf-8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", metavar="FILE", help="read this text file instead of downloading")
    df.add_tiktoken_arg(p)
    p.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_DIR,
        help=f"where to write the files (default: {DEFAULT_DIR})",
    )
    p.add_argument(
        "--val-tokens",
        type=int,
        default=VAL_TOKENS,
        help=f"validation size target in tokens, at least 1, rounded up to a paragraph; the training shard "
        f"gets the rest, which must not be empty (default {VAL_TOKENS})",
    )
    return p.parse_args(argv)


def check_split(train: np.ndarray, val: np.ndarray, docs: list[str], args) -> None:
    """Both shards must hold tokens: the trainer cannot train on, or validate
    with, an empty shard."""
    if len(train):
        return
    source = f"--input {args.input}" if args.input else "the downloaded text"
    if not "".join(docs):
        raise df.DataError(f"{source} is empty: no text to make shards of")
    if len(docs) < 2:
        raise df.DataError(f"{source} holds {len(docs)} paragraph ({len(val)} tokens): too little to split into a "
                           "validation and a training shard (paragraphs are separated by a blank line)")
    raise df.DataError(f"--val-tokens {args.val_tokens} takes all {len(val):,} tokens of {source} (whole paragraphs): "
                       "nothing is left for the training shard; give a smaller --val-tokens")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.val_tokens < 1:
        raise df.DataError(f"--val-tokens {args.val_tokens}: must be at least 1 (an empty validation shard)")
    out_dir = df.make_output_dir(args.output_dir, "--output-dir")
    enc = df.gpt2_encoding(args.tiktoken_file)  # before the download: fail fast when offline
    text = load_text(args.input, out_dir)
    docs = split_documents(text)
    train, val = split_val_train(tokenize_documents(enc, docs), args.val_tokens)
    check_split(train, val, docs, args)
    train_path, val_path = df.write_train_val(out_dir, PREFIX, train, val)
    tok_path = out_dir / "gpt2_tokenizer.bin"
    df.write_gpt2_tokenizer(tok_path, enc)
    print(f"{len(text):,} characters, {len(docs):,} paragraphs")
    print(f"wrote {val_path} ({len(val):,} tokens)")
    print(f"wrote {train_path} ({len(train):,} tokens)")
    print(f"wrote {tok_path}")


if __name__ == "__main__":
    df.run_main(main)
