"""The Llama family on the emulated NCCL (dev/emu; NOT a GPU, NOT NCCL) at the trainer level: train_gpt.cu's ring
(--context-parallel 2 and 3, `mpirun` of emu_train_gpt_mpi_*) and data parallelism with ZeRO-1, on a Llama model
with grouped-query attention, against one process holding the whole batch (the plain emulated trainer).

The model: a Hugging Face checkpoint written here (test_hf_llama's writer) and imported by dev/data/hf_llama.py:
RMSNorm, RoPE, SwiGLU, an untied head, NH 6 query heads sharing NKV 2 K/V heads (groups of 3) of HD 8, C 48. The
ring carries the compact K/V (2 NKV HD a token, after RoPE: llmc/cuda/ring.cuh), and each rank turns its rows by
their global positions (token_position: the zigzag's chunks r and 2N-1-r).

Bounds. The ring and the data-parallel ranks regroup fp32 sums only (attention merged from per-block log-sum-exps;
weight gradients summed per rank, then across ranks), so FP32 losses over a few AdamW steps agree to 1e-5 relative
(test_emu_context_parallel's and test_emu_multigpu's bound and reasons; measured here: within 1e-6 absolute).
BF16 is wider than GPT-2's 1e-3: this model's logits are larger (step 1's loss 6.6 over 300 tokens), so a one-ulp
change moves its loss more. Data parallelism rounds each rank's gradients before the sum (measured: step 1 equal,
then 4.1e-5, 2.4e-3, 3.7e-3); the ring's fp32 merge moves attention's bf16 output by an ulp here and there
(measured: 7.1e-4 at step 1, at most 4.5e-3 after), the one process in BF16 being itself 3.6e-4 (step 1) to 5.0e-3
(step 4) from its FP32 run. Bounds: step 1 within 2e-3 absolute (data parallelism: 1e-3 relative), every step
within 1e-2 absolute. A row turned by its local place instead of its global position moves step 1 by 2.3e-2 and
later steps by 0.09 to 0.29. With documents (--reset-attention-mask --reset-position-ids) RoPE's positions restart
at each document's start, found at the global row: the FP32 bound. -r 1 under the ring runs the forward ring, RoPE
included, again in the backward, -r 2 keeps attention's output: bitwise -r 0's steps (the slow set).

Mutants (the slow set builds each into a copy of the sources; the fast set checks that their text is there): RoPE
turning a row by its local place (n % T) instead of its global position: the losses move past the bounds; the ring
reading a received K/V block, or packing this rank's out of qkv, with the query heads' width (2 NH HD, GPT-2's
3C row) instead of the compact 2 NKV HD: the emulator stops the run (a read of ring.dkv_blocks never written, past
the K/V block; a copy running past layer0.qkv's end).
"""
import subprocess
import sys

import numpy as np
import pytest

import test_hf_llama as hf
from conftest import REPO, datafile
from test_emu_context_parallel import FP32_REL
from test_emu_multigpu import bins, env, explain, steps  # noqa: F401
from test_offload import files
from emu_support import assert_mutant_applies, mutant_sources, slow

