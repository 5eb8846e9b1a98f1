#!/usr/bin/env python3
"""transform.py: rewrites remat's CUDA sources for the CPU emulator (dev/emu).

Why it exists: the host C++ compiler cannot parse CUDA's kernel launch syntax,
and the emulator needs a hook at a few CUDA constructs. This script copies the
sources into a build directory (never into the source tree) and rewrites, in
code only (comments and string literals are left alone):

  kernel<<<grid, block[, smem[, stream]]>>>(args)
      -> emu_launch(emu::Site{"kernel", __FILE__, __LINE__}, (grid), (block),
                    (smem), (stream), kernel, args)
     for any callee: a plain or qualified name, with template arguments
     (nested too), the configuration and arguments over several lines;
  __shared__ T a[..], b[..];    (static shared memory)
      -> the same, followed by emu_shared_use(&a, sizeof(a)); ... so the
         emulator can poison it before every block;
  extern __shared__ T name[];   (dynamic shared memory)
      -> T* name = (T*)emu_dynamic_shared();
  __launch_bounds__(N[, M]) kernel(...) {
      -> the same with emu_launch_bounds(N); first in the body.

Every rewrite keeps the line count (a removed newline is put back after the
replacement) and each file starts with a #line directive naming the original,
so compiler messages and __FILE__/__LINE__ point into the real sources.

It fails loudly (exit status 1, file:line and the reason) on a construct it
cannot rewrite, and checks its output: no '<<<' may remain in code.

usage: transform.py SRC_ROOT OUT_DIR [--stamp FILE]   (SRC_ROOT/*.{c,cu,h,cuh,cpp,hpp} and SRC_ROOT/llmc/)
       transform.py --file IN OUT                      (one file, for tests)
Files are written only when their content changes, and --stamp FILE is
touched only then (or when missing), so make rebuilds only after real changes.
"""
import os
import re
import sys

SOURCE_EXTS = (".c", ".cu", ".h", ".cuh", ".cpp", ".hpp")


class TransformError(Exception):
    pass


