"""Small named predicates over libcst trees, for the proofs edits make before they change code.

The questions are few: which statement holds a node, which block holds that statement,
and between two statements, is a name rebound, mutated in place, or handed to a call
that could mutate it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import libcst as cst
import libcst.matchers as m

from .graph import NoMatch

__all__ = [
    "ParentMap",
    "assigned_names",
    "expression_code",
    "in_place_writes",
    "calls_taking",
    "comment_line",
    "dataclass_literal",
    "replace_nodes",
    "statement_block",
]


def expression_code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


class ParentMap:
    """Parents of every node under a root (libcst nodes do not point up)."""

    def __init__(self, root: cst.CSTNode):
        self.root = root
        self._parent: dict[cst.CSTNode, cst.CSTNode] = {}
        stack = [root]
        while stack:
            node = stack.pop()
            for child in node.children:
                self._parent[child] = node
                stack.append(child)

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._parent.get(node)

    def ancestors(self, node: cst.CSTNode):
        node = self._parent.get(node)
        while node is not None:
            yield node
            node = self._parent.get(node)

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement:
        """The innermost statement containing ``node``."""
        for ancestor in self.ancestors(node):
            if isinstance(ancestor, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                return ancestor
        raise NoMatch("source.placement", f"{expression_code(node)} is not inside a statement.")

    def in_nested_scope(self, node: cst.CSTNode) -> bool:
        """Inside a lambda, comprehension or nested function of the root."""
        nested = (cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp, cst.FunctionDef)
        return any(isinstance(a, nested) for a in self.ancestors(node) if a is not self.root)


def statement_block(parents: ParentMap, statement: cst.BaseStatement) -> tuple[cst.CSTNode, int]:
    """The block (an IndentedBlock) holding ``statement``, and the statement's index in it."""
    block = parents.parent(statement)
    if not isinstance(block, cst.IndentedBlock):
        raise NoMatch("source.placement", "the statement is not in an indented block.")
    return block, next(i for i, s in enumerate(block.body) if s is statement)


def assigned_names(statement: cst.CSTNode) -> set[str]:
    """Names a statement (re)binds: assignment targets, for/with/except targets, walrus, del, imports."""
    names: set[str] = set()
    targets = [
        *(t.target for a in m.findall(statement, m.Assign()) for t in a.targets),
        *(a.target for a in m.findall(statement, m.AnnAssign() | m.AugAssign())),
        *(f.target for f in m.findall(statement, m.For())),
        *(i.asname.name for i in m.findall(statement, m.WithItem()) if i.asname is not None),
        *(n.target for n in m.findall(statement, m.NamedExpr())),
        *(d.target for d in m.findall(statement, m.Del())),
    ]
    for target in targets:
        names |= {n.value for n in m.findall(target, m.Name())} if not isinstance(target, cst.Name) else {target.value}
    for handler in m.findall(statement, m.ExceptHandler()):
        if handler.name is not None:
            names |= {n.value for n in m.findall(handler.name, m.Name())}
    return names


def in_place_writes(statement: cst.CSTNode) -> list[str]:
    """Code that could change a tensor in place: augmented or item assignment, ``x.op_(...)`` calls."""
    found = [expression_code(a) for a in m.findall(statement, m.AugAssign())]
    found += [
        expression_code(t.target)
        for a in m.findall(statement, m.Assign())
        for t in a.targets
        if isinstance(t.target, (cst.Subscript, cst.Attribute))
    ]
    for call in m.findall(statement, m.Call(func=m.Attribute())):
        method = call.func.attr.value
        if method.endswith("_") and not method.endswith("__"):
            found.append(expression_code(call))
    return found


def calls_taking(statement: cst.CSTNode, name: str, exclude: tuple[cst.Call, ...] = ()) -> list[cst.Call]:
    """Calls in ``statement`` that receive the bare name ``name`` as an argument."""
    found = []
    for call in m.findall(statement, m.Call()):
        if any(call is e for e in exclude):
            continue
        if any(m.matches(arg.value, m.Name(name)) for arg in call.args):
            found.append(call)
    return found


class _Replace(cst.CSTTransformer):
    def __init__(self, replacements, insert):
        self.replacements = replacements
        self.insert = insert

    def on_leave(self, original_node, updated_node):
        for old, new in self.replacements:
            if original_node is old:
                return new(updated_node) if callable(new) else new
        if self.insert is not None and original_node is self.insert[0]:
            block, index, statements = self.insert
            body = list(updated_node.body)
            return updated_node.with_changes(body=body[:index] + list(statements) + body[index:])
        return updated_node


def replace_nodes(
    tree: cst.CSTNode,
    replacements: list[tuple[cst.CSTNode, cst.CSTNode | Callable[[cst.CSTNode], cst.CSTNode]]],
    insert: tuple[cst.IndentedBlock, int, list[cst.BaseStatement]] | None = None,
) -> cst.CSTNode:
    """``tree`` with each old node (found by identity) replaced, and statements inserted into a block.

    A replacement is a node, or a function of the old node as updated by the replacements
    below it (to edit a statement whose inner call was also replaced).
    """
    return tree.visit(_Replace(replacements, insert))


def comment_line(text: str) -> cst.EmptyLine:
    return cst.EmptyLine(comment=cst.Comment(f"# {text}"))


def dataclass_literal(value: Any, name_of: Callable[[type], str], indent: str = "    ") -> str:
    """Python that builds ``value`` (dataclasses, tuples, plain constants): each dataclass as a call
    with the fields that differ from their defaults, ``name_of(cls)`` naming it; the outermost
    call's fields on lines of their own."""

    def literal(v: Any) -> str:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return f"{name_of(type(v))}({', '.join(_fields(v))})"
        if isinstance(v, tuple):
            items = [literal(x) for x in v]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if isinstance(v, float) and not math.isfinite(v):
            return f'float("{v}")'
        if v is None or isinstance(v, (bool, int, float, str)):
            return repr(v)
        raise TypeError(f"dataclass_literal: no literal writes a {type(v).__name__}.")

    def _fields(v: Any) -> list[str]:
        out = []
        for f in dataclasses.fields(v):
            current = getattr(v, f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING
            )  # fmt: skip
            if default is dataclasses.MISSING or current != default:
                out.append(f"{f.name}={literal(current)}")
        return out

    if not (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return literal(value)
    fields = "".join(f"\n{indent}{field}," for field in _fields(value))
    return f"{name_of(type(value))}({fields}\n)" if fields else f"{name_of(type(value))}()"
