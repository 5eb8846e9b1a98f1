"""A synthetic dataset with a known best possible loss: remat's convergence test.

Real text has no known entropy, so "the loss went down" is all a test can check.
Here the tokens come from a random sparse first-order Markov chain whose entropy
rate H is computed exactly, so a model's validation loss can be compared with the
floor H (in nats per token, the unit of the trainer's cross-entropy loss): a
perfect model's loss equals H and no model can do better on average.

The chain: W "words" (token ids 0..W-1) plus an end-of-text state (id W, so the
vocabulary has V = W+1 tokens; default W=255, V=256). Each word moves to 2..6
words with Dirichlet(1) probabilities and to EOT with a probability drawn from
U(0.01, 0.05); EOT moves to 8..16 document-start words. A random cycle through all
words is part of the successor sets, so the chain is irreducible by construction;
irreducibility and aperiodicity are also checked on the graph. The stationary
distribution pi is solved exactly, and

    H = -sum_i pi_i sum_j P_ij ln P_ij.

Since the chain is first order and each token is the whole state, the best
prediction of the next token needs only the current one, so the floor holds at
every position of a training window, the first included.

The stream starts with EOT and EOT precedes each document, like the GPT-2 shards;
documents have varied lengths (each word ends its document with its own
probability: geometric-like lengths around the mean, many of a few tokens, some
of hundreds).

Packed documents (the trainers' --reset-attention-mask, --reset-position-ids,
--eod-mask-loss; docs/documents.md): masking attention to each document and
restarting positions hide only context the chain does not use (the prediction
after EOT, a document's first, sees EOT itself, which is all it needs), so the
floor stays H. Without the loss where the input is EOT (--eod-mask-loss) the
mean runs over the other tokens only, and the floor is theirs:

    H_counted = -sum_{i != EOT} pi_i sum_j P_ij ln P_ij / (1 - pi_EOT),

written as entropy_nats_per_token_eod_masked.
Outputs, in --output-dir (default data/synthetic/): synthetic_train.bin,
synthetic_val.bin (token shards), synthetic_tokenizer.bin (version-2 tokenizer:
each word decodes as a pronounceable pseudo-word with a leading space, EOT as
"\\n<|endoftext|>\\n"), and synthetic_meta.json (vocab_size, eot,
entropy_nats_per_token, seed, train_tokens, val_tokens, ...). The same seed gives
the same bytes on every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datafile as df  # noqa: E402

DEFAULT_DIR = df.DATA_ROOT / "synthetic"
DEFAULT_SEED = 1337
DEFAULT_WORDS = 255
MAX_WORDS = 4095  # the stationary solve is dense: keep V^3 small
EOT_TEXT = b"\n<|endoftext|>\n"
FORMAT = "remat-synthetic-markov-v1"

WORD_SUCCESSORS = (2, 6)  # inclusive range of word->word successors per word
END_PROB = (0.01, 0.05)  # range of each word's probability of ending the document
START_WORDS = (8, 16)  # inclusive range of words that can start a document

LANES = 4096  # chains sampled side by side
MAX_DOCS_PER_ROUND = 64  # bounds the memory of one sampling round


@dataclass
class Chain:
    words: int
    succ: np.ndarray  # (V, K) successor ids, rows padded with 0
    cum: np.ndarray  # (V, K) cumulative probabilities, last real entry 1.0, pad 2.0
    probs: list[np.ndarray]  # per-state successor probabilities (exact, for P)
    succ_lists: list[np.ndarray]

    @property
    def vocab_size(self) -> int:
        return self.words + 1

    @property
    def eot(self) -> int:
        return self.words


# --- construction -----------------------------------------------------------------


def _pick_others(rng, n: int, k: int, exclude: int) -> np.ndarray:
    """k distinct ids from 0..n-1, none equal to exclude."""
    picks = rng.choice(n - 1, size=k, replace=False)
    return picks + (picks >= exclude)


def _word_row(rng, w: int, cycle_next: int, words: int, eot: int):
    k = min(int(rng.integers(WORD_SUCCESSORS[0], WORD_SUCCESSORS[1] + 1)), words)
    succ = np.concatenate([[cycle_next], _pick_others(rng, words, k - 1, cycle_next), [eot]])
    p_end = rng.uniform(*END_PROB)
    probs = np.concatenate([rng.dirichlet(np.ones(k)) * (1.0 - p_end), [p_end]])
    return succ, probs


def _eot_row(rng, words: int):
    m = min(int(rng.integers(START_WORDS[0], START_WORDS[1] + 1)), words)
    return rng.choice(words, size=m, replace=False), rng.dirichlet(np.ones(m))


def _tables(succ_lists, probs):
    """Padded successor and cumulative-probability tables for vectorised sampling."""
    width = max(len(s) for s in succ_lists)
    V = len(succ_lists)
    succ = np.zeros((V, width), dtype=np.int64)
    cum = np.full((V, width), 2.0)  # above any uniform draw: padding is never chosen
    for i, (s, p) in enumerate(zip(succ_lists, probs)):
        succ[i, : len(s)] = s
        c = np.cumsum(p)
        c[-1] = 1.0  # rounding must not leave a gap at the top
        cum[i, : len(c)] = c
    return succ, cum


def build_chain(words: int, rng: np.random.Generator) -> Chain:
    eot = words
    order = rng.permutation(words)
    cycle_next = np.empty(words, dtype=np.int64)
    cycle_next[order] = np.roll(order, -1)  # a cycle through every word: irreducible
    succ_lists, probs = [], []
    for w in range(words):
        s, p = _word_row(rng, w, int(cycle_next[w]), words, eot)
        succ_lists.append(s)
        probs.append(p)
    s, p = _eot_row(rng, words)
    succ_lists.append(s)
    probs.append(p)
    succ, cum = _tables(succ_lists, probs)
    return Chain(words, succ, cum, probs, succ_lists)


# --- analysis ---------------------------------------------------------------------


def _bfs(adj: list, start: int) -> list[int]:
    level = [-1] * len(adj)
    level[start] = 0
    todo = deque([start])
    while todo:
        u = todo.popleft()
        for v in adj[u]:
            if level[v] < 0:
                level[v] = level[u] + 1
                todo.append(v)
    return level


def irreducible_and_period(succ_lists) -> tuple[bool, int]:
    """Strong connectivity (reach and be reached from state 0) and the period, which
    for an irreducible chain is the gcd of level[u] + 1 - level[v] over edges u->v."""
    adj = [[int(v) for v in s] for s in succ_lists]
    rev = [[] for _ in adj]
    for u, vs in enumerate(adj):
        for v in vs:
            rev[v].append(u)
    level = _bfs(adj, 0)
    if min(level) < 0 or min(_bfs(rev, 0)) < 0:
        return False, 0
    period = 0
    for u, vs in enumerate(adj):
        for v in vs:
            period = math.gcd(period, level[u] + 1 - level[v])
    return True, period


def transition_matrix(chain: Chain) -> np.ndarray:
    V = chain.vocab_size
    P = np.zeros((V, V))
    for i, (s, p) in enumerate(zip(chain.succ_lists, chain.probs)):
        P[i, s] = p
    return P


def stationary(P: np.ndarray) -> np.ndarray:
    """pi with pi P = pi, sum pi = 1: one balance equation (redundant for an
    irreducible chain) is replaced by the normalisation."""
    V = len(P)
    A = P.T - np.eye(V)
    A[-1, :] = 1.0
    b = np.zeros(V)
    b[-1] = 1.0
    pi = np.linalg.solve(A, b)
    if pi.min() <= 0 or np.abs(pi @ P - pi).max() > 1e-12:
        raise df.DataError("stationary distribution solve failed")
    return pi


def entropy_rate(P: np.ndarray, pi: np.ndarray) -> float:
    logs = np.log(np.where(P > 0, P, 1.0))  # 0 ln 0 = 0
    return float(-(pi * (P * logs).sum(axis=1)).sum())


def entropy_rate_without(P: np.ndarray, pi: np.ndarray, state: int) -> float:
    """The entropy rate over the predictions whose input is not `state` (the
    floor of a loss that leaves out the predictions made from EOT)."""
    logs = np.log(np.where(P > 0, P, 1.0))
    per_state = -(P * logs).sum(axis=1)
    keep = np.arange(len(pi)) != state
    return float((pi[keep] * per_state[keep]).sum() / pi[keep].sum())


def unigram_entropy(pi: np.ndarray) -> float:
    return float(-(pi * np.log(pi)).sum())


# --- sampling ---------------------------------------------------------------------


def _sample_round(chain: Chain, lanes: int, docs: int, rng) -> np.ndarray:
    """Each lane runs the chain from EOT and stops just before its (docs+1)-th EOT,
    i.e. after exactly `docs` whole documents. Documents are independent excursions
    from EOT, so lanes laid end to end are an exact sample of one long chain; a fixed
    count per lane (not "whatever fits in n steps") keeps long documents unbiased."""
    eot = chain.eot
    state = np.full(lanes, eot, dtype=np.int64)
    eots_seen = np.ones(lanes, dtype=np.int64)
    active = np.ones(lanes, dtype=bool)
    lengths = np.zeros(lanes, dtype=np.int64)
    rows = []
    while active.any():
        rows.append(state.astype(np.uint16))
        lengths += active
        u = rng.random(lanes)
        k = (chain.cum[state] <= u[:, None]).sum(axis=1)
        nxt = chain.succ[state, k]
        eots_seen += active & (nxt == eot)
        active &= eots_seen <= docs
        state = nxt
    grid = np.stack(rows, axis=1)  # (lanes, steps)
    keep = np.arange(grid.shape[1])[None, :] < lengths[:, None]
    return grid[keep]  # row-major: lane 0's tokens, then lane 1's, ...


def sample_stream(chain: Chain, n_tokens: int, rng, mean_doc: float, lanes: int = LANES):
    """n_tokens of the chain started at EOT (so the stream starts with EOT)."""
    pieces, have = [], 0
    while have < n_tokens:
        need = n_tokens - have
        docs = math.ceil(need / (lanes * mean_doc))
        piece = _sample_round(chain, lanes, min(max(docs, 1), MAX_DOCS_PER_ROUND), rng)
        pieces.append(piece)
        have += len(piece)
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
    return stream[:n_tokens]


# --- vocabulary text --------------------------------------------------------------

_ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "ch", "sh", "th", "br", "tr", "pl", "st", "gr", "kl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "k"]


def word_texts(words: int, rng) -> list[bytes]:
    """Distinct pronounceable pseudo-words, each with a leading space."""
    seen: set[str] = set()
    out = []
    while len(out) < words:
        syllables = int(rng.integers(1, 4))
        w = "".join(
            _ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))]
            for _ in range(syllables)
        ) + _CODAS[rng.integers(len(_CODAS))]
        if w not in seen:
            seen.add(w)
            out.append((" " + w).encode("ascii"))
    return out


# --- command line -----------------------------------------------------------------


def _positive(name, lo, hi):
    def parse(s):
        try:
            v = int(s.replace("_", "").replace(",", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}")
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{name} must be in {lo}..{hi}, got {v}")
        return v

    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"default {DEFAULT_SEED}")
    p.add_argument("--words", type=_positive("--words", 2, MAX_WORDS), default=DEFAULT_WORDS,
                   help=f"number of word tokens W; vocab is W+1 (default {DEFAULT_WORDS})")
    p.add_argument("--train-tokens", type=_positive("--train-tokens", 1, df.MAX_SHARD_TOKENS),
                   default=2_000_000, help="default 2,000,000")
    p.add_argument("--val-tokens", type=_positive("--val-tokens", 1, df.MAX_SHARD_TOKENS),
                   default=100_000, help="default 100,000")
    p.add_argument("--output-dir", type=Path, default=DEFAULT_DIR,
                   help=f"default {DEFAULT_DIR}")
    args = p.parse_args(argv)
    if args.seed < 0:
        p.error("--seed must be >= 0")
    return args


def make_chain(seed: int, words: int):
    """The chain, its analysis and the separate generators for text/train/val, all
    from one seed; val does not depend on --train-tokens and vice versa."""
    chain_ss, names_ss, train_ss, val_ss = np.random.SeedSequence(seed).spawn(4)
    rng = np.random.Generator(np.random.PCG64(chain_ss))
    while True:  # redraw in the (never yet seen) case of a periodic chain
        chain = build_chain(words, rng)
        ok, period = irreducible_and_period(chain.succ_lists)
        if ok and period == 1:
            break
    gens = [np.random.Generator(np.random.PCG64(s)) for s in (names_ss, train_ss, val_ss)]
    return chain, gens


def write_meta(path: Path, meta: dict) -> None:
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = df.make_output_dir(args.output_dir, "--output-dir")  # before the work: a bad directory fails at once
    t0 = time.perf_counter()
    chain, (names_rng, train_rng, val_rng) = make_chain(args.seed, args.words)
    P = transition_matrix(chain)
    pi = stationary(P)
    H, H1 = entropy_rate(P, pi), unigram_entropy(pi)
    H_counted = entropy_rate_without(P, pi, chain.eot)
    mean_doc = 1.0 / pi[chain.eot]  # mean return time to EOT = tokens per document
    tokens = word_texts(args.words, names_rng) + [EOT_TEXT]
    val = sample_stream(chain, args.val_tokens, val_rng, mean_doc)
    train = sample_stream(chain, args.train_tokens, train_rng, mean_doc)

    names = {k: f"synthetic_{k}.bin" for k in ("train", "val", "tokenizer")}
    df.write_shard(out / names["val"], val)
    df.write_shard(out / names["train"], train)
    df.write_tokenizer(out / names["tokenizer"], tokens, chain.eot)
    meta = {
        "format": FORMAT,
        "vocab_size": chain.vocab_size,
        "eot": chain.eot,
        "entropy_nats_per_token": H,
        "entropy_bits_per_token": H / math.log(2),
        "entropy_nats_per_token_eod_masked": H_counted,
        "unigram_entropy_nats": H1,
        "mean_document_tokens": mean_doc,
        "seed": args.seed,
        "words": args.words,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "train_file": names["train"],
        "val_file": names["val"],
        "tokenizer_file": names["tokenizer"],
    }
    write_meta(out / "synthetic_meta.json", meta)  # last: its presence means complete
    dt = time.perf_counter() - t0
    print(f"vocab {chain.vocab_size} (eot {chain.eot}), mean document {mean_doc:.1f} tokens")
    print(f"entropy floor  {H:.6f} nats/token ({H / math.log(2):.4f} bits): a perfect model's loss")
    print(f"unigram entropy {H1:.6f} nats/token (loss of a model ignoring context)")
    print(f"with --eod-mask-loss the floor is {H_counted:.6f} nats/token (the predictions made from EOT left out)")
    print(f"wrote {len(train):,} train + {len(val):,} val tokens to {out} in {dt:.1f}s")


if __name__ == "__main__":
    df.run_main(main)
