"""The dev/bench tools refuse what they cannot use in one line (datafile.run_main's
error path), never with a traceback: a trainer that fails under them, a CSV
that is not the sweep's, an output they cannot write, malformed numbers."""
import sys

import pytest

from conftest import REPO, binary, run

BENCH = REPO / "dev" / "bench"


def assert_one_line(res, *needles):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], res.stderr


def test_bench_cpu_reports_the_trainers_error(tmp_path):
    res = run([sys.executable, BENCH / "bench_cpu.py", "--binary", binary("train_gpt_cpu"), "--model", "d6", "-t", 2000,
               "--steps", 2])
    assert_one_line(res, "exceeds the model's maximum")  # the trainer's own line, passed on


@pytest.mark.parametrize("flags, needle", [(["--T", "64,abc"], "--T"), (["--out", "FILE/x"], "--out"),
                                           (["-b", "0"], "flag -b")])
def test_sweep_recompute_dry_run_refuses_in_one_line(tmp_path, flags, needle):
    (tmp_path / "file").write_text("")
    flags = [str(tmp_path / "file" / "x") if f == "FILE/x" else f for f in flags]
    res = run([sys.executable, BENCH / "sweep_recompute.py", "--dry-run", "--exe", binary("train_gpt_cpu"),
               "--models", "d12", "--T", "64", "--max-seq-len", 64, "--out", tmp_path / "out", *flags])
    assert_one_line(res, needle)


def test_plot_sweep_reads_only_the_sweeps_csv(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    assert_one_line(run([sys.executable, BENCH / "plot_sweep.py", tmp_path / "bad.csv"]), "model")
    res = run([sys.executable, BENCH / "sweep_recompute.py", "--dry-run", "--exe", binary("train_gpt_cpu"),
               "--models", "d12", "--T", "32,64", "--max-seq-len", 64, "--out", tmp_path / "sweep"])
    assert res.returncode == 0, res.stderr
    csv = tmp_path / "sweep" / "sweep.csv"
    assert_one_line(run([sys.executable, BENCH / "plot_sweep.py", csv, "-o", tmp_path / "missing" / "s.png"]),
                    f"-o {tmp_path / 'missing' / 's.png'}")
    res = run([sys.executable, BENCH / "plot_sweep.py", csv, "-o", tmp_path / "s.pdf"])
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "s.pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize("script, env, needle", [
    ("run_single_node.sh", {"NGPUS": "1x"}, "NGPUS '1x'"),
    ("run_single_node.sh", {"NGPUS": "abc"}, "NGPUS 'abc'"),
    ("run_multi_node.sh", {"HOSTFILE": "EMPTY"}, "lists no node"),  # grep -c found none: set -e ended it silently
    ("run_multi_node.sh", {"HOSTFILE": "ONE", "GPUS_PER_NODE": "x"}, "GPUS_PER_NODE 'x'"),
    ("run_multi_node.sh", {"HOSTFILE": "ONE", "TRAINER": "MISSING"}, "is not an executable"),
])
def test_launch_scripts_refuse_bad_settings_in_one_line(tmp_path, script, env, needle):
    (tmp_path / "empty").write_text("# no nodes yet\n")
    (tmp_path / "one").write_text("node01 slots=1\n")
    paths = {"EMPTY": tmp_path / "empty", "ONE": tmp_path / "one", "MISSING": tmp_path / "no_trainer"}
    env = {k: str(paths.get(v, v)) for k, v in env.items()}
    res = run([REPO / "scripts" / script], env=env, timeout=60)
    assert_one_line(res, needle)
