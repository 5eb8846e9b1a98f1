"""--plan, --plan-json and -r auto of the CPU trainer (the same planner serves
the GPU trainer). The JSON totals are checked against a count of every buffer
written out here independently of llmc/plan/plan.h."""
import json
import re

import pytest

from conftest import BUILD, binary, run

SHAPES = {
    "d12": (["-e", "d12"], dict(L=12, NH=12, C=768, V=50257, maxT=1024)),
    "d48": (["-e", "d48"], dict(L=48, NH=25, C=1600, V=50257, maxT=1024)),
    "24x2048": (["-e", "d24", "--layers", "24", "--channels", "2048", "--heads", "16", "--max-seq-len", "8192"],
                dict(L=24, NH=16, C=2048, V=50257, maxT=8192)),
}


def plan_json(*args):
    res = run([binary("train_gpt_cpu"), *map(str, args), "--plan-json"])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def a256(n):
    return (n + 255) // 256 * 256


def independent_total(s, B, T, modes, processes=1, zero=0):
    """Every buffer of one process of the CPU trainer (fp32 storage, fp32
    statistics), each rounded up to 256 bytes, counted from docs/DESIGN.md's tables."""
    L, NH, C, V, maxT = s["L"], s["NH"], s["C"], s["V"], s["maxT"]
    Vp = (V + 127) // 128 * 128
    P = Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C
    N = B * T
    shard = -(-P // processes) if zero else P  # ZeRO-1: this process's share of AdamW m and v
    total = 2 * a256(4 * P) + 2 * a256(4 * shard)  # parameters, gradients, AdamW m and v
    kept = {0: [C, C, 1, 1, 3 * C, C, NH, C, C, 1, 1, 4 * C, 4 * C],
            2: [C, 1, 1, 3 * C, C, NH, C, 1, 1, 4 * C],
            3: [C, C, NH],  # x, attention output, logsumexp
            1: [C]}
    for m in modes:
        total += sum(a256(4 * N * k) for k in kept[m])
    if 1 in modes:    # one shared set of everything but x
        total += sum(a256(4 * N * k) for k in kept[0][1:])
    elif 3 in modes:  # everything but x, attention output and logsumexp
        total += sum(a256(4 * N * k) for k in [C, 1, 1, 3 * C, C, C, 1, 1, 4 * C, 4 * C])
    elif 2 in modes:  # one shared set of ln1, ln2, fch_gelu
        total += sum(a256(4 * N * k) for k in [C, C, 4 * C])
    total += 2 * a256(4 * N)                 # inputs, targets
    total += 2 * a256(4 * N * C)             # final residual, lnf
    total += 3 * a256(4 * N)                 # lnf mean, rstd, losses
    total += 2 * a256(4 * N * C)             # backward buffers dres, dln (the others go over dead activations)
    total += a256(4 * min(256, N) * Vp)      # logits chunk
    total += a256(4 << 18) + a256(2 * (N + 1))  # io staging, dataloader window
    total += a256(4 * N)                     # evaluation's top-1 tokens
    return total


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["0", "1", "2", "3"])
@pytest.mark.parametrize("T", [256, 1024])
def test_plan_json_matches_an_independent_count(shape, mode, T):
    flags, s = SHAPES[shape]
    d = plan_json(*flags, "-b", 2, "-t", T, "-r", mode)
    assert d["total_bytes"] == independent_total(s, 2, T, [int(mode)] * s["L"])
    assert set(d["components"]) == {"parameters", "master_weights", "gradients", "optimizer", "activations",
                                    "scratch", "workspace"}
    assert sum(d["components"].values()) == d["total_bytes"]
    assert [m["recompute"] for m in d["modes"]] == ["0", "2", "3", "1"]
    for m in d["modes"]:
        assert set(m) >= {"recompute", "total_bytes", "max_batch", "max_seq_len", "predicted_step_seconds",
                          "predicted_extra_time_fraction"}
    totals = [m["total_bytes"] for m in d["modes"]]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_plan_mixed_layers():
    flags, s = SHAPES["d12"]
    d = plan_json(*flags, "-b", 1, "-t", 512, "-r", "1", "--recompute-layers", "0,3-5")
    modes = [1 if l in (0, 3, 4, 5) else 0 for l in range(12)]
    assert d["layer_modes"] == modes
    assert d["total_bytes"] == independent_total(s, 1, 512, modes)


