"""Fuzzing of every parser (dev/fuzz): each libFuzzer harness, built with
clang under ASan + UBSan, runs from the committed seed corpus for
REMAT_FUZZ_SECONDS (default 10) and must find nothing: no crash, sanitizer
report, leak or hang. New inputs go to a temporary directory; a crash input
is kept there (named in the failure) for adding to dev/fuzz/corpus/<harness>/
as a regression once fixed. The corpus alone (every committed input, crash
regressions included) also runs on each harness."""
import os
import shutil
import subprocess

import pytest

from conftest import BUILD, REPO

HARNESSES = ["model", "shard", "tokenizer", "state", "done", "flags"]
SECONDS = int(os.environ.get("REMAT_FUZZ_SECONDS", "10"))


def harness(name):
    path = BUILD / f"fuzz_{name}"
    if not path.exists():
        if shutil.which("clang") is None:
            pytest.skip("clang not found: the fuzz harnesses are not built (apt-get install clang; .ci/run does)")
        pytest.fail(f"{path} is not built: run 'make test-bins' (make test does)")
    return path


def fuzz(name, *args, timeout):
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
    return subprocess.run([str(harness(name)), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.parametrize("name", HARNESSES)
def test_seed_corpus_is_clean(name):
    corpus = REPO / "dev" / "fuzz" / "corpus" / name
    assert len(list(corpus.iterdir())) >= 2
    res = fuzz(name, "-runs=0", corpus, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.parametrize("name", HARNESSES)
def test_fuzzing_finds_nothing(name, tmp_path):
    corpus = REPO / "dev" / "fuzz" / "corpus" / name
    (tmp_path / "new").mkdir()
    res = fuzz(name, tmp_path / "new", corpus, f"-max_total_time={SECONDS}", "-timeout=10", "-rss_limit_mb=2048",
               f"-artifact_prefix={tmp_path}/", timeout=SECONDS + 120)
    crashes = [p.name for p in tmp_path.iterdir() if p.is_file()]
    assert res.returncode == 0 and not crashes, f"fuzz_{name} found {crashes} in {tmp_path}:\n{res.stderr[-4000:]}"
    assert "Done" in res.stderr and " runs in " in res.stderr
