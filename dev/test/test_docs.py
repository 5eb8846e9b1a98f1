"""The documentation against the repository and the program.

- Every document a file names (docs/FORMATS.md, docs/DESIGN.md, a markdown link, an
  anchor in one) exists in the repository.
- Every table of numbers between dev/docs_tables.py's markers equals what the
  program prints now (the flag table from --help, plans from --plan and
  --plan-json), so no number in the docs can go stale silently. The GPU plans
  need build/train_gpt_bf16 (make build/train_gpt_bf16 or make cuda-all: nvcc,
  no GPU); without it those blocks are skipped, saying so.
- The flag table lists exactly the flags of llmc/core/cli.h's parser table.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "dev"))
import docs_tables  # noqa: E402

TEXT_SUFFIXES = {".c", ".h", ".cu", ".cuh", ".cpp", ".py", ".sh", ".md", ".mk", ".sbatch", ".txt", ".json", ".toml", ".cfg"}
TEXT_NAMES = {"Makefile", "run", "LICENSE"}
# Files that scripts write at run time (dev/gpu_check.sh, dev/bench/sweep_recompute.py),
# named in their help and comments; never part of the repository.
RUN_OUTPUTS = {"summary.md", "sweep.md", "bench_attention.md"}
MD_NAME = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def repo_files():
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split("\n")
        files = [REPO / f for f in out if f]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in REPO.rglob("*") if ".git" not in p.parts and "build" not in p.parts and "data" not in p.parts]
    return [f for f in files if f.is_file() and (f.suffix in TEXT_SUFFIXES or f.name in TEXT_NAMES) and "corpus" not in f.parts]


def resolves(ref, where):
    return (REPO / ref).is_file() or (where.parent / ref).is_file()


def heading_anchors(md):
    anchors = set()
    for line in md.read_text().splitlines():
        m = re.match(r"^#+ (.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


def test_every_named_document_exists():
    """A name ending in .md anywhere in the sources, scripts and docs resolves
    from the repository root or from the naming file's folder."""
    bad, seen = [], 0
    for f in repo_files():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for ref in MD_NAME.findall(line):
                seen += 1
                if Path(ref).name in RUN_OUTPUTS or resolves(ref, f):
                    continue
                bad.append(f"{f.relative_to(REPO)}:{n}: {ref}")
    assert seen > 20, "no document references found: the scan is broken"
    assert not bad, "documents named but not in the repository:\n" + "\n".join(bad)


