"""The package's import graph has no circles, and each room imports only the rooms the map in CONTRIBUTING.md ("The
rooms") lists before it (or modules of its own row): the map is read from that file, so it cannot drift from the code.

Every import counts, at the top of a module or inside a function: an import deferred to call time is still a
dependency, and a circle through one means two rooms that cannot be understood, tested or changed apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"klevict_cli": ROOT / "klevict_cli", "klevict_kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (`from package import module` counts as importing the module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def rooms() -> dict[str, int]:
    """module -> its row in CONTRIBUTING.md's map of the rooms (`kernels/`, `policies/`: every module inside)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text.split("## The rooms", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    modules = _modules()
    found = {}
    for n, row in enumerate(rows):
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if name.endswith("/"):
                prefix = "klevict_kernels" if name == "kernels/" else f"klevict_cli.{name.strip('/')}"
                found.update({m: n for m in modules if m == prefix or m.startswith(prefix + ".")})
            else:
                found[f"klevict_cli.{name.removesuffix('.py')}"] = n
    return found


def test_the_graph_sees_imports_inside_functions_and_finds_a_circle():
    """The check itself: a deferred import is an edge, and two modules importing each other are a circle."""
    graph = import_graph()
    assert "klevict_cli.engine" in graph["klevict_cli.adapter_check"]  # imported at the top
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_the_package_imports_itself_back():
    assert circles(import_graph()) == []


def test_every_room_imports_only_the_rooms_before_it_on_the_map():
    graph, row = import_graph(), rooms()
    row["klevict_cli"] = -1  # the package itself: its version only
    row["klevict_cli.__main__"] = len(row)  # `python -m klevict_cli`: the CLI
    assert sorted(set(graph) - set(row)) == []  # every module is on the map
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if row[b] > row[a])
    assert upward == []
