"""Offloaded checkpoints through the CPU trainer's command line: a copy to a
host pool and back, so model files, state files and logs are byte-identical
to the same run without it (and to -r 0); the plan's device and host bytes
against a count written out here; -r auto within both budgets; bad input."""
import json
import re
from pathlib import Path

import pytest

from conftest import REPO, binary, copy_checkpoint, gpu_trainer, run
from test_plan_cli import SHAPES, a256, independent_total

# five layers: the staging ring's three slots wrap around
MODEL = ["-e", "d6", "--layers", "5", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "32"]


def train(tiny_shards, out, *extra):
    return run([binary("train_gpt_cpu"), *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", tiny_shards / "tiny_val.bin",
                "-b", "2", "-t", "32", "-v", "2", "-m", "2", "-s", "0", "-l", "1e-3", "-x", "4", "-n", "2", "-o", out, *extra],
               check=True)


def files(out):
    """Every checkpoint file's bytes, each run's own id (in the headers and the
    DONE markers, llmc/core/checkpoint.h) zeroed."""
    run_id = int(next(out.glob("DONE_*")).read_text().split()[1], 16)
    raw, text = run_id.to_bytes(8, "little"), f"{run_id:016x}".encode()
    return {p.name: p.read_bytes().replace(raw, bytes(8)).replace(text, b"0" * 16)
            for p in sorted(out.iterdir()) if p.name != "log.jsonl"}


def losses(out):
    return [(e["step"], e.get("loss"), e.get("val_loss")) for e in map(json.loads, (out / "log.jsonl").read_text().splitlines())
            if "loss" in e or "val_loss" in e]


@pytest.mark.parametrize("plain,offloaded", [
    (["-r", "1"], ["-r", "1", "--offload-checkpoints"]),
    (["-r", "3"], ["-r", "3", "--offload-checkpoints"]),
    (["-r", "1:0,2/3:1,4/2:3"], ["-r", "1o:0,2/3o:1,4/2:3"]),
    (["-r", "3:0-2/1:3-4"], ["-r", "3o:0,2/3:1/1o:4/1:3"]),
    (["-r", "1", "--recompute-layers", "every:2"], ["-r", "1", "--recompute-layers", "every:2", "--offload-checkpoints"]),
])
@pytest.mark.parametrize("dropout", [[], ["--dropout", "0.2", "-d", "128"]], ids=["plain", "dropout+2micro"])
def test_offloaded_runs_write_identical_files(tiny_shards, tmp_path, plain, offloaded, dropout):
    outs = {}
    for name, flags in (("r0", []), ("plain", plain), ("offloaded", offloaded)):
        outs[name] = tmp_path / name
        res = train(tiny_shards, outs[name], *flags, *dropout)
        if name == "offloaded":
            assert re.search(r"host memory, offloaded checkpoints: [0-9.]+ MiB \(a second allocation\), device staging ring 3 slots",
                             res.stdout), res.stdout
    ref = files(outs["r0"])
    assert any(n.startswith("model_") for n in ref) and any(n.startswith("state_") for n in ref)
    assert files(outs["plain"]) == ref and files(outs["offloaded"]) == ref
    assert losses(outs["offloaded"]) == losses(outs["r0"]) and len(losses(outs["r0"])) >= 4


def offloaded_total(s, B, T, modes, offload):
    """Device and host bytes of the CPU trainer's plan: an offloaded layer keeps
    nothing on the device, its tensors in the host pool, and three (at most L)
    staging slots hold x, plus attention's output and logsumexp when some -r 3
    layer offloads."""
    C, NH, N = s["C"], s["NH"], B * T
    hosted = {1: [C], 3: [C, C, NH]}
    device = independent_total(s, B, T, modes)
    host = 0
    for m, o in zip(modes, offload):
        if o:
            layer = sum(a256(4 * N * k) for k in hosted[m])
            device -= layer
            host += layer
    if any(offload):
        slot = hosted[3] if any(o and m == 3 for m, o in zip(modes, offload)) else hosted[1]
        device += min(3, s["L"]) * sum(a256(4 * N * k) for k in slot)
    return device, host


