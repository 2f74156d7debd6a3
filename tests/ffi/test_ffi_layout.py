"""Check ggml_ffi's cffi declarations against the C compiler's view of the
headers of the libggml actually loaded (the pinned ggml built for this machine,
or the fallback libggml-python wheel; each has its own generated cdef).

cffi in ABI mode computes struct layouts and takes enum values from
ggml_ffi/_cdef.h alone; nothing checks them against the real headers at run
time. A wrong offset or enum value reads and writes the wrong bytes silently.
So here a C program generated from the cdef prints, as gcc sees the real
headers, the size/alignment of every complete struct, union and typedef, the
offset and size of every field, the value of every enum constant and a few
macros; every one is compared with what cffi computed. New declarations in the
cdef are covered without editing this file.
"""
from __future__ import annotations

import difflib
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

import ggml_ffi  # noqa: E402
from ggml_ffi import core, gen_cdef  # noqa: E402
from ggml_ffi._loader import _CDEF, ORIGIN, include_path, lib, library_path  # noqa: E402
from ggml_ffi._loader import ffi as loaded_ffi  # noqa: E402

import cffi  # noqa: E402

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

CDEF_TEXT = _CDEF.read_text()
# The loaded ffi is usually cffi's out-of-line form of the cdef (ggml_ffi/_loader.py), whose struct
# types cannot be introspected (`.fields` of an opaque one trips an assertion in cffi): the checks
# against C read the cdef parsed here, and test_loaded_declarations_are_the_parsed_ones ties the two.
ffi = cffi.FFI()
ffi.cdef(CDEF_TEXT)

# Enum families the binding relies on; each must be present in the cdef.
REQUIRED_ENUM_PREFIXES = (
    "GGML_OP_", "GGML_UNARY_OP_", "GGML_GLU_OP_", "GGML_TYPE_", "GGML_STATUS_",
    "GGML_TENSOR_FLAG_", "GGML_LOG_LEVEL_", "GGML_PREC_",
)
# core.py hardcodes these; the cdef's array sizes are literals derived from them.
HARDCODED_MACROS = {
    "GGML_MAX_DIMS": core.MAX_DIMS,
    "GGML_MAX_SRC": core.MAX_SRC,
    "GGML_MAX_OP_PARAMS": core.MAX_OP_PARAMS,
    "GGML_MAX_NAME": core.MAX_NAME,
}
EXPECTED_HARDCODED = {"GGML_MAX_DIMS": 4, "GGML_MAX_SRC": 10, "GGML_MAX_OP_PARAMS": 64, "GGML_MAX_NAME": 64}
OTHER_MACROS = (
    "GGML_KQ_MASK_PAD", "GGML_MAX_PARAMS", "GGML_MAX_N_THREADS", "GGML_DEFAULT_N_THREADS",
    "GGML_DEFAULT_GRAPH_SIZE", "GGML_MROPE_SECTIONS", "GGML_EXIT_SUCCESS", "GGML_EXIT_ABORTED",
)


# ---------------------------------------------------------------- the cdef side

def _aggregates() -> list[tuple[str, object]]:
    """(C type expression, cffi type) of every struct/union the cdef defines
    completely, named or reached only through a typedef (`typedef struct {...} T`)."""
    typedefs, structs, unions = ffi.list_types()
    out, seen = [], set()
    for kind, names in (("struct", structs), ("union", unions)):
        for name in names:
            t = ffi.typeof(f"{kind} {name}")
            if t.fields is not None:
                out.append((f"{kind} {name}", t))
                seen.add(t.cname)
    for name in typedefs:
        t = ffi.typeof(name)
        if t.kind in ("struct", "union") and t.fields is not None and t.cname not in seen:
            out.append((name, t))
            seen.add(t.cname)
    return out


def _named_enums() -> list[str]:
    return sorted(set(re.findall(r"\benum\s+(\w+)\s*\{", CDEF_TEXT)))


def _enum_constants() -> dict[str, int]:
    """Every integer constant the cdef gives cffi: named and anonymous enums'
    members, and any #define that survived into the cdef."""
    names: set[str] = set()
    for enum in _named_enums():
        names.update(ffi.typeof(f"enum {enum}").relements)
    for body in re.findall(r"\benum\s*\{([^}]*)\}", CDEF_TEXT):
        names.update(m.group(1) for m in re.finditer(r"(?:^|,)\s*([A-Za-z_]\w*)", body))
    names.update(getattr(getattr(ffi, "_parser", None), "_int_constants", {}) or {})
    return {n: getattr(lib, n) for n in sorted(names)}


