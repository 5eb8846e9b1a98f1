#!/usr/bin/env python3
"""Token ids of a prompt, for the trainers' sampling.

    python3 dev/data/prompt.py [--tokenizer FILE] [-o FILE] [--] TEXT

Prints the ids of TEXT separated by spaces (or writes them to -o FILE), the
format `--prompt-tokens FILE` reads. `train_gpt --prompt TEXT` runs this
script itself, passing the tokenizer file it loaded.

The vocabulary: a model's own tokenizer.json (the `tokenizers` package) when
one lies beside the tokenizer file with its name (PREFIX_tokenizer.json beside
PREFIX_tokenizer.bin, as dev/data/hf_tokenize.py writes them); GPT-2's (tiktoken;
offline with --tiktoken-file or $REMAT_TIKTOKEN_FILE) when no tokenizer file is
given or the file is GPT-2's (50257 tokens, end-of-text 50256); for any other
tokenizer file (the synthetic
dataset's, a byte-level one) a greedy longest match over its tokens, which is
exact for vocabularies like those, where each token is a word or a byte.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402
from datafile import DataError  # noqa: E402


def longest_match_ids(text: bytes, vocab: list[bytes]) -> list[int]:
    """Greedy longest-match segmentation of text into tokens of vocab."""
    ids_of = {}
    for i, tok in enumerate(vocab):
        ids_of.setdefault(tok, i)  # the first id of a repeated token
    longest = max(len(t) for t in vocab)
    ids, pos = [], 0
    while pos < len(text):
        for n in range(min(longest, len(text) - pos), 0, -1):
            tid = ids_of.get(text[pos:pos + n])
            if tid is not None:
                ids.append(tid)
                pos += n
                break
        else:
            raise DataError(f"byte {pos} of the prompt ({text[pos:pos + 1]!r}) is in no token of the vocabulary")
    return ids


def hf_tokenizer_beside(tokenizer: str) -> Path | None:
    """The tokenizer.json that dev/data/hf_tokenize.py copies beside the tokenizer
    file it writes (PREFIX_tokenizer.bin, PREFIX_tokenizer.json), if there is one."""
    path = Path(tokenizer).with_suffix(".json")
    return path if path.is_file() else None


def prompt_ids(text: str, tokenizer: str | None, tiktoken_file: str | None) -> list[int]:
    if tokenizer and hf_tokenizer_beside(tokenizer):
        import hf_tokenize
        tok = hf_tokenize.load_tokenizer(hf_tokenizer_beside(tokenizer))
        return tok.encode(text, add_special_tokens=False).ids
    if tokenizer:
        vocab, eot = df.read_tokenizer(tokenizer)
        if len(vocab) != df.GPT2_VOCAB_SIZE or eot != df.GPT2_EOT:
            return longest_match_ids(text.encode("utf-8"), vocab)
    return df.gpt2_encoding(tiktoken_file).encode_ordinary(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", help="the prompt")
    p.add_argument("--tokenizer", help="tokenizer file (docs/FORMATS.md); default: GPT-2's vocabulary")
    p.add_argument("-o", "--output", help="write the ids to this file instead of standard output")
    df.add_tiktoken_arg(p)
    args = p.parse_args(argv)
    if args.output:
        df.refuse_directory(args.output, "-o")
    ids = prompt_ids(args.text, args.tokenizer, args.tiktoken_file)
    if not ids:
        raise DataError("the prompt is empty")
    line = " ".join(map(str, ids)) + "\n"
    if args.output:
        try:
            Path(args.output).write_text(line)
        except OSError as e:
            raise DataError(f"-o {args.output}: cannot write ({e.strerror})") from None
    else:
        sys.stdout.write(line)


if __name__ == "__main__":
    df.run_main(main)
