"""dev/bench/torch_gpt2.py, the PyTorch side-by-side baseline, against the CPU
reference: remat's random init reproduced bit for bit, and the same losses and
gradient norms step by step on the same weights and tokens (fp32 on the CPU).
Skipped when PyTorch is not installed (CI does not install it)."""
import importlib.util
import re
import sys

import numpy as np
import pytest

from conftest import REPO, binary, datafile, run

SCRIPT = REPO / "dev" / "bench" / "torch_gpt2.py"
L, C, NH, V, MAXT = 2, 32, 4, 200, 32  # V=200 pads to 256: the masked logits are exercised
SHAPE = ["-e", "d6", "--layers", str(L), "--channels", str(C), "--heads", str(NH), "--vocab-size", str(V),
         "--max-seq-len", str(MAXT)]
STEP = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr ([0-9.e+-]+) \| norm ([0-9.]+)", re.M)


@pytest.fixture(scope="module")
def tg():
    """The baseline as a module; skips the test when torch is not importable."""
    try:
        import torch
    except ImportError as exc:
        pytest.skip(f"PyTorch is not installed ({exc}); the torch baseline is optional")
    torch.set_num_threads(1)  # tiny models: spinning threads only lose time on a busy machine
    spec = importlib.util.spec_from_file_location("torch_gpt2", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("torch_baseline") / "train.bin"
    datafile.write_shard(path, np.random.default_rng(5).integers(0, V, 4000))
    return path


def steps_of(stdout):
    """[(loss, lr, norm)] from the step lines."""
    return [(float(m[2]), float(m[3]), float(m[4])) for m in STEP.finditer(stdout)]


def run_torch_inprocess(tg, capsys, args):
    capsys.readouterr()
    assert tg.main([*args, "--device", "cpu"]) == 0
    return capsys.readouterr().out


def assert_same_steps(remat_out, torch_out, n):
    a, b = steps_of(remat_out), steps_of(torch_out)
    assert len(a) == len(b) == n, (remat_out[-2000:], torch_out[-2000:])
    for i, ((la, lra, na), (lb, lrb, nb)) in enumerate(zip(a, b), 1):
        assert abs(la - lb) <= 1e-5, f"step {i}: loss {la} (train_gpt_cpu) vs {lb} (torch)"
        assert lra == lrb, f"step {i}: lr {lra} vs {lrb}"
        assert abs(na - nb) <= 1e-4 * na + 1e-4, f"step {i}: norm {na} vs {nb}"


def test_remat_init_reproduced_bit_for_bit(tg, shard, tmp_path):
    # -l 0 leaves the weights as initialised, so the end-of-run checkpoint is the init
    run([binary("train_gpt_cpu"), *SHAPE, "-i", shard, "-j", "", "-b", "2", "-t", "16", "-x", "1", "-l", "0",
         "-s", "0", "-v", "0", "--seed", "7", "-o", tmp_path / "ck"], check=True)
    cfg, version, from_file = tg.read_model_file(str(tmp_path / "ck" / "model_00000001.bin"))
    assert version == 3 and (cfg["L"], cfg["C"], cfg["NH"], cfg["V"], cfg["Vp"], cfg["maxT"]) == (L, C, NH, V, 256, MAXT)
    import torch
    ours = tg.remat_init(cfg, 7, torch.device("cpu"))
    for name in tg.TENSOR_NAMES:
        assert np.array_equal(from_file[name].numpy(), ours[name].numpy()), name


def test_training_steps_match_cpu_trainer(tg, shard):
    # warmup, cosine decay, weight decay and clipping (the first norms exceed 0.5) all in play
    common = [*SHAPE, "-i", shard, "-b", "3", "-t", "16", "-x", "5", "-l", "1e-2", "-u", "2", "-q", "0.1", "-c",
              "0.1", "--grad-clip", "0.5"]
    remat = run([binary("train_gpt_cpu"), *common, "-j", "", "-s", "0", "-v", "0"], check=True)
    torch_res = run([sys.executable, SCRIPT, *common, "--device", "cpu"], env={"OMP_NUM_THREADS": "1"}, check=True)
    assert_same_steps(remat.stdout, torch_res.stdout, 5)
    assert "average step time" in torch_res.stdout
    summary = [ln for ln in torch_res.stdout.splitlines() if ln.startswith("summary {")]
    assert len(summary) == 1 and '"step1_loss": ' in summary[0]


@pytest.mark.parametrize("version", [3, 5])
def test_model_file_same_losses(tg, shard, tmp_path, capsys, version):
    # two steps of training first, so LayerNorm weights and biases are no longer 1 and 0
    run([binary("train_gpt_cpu"), *SHAPE, "-i", shard, "-j", "", "-b", "2", "-t", "32", "-x", "2", "-l", "1e-2",
         "-s", "0", "-v", "0", "-o", tmp_path / "ck"], check=True)
    model = tmp_path / "ck" / "model_00000002.bin"
    if version == 5:  # the same weights rounded to bf16 (round to nearest even)
        raw = model.read_bytes()
        bits = np.frombuffer(raw[1024:], dtype=np.float32).view(np.uint32).astype(np.uint64)
        header = np.frombuffer(raw[:1024], dtype=np.int32).copy()
        header[1] = 5
        model = tmp_path / "m5.bin"
        model.write_bytes(header.tobytes() + ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes())
    args = ["-i", shard, "-b", "2", "-t", "32", "-x", "3", "-l", "1e-3"]
    remat = run([binary("train_gpt_cpu"), "-e", model, *args, "-j", "", "-s", "0", "-v", "0"], check=True)
    assert f"(version {version})" in remat.stdout
    out = run_torch_inprocess(tg, capsys, ["--model", str(model), *map(str, args)])
    assert f"(version {version})" in out
    assert_same_steps(remat.stdout, out, 3)


def test_without_torch_exits_77(tmp_path):
    # a torch package that fails to import stands in for a machine without PyTorch
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    res = run([sys.executable, SCRIPT, "--device", "cpu"], env={"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 77, res.stderr
    assert "PyTorch is not importable" in res.stderr
