"""dev/emu/transform.py, which rewrites the CUDA sources' kernel launches and
shared-memory declarations into calls the emulator's runtime takes: every
launch form, a launch in a macro, the forms it must refuse, and the current
sources whole."""
import importlib.util
import re
import subprocess
import sys

import pytest

from conftest import REPO
from emu_support import EMU

def load_transform():
    spec = importlib.util.spec_from_file_location("emu_transform", EMU / "transform.py")
    mod = importlib.util.module_from_spec(spec)
    keep, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in dev/emu
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.dont_write_bytecode = keep
    return mod


TRICKY = r'''
// k<<<1, 2>>>(x) in a comment stays
const char* s = "a<<<b>>>c";
void f() {
    k<<<g, b>>>(x, y);
    ns::kern<HS, (A > B ? 1 : 2)><<<grid_for(n, 256), 256, 0, stream>>>(out,
        in);
    k2<<<
        dim3(4, 2), /* block, with a comma */ dim3(32),
        smem>>>();
    ::k3<T><<<a, b, c, s>>>(p->q, r[1]);
}
__global__ void __launch_bounds__(Cfg<A, B>::THREADS, 2)
kern(float* x) {
    __shared__ __align__(16) float a[4][8], b[2];
    extern __shared__ float dyn[];
}
'''


def test_transform_rewrites_every_launch_form():
    t = load_transform()
    out = t.transform_text(TRICKY, "/src/x.cu")
    lines = out.split("\n")
    assert lines[0] == '#line 1 "/src/x.cu"'
    body = "\n".join(lines[1:])
    assert body.count("\n") == TRICKY.count("\n"), "line numbers must not move"
    assert "// k<<<1, 2>>>(x) in a comment stays" in body and '"a<<<b>>>c"' in body
    assert 'emu_launch(emu::Site{"k", __FILE__, __LINE__}, (g), (b), (0), ((cudaStream_t)0), k, x, y);' in body
    assert ('emu_launch(emu::Site{"ns::kern<HS, (A > B ? 1 : 2)>", __FILE__, __LINE__}, (grid_for(n, 256)), (256), (0), (stream), '
            'ns::kern<HS, (A > B ? 1 : 2)>, out,') in body
    assert re.search(r'emu_launch\(emu::Site\{"k2", __FILE__, __LINE__\}, \(dim3\(4, 2\)\), \(dim3\(32\)\), \(smem\), '
                     r'\(\(cudaStream_t\)0\), k2\n\n\);', body)  # the two removed newlines come back after the callee
    assert 'emu_launch(emu::Site{"::k3<T>", __FILE__, __LINE__}, (a), (b), (c), (s), ::k3<T>, p->q, r[1]);' in body
    assert "emu_launch_bounds((long)(Cfg<A, B>::THREADS));" in body
    assert "emu_shared_use(&a, sizeof(a)); emu_shared_use(&b, sizeof(b));" in body
    assert "float* dyn = (float*)emu_dynamic_shared();" in body
    # launches keep their lines
    src_lines = TRICKY.split("\n")
    for i, line in enumerate(src_lines):
        if "k<<<g, b>>>" in line or "::k3<T><<<" in line:
            assert "emu_launch(" in lines[i + 1]


def test_transform_launch_in_a_macro():
    t = load_transform()
    src = "#define LAUNCH(k, n) \\\n    k<<<grid_for(n, \\\n               256), 256>>>(n)\nint x;\n"
    out = t.transform_text(src, "/m.cu").split("\n", 1)[1]
    assert out.count("\n") == src.count("\n")
    assert re.search(r'emu_launch\(emu::Site\{"k", __FILE__, __LINE__\}, \(grid_for\(n, +256\)\), \(256\), \(0\), '
                     r'\(\(cudaStream_t\)0\), k, \\\nn\)\n', out), out
    assert all(line.endswith("\\") for line in out.split("\n")[:2])


@pytest.mark.parametrize("bad, why", [
    ("void f() { (*table[i])<<<1, 32>>>(x); }", "callee"),
    ("void f() { k<<<1>>>(x); }", "2 to 4 arguments"),
    ("void f() { k<<<1, 2, 3, 4, 5>>>(x); }", "2 to 4 arguments"),
    ("void f() { k<<<1, 32>>> x; }", "argument list"),
    ("#define S __shared__ float x[4];\n", "preprocessor"),
])
def test_transform_fails_loudly(bad, why):
    t = load_transform()
    with pytest.raises(t.TransformError, match=why):
        t.transform_text(bad, "/src/bad.cu")


def test_transform_covers_the_sources(tmp_path):
    """Every launch in the current sources is rewritten, nothing is written into the tree."""
    res = subprocess.run([sys.executable, EMU / "transform.py", REPO, tmp_path], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    t = load_transform()
    launches = 0
    for src in [*REPO.glob("*.cu"), *(REPO / "llmc" / "cuda").glob("*.cuh")]:
        code = t.mask_code(src.read_text())
        launches += code.count("<<<")
        out = (tmp_path / src.relative_to(REPO)).read_text()
        assert "<<<" not in t.mask_code(out)
        assert out.count("\n") == src.read_text().count("\n") + 1
    assert launches >= 10
    with pytest.raises(t.TransformError, match="source tree"):
        t.transform_tree(REPO, REPO / "llmc")
