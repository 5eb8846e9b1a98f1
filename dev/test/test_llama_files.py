"""Model files of the configurable family (versions 7 and 8, docs/FORMATS.md): the
trainer reads a numpy-written version-7 file and writes it back with the same
header slots and, after a step of learning rate 0, the same payload; version 8
(bf16) loads as the same values; every switch slot with a bad value is refused
with one line naming the slot. The presets plan without weights."""
import json
import re

import numpy as np
import pytest

from conftest import binary, datafile, run
from test_llama_reference import CASES, ROPE_TYPES, V, header, random_params, write_model


def one_step(tmp_path, model, *extra):
    return run([binary("train_gpt_cpu"), "-e", model, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "16",
                "-x", "1", "-s", "0", *extra])


@pytest.fixture
def tokens(tmp_path):
    datafile.write_shard(tmp_path / "t.bin", np.random.default_rng(1).integers(0, V, 2 * 16 + 1))


@pytest.mark.parametrize("name", ["llama3-untied", "qwen2-linear-tied", "yarn-attention-factor"])
def test_version7_round_trip(tmp_path, tokens, name):
    cfg = CASES[name]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 3))
    res = one_step(tmp_path, tmp_path / "m.bin", "-l", "0", "-o", tmp_path / "ck")
    assert res.returncode == 0, res.stderr
    assert "(version 7)" in res.stdout
    a, b = (tmp_path / "m.bin").read_bytes(), (tmp_path / "ck" / "model_00000001.bin").read_bytes()
    ha, hb = np.frombuffer(a[:1024], np.int32), np.frombuffer(b[:1024], np.int32)
    assert list(ha[:240]) == list(hb[:240])  # slots 240-244: the run id
    assert a[1024:] == b[1024:]


def test_version8_loads_as_its_values(tmp_path, tokens):
    cfg = CASES["llama3-tied"]
    write_model(tmp_path / "m7.bin", cfg, random_params(cfg, 4))
    raw = (tmp_path / "m7.bin").read_bytes()
    bits = np.frombuffer(raw[1024:], np.float32).view(np.uint32).astype(np.uint64)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    h = header(cfg)
    h[1] = 8
    (tmp_path / "m8.bin").write_bytes(h.tobytes() + bf16.tobytes())
    h[1] = 7
    (tmp_path / "m7w.bin").write_bytes(h.tobytes() + (bf16.astype(np.uint32) << 16).view(np.float32).tobytes())
    losses = []
    for name in ["m8.bin", "m7w.bin"]:
        res = one_step(tmp_path, tmp_path / name)
        assert res.returncode == 0, res.stderr
        losses.append(re.search(r"^step +1/\d+ \| loss ([0-9.]+)", res.stdout, re.M).group(1))
    assert losses[0] == losses[1]


F32 = lambda v: int(np.array([v], np.float32).view(np.int32)[0])
BAD_SLOTS = [  # (slot, value, words of the message)
    (8, 0, "family"), (8, 4, "family"), (9, 3, "K/V heads"), (9, 0, "K/V heads"), (10, 7, "head size"),
    (11, 0, "MLP width"), (12, 2, "norm"), (13, F32(float("nan")), "not a finite number"), (13, F32(0.0), "norm epsilon"),
    (14, 2, "positions"), (15, F32(0.5), "theta"), (16, 4, "RoPE scaling"), (22, 2, "MLP"), (23, 16, "bias mask"),
    (24, 2, "head"), (25, V, "bos token"), (26, -2, "eos token"), (27, -1, "max_position_embeddings"), (100, 1, "unused"),
]


@pytest.mark.parametrize("slot,value,words", BAD_SLOTS)
def test_bad_switch_slot_refused_naming_it(tmp_path, tokens, slot, value, words):
    cfg = CASES["llama-default-untied"]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 5))
    raw = bytearray((tmp_path / "m.bin").read_bytes())
    raw[4 * slot:4 * slot + 4] = np.array([value], np.int32).tobytes()
    (tmp_path / "bad.bin").write_bytes(bytes(raw))
    res = one_step(tmp_path, tmp_path / "bad.bin")
    assert res.returncode != 0
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert f"header slot {slot}" in err and words in err, err


@pytest.mark.parametrize("slot,value,words", [(18, F32(4.0), "high_freq_factor"), (17, F32(0.5), "factor"),
                                              (20, 0, "original_max_position_embeddings")])
