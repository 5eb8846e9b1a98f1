"""--offload-optimizer in train_gpt under the CPU emulator of CUDA (dev/emu):
master weights and moments in the pinned pool, the gradients copied down,
AdamW on the host (llmc/cuda/adamw.cuh, host_adamw: the kernel's arithmetic
element by element) and the parameters copied up (llmc/cuda/optimizer_offload.cuh).
Model and state files byte-identical to the on-device optimizer's in BF16
(with and without master weights, with offloaded checkpoints sharing the
pool) and FP32, and resume across the flag; mutants that read the pinned
gradients before their copy's event, or run the next forward before the
parameters' copy up, are caught; the pinned pool must fit
EMU_HOST_PINNED_LIMIT. Passing here is the emulator's verdict, not a GPU's."""
import json
import shutil

import pytest

from conftest import REPO
from emu_support import OUT, build_trainers, emu_run, explain, mutant_sources, slow, train_two_steps
from test_offload import files

MODEL = ["-e", "d6", "--layers", "3", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
SETTINGS = {
    "r0": [],
    "r1o": ["-r", "1", "--offload-checkpoints"],
    "w0": ["-w", "0"],
}


@pytest.fixture(scope="module")
def train_exes():
    return build_trainers(REPO, OUT, ["bf16", "fp16"])


def train(exe, tiny_shards, out, *flags, check=True, steps="2", lr="1e-3", **env):
    if not env and steps == "2" and lr == "1e-3":
        return train_two_steps(exe, MODEL, tiny_shards, out, *flags, check=check)
    res = emu_run([exe, *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32", "-x", steps, "-n", steps, "-s", "0",
                   "-l", lr, "-d", "128", "-o", out, *flags], **env)
    if check:
        assert res.returncode == 0, explain(res)
    return res


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_emulated_offloaded_optimizer_writes_identical_files(train_exes, tiny_shards, tmp_path, setting):
    flags = SETTINGS[setting]
    train(train_exes["bf16"], tiny_shards, tmp_path / "device", *flags)
    res = train(train_exes["bf16"], tiny_shards, tmp_path / "host", *flags, "--offload-optimizer")
    assert "optimizer offloaded (--offload-optimizer)" in res.stdout and "pinned host" in res.stdout, res.stdout[-3000:]
    ref = files(tmp_path / "device")
    assert any(n.startswith("model_") for n in ref) and any(n.startswith("state_") for n in ref)
    assert files(tmp_path / "host") == ref


def test_emulated_fp16_with_skipped_steps(train_exes, tiny_shards, tmp_path):
    """FP16 with loss scaling at a learning rate of 1: steps 2 and 3 overflow and
    are skipped (the scale halved each time), step 4 updates again; the files
    are the on-device optimizer's byte for byte."""
    got = {}
    for name, flags in (("device", []), ("host", ["--offload-optimizer"])):
        res = train(train_exes["fp16"], tiny_shards, tmp_path / name, *flags, steps="4", lr="1")
        assert res.stdout.count("skipped: inf/NaN gradients") == 2, res.stdout[-3000:]
        assert "step    4/4 | loss" in res.stdout and "step    4/4 | loss" in res.stdout.split("skipped")[-1]
        got[name] = files(tmp_path / name)
    assert got["host"] == got["device"]


@pytest.mark.parametrize("first,second", [([], ["--offload-optimizer"]), (["--offload-optimizer"], [])], ids=["on", "off"])
def test_emulated_resume_across_the_flag(train_exes, tiny_shards, tmp_path, first, second):
    exe = train_exes["bf16"]
    common = ["-x", "2", "-n", "1"]
    train(exe, tiny_shards, tmp_path / "whole", *common)
    train(exe, tiny_shards, tmp_path / "half", *common, *first)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for name in ["model_00000001.bin", "state_00000001_00000.bin", "DONE_00000001"]:
        shutil.copy(tmp_path / "half" / name, resumed / name)
    train(exe, tiny_shards, resumed, *common, *second, "-y", "1")
    ref, got = files(tmp_path / "whole"), files(resumed)
    for name in ("model_00000002.bin", "state_00000002_00000.bin"):
        assert got[name] == ref[name], name


SYNC = "    CUDA_CHECK(cudaEventSynchronize(o->grads_down)); /* the host reads the gradients only once they are down */\n"
UP = "    CUDA_CHECK(cudaStreamWaitEvent(main, o->params_up, 0)); /* the gather and the next forward read them */\n"
LAYER = "    CUDA_CHECK(cudaStreamWaitEvent(o->copy, o->main_done, 0));\n    for (int t = FIRST_BLOCK_TENSOR;"


def test_emulated_optimizer_offload_mutants_apply():
    """Every mutant's text is in its source once, in the fast set too (the slow ones would else go stale unnoticed)."""
    text = (REPO / "llmc/cuda/optimizer_offload.cuh").read_text()
    for old in (SYNC, UP, LAYER):
        assert text.count(old) == 1, old


# each mutant is one more emulated build (minutes): the one the issue names runs in `make test`, the others with
# REMAT_EMU_SLOW=1
@pytest.mark.parametrize("what,old,new", [
    ("host AdamW before the gradients' copy down has completed", SYNC, ""),
    pytest.param("the next forward before the parameters' copy up", UP, "", marks=slow),
    pytest.param("a layer's gradients down before its backward has written them", LAYER, "    for (int t = FIRST_BLOCK_TENSOR;",
                 marks=slow),
], ids=["no-wait-down", "no-wait-up", "no-wait-layer"])
def test_emulated_optimizer_offload_mutants_are_caught(train_exes, tiny_shards, tmp_path, what, old, new):
    (tmp_path / "src").mkdir()
    mutant_sources(tmp_path / "src", {"llmc/cuda/optimizer_offload.cuh": (old, new)})
    exe = build_trainers(tmp_path / "src", tmp_path / "src" / "build" / "emu", ["bf16"])["bf16"]
    train(train_exes["bf16"], tiny_shards, tmp_path / "ref", "--offload-optimizer")
    res = train(exe, tiny_shards, tmp_path / "mut", "--offload-optimizer", check=False)
    # the copy up unordered with the forward: the emulator's stream-hazard check on the parameters; the gradients
    # read too early: the pinned pool's NaN or last step's values, so the training diverges or its files differ
    if res.returncode != 0:
        assert "emu: stream hazard:" in res.stderr or "diverged" in res.stderr, explain(res)
    else:
        assert files(tmp_path / "mut") != files(tmp_path / "ref"), what


def test_emulated_pinned_pool_within_the_limit(train_exes, tiny_shards, tmp_path):
    """The pinned pool is one cudaMallocHost of the plan's host bytes: a limit
    below it is refused naming the offloaded optimizer; ample room runs."""
    exe = train_exes["bf16"]
    plan = json.loads(emu_run([exe, *MODEL, "-b", "2", "-t", "32", "--offload-optimizer", "--plan-json"]).stdout)
    pool = plan["host_total_bytes"]
    assert pool > 0
    low = train(exe, tiny_shards, tmp_path / "low", "--offload-optimizer", check=False, EMU_HOST_PINNED_LIMIT=str(pool // 2))
    assert low.returncode != 0 and "pinned host memory for the offloaded optimizer" in low.stderr, explain(low)
    ok = train(exe, tiny_shards, tmp_path / "ok", "--offload-optimizer", EMU_HOST_PINNED_LIMIT=str(pool + (64 << 20)))
    assert ok.returncode == 0
