"""--offload-optimizer through the CPU trainer's command line: the moments, a
copy of the parameters and of the gradients in a host pool (a second
allocation, as the GPU's pinned memory), AdamW on that copy and the
parameters copied back; model files, state files and losses byte-identical
to the same run without it, with every lever; resume across the flag; the
plan's device and host bytes against a count written out here; -r auto
choosing the optimizer's place within both budgets."""
import json
import re
import shutil

import pytest

from conftest import binary, copy_checkpoint, gpu_trainer, run
from test_offload import MODEL, files, losses, train
from test_plan_cli import a256


def pair(tiny_shards, tmp_path, flags, name="run"):
    """The same run without and with --offload-optimizer: their output directories."""
    plain, offloaded = tmp_path / f"{name}_plain", tmp_path / f"{name}_offloaded"
    train(tiny_shards, plain, *flags)
    res = train(tiny_shards, offloaded, *flags, "--offload-optimizer")
    assert "optimizer offloaded (--offload-optimizer)" in res.stdout, res.stdout
    return plain, offloaded


@pytest.mark.parametrize("flags", [
    ["-r", "0"], ["-r", "1"], ["-r", "2"], ["-r", "3"],
    ["-r", "1o:0,2/3o:1,4/2:3"],
    ["-r", "1", "--segment-layers", "2"],
    ["-r", "3", "--segment-layers", "2", "--offload-checkpoints"],
    ["-r", "2", "--tile-tokens", "16"],
    ["-r", "1", "--dropout", "0.2", "-d", "128"],
], ids=["r0", "r1", "r2", "r3", "mix-offloaded", "segments", "segments-offloaded", "tiles", "dropout+2micro"])
def test_offloaded_optimizer_writes_identical_files(tiny_shards, tmp_path, flags):
    plain, offloaded = pair(tiny_shards, tmp_path, flags)
    ref = files(plain)
    assert any(n.startswith("model_") for n in ref) and any(n.startswith("state_") for n in ref)
    assert files(offloaded) == ref
    assert losses(offloaded) == losses(plain) and len(losses(plain)) >= 4


@pytest.mark.parametrize("first,second", [([], ["--offload-optimizer"]), (["--offload-optimizer"], [])], ids=["on", "off"])
def test_resume_across_the_flag(tiny_shards, tmp_path, first, second):
    """Stop after step 2 with the flag one way, resume to step 4 the other: the
    files of an uninterrupted run without it."""
    whole = tmp_path / "whole"
    train(tiny_shards, whole)
    half = tmp_path / "half"
    train(tiny_shards, half, *first)
    resumed = tmp_path / "resumed"
    copy_checkpoint(half, resumed, 2)
    train(tiny_shards, resumed, *second, "-y", "1")
    ref, got = files(whole), files(resumed)
    for name in ("model_00000004.bin", "state_00000004_00000.bin"):
        assert got[name] == ref[name], name


def plan_json(*args):
    res = run([binary("train_gpt_cpu"), *MODEL, "-b", "2", "-t", "32", "--plan-json", *args], check=True)
    return json.loads(res.stdout)


def param_count(C=32, L=5, Vp=128, maxT=32):
    return Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C


