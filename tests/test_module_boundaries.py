"""The shape docs/architecture.md promises, read from the source itself (ast,
no imports): no import circles between the product's modules, no module
importing another's private names, the coordinator importing none of the
daemon's own modules, and nothing in the product importing from bench/."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "rpc_daemon", "ggml_ffi")
# the daemon's own rooms: the coordinator reaches a worker through rpc_daemon.client and rpc_daemon.wire only
DAEMON_ONLY = ("rpc_daemon.daemon", "rpc_daemon.validation", "rpc_daemon.compute")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if "_ggml" not in p.parts}


MODULES = product_modules()


def runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (annotations only: no import at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *runtime_nodes(child)])
            continue
        yield node
        yield from runtime_nodes(node)


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(module, names) for every import in the file that runs, at any depth (a function-level import is
    one too)."""
    found = []
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [alias.name for alias in node.names]
            # `from package import module` imports the module
            found += [(f"{node.module}.{n}", []) for n in names if f"{node.module}.{n}" in MODULES]
            found.append((node.module, [n for n in names if f"{node.module}.{n}" not in MODULES]))
    return found


def resolve(name: str) -> str | None:
    """The product module `name` is, or lies in (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def graph() -> dict[str, set[str]]:
    edges = {}
    for mod, path in MODULES.items():
        targets = {resolve(m) for m, _ in imports(path)}
        # a package's __init__ is no edge of its own modules' (it gathers them)
        edges[mod] = {t for t in targets if t and t != mod and not mod.startswith(t + ".")}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert cycles(graph()) == []


def test_no_module_imports_another_modules_private_names():
    offenders = [f"{mod} imports {name} from {target}" for mod, path in MODULES.items()
                 for target, names in imports(path) if resolve(target) not in (None, mod)
                 for name in names if name.startswith("_") and not name.startswith("__")]
    assert offenders == []


@pytest.mark.parametrize("package", ["coordinator"])
def test_the_coordinator_imports_no_daemon_only_module(package):
    offenders = [f"{mod} imports {target}" for mod, path in MODULES.items() if mod.startswith(package)
                 for target, _ in imports(path) if target.startswith(DAEMON_ONLY)]
    assert offenders == []


def test_nothing_in_the_product_imports_from_bench():
    offenders = [f"{mod} imports {target}" for mod, path in MODULES.items() for target, _ in imports(path)
                 if target == "bench" or target.startswith("bench.")]
    offenders += [f"{mod} reads {path.name} by path" for mod, path in MODULES.items()
                  if "bench/" in path.read_text() and "spec_from_file_location" in path.read_text()]
    assert offenders == []