def plan_json(*args):
    res = run([binary("train_gpt_cpu"), *map(str, args), "--plan-json"])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("flag,modes,offload", [
    ("1o:all", [1] * 12, [1] * 12),
    ("3o:all", [3] * 12, [1] * 12),
    ("1o:0-3/3:4-6/3o:7/2:8-9", [1, 1, 1, 1, 3, 3, 3, 3, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]),
    ("1o:11", [0] * 11 + [1], [0] * 11 + [1]),
])
def test_plan_device_and_host_bytes(flag, modes, offload):
    flags, s = SHAPES["d12"]
    d = plan_json(*flags, "-b", 2, "-t", 512, "-r", flag)
    assert d["layer_modes"] == modes and d["layer_offload"] == offload
    device, host = offloaded_total(s, 2, 512, modes, offload)
    assert d["total_bytes"] == device and sum(d["components"].values()) == device
    assert d["host_total_bytes"] == host == sum(a256(b["bytes"]) for b in d["host_buffers"])
    assert d["staging_slots"] == 3
    again = plan_json(*flags, "-b", 2, "-t", 512, "-r", d["recompute"])
    assert (again["layer_modes"], again["layer_offload"], again["total_bytes"]) == (modes, offload, device)


def test_offload_flag_is_the_mix_with_every_recomputed_layer_offloaded():
    flags, _ = SHAPES["d12"]
    a = plan_json(*flags, "-b", 1, "-t", 256, "-r", "3", "--recompute-layers", "0,5-7", "--offload-checkpoints")
    b = plan_json(*flags, "-b", 1, "-t", 256, "-r", "3o:0,5-7")
    assert a["recompute"] == "3o:0,5-7" and a["total_bytes"] == b["total_bytes"] and a["host_total_bytes"] == b["host_total_bytes"]


AUTO_NOTE = re.compile(r"^recompute auto: fits .* with [0-9.]+ MiB: -r (\S+)( --tile-tokens \d+)?; predicted", re.M)
HOST_NOTE = re.compile(r"^recompute auto: host memory ([0-9.]+) MiB of ([0-9.]+) MiB \(--host-mem-budget\)", re.M)


def auto(budget, *extra, tiles=("--tile-tokens", "0")):
    """-r auto on the 24-layer model; untiled unless `tiles` says otherwise
    (a tile would fit budgets these tests mean for offloading alone), no
    segments (test_segments.py has them)."""
    flags, _ = SHAPES["24x2048"]
    return run([binary("train_gpt_cpu"), *flags, "-b", 1, "-t", 4096, "-r", "auto", "--mem-budget", budget, "--plan-json", *tiles,
                "--segment-layers", "1", *extra])


def test_auto_offloads_where_nothing_else_fits():
    """Below -r 1's total nothing fits without offloading; with it -r auto
    finds a mix within both budgets, and its printed flag reproduces it."""
    flags, s = SHAPES["24x2048"]
    r1 = plan_json(*flags, "-b", 1, "-t", 4096, "-r", "1")["total_bytes"]
    budget = r1 - 8 * a256(4 * 4096 * 2048)
    assert auto(budget).returncode == 1
    res = auto(budget, "--offload-checkpoints", "--host-mem-budget", "4GiB")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["total_bytes"] <= budget and 0 < d["host_total_bytes"] <= 4 << 30 and any(d["layer_offload"])
    note = AUTO_NOTE.search(res.stderr)
    assert note and "o:" in note.group(1), res.stderr
    host = HOST_NOTE.search(res.stderr)
    assert host and abs(float(host.group(1)) * 2**20 - d["host_total_bytes"]) < 0.1 * 2**20
    again = plan_json(*flags, "-b", 1, "-t", 4096, "-r", note.group(1))
    assert (again["layer_modes"], again["layer_offload"], again["total_bytes"]) == \
        (d["layer_modes"], d["layer_offload"], d["total_bytes"])


def test_auto_keeps_within_the_host_budget():
    """A host budget for 3 offloaded layers' inputs: at most 3 offload, and a
    budget for none leaves auto with nothing that fits below -r 1's total."""
    flags, _ = SHAPES["24x2048"]
    x = a256(4 * 4096 * 2048)
    r1 = plan_json(*flags, "-b", 1, "-t", 4096, "-r", "1")["total_bytes"]
    d = json.loads(auto(r1, "--offload-checkpoints", "--host-mem-budget", 3 * x).stdout)
    assert sum(d["layer_offload"]) <= 3 and d["host_total_bytes"] <= 3 * x
    assert auto(r1 - 4 * x, "--offload-checkpoints", "--host-mem-budget", 2 * x).returncode == 1


