"""Refusals and messages (issue 33): sizes printed in a unit that shows
them, sizes that are not sizes refused, limits named with their reason,
suggestions that the run would accept, and flags that would do nothing
refused as docs/run-safety.md promises."""
import re

import numpy as np
import pytest

from conftest import BUILD, ONE_THREAD, TINY_MODEL, binary, datafile, one_error, run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("refusals")
    datafile.write_shard(d / "train.bin", np.random.default_rng(34).integers(0, 64, 20000))
    return d


def cpu(data, *flags, model=TINY_MODEL):
    return run([binary("train_gpt_cpu"), *model, "-i", data / "train.bin", "-j", "", "-s", "0", *flags], env=ONE_THREAD)


# ---- sizes (finding 9) ----

@pytest.mark.parametrize("flag", ["--host-mem-budget", "--mem-budget"])
@pytest.mark.parametrize("value", ["0x10", "0X1p20", "  0x400MiB"])
def test_hexadecimal_sizes_are_refused(data, flag, value):
    line = one_error(cpu(data, "-b", "2", "-t", "8", "-x", "1", "-r", "1", "--offload-checkpoints", flag, value))
    assert line.startswith(f"error: flag {flag}: '{value}' is not a positive size like 80GiB"), line


def test_a_small_host_pool_is_printed_in_a_unit_that_shows_it(data):
    line = one_error(cpu(data, "-b", "2", "-t", "8", "-x", "1", "-r", "1", "--offload-checkpoints", "--host-mem-budget", "300"))
    assert "0.0 MiB" not in line, line
    m = re.search(r"the host pool needs ([0-9.]+) KiB, more than 300 bytes", line)
    assert m and float(m.group(1)) > 0.3, line


def test_host_budget_lines_print_small_sizes_in_a_unit_that_shows_them(data):
    """--plan's host memory line and -r auto's, with a 300-byte host budget:
    not '0.0 MiB of 0.0 MiB'."""
    plan = cpu(data, "-b", "2", "-t", "8", "-r", "1o:all", "--host-mem-budget", "300", "--plan")
    assert re.search(r"^host memory for offloaded checkpoints: [0-9.]+ KiB of 300 bytes \(--host-mem-budget\): does not fit$",
                     plan.stdout, re.M), plan.stdout
    auto = cpu(data, "-b", "2", "-t", "8", "-x", "1", "-r", "auto", "--offload-checkpoints", "--host-mem-budget", "300")
    assert auto.returncode == 0, auto.stderr
    assert re.search(r"^recompute auto: host memory 0 bytes of 300 bytes \(--host-mem-budget\)", auto.stdout, re.M), auto.stdout


def test_a_plan_just_over_the_budget_prints_sizes_that_differ(data):
    """A --mem-budget one byte below the plan: 'needs N bytes, more than
    N-1 bytes', not the same MiB twice."""
    import json
    plan = cpu(data, "-b", "2", "-t", "8", "-r", "0", "--plan-json")
    total = json.loads(plan.stdout)["total_bytes"]
    res = cpu(data, "-b", "2", "-t", "8", "-x", "1", "-r", "0", "--mem-budget", str(total - 1))
    first = res.stderr.strip().splitlines()[0]
    assert res.returncode == 1 and first == f"the plan of -r 0 needs {total} bytes, more than --mem-budget {total - 1} bytes", res.stderr


# ---- limits with their reason (finding 10) ----

def test_too_many_tokens_per_micro_step_names_the_limit(data):
    model = [*TINY_MODEL[:-2], "--max-seq-len", "4096"]
    line = one_error(cpu(data, "-b", "1048576", "-t", "4096", "-x", "1", "--plan", model=model))
    assert "4294967296 tokens per micro-step" in line and "2^31-1 = 2147483647" in line, line


@pytest.mark.parametrize("value", ["2147483648", "99999999999"])
def test_tile_tokens_past_the_limit_names_the_limit(data, value):
    line = one_error(cpu(data, "-b", "2", "-t", "8", "-x", "1", "--tile-tokens", value))
    assert f"--tile-tokens: {value} is more than 2^31-1 = 2147483647" in line, line


