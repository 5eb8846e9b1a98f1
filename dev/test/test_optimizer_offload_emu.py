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
EMU_HOST_PINNED_LIMIT. With one micro-step (one process) the device keeps
the block gradients of two layers in flight only (plan.h, plan_grad_slots):
the same files and log lines as without the flag (GPT-2 and Llama shapes,
BF16 and FP16 with skipped steps), the plan's device total smaller by the
gradients it no longer holds, and mutants that reuse a slot before its copy
down, skip a layer's norm or wait for the wrong slot are caught. Passing here
is the emulator's verdict, not a GPU's."""
import json
import re
import shutil
import signal
import subprocess

import pytest

import test_hf_llama as hf
from conftest import REPO
from emu_support import OUT, build_trainers, emu_env, emu_run, explain, mutant_sources, slow, train_two_steps
from test_llama_gpu_emu import imported_model
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


# ---- one micro-step: the block gradients of the layers in flight only ----

def one_micro_step(exe, model, out, *flags, steps=2, lr="1e-3", batch=2, check=True, **env):
    """`steps` steps of one micro-step each (-d: B x T tokens), the files in `out`."""
    res = emu_run([exe, *model, "-j", "", "-b", batch, "-t", "32", "-x", steps, "-n", steps, "-s", "0", "-l", lr, "-d", 32 * batch,
                   "-o", out, *flags], **env)
    if check:
        assert res.returncode == 0, explain(res)
    return res


def step_lines(stdout):
    """Each step's line without its timing: loss, lr and norm (or the skip)."""
    return [re.sub(r" \| [0-9.]+ ms.*", "", s) for s in stdout.splitlines() if s.startswith("step ")]


def gpt2(tiny_shards, tmp_path):
    return [*MODEL, "-i", tiny_shards / "tiny_train.bin"]