@pytest.mark.parametrize("processes", [2, 3, 8])
@pytest.mark.parametrize("zero", [0, 1])
def test_plan_for_other_process_counts(processes, zero):
    """--plan-processes N plans one process of an N-process run without
    starting N: under ZeRO-1 each holds 1/N of the AdamW state (the rest is
    per-process and does not shrink)."""
    flags, s = SHAPES["d48"]
    d = plan_json(*flags, "-b", 1, "-t", 1024, "-r", "1", "-z", zero, "--plan-processes", processes)
    assert d["world_size"] == processes and d["zero_stage"] == zero
    assert d["total_bytes"] == independent_total(s, 1, 1024, [1] * s["L"], processes, zero)
    text = run([binary("train_gpt_cpu"), *flags, "-b", "1", "-t", "1024", "-r", "1", "-z", str(zero), "--plan",
                "--plan-processes", str(processes)], check=True).stdout
    assert f"; per process, {processes} processes, ZeRO-{zero}):" in text


def test_plan_json_stdout_is_the_json_alone():
    """Notes printed while planning (-z 1 with one process) go to stderr, so
    --plan-json's stdout parses whatever the flags."""
    res = run([binary("train_gpt_cpu"), "-e", "d6", "-z", "1", "--plan-processes", "1", "--plan-json"], check=True)
    assert json.loads(res.stdout)["zero_stage"] == 1
    assert "note: -z 1 with one process shards nothing" in res.stderr


def test_plan_processes_needs_plan():
    res = run([binary("train_gpt_cpu"), "-e", "d6", "--plan-processes", "4"])
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: flag --plan-processes only applies to --plan and --plan-json "
                                  "(a run uses the processes it is started with)")


def test_max_batch_and_seq_len_are_tight():
    flags, _ = SHAPES["d12"]
    d = plan_json(*flags, "-b", 4, "-t", 1024, "--mem-budget", "3GiB")
    budget = 3 << 30
    for m in d["modes"]:
        b, t = m["max_batch"], m["max_seq_len"]
        if b >= 1:
            assert plan_json(*flags, "-b", b, "-t", 1024, "-r", m["recompute"])["total_bytes"] <= budget
            assert plan_json(*flags, "-b", b + 1, "-t", 1024, "-r", m["recompute"])["total_bytes"] > budget
        if 1 <= t < 1024:
            assert plan_json(*flags, "-b", 4, "-t", t, "-r", m["recompute"])["total_bytes"] <= budget
            assert plan_json(*flags, "-b", 4, "-t", t + 1, "-r", m["recompute"])["total_bytes"] > budget


def auto(budget, *extra):
    """-r auto's mode search alone: untiled (test_offload.py has its tile choice), no segments (test_segments.py)."""
    flags, _ = SHAPES["24x2048"]
    return run([binary("train_gpt_cpu"), *flags, "-b", 1, "-t", 4096, "-r", "auto", "--mem-budget", budget,
                "--tile-tokens", "0", "--segment-layers", "1", "--plan-json", *extra])


def mode_plans():
    flags, _ = SHAPES["24x2048"]
    d = plan_json(*flags, "-b", 1, "-t", 4096)
    return {m["recompute"]: m for m in d["modes"]}


def mode_totals():
    return {k: m["total_bytes"] for k, m in mode_plans().items()}


AUTO_NOTE = re.compile(r"^recompute auto: fits .* with [0-9.]+ MiB: -r (\S+); predicted ([0-9.]+) ms per step, "
                       r"\+([0-9.]+)% time over -r 0 \(cost model cpu\)$", re.M)


def test_auto_picks_nothing_when_everything_fits():
    tot = mode_totals()
    d = json.loads(auto(tot["0"]).stdout)
    assert d["layer_modes"] == [0] * 24 and d["total_bytes"] <= tot["0"]


def test_auto_picks_full_recompute_everywhere_when_only_that_fits():
    tot = mode_totals()
    d = json.loads(auto(tot["1"]).stdout)
    assert d["layer_modes"] == [1] * 24 and d["total_bytes"] <= tot["1"]