def test_bad_llama3_slots_refused(tmp_path, tokens, slot, value, words):
    cfg = CASES["llama3-tied"]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 6))
    raw = bytearray((tmp_path / "m.bin").read_bytes())
    raw[4 * slot:4 * slot + 4] = np.array([value], np.int32).tobytes()
    (tmp_path / "bad.bin").write_bytes(bytes(raw))
    res = one_step(tmp_path, tmp_path / "bad.bin")
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1
    assert f"header slot" in res.stderr and words in res.stderr, res.stderr


def test_truncated_version7_refused(tmp_path, tokens):
    cfg = CASES["qwen2-default-untied"]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 7))
    raw = (tmp_path / "m.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(raw[:-4])
    res = one_step(tmp_path, tmp_path / "short.bin")
    assert res.returncode != 0 and "does not match its header" in res.stderr


# Parameter counts of the Hugging Face models (their model cards), from the plan's fp32 parameter bytes.
PRESETS = {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
           "qwen2.5-7b": 7_615_616_512, "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824,
           "llama3.1-8b": 8_030_261_248}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_plans_with_the_models_parameter_count(preset):
    res = run([binary("train_gpt_cpu"), "-e", preset, "-b", "1", "-t", "256", "--plan-json"], check=True)
    assert json.loads(res.stdout)["config"]["num_parameters"] == PRESETS[preset]


def test_gpu_trainer_refuses_query_heads_narrower_than_c(tmp_path, tokens):
    """The GPU's block is tested with NH x HD = C only: a Llama file whose query heads span less than C must be
    refused in one line, not computed on (the refusal comes before any device work, so the emulated build shows it
    too). Grouped-query attention (NKV < NH) runs: test_llama_gpu_emu.py, test_emu.py's _kv cases."""
    from conftest import gpu_trainer
    exe = gpu_trainer()
    cfg = CASES["llama-NH*HD>C"]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 5))
    res = run([exe, "-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "16", "-x", "1", "-s", "0"])
    assert res.returncode != 0 and "the GPU's attention needs NH x HD = C" in res.stderr, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("flag,rope,extra", [("linear:4", "linear", {}), ("llama3:8", "llama3", dict(low=1.0, high=4.0)),
                                             ("yarn:4", "yarn", dict(low=32.0, high=1.0))])
def test_rope_scaling_extends_context(tmp_path, flag, rope, extra):
    """--rope-scaling TYPE:FACTOR with a longer --max-seq-len: the run computes the scaled RoPE (its first
    loss is numpy's with that scaling, the original length the file's 64) and writes it into its model files."""
    from test_llama_reference import B, MAXT, T, reference_loss
    cfg = CASES["llama-default-untied"]
    p = random_params(cfg, 9)
    write_model(tmp_path / "m.bin", cfg, p)
    tokens = np.random.default_rng(2).integers(0, V, B * T + 1)
    datafile.write_shard(tmp_path / "t.bin", tokens)
    res = run([binary("train_gpt_cpu"), "-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-b", str(B), "-t", str(T),
               "-x", "1", "-s", "0", "-l", "0", "--max-seq-len", "256", "--rope-scaling", flag, "-o", tmp_path / "ck"], check=True)
    scaled = dict(cfg, rope=rope, factor=float(flag.split(":")[1]), original=MAXT, **extra)
    inputs, targets = tokens[:B * T].reshape(B, T), tokens[1:B * T + 1].reshape(B, T)
    expected = reference_loss(scaled, p, inputs, targets, np.tile(np.arange(T), (B, 1)))
    loss = float(re.search(r"^step +1/\d+ \| loss ([0-9.]+)", res.stdout, re.M).group(1))
    assert abs(loss - expected) < 1e-5 * expected, (loss, expected)
    assert abs(reference_loss(cfg, p, inputs, targets, np.tile(np.arange(T), (B, 1))) - expected) > 1e-4 * expected
    h = np.frombuffer((tmp_path / "ck" / "model_00000001.bin").read_bytes()[:1024], np.int32)
    f = h.view(np.float32)
    assert h[2] == 256 and h[16] == ROPE_TYPES[rope] and f[17] == scaled["factor"] and h[20] == MAXT and h[27] == 256


@pytest.mark.parametrize("args,words", [(["--rope-scaling", "linear:4"], "lengthens"),
                                        (["--max-seq-len", "128", "--rope-scaling", "ntk:4"], "not linear, llama3 or yarn"),
                                        (["--max-seq-len", "128", "--rope-scaling", "linear:0.5"], "factor")])
def test_rope_scaling_refusals(tmp_path, tokens, args, words):
    cfg = CASES["llama-default-untied"]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 9))
    res = one_step(tmp_path, tmp_path / "m.bin", *args)
    assert res.returncode != 0 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_rope_scaling_over_a_scaling_refused(tmp_path, tokens):
    cfg = CASES["llama3-tied"]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 9))
    res = one_step(tmp_path, tmp_path / "m.bin", "--max-seq-len", "128", "--rope-scaling", "yarn:2")
    assert res.returncode != 0 and "already has llama3" in res.stderr, res.stderr