def llama(tiny_shards, tmp_path):
    """Llama's block (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head) with 4 layers: slots reused twice."""
    flags = imported_model(tmp_path, hf.llama_config, {"num_hidden_layers": 4, "num_key_value_heads": hf.NH // 2})
    return [flags[0], flags[1], flags[2], flags[3]]


SLOT_CASES = {  # model, precision, steps, learning rate, more flags
    "gpt2-bf16": (gpt2, "bf16", 2, "1e-3", []),
    "llama-bf16": (llama, "bf16", 3, "3e-3", []),
    "gpt2-fp16-skipped": (gpt2, "fp16", 4, "1", []),
    "gpt2-bf16-tiles-r1o": (gpt2, "bf16", 2, "1e-3", ["-r", "1", "--offload-checkpoints", "--tile-tokens", "16"]),
}


@pytest.mark.parametrize("case", list(SLOT_CASES))
def test_emulated_gradient_slots_change_no_bit(train_exes, tiny_shards, tmp_path, case):
    """The gradients of the layers in flight only: model and state files and
    every step's loss and norm as without the flag (FP16 at a learning rate
    of 1: two steps skipped on overflow, found by the layers' norms taken
    from their slots)."""
    make, precision, steps, lr, flags = SLOT_CASES[case]
    model, exe = make(tiny_shards, tmp_path), train_exes[precision]
    ref = one_micro_step(exe, model, tmp_path / "device", *flags, steps=steps, lr=lr)
    got = one_micro_step(exe, model, tmp_path / "host", *flags, "--offload-optimizer", steps=steps, lr=lr)
    assert "and 2 layers in flight (grads_in_flight" in got.stdout, got.stdout[-3000:]
    if precision == "fp16":
        assert ref.stdout.count("skipped: inf/NaN gradients") == 2, ref.stdout[-3000:]
    assert len(step_lines(ref.stdout)) == steps and step_lines(got.stdout) == step_lines(ref.stdout)
    assert files(tmp_path / "host") == files(tmp_path / "device")


@slow
def test_emulated_gradient_slots_with_chunked_logits(train_exes, tmp_path):
    """2112 rows: the logits take two chunks, so the untied head's gradient
    has an fp32 sum (outside the blocks, moved down past them), and the
    weight gradients' matmuls run at a size where cuBLASLt's algorithm (and
    the bits) depends on the output's alignment, which each tensor keeps in
    its slot."""
    model = llama(None, tmp_path)
    exe = train_exes["bf16"]
    ref = one_micro_step(exe, model, tmp_path / "device", batch=66)
    got = one_micro_step(exe, model, tmp_path / "host", "--offload-optimizer", batch=66)
    assert "layers in flight" in got.stdout and step_lines(got.stdout) == step_lines(ref.stdout)
    assert files(tmp_path / "host") == files(tmp_path / "device")


def a256(n):
    return -(-n // 256) * 256


def test_emulated_gradient_slots_shrink_the_device_plan(train_exes):
    """MODEL's plan (bf16, fp32 master weights, one micro-step of 2 x 32
    tokens, tied head) against a count by hand: the flag moves the master
    weights and moments to the host, and the gradients become those outside
    the blocks (wte 128 x C, wpe 32 x C, the final norm's 2C) and two slots; a
    slot gives each of a layer's 12 tensors (C-multiples 1, 1, 3C, 3, C, 1, 1,
    1, 4C, 4, 4C, 1) its bf16 bytes rounded up to 256 and 256 more. Every
    buffer takes its bytes and the emulated build's guard zone, rounded up to
    256. With two micro-steps the gradients stay whole."""
    C, L = 32, 3
    per_layer = [1, 1, 3 * C, 3, C, 1, 1, 1, 4 * C, 4, 4 * C, 1]
    outside, layer = 128 * C + 32 * C + 2 * C, sum(per_layer) * C
    P = outside + L * layer
    slot = sum(a256(2 * n * C) + 256 for n in per_layer)
    guard = int(re.search(r"-DPLAN_GUARD_BYTES=(\d+)", (REPO / "dev/emu/Makefile").read_text()).group(1))

    def plan(*flags):
        res = emu_run([train_exes["bf16"], *MODEL, "-b", "2", "-t", "32", "--plan-json", *flags])
        assert res.returncode == 0, explain(res)
        return json.loads(res.stdout)

    def held(b):
        return a256(b + guard)

    plain, off = plan("-d", "64"), plan("-d", "64", "--offload-optimizer")
    got = {b["name"]: b["bytes"] for b in off["buffers"] if b["name"].startswith("grads")}
    assert got == {"grads_outside_blocks": 2 * outside, "grads_in_flight": 2 * slot}
    assert {b["name"]: b["bytes"] for b in plain["buffers"]}["grads"] == 2 * P
    lost = 3 * held(4 * P) + held(2 * P) - held(2 * outside) - held(2 * slot)
    assert plain["total_bytes"] - off["total_bytes"] == lost
    two_plain, two = plan("-d", "128"), plan("-d", "128", "--offload-optimizer")
    assert {b["name"]: b["bytes"] for b in two["buffers"]}.get("grads") == 2 * P
    assert two_plain["total_bytes"] - two["total_bytes"] == 3 * held(4 * P)


WAIT_SLOT = "    CUDA_CHECK(cudaStreamWaitEvent(main, o->slot_down[slot], 0));\n"
NORM = "        gpu_norm_group(m->norm_partials, l, base, &s, m->stream);\n"
WRITE = "    for (int t = 0; t < NUM_BLOCK_TENSORS; t++) b.tensor[t] = gpu_grad_slot(m, l) + gpu_slot_at(m, l, t);\n"


def test_emulated_gradient_slot_mutants_apply():
    assert (REPO / "llmc/cuda/optimizer_offload.cuh").read_text().count(WAIT_SLOT) == 1
    text = (REPO / "train_gpt.cu").read_text()
    assert text.count(NORM) == 1 and text.count(WRITE) == 1


def test_emulated_slot_reused_before_its_copy_is_caught(train_exes, tiny_shards, tmp_path):
    """The main stream's wait for a slot's copy down deleted (EMU_DELETE_SYNC,
    no rebuild): layer l-2 zeroes and writes the slot that layer l's copy
    reads, which the emulator's stream-hazard check stops."""
    line = (REPO / "llmc/cuda/optimizer_offload.cuh").read_text().split(WAIT_SLOT)[0].count("\n") + 1
    res = one_micro_step(train_exes["bf16"], gpt2(tiny_shards, tmp_path), tmp_path / "mut", "--offload-optimizer", check=False,
                         EMU_DELETE_SYNC=f"llmc/cuda/optimizer_offload.cuh:{line}")
    assert res.returncode != 0 and "emu: stream hazard:" in res.stderr and "'grads_in_flight'" in res.stderr, explain(res)


# A slot index shifted everywhere at once only renames the slots, and a layer waiting for the other slot's copy
# waits for a later copy on the same in-order stream (more than it needs): neither is wrong, so the shifted index
# here is the backward's alone, which then writes the slot whose copy down (or zeroing) belongs to another layer.
@slow
@pytest.mark.parametrize("what,old,new", [
    ("layer 1's squared norm not taken from its slot", NORM, NORM.replace("        gpu_norm", "        if (l != 1) gpu_norm")),
    ("the backward writes layer l into slot (l + 1) mod R", WRITE, WRITE.replace("gpu_grad_slot(m, l)", "gpu_grad_slot(m, l + 1)")),
], ids=["norm-skipped", "slot-shifted"])
def test_emulated_gradient_slot_source_mutants_are_caught(train_exes, tiny_shards, tmp_path, what, old, new):
    (tmp_path / "src").mkdir()
    mutant_sources(tmp_path / "src", {"train_gpt.cu": (old, new)})
    exe = build_trainers(tmp_path / "src", tmp_path / "src" / "build" / "emu", ["bf16"])["bf16"]
    model = gpt2(tiny_shards, tmp_path)
    ref = one_micro_step(train_exes["bf16"], model, tmp_path / "ref", "--offload-optimizer")
    res = one_micro_step(exe, model, tmp_path / "mut", "--offload-optimizer", check=False)
    # a skipped norm leaves its group's sum unwritten (the emulator's initcheck; on a GPU the last step's value), a
    # shifted slot races with a copy down (its stream-hazard check) or sends another layer's gradients down
    if res.returncode != 0:
        assert "emu: stream hazard:" in res.stderr or "emu: initcheck:" in res.stderr, explain(res)
    else:
        assert step_lines(res.stdout) != step_lines(ref.stdout) or files(tmp_path / "mut") != files(tmp_path / "ref"), what