EOT = 7
NH, NKV, HD = 6, 2, 8
C = NH * HD


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The imported model file and a token shard in which EOT starts a document about every 9 tokens."""
    d = tmp_path_factory.mktemp("emu_llama_ring")
    config = hf.llama_config(hidden_size=C, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD)
    hf.write_hf(d / "hf", config, hf.hf_state(config, np.random.default_rng(11)))
    res = subprocess.run([sys.executable, REPO / "dev/data/hf_llama.py", "import", d / "hf", d / "m.bin"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rng = np.random.default_rng(13)
    tokens = rng.integers(EOT + 1, config["vocab_size"], 20000)
    tokens[rng.random(tokens.size) < 1 / 9] = EOT
    datafile.write_shard(d / "t.bin", tokens)
    return d


def train(bins, llama, ranks, precision, *flags, **extra):
    """ranks 0: the plain emulated trainer, one process, no NCCL; else mpirun -np ranks of the NCCL build."""
    common = ["-e", llama / "m.bin", "-i", llama / "t.bin", "-j", "", "-t", "32", "-s", "0", "-l", "1e-3", *flags]
    exe = bins / f"emu_train_gpt_{precision}" if ranks == 0 else bins / f"emu_train_gpt_mpi_{precision}"
    args = [exe, *common] if ranks == 0 else ["mpirun", "-np", str(ranks), exe, *common]
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=900, env=env(**extra), cwd=REPO)


def ring(bins, llama, precision, n, *flags):
    res = train(bins, llama, n, precision, "--context-parallel", str(n), *flags, EMU_DEVICE_COUNT=str(n))
    assert f"context parallel: NCCL ring of {n} in each group" in res.stdout, explain(res)
    return res


BF16_STEP1_ABS, BF16_ABS = 2e-3, 1e-2  # module docstring


def assert_within(one, two, precision):
    assert len(one) == len(two) and len(one) > 0, (one, two)
    assert [a[0] for a in one] == [b[0] for b in two]
    diffs = [abs(float(a[1]) - float(b[1])) for a, b in zip(one, two)]
    print(f"{precision}: |loss(ring) - loss(1 process)| per step: {diffs}")
    if precision == "fp32":
        assert all(d <= FP32_REL * float(a[1]) for d, a in zip(diffs, one)), (one, two)
    else:
        assert diffs[0] <= BF16_STEP1_ABS and all(d <= BF16_ABS for d in diffs), (one, two)


DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eot-token", str(EOT)]


def test_the_model_is_grouped_query_llama(llama):
    """The imported file's header (docs/FORMATS.md: slots 8-10 family, K/V heads, head size) says Llama with NKV < NH."""
    head = np.fromfile(llama / "m.bin", dtype=np.int32, count=256)
    assert list(head[8:11]) == [2, NKV, HD] and head[5] == NH and head[6] == C, head[:16]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_members_match_one_process(bins, llama, precision):
    one = steps(train(bins, llama, 0, precision, "-b", "2", "-x", "4"))
    assert_within(one, steps(ring(bins, llama, precision, 2, "-b", "2", "-x", "4")), precision)


def test_three_members_match_one_process(bins, llama):
    """T = 24: chunks of 4; K/V passed on twice round a ring of three (a ring of two cannot tell its direction)."""
    one = steps(train(bins, llama, 0, "fp32", "-b", "2", "-t", "24", "-x", "3"))
    assert_within(one, steps(ring(bins, llama, "fp32", 3, "-b", "2", "-t", "24", "-x", "3")), "fp32")


@pytest.mark.parametrize("n, T", [(2, "32"), (3, "24")])
def test_documents_match_one_process(bins, llama, n, T):
    """Positions restarting at each document (RoPE at position - document start, both global) and the document mask."""
    one = train(bins, llama, 0, "fp32", "-b", "2", "-t", T, "-x", "3", *DOCS)
    assert_within(steps(one), steps(ring(bins, llama, "fp32", n, "-b", "2", "-t", T, "-x", "3", *DOCS)), "fp32")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_data_parallel_ranks_with_zero1_match_one_rank(bins, llama, precision):
    """2 ranks x B 1 with ZeRO-1 (each rank updates half the parameters, then all-gathers) against 1 rank x B 2."""
    one = steps(train(bins, llama, 0, precision, "-b", "2", "-x", "4"))
    res = train(bins, llama, 2, precision, "-b", "1", "-x", "4", "-z", "1")
    assert "data parallel: 2 processes, NCCL" in res.stdout and "ZeRO-1" in res.stdout, explain(res)
    two = steps(res)
    assert len(one) == len(two) == 4, (one, two)
    diffs = [abs(float(a[1]) - float(b[1])) for a, b in zip(one, two)]
    print(f"{precision}: |loss(2 ranks, ZeRO-1) - loss(1 rank)| per step: {diffs}")
    if precision == "fp32":
        assert all(d <= FP32_REL * float(a[1]) for d, a in zip(diffs, one)), (one, two)
    else:
        assert all(d <= BF16_ABS for d in diffs), (one, two)
    assert diffs[0] <= 1e-5 * float(one[0][1]) * (1 if precision == "fp32" else 100), "step 1's loss is computed before any update"


def test_two_zero1_ranks_offload_their_optimizer_shards_bitwise(bins, llama, tmp_path):
    """--offload-optimizer with 2 ranks and ZeRO-1 (BF16): each rank keeps its shard's master weights and moments in
    pinned host memory, its reduced gradients go down after the reductions, AdamW runs on its host, the shard's
    parameters go up before the all-gather (llmc/cuda/optimizer_offload.cuh); model and state files byte for byte
    those of the same 2 ranks with the optimizer on the device."""
    got = {}
    for name, flags in (("device", []), ("host", ["--offload-optimizer"])):
        res = train(bins, llama, 2, "bf16", "-b", "1", "-x", "3", "-z", "1", "-n", "3", "-o", tmp_path / name, *flags)
        assert res.returncode == 0 and "ZeRO-1" in res.stdout, explain(res)
        assert not flags or "optimizer offloaded (--offload-optimizer)" in res.stdout, explain(res)
        got[name] = files(tmp_path / name)
    assert any(n.startswith("model_") for n in got["device"]) and sum(n.startswith("state_") for n in got["device"]) >= 2, sorted(got["device"])
    assert got["host"] == got["device"]


