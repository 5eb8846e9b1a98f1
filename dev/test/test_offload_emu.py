"""Offloaded checkpoints in train_gpt under the CPU emulator of CUDA (dev/emu):
model and state files byte-identical to the same run without offloading and
to -r 0, with dropout and micro-steps, untiled and with token tiles of a size
that divides no B*T (GPU token tiles are bitwise equal across recompute and
offload settings at the same size); and mutants that drop the main
stream's wait on a prefetch, or on a copy out before a staging slot is
written again, change the results (llmc/cuda/offload.cuh: the emulator issues the
copy stream's work as late as its events allow, and released slots hold NaN).
The copy stream's own waits on the main stream are left to dev/emu's
cross-stream hazard check."""
import pytest

from conftest import REPO
from emu_support import OUT, build_trainers, explain, mutant_sources, train_two_steps
from test_offload import files

# four layers: the ring's three slots wrap around
MODEL = ["-e", "d6", "--layers", "4", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
SETTINGS = {
    "r0": ["-r", "0"],
    "r1": ["-r", "1"],
    "r1o": ["-r", "1", "--offload-checkpoints"],
    "r3o": ["-r", "3o:all"],
    "mix": ["-r", "1o:0,2/3:1/3o:3"],
}


# tiles of 7 of the 64 rows: nine of 7 and a last one of 1
TILES = ["--tile-tokens", "7"]




@pytest.fixture(scope="module")
def train_exes():
    return build_trainers(REPO, OUT, ["bf16", "fp32"])


def train(exe, tiny_shards, out, *flags, check=True):
    return train_two_steps(exe, MODEL, tiny_shards, out, *flags, check=check)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_emulated_offload_writes_identical_files(train_exes, tiny_shards, tmp_path, precision):
    got = {}
    for name, flags in SETTINGS.items():
        res = train(train_exes[precision], tiny_shards, tmp_path / name, *flags)
        if name.endswith("o") or name == "mix":
            assert "host memory, offloaded checkpoints:" in res.stdout and "(pinned)" in res.stdout, res.stdout[-2000:]
        got[name] = files(tmp_path / name)
    assert any(n.startswith("model_") for n in got["r0"])
    for name in SETTINGS:
        assert got[name] == got["r0"], f"{name} differs from -r 0"


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_emulated_tiles_write_identical_files_in_every_setting(train_exes, tiny_shards, tmp_path, precision):
    got = {}
    for name, flags in SETTINGS.items():
        res = train(train_exes[precision], tiny_shards, tmp_path / name, *flags, *TILES)
        assert "token tiles: 7 of the 64 rows at a time (--tile-tokens 7)" in res.stdout, res.stdout[-2000:]
        got[name] = files(tmp_path / name)
    assert any(n.startswith("model_") for n in got["r0"])
    for name in SETTINGS:
        assert got[name] == got["r0"], f"tiles of 7, {name} differs from tiles of 7, -r 0"


READY = "    if (offload_layer(o, l)) offload_main_waits(o, o->in_done[offload_slot(o, l)]);\n"
ACQUIRE = "    offload_main_waits(o, o->out_done[s]);\n"


def mutant(tmp, old, new):
    """train_gpt with one edit of llmc/cuda/offload.cuh, built in a copy of the sources."""
    mutant_sources(tmp, {"llmc/cuda/offload.cuh": (old, new)})
    return build_trainers(tmp, tmp / "build" / "emu", ["bf16"])["bf16"]


@pytest.mark.parametrize("what,old,new", [
    ("no wait for the prefetch before a layer's recompute", READY, "    (void)o; (void)l;\n"),
    ("no wait for the copy out before a slot is written again", ACQUIRE, ""),
])
def test_emulated_offload_mutants_change_the_results(train_exes, tiny_shards, tmp_path, what, old, new):
    (tmp_path / "src").mkdir()
    exe = mutant(tmp_path / "src", old, new)
    train(train_exes["bf16"], tiny_shards, tmp_path / "ref", *SETTINGS["r1o"])
    res = train(exe, tiny_shards, tmp_path / "mut", *SETTINGS["r1o"], check=False)
    # caught by the emulator's stream-hazard check (dev/emu: an access of a staging slot that no event
    # orders after the other stream's), else through the results: the poisoned slot read makes the
    # gradient norm NaN, an overwritten one other files
    if res.returncode != 0:
        hazard = "emu: stream hazard:" in res.stderr and "'offload_staging" in res.stderr
        assert hazard or "gradient norm nan: training diverged" in res.stderr, explain(res)
    else:
        assert files(tmp_path / "mut") != files(tmp_path / "ref"), what