@pytest.mark.parametrize("between", [("0", "2"), ("2", "3"), ("3", "1")])
@pytest.mark.parametrize("frac", [0.2, 0.5, 0.8])
def test_auto_between_the_modes_totals(between, frac):
    """Budgets between two modes' totals: the choice fits, is printed as the
    -r flag that reproduces it, and is predicted no slower than any single
    mode on every layer that fits."""
    plans = mode_plans()
    hi, lo = plans[between[0]]["total_bytes"], plans[between[1]]["total_bytes"]
    budget = int(lo + frac * (hi - lo))
    res = auto(budget)
    note = AUTO_NOTE.search(res.stderr)
    assert note, res.stderr
    d = json.loads(res.stdout)  # stdout is the JSON alone; the note goes to stderr
    assert d["total_bytes"] <= budget
    assert len(set(d["layer_modes"])) > 1  # between two uniform totals: a mix
    flags, _ = SHAPES["24x2048"]
    again = plan_json(*flags, "-b", 1, "-t", 4096, "-r", note.group(1))
    assert again["layer_modes"] == d["layer_modes"] and again["total_bytes"] == d["total_bytes"]
    assert again["recompute"] == note.group(1)
    secs = d["predicted_step_seconds"]
    assert abs(float(note.group(2)) - 1e3 * secs) <= 0.05 + 1e-6 * 1e3 * secs
    for m in plans.values():
        if m["total_bytes"] <= budget:
            assert secs <= m["predicted_step_seconds"] * (1 + 1e-9)


def test_auto_just_below_mode_zero_needs_some_recompute():
    tot = mode_totals()
    d = json.loads(auto(tot["0"] - 1).stdout)
    assert any(d["layer_modes"]) and d["total_bytes"] < tot["0"]


def test_auto_nothing_fits_says_what_would():
    """Below -r 1 untiled without segments: tiles and segments keep -t (no
    shorter -t is offered); below the least of those, a shorter -t."""
    tot = mode_totals()
    res = auto(tot["1"] - 1)
    assert res.returncode == 1
    assert "what would fit" in res.stderr and "keeping the batch and the sequence length" in res.stderr, res.stderr
    assert not re.search(r" -t \d+", res.stderr), res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: -r auto: nothing fits")
    least = min(plan_json(*SHAPES["24x2048"][0], "-b", 1, "-t", 4096, "-r", 1, "--tile-tokens", tile, "--segment-layers", K)["total_bytes"]
                for tile in (0, 1) for K in range(1, 25))
    res = auto(least - 1)
    assert res.returncode == 1 and re.search(r"^  -r 1\S*( --segment-layers \d+)?( --tile-tokens \d+)? -t \d+$", res.stderr, re.M), res.stderr
    assert "keeping the batch" not in res.stderr


# ---- what would fit: every suggestion is a plan that fits (issue 44, 3 and 6) ----

def suggested_flags(stderr):
    """Each line of 'what would fit' as trainer flags {flag: value} (its
    processes as --plan-processes), skipping 'nothing at this model size'."""
    lines = stderr.split("what would fit in", 1)[1].splitlines()[1:]
    sets = []
    for line in lines:
        if not line.startswith("  "):
            break
        line = line.strip()
        if line.startswith("nothing at this model size"):
            continue
        if line.startswith("-r auto:"):
            text = re.search(r"here (-r .*?) \(\+", line).group(1)
        elif " on every layer:" in line:
            text = line.split(" on every layer:")[0]
        else:
            text = re.split(r": | \(", line)[0]
        m = re.search(r" across (\d+) processes", text)
        if m:
            text = text[:m.start()] + f" --plan-processes {m.group(1)}"
        words = text.split()
        assert len(words) % 2 == 0, line
        sets.append(dict(zip(words[::2], words[1::2])))
    return sets


def check_every_suggestion_fits(base, budget, stderr):
    """Runs the trainer's --plan-json with each suggestion over `base`
    ({flag: value}): the plan, device and host memory together (the CPU's
    one memory), fits `budget`; the batch and length it keeps are base's or
    less, and -d keeps the tokens per step. Returns the suggestions."""
    sets = suggested_flags(stderr)
    assert sets, stderr
    for flags in sets:
        run_flags = {**base, **flags}
        if run_flags.get("--context-parallel", "1") != "1" or "--plan-processes" in flags:
            run_flags.setdefault("--plan-processes", base.get("--plan-processes", "1"))
        args = [a for kv in run_flags.items() for a in kv]
        d = plan_json(*args)
        assert d["total_bytes"] + d["host_total_bytes"] <= budget, (flags, d["total_bytes"], budget, stderr)
        assert int(run_flags["-t"]) <= int(base["-t"]) and int(run_flags["-b"]) <= int(base["-b"]), (flags, stderr)
    return sets


