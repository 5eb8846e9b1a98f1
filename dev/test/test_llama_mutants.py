"""The numpy reference of test_llama_reference.py can fail: train_gpt.c with each
of these mistakes, built in a scratch directory, gives a loss numpy's is not
within 1e-5 of, on the case named (tied / untied, rope types chosen so the mistake
shows). The mistakes: RoPE pairing (2j, 2j+1) instead of rotate_half's (j, j +
HD/2); query head h reading K/V head h % NKV instead of h / (NH/NKV); RMSNorm
subtracting the mean; llama3's ramp with its bounds swapped. (RoPE from the local
row instead of the global position under the ring fails test_ring_gradcheck: the
commit that added it says so.)"""
import shutil
import subprocess

import pytest

from conftest import REPO
from test_llama_reference import losses_of

MUTANTS = {
    "interleaved-pairing": ("llama-default-untied", """                    real a = x[j], b = x[j + half], co = cs[j], si = cs[half + j];
                    x[j] = a * co - b * si;
                    x[j + half] = b * co + a * si;""", """                    real a = x[2 * j], b = x[2 * j + 1], co = cs[j], si = cs[half + j];
                    x[2 * j] = a * co - b * si;
                    x[2 * j + 1] = b * co + a * si;"""),
    "kv-head-h-mod-nkv": ("llama-default-untied", "const real* k = kv + ((size_t)b * Tl + a->ki + j) * ld + h / g.group * hs;",
                          "const real* k = kv + ((size_t)b * Tl + a->ki + j) * ld + h % g.NKV * hs;"),
    "rmsnorm-subtracts-mean": ("qwen2-default-untied", """        for (int c = 0; c < C; c++) ss += xr[c] * xr[c];
        ss /= (real)C;
        mean[n] = 0;""", """        real mu = 0;
        for (int c = 0; c < C; c++) mu += xr[c];
        mu /= (real)C;
        for (int c = 0; c < C; c++) ss += (xr[c] - mu) * (xr[c] - mu);
        ss /= (real)C;
        mean[n] = mu;"""),
    "llama3-bounds-swapped": ("llama3-tied", "double low_wavelen = orig / c->rope_low, high_wavelen = orig / c->rope_high;",
                              "double low_wavelen = orig / c->rope_high, high_wavelen = orig / c->rope_low;", "llmc/core/model.h"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutant_fails_the_reference(tmp_path, mutant):
    case, old, new, rel = (*MUTANTS[mutant], "train_gpt.c")[:4]  # the file mutated: train_gpt.c unless named
    src = (REPO / rel).read_text()
    assert src.count(old) == 1, f"the text to mutate is not in {rel} once (the source changed: update the mutant)"
    build = tmp_path / "src"
    build.mkdir()
    shutil.copy(REPO / "train_gpt.c", build / "train_gpt.c")
    shutil.copytree(REPO / "llmc", build / "llmc")  # a copy: the mutant may be in a shared header (rope_frequencies)
    (build / rel).write_text(src.replace(old, new))
    cc = shutil.which("cc") or shutil.which("gcc")
    res = subprocess.run([cc, "-O1", "-std=gnu11", "-fno-math-errno", "-march=native", "-fopenmp", "-o", build / "exe",
                          build / "train_gpt.c", "-lm"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    work = tmp_path / "run"
    work.mkdir()
    loss, expected, _ = losses_of(build / "exe", work, case)
    assert abs(loss - expected) > 1e-5 * expected, f"{mutant}: loss {loss} still matches numpy's {expected}"
