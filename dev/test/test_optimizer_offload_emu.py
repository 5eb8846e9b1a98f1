"""--offload-optimizer in train_gpt under the CPU emulator of CUDA (dev/emu):
master weights and moments in the pinned pool, the gradients copied down,
AdamW on the host (llmc/cuda/adamw.cuh, host_adamw: the kernel's arithmetic
element by element) and the parameters copied up (llmc/cuda/optimizer_offload.cuh);
with one process the update is deferred to the next forward, layer by layer.
Model and state files byte-identical to the on-device optimizer's in BF16
(with and without master weights, with offloaded checkpoints sharing the
pool, -r 1, segments, token tiles) and FP16 with skipped steps, with
evaluation, sampling and checkpoints between steps (a preemption's too), and
resume across the flag and from a checkpoint written while an update was
deferred; mutants that
read the pinned gradients before their copy's event, run a layer's forward
before its parameters' copy up, update a layer twice in a step, or write a
checkpoint without the deferred update are caught; the pinned pool must fit
EMU_HOST_PINNED_LIMIT. Passing here is the emulator's verdict, not a GPU's."""
import json
import re
import shutil
import signal
import subprocess

import pytest

from conftest import REPO
from emu_support import OUT, build_trainers, emu_env, emu_run, explain, mutant_sources, slow, train_two_steps
from test_offload import files, losses

