"""dev/plot_log.py and dev/bench/plot_plan.py draw real runs: a log with a
resume that repeated steps, and the trainer's own --plan-json."""
import importlib.util
import json
import sys

import pytest

from conftest import REPO, binary, run

pytest.importorskip("matplotlib", reason="matplotlib is not installed (dev/data/requirements.txt); the plots are optional")

SHAPE = ["-e", "d6", "--layers", 1, "--channels", 32, "--heads", 4, "--max-seq-len", 32]


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000, (path, len(data))


def test_plot_log_draws_a_resumed_run_once_per_step(tmp_path, synthetic):
    data, meta = synthetic
    out = tmp_path / "run"
    args = [binary("train_gpt_cpu"), *SHAPE, "--vocab-size", meta["vocab_size"], "-i", data / "synthetic_train.bin",
            "-j", data / "synthetic_val.bin", "-b", 2, "-t", 32, "-v", 3, "-m", 2, "-s", 0, "-n", 3,
            "--eval-by-position", 8, "-q", 0.1, "-o", out]
    run([*args, "-x", 8], check=True)
    before = (out / "log.jsonl").read_text()
    (out / "DONE_00000008").unlink()  # as if the run died after step 8 but before its last checkpoint
    run([*args, "-x", 7, "-y", 1], check=True)  # resumes at step 6, repeats 7 on a shorter schedule, stops
    after = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    old7 = [r for r in map(json.loads, before.splitlines()) if r["step"] == 7 and "loss" in r]
    sevens = [r for r in after if r["step"] == 7 and "loss" in r]
    # the trainer dropped the superseded lines itself (llmc/logger.h): step 7 once, the resumed run's
    assert len(sevens) == 1 and len(old7) == 1 and sevens[0]["lr"] != old7[0]["lr"]
    # a log that holds both runs (appended without that trim, as older logs are): plot_log keeps the later run
    resumed = [r for r in after if r["step"] > 6 or (r["step"] == 6 and "val_loss" in r)]
    both = tmp_path / "both"
    both.mkdir()
    (both / "log.jsonl").write_text(before + "".join(json.dumps(r) + "\n" for r in resumed))
    plot_log = load(REPO / "dev" / "plot_log.py", "plot_log")
    for log in (plot_log.read_log(out / "log.jsonl"), plot_log.read_log(both / "log.jsonl")):
        assert list(log["train"]) == list(range(1, 8))  # step 8 of the abandoned run is gone
        assert list(log["val"]) == [0, 3, 6, 7]
        assert log["train"][7] == sevens[0]  # the resumed run's record
    png = tmp_path / "log.png"
    res = run([sys.executable, REPO / "dev" / "plot_log.py", out, out, "--labels", "a,b", "-o", png], check=True)
    assert "wrote" in res.stdout
    assert_png(png)
    bad = run([sys.executable, REPO / "dev" / "plot_log.py", tmp_path / "nothing"])
    assert bad.returncode == 1 and "cannot read" in bad.stderr


def test_plot_plan_draws_the_trainers_plan(tmp_path):
    png = tmp_path / "plan.png"
    res = run([sys.executable, REPO / "dev" / "bench" / "plot_plan.py", "--trainer", binary("train_gpt_cpu"), "-e", "d6",
               "--seq-lens", "64,128", "-b", 2, "-o", png, "--", "--layers", 2, "--vocab-size", 256], check=True)
    assert "wrote" in res.stdout
    assert_png(png)
    plot_plan = load(REPO / "dev" / "bench" / "plot_plan.py", "plot_plan")
    stacked = {c for _, parts, _ in plot_plan.STACK for c in parts}
    plan = json.loads(run([binary("train_gpt_cpu"), "-e", "d6", "--plan-json"], check=True).stdout)
    assert stacked == set(plan["components"]), "a component of the plan is missing from the picture"
