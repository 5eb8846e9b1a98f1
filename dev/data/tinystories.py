"""TinyStories as GPT-2 token shards: a mid-size corpus small models learn quickly.

Downloads TinyStories_all_data.tar.gz (1.6 GB, sha256 checked) from the
roneneldan/TinyStories dataset on the HuggingFace hub over HTTP, unpacks its 50
JSON files (data00.json .. data49.json, each a list of records with a "story"),
tokenizes the stories with the GPT-2 tokenizer in a pool of worker processes and
writes, in --output-dir (default data/tinystories/):

    TinyStories_val.bin      every story of data00.json   (~19M tokens)
    TinyStories_train.bin    the stories of data01..data49 (~900M tokens, ~1.8 GB)
    gpt2_tokenizer.bin       GPT-2 tokenizer file for decoding

Each story is stripped of surrounding whitespace and written as EOT (50256) then its
tokens. Needs internet for the archive (or --archive PATH to a local copy) and for
the tokenizer (or --tiktoken-file PATH / $REMAT_TIKTOKEN_FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
from multiprocessing import Pool
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402

URL = (
    "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/"
    "TinyStories_all_data.tar.gz"
)
ARCHIVE = "TinyStories_all_data.tar.gz"
ARCHIVE_SHA256 = "26cf7605aca15bc4ea6fa637256400d9d01317b28ed296172b2d1dd160cd7699"
DEFAULT_DIR = df.DATA_ROOT / "tinystories"
OFFLINE_HINT = (
    "offline, pass --archive PATH to a copy of " + ARCHIVE + ", or use "
    "dev/data/tinyshakespeare.py --input FILE or dev/data/synthetic.py instead"
)


# --- pure parts (tested on small inputs) -----------------------------------------


def stories_from_json(path) -> list[str]:
    """The stories of one data*.json file, whitespace-stripped, in file order."""
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    return [r["story"].strip() for r in records]


def split_files(json_files) -> tuple[list[Path], list[Path]]:
    """(val, train): the first file (sorted by name) is validation, the rest train."""
    files = sorted(Path(p) for p in json_files)
    if len(files) < 2:
        raise df.DataError(f"expected the TinyStories data*.json files, found {len(files)}")
    return files[:1], files[1:]


def tokenize_story_file(path) -> np.ndarray:
    """Worker task: one JSON file to EOT-separated uint16 tokens."""
    return df.tokenize_batch(stories_from_json(path))


def write_split(pool, files, dest: Path, desc: str, workers: int, progress=True) -> int:
    """Tokenize files in order and stream them into one shard; returns its size."""
    with df.ShardWriter(lambda i: dest, None, desc=desc, progress=progress) as writer:
        for tokens in df.ordered_pool_map(pool, tokenize_story_file, files, workers + 1):
            writer.add(tokens)
    return writer.total_tokens


def tokenize_splits(json_files, out_dir: Path, workers: int, tiktoken_file=None,
                    progress: bool | None = True) -> tuple[int, int]:
    """data*.json files to TinyStories_{val,train}.bin; returns the token counts."""
    val_files, train_files = split_files(json_files)
    with Pool(workers, initializer=df.init_gpt2_worker, initargs=(tiktoken_file,)) as pool:
        n_val = write_split(pool, val_files, out_dir / "TinyStories_val.bin", "val",
                            workers, progress)
        n_train = write_split(pool, train_files, out_dir / "TinyStories_train.bin", "train",
                              workers, progress)
    return n_val, n_train


# --- network and files ------------------------------------------------------------


def fetch_archive(out_dir: Path, archive: str | None) -> Path:
    path = Path(archive) if archive else df.download(URL, out_dir / ARCHIVE, "TinyStories",
                                                       OFFLINE_HINT)
    if not path.is_file():
        raise df.DataError(f"archive not found: {path}")
    print(f"checking sha256 of {path}")
    digest = df.sha256_file(path)
    if digest != ARCHIVE_SHA256:
        raise df.DataError(
            f"{path}: sha256 {digest} differs from {ARCHIVE_SHA256}; delete it and rerun"
        )
    return path


def extract(archive: Path, dest: Path) -> list[Path]:
    """Unpack once; a marker written after the last file makes a rerun skip it."""
    marker = dest / ".extracted"
    if not marker.exists():
        print(f"unpacking {archive} to {dest}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")  # refuses paths outside dest
        marker.touch()
    return sorted(dest.rglob("data*.json"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--archive", metavar="PATH", help=f"local {ARCHIVE} instead of downloading")
    df.add_tiktoken_arg(p)
    p.add_argument("--output-dir", type=Path, default=DEFAULT_DIR, help=f"default {DEFAULT_DIR}")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: all cores)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = df.make_output_dir(args.output_dir, "--output-dir")
    enc = df.gpt2_encoding(args.tiktoken_file)  # before the download: fail fast when offline
    files = extract(fetch_archive(out, args.archive), out / "TinyStories_all_data")
    n_val, n_train = tokenize_splits(files, out, max(1, args.workers), args.tiktoken_file)
    df.write_gpt2_tokenizer(out / "gpt2_tokenizer.bin", enc)
    print(f"wrote {out}/TinyStories_val.bin ({n_val:,} tokens), "
          f"TinyStories_train.bin ({n_train:,} tokens), gpt2_tokenizer.bin")


if __name__ == "__main__":
    df.run_main(main)
