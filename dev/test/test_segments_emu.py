"""Segment checkpointing (--segment-layers K) in train_gpt under the CPU
emulator of CUDA (dev/emu): model and state files byte-identical to -r 0
without segments, in recompute mixes, with offloaded segment inputs (the
staging ring's slot s mod R per segment, llmc/cuda/offload.cuh), token tiles,
dropout and two micro-steps; and a mutant whose backward skips the
segment's forward again, or the wait on a segment input's prefetch, changes
the results."""

import pytest

from conftest import REPO
from emu_support import OUT, build_trainers, emu_run, explain, mutant_sources, train_two_steps
from test_offload import files

# five layers: K = 2 makes three segments (the last of one layer), K = 3 two
MODEL = ["-e", "d6", "--layers", "5", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
SETTINGS = {
    "r0": ["-r", "0"],
    "k2r1": ["-r", "1", "--segment-layers", "2"],
    "k3mix": ["-r", "3:0-1/2:2/1:3", "--segment-layers", "3"],
    "k2r0o": ["-r", "0", "--segment-layers", "2", "--offload-checkpoints"],
    "k1r3o": ["-r", "2:0/3o:1-4", "--segment-layers", "1"],
}


@pytest.fixture(scope="module")
def train_exes():
    return build_trainers(REPO, OUT, ["bf16", "fp32"])


def train(exe, tiny_shards, out, *flags, check=True):
    return train_two_steps(exe, MODEL, tiny_shards, out, *flags, check=check)


@pytest.mark.parametrize("precision,tiles", [("bf16", []), ("fp32", []), ("bf16", ["--tile-tokens", "7"])],
                         ids=["bf16", "fp32", "bf16-tiles7"])
def test_emulated_segments_write_identical_files(train_exes, tiny_shards, tmp_path, precision, tiles):
    got = {}
    for name, flags in SETTINGS.items():
        res = train(train_exes[precision], tiny_shards, tmp_path / name, *flags, *tiles)
        if "--segment-layers" in flags and flags[flags.index("--segment-layers") + 1] != "1":
            assert "segments: " in res.stdout, res.stdout[-2000:]
        if name == "k2r0o":
            assert "host memory, offloaded checkpoints:" in res.stdout and "staging ring 3 slots" in res.stdout, res.stdout[-2000:]
        got[name] = files(tmp_path / name)
    assert any(n.startswith("model_") for n in got["r0"])
    for name in SETTINGS:
        assert got[name] == got["r0"], f"{name} differs from -r 0"


MUTANTS = {
    "no forward again": ("        if (K > 1 && top < L - 1) gpu_segment_forward_again(m, first, top);\n", ""),
    "no wait on the prefetch": ("        offload_ready(&m->off, first);\n", ""),
}
MUTANT_FLAGS = ["-r", "1", "--segment-layers", "2", "--offload-checkpoints"]


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_emulated_segment_mutants_change_the_results(train_exes, tiny_shards, tmp_path, mutant):
    (tmp_path / "src").mkdir()
    mutant_sources(tmp_path / "src", {"train_gpt.cu": MUTANTS[mutant]})
    exe = build_trainers(tmp_path / "src", tmp_path / "src" / "build" / "emu", ["bf16"])["bf16"]
    train(train_exes["bf16"], tiny_shards, tmp_path / "ref", *MUTANT_FLAGS)
    res = train(exe, tiny_shards, tmp_path / "mut", *MUTANT_FLAGS, check=False)
    # a poisoned (NaN) staging slot read, a stream hazard the emulator reports, or other files
    if res.returncode != 0:
        assert "emu: stream hazard:" in res.stderr or "gradient norm nan" in res.stderr, explain(res)
    else:
        assert files(tmp_path / "mut") != files(tmp_path / "ref"), mutant


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_emulated_test_gpt_segments_equal_r0(emu_build, precision):
    """test_gpt's check_segments: one step of a 5-layer GPU model per mix and
    K, with dropout at every site, bitwise -r 0's without segments."""
    res = emu_run([emu_build / f"emu_test_gpt_{precision}", "segments:hs16:64:4:300:33"])
    assert res.returncode == 0, explain(res)
    assert res.stdout.count("bitwise identical to -r 0 without segments") == 5, res.stdout[-3000:]
    assert "PASS: segments bitwise equal to -r 0, hs16 T=33" in res.stdout