def mask_code(text, strings=True):
    """The text with comments (and, if strings, string/char literals) blanked, newlines kept: same length, same offsets."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a, b):
        for j in range(a, b):
            if out[j] != "\n":
                out[j] = " "

    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            while j > 0 and text[j - 1] == "\\" and j < n:  # a comment continued with backslash-newline
                k = text.find("\n", j + 1)
                j = n if k < 0 else k
            blank(i, j)
            i = j
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            if j < 0:
                raise TransformError(f"unterminated comment at offset {i}")
            blank(i, j + 2)
            i = j + 2
        elif c == "R" and i + 1 < n and text[i + 1] == '"' and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^()\\ ]{0,16})\(', text[i:])
            if not m:
                raise TransformError(f"malformed raw string at offset {i}")
            end = text.find(")" + m.group(1) + '"', i)
            if end < 0:
                raise TransformError(f"unterminated raw string at offset {i}")
            end += len(m.group(1)) + 2
            if strings:
                blank(i + 1, end)
            i = end
        elif c in "\"'":
            if c == "'" and re.match(r"[0-9a-fA-F]", text[i + 1:i + 2]) and re.search(r"\b[0-9][0-9a-fA-FxXbB']*$", text[max(0, i - 40):i]):
                i += 1  # a C++14 digit separator (1'000'000)
                continue
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    raise TransformError(f"unterminated literal at offset {i}")
                j += 1
            if strings:
                blank(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


OPEN, CLOSE = "([{", ")]}"


def split_spans(s, angles=False):
    """(start, end) of the parts of s between commas outside (), [], {} (and <> when angles)."""
    spans, depth, angle, begin = [], 0, 0, 0
    for i, ch in enumerate(s):
        if ch in OPEN:
            depth += 1
        elif ch in CLOSE:
            depth -= 1
        elif angles and depth == 0 and ch == "<" and s[i - 1:i] != "<" and s[i + 1:i + 2] not in ("<", "="):
            angle += 1
        elif angles and depth == 0 and ch == ">" and angle > 0 and s[i - 1:i] != "-":
            angle -= 1
        elif ch == "," and depth == 0 and angle == 0:
            spans.append((begin, i))
            begin = i + 1
    spans.append((begin, len(s)))
    return spans


def split_top(s, angles=False):
    return [s[a:b].strip() for a, b in split_spans(s, angles)]


def match_forward(code, i):
    """Index just past the bracket matching code[i] (one of ([{)."""
    depth = 0
    for j in range(i, len(code)):
        if code[j] in OPEN:
            depth += 1
        elif code[j] in CLOSE:
            depth -= 1
            if depth == 0:
                return j + 1
    raise TransformError(f"unbalanced '{code[i]}'")


def callee_start(code, end):
    """Start of the launched expression that ends just before `end`: a qualified name with optional template arguments."""
    i = end
    while i > 0 and code[i - 1].isspace():
        i -= 1
    if i > 0 and code[i - 1] == ">":  # template arguments: walk back to the matching '<' (angles inside () [] ignored)
        angle, paren = 0, 0
        j = i - 1
        while j >= 0:
            ch = code[j]
            if ch in ")]":
                paren += 1
            elif ch in "([":
                paren -= 1
            elif paren == 0 and ch == ">":
                angle += 1
            elif paren == 0 and ch == "<":
                angle -= 1
                if angle == 0:
                    break
            j -= 1
        if j < 0 or paren != 0:
            raise TransformError("unbalanced template arguments before '<<<'")
        i = j
        while i > 0 and code[i - 1].isspace():
            i -= 1
    m = re.search(r"((?:::\s*)?[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)*)$", code[max(0, i - 4000):i])
    if not m:
        raise TransformError("a kernel launch whose callee is not a (qualified, possibly templated) name")
    return max(0, i - 4000) + m.start(1)


def rewrite_launches(text, code):
    plain = mask_code(text, strings=False)  # comments blanked, literals kept: what goes into the rewritten call
    out, pos = [], 0
    for m in re.finditer(r"<<<", code):
        start = m.start()
        if start < pos:
            continue
        try:
            cs = callee_start(code, start)
            callee = plain[cs:start].strip()
            # the configuration: up to the first '>>>' outside brackets
            depth, j = 0, m.end()
            while j < len(code):
                ch = code[j]
                if ch in OPEN:
                    depth += 1
                elif ch in CLOSE:
                    depth -= 1
                elif depth == 0 and code.startswith(">>>", j):
                    break
                j += 1
            else:
                raise TransformError("no '>>>' closing the launch configuration")
            config, config_code = plain[m.end():j], code[m.end():j]
            k = j + 3
            while k < len(code) and code[k].isspace():
                k += 1
            if k >= len(code) or code[k] != "(":
                raise TransformError("'>>>' not followed by the kernel's argument list")
            close = match_forward(code, k)
            no_args = code[k + 1:close - 1].strip() == ""
            parts = [config[a:b].strip() for a, b in split_spans(config_code)]
            if not 2 <= len(parts) <= 4 or "" in parts:
                parts = [config[a:b].strip() for a, b in split_spans(config_code, angles=True)]
            if not 2 <= len(parts) <= 4 or "" in parts:
                raise TransformError(f"launch configuration <<<{config.strip()}>>> does not have 2 to 4 arguments")
            grid, block = parts[0], parts[1]
            smem = parts[2] if len(parts) > 2 else "0"
            stream = parts[3] if len(parts) > 3 else "(cudaStream_t)0"
        except TransformError as e:
            raise TransformError(f"line {line_of(text, start)}: {e}") from None
        name = re.sub(r"\s+", " ", callee).replace("\\", "\\\\").replace('"', '\\"')
        replaced = text[cs:k + 1]
        rep = (f'emu_launch(emu::Site{{"{name}", __FILE__, __LINE__}}, ({grid}), ({block}), ({smem}), ({stream}), {callee}'
               + ("" if no_args else ", "))
        # keep the line count; inside a macro the newlines are backslash continuations and stay so
        continued = replaced.count("\\\n")
        rep = rep.replace("\\\n", " ").replace("\n", " ") + "\\\n" * continued + "\n" * (replaced.count("\n") - continued)
        out.append(text[pos:cs])
        out.append(rep)
        pos = k + 1
    out.append(text[pos:])
    return "".join(out)


def statement_end(code, i):
    """Index of the ';' ending the statement that starts at i (outside brackets)."""
    depth = 0
    for j in range(i, len(code)):
        ch = code[j]
        if ch in OPEN:
            depth += 1
        elif ch in CLOSE:
            depth -= 1
            if depth < 0:
                break
        elif ch == ";" and depth == 0:
            return j
    raise TransformError("no ';' ending the declaration")


def declarator_name(piece):
    """Name declared by one declarator (with or without the leading type): the last identifier before any '[' or '='."""
    head = re.split(r"[\[=]", piece, maxsplit=1)[0]
    head = re.sub(r"__align__\s*\([^)]*\)", " ", head)
    head = re.sub(r"__attribute__\s*\(\(.*?\)\)", " ", head)
    ids = re.findall(r"[A-Za-z_]\w*", head)
    if not ids:
        raise TransformError(f"cannot find the name declared in '{piece.strip()}'")
    return ids[-1]


def rewrite_shared(text, code):
    out, pos = [], 0
    for m in re.finditer(r"\b__shared__\b", code):
        if m.start() < pos:
            continue
        try:
            line_start = code.rfind("\n", 0, m.start()) + 1
            if code[line_start:m.start()].lstrip().startswith("#"):
                raise TransformError("__shared__ inside a preprocessor directive is not supported")
            # extern __shared__: dynamic shared memory
            before = re.search(r"\bextern\s+$", code[:m.start()])
            if before:
                end = statement_end(code, m.end())
                decl = text[m.end():end]
                decl_code = code[m.end():end]
                d = re.match(r"^(.*?)\b([A-Za-z_]\w*)\s*\[\s*\]\s*$", re.sub(r"__align__\s*\([^)]*\)", " ", decl_code), re.S)
                if not d:
                    raise TransformError(f"extern __shared__ declaration '{decl.strip()}' is not 'T name[]'")
                typ, name = d.group(1).strip(), d.group(2)
                rep = f"{typ}* {name} = ({typ}*)emu_dynamic_shared();"
                rep += "\n" * text[before.start():end + 1].count("\n")
                out.append(text[pos:before.start()])
                out.append(rep)
                pos = end + 1
                continue
            end = statement_end(code, m.end())
            pieces = split_top(code[m.end():end], angles=True)
            names = [declarator_name(p) for p in pieces]
        except TransformError as e:
            raise TransformError(f"line {line_of(text, m.start())}: {e}") from None
        out.append(text[pos:end + 1])
        out.append("".join(f" emu_shared_use(&{n}, sizeof({n}));" for n in names))
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


def rewrite_launch_bounds(text, code):
    out, pos = [], 0
    for m in re.finditer(r"\b__launch_bounds__\s*\(", code):
        if m.start() < pos:
            continue
        try:
            args_end = match_forward(code, m.end() - 1)
            args = split_top(code[m.end():args_end - 1], angles=True)
            if not 1 <= len(args) <= 3 or not args[0]:
                raise TransformError("__launch_bounds__ needs 1 to 3 arguments")
            maxthreads = text[m.end():args_end - 1]
            maxthreads = split_top(maxthreads, angles=True)[0]
            p = code.find("(", args_end)
            if p < 0:
                raise TransformError("no parameter list after __launch_bounds__")
            if not re.fullmatch(r"\s*[A-Za-z_]\w*\s*", code[args_end:p]):
                raise TransformError("__launch_bounds__ not followed by the kernel's name")
            q = match_forward(code, p)
            r = q
            while r < len(code) and code[r].isspace():
                r += 1
            if r < len(code) and code[r] == ";":  # a declaration
                continue
            if r >= len(code) or code[r] != "{":
                raise TransformError("no body after the kernel's parameter list")
        except TransformError as e:
            raise TransformError(f"line {line_of(text, m.start())}: {e}") from None
        out.append(text[pos:r + 1])
        out.append(f" emu_launch_bounds((long)({maxthreads.strip()}));")
        pos = r + 1
    out.append(text[pos:])
    return "".join(out)


def transform_text(text, origin):
    """The rewritten text of one file; raises TransformError."""
    for step in (rewrite_launches, rewrite_shared, rewrite_launch_bounds):
        text = step(text, mask_code(text))
    code = mask_code(text)
    left = code.find("<<<")
    if left >= 0:
        raise TransformError(f"line {line_of(code, left)}: a '<<<' was not rewritten")
    origin = origin.replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{origin}"\n' + text


def write_if_changed(path, text):
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return False
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


def source_files(root):
    files = [f for f in sorted(os.listdir(root)) if f.endswith(SOURCE_EXTS) and os.path.isfile(os.path.join(root, f))]
    llmc = os.path.join(root, "llmc")
    for dirpath, _dirs, names in os.walk(llmc):
        for f in sorted(names):
            if f.endswith(SOURCE_EXTS):
                files.append(os.path.relpath(os.path.join(dirpath, f), root))
    return files


def transform_tree(root, out):
    root, out = os.path.abspath(root), os.path.abspath(out)
    if out == root or out.startswith(os.path.join(root, "llmc")):
        raise TransformError(f"refusing to write into the source tree ({out})")
    wanted, errors, changed = set(), [], 0
    for rel in source_files(root):
        src = os.path.join(root, rel)
        with open(src, encoding="utf-8") as f:
            text = f.read()
        try:
            new = transform_text(text, src)
        except TransformError as e:
            errors.append(f"{src}: {e}")
            continue
        wanted.add(rel)
        changed += write_if_changed(os.path.join(out, rel), new)
    if errors:
        raise TransformError("\n".join(errors))
    for dirpath, _dirs, names in os.walk(out):  # files of sources that no longer exist
        for f in names:
            rel = os.path.relpath(os.path.join(dirpath, f), out)
            if f.endswith(SOURCE_EXTS) and rel not in wanted:
                os.remove(os.path.join(dirpath, f))
    return len(wanted), changed


def main(argv):
    try:
        if len(argv) == 4 and argv[1] == "--file":
            with open(argv[2], encoding="utf-8") as f:
                write_if_changed(argv[3], transform_text(f.read(), os.path.abspath(argv[2])))
            return 0
        stamp = None
        if len(argv) == 5 and argv[3] == "--stamp":
            stamp = argv[4]
            argv = argv[:3]
        if len(argv) != 3:
            print(__doc__.strip().split("\n\n")[-2], file=sys.stderr)
            return 2
        n, changed = transform_tree(argv[1], argv[2])
        if stamp and (changed or not os.path.exists(stamp)):
            with open(stamp, "w") as f:
                f.write(f"{n} files\n")
        if changed or not stamp:
            print(f"transform.py: {n} files into {argv[2]} ({changed} changed)")
        return 0
    except TransformError as e:
        print(f"transform.py: error:\n{e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