# A small random-init model of the configurable family from the command line: SmolLM2's switches (RMSNorm,
# RoPE theta 1e5, 3 query heads on 3 K/V heads of 64, SwiGLU 1536, tied) at 2 layers of C 48.
SMALL = ["-e", "smollm2-135m", "--layers", "2", "--heads", "3", "--channels", "48", "--vocab-size", "64", "--max-seq-len", "64"]


def small_run(tmp_path, out, *flags):
    return run([binary("train_gpt_cpu"), *SMALL, "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "16", "-s", "0",
                "-l", "1e-3", "-o", tmp_path / out, *flags], check=True)


def payload(path):
    return path.read_bytes()[1024:]


@pytest.mark.parametrize("flags", [["-r", "1"], ["-r", "2"], ["-r", "3"], ["-r", "1o:all", "--tile-tokens", "5"],
                                   ["-r", "2", "--segment-layers", "2", "--dropout", "0.1"], ["-r", "3:0/1:1", "--tile-tokens", "7"]])
def test_cli_modes_write_the_same_model(tmp_path, tokens, flags):
    """Through the command line: every -r mode, offload, tiles and segments train the same bits as -r 0."""
    drop = ["--dropout", "0.1"] if "--dropout" in flags else []
    small_run(tmp_path, "ref", "-x", "3", "-r", "0", *drop)
    small_run(tmp_path, "other", "-x", "3", *flags)
    assert payload(tmp_path / "ref" / "model_00000003.bin") == payload(tmp_path / "other" / "model_00000003.bin")
    assert (tmp_path / "ref" / "model_00000003.bin").read_bytes()[4:8] == np.int32(7).tobytes()  # version 7


def test_cli_resume_bitwise(tmp_path, tokens):
    small_run(tmp_path, "whole", "-x", "4")
    small_run(tmp_path, "split", "-x", "2")
    small_run(tmp_path, "split", "-x", "4", "-y", "1")
    assert payload(tmp_path / "whole" / "model_00000004.bin") == payload(tmp_path / "split" / "model_00000004.bin")


def test_grouped_query_backward_independent_of_threads(tmp_path, tokens):
    """4 query heads on 1 K/V head: the K/V gradient sums over the group in a fixed order, so 1 and 3 threads
    train the same bits."""
    cfg = CASES["llama3-untied"]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 11))
    for n in (1, 3):
        res = run([binary("train_gpt_cpu"), "-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-b", "2", "-t", "16",
                   "-x", "2", "-s", "0", "-r", "1", "-o", tmp_path / f"o{n}"], env={"OMP_NUM_THREADS": str(n)}, check=True)
    assert payload(tmp_path / "o1" / "model_00000002.bin") == payload(tmp_path / "o3" / "model_00000002.bin")


@pytest.mark.skipif(__import__("shutil").which("mpirun") is None, reason="mpirun not found (install OpenMPI)")
@pytest.mark.parametrize("degree", [2, 4])
def test_context_parallel_against_one_process(tmp_path, degree):
    """--context-parallel N: RoPE from each token's global position, packed documents restarting positions and
    masking attention, the ring carrying the K/V heads after RoPE: per-step losses within 1e-5 of one process."""
    cfg = CASES["llama3-untied"]
    write_model(tmp_path / "m.bin", cfg, random_params(cfg, 12))
    rng = np.random.default_rng(4)
    toks = rng.integers(6, V, 8 * 32 + 1)
    toks[rng.integers(0, 8 * 32, 12)] = 5
    datafile.write_shard(tmp_path / "t.bin", toks)
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    flags = ["-e", tmp_path / "m.bin", "-i", tmp_path / "t.bin", "-j", "", "-b", "1", "-t", "32", "-x", "3", "-s", "0", "-l", "1e-3",
             "--eot-token", "5", "--reset-position-ids", "--reset-attention-mask"]
    one = run([binary("train_gpt_cpu"), *flags], env=env, check=True)
    ring = run(["mpirun", "-np", str(degree), binary("train_gpt_cpu"), *flags, "--context-parallel", str(degree)], env=env, check=True)
    step = re.compile(r"^step +\d+/\d+ \| loss ([0-9.]+)", re.M)
    a, b = [float(x) for x in step.findall(one.stdout)], [float(x) for x in step.findall(ring.stdout)]
    assert len(a) == 3 and len(b) == 3
    assert all(abs(x - y) <= 1e-5 * x for x, y in zip(a, b)), (a, b)