@pytest.mark.parametrize("args,message", [
    (["-r", "2o:all"], "only -r 1 and -r 3 layers offload"),
    (["-r", "0o:0"], "only -r 1 and -r 3 layers offload"),
    (["-r", "1x:0"], "each group is MODE:LAYERS"),
    (["-r", "2", "--offload-checkpoints"], "no layer recomputes with -r 1 or -r 3"),
    (["-r", "1o:all", "--offload-checkpoints"], "mark offloaded groups in the mix instead"),
    (["--host-link", "pcie9", "-r", "1"], "flag --host-link: 'pcie9' is not pcie4, pcie5, nvlink-c2c nor a positive rate"),
    (["--host-mem-budget", "lots", "-r", "1", "--offload-checkpoints"], "flag --host-mem-budget: 'lots' is not a positive size"),
])
def test_bad_offload_flags_are_refused(args, message):
    res = run([binary("train_gpt_cpu"), *MODEL, "-b", "1", "-t", "32", *args, "--plan"])
    assert res.returncode != 0 and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_run_refuses_a_host_pool_over_the_host_budget(tiny_shards, tmp_path):
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", tiny_shards / "tiny_train.bin", "-b", "2", "-t", "32", "-x", "1",
               "-r", "1", "--offload-checkpoints", "--host-mem-budget", "1KiB"])
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1].startswith("error: offloaded checkpoints: the host pool needs"), res.stderr


# ---- token tiles ----

def model_files(out):
    return {n: b for n, b in files(out).items() if n.startswith("model_")}


@pytest.mark.parametrize("tile", ["5", "16"])
def test_tiled_runs_write_identical_files(tiny_shards, tmp_path, tile):
    """At a fixed tile size every -r setting, offloaded or not, writes the same
    files (the state records the tile size); the model files equal the
    untiled run's: on the CPU a tile changes no sum's order."""
    drop = ["--dropout", "0.2", "-d", "128"]
    untiled = tmp_path / "untiled"
    train(tiny_shards, untiled, *drop)
    got = {}
    for name, flags in (("r0", ["-r", "0"]), ("r1", ["-r", "1"]), ("r3o", ["-r", "3o:all"]), ("mix", ["-r", "1o:0,2/2:1/3:3-4"])):
        res = train(tiny_shards, tmp_path / name, *drop, "--tile-tokens", tile, *flags)
        assert f"token tiles: {tile} of the 64 rows at a time (--tile-tokens {tile})" in res.stdout, res.stdout
        got[name] = files(tmp_path / name)
    for name in got:
        assert got[name] == got["r0"], name
    assert model_files(tmp_path / "r0") == model_files(untiled) and len(model_files(untiled)) >= 2
    assert losses(tmp_path / "r1") == losses(untiled)


def auto_tile_budget():
    """A budget where -r auto on MODEL at -b 2 -t 32 must tile: below the
    least untiled plan (-r 1 at any segment size), at or above a tiled one."""
    base = [*MODEL, "-b", "2", "-t", "32", "-i", "x", "-r", "1"]
    untiled = min(plan_json(*base, "--segment-layers", K)["total_bytes"] for K in range(1, 6))
    tiled = min(plan_json(*base, "--segment-layers", K, "--tile-tokens", 1)["total_bytes"] for K in range(1, 6))
    assert tiled < untiled
    return untiled - 1


@pytest.mark.parametrize("first,then", [(["--tile-tokens", "5"], ["--tile-tokens", "8"]),
                                        (["-r", "auto", "--mem-budget", "TILED"], ["-r", "auto"]),
                                        (["-r", "auto", "--mem-budget", "TILED"], ["-r", "1", "--segment-layers", "2"])],
                         ids=["typed", "auto-chose-a-tile-then-none", "auto-then-fixed"])
def test_resume_with_another_tile_size_continues_bitwise_on_the_cpu(tiny_shards, tmp_path, first, then):
    """Issue 44, 4: on the CPU every tile size gives the untiled bits, so a
    resume whose tile differs from the checkpoint's, typed or chosen by
    -r auto under another budget (and its segments and modes with it), goes
    on, says so, and writes the model files and losses of the run that did
    not stop."""
    budget = str(auto_tile_budget())
    first = [budget if a == "TILED" else a for a in first]
    full, part = tmp_path / "full", tmp_path / "part"
    res = train(tiny_shards, full, *first)
    if "auto" in first:
        assert re.search(r"^recompute auto: .* --tile-tokens \d+;", res.stdout, re.M), res.stdout
    copy_checkpoint(full, part, 2)
    res = train(tiny_shards, part, *then, "-y", "1")
    assert re.search(r"^resume: --tile-tokens \d+, the checkpoint's \d+: the CPU trainer's results do not depend on the tile size$",
                     res.stdout, re.M), res.stdout
    assert model_files(part) == {n: b for n, b in model_files(full).items() if n in model_files(part)} and "model_00000004.bin" in model_files(part)
    trained = [e for e in losses(full) if e[0] > 2 and e[1] is not None]
    assert [e for e in losses(part) if e[1] is not None] == trained and len(trained) == 2
    assert losses(part)[-1] == losses(full)[-1] and losses(full)[-1][2] is not None  # the last validation


