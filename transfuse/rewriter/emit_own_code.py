"""A checkpoint's own code (``auto_map`` classes, which transformers loads into its modules cache,
``transformers_modules.<...>``) in an emitted directory: emitted beside the other files, never
imported from the cache.

``own_modules`` finds the modules of that code an emitted directory needs: those holding the model's
classes or its configuration, and every module of the same code they import relatively, again and
again. Each is emitted as a file of the directory (rewritten where it holds fused classes), and
its relative imports stay relative. ``redirected`` points an import of a name that an emitted file
defines (``from transformers import LlamaForCausalLM`` in a file that subclasses it, with the llama
classes fused) at that file, so that the emitted class derives from the fused one.
"""

from __future__ import annotations

import sys

import libcst as cst

__all__ = ["absolute_module", "is_own_code", "own_modules", "redirected"]


def absolute_module(module_name: str, relative: cst.ImportFrom) -> str:
    """The absolute module a relative ``from ...x import y`` in ``module_name`` refers to."""
    level = len(relative.relative)
    package = module_name.rsplit(".", level)[0]
    tail = cst.Module(body=[]).code_for_node(relative.module) if relative.module is not None else ""
    return f"{package}.{tail}" if tail else package


def is_own_code(module_name: str) -> bool:
    """Whether the module is a checkpoint's own code, as transformers loaded it into its modules cache."""
    from transformers.utils import TRANSFORMERS_DYNAMIC_MODULE_NAME

    return module_name.split(".")[0] == TRANSFORMERS_DYNAMIC_MODULE_NAME


def _relative_targets(module_name: str) -> list[str]:
    """The modules that ``module_name``'s relative imports name (loaded ones)."""
    module = sys.modules[module_name]
    with open(module.__file__, encoding="utf-8") as f:
        tree = cst.parse_module(f.read())
    found = []

    class Imports(cst.CSTVisitor):
        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            if not node.relative:
                return
            target = absolute_module(module_name, node)
            if node.module is None and not isinstance(node.names, cst.ImportStar):  # from . import a, b
                found.extend(f"{target}.{cst.Module(body=[]).code_for_node(a.name)}" for a in node.names)
            else:
                found.append(target)

    tree.visit(Imports())
    return [name for name in found if name in sys.modules]


def own_modules(module_names, config_module: str) -> list[str]:
    """The modules of the checkpoint's own code to emit besides ``module_names`` (see the module
    docstring), in the order found."""
    queue = [name for name in [*module_names, config_module] if is_own_code(name)]
    found: list[str] = []
    while queue:
        name = queue.pop(0)
        if name in found:
            continue
        found.append(name)
        queue += [t for t in _relative_targets(name) if is_own_code(t) and t not in found]
    return [name for name in found if name not in module_names]


def _emitted_home(module, name: str, emitted: dict[str, str]) -> str | None:
    """The emitted file stem that defines what ``module.name`` is, if one does."""
    value = getattr(module, name, None)
    home = getattr(value, "__module__", None)
    if home not in emitted or home == module.__name__ or getattr(sys.modules[home], getattr(value, "__name__", ""), None) is not value:
        return None
    return emitted[home]


def redirected(line: cst.SimpleStatementLine, absolute: str, emitted: dict[str, str]) -> list[cst.SimpleStatementLine] | None:
    """``from <absolute> import ...`` split so that names an emitted file defines come from it (``from
    .stem import name``); None when no name does."""
    node = line.body[0]
    module = sys.modules.get(absolute)
    if module is None or isinstance(node.names, cst.ImportStar):
        return None
    homes = [(alias, _emitted_home(module, cst.Module(body=[]).code_for_node(alias.name), emitted)) for alias in node.names]
    if all(home is None for _, home in homes):
        return None
    kept = [alias.with_changes(comma=cst.MaybeSentinel.DEFAULT) for alias, home in homes if home is None]
    lines = [line.with_changes(body=[node.with_changes(names=kept, lpar=None, rpar=None)])] if kept else []
    for stem in dict.fromkeys(home for _, home in homes if home is not None):
        names = [alias.with_changes(comma=cst.MaybeSentinel.DEFAULT) for alias, home in homes if home == stem]
        moved = node.with_changes(relative=[cst.Dot()], module=cst.Name(stem), names=names, lpar=None, rpar=None)
        lines.append(cst.SimpleStatementLine(body=[moved]))
    return [lines[0].with_changes(leading_lines=line.leading_lines), *lines[1:]]