# ---- suggestions the run accepts (finding 8) ----

def test_context_parallel_suggests_lengths_the_model_takes(data):
    """-t 30 under N = 2 with --max-seq-len 32: 28 works, 32 too; -t 29
    with --max-seq-len 30: 28 alone; -t 131071 exceeds the model, which the
    refusal says instead of suggesting 131072."""
    model = [*TINY_MODEL[:-2], "--max-seq-len", "32"]
    line = one_error(cpu(data, "-b", "2", "-t", "30", "--context-parallel", "2", "--plan", "--plan-processes", "2", model=model))
    assert "-t 28 or 32 work" in line, line
    line = one_error(cpu(data, "-b", "2", "-t", "29", "--max-seq-len", "30", "--context-parallel", "2", "--plan", "--plan-processes", "2",
                         model=TINY_MODEL[:-2]))
    assert "-t 28 works" in line and "32" not in line, line
    line = one_error(cpu(data, "-b", "2", "-t", "131071", "--context-parallel", "2", "--plan", "--plan-processes", "2", model=model))
    assert "131072" not in line and "exceeds the model's maximum 32" in line, line


def test_suggested_lengths_under_context_parallelism_are_multiples_of_2n(data):
    model = ["-e", "d6", "--layers", "2", "--channels", "64", "--heads", "2", "--vocab-size", "64", "--max-seq-len", "8192"]
    for budget in ["12MiB", "20MiB"]:
        res = cpu(data, "-b", "1", "-t", "8192", "-r", "auto", "--mem-budget", budget, "--plan", "--plan-processes", "2",
                  "--context-parallel", "2", model=model)
        assert res.returncode == 1
        ts = [int(t) for t in re.findall(r"-t (\d+)", res.stderr)]
        assert ts and all(t % 4 == 0 and t <= 8192 for t in ts), res.stderr


@pytest.mark.skipif(not (BUILD / ".mpi-cpu-on").exists(), reason="train_gpt_cpu built without MPI: its advice names no other process "
                    "counts (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)")
def test_the_least_plan_is_not_called_nothing_when_it_fits(data):
    """When only more processes fit, the suggestion says how many, not
    'nothing ... still needs' a size below the budget."""
    model = ["-e", "d6", "--layers", "2", "--channels", "64", "--heads", "2", "--vocab-size", "64", "--max-seq-len", "8192"]
    res = cpu(data, "-b", "1", "-t", "8192", "-r", "auto", "--mem-budget", "8MiB", "--plan", "--plan-processes", "2",
              "--context-parallel", "2", model=model)
    assert res.returncode == 1
    for m in re.finditer(r"still needs ([0-9.]+) (MiB|KiB)", res.stderr):
        assert float(m.group(1)) * (1 if m.group(2) == "MiB" else 1 / 1024) > 8, res.stderr
    # more processes: each on the ring of a sequence (T kept), or with a shorter -t
    assert re.search(r"^  -r \S+(?: --(?:segment-layers|tile-tokens) \d+)*(?: -b 1 -t \d+| --context-parallel \d+ -d \d+) -z 1 across \d+ "
                     r"processes", res.stderr, re.M), res.stderr


# ---- ranks that diverge name themselves and what differs (finding 11) ----

@pytest.fixture(scope="module")
def proc_timeout_exe():
    import shutil
    if shutil.which("mpirun") is None or shutil.which("mpicc") is None:
        pytest.skip("mpirun/mpicc not found (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)")
    from conftest import BUILD, REPO
    BUILD.mkdir(exist_ok=True)
    exe = BUILD / "test_proc_timeout"
    run(["mpicc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-DUSE_MPI", "-I", REPO, "-o", exe,
         REPO / "dev/test/test_proc_timeout.c", "-lm"], check=True, timeout=120)
    return exe