@pytest.mark.parametrize("chooser", [["-r", "auto"], ["-r", "1", "--tile-tokens", "auto"]], ids=["r-auto", "tile-auto"])
def test_gpu_resume_keeps_the_checkpoints_tile_where_it_fits(tiny_shards, tmp_path, chooser):
    """Issue 44, 4, on the GPU trainer's plan (--plan: no GPU needed), over a
    checkpoint the CPU trainer wrote at --tile-tokens 16: a GPU run's bits
    depend on the tile, so -r auto (or --tile-tokens auto) resumes at 16
    where a plan at 16 fits, and says so; where none does it refuses naming
    --resume-override, with which it chooses another tile."""
    exe = gpu_trainer()
    out = tmp_path / "run"
    train(tiny_shards, out, "--tile-tokens", "16")
    base = [str(exe), *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32", "-s", "0", "-x", "6", "-o", out,
            "-y", "1", *chooser]
    res = run([*base, "--mem-budget", "1GiB", "--plan-json"])
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tile_tokens"] == 16
    assert re.search(r"--tile-tokens 16(,| is) the checkpoint's, kept on resume \(a GPU run's bits depend on the tile size", res.stderr), res.stderr
    plan = [str(exe), *MODEL, "-b", "2", "-t", "32", "-i", "x", "-r", "1", "--plan-json"]
    at16 = min(json.loads(run([*plan, "--tile-tokens", "16", "--segment-layers", K]).stdout)["total_bytes"] for K in "12345")
    # -r auto: below every plan at 16; --tile-tokens auto with -r 1: below -r 1's own plan at 16
    tight = str(at16 - 1 if chooser[1] == "auto" else json.loads(run([*plan, "--tile-tokens", "16"]).stdout)["total_bytes"] - 1)
    res = run([*base, "--mem-budget", tight, "--plan"])
    assert res.returncode == 1 and "trained with --tile-tokens 16" in res.stderr and "--resume-override" in res.stderr, res.stderr
    res = run([*base, "--mem-budget", tight, "--resume-override", "--plan-json"])
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["tile_tokens"] != 16 and d["total_bytes"] <= int(tight)  # (untiled may fit: on a GPU tiles add buffers of their own)


def test_tiled_plan_holds_one_tile_of_the_token_wise_tensors():
    flags, s = SHAPES["d12"]
    C, NH, N, K = s["C"], s["NH"], 2 * 512, 100
    d = plan_json(*flags, "-b", 2, "-t", 512, "-r", "1", "--tile-tokens", K)
    sizes = {b["name"]: b["bytes"] for b in d["buffers"]}
    assert d["tile_tokens"] == K
    for name, width in (("ln1", C), ("ln1_mean", 1), ("res2", C), ("ln2", C), ("fch", 4 * C), ("fch_gelu", 4 * C)):
        assert sizes[f"recompute.{name}"] == 4 * K * width, name
    for name, width in (("qkv", 3 * C), ("atty", C), ("att_lse", NH)):
        assert sizes[f"recompute.{name}"] == 4 * N * width, name
    assert sizes["backward.datty"] == 4 * N * C and sizes["backward.dqkv"] == 4 * N * 3 * C
    untiled = plan_json(*flags, "-b", 2, "-t", 512, "-r", "1")
    saved = sum(a256(4 * N * k) - a256(4 * K * k) for k in (C, 1, 1, C, C, 1, 1, 4 * C, 4 * C)) - a256(4 * N * C) - a256(12 * N * C)
    assert untiled["total_bytes"] - d["total_bytes"] == saved


def reproduced(d, flags_printed, *base):
    """The plan of the printed flags equals the one -r auto chose."""
    again = plan_json(*base, *flags_printed.split())
    keys = ("recompute", "layer_modes", "layer_offload", "tile_tokens", "total_bytes", "host_total_bytes", "predicted_step_seconds")
    return {k: again[k] for k in keys} == {k: d[k] for k in keys}


def test_auto_chooses_a_tile_where_untiled_does_not_fit():
    """Below the untiled -r 1 total -r auto (no offloading) still fits, with a
    tile; -r auto --tile-tokens auto chooses the same; the printed flags
    reproduce the plan; --tile-tokens 0 pins it untiled, where nothing fits."""
    flags, _ = SHAPES["24x2048"]
    r1 = plan_json(*flags, "-b", 1, "-t", 4096, "-r", "1")["total_bytes"]
    budget = (r1 + plan_json(*flags, "-b", 1, "-t", 4096, "-r", "1", "--tile-tokens", 64)["total_bytes"]) // 2
    assert auto(budget).returncode == 1
    res = auto(budget, tiles=())
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    note = AUTO_NOTE.search(res.stderr)
    assert note and note.group(2), res.stderr
    K = int(note.group(2).split()[-1])
    assert d["tile_tokens"] == K and K & (K - 1) == 0 and 64 <= K < 4096 and d["total_bytes"] <= budget
    assert reproduced(d, f"-r {note.group(1)}{note.group(2)}", *flags, "-b", 1, "-t", 4096)
    same = json.loads(auto(budget, tiles=("--tile-tokens", "auto")).stdout)
    assert (same["recompute"], same["tile_tokens"]) == (d["recompute"], K)


