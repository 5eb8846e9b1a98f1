"""llmc/'s folders are its layers (docs/DESIGN.md, "Architecture"): every include points the allowed way between
them, no folder sits above the trainers' includes, and the longest chain of includes from a header to the ground is
short enough to read. Parsed from the sources; nothing is built."""
import functools
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LLMC = REPO / "llmc"

# Which folders a folder's headers may include (its own included). core is the ground everything shares; the
# planner reads only core; the backends (cpu/ and cuda/: the CPU reference's fast parts, the CUDA op families) and
# the run driver (run/) read core and the planner, never each other: a backend reaches the driver only through
# the trainer that joins them (train_gpt.c, train_gpt.cu).
ALLOWED = {
    "core": {"core"},
    "plan": {"core", "plan"},
    "cpu": {"core", "plan", "cpu"},
    "cuda": {"core", "cuda"},
    "run": {"core", "plan", "run"},
}
# The three CUDA files that read the plan, all host-side orchestration and no kernel: nvtx_regions.cuh registers the
# plan's arena with a memory checker, entry by entry; offload.cuh copies the layers the plan sends to the host through
# the staging slots it lays out; optimizer_offload.cuh finds the offloaded optimizer's tensors in the plan's host pool.
CUDA_READS_PLAN = {"cuda/nvtx_regions.cuh": {"plan/plan.h"}, "cuda/offload.cuh": {"plan/plan.h"},
                   "cuda/optimizer_offload.cuh": {"plan/plan.h"}}
MAX_FLOORS = 7
TOP_LEVEL_MAX_FILES = 0


def include_graph():
    graph = {}
    for folder in sorted(p for p in LLMC.iterdir() if p.is_dir()):
        for f in sorted(folder.iterdir()):
            rel = f"{folder.name}/{f.name}"
            text = f.read_text()
            graph[rel] = [os.path.normpath(os.path.join(folder.name, inc))
                          for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M)]
    return graph


def longest_chain(graph):
    @functools.lru_cache(maxsize=None)
    def chain(node):
        best = ()
        for dep in graph.get(node, []):
            c = chain(dep)
            if len(c) > len(best):
                best = c
        return (node, *best)
    return max((chain(n) for n in graph), key=len)


def test_llmc_has_only_folders_at_its_top():
    loose = [p.name for p in LLMC.iterdir() if p.is_file()]
    assert len(loose) <= TOP_LEVEL_MAX_FILES, f"files at llmc/'s top, outside the layers: {loose}"
    assert {p.name for p in LLMC.iterdir() if p.is_dir()} == set(ALLOWED)


def test_every_include_names_a_file_that_exists():
    graph = include_graph()
    missing = [(f, inc) for f, incs in graph.items() for inc in incs if inc not in graph]
    assert not missing


def test_includes_point_the_allowed_way():
    wrong = []
    for f, incs in include_graph().items():
        folder = f.split("/")[0]
        for inc in incs:
            if inc.split("/")[0] not in ALLOWED[folder] and inc not in CUDA_READS_PLAN.get(f, set()):
                wrong.append(f"{f} includes {inc}")
    assert not wrong, "\n".join(wrong)


def test_the_longest_include_chain_is_at_most_seven_floors():
    chain = longest_chain(include_graph())
    assert len(chain) <= MAX_FLOORS, " -> ".join(chain)


def test_no_cycles():
    graph = include_graph()
    state = {}

    def visit(n, path):
        if state.get(n) == 1:
            pytest.fail("include cycle: " + " -> ".join(path + [n]))
        if state.get(n) == 2:
            return
        state[n] = 1
        for d in graph.get(n, []):
            visit(d, path + [n])
        state[n] = 2
    for n in graph:
        visit(n, [])


def test_the_checker_sees_a_wrong_include(tmp_path, monkeypatch):
    """The rule is not vacuous: a core header that includes the planner, and a chain one floor too long, fail."""
    graph = include_graph()
    graph["core/model.h"] = graph["core/model.h"] + ["plan/plan.h"]
    folder_of = lambda f: f.split("/")[0]
    assert any(folder_of(inc) not in ALLOWED[folder_of(f)] for f, incs in graph.items() for inc in incs)
    deep = {f"run/h{i}.h": [f"run/h{i + 1}.h"] for i in range(MAX_FLOORS)}
    deep[f"run/h{MAX_FLOORS}.h"] = []
    assert len(longest_chain(deep)) == MAX_FLOORS + 1


def test_the_trainers_include_the_driver_and_their_own_backend_only():
    for trainer, backend in (("train_gpt.c", "cpu"), ("train_gpt.cu", "cuda")):
        incs = re.findall(r'^\s*#\s*include\s+"llmc/([^"]+)"', (REPO / trainer).read_text(), re.M)
        folders = {i.split("/")[0] for i in incs}
        assert folders <= {"run", backend}, (trainer, sorted(folders))
        assert "run/trainer.h" in incs
