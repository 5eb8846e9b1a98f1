"""dev/plot_log.py and dev/bench/plot_plan.py draw real runs: a log with a
resume that repeated steps, and the trainer's own --plan-json."""
import importlib.util
import json
import sys

import numpy as np

import pytest

from conftest import REPO, binary, datafile, run

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
    # resumes at step 6, repeats 7 on a shorter schedule (insisted on: the schedule decays over -x), stops
    run([*args, "-x", 7, "-y", 1, "--resume-override"], check=True)
    after = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    old7 = [r for r in map(json.loads, before.splitlines()) if r["step"] == 7 and "loss" in r]
    sevens = [r for r in after if r["step"] == 7 and "loss" in r]
    # the trainer dropped the superseded lines itself (llmc/run/logger.h): step 7 once, the resumed run's
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


def write_log(run_dir, steps, norms, val_every=0, by_position=False):
    """A log.jsonl in the trainer's record format (llmc/run/logger.h)."""
    run_dir.mkdir(parents=True)
    lines = []
    for s, norm in zip(steps, norms):
        if val_every and s % val_every == 0:
            lines.append({"step": s, "val_loss": 5.0 - s / 100})
            if by_position:
                lines.append({"step": s, "val_loss_by_position": [{"begin": 0, "end": 16, "loss": 5.1, "tokens": 64},
                                                                  {"begin": 16, "end": 32, "loss": 4.9, "tokens": 64}]})
        lines.append({"step": s + 1, "loss": 5.0 - s / 90, "lr": 1e-3, "norm": norm, "ms": 10.0, "tokens_per_s": 1e4,
                      "tokens": 256 * (s + 1), "memory_mib": 20.0})
    (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def drawn_figure(module, monkeypatch, draw, *args):
    """The matplotlib figure `draw` makes, caught before it is written."""
    caught = {}

    def keep(plt, fig, out):
        fig.canvas.draw()
        caught["fig"] = fig
    monkeypatch.setattr(module, "save_figure", keep)
    draw(*args)
    return caught["fig"]


def labelled_ticks(axis):
    lo, hi = sorted(axis.get_view_interval())
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text() and lo <= t.get_position()[1] <= hi]


@pytest.mark.parametrize("norms", [[1.05 + 0.6 * (i % 7) / 6 for i in range(30)],  # within a decade
                                   [0.3 * 1.1 ** i for i in range(30)]],  # over a decade and a half
                         ids=["narrow", "wide"])
def test_plot_log_panels_fit_the_runs(tmp_path, monkeypatch, norms):
    plot_log = load(REPO / "dev" / "plot_log.py", "plot_log_panels")
    runs = [("noval", plot_log.read_log(write_log(tmp_path / "a", range(30), norms) / "log.jsonl")),
            ("val", plot_log.read_log(write_log(tmp_path / "b", range(30), norms, val_every=10) / "log.jsonl"))]
    fig = drawn_figure(plot_log, monkeypatch, plot_log.plot, runs, tmp_path / "x.png")
    titles = [a.get_title() for a in fig.axes if a.axison]
    assert not any("by position" in t for t in titles)  # no run evaluated by position: no empty panel
    loss = next(a for a in fig.axes if a.get_title() == "loss vs step")
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["noval train", "val train", "val val"]
    norm = next(a for a in fig.axes if a.get_title().startswith("gradient norm"))
    assert norm.get_yscale() == "log"
    labels = labelled_ticks(norm.yaxis)
    assert len(labels) >= 3 and all(float(t) > 0 for t in labels), labels  # plain numbers, not 10^0 alone

    runs.append(("bypos", plot_log.read_log(write_log(tmp_path / "c", range(30), norms, 10, True) / "log.jsonl")))
    fig = drawn_figure(plot_log, monkeypatch, plot_log.plot, runs, tmp_path / "x.png")
    assert sum("by position" in a.get_title() for a in fig.axes if a.axison) == 1


@pytest.mark.parametrize("suffix, magic", [(".pdf", b"%PDF"), (".svg", b"<?xml"), (".png", b"\x89PNG")])
def test_plot_log_writes_the_format_its_extension_names(tmp_path, suffix, magic):
    run_dir = write_log(tmp_path / "r", range(10), [1.0] * 10)
    out = tmp_path / f"log{suffix}"
    res = run([sys.executable, REPO / "dev" / "plot_log.py", run_dir, "-o", out], check=True)
    assert "wrote" in res.stdout and out.read_bytes().startswith(magic)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, "r"])  # no temporary left