MODEL_8x128 = {"-e": "d6", "--layers": "8", "--heads": "4", "--channels": "128", "--max-seq-len": "4096", "--vocab-size": "256",
               "-b": "1", "-t": "4096", "-i": "x"}


@pytest.mark.parametrize("mib", [80, 70, 68.3, 60, 45])
@pytest.mark.parametrize("given", [["-r", "1", "--segment-layers", "2"], ["-r", "2"], ["-r", "auto", "--tile-tokens", "0"],
                                   ["-r", "auto"]], ids=["r1-K2", "r2", "auto-untiled", "auto"])
def test_every_suggestion_fits_when_run(given, mib):
    """8 layers of C=128 at T=4096 (the issue's segments case: -r 1
    --segment-layers 2 in 70 MiB was told -r 2:0-4, which needs 125 MiB):
    whatever the run gave, each suggested flag set, planned by the trainer,
    fits the budget."""
    budget = int(mib * 2**20)
    base = dict(MODEL_8x128)
    plan = ["--plan"] if "auto" in given else []  # a fixed -r is held to --mem-budget only when it would run
    res = run([binary("train_gpt_cpu"), *[a for kv in base.items() for a in kv], *given, "--mem-budget", budget, *plan])
    if res.returncode == 0:
        return  # -r auto found a plan: nothing to suggest
    assert res.returncode == 1 and "what would fit in" in res.stderr, res.stderr
    check_every_suggestion_fits(base, budget, res.stderr)


@pytest.mark.skipif(not (BUILD / ".mpi-cpu-on").exists(), reason="train_gpt_cpu built without MPI: its advice names no other process "
                    "counts (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)")
@pytest.mark.parametrize("mib", [30, 20, 12, 9])
def test_every_suggestion_fits_when_run_over_processes(mib):
    """4 layers at T=8192 planned over 4 processes in rings of 2: the
    suggestions with more processes, more ring members, ZeRO-1, a smaller -b
    or a shorter -t each fit when the trainer plans them over the processes
    they name."""
    budget = mib << 20
    base = {"-e": "d6", "--layers": "4", "--heads": "2", "--channels": "64", "--max-seq-len": "8192", "--vocab-size": "64", "-b": "2",
            "-t": "8192", "-i": "x", "--plan-processes": "4", "--context-parallel": "2"}
    res = run([binary("train_gpt_cpu"), *[a for kv in base.items() for a in kv], "-r", "auto", "--mem-budget", budget, "--plan"])
    assert res.returncode == 1 and "what would fit in" in res.stderr, res.stderr
    sets = check_every_suggestion_fits(base, budget, res.stderr)
    assert any("--context-parallel" in f for f in sets), res.stderr  # the ring grows before the sequence has to shrink alone


def test_segments_advice_names_the_plan_that_fits():
    """The issue's case: -r 1 --segment-layers 2 in 70 MiB: -r 1 with
    segments and a tile fits at -t 4096 and is offered, not a per-layer mix
    that ignores the segments; -r auto itself finds it."""
    budget = 70 << 20
    args = [binary("train_gpt_cpu"), *[a for kv in MODEL_8x128.items() for a in kv], "--mem-budget", budget]
    res = run([*args, "-r", "1", "--segment-layers", "2"])
    assert res.returncode == 1
    sets = check_every_suggestion_fits(MODEL_8x128, budget, res.stderr)
    assert any(f.get("--segment-layers", "1") != "1" and "--tile-tokens" in f and "-t" not in f for f in sets), res.stderr
    res = run([*args, "-r", "auto", "--plan"])
    assert res.returncode == 0, res.stderr
    assert re.search(r"^recompute auto: fits .* --segment-layers \d+ --tile-tokens \d+;", res.stdout, re.M), res.stdout