def test_every_markdown_link_resolves():
    """Relative links in the .md files reach a file, and an anchor a heading of it."""
    bad, checked = [], 0
    for f in repo_files():
        if f.suffix != ".md":
            continue
        for target in MD_LINK.findall(f.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            checked += 1
            if not dest.is_file():
                bad.append(f"{f.relative_to(REPO)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
                bad.append(f"{f.relative_to(REPO)}: {target}: no heading '{anchor}' in {dest.name}")
    assert checked > 20
    assert not bad, "\n".join(bad)


def test_the_design_and_format_documents_and_license_exist():
    for name in ("docs/DESIGN.md", "docs/FORMATS.md", "LICENSE", "README.md"):
        assert (REPO / name).is_file(), name
    assert "MIT License" in (REPO / "LICENSE").read_text()


CODE_SUFFIXES = {".c", ".cu", ".h", ".cuh", ".py", ".cpp", ".sh", ".mk"}


@pytest.mark.parametrize("doc", ["README.md", "docs/DESIGN.md"])
def test_every_code_name_the_reading_docs_give_exists(doc):
    """Each `identifier` with an underscore that README.md or docs/DESIGN.md names
    (a function, type, macro or variable to look for) is a word of the code."""
    words = set()
    for f in repo_files():
        if f.suffix in CODE_SUFFIXES or f.name in ("Makefile",):
            words.update(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", f.read_text(errors="replace")))
    names = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?`", (REPO / doc).read_text()))
    missing = sorted(n for n in names if "_" in n and n not in words)
    assert not missing, f"{doc} names {missing}, which no source file has"


def test_readme_fits_on_a_few_screens():
    assert len((REPO / "README.md").read_text().splitlines()) <= 300


def generated_blocks():
    blocks = []
    for path in docs_tables.doc_files():
        text = path.read_text()
        for name, start, end in docs_tables.blocks_in(text):
            blocks.append(pytest.param(path, name, text[start:end], id=f"{path.relative_to(REPO)}:{name}"))
    return blocks


def test_every_generator_has_a_block():
    """No table the script can write is missing from the docs (a removed
    block would drop its check silently)."""
    used = {p.values[1] for p in generated_blocks()}
    assert used == set(docs_tables.BLOCKS), set(docs_tables.BLOCKS) ^ used


def test_every_longest_t_generator_has_a_block():
    """The same for the blocks only --longest-t rewrites (their rows are held to the program by test_offload.py)."""
    used = [name for path in docs_tables.doc_files() for name, _, _ in docs_tables.blocks_in(path.read_text(), docs_tables.SLOW_BEGIN)]
    assert sorted(used) == sorted(docs_tables.SLOW_BLOCKS), used


@pytest.mark.parametrize("path,name,body", generated_blocks())
def test_generated_block_is_what_the_program_prints(path, name, body):
    try:
        want = docs_tables.generate(name)
    except docs_tables.MissingBinary as e:
        pytest.skip(f"{name}: {e} (make build/train_gpt_bf16 needs nvcc): not checked")
    assert body == want, f"{path.relative_to(REPO)}: block {name} is stale: run python3 dev/docs_tables.py"


def test_flag_table_lists_exactly_the_parsers_flags():
    """Independent of the generator: the table's flags are llmc/core/cli.h's table's."""
    src = (REPO / "llmc/core/cli.h").read_text()
    parser = set(re.findall(r'^\s*\{"(-[-a-z0-9]+)", FLAG_\w+', src, re.M))
    text = (REPO / "docs/flags.md").read_text()
    rows = re.findall(r"^\| `(-[-a-z0-9]+)` \|", text, re.M)
    assert len(parser) > 30 and sorted(rows) == sorted(parser)


def test_readme_sequence_table_is_the_docs_numbers():
    """README's "How long a sequence fits" rows are rows of docs/offload-and-tiles.md's two longest-T tables (the model's
    -e, the card, the host memory, the technique's flags; the optimizer's table where they name --offload-optimizer)
    or docs/context-parallel.md's 8-GPU -r 1 -z 1 rows for GPT-2 1.5B: the same T, GiB, predicted step, and the
    optimizer's not-hidden seconds and share where it is in host memory (those tables are held to the program by
    test_offload.py and test_docs_rows.py). Among them GPT-2 1.5B with every lever and Llama 3.1 8B with the optimizer
    in host memory on one H200 and on one H100."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("longest_t", REPO / "dev" / "bench" / "longest_t.py")
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## How long a sequence fits"):readme.index("## Status")]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]+) \| ([0-9,]+) \| ([0-9.]+) \| ([^|]+) \|$", section, re.M)
    assert len(rows) >= 16, section
    docs = (REPO / "docs/offload-and-tiles.md").read_text()
    longest = {(m, card, 120, tech): (int(T), step, "on the device") for m, card, tech, T, step in re.findall(
        r"^\| (\S+) \| (\S+) \| (\w+) \| (\d+)(?: \(limit\))? \|(?: [^|]+ \|){4} ([0-9.]+) \|$", docs, re.M)}
    for m, card, host, tech, T, step, hidden, share in re.findall(
            r"^\| (\S+) \| (\d+GB) \| (\d+) \| (\w+) \| (\d+)(?: \(limit\))? \|(?: [^|]+ \|){5} ([0-9.]+) \| [^|]+ \| ([0-9.]+) \| ([0-9.]+%) \|$",
            docs, re.M):
        longest[(m, card, int(host), tech)] = (int(T), step, f"{hidden} s, {share}")
    by_flags = {" ".join(f): t for t, f in lt.TECHNIQUES.items()}
    ring = {int(T.replace(",", "")): (gib, step) for T, gib, step in re.findall(
        r"^\| ([0-9,]+) \| 8 \| 1 \| 1 \| ([0-9.]+) \| yes \| ([0-9.]+) \|", (REPO / "docs/context-parallel.md").read_text(), re.M)}
    name = {e: m for m, e in lt.MODELS.items()}
    checked_ring, checked = 0, set()
    for model, where, settings, T, step, opt in rows:
        T = int(T.replace(",", ""))
        gib = re.search(r"([0-9.]+) GiB per GPU", settings)
        if gib:  # the rows of docs/context-parallel.md
            assert model == "d48" and "--context-parallel 8" in where and ring.get(T) == (gib.group(1), step), (where, settings, T, ring)
            checked_ring += 1
            continue
        flags = re.sub(r"\s*\(segments\)$", "", settings.strip()).strip("`").replace(" --context-parallel 8 -z 1", "")
        card = "8x141GB" if where.startswith("eight") else "80GB" if "80 GB H100" in where else "141GB"
        assert card != "8x141GB" or "--context-parallel 8 -z 1" in settings, settings
        host = re.search(r"\+ (\d+) GiB host memory", where)
        assert bool(host) == ("--offload" in flags), (where, settings)
        key = (name[model], card, int(host.group(1)) if host else 120, by_flags[flags])
        assert longest[key] == (T, step, opt.strip()), (key, T, step, opt, longest.get(key))
        checked.add(key)
    assert checked_ring == 2
    assert {("1.5B", "141GB", 120, "every"), ("llama3.1-8b", "141GB", 120, "optimizer"), ("llama3.1-8b", "80GB", 256, "every")} <= checked