@pytest.mark.parametrize("script", ["plot_log", "plot_plan"])
@pytest.mark.parametrize("target", ["missing/x.png", "dir", "x.docx"])
def test_plots_refuse_an_output_they_cannot_write_in_one_line(tmp_path, script, target):
    run_dir = write_log(tmp_path / "r", range(10), [1.0] * 10)
    (tmp_path / "dir").mkdir()
    out = tmp_path / target
    if script == "plot_log":
        cmd = [REPO / "dev" / "plot_log.py", run_dir, "-o", out]
    else:
        cmd = [REPO / "dev" / "bench" / "plot_plan.py", "--trainer", binary("train_gpt_cpu"), "-e", "d6",
               "--seq-lens", "64", "-o", out]
    res = run([sys.executable, *cmd])
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and f"-o {out}" in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert not out.is_file()


@pytest.mark.parametrize("flags", [["-r", "1"], ["-t", "64"], ["-b", "2"], ["--max-seq-len", "256"], ["-e", "d12"],
                                   ["--plan"], ["--plan-json"], ["--layers", "2", "-r", "2"]])
def test_plot_plan_refuses_the_flags_it_sets_itself(tmp_path, flags):
    png = tmp_path / "plan.png"
    res = run([sys.executable, REPO / "dev" / "bench" / "plot_plan.py", "--trainer", binary("train_gpt_cpu"), "-e", "d6",
               "--seq-lens", "64,128", "-o", png, "--", *flags])
    lines = res.stderr.strip().splitlines()
    own = next(f for f in flags if f.startswith("-") and f != "--layers")
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"plot_plan.py: error: {own} "), res.stderr
    assert not png.exists()


def test_plot_plan_scale_modes_and_title_fit_the_plan(tmp_path, monkeypatch):
    """Bars for all four recompute modes and -r 1 offloaded, each as tall as
    the trainer's plan for it (device bytes, then the host pool's); a y axis
    fitted to the tallest bar; a long -e path wrapped, not cut."""
    plot_plan = load(REPO / "dev" / "bench" / "plot_plan.py", "plot_plan_drawn")
    model = tmp_path / ("a_directory_with_a_long_name_" * 4) / "model.bin"
    model.parent.mkdir()
    datafile.write_model(model, {"max_seq_len": 128, "vocab_size": 256, "padded_vocab_size": 256, "num_layers": 2,
                                 "num_heads": 4, "channels": 32},
                         {k: np.zeros(s, np.float32) for k, s in datafile.model_tensor_shapes(
                             {"max_seq_len": 128, "vocab_size": 256, "padded_vocab_size": 256, "num_layers": 2,
                              "num_heads": 4, "channels": 32}).items()})
    args = plot_plan.argparse.Namespace(trainer=binary("train_gpt_cpu"), model=str(model), b=2, seq_lens=[64, 128],
                                        extra=[])
    plans = plot_plan.collect(args)
    fig = drawn_figure(plot_plan, monkeypatch, plot_plan.draw, plans, args, tmp_path / "plan.png")
    ax = fig.axes[0]
    assert sorted({t.get_text() for t in ax.texts if t.get_text().startswith("-r ")}) == ["-r 0", "-r 1", "-r 1o", "-r 2", "-r 3"]
    expected = {}  # total bytes of each bar, from the trainer's own plan (run here, not through plot_plan)
    for T in (64, 128):
        for mode in ("0", "1", "2", "3", "1o:all"):
            plan = json.loads(run([binary("train_gpt_cpu"), "-e", model, "--max-seq-len", 128, "-b", 2, "-t", T, "-r",
                                   mode, "--plan-json"], check=True).stdout)
            expected[(T, mode)] = sum(plan["components"].values()) + plan["host_total_bytes"]
    stacks = {}  # the top of each stacked bar, by its x position
    for p in ax.patches:
        x = round(p.get_x(), 6)
        stacks[x] = max(stacks.get(x, 0.0), p.get_y() + p.get_height())
    unit = 1e6 if "MB" in ax.get_ylabel() else 1e9 if "GB" in ax.get_ylabel() else 1e3 if "kB" in ax.get_ylabel() else 1
    bar_tops = sorted(stacks.values())
    assert np.allclose(sorted(v / unit for v in expected.values()), bar_tops, rtol=1e-6)
    assert max(bar_tops) < ax.get_ylim()[1] < 1.5 * max(bar_tops)  # fitted, not always 141 GB
    renderer = fig.canvas.get_renderer()
    title = ax.title.get_window_extent(renderer)
    assert 0 <= title.x0 and title.x1 <= fig.bbox.width, (title, fig.bbox.width)
    assert str(model).replace("\n", "") in ax.get_title().replace("\n", "")