@pytest.mark.parametrize("procs", [1, 2])
def test_plan_moves_the_optimizer_to_the_host_pool(procs):
    """The CPU trainer (fp32, no master weights): the device keeps parameters
    and gradients; the host pool holds this process's shard of the parameters,
    of the gradients and the two moments, 4 bytes each, each entry aligned to
    256 bytes. With -z 1 over two processes the shard is half, rounded up."""
    zero = ["-z", "1", "--plan-processes", str(procs)]
    plain, off = plan_json(*zero), plan_json(*zero, "--offload-optimizer")
    P = param_count()
    shard = -(-P // procs)
    host = {b["name"]: b["bytes"] for b in off["host_buffers"]}
    assert host == {"master_weights": 4 * shard, "grads_copy": 4 * shard, "adam_m": 4 * shard, "adam_v": 4 * shard}
    assert off["host_total_bytes"] == 4 * a256(4 * shard)
    assert off["host_components"] == {"parameters": 0, "master_weights": a256(4 * shard), "gradients": a256(4 * shard),
                                      "optimizer": 2 * a256(4 * shard), "activations": 0, "scratch": 0, "workspace": 0}
    assert off["offload_optimizer"] == 1 and off["flags"].endswith(" --offload-optimizer")
    assert plain["offload_optimizer"] == 0 and "offload-optimizer" not in plain["flags"]
    assert off["components"]["optimizer"] == 0 and plain["components"]["optimizer"] == 2 * a256(4 * shard)
    assert plain["host_total_bytes"] == 0
    # the device loses exactly the two moments
    assert plain["total_bytes"] - off["total_bytes"] == 2 * a256(4 * shard)
    dev_names = {b["name"] for b in off["buffers"]}
    assert "adam_m" not in dev_names and "adam_v" not in dev_names and "params" in dev_names and "grads" in dev_names


def test_gpu_plan_moves_master_weights_and_moments():
    """The GPU trainer's plan (bf16 storage, fp32 master weights; two
    micro-steps, so the device keeps its whole gradient buffer): the master
    weights and moments leave the device; the host pool holds them (4 bytes a
    parameter each) and a bf16 copy of the gradients. (With one micro-step the
    gradients shrink too: test_optimizer_offload_emu.py.)"""
    gpu = gpu_trainer()
    if gpu is None:
        pytest.skip("no GPU trainer build (nor its emulated build) to plan with")
    args = [gpu, *MODEL, "-b", "2", "-t", "32", "-d", "128", "--plan-json"]
    plain = json.loads(run(args, check=True).stdout)
    off = json.loads(run([*args, "--offload-optimizer"], check=True).stdout)
    P = param_count()
    host = {b["name"]: b["bytes"] for b in off["host_buffers"]}
    assert host == {"master_weights": 4 * P, "grads_copy": 2 * P, "adam_m": 4 * P, "adam_v": 4 * P}
    lost = {b["name"]: b["bytes"] for b in plain["buffers"]}
    for b in off["buffers"]:
        lost.pop(b["name"], None)
    assert lost == {"master_weights": 4 * P, "adam_m": 4 * P, "adam_v": 4 * P}
    # each entry aligned to 256 bytes, after the guard zone emulated builds add (0 to 256 bytes)
    assert 3 * a256(4 * P) <= plain["total_bytes"] - off["total_bytes"] <= 3 * a256(4 * P + 256)


def auto(*args):
    return run([binary("train_gpt_cpu"), *MODEL, "-b", "2", "-t", "32", "-r", "auto", "--plan", *args])


def test_auto_keeps_the_optimizer_on_the_device_when_it_fits():
    res = auto("--mem-budget", "64MiB", "--offload-optimizer")
    assert res.returncode == 0, res.stderr
    assert "recompute auto: the optimizer on the device (no --offload-optimizer)" in res.stdout, res.stdout


def test_auto_without_the_flag_never_offloads():
    res = auto("--mem-budget", "64MiB")
    assert res.returncode == 0, res.stderr
    assert "optimizer offloaded" not in res.stdout and "the optimizer" not in res.stdout


needs_mpi = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found (install OpenMPI)")


@needs_mpi
@pytest.mark.parametrize("flags", [["-z", "1"], ["-z", "1", "--context-parallel", "2"]], ids=["zero1", "zero1+cp2"])
def test_two_processes_offload_their_shards(synthetic, tmp_path, flags):
    """ZeRO-1 over two processes, each offloading its shard (and context
    parallelism over the two): model and both ranks' state files byte for byte
    those of the run without the flag."""
    from test_multiprocess import train as mpi_train
    outs = {}
    for tag, extra in (("plain", []), ("offloaded", ["--offload-optimizer"])):
        outs[tag] = tmp_path / tag
        mpi_train(2, synthetic, "-b", "2", "-x", "4", "-v", "0", "-n", "2", "--dropout", "0.1", *flags, *extra, "-o", outs[tag])
    ref = files(outs["plain"])
    assert any(n.startswith("state_") and n.endswith("_00001.bin") for n in ref)
    assert files(outs["offloaded"]) == ref


def test_auto_offloads_the_optimizer_where_only_that_fits(tiny_shards, tmp_path):
    """A device budget (given apart from the host's, so the CPU's pool does not
    draw on it) that no plan with the optimizer on the device fits: -r auto
    with the flag moves it to the host pool and says so, and the run trains to
    the files of -r 0 without it; without the flag, or with the one memory of
    the CPU (no --host-mem-budget), nothing fits."""
    budget = ["--mem-budget", "2MiB"]
    res = auto(*budget, "--host-mem-budget", "64MiB", "--offload-optimizer")
    assert res.returncode == 0, res.stderr
    assert "recompute auto: the optimizer in host memory: --offload-optimizer" in res.stdout, res.stdout
    for flags in ([*budget, "--host-mem-budget", "64MiB"], [*budget, "--offload-optimizer"]):
        res = auto(*flags)
        assert res.returncode != 0 and "-r auto: nothing fits in 2.0 MiB" in res.stderr, (flags, res.stderr)
    train(tiny_shards, tmp_path / "r0")
    res = train(tiny_shards, tmp_path / "auto", "-r", "auto", *budget, "--host-mem-budget", "64MiB", "--offload-optimizer")
    assert "optimizer offloaded (--offload-optimizer)" in res.stdout
    assert files(tmp_path / "auto") == files(tmp_path / "r0")
