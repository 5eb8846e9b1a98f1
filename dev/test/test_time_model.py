"""The time model's calibration on the CPU reference and its GPU defaults
(llmc/plan/cost_model.h, llmc/cpu/cpu_calibrate.h). No timing is asserted: the
calibrated rates are whatever this machine measured, and the checks are that
every rate is written, that the planner reads each back, and that its
predictions follow from them by the model's formulas written out here."""
import json
import re

import pytest

from conftest import REPO, binary, run

# small enough for seconds, every op family timed (attention at T = 64)
MODEL = ["-e", "d6", "--layers", "3", "--channels", "32", "--heads", "2", "--vocab-size", "64", "--max-seq-len", "64"]
B, T, C, L, E = 2, 64, 32, 3, 4  # E: the CPU reference's fp32 bytes
CALIBRATED = re.compile(r"^cost model: step 2 \(([0-9.]+) ms\) calibrated, written to ", re.M)
# every key of a cost-model file (docs/FORMATS.md) but the ring's, which a run without context parallelism does not measure
RATES = ["matmul_flops_per_s", "attention_flops_per_s", "memory_bytes_per_s", "host_link_bytes_per_s", "tile_pass_s", "matmul_half_rows",
         "matmul_backward_flops_per_s", "attention_backward_flops_per_s", "gelu_bytes_per_s", "host_memory_bytes_per_s"]


def cost_file(path):
    return {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in path.read_text().splitlines()
                                              if line.strip() and not line.startswith("#"))}


def predicted(*args, exe="train_gpt_cpu"):
    res = run([binary(exe) if exe == "train_gpt_cpu" else exe, *map(str, args), "--plan-json"])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def calibrated(tiny_shards, tmp_path_factory):
    """A -r 0 run whose step 2 calibrates a cost model: (file, rates, step ms)."""
    cm = tmp_path_factory.mktemp("calibration") / "cpu.cost"
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", B, "-t", T, "-s", "0", "-x", "3",
               "-r", "0"], env={"REMAT_PROFILE": "2", "REMAT_PROFILE_COST_MODEL": str(cm)}, check=True)
    line = CALIBRATED.search(res.stdout)
    assert line, res.stdout
    return cm, cost_file(cm), float(line.group(1))


def test_calibration_writes_every_rate_and_the_plan_reads_them(calibrated):
    """Every rate is in the file, positive, and the plan's cost model is the
    file's; the step it was measured on is predicted as measured (the
    memory-bound rate takes what the timed families leave of it), so a
    rate the planner dropped (backward matmuls at the forward's rate, say)
    would show."""
    cm, rates, step_ms = calibrated
    assert sorted(k for k in rates if k != "name") == sorted(RATES)
    assert all(float(rates[k]) > 0 for k in RATES)
    assert rates["name"].endswith("calibrated at B=2 T=64")
    d = predicted(*MODEL, "-b", B, "-t", T, "-r", "0", "--cost-model", cm)
    for k in RATES:
        assert d["cost_model"][k] == float(rates[k]), k
    assert 1e3 * d["predicted_step_seconds"] == pytest.approx(step_ms, abs=0.051)  # printed to 0.1 ms
    assert predicted(*MODEL, "-b", B, "-t", T, "-r", "0")["predicted_step_seconds"] != d["predicted_step_seconds"]


@pytest.mark.parametrize("mode", ["0", "1", "2"])
def test_every_call_of_a_family_is_timed(tiny_shards, tmp_path, mode):
    """The profiled step times each call the model prices, counted here from
    the block's structure (docs/DESIGN.md): per layer 4 forward matmuls, 8
    backward (input and weight of each), attention forward and backward,
    GELU forward and backward; the classifier's one chunk (B T = 128 rows)
    1 forward, 2 backward; -r 1 runs each layer's forward again up to the
    GELU (3 matmuls, attention, GELU), -r 2 the GELU. A call left untimed
    (GELU's backward, say) would move its time into the memory rate unseen."""
    res = run([binary("train_gpt_cpu"), *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", B, "-t", T, "-s", "0", "-x", "2",
               "-r", mode], env={"REMAT_PROFILE": "2", "REMAT_PROFILE_COST_MODEL": str(tmp_path / "cpu.cost")}, check=True)
    again = {"0": (0, 0, 0), "1": (3, 1, 1), "2": (0, 0, 1)}[mode]  # matmuls, attention, GELU in the backward's forward again
    want = (4 * L + 1 + again[0] * L, 8 * L + 2, L + again[1] * L, L, 2 * L + again[2] * L)
    m = re.search(r"^cost model: step 2 timed (\d+) forward and (\d+) backward matmuls, (\d+) forward and (\d+) backward attention calls, "
                  r"(\d+) GELU calls$", res.stdout, re.M)
    assert m and tuple(map(int, m.groups())) == want, res.stdout[-1500:]


def test_calibrated_recompute_costs_follow_the_formulas(calibrated):
    """Extra time over -r 0 per mode at the file's rates, written out:
    -r 2 applies two LayerNorms (4 N C E bytes at the memory rate) and GELU
    (8 N C E at GELU's); -r 3 adds the forward matmuls up to GELU (16 N C^2
    at the forward matmul rate) and LN1, LN2 from scratch (the same bytes);
    -r 1 adds attention's forward (4 C per causal pair, at its forward rate)."""
    cm, rates, _ = calibrated
    r = {k: float(rates[k]) for k in RATES}
    N = B * T
    elementwise = 4 * N * C * E / r["memory_bytes_per_s"] + 8 * N * C * E / r["gelu_bytes_per_s"]
    want = {"2": L * elementwise, "3": L * (elementwise + 16 * N * C * C / r["matmul_flops_per_s"])}
    want["1"] = want["3"] + L * 4 * B * T * (T + 1) / 2 * C / r["attention_flops_per_s"]
    base = predicted(*MODEL, "-b", B, "-t", T, "-r", "0", "--cost-model", cm)["predicted_step_seconds"]
    for mode, extra in want.items():
        got = predicted(*MODEL, "-b", B, "-t", T, "-r", mode, "--cost-model", cm)["predicted_step_seconds"] - base
        assert got == pytest.approx(extra, rel=1e-6), mode