def test_plot_log_reads_the_non_finite_values_the_trainer_prints(tmp_path):
    """Logs of earlier versions of llmc/run/logger.h have printf's nan, -nan, inf or
    -inf for a non-finite value, which is not JSON; such a record is still read."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    train = '{"step": %d, "loss": %s, "lr": 0.001, "norm": %s, "ms": 1.0, "tokens_per_s": 5.0, "tokens": %d, "memory_mib": 2.0}\n'
    (run_dir / "log.jsonl").write_text(train % (1, "5.5", "inf", 64) + '{"step": 1, "val_loss": -nan}\n'
                                       + train % (2, "-inf", "nan", 128) + train % (3, "4.5", "1.25", 192))
    plot_log = load(REPO / "dev" / "plot_log.py", "plot_log_nonfinite")
    log = plot_log.read_log(run_dir / "log.jsonl")
    assert list(log["train"]) == [1, 2, 3] and log["train"][1]["norm"] == float("inf")
    assert log["train"][2]["loss"] == float("-inf") and np.isnan(log["train"][2]["norm"]) and np.isnan(log["val"][1])
    res = run([sys.executable, REPO / "dev" / "plot_log.py", run_dir, "-o", tmp_path / "x.png"], check=True)
    assert "wrote" in res.stdout


def test_plot_log_reads_null_for_a_non_finite_value(tmp_path):
    """The trainer writes a non-finite loss, norm or validation loss as null: read as NaN, a gap."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    train = '{"step": %d, "loss": %s, "lr": 0.001, "norm": %s, "ms": 1.0, "tokens_per_s": 5.0, "tokens": %d, "memory_mib": 2.0}\n'
    (run_dir / "log.jsonl").write_text(train % (1, "5.5", "null", 64) + '{"step": 1, "val_loss": null}\n'
                                       + '{"step": 1, "val_loss_by_position": [{"begin": 0, "end": 8, "loss": null, "tokens": 8}]}\n'
                                       + train % (2, "4.5", "1.25", 128))
    plot_log = load(REPO / "dev" / "plot_log.py", "plot_log_null")
    log = plot_log.read_log(run_dir / "log.jsonl")
    assert np.isnan(log["train"][1]["norm"]) and np.isnan(log["val"][1]) and log["train"][2]["norm"] == 1.25
    assert np.isnan(log["by_pos"][1][0]["loss"])
    res = run([sys.executable, REPO / "dev" / "plot_log.py", run_dir, "-o", tmp_path / "x.png"], check=True)
    assert "wrote" in res.stdout


@pytest.mark.parametrize("record, needle", [('{"step": 1, "loss": "abc", "lr": 0.001}', "loss 'abc'"),
                                            ('{"step": 1, "val_loss": "5"}', "val_loss '5'"),
                                            ('{"step": 1, "val_loss_by_position": [{"a": 1}]}', "val_loss_by_position"),
                                            ('{"step": 1, "val_loss_by_position": []}', "val_loss_by_position"),
                                            ('{"step": 1, "loss": 5, "norm": true}', "norm True")])
def test_plot_log_refuses_records_it_cannot_draw_in_one_line(tmp_path, record, needle):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "log.jsonl").write_text(record + '\n{"step": 2, "loss": 5.0, "lr": 0.001, "norm": 1.0}\n')
    res = run([sys.executable, REPO / "dev" / "plot_log.py", run_dir, "-o", tmp_path / "x.png"])
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and f"log.jsonl:1: {needle}" in lines[0], res.stderr
    assert not (tmp_path / "x.png").exists()