def _sizeable_typedefs() -> dict[str, int]:
    out = {}
    for name in ffi.list_types()[0]:
        try:
            out[name] = ffi.sizeof(name)
        except (ffi.error, TypeError):  # opaque or function type: no size in C either
            pass
    return out


def _rope_macros() -> list[str]:
    text = (include_path() / "ggml.h").read_text()
    return sorted(set(re.findall(r"^\s*#\s*define\s+(GGML_ROPE_TYPE_\w+)\s", text, re.M)))


AGGREGATES = _aggregates()
ENUMS = _named_enums()
CONSTANTS = _enum_constants()
TYPEDEFS = _sizeable_typedefs()
MACROS = sorted(set(HARDCODED_MACROS) | set(OTHER_MACROS) | set(_rope_macros()))


# ---------------------------------------------------------------- the C side

def _c_checks() -> list[tuple[tuple[str, ...], str]]:
    """(key, C statement) pairs, one statement per line of the program."""
    checks = []
    for expr, t in AGGREGATES:
        checks.append((("S", expr),
                       f'printf("S\\t{expr}\\t%zu\\t%zu\\n", sizeof({expr}), (size_t)_Alignof({expr}));'))
        for fname, f in t.fields:
            if not fname or f.bitsize != -1:
                continue  # no offsetof for bitfields or unnamed members
            checks.append((("F", expr, fname),
                           f'printf("F\\t{expr}\\t{fname}\\t%zu\\t%zu\\n", offsetof({expr}, {fname}), '
                           f"sizeof((({expr} *)0)->{fname}));"))
    for enum in ENUMS:
        checks.append((("Z", enum), f'printf("Z\\t{enum}\\t%zu\\n", sizeof(enum {enum}));'))
    for name in CONSTANTS:
        checks.append((("E", name), f'printf("E\\t{name}\\t%lld\\n", (long long)({name}));'))
    for name in TYPEDEFS:
        checks.append((("T", name), f'printf("T\\t{name}\\t%zu\\n", sizeof({name}));'))
    return checks


def _c_program(checks, dropped) -> tuple[str, dict[int, tuple[str, ...]]]:
    """The program's text and which check each line number holds."""
    lines = ["#include <stdio.h>", "#include <stddef.h>"]
    lines += [f'#include "{h}"' for h in gen_cdef.HEADERS]
    lines += ["int main(void) {"]
    where = {}
    for key, stmt in checks:
        if key in dropped:
            continue
        lines.append("    " + stmt)
        where[len(lines)] = key
    for name in MACROS:
        lines += [f"#ifdef {name}", f'    printf("M\\t{name}\\t%lld\\n", (long long)({name}));',
                  "#else", f'    printf("M\\t{name}\\t-\\n");', "#endif"]
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines), where