def test_auto_searches_tiles_below_64():
    """At 68.3 MiB the 8x128 model fits -r 1 --segment-layers 2 only with a
    tile below 64 rows (64: 68.5 MiB): -r auto finds one, and its least plan
    when nothing fits is at the smallest tile, one row."""
    args = [binary("train_gpt_cpu"), *[a for kv in MODEL_8x128.items() for a in kv], "-r", "auto"]
    tile64 = plan_json(*[a for kv in MODEL_8x128.items() for a in kv], "-r", "1", "--segment-layers", "2", "--tile-tokens", "64")
    budget = tile64["total_bytes"] - 1
    res = run([*args, "--mem-budget", budget, "--plan-json"])
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert 0 < d["tile_tokens"] < 64 and d["total_bytes"] <= budget, d["tile_tokens"]
    res = run([*args, "--mem-budget", 40 << 20, "--plan"])
    assert res.returncode == 1
    assert re.search(r"^-r auto: even full recompute on every layer --tile-tokens 1( --segment-layers \d+)? \(", res.stderr, re.M), res.stderr


def test_context_parallel_advice_adds_ring_members_before_cutting_t():
    """--context-parallel 4 on 8 processes where nothing fits at T = 8192
    but 8 ring members with ZeRO-1 do: that is offered, with -d keeping the
    tokens per step, and no shorter -t or smaller -b."""
    model = {"-e": "d6", "--layers": "4", "--heads": "4", "--channels": "256", "--max-seq-len": "8192", "--vocab-size": "256",
             "-b": "1", "-t": "8192", "-i": "x", "--plan-processes": "8", "--context-parallel": "4"}
    flat = [a for kv in model.items() for a in kv]
    cp8 = plan_json(*flat[:-2], "--context-parallel", "8", "-r", "1", "-z", "1", "--tile-tokens", "1", "--segment-layers", "2")
    cp4 = min(plan_json(*flat, "-r", "1", "-z", "1", "--tile-tokens", t, "--segment-layers", K)["total_bytes"] for t in (0, 1) for K in (1, 2, 4))
    assert cp8["total_bytes"] < cp4
    budget = (cp8["total_bytes"] + cp4) // 2
    res = run([binary("train_gpt_cpu"), *flat, "-r", "auto", "--mem-budget", budget, "--plan"])
    assert res.returncode == 1
    sets = check_every_suggestion_fits(model, budget, res.stderr)
    assert any(f.get("--context-parallel") == "8" and f.get("-d") == "16384" for f in sets), res.stderr
    assert not re.search(r" -t \d+| -b \d+", res.stderr), res.stderr


def test_keep_attention_costs_a_small_fraction_of_full_recompute_at_long_T():
    """GPT-2 124M at T=32768 on the H100 defaults: attention dominates the
    step, so rerunning it (-r 1) costs far more than the matmuls -r 3 reruns."""
    d = plan_json("-e", "d12", "--max-seq-len", "32768", "-b", 1, "-t", 32768, "--cost-model", "h100")
    extra = {m["recompute"]: m["predicted_extra_time_fraction"] for m in d["modes"]}
    assert extra["0"] == 0 and 0 < extra["2"] < extra["3"] < extra["1"]
    assert extra["3"] < 0.25 * extra["1"]
    assert d["cost_model"]["name"] == "h100"


def test_mixes_on_the_command_line():
    flags, s = SHAPES["d12"]
    d = plan_json(*flags, "-b", 1, "-t", 512, "-r", "1:0,2/3:3-6/2:7,9-11")
    modes = [1, 0, 1, 3, 3, 3, 3, 2, 0, 2, 2, 2]
    assert d["layer_modes"] == modes and d["recompute"] == "1:0,2/2:7,9-11/3:3-6"
    assert d["total_bytes"] == independent_total(s, 1, 512, modes)
    assert plan_json(*flags, "-b", 1, "-t", 512, "-r", "3:all")["layer_modes"] == [3] * 12
    assert plan_json(*flags, "-b", 1, "-t", 512, "-r", "3", "--recompute-layers", "every:3")["layer_modes"] == \
        [3 if l % 3 == 0 else 0 for l in range(12)]


@pytest.mark.parametrize("budget,needle", [("12XB", "unknown unit"), ("-5", "not a positive size"),
                                           ("GiB", "not a positive size"), ("1e400", "not a positive size")])
def test_malformed_budget(budget, needle):
    res = run([binary("train_gpt_cpu"), "-e", "d12", "--plan", "--mem-budget", budget])
    assert res.returncode == 1 and needle in res.stderr and "--mem-budget" in res.stderr


def test_impossible_configuration_is_refused():
    res = run([binary("train_gpt_cpu"), "-e", "d12", "-t", "2048", "--plan"])
    assert res.returncode == 1 and "exceeds the model's maximum 1024" in res.stderr