@slow
@pytest.mark.parametrize("n, T, mode", [(2, "32", "1"), (3, "24", "2")])
def test_recompute_under_the_ring_bitwise(bins, llama, n, T, mode):
    """-r 1 runs the forward ring (RoPE at the global positions included) again in the backward, -r 2 keeps attention's
    output: -r 0's step lines bit for bit, with documents."""
    base, got = [steps(ring(bins, llama, "bf16", n, "-b", "2", "-t", T, "-x", "2", *DOCS, "-r", r)) for r in ("0", mode)]
    assert len(base) == 2 and got == base, (base, got)


# A layer's shard copied down after the compute stream only, not after the layer's reduction on the collectives'
# stream: the copy races the ncclReduce that writes the shard (the emulator's stream-hazard check stops the run).
OFFLOAD_MUTANT = ("train_gpt.cu", "lo, hi,\n                                 final_on);", "lo, hi,\n                                 m->stream);")


def test_offload_mutant_applies():
    rel, old, _ = OFFLOAD_MUTANT
    assert_mutant_applies((REPO / rel).read_text(), rel, old)


@slow
def test_offload_copy_before_the_reduction_is_caught(llama, tmp_path):
    rel, old, new = OFFLOAD_MUTANT
    tmp = mutant_sources(tmp_path, {rel: (old, new)})
    exe = tmp / "build" / "emu" / "emu_train_gpt_mpi_bf16"
    res = subprocess.run(["make", "-s", "-C", str(tmp / "dev" / "emu"), str(exe)], capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    res = train(exe.parent, llama, 2, "bf16", "-b", "1", "-x", "3", "-z", "1", "--offload-optimizer")
    assert res.returncode != 0 and "emu: stream hazard:" in res.stderr, explain(res)


@slow
def test_four_ranks_in_two_rings_with_zero1_match_one_process(bins, llama):
    """4 processes: two rings of 2 (--context-parallel 2), each carrying one sequence, data-parallel across the rings
    with ZeRO-1 (each of the 4 ranks updates a quarter of the parameters), against one process with both sequences."""
    one = steps(train(bins, llama, 0, "fp32", "-b", "2", "-x", "3"))
    res = train(bins, llama, 4, "fp32", "--context-parallel", "2", "-b", "1", "-x", "3", "-z", "1", EMU_DEVICE_COUNT="4")
    assert "context parallel: NCCL ring of 2 in each group" in res.stdout and "ZeRO-1" in res.stdout, explain(res)
    assert_within(one, steps(res), "fp32")


MUTANTS = {
    "rope-local-position": ("llmc/cuda/rope.cuh", "(double)(token_position(&r.lay, bt) -", "(double)((int)(bt % (size_t)r.lay.T) -"),
    "ring-read-with-query-width": ("llmc/cuda/ring.cuh", "*ld = (int)(step == 0 ? q + kv2 : kv2);",
                                   "*ld = (int)(step == 0 ? q + kv2 : 2 * q);"),
    "ring-pack-with-query-width": ("llmc/cuda/ring.cuh", "qkv + q, (q + kv2) * sizeof(floatX)", "qkv + q, 3 * q * sizeof(floatX)"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_ring_mutants_apply(name):
    rel, old, _ = MUTANTS[name]
    assert_mutant_applies((REPO / rel).read_text(), rel, old)


@slow
@pytest.mark.parametrize("name", list(MUTANTS))
def test_ring_mutants_fail(bins, llama, tmp_path, name):
    """Each mutant's ring of 2 (FP32) against the unmutated one process: a failed run or losses past the bound."""
    rel, old, new = MUTANTS[name]
    tmp = mutant_sources(tmp_path, {rel: (old, new)})
    exe = tmp / "build" / "emu" / "emu_train_gpt_mpi_fp32"
    res = subprocess.run(["make", "-s", "-C", str(tmp / "dev" / "emu"), str(exe)], capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    one = steps(train(bins, llama, 0, "fp32", "-b", "2", "-x", "2"))
    res = train(exe.parent, llama, 2, "fp32", "--context-parallel", "2", "-b", "2", "-x", "2", EMU_DEVICE_COUNT="2")
    if res.returncode != 0:
        assert "emu: " in res.stderr, explain(res)
        return
    with pytest.raises(AssertionError):
        assert_within(one, steps(res), "fp32")