@pytest.fixture(scope="module")
def c_facts(tmp_path_factory):
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed")
    tmp = tmp_path_factory.mktemp("ffi_layout")
    src, exe = tmp / "layout.c", tmp / "layout"
    checks = _c_checks()
    # A declaration the headers lack fails to compile; drop such lines, note why, retry,
    # so that one stale name is reported alongside every other mismatch.
    rejected: dict[tuple[str, ...], str] = {}
    for _ in range(10):
        text, where = _c_program(checks, rejected)
        src.write_text(text)
        cc = subprocess.run([gcc, "-std=gnu11", "-O0", f"-I{include_path()}", str(src), "-o", str(exe)],
                            capture_output=True, text=True)
        if cc.returncode == 0:
            break
        errors = re.findall(rf"^{re.escape(str(src))}:(\d+):\d+: error: (.*)$", cc.stderr, re.M)
        bad = {where[int(n)]: msg for n, msg in errors if int(n) in where}
        assert bad, f"gcc failed on the generated {src}:\n{cc.stderr[-6000:]}"
        for key, msg in bad.items():
            rejected.setdefault(key, msg)
    else:
        pytest.fail(f"gcc still fails on the generated {src}:\n{cc.stderr[-6000:]}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    facts: dict[str, dict] = {k: {} for k in "SFZETM"}
    facts["rejected"] = rejected
    for line in run.stdout.splitlines():
        tag, *rest = line.split("\t")
        if tag == "S":
            facts["S"][rest[0]] = (int(rest[1]), int(rest[2]))
        elif tag == "F":
            facts["F"][(rest[0], rest[1])] = (int(rest[2]), int(rest[3]))
        elif tag == "M":
            facts["M"][rest[0]] = None if rest[1] == "-" else int(rest[1])
        else:
            facts[tag][rest[0]] = int(rest[1])
    return facts


def _c_value(c_facts, key: tuple[str, ...]):
    """The C side's value for a check, or why there is none."""
    table = c_facts[key[0]]
    k = key[1] if len(key) == 2 else key[1:]
    if k in table:
        return table[k]
    if key in c_facts["rejected"]:
        return f"<rejected by gcc: {c_facts['rejected'][key]}>"
    return "<not printed>"


def _report(what: str, mismatches: list[str]) -> str:
    return f"{len(mismatches)} {what} mismatch(es) between ggml_ffi/_cdef.h and the C headers:\n  " + \
        "\n  ".join(mismatches)


# ---------------------------------------------------------------- tests

def test_cdef_declares_the_expected_aggregates():
    # the cffi enumeration must agree with the text, so nothing is skipped unnoticed
    named = {f"{k} {n}" for k, n in re.findall(r"\b(struct|union)\s+(\w+)\s*\{", CDEF_TEXT)}
    found_named = {expr for expr, _ in AGGREGATES if " " in expr}
    assert named == found_named, f"cdef text vs cffi: only in text {named - found_named}, " \
        f"only in cffi {found_named - named}"
    anon = len(re.findall(r"\btypedef\s+(?:struct|union)\s*\{", CDEF_TEXT))
    found_anon = sum(" " not in expr for expr, _ in AGGREGATES)
    assert anon == found_anon, f"{anon} anonymous typedef'd aggregates in the text, {found_anon} via cffi"
    assert "struct ggml_tensor" in found_named


def test_struct_layouts_match_c(c_facts):
    bad = []
    for expr, t in AGGREGATES:
        c = _c_value(c_facts, ("S", expr))
        py = (ffi.sizeof(t), ffi.alignof(t))
        if c != py:
            bad.append(f"{expr}: sizeof/alignof C={c} cffi={py}")
        for fname, f in t.fields:
            if not fname or f.bitsize != -1:
                bad.append(f"{expr}.{fname or '<unnamed>'}: bitfield/unnamed member, cannot be checked")
                continue
            cf = _c_value(c_facts, ("F", expr, fname))
            pf = (f.offset, ffi.sizeof(f.type))
            if cf != pf:
                bad.append(f"{expr}.{fname} ({f.type.cname}): offset/size C={cf} cffi={pf}")
    assert not bad, _report("struct layout", bad)


def test_loaded_declarations_are_the_parsed_ones():
    bad = []
    for expr, t in AGGREGATES:
        if (loaded_ffi.sizeof(expr), loaded_ffi.alignof(expr)) != (ffi.sizeof(t), ffi.alignof(t)):
            bad.append(f"{expr}: sizeof/alignof loaded={loaded_ffi.sizeof(expr), loaded_ffi.alignof(expr)}")
        for fname, f in t.fields:
            if fname and f.bitsize == -1 and loaded_ffi.offsetof(expr, fname) != f.offset:
                bad.append(f"{expr}.{fname}: offset loaded={loaded_ffi.offsetof(expr, fname)} parsed={f.offset}")
    bad += [f"sizeof({name}): loaded={loaded_ffi.sizeof(name)} parsed={size}"
            for name, size in TYPEDEFS.items() if loaded_ffi.sizeof(name) != size]
    bad += [f"sizeof(enum {e})" for e in ENUMS if loaded_ffi.sizeof(f"enum {e}") != ffi.sizeof(f"enum {e}")]
    assert not bad, _report("loaded declaration", bad)


def test_typedef_and_enum_sizes_match_c(c_facts):
    bad = []
    for name, size in TYPEDEFS.items():
        if _c_value(c_facts, ("T", name)) != size:
            bad.append(f"sizeof({name}): C={_c_value(c_facts, ('T', name))} cffi={size}")
    for enum in ENUMS:
        size = ffi.sizeof(f"enum {enum}")
        if _c_value(c_facts, ("Z", enum)) != size:
            bad.append(f"sizeof(enum {enum}): C={_c_value(c_facts, ('Z', enum))} cffi={size}")
    assert not bad, _report("size", bad)


def test_enum_constants_match_c(c_facts):
    missing = [p for p in REQUIRED_ENUM_PREFIXES if not any(n.startswith(p) for n in CONSTANTS)]
    assert not missing, f"the cdef has no constants for {missing}"
    bad = [f"{name}: C={_c_value(c_facts, ('E', name))} cffi={value}"
           for name, value in CONSTANTS.items() if _c_value(c_facts, ("E", name)) != value]
    assert not bad, _report("enum constant", bad)


def test_macros_match_c(c_facts):
    macros = c_facts["M"]
    print("C macro values:", ", ".join(f"{k}={'undefined' if v is None else v}" for k, v in macros.items()))
    bad = []
    for name, hard in HARDCODED_MACROS.items():
        if not macros.get(name) == hard == EXPECTED_HARDCODED[name]:
            bad.append(f"{name}: C={macros.get(name)} core.py={hard} expected={EXPECTED_HARDCODED[name]}")
    rope = [n for n in macros if n.startswith("GGML_ROPE_TYPE_")]
    if "GGML_ROPE_TYPE_NEOX" not in rope or macros["GGML_ROPE_TYPE_NEOX"] is None:
        bad.append("GGML_ROPE_TYPE_NEOX is not defined by ggml.h")
    for name, value in macros.items():  # macros that made it into the cdef must agree
        if value is not None and name in CONSTANTS and CONSTANTS[name] != value:
            bad.append(f"{name}: C={value} cffi={CONSTANTS[name]}")
    # the cdef's literal array sizes must follow the macros
    fields = dict(ffi.typeof("struct ggml_tensor").fields)
    for field, macro, size in (("ne", "GGML_MAX_DIMS", lambda f: f.type.length),
                               ("nb", "GGML_MAX_DIMS", lambda f: f.type.length),
                               ("src", "GGML_MAX_SRC", lambda f: f.type.length),
                               ("name", "GGML_MAX_NAME", lambda f: f.type.length),
                               ("op_params", "GGML_MAX_OP_PARAMS", lambda f: ffi.sizeof(f.type))):
        if size(fields[field]) != macros.get(macro):
            bad.append(f"ggml_tensor.{field}: cdef extent {size(fields[field])} != {macro}={macros.get(macro)}")
    assert not bad, _report("macro", bad)


def test_exactly_one_copy_of_each_libggml_is_loaded():
    backend = ggml_ffi.CpuBackend()
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    finally:
        backend.close()
    paths = sorted({line.split(None, 5)[5].strip() for line in maps.splitlines()
                    if len(line.split(None, 5)) == 6 and "libggml" in line.split(None, 5)[5]})
    groups = {"libggml-base": r"^libggml-base\.so", "libggml-cpu": r"^libggml-cpu", "libggml": r"^libggml\.so"}
    found = {g: [p for p in paths if re.match(rx, os.path.basename(p))] for g, rx in groups.items()}
    bad = [f"{g}: {len(ps)} distinct mappings {ps}" for g, ps in found.items() if len(ps) != 1]
    if found["libggml"] and found["libggml"][0] != os.path.realpath(library_path()):
        bad.append(f"libggml mapped from {found['libggml'][0]}, expected {library_path()}")
    assert not bad, "libggml libraries loaded wrongly:\n  " + "\n  ".join(bad) + \
        "\nall libggml mappings:\n  " + "\n  ".join(paths)


def test_gen_cdef_reproduces_committed_cdef(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    out = tmp_path / "_cdef.h"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "ggml_ffi.gen_cdef", "--origin", ORIGIN.kind, str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, f"gen_cdef failed:\n{run.stdout}\n{run.stderr}"
    new = out.read_text()
    if new != CDEF_TEXT:
        diff = list(difflib.unified_diff(CDEF_TEXT.splitlines(), new.splitlines(),
                                         "committed _cdef.h", "regenerated", lineterm=""))
        pytest.fail(f"ggml_ffi/_cdef.h is stale; run `python -m ggml_ffi.gen_cdef` ({len(diff)} diff lines):\n"
                    + "\n".join(diff[:300]))