def test_auto_tile_is_the_fastest_that_fits():
    """-r auto's choice against every (uniform -r, tile) plan the program
    gives: none that fits is predicted faster; a fixed -r with --tile-tokens
    auto takes the fastest tile that fits among untiled and the powers of two
    from 2048 down, and the smallest (one row) where none fits."""
    flags, _ = SHAPES["24x2048"]
    tiles = [0, 2048, 1024, 512, 256, 128, 64]
    r1_tiled = plan_json(*flags, "-b", 1, "-t", 4096, "-r", "1", "--tile-tokens", 64)["total_bytes"]
    r3 = plan_json(*flags, "-b", 1, "-t", 4096, "-r", "3")["total_bytes"]
    plans = [plan_json(*flags, "-b", 1, "-t", 4096, "-r", r, "--tile-tokens", k) for r in "0123" for k in tiles]
    for budget in (r1_tiled + (1 << 20), (r1_tiled + r3) // 2, r3):
        fitting = [p for p in plans if p["total_bytes"] <= budget]
        d = json.loads(auto(budget, tiles=()).stdout)
        assert d["total_bytes"] <= budget and d["predicted_step_seconds"] <= min(p["predicted_step_seconds"] for p in fitting) * (1 + 1e-9)
        for r in "13":
            mine = [p for p in fitting if p["recompute"] == r]
            res = run([binary("train_gpt_cpu"), *flags, "-b", 1, "-t", 4096, "-r", r, "--mem-budget", budget, "--tile-tokens", "auto", "--plan-json"])
            got = json.loads(res.stdout)
            if mine:
                fastest = min(mine, key=lambda p: (p["predicted_step_seconds"], -p["tile_tokens"] if p["tile_tokens"] else -1e9))
                assert got["tile_tokens"] == fastest["tile_tokens"], (r, budget)
            else:
                assert got["tile_tokens"] == 1 and "no tile fits" in res.stderr


def test_gpu_tiled_plan_adds_the_fp32_tile_gradient_sums():
    """The GPU trainer's plan (BF16, no GPU needed): one tile of the token-wise
    tensors as on the CPU, in 2-byte storage, and backward.tile_grads, one
    layer's 12C^2 + 13C parameter gradients in fp32; --plan lists it."""
    exe = REPO / "build" / "train_gpt_bf16"
    if not exe.exists():
        pytest.skip(f"{exe} not built (make build/train_gpt_bf16 needs nvcc)")
    flags, s = SHAPES["d12"]
    C, N, K = s["C"], 2 * 512, 100
    env_free = ["--mem-budget", "80GiB", "--cost-model", "h100"]
    res = run([exe, *flags, "-b", "2", "-t", "512", "-r", "1", "--tile-tokens", str(K), *env_free, "--plan-json"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    sizes = {b["name"]: b["bytes"] for b in d["buffers"]}
    assert sizes["backward.tile_grads"] == 4 * (12 * C * C + 13 * C)
    for name, width, E in (("ln1", C, 2), ("ln1_mean", 1, 4), ("res2", C, 2), ("fch", 4 * C, 2), ("fch_gelu", 4 * C, 2)):
        assert sizes[f"recompute.{name}"] == E * K * width, name
    assert sizes["backward.datty"] == 2 * N * C and sizes["backward.dqkv"] == 2 * N * 3 * C
    res = run([exe, *flags, "-b", "2", "-t", "512", "-r", "1", *env_free, "--plan-json"], env={"CUDA_VISIBLE_DEVICES": ""})
    untiled = json.loads(res.stdout)
    assert "backward.tile_grads" not in {b["name"] for b in untiled["buffers"]}
    saved = sum(a256(E * N * k) - a256(E * K * k) for k, E in ((C, 2), (1, 4), (1, 4), (C, 2), (C, 2), (1, 4), (1, 4), (4 * C, 2), (4 * C, 2)))
    added = a256(2 * N * C) + a256(6 * N * C) + a256(4 * (12 * C * C + 13 * C))
    assert untiled["total_bytes"] - d["total_bytes"] == saved - added
    res = run([exe, *flags, "-b", "2", "-t", "512", "-r", "1", "--tile-tokens", str(K), *env_free, "--plan"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert re.search(r"^  backward\.tile_grads +scratch +27\.0 MiB$", res.stdout, re.M), res.stdout[-3000:]


@pytest.mark.parametrize("bad", ["-1", "x", "1.5"])
def test_bad_tile_flag_is_refused(bad):
    res = run([binary("train_gpt_cpu"), *MODEL, "-b", "1", "-t", "32", "--tile-tokens", bad, "--plan"])
    assert res.returncode != 0 and "flag --tile-tokens" in res.stderr and len(res.stderr.strip().splitlines()) == 1


RSS = re.compile(r"peak resident memory: ([0-9.]+) MiB \(plan: ([0-9.]+) MiB[,)]")


def test_tiles_lower_peak_rss_as_planned(tmp_path):
    """-r 1 with many short sequences (attention is cheap, the token-wise
    recompute set large): the tiled run's peak RSS is lower than the untiled
    run's by most of what the plan saves, and each stays near its plan."""
    import numpy as np
    import datafile
    data = tmp_path / "train.bin"
    datafile.write_shard(data, np.random.default_rng(1).integers(0, 64, 200000))
    shape = ["-e", "d6", "--layers", "1", "--channels", "64", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "64"]
    got = {}
    for tile in ("0", "256"):
        res = run([binary("train_gpt_cpu"), *shape, "-i", data, "-j", "", "-b", "1024", "-t", "64", "-x", "1", "-s", "0", "-r", "1",
                   "--tile-tokens", tile], check=True)
        rss, planned = map(float, RSS.search(res.stdout).groups())
        got[tile] = rss, planned
    saved_plan = got["0"][1] - got["256"][1]
    saved_rss = got["0"][0] - got["256"][0]
    assert saved_plan > 90, got  # MiB: the token-wise set (11C+4 floats a token) less datty and dqkv (4C)
    assert saved_rss > 0.75 * saved_plan, got
    for rss, planned in got.values():
        assert rss < planned + 80, got  # the program, libraries and the dataloader's shard beyond the plan


# ---- the links measured for the time model ----

COST_LINE = re.compile(r"^cost model: step 2 \(\S+ ms\) calibrated, written to (\S+): .*; (\d) links? measured: host link (\S+) B/s \((\d+) copies\), "
                       r"ring (\S+) B/s and (\S+) s a message \((\d+) waits\); matmuls at half rate at (\S+) rows$", re.M)


def cost_file(path):
    return {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in path.read_text().splitlines()
                                              if line.strip() and not line.startswith("#"))}


def test_profiled_step_measures_the_host_link(tiny_shards, tmp_path):
    """REMAT_PROFILE_COST_MODEL: step 2's offload copies timed (5 layers, each
    x out and back, one micro-step: 10 copies) into the file's
    host_link_bytes_per_s, which --cost-model reads back into the plan."""
    cm = tmp_path / "cm.txt"
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", "2", "-t", "32", "-s", "0",
               "-x", "3", "-r", "1", "--offload-checkpoints"], env={"REMAT_PROFILE": "2", "REMAT_PROFILE_COST_MODEL": str(cm)}, check=True)
    line = COST_LINE.search(res.stdout)
    assert line and line.group(2) == "1" and line.group(4) == "10" and line.group(7) == "0", res.stdout
    rates = cost_file(cm)
    assert float(rates["host_link_bytes_per_s"]) > 0 and "ring_link_bytes_per_s" not in rates
    assert float(rates["matmul_half_rows"]) == pytest.approx(float(line.group(8)), rel=1e-2)
    assert rates["name"].endswith("calibrated at B=2 T=32")
    d = plan_json(*MODEL, "-b", "2", "-t", "32", "-r", "1", "--offload-checkpoints", "--cost-model", cm)
    assert d["cost_model"]["host_link_bytes_per_s"] == float(rates["host_link_bytes_per_s"])
    assert d["cost_model"]["matmul_flops_per_s"] == float(rates["matmul_flops_per_s"])
    assert d["cost_model"]["matmul_half_rows"] == float(rates["matmul_half_rows"])


# ---- the numbers of docs/offload-and-tiles.md ----

NUMBERS_ROW = re.compile(r"^\| (\S+) \| ((?:8x)?\d+GB) \| (\w+) \| (\d+)( \(limit\))? \| ([0-9.]+) \| ([0-9.]+) \| `([^`]*)` \| (\d+) \| ([0-9.]+) \|$", re.M)


def test_docs_numbers_are_the_programs():
    """Every row of the table: the plan at its T fits both budgets with the
    device and host bytes, the -r choice and the tile size printed, and at T+1 (T+2N on N
    cards sharing each sequence) it does not (unless T is --max-seq-len's limit)."""
    exe = gpu_trainer()
    import importlib.util
    spec = importlib.util.spec_from_file_location("longest_t", REPO / "dev" / "bench" / "longest_t.py")
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    rows = NUMBERS_ROW.findall((REPO / "docs/offload-and-tiles.md").read_text())
    assert [r[:3] for r in rows] == lt.settings()
    host = 120 << 30
    # The emulated build pads every device buffer with guard bytes (dev/emu/Makefile), so its plan is the
    # table's plus that much per buffer; at the longest T, where a few KiB decide which tile fits and
    # whether the plan fits at all, each row is checked there with its own flags (the -r and tile it
    # printed), the guard bytes taken out.
    guard = re.search(r"-DPLAN_GUARD_BYTES=(\d+)", (REPO / "dev/emu/Makefile").read_text())
    guard_bytes = int(guard.group(1)) if "emu" in Path(exe).name else 0
    for model, card, tech, T, limit, dev_gib, host_gib, flag, tile, _ in rows:
        cost_model, mib, _ = lt.CARDS[card]
        budget, T = (mib - lt.HEADROOM_MIB) << 20, int(T)
        args = (lt.MODELS[model], lt.flags_of(card, tech))
        if guard_bytes:
            tiles = ["--tile-tokens", tile] if int(tile) else []
            d = lt.plan(str(exe), args[0], T, ["-r", *flag.split(), *tiles, *lt.card_flags(card)], budget + guard_bytes * 4096, host, cost_model)
            device = d["total_bytes"] - guard_bytes * len(d["buffers"])
            assert device <= budget and d["host_total_bytes"] <= host, (model, card, tech, T)
            assert f"{device / 2**30:.1f}" == dev_gib and f"{d['host_total_bytes'] / 2**30:.1f}" == host_gib, (model, card, tech)
            continue
        d = lt.plan(str(exe), args[0], T, args[1], budget, host, cost_model)
        assert lt.fits(d, budget, host), (model, card, tech, T)
        assert f"{d['total_bytes'] / 2**30:.1f}" == dev_gib and f"{d['host_total_bytes'] / 2**30:.1f}" == host_gib
        assert lt.recompute_cell(d) == flag and d["tile_tokens"] == int(tile)
        if limit:
            assert T == lt.MAX_T
        else:
            T_next = T + lt.t_step(card)  # under --context-parallel N the next length the ring takes, T + 2N
            assert not lt.fits(lt.plan(str(exe), args[0], T_next, args[1], budget, host, cost_model), budget, host), (model, card, tech, T)


OPTIMIZER_TABLE_ROW = re.compile(r"^\| (\S+) \| (\d+GB) \| (\d+) \| (\w+) \| (\d+)( \(limit\))? \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| "
                                 r"`([^`]*)` \| (\d+) \| ([0-9.]+) \| ([0-9.]+) / ([0-9.]+) / ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)% \|$", re.M)


def test_docs_optimizer_numbers_are_the_programs():
    """Every row of the optimizer's longest-T table (docs/offload-and-tiles.md, "The optimizer in host memory"): the
    plan at its T, with its technique's flags and host budget, fits both budgets with the device and host GiB and the
    choices printed (-r, segments, --offload-optimizer, tile), and at T+1 it does not; where the optimizer is in host
    memory its pool is 14 bytes a parameter (fp32 master weights and two moments, a bf16 gradient copy), AdamW's time
    is 28 bytes a parameter at the host's memory rate (gradient read, master weights and both moments read and
    written, the bf16 parameter written) and each copy 2 bytes a parameter over the host link, counted here from the
    parameter count; the step and the share are the plan's step and not-hidden seconds over it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("longest_t", REPO / "dev" / "bench" / "longest_t.py")
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    exe = str(gpu_trainer())
    rows = OPTIMIZER_TABLE_ROW.findall((REPO / "docs/offload-and-tiles.md").read_text())
    assert [(m, c, int(h), t) for m, c, h, t, *_ in rows] == lt.OPTIMIZER_ROWS
    guard = re.search(r"-DPLAN_GUARD_BYTES=(\d+)", (REPO / "dev/emu/Makefile").read_text())
    guard_bytes = int(guard.group(1)) if "emu" in Path(exe).name else 0
    for model, card, host_gib, tech, T, limit, dev_gib, host_used, opt_gib, flag, tile, step, down, adamw, up, hidden, share in rows:
        cost_model, mib, _ = lt.CARDS[card]
        budget, host, T = (mib - lt.HEADROOM_MIB) << 20, int(host_gib) << 30, int(T)
        if guard_bytes:  # as in test_docs_numbers_are_the_programs: the row's own choices, the guard bytes taken out
            tiles = ["--tile-tokens", tile] if int(tile) else []
            d = lt.plan(exe, lt.MODELS[model], T, ["-r", *flag.split(), *tiles], budget + guard_bytes * 4096, host, cost_model)
            device = d["total_bytes"] - guard_bytes * len(d["buffers"])
        else:
            d = lt.plan(exe, lt.MODELS[model], T, lt.TECHNIQUES[tech], budget, host, cost_model)
            device = d["total_bytes"]
            assert lt.recompute_cell(d) == flag and d["tile_tokens"] == int(tile), (model, card, host_gib, tech)
            if limit:
                assert T == lt.MAX_T
            else:
                assert not lt.fits(lt.plan(exe, lt.MODELS[model], T + 1, lt.TECHNIQUES[tech], budget, host, cost_model), budget, host)
        assert device <= budget and d["host_total_bytes"] <= host, (model, card, host_gib, tech, T)
        assert (f"{device / 2**30:.1f}", f"{d['host_total_bytes'] / 2**30:.1f}") == (dev_gib, host_used), (model, card, host_gib, tech)
        P, o, cm = d["config"]["num_parameters"], d["optimizer_offload_seconds"], d["cost_model"]
        offloaded = flag.endswith("--offload-optimizer")
        assert d["offload_optimizer"] == offloaded
        assert f"{lt.host_optimizer_bytes(d) / 2**30:.1f}" == opt_gib == f"{14 * P * offloaded / 2**30:.1f}"
        assert o["adamw"] == pytest.approx(28 * P * offloaded / cm["host_memory_bytes_per_s"], rel=1e-6)
        assert o["down"] == o["up"] == pytest.approx(2 * P * offloaded / cm["host_link_bytes_per_s"], rel=1e-6)
        assert (f"{o['down']:.2f}", f"{o['adamw']:.2f}", f"{o['up']:.2f}", f"{o['exposed']:.2f}") == (down, adamw, up, hidden)
        assert f"{d['predicted_step_seconds']:.1f}" == step and f"{100 * o['exposed'] / d['predicted_step_seconds']:.2f}" == share


README_BUDGETS = {"one 141 GB H200": ("142747MiB", "h200"), "one 80 GB H100": ("80535MiB", "h100")}


def test_readme_optimizer_rows_run_as_printed():
    """README's longest-T rows with --offload-optimizer, run by the recipe under the table as a reader would type it
    (`./train_gpt -e E --max-seq-len T -b 1 -t T SETTINGS --mem-budget 142747MiB|80535MiB --host-mem-budget NGiB
    --cost-model h200|h100`): -r auto fits at T with the optimizer in host memory, and nothing fits at T+1."""
    exe = gpu_trainer()
    if "emu" in Path(exe).name:
        pytest.skip("only the emulated build: its plans carry guard bytes per buffer (dev/emu/Makefile), so the last "
                    "bytes of a longest T are not its; make train_gpt")
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## How long a sequence fits"):readme.index("## Status")]
    assert "`--mem-budget` the card less 1 GiB (142747MiB,\n80535MiB)" in section and "`--cost-model h200` or `h100`" in section
    rows = re.findall(r"^\| `([^`]+)` \| (one [^|+]+?) \+ (\d+) GiB host memory \| `([^`]*--offload-optimizer[^`]*)` \| ([0-9,]+) \|", section, re.M)
    assert len(rows) >= 3 and any("80 GB" in r[1] for r in rows), rows

    def plan(E, T, settings, budget, host, cost_model):
        res = run([exe, "-e", E, "--max-seq-len", str(T), "-b", "1", "-t", str(T), *settings.split(), "--mem-budget", budget,
                   "--host-mem-budget", f"{host}GiB", "--cost-model", cost_model, "--plan-json"])
        return json.loads(res.stdout) if res.returncode == 0 else res.stderr

    for E, where, host, settings, T in rows:
        budget, cost_model = README_BUDGETS[where]
        T = int(T.replace(",", ""))
        d = plan(E, T, settings, budget, host, cost_model)
        assert isinstance(d, dict) and d["offload_optimizer"] == 1, (E, where, host, T, d)
        assert d["total_bytes"] <= int(budget[:-3]) << 20 and d["host_total_bytes"] <= int(host) << 30
        over = plan(E, T + 1, settings, budget, host, cost_model)
        assert isinstance(over, str) and "-r auto: nothing" in over, (E, where, host, T + 1)