def test_ranks_at_different_steps_say_which_rank_is_at_which(proc_timeout_exe):
    """Two ranks in the same collective, one a step ahead (as a rank resumed
    from another step would be): each names both ranks and both steps."""
    from test_multiprocess import MPI_ENV
    res = run(["mpirun", "-np", "2", proc_timeout_exe, "steps"], env=MPI_ENV, timeout=60)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode != 0 and errors, res.stderr
    for ln in errors:
        me = int(ln[len("error: rank ")])
        other = 1 - me
        assert f"the ranks are at different steps: rank {me} at step {4 + me}, rank {other} at step {4 + other}, both in a sum" in ln, ln


# ---- cosmetics: what the run prints about itself ----

def peak_line(res):
    m = re.search(r"peak resident memory: ([0-9.]+) MiB \(plan: ([0-9.]+) MiB( with the offloaded checkpoints' host pool)?, "
                  r"and up to (\d+) MiB for the program\)", res.stdout)
    assert m, res.stdout[-800:]
    return float(m.group(1)), float(m.group(2)), m.group(3) is not None, float(m.group(4))


def test_peak_memory_of_the_quick_start_model_is_within_what_it_says(data, tmp_path):
    """The quick start's CPU model (scripts/quickstart.sh) with validation
    and sampling: the peak stays within the plan and the program's share."""
    from conftest import datafile as df
    df.write_shard(tmp_path / "t.bin", np.random.default_rng(1).integers(0, 256, 200000))
    df.write_shard(tmp_path / "v.bin", np.random.default_rng(2).integers(0, 256, 20000))
    model = ["-e", "d6", "--layers", "2", "--channels", "64", "--heads", "4", "--max-seq-len", "64", "--vocab-size", "256"]
    res = run([binary("train_gpt_cpu"), *model, "-b", "16", "-t", "64", "-x", "4", "-i", tmp_path / "t.bin", "-j", tmp_path / "v.bin",
               "-v", "2", "-m", "4", "-s", "4", "-g", "16"], env={"OMP_NUM_THREADS": "2"}, check=True)
    peak, plan, _, program = peak_line(res)
    assert plan < peak <= plan + program, res.stdout[-400:]


def test_peak_memory_line_counts_the_offload_host_pool(data):
    plain = peak_line(cpu(data, "-b", "2", "-t", "8", "-x", "2", "-r", "1"))
    off = peak_line(cpu(data, "-b", "2", "-t", "8", "-x", "2", "-r", "1", "--offload-checkpoints"))
    assert off[2] and not plain[2] and off[1] >= plain[1], (plain, off)


def test_cpu_budget_messages_do_not_mention_cuda(data):
    res = cpu(data, "-b", "2", "-t", "8", "-x", "1", "-r", "auto", "--mem-budget", "1KiB", "--plan")
    assert res.returncode == 1 and "CUDA" not in res.stderr + res.stdout, res.stderr


def test_token_tiles_under_context_parallelism_count_a_rank_rows(data):
    res = cpu(data, "-b", "2", "-t", "16", "--context-parallel", "2", "--plan", "--plan-processes", "2", "--tile-tokens", "4")
    assert res.returncode == 0, res.stderr
    assert "token tiles: 4 of the 16 rows at a time" in res.stdout, res.stdout  # B x T/N = 2 x 8 per rank


def test_help_of_d_says_groups():
    out = run([binary("train_gpt_cpu"), "--help"]).stdout
    line = next(l for l in out.splitlines() if l.strip().startswith("-d "))
    assert "B*T*groups" in line and "--context-parallel" in line, line


# ---- flags that would do nothing (cosmetic list) ----

@pytest.mark.parametrize("flags,named", [(["--host-mem-budget", "1GiB", "-r", "1"], "--host-mem-budget"),
                                         (["--host-link", "pcie4"], "--host-link"),
                                         (["--host-link", "40e9", "-r", "3"], "--host-link"),
                                         (["--ring-link", "mpi"], "--ring-link")])