def test_plan_table_is_readable():
    res = run([binary("train_gpt_cpu"), "-e", "d12", "-b", "4", "-t", "1024", "--plan", "--mem-budget", "80GiB"],
              check=True)
    for needle in ["parameters", "gradients", "optimizer state", "activations", "scratch", "total",
                   "activations by tensor", "fch_gelu", "logits_chunk", "max -b", "max -t", "-r 1"]:
        assert needle in res.stdout


def test_allocation_failure_prints_the_plan_and_what_fits(synthetic):
    """An address-space limit makes the arena allocation fail: the trainer
    prints the plan, the memory it found, and flags that fit, then exits 1."""
    import resource
    import subprocess

    out, meta = synthetic
    limit = 3 << 30

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    res = subprocess.run([str(binary("train_gpt_cpu")), "-e", "d12", "-b", "4", "-t", "1024", "--vocab-size",
                          str(meta["vocab_size"]), "-i", str(out / "synthetic_train.bin"), "-j", "", "-x", "1", "-s", "0"],
                         capture_output=True, text=True, preexec_fn=cap, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 1, res.stderr
    assert "out of memory on the host: the plan needs" in res.stderr
    assert "what would fit in" in res.stderr and "-r auto" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: out of host memory")


def write_fake_cgroup(root, version, limit, usage, inactive):
    """A cgroup file system with one memory limit, v2 (memory.max) or v1
    (memory/memory.limit_in_bytes), read through REMAT_TEST_CGROUP_ROOT."""
    if version == "v2":
        (root / "memory.max").write_text(f"{limit}\n")
        (root / "memory.current").write_text(f"{usage}\n")
        (root / "memory.stat").write_text(f"anon 1000\nfile 5000\ninactive_file {inactive}\nactive_file 10\n")
    else:
        d = root / "memory"
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"cache 5000\ninactive_file 7\ntotal_inactive_file {inactive}\n")


# The host budget keeps this much for the program beyond the plan (started
# alone: no mpirun, whose share is more; the MPI library's 2 MiB in a build
# with MPI; llmc/plan/budget.h).
PROGRAM_BYTES = (6 if (BUILD / ".mpi-cpu-on").exists() else 4) << 20


def host_mem_available():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo")


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_host_budget_honours_a_cgroup_limit(tmp_path, version):
    """A job in a 512 MiB container is told what fits in 512 MiB, less what it
    uses (page cache that can be dropped not counted), not what the host has."""
    limit, usage, inactive = 512 << 20, 100 << 20, 30 << 20
    write_fake_cgroup(tmp_path, version, limit, usage, inactive)
    room = limit - (usage - inactive)
    assert host_mem_available() > room  # else the host, not the cgroup, is the bound here
    env = {"REMAT_TEST_CGROUP_ROOT": str(tmp_path)}
    budget = room - PROGRAM_BYTES
    d = json.loads(run([binary("train_gpt_cpu"), "-e", "d12", "--plan-json"], env=env, check=True).stdout)
    assert d["budget_bytes"] == budget
    text = run([binary("train_gpt_cpu"), "-e", "d12", "--plan"], env=env, check=True).stdout
    mib = PROGRAM_BYTES >> 20
    assert f"fit in {budget / 2**20:.1f} MiB (cgroup memory limit less its usage less {mib} MiB for the program)" in text
    res = run([binary("train_gpt_cpu"), "-e", "d12", "-r", "auto", "--plan"], env=env)
    assert res.returncode == 1 and f"does not fit {budget / 2**20:.1f} MiB (cgroup memory limit less its usage less {mib} MiB for the " \
        "program)" in res.stderr


def test_host_budget_without_a_cgroup_limit(tmp_path):
    """memory.max 'max': no limit, the budget is the host's available memory."""
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123456\n")
    res = run([binary("train_gpt_cpu"), "-e", "d12", "--plan"], env={"REMAT_TEST_CGROUP_ROOT": str(tmp_path)}, check=True)
    assert f"(available host memory less 1024 MiB for the OS less {PROGRAM_BYTES >> 20} MiB for the program)" in res.stdout


def test_explicit_budget_says_it_keeps_no_headroom():
    res = run([binary("train_gpt_cpu"), "-e", "d12", "--plan", "--mem-budget", "79GiB"], check=True)
    assert "fit in 80896.0 MiB (--mem-budget, as given: no headroom kept" in res.stdout

