"""The project's import graph has no cycle, function-level imports included.

Every ``import`` / ``from ... import`` anywhere in a module (top level, inside functions and
methods) is an edge to the project module it names; importing ``a.b.c`` also runs ``a.b``'s
``__init__``, so it is an edge to the parent packages too (except the importer's own packages,
which are already being imported). Imports under ``if TYPE_CHECKING:`` are left out: they never
run. A package's ``__init__`` importing its own submodules (its face) is not a cycle unless one
of those submodules imports the face back.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "kserve_trio"


def project_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            test = node.test
            name = getattr(test, "id", None) or getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                stack.extend(node.orelse)
                continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_names(module: str, path: pathlib.Path, modules) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in modules else base)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in imported_names(module, path, modules):
            if not name.startswith(PACKAGE):
                continue
            target = owner(name)
            if target is None:
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != module and not module.startswith(dep + "."):
                    graph[module].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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


def test_the_detector_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_count_and_type_checking_ones_do_not(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import kserve_trio.worker\n"
        "def f():\n"
        "    from kserve_trio.core import errors\n"
        "    from . import sibling\n"
    )
    modules = {"kserve_trio.core.errors": None, "kserve_trio.core.sibling": None}
    names = imported_names("kserve_trio.core.probe", source, modules)
    assert names == {"typing", "kserve_trio.core.errors", "kserve_trio.core.sibling"}
    assert len(import_graph()) > 100


def test_the_project_has_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


FACED_PACKAGES = (
    "kserve_trio.core.bundles",
    "kserve_trio.core.memory",
    "kserve_trio.core.process",
    "kserve_trio.core.protocol",
    "kserve_trio.core.tensors",
    "kserve_trio.gateway.fleet",
    "kserve_trio.gateway.placement",
    "kserve_trio.gateway.request_path",
)
"""Packages the rest of the project reaches through their ``__init__`` only."""


def test_faced_packages_are_imported_through_their_face_only():
    graph = import_graph()
    reached_around = sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        for face in FACED_PACKAGES
        if dep.startswith(face + ".") and not module.startswith(face + ".") and module != face
    )
    assert reached_around == [], "imports around a package's face:\n" + "\n".join(reached_around)