def test_offload_and_ring_flags_without_their_feature_are_refused(data, flags, named):
    line = one_error(cpu(data, "-b", "2", "-t", "8", "-x", "1", *flags))
    assert line.startswith(f"error: flag {named}: applies to"), line


@pytest.mark.parametrize("flags", [["--host-mem-budget", "1GiB", "-r", "1", "--offload-checkpoints"], ["--host-link", "pcie4", "-r", "1o:0-1"],
                                   ["--host-mem-budget", "1GiB", "-r", "auto"], ["--host-link", "pcie4", "--plan"],
                                   ["--ring-link", "mpi", "--context-parallel", "2", "--plan", "--plan-processes", "2"]])
def test_offload_and_ring_flags_with_their_feature_are_taken(data, flags):
    res = cpu(data, "-b", "2", "-t", "8", "-x", "1", *flags)
    assert res.returncode == 0, res.stderr


# ---- -r auto's refusals with offloading (finding 7) ----

LONG_MODEL = ["-e", "d6", "--layers", "4", "--channels", "64", "--heads", "2", "--vocab-size", "64", "--max-seq-len", "4096"]


def plan_of(data, *flags, T=4096):
    import json
    res = cpu(data, "-b", "1", "-t", str(T), *flags, "--plan-json", model=LONG_MODEL)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    return d["total_bytes"] / 2**20, d.get("host_total_bytes", 0) / 2**20


def test_auto_refusal_with_a_host_budget_lists_the_offloaded_choice_that_fits(data):
    """-r auto without --offload-checkpoints, but with --host-mem-budget: no
    choice without offloading fits at -t 4096, one with offloading does;
    'what would fit' names it and the host memory it takes."""
    device_1, _ = plan_of(data, "-r", "1", "--tile-tokens", "64")
    device_1o, host_1o = plan_of(data, "-r", "1o:all", "--tile-tokens", "64")
    assert device_1o < device_1
    budget = f"{(device_1o + device_1) / 2:.3f}MiB"
    res = cpu(data, "-b", "1", "-t", "4096", "-r", "auto", "--segment-layers", "1", "--mem-budget", budget, "--host-mem-budget", "1GiB",
              "--plan", model=LONG_MODEL)  # segments would fit without offloading
    assert res.returncode == 1
    m = re.search(r"^  --offload-checkpoints -r auto: here -r (\S+) --tile-tokens (\d+) \(([0-9.]+) MiB, and ([0-9.]+) MiB of host "
                  r"memory of 1024\.0 MiB, --host-mem-budget\)", res.stderr, re.M)
    assert m and "o" in m.group(1) and float(m.group(4)) > 0, res.stderr
    assert "even full recompute on every layer" in res.stderr and "even -r 1o" not in res.stderr  # what it searched: no offloading
    taken = cpu(data, "-b", "1", "-t", "4096", "-r", "auto", "--segment-layers", "1", "--mem-budget", budget, "--host-mem-budget", "1GiB",
                "--plan", "--offload-checkpoints", model=LONG_MODEL)
    assert taken.returncode == 0 and f"-r {m.group(1)} --tile-tokens {m.group(2)}" in taken.stdout, taken.stdout[-2000:]


SMALLEST_TILE = "1"  # the smallest tile the trainers accept, and so the least plan's (issue 44, 5)


def test_auto_refusal_claims_the_least_plan_with_offloading_and_tiles(data):
    """Nothing fits even offloaded: the claimed minimum is -r 1o on every
    layer with the smallest tile, one row (less than -r 1's), with its host memory,
    and the shorter -t suggested is one that fits offloaded."""
    device_1o, host_1o = plan_of(data, "-r", "1o:all", "--tile-tokens", SMALLEST_TILE)
    res = cpu(data, "-b", "1", "-t", "4096", "-r", "auto", "--segment-layers", "1", "--mem-budget", f"{device_1o * 0.8:.3f}MiB",
              "--offload-checkpoints", "--host-mem-budget", "1GiB", "--plan", model=LONG_MODEL)  # segments reach as low without host memory
    assert res.returncode == 1
    assert re.search(rf"even -r 1o:all --tile-tokens 1 \({device_1o:.1f} MiB, and {host_1o:.1f} MiB of host memory\) does not fit",
                     res.stderr), res.stderr
    m = re.search(r"^  -r 1o:all --tile-tokens 1 -t (\d+) \(", res.stderr, re.M)
    assert m, res.stderr
    assert plan_of(data, "-r", "1o:all", "--tile-tokens", SMALLEST_TILE, T=int(m.group(1)))[0] <= device_1o * 0.8


