"""Pack a long-document corpus for long-context fine-tuning (docs/finetune_long.md).

Reads token shards in which the end-of-text token precedes each document (llm.c's
and dev/data's shards; uint16 or uint32 tokens, and the output is uint32 when any
input is), keeps the documents of at least --min-tokens tokens (the
end-of-text token included), optionally shuffles them (--seed), and writes them
back to back, each still preceded by its end-of-text token, as new shards of at
most --shard-tokens tokens. The trainers then cut sequences of T tokens from the
stream as from any shard; with --reset-attention-mask, --reset-position-ids and
--eod-mask-loss (docs/documents.md) each document trains as if alone in its
sequence, and a document longer than T continues in the next sequence.

Tokens before a shard's first end-of-text token belong to a document begun in an
earlier shard and are dropped (their count is printed). It prints what it kept,
and for sequences of --seq-len tokens how many fewer (query, key) pairs attention
computes with the mask than without.

    python3 dev/data/pack_documents.py "data/fineweb10B/fineweb_train_*.bin" data/long --min-tokens 4096 --seq-len 16384
"""
import argparse
import glob
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402


def documents(tokens: np.ndarray, eot: int):
    """(documents, tokens before the first end of text): each document from its
    end-of-text token up to the next one."""
    starts = np.flatnonzero(tokens == eot)
    if len(starts) == 0:
        return [], len(tokens)
    ends = np.append(starts[1:], len(tokens))
    return [tokens[a:b] for a, b in zip(starts, ends)], int(starts[0])


def attended_pairs(lengths, T: int):
    """Pairs attention computes over the packed stream cut into rows of T:
    without the mask T (T + 1) / 2 a row, with it the sum over each row's
    pieces of documents of len (len + 1) / 2."""
    total = int(sum(lengths))
    rows = total // T
    masked, pos = 0, 0
    for n in lengths:  # walk the stream, cutting documents at row edges
        while n > 0 and pos < rows * T:
            piece = min(n, T - pos % T)
            masked += piece * (piece + 1) // 2
            n -= piece
            pos += piece
    return rows * T * (T + 1) // 2, masked


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", help="token shards (a glob)")
    p.add_argument("output_dir", type=Path)
    p.add_argument("--eot", type=int, default=50256, help="the end-of-text token (default 50256, GPT-2's)")
    p.add_argument("--min-tokens", type=int, default=1, help="keep documents of at least this many tokens (default 1: all)")
    p.add_argument("--seed", type=int, default=None, help="shuffle the documents with this seed (default: keep their order)")
    p.add_argument("--seq-len", type=int, default=None, help="report the attention pairs saved at this T")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per output shard (default 100M)")
    p.add_argument("--prefix", default="packed", help="output names PREFIX_000000.bin, ... (default packed)")
    a = p.parse_args(argv)
    paths = sorted(glob.glob(a.inputs))
    if not paths:
        p.error(f"no files match {a.inputs!r}")
    if a.min_tokens < 1 or a.shard_tokens < 1 or (a.seq_len is not None and a.seq_len < 1):
        p.error("--min-tokens, --shard-tokens and --seq-len must be positive")
    kept, seen, dropped_lead = [], 0, 0
    # uint32 tokens in, uint32 tokens out (llm.c's llama-3 shards): the widest input's version
    version = max(df.read_shard_version(path) for path in paths)
    for path in paths:
        docs, lead = documents(df.read_shard(path), a.eot)
        dropped_lead += lead
        seen += len(docs)
        kept += [d for d in docs if len(d) >= a.min_tokens]
    if not kept:
        sys.exit(f"error: no document of at least {a.min_tokens} tokens (of {seen}) in {len(paths)} shard(s)")
    if a.seed is not None:
        order = np.random.default_rng(a.seed).permutation(len(kept))
        kept = [kept[i] for i in order]
    out = df.make_output_dir(a.output_dir, "output_dir")
    stream = np.concatenate(kept)
    names = []
    for i, s in enumerate(range(0, len(stream), a.shard_tokens)):
        name = out / f"{a.prefix}_{i:06d}.bin"
        df.write_shard(name, stream[s:s + a.shard_tokens], version=version)
        names.append(name.name)
    lengths = [len(d) for d in kept]
    print(f"kept {len(kept):,} of {seen:,} documents ({len(stream):,} tokens, mean {np.mean(lengths):.0f}, "
          f"longest {max(lengths):,}); {dropped_lead:,} tokens before a shard's first end of text dropped")
    print(f"wrote {len(names)} shard(s) to {out}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    if a.seq_len:
        full, masked = attended_pairs(lengths, a.seq_len)
        if full:
            print(f"at T={a.seq_len}: attention computes {full / masked:.1f}x fewer (query, key) pairs with --reset-attention-mask")


if __name__ == "__main__":
    df.run_main(main)