MODEL = ["-e", "d6", "--layers", "3", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]
SETTINGS = {
    "r0": [],
    "r1o": ["-r", "1", "--offload-checkpoints"],
    "w0": ["-w", "0"],
    "seg2": ["-r", "1", "--segment-layers", "2"],
    "tiles": ["-r", "1", "--tile-tokens", "16"],
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
    are skipped (the scale halved each time), step 4 updates again; the files,
    a checkpoint after every step (step 1's written while its update is
    deferred, steps 2 and 3's after skips that leave none), are the on-device
    optimizer's byte for byte."""
    got = {}
    for name, flags in (("device", []), ("host", ["--offload-optimizer"])):
        res = train(train_exes["fp16"], tiny_shards, tmp_path / name, *flags, "-n", "1", steps="4", lr="1")
        assert res.stdout.count("skipped: inf/NaN gradients") == 2, res.stdout[-3000:]
        assert "step    4/4 | loss" in res.stdout and "step    4/4 | loss" in res.stdout.split("skipped")[-1]
        got[name] = files(tmp_path / name)
    assert sum(n.startswith("state_") for n in got["device"]) == 4 and got["host"] == got["device"]


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


def train_between(exe, tiny_shards, out, *flags):
    """Three steps of two micro-steps, with validation, a sample and a checkpoint after each: with the optimizer
    offloaded each reads the parameters (a checkpoint also the moments) while the step's update is deferred."""
    res = emu_run([exe, *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", tiny_shards / "tiny_val.bin", "-b", "2", "-t", "32",
                   "-x", "3", "-n", "1", "-v", "1", "-m", "1", "-s", "1", "-g", "4", "-l", "1e-3", "-d", "128", "-o", out, *flags])
    assert res.returncode == 0, explain(res)
    return res


def samples(stdout):
    return [part.split("\n---\n")[0] for part in stdout.split("sample at step ")[1:]]


def test_emulated_deferred_update_between_steps(train_exes, tiny_shards, tmp_path):
    """Evaluation, sampling and checkpoints between the steps see the update the next forward would run: losses,
    samples, and every checkpoint (written while an update was deferred) equal the on-device optimizer's; resuming
    from step 2's checkpoint of the offloaded run ends in the same files."""
    exe = train_exes["bf16"]
    ref = train_between(exe, tiny_shards, tmp_path / "device")
    got = train_between(exe, tiny_shards, tmp_path / "host", "--offload-optimizer")
    assert len(samples(ref.stdout)) == 3 and samples(got.stdout) == samples(ref.stdout), got.stdout[-3000:]
    want = losses(tmp_path / "device")
    assert sum(1 for _, _, val in want if val is not None) >= 3 and losses(tmp_path / "host") == want
    assert files(tmp_path / "host") == files(tmp_path / "device")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for name in ["model_00000002.bin", "state_00000002_00000.bin", "DONE_00000002"]:
        shutil.copy(tmp_path / "host" / name, resumed / name)
    train_between(exe, tiny_shards, resumed, "--offload-optimizer", "-y", "1")
    ref_files, got_files = files(tmp_path / "device"), files(resumed)
    for name in ("model_00000003.bin", "state_00000003_00000.bin"):
        assert got_files[name] == ref_files[name], name


def stopped_run(exe, tiny_shards, out, at_step, *flags):
    """A long run (constant learning rate) sent SIGUSR1 once it has printed step at_step: it checkpoints the step
    it stops after and exits 75; returns that step."""
    args = [str(a) for a in (exe, *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32", "-x", "500", "-k",
                             "constant", "-s", "0", "-l", "1e-3", "-d", "128", "-o", out, *flags)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=emu_env())
    for line in proc.stdout:
        if line.startswith(f"step {at_step:4d}/"):
            break
    proc.send_signal(signal.SIGUSR1)
    proc.wait(timeout=600)
    out_text, err = proc.stdout.read(), proc.stderr.read()
    m = re.search(r"stopped by SIGUSR1 after step (\d+): checkpoint written", out_text)
    assert proc.returncode == 75 and m, (proc.returncode, out_text[-2000:], err[-2000:])
    return int(m.group(1))


def test_emulated_preemption_writes_the_deferred_update(train_exes, tiny_shards, tmp_path):
    """SIGUSR1 after a step whose update is deferred: the checkpoint it writes holds that update, the same bytes as
    the on-device optimizer's checkpoint of that step (a run checkpointing every step, stopped later)."""
    exe = train_exes["bf16"]
    stop = stopped_run(exe, tiny_shards, tmp_path / "host", 2, "--offload-optimizer")
    stopped_run(exe, tiny_shards, tmp_path / "device", stop + 1, "-n", "1")
    got, ref = files(tmp_path / "host"), files(tmp_path / "device")
    for name in (f"model_{stop:08d}.bin", f"state_{stop:08d}_00000.bin"):
        assert got[name] == ref[name], name


SYNC = "    CUDA_CHECK(cudaEventSynchronize(o->grads_down)); /* the host reads the gradients only once they are down */\n"
UP = "    CUDA_CHECK(cudaStreamWaitEvent(main, o->params_up, 0)); /* the forward of group g reads them */\n"
LAYER = "    CUDA_CHECK(cudaStreamWaitEvent(o->copy, o->main_done, 0));\n    for (int t = FIRST_BLOCK_TENSOR;"
OOH, TGC = "llmc/cuda/optimizer_offload.cuh", "train_gpt.cu"
# a layer updated twice in a step: its AdamW at the start of every pass over its rows (gpu_block_forward_qkv, which
# -r 1's recompute runs again in the backward), each call running the group again and the update left pending
HOOK = "        gpu_offload_update_until(m, 1 + l);\n"
QKV = "static void gpu_block_forward_qkv(GpuModel* m, int l, int r0, int n) {\n"
ONCE = "    if (!o->pending || o->next_group > g) return;\n"
CLEARED = "    o->pending = o->next_group < optimizer_offload_groups(L);\n"
FLUSH = "    gpu_offload_flush(m); /* checkpoints (the preemption's too) read the state after the last step's update */\n"
MUTANTS = {
    "no-wait-down": ("host AdamW before the gradients' copy down has completed", {OOH: [(SYNC, "")]}, []),
    "no-wait-up": ("a layer's forward before its parameters' copy up", {OOH: [(UP, "")]}, []),
    "no-wait-layer": ("a layer's gradients down before its backward has written them",
                      {OOH: [(LAYER, "    for (int t = FIRST_BLOCK_TENSOR;")]}, []),
    "twice": ("a layer's update run again by -r 1's recompute",
              {OOH: [(ONCE, "    if (!o->pending) return;\n    if (o->next_group > g) o->next_group = g;\n"), (CLEARED, "")],
               TGC: [(HOOK, ""), (QKV, "static void gpu_offload_update_until(GpuModel* m, int g);\n" + QKV +
                                  "    gpu_offload_update_until(m, 1 + l);\n")]},
              ["-r", "1", "-d", "64"]),
    "no-flush": ("a checkpoint written while the update is deferred", {TGC: [(FLUSH, "")]}, ["-n", "1"]),
}


def test_emulated_optimizer_offload_mutants_apply():
    """Every mutant's text is in its source once, in the fast set too (the slow ones would else go stale unnoticed)."""
    for _, edits, _ in MUTANTS.values():
        for rel, pairs in edits.items():
            text = (REPO / rel).read_text()
            for old, _ in pairs:
                assert text.count(old) == 1, (rel, old)


def mutated_trainer(tmp, edits):
    """The emulated BF16 train_gpt of the sources with edits {file: [(old, new), ...]} applied (each old text once)."""
    (tmp / "src").mkdir()
    mutant_sources(tmp / "src", {rel: pairs[0] for rel, pairs in edits.items()})
    for rel, pairs in edits.items():
        text = (tmp / "src" / rel).read_text()
        for old, new in pairs[1:]:
            assert text.count(old) == 1, (rel, old)
            text = text.replace(old, new)
        (tmp / "src" / rel).write_text(text)
    return build_trainers(tmp / "src", tmp / "src" / "build" / "emu", ["bf16"])["bf16"]


# each mutant is one more emulated build (minutes): the one the issue names runs in `make test`, the others with
# REMAT_EMU_SLOW=1
@pytest.mark.parametrize("name", [n if n == "no-wait-down" else pytest.param(n, marks=slow) for n in MUTANTS])
def test_emulated_optimizer_offload_mutants_are_caught(train_exes, tiny_shards, tmp_path, name):
    what, edits, flags = MUTANTS[name]
    exe = mutated_trainer(tmp_path, edits)
    train(train_exes["bf16"], tiny_shards, tmp_path / "ref", "--offload-optimizer", *flags, steps="3")
    res = train(exe, tiny_shards, tmp_path / "mut", "--offload-optimizer", *flags, steps="3", check=False)
    # the copy up unordered with the forward: the emulator's stream-hazard check on the parameters; the gradients
    # read too early: the pinned pool's NaN or last step's values, so the training diverges or its files differ;
    # a layer updated twice: its second copy up overwrites parameters the forward read, unordered (the hazard check
    # stops it; else the moments differ); a checkpoint without the deferred update: the files differ
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