def test_auto_refusal_claims_the_least_plan_over_segment_sizes(data):
    """-r auto searches segment sizes too, so the minimum it claims is -r 1
    with the smallest tile at the segment size of least memory (computed
    here from each K's plan), and a budget just above that claim fits."""
    least, k_least = min((plan_of(data, "-r", "1", "--tile-tokens", SMALLEST_TILE, "--segment-layers", str(k))[0], k) for k in range(1, 5))
    assert k_least > 1 and least < plan_of(data, "-r", "1", "--tile-tokens", SMALLEST_TILE)[0]
    res = cpu(data, "-b", "1", "-t", "4096", "-r", "auto", "--mem-budget", f"{least * 0.99:.3f}MiB", "--plan", model=LONG_MODEL)
    assert res.returncode == 1
    assert re.search(rf"even full recompute on every layer --tile-tokens 1 --segment-layers {k_least} \({least:.1f} MiB\) does not fit",
                     res.stderr), res.stderr
    fits = cpu(data, "-b", "1", "-t", "4096", "-r", "auto", "--mem-budget", f"{least + 0.1:.3f}MiB", "--plan", model=LONG_MODEL)
    assert fits.returncode == 0 and "recompute auto: fits" in fits.stdout, fits.stderr


def test_cpu_offload_pool_counts_against_the_one_memory_budget(data):
    """The CPU trainer's host pool is the plan's memory (finding 6): with
    --mem-budget alone, -r auto's suggested '-r 1o:all -t N' fits with its
    pool, and a fixed -r 1o:all whose plan fits but not with its pool is
    refused, not run past the budget."""
    device_1o, host_1o = plan_of(data, "-r", "1o:all", "--tile-tokens", SMALLEST_TILE)
    device_1, _ = plan_of(data, "-r", "1", "--tile-tokens", SMALLEST_TILE)
    assert device_1o < device_1 < device_1o + host_1o
    budget = device_1o * 0.8
    res = cpu(data, "-b", "1", "-t", "4096", "-r", "auto", "--segment-layers", "1", "--mem-budget", f"{budget:.3f}MiB",
              "--offload-checkpoints", "--plan", model=LONG_MODEL)  # segments would claim less
    assert res.returncode == 1
    # the least plan claimed: -r 1, which takes less of the one memory than -r 1o with its pool
    assert f"even full recompute on every layer --tile-tokens 1 ({device_1:.1f} MiB) does not fit" in res.stderr, res.stderr
    m = re.search(r"^  -r 1o:all --tile-tokens 1 -t (\d+) \(.*the same memory as the plan", res.stderr, re.M)
    assert m, res.stderr
    assert sum(plan_of(data, "-r", "1o:all", "--tile-tokens", SMALLEST_TILE, T=int(m.group(1)))) <= budget
    between = f"{device_1o + host_1o / 2:.3f}MiB"
    fixed = cpu(data, "-b", "1", "-t", "4096", "-r", "1o:all", "--tile-tokens", SMALLEST_TILE, "--mem-budget", between, "-x", "1", model=LONG_MODEL)
    line = fixed.stderr.strip().splitlines()[-1] if fixed.stderr.strip() else ""
    assert fixed.returncode == 1 and line.startswith("error: flag --mem-budget: the plan") and f"({device_1o + host_1o:.1f} MiB with -r 1o:all)" in line, line
