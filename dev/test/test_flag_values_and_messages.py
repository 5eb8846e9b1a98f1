"""Issue 44's small findings about flags and what the trainer says: numbers
are parsed strictly (no leading space, no '+', no hexadecimal where the docs
call a value a number); the offload refusal under segments names the
segment inputs the model has; --plan-json's `flags` reproduce the plan (what
-r auto chose) and every top-level key of it is in docs/FORMATS.md;
passkey.py eval refuses a trainer command that gives the flags it sets."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, binary, datafile, run

SMALL = ["-e", "d6", "--layers", "4", "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "64"]
PLAN = [*SMALL, "-b", "2", "-t", "64", "--plan"]


def refusal(*args):
    res = run([binary("train_gpt_cpu"), *map(str, args)])
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (res.returncode, res.stdout[-800:], res.stderr)
    return lines[0]


# (flags before the value, the flag named, the value refused, its plain spelling that is accepted)
NUMBERS = [
    ([], "-n", " 2", "2"), ([], "-n", "+2", "2"), ([], "-n", "\t2", "2"),
    ([], "-l", "+1e-3", "1e-3"), ([], "-l", " 0.001", ".001"), ([], "-l", "0x1p-10", "0.0009765625"),
    ([], "--seed", "+7", "7"), ([], "--tile-tokens", "+64", "64"), ([], "--tile-tokens", " 64", "64"),
    ([], "--segment-layers", "+2", "2"), ([], "--segment-layers", " 2", "2"),
    (["-r", "1"], "--recompute-layers", " 1", "1"), (["-r", "1"], "--recompute-layers", "+1", "1"),
    (["-r", "1"], "--recompute-layers", "0, 2", "0,2"), (["-r", "1"], "--recompute-layers", "0-+2", "0-2"),
    (["-r", "1"], "--recompute-layers", "every:+2", "every:2"), ([], "-r", "1:+0/0:1-3", "1:0/0:1-3"),
]


@pytest.mark.parametrize("before, flag, bad, good", NUMBERS, ids=[f"{f}={b!r}" for _, f, b, _ in NUMBERS])
def test_numbers_are_parsed_strictly(before, flag, bad, good):
    line = refusal(*PLAN, *before, flag, bad)
    assert line.startswith(f"error: flag {flag}") and bad.strip() in line, line
    res = run([binary("train_gpt_cpu"), *PLAN, *before, flag, good])
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("bad", ["+8", " 8", "0,+4", "0, 4", "every:+8"])
def test_eval_by_position_is_parsed_strictly(tmp_path, bad):
    datafile.write_shard(tmp_path / "d.bin", np.random.default_rng(2).integers(0, 64, 1000))
    base = [*SMALL, "-i", tmp_path / "d.bin", "-j", tmp_path / "d.bin", "-b", "1", "-t", "16", "-x", "0", "-v", "1", "-m", "1",
            "-s", "0"]
    line = refusal(*base, "--eval-by-position", bad)
    assert line.startswith("error: flag --eval-by-position") and bad.strip() in line, line
    good = bad.replace(" ", "").replace("+", "")
    assert run([binary("train_gpt_cpu"), *base, "--eval-by-position", good]).returncode == 0


@pytest.mark.parametrize("L, K, starts", [(5, 5, "layer 0 alone: one segment"), (8, 5, "layers 0 and 5"), (8, 4, "layers 0 and 4"),
                                          (8, 3, "layers 0, 3, ..., 6"), (10, 2, "layers 0, 2, ..., 8")])
def test_offload_refusal_names_the_models_segment_inputs(L, K, starts):
    """The segment inputs named are those of an L-layer model (the issue: 'layers 0, 5' of a 5-layer model)."""
    model = ["-e", "d6", "--layers", L, "--channels", "32", "--heads", "4", "--vocab-size", "64", "--max-seq-len", "64"]
    line = refusal(*model, "-b", "2", "-t", "64", "--plan", "-r", f"1o:0,1/1:2-{L - 1}", "--segment-layers", K)
    assert f"offloads layer 1, which starts no segment of --segment-layers {K}" in line, line
    assert line.endswith(f"with segments only the segment inputs ({starts}) offload"), line
    numbers = [int(x) for x in re.findall(r"\d+", line[line.index("segment inputs"):])]
    assert all(n < L for n in numbers), line  # never a layer the model does not have


def plan_json(*args):
    res = run([binary("train_gpt_cpu"), *map(str, args), "--plan-json"])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


LONG = ["-e", "d6", "--layers", "8", "--channels", "64", "--heads", "4", "--vocab-size", "256", "--max-seq-len", "4096", "-b", "1",
        "-t", "4096"]
KEPT = ["total_bytes", "host_total_bytes", "layer_modes", "layer_offload", "tile_tokens", "segment_layers", "recompute",
        "staging_slots", "buffers"]


@pytest.mark.parametrize("choice", [["-r", "auto", "--mem-budget", "70MiB"], ["-r", "auto", "--mem-budget", "40MiB"],
                                    ["-r", "1", "--segment-layers", "2", "--offload-checkpoints", "--tile-tokens", "128"],
                                    ["-r", "3", "--segment-layers", "3"]])
def test_plan_json_flags_reproduce_the_plan(choice):
    """`flags` in place of the choice (-r auto's or the flags given) gives the same plan."""
    a = plan_json(*LONG, *choice)
    assert a["flags"].startswith(f"-r {a['recompute']} --tile-tokens {a['tile_tokens']} --segment-layers {a['segment_layers']}")
    b = plan_json(*LONG, *a["flags"].split())
    assert {k: a[k] for k in KEPT} == {k: b[k] for k in KEPT}
    if choice[1] == "auto":
        assert a["tile_tokens"] > 0 or a["segment_layers"] > 1 or "o" in a["recompute"] or len(set(a["layer_modes"])) > 1
        # the recompute key alone leaves the tiles out: not the plan (why flags exist)
        if a["tile_tokens"]:
            assert plan_json(*LONG, "-r", a["recompute"])["total_bytes"] != a["total_bytes"]


def test_every_plan_json_key_is_documented():
    keys = plan_json(*LONG, "-r", "1", "--segment-layers", "2", "--offload-checkpoints").keys()
    text = (REPO / "docs/FORMATS.md").read_text()
    table = text[text.index("## `--plan-json`"):]
    table = table[:table.index("\n## ", 5)]
    missing = [k for k in keys if f"`{k}`" not in table]
    assert not missing, missing


@pytest.fixture(scope="module")
def passkey_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("pk")
    run([sys.executable, REPO / "dev" / "data" / "passkey.py", "make", d, "--seq-len", "32", "--samples-per-depth", "1",
         "--depths", "0,1", "--seed", "3"], check=True)
    return d


@pytest.mark.parametrize("given", [["-t", "16"], ["--eval-dump", "mine.bin"], ["-b", "4"], ["-j", "x.bin"], ["-t=16"]])
def test_passkey_eval_refuses_the_flags_it_sets(passkey_data, tmp_path, given):
    """A -t or --eval-dump of the user's was silently overridden; now refused, naming it."""
    res = run([sys.executable, REPO / "dev" / "data" / "passkey.py", "eval", passkey_data, "--", binary("train_gpt_cpu"),
               *SMALL, *given])
    flag = given[0].split("=")[0]
    assert res.returncode != 0 and f"the trainer command gives {flag}: passkey.py eval sets" in res.stderr, res.stderr
    assert not list(tmp_path.iterdir())


def test_passkey_eval_takes_a_launchers_flags():
    """A launcher's own flags before the trainer (mpirun -x VAR) are not the trainer's."""
    sys.path.insert(0, str(REPO / "dev" / "data"))
    import passkey
    passkey.check_command(["mpirun", "-np", "2", "-x", "OMP_NUM_THREADS", "./train_gpt_cpu", "-e", "m.bin", "-r", "1"])
    with pytest.raises(Exception, match="gives -t"):
        passkey.check_command(["mpirun", "-x", "A", "/x/train_gpt", "-e", "m.bin", "-t", "64"])
