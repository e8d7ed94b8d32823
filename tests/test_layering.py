"""The import graph of ``transfuse/`` against the layer order written in ``docs/architecture.md``.

Every module's imports are read statically (``ast``; imports inside functions count, and so do
imports under ``if TYPE_CHECKING:``, which are left out of circles only). An arrow that runs back
up the order, a circle of imports and a module the table does not place are failures.
``python tests/test_layering.py`` prints the arrows up and the circles.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGE = REPOSITORY / "transfuse"
ARCHITECTURE = REPOSITORY / "docs" / "architecture.md"
UTILITIES = -1  # the layer number of modules any layer may import


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    type_only: bool


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``), for every module under ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST, type_only: bool = False):
    """(import statement, whether it sits under ``if TYPE_CHECKING:``), everywhere in ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
        elif isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.body:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), type_only)
        else:
            yield from _statements(node, type_only)


def _named(name: str, known: dict) -> str | None:
    """The module of ``known`` that importing ``name`` runs: itself, or the nearest package above."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(known: dict[str, tuple[Path, bool]]) -> list[Import]:
    """Every import of one module of ``known`` by another."""
    found = []
    for module, (path, package) in known.items():
        here = module.split(".") if package else module.split(".")[:-1]
        for node, type_only in _statements(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
                origin = ".".join(p for p in (base, node.module or "") if p)
                names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
            for name in names:
                target = _named(name, known)
                if target is not None and target != module:
                    found.append(Import(module, target, node.lineno, type_only))
    return found


def layer_table(text: str) -> dict[str, tuple[int, str]]:
    """Module path prefix (dotted, from the package's name) -> (layer number, layer name), from
    the rows of the table in the architecture page (``| 1 | ops | `ops/` |``)."""
    table = {}
    for row in re.findall(r"^\|\s*(\d+|-)\s*\|([^|]+)\|([^|]+)\|", text, flags=re.M):
        number = UTILITIES if row[0] == "-" else int(row[0])
        for entry in re.findall(r"`([^`]+)`", row[2]):
            dotted = entry.removesuffix("/").removesuffix(".py").replace("/", ".")
            dotted = PACKAGE.name if dotted == "__init__" else f"{PACKAGE.name}.{dotted}"
            table[dotted + ("." if entry.endswith("/") else "")] = (number, row[1].strip())
    return table


def layer_of(module: str, table: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The layer of the longest entry that places ``module`` (a directory entry places what is in it)."""
    matches = [key for key in table if key == module or (key.endswith(".") and (module + ".").startswith(key))]
    return table[max(matches, key=len)] if matches else None


def arrows_up(edges: list[Import], table: dict) -> list[str]:
    found = []
    for edge in edges:
        source, target = layer_of(edge.source, table), layer_of(edge.target, table)
        if source is None or target is None or target[0] == UTILITIES:
            continue
        if source[0] == UTILITIES or target[0] > source[0]:
            found.append(f"{edge.source}:{edge.line} ({source[1]}) -> {edge.target} ({target[1]})")
    return found


def circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected groups of more than one module, over the imports that run."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if not edge.type_only:
            graph.setdefault(edge.source, set()).add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def report(root: Path = PACKAGE, architecture: Path = ARCHITECTURE) -> tuple[list[str], list[str], list[list[str]]]:
    """(modules with no layer, arrows up, circles)."""
    known = modules(root)
    table = layer_table(architecture.read_text())
    edges = imports(known)
    unplaced = [module for module in known if layer_of(module, table) is None]
    return unplaced, arrows_up(edges, table), circles(edges)


def test_every_module_has_a_layer():
    unplaced, _, _ = report()
    assert not unplaced, f"modules docs/architecture.md does not place: {unplaced}"


def test_no_import_runs_back_up_the_layer_order():
    _, up, _ = report()
    assert not up, "imports that run back up the layer order:\n" + "\n".join(up)


def test_no_circle_of_imports():
    _, _, found = report()
    assert not found, "circles of imports:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_ops_import_no_transformers():
    known = modules(PACKAGE)
    found = [
        f"{module}:{node.lineno}"
        for module, (path, _) in known.items()
        if module.startswith(f"{PACKAGE.name}.ops")
        for node, _ in _statements(ast.parse(path.read_text()))
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        if (name.split(".")[0] == "transformers" and not getattr(node, "level", 0))
    ]
    assert not found, f"ops/ imports transformers: {found}"


def test_the_check_finds_arrows_up_and_circles(tmp_path):
    """A made-up package with an arrow up inside a function, a circle, a circle through a type-only
    import (not one), and a module the table leaves out."""
    root = tmp_path / "transfuse"
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from ..high import b\n",
        "low/c.py": "from . import d\n",
        "low/d.py": "from .c import x\n",
        "low/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .f import y\n",
        "low/f.py": "from .e import z\n",
        "high/__init__.py": "",
        "high/b.py": "from ..low import c\nfrom .. import settings\n",
        "settings.py": "",
        "stray.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    architecture = tmp_path / "architecture.md"
    architecture.write_text(
        "| # | Layer | Modules |\n|---|---|---|\n| 1 | low | `low/` |\n| 2 | high | `high/`, `__init__.py` |\n"
        "| - | utilities | `settings.py` |\n"
    )
    unplaced, up, found = report(root, architecture)
    assert unplaced == ["transfuse.stray"]
    assert up == ["transfuse.low.a:2 (low) -> transfuse.high.b (high)"]
    assert found == [["transfuse.low.c", "transfuse.low.d"]]


if __name__ == "__main__":
    unplaced, up, found = report()
    print(f"{len(unplaced)} modules without a layer" + "".join(f"\n  {m}" for m in unplaced))
    print(f"{len(up)} imports up the layer order" + "".join(f"\n  {a}" for a in up))
    print(f"{len(found)} circles" + "".join(f"\n  {' <-> '.join(g)}" for g in found))
    sys.exit(1 if unplaced or up or found else 0)