def test_offloaded_copies_are_not_hidden_on_the_cpu(calibrated):
    """The CPU reference copies in line (memcpy): an offloaded -r 1 layer adds
    its input's copy out and back at the host link's rate, all of it."""
    cm, rates, _ = calibrated
    base = predicted(*MODEL, "-b", B, "-t", T, "-r", "1", "--cost-model", cm)["predicted_step_seconds"]
    off = predicted(*MODEL, "-b", B, "-t", T, "-r", "1", "--offload-checkpoints", "--cost-model", cm)["predicted_step_seconds"]
    assert off - base == pytest.approx(L * 2 * B * T * C * E / float(rates["host_link_bytes_per_s"]), rel=1e-3)  # %.9g of a step


GPU_PLAN = REPO / "build" / "train_gpt_bf16"


@pytest.mark.parametrize("shape,flags,family", [
    (["--channels", "768", "--heads", "12"], [], "mma_hs64"),
    (["--channels", "768", "--heads", "6"], [], "mma_hs128"),
    (["--channels", "768", "--heads", "24"], [], "tc"),  # head size 32: no mma kernel
    (["--channels", "768", "--heads", "12"], ["--reset-attention-mask"], "mma_hs64"),  # the mma kernels mask documents too
])
@pytest.mark.parametrize("card", ["a100", "h100", "h200"])
def test_gpu_attention_default_per_family_and_head_size(shape, flags, family, card):
    """The BF16 trainer's default attention rate is its card's for the kernel
    family it runs at the model's head size, and no mma figure exceeds
    FlashAttention-2's published ceiling on an H100 (FA3 paper, figures 5
    and 6: 293 TFLOP/s at head size 64, 326 at 128, forward with 2.5x
    backward)."""
    if not GPU_PLAN.exists():
        pytest.skip(f"{GPU_PLAN} not built (make build/train_gpt_bf16 needs nvcc, not a GPU)")
    want = {"a100": {"mma_hs64": 1.2e14, "mma_hs128": 1.35e14, "tc": 6.0e13},
            "h100": {"mma_hs64": 2.5e14, "mma_hs128": 2.8e14, "tc": 1.25e14}}
    want["h200"] = want["h100"]
    assert want["h100"]["mma_hs64"] < 2.93e14 and want["h100"]["mma_hs128"] < 3.26e14
    d = predicted("-e", "d12", *shape, "--layers", "2", "-b", "1", "-t", "1024", *flags, "--cost-model", card, "--mem-budget", "80GiB",
                  exe=str(GPU_PLAN))
    assert d["cost_model"]["attention_flops_per_s"] == want[card][family]


@pytest.mark.parametrize("preset,family", [("llama3.1-8b", "mma_hs128"), ("llama3.2-3b", "mma_hs128"), ("llama3.2-1b", "mma_hs64"),
                                           ("smollm2-135m", "mma_hs64")])
def test_gpu_attention_default_for_grouped_query_attention(preset, family):
    """The Llama presets' grouped-query attention (32/8, 24/8, 32/8, 9/3 query/K-V heads) takes the mma family's
    rate at its head size on an H200, no higher than for NH K/V heads: its FLOPs count the query heads, and
    FlashAttention-2's ceiling (326 TFLOP/s at 128, 293 at 64, FA3 paper) bounds both."""
    if not GPU_PLAN.exists():
        pytest.skip(f"{GPU_PLAN} not built (make build/train_gpt_bf16 needs nvcc, not a GPU)")
    want = {"mma_hs64": 2.5e14, "mma_hs128": 2.8e14}[family]
    assert want < {"mma_hs64": 2.93e14, "mma_hs128": 3.26e14}[family]
    d = predicted("-e", preset, "--layers", "2", "-b", "1", "-t", "1024", "--cost-model", "h200", "--mem-budget", "80GiB", exe=str(GPU_PLAN))
    assert d["cost_model"]["attention_flops_per_s"] == want


def test_profile_clock(tiny_shards, tmp_path):
    """REMAT_PROFILE_CLOCK=cpu calibrates in CPU time on one thread (the
    file says so); with two threads, or a clock it does not know, the run
    stops with one line before training."""
    cm = tmp_path / "cpu.cost"
    args = [binary("train_gpt_cpu"), *MODEL, "-i", tiny_shards / "tiny_train.bin", "-j", "", "-b", B, "-t", T, "-s", "0", "-x", "2"]
    env = {"REMAT_PROFILE": "2", "REMAT_PROFILE_COST_MODEL": str(cm)}
    run(args, env={**env, "REMAT_PROFILE_CLOCK": "cpu", "OMP_NUM_THREADS": "1"}, check=True)
    assert cost_file(cm)["name"] == "train_gpt_cpu, 1 thread (CPU time), calibrated at B=2 T=64"
    for clock, threads, message in [("cpu", "2", "error: REMAT_PROFILE_CLOCK=cpu times one thread's CPU time: run with OMP_NUM_THREADS=1, not 2 threads"),
                                    ("gpu", "1", "error: REMAT_PROFILE_CLOCK: 'gpu' is neither wall nor cpu")]:
        res = run(args, env={**env, "REMAT_PROFILE_CLOCK": clock, "OMP_NUM_THREADS": threads})
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 1 and lines == [message] and "step " not in res.stdout, (res.stdout[-500:], res.stderr)
