"""FineWeb (or FineWeb-Edu) 10B-token sample as GPT-2 token shards, for GPT-2 runs.

Streams the "sample-10BT" configuration of HuggingFaceFW/fineweb (default) or
HuggingFaceFW/fineweb-edu (--version edu) from the HuggingFace hub with the
`datasets` library (pip install -r dev/data/requirements-full.txt), tokenizes the
documents with the GPT-2 tokenizer in a pool of worker processes, and writes shards
of exactly --shard-size tokens (default 100,000,000; the last shard holds the rest):

    data/fineweb10B/fineweb_val_000000.bin        first shard: validation
    data/fineweb10B/fineweb_train_000001.bin ...  the rest: training
    (--version edu: data/edu_fineweb10B/edu_fineweb_{val,train}_%06d.bin)

About 100 shards of 200 MB, ~20 GB in all. Each document is EOT (50256) followed by
its tokens; a document that crosses a shard boundary continues in the next shard.
Nothing is downloaded to disk besides the shards. Needs internet throughout.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402

VERSIONS = {
    # version: (hub repository, output folder, shard file prefix)
    "classic": ("HuggingFaceFW/fineweb", "fineweb10B", "fineweb"),
    "edu": ("HuggingFaceFW/fineweb-edu", "edu_fineweb10B", "edu_fineweb"),
}
CONFIG = "sample-10BT"
SHARD_TOKENS = 100_000_000
DOCS_PER_TASK = 64  # documents per worker task: amortises inter-process traffic
OFFLINE_HINT = (
    "offline, use dev/data/tinyshakespeare.py --input FILE --tiktoken-file PATH "
    "or dev/data/synthetic.py instead"
)


# --- pure parts (tested on small inputs) -----------------------------------------


def shard_path(out_dir, prefix: str, index: int) -> Path:
    """Shard 0 is validation, every later shard training; the index runs on."""
    split = "val" if index == 0 else "train"
    return Path(out_dir) / f"{prefix}_{split}_{index:06d}.bin"


def write_shards(token_arrays, out_dir, prefix: str, shard_tokens: int = SHARD_TOKENS,
                 progress: bool | None = None) -> list[str]:
    """Cut a stream of token arrays into shards of exactly shard_tokens tokens."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with df.ShardWriter(lambda i: shard_path(out_dir, prefix, i), shard_tokens,
                        desc=prefix, progress=progress) as writer:
        for tokens in token_arrays:
            writer.add(tokens)
    return writer.paths


def document_texts(rows, limit: int | None = None):
    """The "text" field of each dataset row, optionally only the first `limit`."""
    texts = (row["text"] for row in rows)
    return itertools.islice(texts, limit) if limit is not None else texts


def tokenize_to_shards(texts, out_dir, prefix: str, shard_tokens: int, workers: int,
                       tiktoken_file=None, progress: bool | None = True) -> list[str]:
    """Documents (any iterable of str, consumed lazily) to shards, tokenized in a
    pool; order is preserved, so the shards do not depend on the worker count."""
    with Pool(workers, initializer=df.init_gpt2_worker, initargs=(tiktoken_file,)) as pool:
        batches = df.iter_chunks(texts, DOCS_PER_TASK)
        arrays = df.ordered_pool_map(pool, df.tokenize_batch, batches, 4 * workers)
        return write_shards(arrays, out_dir, prefix, shard_tokens, progress)


# --- network ----------------------------------------------------------------------


def stream_dataset(repo: str):
    try:
        import datasets  # lazy: --help and the tests must work without it
    except ImportError:
        raise df.DataError(
            "the datasets package is needed: pip install -r dev/data/requirements-full.txt"
        ) from None
    return datasets.load_dataset(repo, name=CONFIG, split="train", streaming=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", choices=sorted(VERSIONS), default="classic",
                   help="classic = HuggingFaceFW/fineweb, edu = HuggingFaceFW/fineweb-edu")
    df.add_tiktoken_arg(p)
    p.add_argument("--output-dir", type=Path, default=None,
                   help="default data/fineweb10B (edu: data/edu_fineweb10B)")
    p.add_argument("--shard-size", type=int, default=SHARD_TOKENS,
                   help=f"tokens per shard (default {SHARD_TOKENS:,})")
    p.add_argument("--max-docs", type=int, default=None,
                   help="stop after this many documents (for a quick trial)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: all cores)")
    args = p.parse_args(argv)
    if not 0 < args.shard_size <= df.MAX_SHARD_TOKENS:
        p.error(f"--shard-size must be in 1..{df.MAX_SHARD_TOKENS}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    repo, folder, prefix = VERSIONS[args.version]
    out = df.make_output_dir(args.output_dir or df.DATA_ROOT / folder, "--output-dir")
    df.gpt2_encoding(args.tiktoken_file)  # fail fast when offline or the file is bad
    workers = max(1, args.workers)
    hub = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    df.check_reachable(hub, f"fineweb (streaming {repo})", OFFLINE_HINT)
    try:
        texts = document_texts(stream_dataset(repo), args.max_docs)
        paths = tokenize_to_shards(texts, out, prefix, args.shard_size, workers,
                                   args.tiktoken_file)
    except Exception as e:
        if df.is_network_error(e):
            raise df.DataError(
                f"fineweb needs internet to stream {repo} from the HuggingFace hub "
                f"({type(e).__name__}); {OFFLINE_HINT}"
            ) from None
        raise
    print(f"wrote {len(paths)} shards to {out} (first is val)")


if __name__ == "__main__":
    df.run_main(main)
